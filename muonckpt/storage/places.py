"""Where a checkpoint is: a local path or an ``s3://`` URL, told apart once, at the entry
point, so that nothing below mangles a URL into a path (``Path("s3://b/x")`` is ``s3:/b/x``)."""

from __future__ import annotations

import os
from pathlib import Path

from ..settings import local_path
from .s3 import S3Url, is_s3_url

Location = Path | S3Url
"""A checkpoint's place: a local directory, or a key prefix in a bucket."""


def location(target: str | os.PathLike[str] | S3Url) -> Location:
    """``target`` as a :data:`Location`: an ``s3://bucket/key`` URL parsed (a
    :class:`~muonckpt.errors.CheckpointError` naming it when malformed), a local path as a
    :class:`~pathlib.Path`; any other URL is refused in one line naming what is supported
    (:func:`muonckpt.settings.local_path`)."""
    if isinstance(target, S3Url):
        return target
    if is_s3_url(target):
        return S3Url.parse(os.fspath(target))
    return local_path(target)


def target(path: str | os.PathLike[str] | S3Url) -> Path | str:
    """``path`` as the stores and the write engine take it: a local :class:`~pathlib.Path`,
    an ``s3://`` URL as its text (checked, normalized); any other URL refused
    (:func:`location`)."""
    where = location(path)
    return where if isinstance(where, Path) else str(where)


def resolved_place(target: str | os.PathLike[str] | S3Url) -> str:
    """``target`` as the ranks of one call compare it: a local path made absolute (not
    resolved: each rank's own symlinks are its business until the checkpoint is opened), an
    ``s3://`` URL as parsed."""
    place = location(target)
    return str(place) if isinstance(place, S3Url) else os.path.abspath(place)
