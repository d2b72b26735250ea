"""The only part of muonckpt that touches files: safetensors read/write, atomic text writes,
and the directory transaction that puts a checkpoint in place.

Where a checkpoint's bytes go is behind one seam, :class:`CheckpointStore`
(:mod:`.backend`): create a staging directory, write a file durably, publish the staging
directory at its target atomically, list, and remove only muonckpt's own (what a publish
replaced, a staging directory never published, a checkpoint ``keep_last`` no longer keeps).
Each entry point writes through the store of its target (:func:`store_for`: a
:class:`~.backend.PosixStore`), whose operations are those of :mod:`.durable` and
:mod:`.transaction` (fsync before every rename, the atomic swap, the lease, the ownership
rules); an ``s3://`` target's, an :class:`~.s3store.S3Store` (the manifest the commit, by
one conditional write); reading stays with the readers below.

One module per concern; this package re-exports what the rest of muonckpt uses, so callers
write ``storage.X``:

* :mod:`.backend`: the storage seam, :class:`CheckpointStore` and :class:`~.backend.PosixStore`.
* :mod:`.dtypes`: safetensors dtype strings, their sizes and torch dtypes; tensors as bytes.
* :mod:`.checksums`: the XXH3 checksum of each chunk of a tensor's data.
* :mod:`.durable`: fsync, atomic text writes, positional write loops, small reads, libc shims.
* :mod:`.safetensors_format`: the file format's limits and :class:`TensorRecord`.
* :mod:`.safetensors_header`: a file's header parsed and checked, into compact records.
* :mod:`.safetensors_reader` / :mod:`.safetensors_writer`: reading and writing the files.
* :mod:`.reader_cache`: open readers, a bounded number at a time (LRU).
* :mod:`.checkpoint_files`: the read seam of a whole checkpoint, :class:`CheckpointFiles`: a
  local directory's files, or an S3 prefix's objects (manifest, indexes, data by ranged GETs),
  chosen from the place (:func:`location`: a local path or an ``s3://`` URL).
* :mod:`.transaction`: staging, swap-in, retiring and discarding checkpoint directories,
  deleting old checkpoints.
* :mod:`.ownership`: the rules of what may be replaced or deleted (muonckpt's own only), a
  target checked before a write.
* :mod:`.lease`: the file marking each directory muonckpt makes beside a target as its own,
  locked and refreshed while in use (what ``clean`` goes by, never names alone).
* :mod:`.node_local`: the node-local tier's files: a node's staging directory, a file copied
  to a peer in chunks and received checked.
* :mod:`.mailbox`: the mailbox directories background saves of earlier versions left (for
  ``clean``).
* :mod:`.access`: what the layers above ask of paths (is it there, a directory's names, a
  new file to write into, directories made), so that no module outside ``storage/`` opens
  files (``tests/test_file_access.py``).
* :mod:`.torch_pickles` / :mod:`.foreign_limits`: every foreign ``torch.save`` file read by one
  restricted loader, under one set of limits.

torch is imported only where a tensor crosses (the dtype conversions, reading a tensor,
writing one), so that the single-process offline tools run without it. Nothing here imports
the collective or checkpoint layers.
"""

from __future__ import annotations

from .backend import CheckpointStore, store_for
from .checkpoint_files import CheckpointFiles, files_at
from .checksums import CHUNK_BYTES, checksum_chunks, chunk_digest
from .dtypes import byte_view, dtype_name, itemsize, tensor_of_bytes, torch_dtype, unstorable_kind
from .durable import (
    MAX_TEXT_BYTES,
    entries,
    file_size,
    fsync_dir,
    make_directory,
    read_small,
    read_text,
    read_text_chunks,
    sync_files,
    write_texts_durably,
)
from .lease import leftover
from .mailbox import is_mailbox, remove_mailbox
from .model_weights import ModelWeights
from .node_local import (
    Digest,
    NodeStore,
    ReceivedFile,
    file_chunks,
    mark_node,
    nodes_marked,
    present,
)
from .ownership import check_target, is_ours, ownership_problem
from .places import Location, location, resolved_place
from .reader_cache import ReaderCache
from .s3 import S3Client, S3Url
from .safetensors_format import TensorRecord
from .safetensors_reader import SafetensorsReader
from .safetensors_writer import SafetensorsWriter, SharedSafetensorsFile
from .transaction import remove_checkpoint, watch_commit

__all__ = [
    "CHUNK_BYTES",
    "MAX_TEXT_BYTES",
    "CheckpointFiles",
    "CheckpointStore",
    "Digest",
    "Location",
    "ModelWeights",
    "NodeStore",
    "ReaderCache",
    "ReceivedFile",
    "S3Client",
    "S3Url",
    "SafetensorsReader",
    "SafetensorsWriter",
    "SharedSafetensorsFile",
    "TensorRecord",
    "byte_view",
    "check_target",
    "checksum_chunks",
    "chunk_digest",
    "dtype_name",
    "entries",
    "file_chunks",
    "file_size",
    "files_at",
    "fsync_dir",
    "is_mailbox",
    "is_ours",
    "itemsize",
    "leftover",
    "location",
    "make_directory",
    "mark_node",
    "nodes_marked",
    "ownership_problem",
    "present",
    "read_small",
    "read_text",
    "read_text_chunks",
    "remove_checkpoint",
    "remove_mailbox",
    "resolved_place",
    "store_for",
    "sync_files",
    "tensor_of_bytes",
    "torch_dtype",
    "unstorable_kind",
    "watch_commit",
    "write_texts_durably",
]
