"""``muonckpt.latest``: the checkpoint a job resumes from, found by one process or, with
``collective=True``, by rank 0 for every rank of the job (one LIST of the root, not one per
rank: hundreds of ranks listing one S3 prefix at once get throttled, and a rank that reads
back "no checkpoint" from a throttled listing restarts from scratch). Torch is imported only
by the collective path."""

from __future__ import annotations

import os

from ..errors import CheckpointError
from ..files import retention
from ..storage.places import Location, location, resolved_place

__all__ = ["latest"]


def latest(root: str | os.PathLike[str], *, collective: bool = False) -> Location | None:
    """The newest complete checkpoint directly under ``root`` (a directory, or an
    ``s3://bucket/prefix`` URL), to resume from; None when there is none, also when ``root``
    does not exist yet (a job's first start). See :func:`muonckpt.files.retention.latest` for
    what counts as newest and complete.

    Args:
        root: the directory (or S3 prefix) the job saves its checkpoints under.
        collective: every rank of the initialized default process group (torchrun) calls it
            with the same ``root``; rank 0 looks, and every rank returns its answer (or raises
            its error). A rank that never calls it is an error on the others within the
            rendezvous timeout (:func:`muonckpt.distributed.set_rendezvous_timeout`).
    """
    if not collective:
        return retention.latest(root)
    from ..distributed import collectives, group_steps

    if not collectives.is_distributed():
        raise CheckpointError("collective=True needs an initialized default process group")
    ranks = collectives.group_ranks(None)
    group_steps.rendezvous("latest", ranks, {"root": resolved_place(root)}, CheckpointError)
    steps = group_steps.CollectiveSteps("latest", ranks, ranks[0], CheckpointError)
    found = steps.each_then_root("look", lambda: None, lambda _: _text(retention.latest(root)))
    return None if found is None else location(found)


def _text(found: Location | None) -> str | None:
    return None if found is None else str(found)
