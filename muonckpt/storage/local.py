"""Local paths only: a URL (``s3://bucket/x``) given where a checkpoint directory is expected
is refused, before anything is read or written, instead of becoming a local directory
``./s3:/bucket/x``. The one check of every entry point that takes a path."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import CheckpointError

_URL = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*)://")
"""A URL's start: a scheme (RFC 3986) and ``//``."""
_SCHEME_PART = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*):")
"""A URL made a ``Path`` (``Path("s3://b/x")`` is ``s3:/b/x``): its first part, the scheme
and a colon, alone."""


def local_path(path: str | os.PathLike[str]) -> Path:
    """``path`` as a :class:`~pathlib.Path`, unless it is a URL: a string starting with a
    scheme and ``//`` (``s3://``, ``gs://``, ``hf://``, ``https://``), or a relative path
    whose first part is a scheme and a colon alone (such a URL made a ``Path``). A local name
    with a colon (``a:b``, ``run:1/step-10``) is a path.

    Raises:
        CheckpointError: for a URL, naming it (object storage is not supported).
    """
    text = os.fsdecode(os.fspath(path))
    url = _URL.match(text)
    first = Path(text).parts[:1]
    if url is None and not (first and _SCHEME_PART.fullmatch(first[0])):
        return Path(text)
    scheme = url.group(1) if url is not None else first[0][:-1]
    raise CheckpointError(
        f"{text!r} is a {scheme}:// URL, not a local path: muonckpt reads and writes local "
        "directories only (object storage is not supported yet); nothing was read or written"
    )
