"""The checkpoint manifest: versioned dataclasses, their JSON text and coverage checks (read
and schema-checked by :mod:`muonckpt.format.manifest_json`). File names and tensor keys are
:mod:`.names`; renaming params, :mod:`.renames`; the text's size bound, :mod:`.manifest_size`.

Pure: no tensors, no collectives, no file I/O. ``manifest.json`` is written last by a save and
is its commit marker; docs/format.md specifies every field.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from array import array
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..errors import ArgumentError, CheckpointError
from ..layout.state_shapes import StateShape
from .coverage import shared_tensors, tensor_coverage
from .kinds import UNKNOWN
from .names import PARAM_KEY
from .records import (  # the records, named here too
    DIGEST_BYTES,
    DTYPE_BYTES,
    FileEntry,
    GroupEntry,
    IndexEntry,
    ModelFile,
    ParamEntry,
    Piece,
    PieceTable,
    Scalar,
    Spans,
    ValuePath,
    pack_checksums,
    tuple_paths,
    unpack_checksums,
    with_tuples,
)
from .renames import Rename, renamer

FORMAT_NAME = "muonckpt"
DATA_PREFIX = re.compile(r"(s-[0-9a-f]{16}/)?")
"""What a manifest's ``data_prefix`` may be (whole): none, or one save prefix: a manifest
cannot name a file outside its checkpoint."""
FORMAT_VERSION = 5
"""Version 5 records the environment the save ran in (``environment``: what a bitwise resume
depends on, :data:`ENVIRONMENT_KEYS`) and may name a ``data_prefix`` (a checkpoint committed
to object storage); version 4 writes each param's name as the characters it shares with the
previous param's name and the rest (a Kimi-K2-shaped model's 70k names of 75 characters:
5.9 MB -> 2.1 MB of the top level every loading rank reads); version 3 moved the pieces out
of ``manifest.json`` into one piece index per data file (:mod:`.piece_index`), the params
into a table of their kinds; version 2 added the params' own values (``value_dtype``, pieces
of key :data:`PARAM_KEY`); versions 1 to 4 are still read (version 1 holds optimizer state
only)."""
PREFIXED_VERSION = 5
"""The first version whose manifest may name a ``data_prefix`` (a checkpoint committed to
object storage, or copied from there: its files are under a save prefix beside the manifest),
so that a reader that knows no ``data_prefix`` refuses it rather than looking beside the
manifest."""
ENVIRONMENT_KEYS = (
    "torch",
    "device",
    "intra_op_threads",
    "inter_op_threads",
    "OMP_NUM_THREADS",
    "deterministic_algorithms",
    "deterministic_warn_only",
    "cudnn_deterministic",
    "cudnn_benchmark",
    "float32_matmul_precision",
)
"""What a version 5 save records of the environment it ran in (``environment``, on the saving
root): what the bitwise equality of a resumed run with an uninterrupted one depends on besides
the state itself (the dtype of each state tensor as the optimizer held it is each param's
``dtypes``). A load under another compares them (:func:`environment_differences`)."""
__all__ = [  # the records re-exported; every name defined here is public too
    "DIGEST_BYTES",
    "DTYPE_BYTES",
    "FileEntry",
    "GroupEntry",
    "IndexEntry",
    "ModelFile",
    "ParamEntry",
    "Piece",
    "PieceTable",
    "Scalar",
    "Spans",
    "ValuePath",
    "pack_checksums",
    "tuple_paths",
    "unpack_checksums",
    "with_tuples",
]

CHECKSUM_ALGORITHM = "xxh3-64"
"""XXH3 64-bit (seed 0) of each chunk of a tensor's data, as 16 lowercase hex digits."""
MAX_CHUNK_BYTES = 64 << 20
"""The largest checksum chunk a reader accepts (the writer's is 4 MiB): a chunk is read whole
to be verified, so this bounds what verify and load hold of one tensor at once."""
PER_RANK = "per-rank"
CONSOLIDATED = "consolidated"
KINDS = (PER_RANK, CONSOLIDATED)

EXTRA_DEPTH = 24
"""How deeply ``extra`` values and hyperparameters (:func:`json_safe`) may nest (the
manifest around them takes the rest of :data:`muonckpt.format.strict_json.MAX_JSON_DEPTH`)."""
EXTRA_JSON_BYTES = 16 << 20
"""The most bytes of JSON one save's ``extra`` and ``rank_extra`` values may take in the
manifest; larger data goes in tensors."""


def chunk_bytes_of(value: Any) -> int:
    """``value`` as a checksum chunk size a reader accepts, an int from 1 to
    :data:`MAX_CHUNK_BYTES`; :class:`CheckpointError` otherwise."""
    if type(value) is not int or not 0 < value <= MAX_CHUNK_BYTES:
        raise CheckpointError(f"chunk_bytes {value!r} is not from 1 to {MAX_CHUNK_BYTES}")
    return value


@dataclass(frozen=True)
class ExtraTensor:
    """One tensor of the training job's own state: where it goes in its values, and where it
    is stored (a whole safetensors tensor, at its shape)."""

    path: ValuePath
    file: str
    tensor: str
    """Key of the tensor inside the safetensors file."""
    dtype: str
    shape: tuple[int, ...]
    checksums: tuple[str, ...]
    chunk_bytes: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class ExtraValues:
    """A tree of values (``extra`` or one rank's ``rank_extra``): JSON, with ``null`` at each
    tensor's path, and the tensors."""

    values: Any
    tensors: tuple[ExtraTensor, ...] = ()


@dataclass(frozen=True)
class Extra:
    """The training job's own state, saved in the same commit as the optimizer's."""

    shared: ExtraValues | None
    """``extra``: the values every rank gave alike (None: not saved)."""
    ranks: tuple[ExtraValues, ...]
    """``rank_extra``: each saving rank's own values, in grid order (empty: not saved)."""
    files: tuple[FileEntry, ...]
    """The safetensors files holding the tensors of both."""

    def trees(self) -> list[tuple[str, ExtraValues]]:
        """Every tree, named as errors name it (``extra``, ``rank_extra[3]``)."""
        named = [("extra", self.shared)] if self.shared is not None else []
        return named + [(f"rank_extra[{r}]", tree) for r, tree in enumerate(self.ranks)]

    def tensors(self) -> list[ExtraTensor]:
        return [t for _, tree in self.trees() for t in tree.tensors]


@dataclass(frozen=True)
class Manifest:
    """Everything needed to read, verify and reshard a checkpoint without the optimizer."""

    kind: str
    topology: dict[str, int]
    """Source topology: ``{"dp": .., "tp": ..}``."""
    groups: tuple[GroupEntry, ...]
    params: tuple[ParamEntry, ...]
    files: tuple[FileEntry, ...]
    pieces: Sequence[Piece]
    format_version: int = FORMAT_VERSION
    checksum_algorithm: str = CHECKSUM_ALGORITHM
    model: ModelFile | None = None
    """A consolidated save's model tensors beyond the optimizer's params (None: none)."""
    recorded_step: int | None = None
    """The training step the save recorded (``"step"``): ``extra["step"]`` when given, else
    the optimizer's own count where it keeps one; None: unknown (and in older manifests)."""
    extra: Extra | None = None
    """The training job's own state (``"extra"``); None: none was saved."""
    indexes: tuple[IndexEntry, ...] = ()
    """(version 3) The piece index of each data file holding pieces, as read or committed."""
    complete: bool = True
    """Whether :attr:`pieces` holds every piece (False: a version 3 manifest read with only
    some of its indexes, or none, as a load reads it: coverage is then not checked here)."""
    stored_names: tuple[str, ...] = ()
    """(a renamed manifest) The params' names as stored, by position: what a piece index's
    default tensor keys are made from. Empty: the names are as stored."""
    environment: Mapping[str, Any] | None = None
    """(version 5) The environment the save ran in, :data:`ENVIRONMENT_KEYS` (None: not
    recorded: an older version, or a checkpoint written from a foreign one)."""
    data_prefix: str = ""
    """(version 5: a checkpoint committed to object storage) Where the files it names are,
    relative to the manifest: ``""``, beside it, or ``"s-<16 hex>/"``, the save prefix of the
    save that wrote it (:data:`DATA_PREFIX`)."""
    replicas: Mapping[str, Any] | None = None
    """(version 5: a step of the node-local tier) Where each rank's files are: ``nodes``,
    each rank's node, and ``holders``, for each rank the ranks whose nodes keep a copy of its
    files (:func:`muonckpt.format.manifest_json.replica_placement`); None: not a local step."""
    dcp_layout: str = ""
    """(version 5: a checkpoint converted from PyTorch DCP) The layout the DCP checkpoint was
    read as (``recipe``, ``torchtitan``), what a conversion back to DCP writes by default, so
    that the round trip gives the layout it started from; ``""``: none recorded."""
    zero_stage: int = 0
    """(version 5: a checkpoint converted from DeepSpeed) The ZeRO stage its files were
    written at (1, 2 or 3), what a conversion back to DeepSpeed writes by default; 0: none
    recorded."""
    split_experts: tuple[str, ...] = ()
    """(version 5: a conversion with ``--split-experts``) The stacked params written as one
    param per matrix, ``<name>.0`` ... ``<name>.<E-1>``, sorted: what a conversion back to DCP
    stacks again (:func:`muonckpt.format.stacked.merged_experts`); empty: none recorded."""

    def param(self, name: str) -> ParamEntry:
        by_name: dict[str, ParamEntry] | None = self.__dict__.get("_by_name")
        if by_name is None:  # made when first asked: a rewrite's output manifest never is
            by_name = {entry.name: entry for entry in self.params}
            object.__setattr__(self, "_by_name", by_name)
        entry = by_name.get(name)
        if entry is None:
            raise CheckpointError("no such param in the checkpoint", param=name)
        return entry

    def renamed(self, rename: Rename) -> Manifest:
        """The same checkpoint with its params renamed (:data:`Rename`); the stored tensors
        keep their keys in the files. Two params given one name are refused, naming both."""
        fn = renamer(rename)
        names: dict[str, str] = {}
        model = self.model
        for entry in self.params + (model.tensors if model is not None else ()):
            new = fn(entry.name)
            if not isinstance(new, str) or not new:
                raise ArgumentError(
                    f"rename gave {new!r}, not a name", argument="rename", param=entry.name
                )
            names[entry.name] = new
        seen: dict[str, str] = {}
        for old, new in names.items():
            if new in seen:
                raise ArgumentError(
                    f"rename gives params {seen[new]!r} and {old!r} one name {new!r}",
                    argument="rename",
                )
            seen[new] = old
        if model is not None:
            aliases = {str(fn(alias)): names[stored] for alias, stored in model.aliases.items()}
            model = ModelFile(
                tuple(replace(t, name=names[t.name]) for t in model.tensors),
                tuple(replace(p, param=names[p.param]) for p in model.pieces),
                aliases,
            )
        return replace(
            self,
            stored_names=self.stored_names or tuple(e.name for e in self.params),
            model=model,
            groups=tuple(replace(g, params=tuple(names[n] for n in g.params)) for g in self.groups),
            params=tuple(replace(e, name=names[e.name]) for e in self.params),
            pieces=PieceTable(replace(p, param=names[p.param]) for p in self.pieces),
            split_experts=self._renamed_splits({e.name: names[e.name] for e in self.params}),
        )

    def _renamed_splits(self, names: Mapping[str, str]) -> tuple[str, ...]:
        """:attr:`split_experts` after a rename of the params (``names``: old to new): a
        split whose matrices keep their ``.<e>`` under one new stem is recorded by it, any
        other is no longer a split to stack again."""
        kept = set()
        for stem in self.split_experts:
            parts = [(old, new) for old, new in names.items() if old.rpartition(".")[0] == stem]
            stems = {new.rpartition(".")[0] for _, new in parts}
            same = all(old.rpartition(".")[2] == new.rpartition(".")[2] for old, new in parts)
            if len(stems) == 1 and same:
                kept |= stems
        return tuple(sorted(kept))

    def step_of(self, entry: ParamEntry) -> int | float | None:
        """The step count the checkpoint holds for a param: its own scalar (torch and
        KellerJordan AdamW count per param), else its group's."""
        if "step" in entry.scalars:
            value = entry.scalars["step"].value
            return value if isinstance(value, int | float) else None
        return self.groups[entry.group].hyperparams.get("step")

    def latest_step(self, names: Iterable[str]) -> int | None:
        """The largest step count of the named params (None: none has one)."""
        steps = [s for s in (self.step_of(self.param(n)) for n in names) if s is not None]
        return int(max(steps)) if steps else None

    @property
    def has_values(self) -> bool:
        """Whether the params' own values were saved (every param's, or none)."""
        return bool(self.params) and all(e.value_dtype is not None for e in self.params)

    def pieces_of(self) -> PieceIndex:
        """Pieces grouped by (param, state key)."""
        return PieceIndex(self.pieces)

    @property
    def group_step(self) -> int | None:
        """The largest of the groups' step counters (the packaged Muon's AdamW groups)."""
        steps = [g.hyperparams["step"] for g in self.groups if "step" in g.hyperparams]
        return max(steps) if steps else None

    @property
    def step(self) -> int | None:
        """The training step the checkpoint holds: the step its save recorded (the manifest's
        ``"step"``: ``extra["step"]``, or the optimizer's count), else its groups' counter,
        else the largest of its params' own counts (torch's AdamW counts per param); None when
        it records none."""
        if self.recorded_step is not None:
            return self.recorded_step
        if self.group_step is not None:
            return self.group_step
        try:
            return self.latest_step(entry.name for entry in self.params)
        except (TypeError, ValueError, OverflowError):  # a "step" scalar that is not a number
            return None

    def digest(self) -> str:
        """A short hash of :meth:`to_json`: what the ranks of one load (or offline tool)
        compare to know they read one checkpoint."""
        digest = hashlib.blake2b(digest_size=8)
        for chunk in self.json_chunks():
            digest.update(chunk.encode())
        return digest.hexdigest()

    def to_json(self) -> str:
        """The manifest as written: one compact JSON line per group, param, file and piece
        (readable, and half the size of indented JSON: 100k params fit the 100 MB limit)."""
        return "".join(self.json_chunks())

    def _version_5_fields(self) -> dict[str, Any]:
        """The optional top-level fields of version 5 this manifest has."""
        body: dict[str, Any] = {}
        if self.data_prefix:
            body["data_prefix"] = self.data_prefix
        if self.dcp_layout:
            body["dcp_layout"] = self.dcp_layout
        if self.zero_stage:
            body["zero_stage"] = self.zero_stage
        if self.split_experts:
            body["split_experts"] = list(self.split_experts)
        if self.environment is not None and self.format_version >= 5:
            body["environment"] = dict(self.environment)
        if self.replicas is not None:
            body["replicas"] = dict(self.replicas)
        return body

    def json_chunks(self) -> Iterator[str]:
        """The text of :meth:`to_json` in consecutive pieces, each line made as it is asked
        for (the text of 100k params is 89 MB: written or hashed so, it is never whole).

        Built field by field: ``dataclasses.asdict`` deep-copies every value, seconds at 100k
        params."""
        version = self.written_version()
        if version < PREFIXED_VERSION and self.needs_v5():  # an older version asked for
            older = replace(
                self,
                groups=tuple(
                    replace(g, tuples=(), optimizer=version_4_optimizer(g.optimizer))
                    for g in self.groups
                ),
                params=tuple(replace(e, state_shapes={}) for e in self.params),
                dcp_layout="",
                zero_stage=0,
                replicas=None,
                split_experts=(),
            )
            yield from older.json_chunks()
            return
        v3 = self.format_version >= 3
        kinds: dict[str, int] = {}  # each kind's JSON text -> its position
        group = _group_to_json if not v3 else _group_v3
        param: Callable[[ParamEntry], Any] = param_to_json
        if v3:
            param = _Params(kinds, front_coded=self.format_version >= 4).line
        lists: dict[str, tuple[Sequence[Any], Callable[[Any], Any]]] = {
            "groups": (self.groups, group),
            "params": (self.params, param),
            "files": (self.files, _file_to_json),
        }
        if v3:
            lists["indexes"] = (self.indexes, _index_to_json)
        else:
            lists["pieces"] = (self.pieces, piece_to_json)
        body: dict[str, Any] = {
            "format": FORMAT_NAME,
            "kind": self.kind,
            "topology": dict(self.topology),
            **dict.fromkeys(lists),
            "format_version": version,
            "checksum_algorithm": self.checksum_algorithm,
            "step": self.recorded_step,
            "extra": None if self.extra is None else extra_to_json(self.extra),
        }
        body.update(self._version_5_fields())
        if self.model is not None:
            body["model"] = {
                "tensors": [
                    {"name": e.name, "shape": list(e.shape), "dtype": e.value_dtype}
                    for e in self.model.tensors
                ],
                "pieces": [piece_to_json(p) for p in self.model.pieces],
                "aliases": dict(self.model.aliases),
            }
        yield "{\n"
        for index, (key, value) in enumerate(body.items()):
            yield (",\n" if index else "") + compact_json(key) + ": "
            items, to_json = lists.get(key, ((), compact_json))
            if not items:
                yield compact_json([] if key in lists else value)
                continue
            yield "[\n"
            for number, item in enumerate(items):
                yield (",\n" if number else "") + compact_json(to_json(item))
            yield "\n]"
        if v3:  # after params: the kinds their lines name
            yield ',\n"param_kinds": [\n' + ",\n".join(kinds) + "\n]"
        yield "\n}\n"

    def written_version(self) -> int:
        """The version its text says: :data:`PREFIXED_VERSION` where it holds a field of it
        (:meth:`needs_v5`) and is of the current version (an older version asked for is
        written without them), else :attr:`format_version`."""
        current = self.format_version >= FORMAT_VERSION and self.needs_v5()
        return PREFIXED_VERSION if self.data_prefix or current else self.format_version

    def needs_v5(self) -> bool:
        """Whether it holds a field of version :data:`PREFIXED_VERSION`: ``data_prefix``,
        ``dcp_layout``, ``zero_stage``, ``replicas``, ``split_experts``, a state tensor not shaped
        like its param, a setting that was a tuple."""
        return (
            bool(self.data_prefix or self.dcp_layout or self.zero_stage or self.replicas)
            or bool(self.split_experts)
            or any(e.state_shapes for e in self.params)
            or any(g.tuples or has_version_5_optimizer(g.optimizer) for g in self.groups)
        )

    def coverage_problems(self, names: Iterable[str] | None = None) -> list[str]:
        """Gaps, overlaps, stray pieces and pieces sharing a stored tensor: every stored tensor
        must hold each element once (:func:`.coverage.tensor_coverage`), each piece in a tensor
        of its own (:func:`.coverage.shared_tensors`). With ``names``, the coverage of those
        params alone (a load's share, whose pieces the manifest holds all of: the indexes
        holding any of them were read) and no two of the pieces held naming one tensor (every
        piece of each data file they are in: one index lists a file's pieces); else of every
        param and model tensor, and nothing is checked of a manifest holding only some of its
        pieces."""
        everything = names is None
        if everything and not self.complete:
            return []
        wanted = set() if names is None else set(names)
        params = self.params if everything else [e for e in self.params if e.name in wanted]
        mixed = values_problem(self.params) if everything else None
        problems = [] if mixed is None else [mixed]
        grouped, covered = self.pieces_of(), 0
        for entry in params:
            for key in entry.tensor_keys:
                pieces = grouped[entry.name, key]
                covered += len(pieces)
                problems += tensor_coverage(entry, key, pieces)
        if not everything:
            return problems + shared_tensors(self.pieces)
        problems += shared_tensors(self.pieces, self.model.pieces if self.model else ())
        if self.model is not None:
            held = defaultdict(list)
            for piece in self.model.pieces:
                held[piece.param].append(piece)
            for entry in self.model.tensors:
                problems += tensor_coverage(entry, PARAM_KEY, held.get(entry.name, []))
        if covered != len(self.pieces):  # pieces of tensors that no param lists
            listed = {(entry.name, key) for entry in self.params for key in entry.tensor_keys}
            strays = dict.fromkeys((p.param, p.key) for p in self.pieces)
            problems += [
                f"piece of param {param!r} state {key!r} that the manifest's params do not list"
                for param, key in strays
                if (param, key) not in listed
            ]
        return problems


def all_files(manifest: Manifest) -> tuple[FileEntry, ...]:
    """The data files of the optimizer's state and params, then those of ``extra``."""
    return manifest.files + (manifest.extra.files if manifest.extra is not None else ())


class PieceIndex:
    """The pieces of each stored tensor, by (param, key); a tensor that none holds has none.

    One dict per key, of each param's piece row in ``pieces`` (or rows, in an array, where
    several pieces hold it), and the pieces of ``more`` themselves: most tensors have one, and
    a dict of (param, key) tuples and lists took 55 MB at 100k params. Rows, not pieces, so
    that a :class:`PieceTable` of a million pieces is not made into a million objects at once
    (nor rows into a million ints in lists)."""

    __slots__ = ("_by_key", "_more", "_pieces")

    def __init__(self, pieces: Sequence[Piece], more: Iterable[Piece] = ()) -> None:
        self._pieces = pieces
        self._by_key: dict[str, dict[str, int | array[int]]] = {}
        for row, piece in enumerate(pieces):
            by_param = self._by_key.setdefault(piece.key, {})
            found = by_param.get(piece.param)
            if found is None:
                by_param[piece.param] = row
            elif isinstance(found, array):
                found.append(row)
            else:
                by_param[piece.param] = array("q", (found, row))
        self._more: dict[tuple[str, str], list[Piece]] = {}
        for piece in more:
            self._more.setdefault((piece.param, piece.key), []).append(piece)

    def __getitem__(self, tensor: tuple[str, str]) -> Sequence[Piece]:
        param, key = tensor
        found = self._by_key.get(key, {}).get(param)
        rows = () if found is None else (found,) if isinstance(found, int) else found
        return (*map(self._pieces.__getitem__, rows), *self._more.get(tensor, ()))


def compact_json(value: Any) -> str:
    """``value`` as the manifest writes it: JSON without spaces, finite numbers only."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def _group_to_json(g: GroupEntry) -> dict[str, Any]:
    tuples = {"tuples": [list(path) for path in g.tuples]} if g.tuples else {}
    return {
        "hyperparams": g.hyperparams,
        "params": list(g.params),
        "optimizer": g.optimizer,
        **tuples,
    }


def param_to_json(e: ParamEntry) -> dict[str, Any]:
    """A :class:`ParamEntry` in its JSON form (one line of ``params``)."""
    return {
        "name": e.name,
        "shape": list(e.shape),
        "tp_split_dim": e.tp_split_dim,
        "group": e.group,
        "dtypes": dict(e.dtypes),
        "scalars": {k: {"value": v.value, "dtype": v.dtype} for k, v in e.scalars.items()},
        **({"state_shapes": state_shapes_to_json(e.state_shapes)} if e.state_shapes else {}),
    }


def has_version_5_optimizer(optimizer: Mapping[str, Any]) -> bool:
    """Whether a group's ``optimizer`` holds a value of version 5: a ``compute_view``, the
    ``momentum_form`` ``unknown``."""
    return optimizer.get("compute_view") is not None or optimizer.get("momentum_form") == UNKNOWN


def version_4_optimizer(optimizer: dict[str, Any]) -> dict[str, Any]:
    """A group's ``optimizer`` as version 4 writes it: no ``compute_view``, an ``unknown``
    momentum form unrecorded."""
    if not has_version_5_optimizer(optimizer):
        return optimizer
    older = {k: v for k, v in optimizer.items() if k != "compute_view"}
    if older.get("momentum_form") == UNKNOWN:
        older["momentum_form"] = None
    return older


def state_shapes_to_json(shapes: Mapping[str, StateShape]) -> dict[str, Any]:
    """A param's :attr:`ParamEntry.state_shapes` in their JSON form (version 5)."""
    return {k: {"rule": v.rule, "shape": list(v.shape)} for k, v in shapes.items()}


def _file_to_json(f: FileEntry) -> dict[str, Any]:
    return {"name": f.name, "bytes": f.bytes}


def _group_v3(g: GroupEntry) -> dict[str, Any]:
    """A group in version 3: its params are those whose kind names it, in order; version 5:
    with ``tuples`` where a setting held a tuple."""
    return {k: v for k, v in _group_to_json(g).items() if k != "params"}


class _Params:
    """The lines of ``params`` from version 3: ``[name, kind]`` (version 4: ``[shared, rest,
    kind]``, the name the first ``shared`` characters of the previous param's name and then
    ``rest``, :func:`front_coded`), the kind (everything but the name) a position in
    ``param_kinds``; ``kinds`` collects them (as their JSON, whose order is the table's)."""

    def __init__(self, kinds: dict[str, int], *, front_coded: bool) -> None:
        self.kinds, self.front_coded, self.previous = kinds, front_coded, ""

    def line(self, e: ParamEntry) -> list[Any]:
        fields = param_to_json(e)
        del fields["name"]
        kind = self.kinds.setdefault(compact_json(fields), len(self.kinds))
        if not self.front_coded:
            return [e.name, kind]
        shared, self.previous = front_coded(self.previous, e.name), e.name
        return [shared, e.name[shared:], kind]


def front_coded(previous: str, name: str) -> int:
    """How many leading characters ``name`` shares with ``previous`` (version 4's params)."""
    shared = 0
    for a, b in zip(previous, name, strict=False):
        if a != b:
            break
        shared += 1
    return shared


def _index_to_json(i: IndexEntry) -> dict[str, Any]:
    return {
        "name": i.name,
        "file": i.file,
        "bytes": i.bytes,
        "checksum": i.checksum,
        "pieces": i.pieces,
        "params": [list(span) for span in i.params],
    }


def values_problem(params: Sequence[ParamEntry]) -> str | None:
    """A checkpoint saves the params' own values for all of them or for none."""
    if len({p.value_dtype is not None for p in params}) > 1:
        return "some params have saved values and others not"
    return None


def model_tensor(name: str, shape: Sequence[int], dtype: str) -> ParamEntry:
    """A model tensor of :class:`ModelFile`: stored whole, in no group."""
    return ParamEntry(name, tuple(shape), -1, -1, {PARAM_KEY: dtype})


def extra_to_json(extra: Extra) -> dict[str, Any]:
    """An :class:`Extra` in its JSON form (what
    :func:`muonckpt.format.manifest_json.extra_from_json` reads)."""

    def tensor(t: ExtraTensor) -> dict[str, Any]:
        lists = {"path": list(t.path), "shape": list(t.shape), "checksums": list(t.checksums)}
        return {**asdict(t), **lists}

    def tree(values: ExtraValues) -> dict[str, Any]:
        return {"values": values.values, "tensors": [tensor(t) for t in values.tensors]}

    return {
        "global": None if extra.shared is None else tree(extra.shared),
        "ranks": [tree(r) for r in extra.ranks],
        "files": [{"name": f.name, "bytes": f.bytes} for f in extra.files],
    }


def piece_to_json(piece: Piece) -> dict[str, Any]:
    """A :class:`Piece` in its JSON form (what
    :func:`muonckpt.format.manifest_json.piece_from_json` reads)."""
    region = piece.region
    return {
        "param": piece.param,
        "key": piece.key,
        "file": piece.file,
        "tensor": piece.tensor,
        "region": {
            "cols": region.cols,
            "block_start": region.block_start,
            "block_width": region.block_width,
            "start": region.start,
            "stop": region.stop,
        },
        "checksums": list(piece.checksums),
        "chunk_bytes": piece.chunk_bytes,
    }


def json_safe(value: Any, path: object = None) -> Any:
    """Hyperparameter values as JSON: tuples become lists; anything else JSON can't hold
    fails, as does a value nesting more than :data:`EXTRA_DEPTH` levels (which the manifest's
    reader would refuse: checked as it is walked, never a RecursionError); the error names
    ``path``, the file the value came from."""

    def safe(value: Any, depth: int) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            raise CheckpointError(
                f"hyperparameter value {value!r} cannot be stored in JSON", path=path
            )
        if isinstance(value, (str, int, float, bool)) or value is None:
            return value
        if depth >= EXTRA_DEPTH and isinstance(value, (list, tuple, Mapping)):
            raise CheckpointError(
                f"a hyperparameter value nests more than {EXTRA_DEPTH} levels deep", path=path
            )
        if isinstance(value, (list, tuple)):
            return [safe(v, depth + 1) for v in value]
        if isinstance(value, Mapping):
            return {str(k): safe(v, depth + 1) for k, v in value.items()}
        raise CheckpointError(
            f"hyperparameter value {value!r} cannot be stored in the manifest", path=path
        )

    return safe(value, 0)


def environment_differences(saved: Mapping[str, Any] | None, now: Mapping[str, Any]) -> list[str]:
    """What differs between the environment a checkpoint was saved in and ``now``, one
    ``key saved -> now`` each (:data:`ENVIRONMENT_KEYS`; a key either lacks is not compared);
    empty when ``saved`` records none."""
    if saved is None:
        return []
    return [
        f"{key} {saved[key]!r} -> {now[key]!r}"
        for key in ENVIRONMENT_KEYS
        if key in saved and key in now and saved[key] != now[key]
    ]
