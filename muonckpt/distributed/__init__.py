"""Ranks working together: the only calls into torch.distributed, the step protocol every
operation over several ranks runs as, and local multi-process launches.

A change to a collective, to the step protocol or to how processes are started goes here.
Modules, one reason to change each: :mod:`.collectives` (tensor and JSON collectives, a
group's size and ranks), :mod:`.steps` (pure: the step protocol), :mod:`.group_steps` (the
protocol over the process group: ``CollectiveSteps``, ``StoreSteps``, ``rendezvous`` and its
timeout), :mod:`.groups` (joining the default group, the dp x tp grid), :mod:`.launch`
(``run_distributed``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._namespace import lazy_names

if TYPE_CHECKING:
    from ..errors import DistributedRunError as DistributedRunError
    from .collectives import comm_device as comm_device
    from .collectives import global_rank as global_rank
    from .group_steps import rendezvous_timeout as rendezvous_timeout
    from .group_steps import set_rendezvous_timeout as set_rendezvous_timeout
    from .groups import default_group_from_env as default_group_from_env
    from .groups import grid_groups as grid_groups
    from .launch import run_distributed as run_distributed

_NAMES = {
    "comm_device": ".collectives",
    "default_group_from_env": ".groups",
    "global_rank": ".collectives",
    "grid_groups": ".groups",
    "rendezvous_timeout": ".group_steps",
    "set_rendezvous_timeout": ".group_steps",
    "run_distributed": ".launch",
    "DistributedRunError": "..errors",
}
__all__ = list(_NAMES)
__getattr__, __dir__ = lazy_names(__name__, _NAMES)
