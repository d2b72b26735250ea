"""Ranks working together: the only calls into torch.distributed, the step protocol every
operation over several ranks runs as, and local multi-process launches.

A change to a collective, to the step protocol or to how processes are started goes here.
Modules: :mod:`.collectives` (process groups, metadata as JSON, ``CollectiveSteps``,
``StoreSteps``, ``rendezvous``), :mod:`.steps` (pure: the protocol), :mod:`.launch`
(``run_distributed``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._namespace import lazy_names

if TYPE_CHECKING:
    from ..errors import DistributedRunError as DistributedRunError
    from .collectives import comm_device as comm_device
    from .collectives import default_group_from_env as default_group_from_env
    from .collectives import global_rank as global_rank
    from .collectives import grid_groups as grid_groups
    from .collectives import rendezvous_timeout as rendezvous_timeout
    from .collectives import set_rendezvous_timeout as set_rendezvous_timeout
    from .launch import run_distributed as run_distributed

_NAMES = {
    "comm_device": ".collectives",
    "default_group_from_env": ".collectives",
    "global_rank": ".collectives",
    "grid_groups": ".collectives",
    "rendezvous_timeout": ".collectives",
    "set_rendezvous_timeout": ".collectives",
    "run_distributed": ".launch",
    "DistributedRunError": "..errors",
}
__all__ = list(_NAMES)
__getattr__, __dir__ = lazy_names(__name__, _NAMES)
