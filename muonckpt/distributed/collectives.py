"""Every call muonckpt makes into torch.distributed, in one place.

Ranks are global ranks unless a name says otherwise. Small metadata travels as UTF-8 JSON in
uint8 tensors (no pickle, unlike torch's ``*_object`` collectives). Every tensor muonckpt
creates for torch.distributed, and every point-to-point message, is on the device
:func:`comm_device` names for its group (the CPU for gloo, the current CUDA device for NCCL);
a collective on the caller's tensors uses their own device where the group serves it. Results
come back on the device the caller's tensors are on.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .. import settings
from ..errors import CollectiveError, LayoutError, MuonCkptError, PeerLostError
from .steps import Outcome, StepProtocol, disagreement

Group = dist.ProcessGroup | None


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def global_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def group_size(group: Group) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def group_rank(group: Group) -> int:
    return dist.get_rank(group) if is_distributed() else 0


def group_ranks(group: Group) -> list[int]:
    """Global ranks of a group, in group-rank order."""
    if not is_distributed():
        return [0]
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


_CPU = torch.device("cpu")

PEER_LOST = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|ECONNRESET|EPIPE|Socket Timeout", re.I
)
"""What torch.distributed says when the process at the other end went away (gloo's pairs,
the store's socket): in a rank's error, a consequence of another's death, not its cause."""


@contextmanager
def _lost(peer: Callable[[], str], peers: Callable[[], Sequence[int]]) -> Iterator[None]:
    """Turn torch's error for a process gone from under a transfer into a
    :class:`PeerLostError` naming ``peer()``, the process(es) at the other end: ``peers()``."""
    try:
        yield
    except RuntimeError as exc:
        if not (isinstance(exc, dist.DistNetworkError) or PEER_LOST.search(str(exc))):
            raise
        message = f"lost the connection to {peer()} ({_one_line(exc)})"
        raise PeerLostError(message, peers=peers()) from exc


def _members(group: Group) -> Callable[[], str]:
    """``group``'s ranks, short (a rank's one-line error must name the cause early enough for
    a launcher to tell it from the others', :data:`PEER_LOST`)."""

    def named() -> str:
        ranks = group_ranks(group)
        shown = ranks if len(ranks) <= 8 else f"[{ranks[0]}, ..., {ranks[-1]}]"
        return f"a rank of the group of {len(ranks)} ranks {shown}"

    return named


def comm_device(group: Group) -> torch.device:
    """The device of the tensors muonckpt creates to hand to torch.distributed for ``group``
    (None: the default group; metadata, state pieces, receive buffers): the CPU where the
    group's backend serves CPU tensors (gloo, ``cpu:gloo,cuda:nccl``), else this process's
    current device of the type it serves (``cuda:N`` for ``nccl``).

    Read from the group's backend config at each call (well under a microsecond), so nothing
    goes stale when groups are remade or the current CUDA device changes. Raises
    :class:`CollectiveError` for a group served only for a device type this process has none
    of, and for one served only by gloo for CUDA (``cuda:gloo``): gloo's point-to-point send
    and receive move host memory only, so such a group can carry neither CPU nor CUDA
    messages.
    """
    if not is_distributed():
        return _CPU
    config, served = _served(group)
    if "cpu" in served:
        return _CPU
    kind = served[0]
    module = torch.get_device_module(kind)
    if not module.is_available():
        raise CollectiveError(
            f"the process group with backend {config!r} needs {kind.upper()} tensors, and this "
            f"process has no usable {kind.upper()} device (torch.{kind}.is_available() is False): "
            "run it where there is one, or give the group a CPU backend too (cpu:gloo,...)"
        )
    if f"{kind}:gloo" in config.split(","):
        raise CollectiveError(
            f"the process group with backend {config!r} serves {kind.upper()} tensors by gloo "
            "only, whose point-to-point send and receive move host memory: give it a CPU "
            f"backend too (cpu:gloo,{kind}:gloo, or plain gloo)"
        )
    return torch.device(kind, module.current_device())


def _served(group: Group) -> tuple[str, list[str]]:
    """The group's backend config (``cpu:gloo,cuda:nccl``) and the device types it serves."""
    config = dist.get_backend_config(group)
    return config, [entry.split(":")[0] for entry in config.split(",")]


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` contiguous on ``device``: itself when it is already, else a copy."""
    return tensor.to(device).contiguous()


def _for_collective(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    """``tensor`` as a collective over ``group`` takes it: on its own device where the group
    serves that device type (a step's CUDA tensors keep the CUDA backend of a
    ``cpu:gloo,cuda:nccl`` group), else on :func:`comm_device`. Every rank must pass tensors of
    one device type, as torch requires."""
    served = tensor.device.type in _served(group)[1]
    return _on(tensor, tensor.device if served else comm_device(group))


def all_gather_flat(local: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenation of every group rank's equal-sized 1-D ``local``, in group-rank order, on
    ``local``'s device."""
    sent = _for_collective(local, group)
    out = torch.empty(local.numel() * group_size(group), dtype=local.dtype, device=sent.device)
    gather_single = getattr(dist, "all_gather_single", None)
    with _lost(_members(group), lambda: group_ranks(group)):
        if gather_single is not None:
            gather_single(out, sent, group=group)
        else:
            dist.all_gather_into_tensor(out, sent, group=group)
    return out.to(local.device)


def all_gather_list(local: torch.Tensor, group: Group) -> list[torch.Tensor]:
    """Every group rank's ``local`` (all the same shape), in group-rank order, on ``local``'s
    device."""
    sent = _for_collective(local, group)
    parts = [torch.empty_like(sent) for _ in range(group_size(group))]
    with _lost(_members(group), lambda: group_ranks(group)):
        dist.all_gather(parts, sent, group=group)
    return [part.to(local.device) for part in parts]


def all_reduce_mean_(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    """``tensor`` replaced in place by its mean over the group's ranks."""
    if group_size(group) > 1:
        reduced = _for_collective(tensor, group)
        with _lost(_members(group), lambda: group_ranks(group)):
            dist.all_reduce(reduced, group=group)
        if reduced is not tensor:
            tensor.copy_(reduced)
        tensor.div_(group_size(group))
    return tensor


def all_gather_ints(values: Sequence[int], group: Group) -> list[list[int]]:
    """Each group rank's list of ints (all lists the same length), in group-rank order."""
    local = torch.tensor(list(values), dtype=torch.int64, device=comm_device(group))
    return [t.tolist() for t in all_gather_list(local, group)]


def grid_ranks(dp_group: Group, tp_group: Group, operation: str = "describe the grid") -> list[int]:
    """Global ranks of the dp x tp grid, indexed ``dp_rank * tp + tp_rank``.

    A collective over the DP group (the first step of ``operation``), through the store with
    bounded waits (:class:`StoreSteps`), so that it cannot hang on a rank that never comes;
    raises :class:`CollectiveError` when the groups do not form a grid (a TP group whose size
    differs between DP ranks, say)."""
    if not is_distributed():
        return [0]
    tp_members = group_ranks(tp_group)

    def grid(rows: list[list[int]]) -> list[int]:
        if any(len(row) != len(tp_members) for row in rows):
            raise CollectiveError("the TP groups of different DP ranks differ in size")
        ranks = [rank for row in rows for rank in row]
        if len(set(ranks)) != len(ranks):
            raise CollectiveError(f"the DP and TP groups do not form a grid: ranks {ranks}")
        return ranks

    dp_members = group_ranks(dp_group)
    if len(dp_members) == 1:
        return grid([tp_members])
    steps = StoreSteps(operation, dp_members, CollectiveError)
    return steps.each_then_root("grid", lambda: tp_members, grid)


def grid_groups(dp: int, tp: int) -> tuple[Group, Group]:
    """Megatron-style (dp_group, tp_group) of this rank over the default group of dp * tp ranks.

    DP groups stride ``tp``; TP groups are consecutive ranks. A collective: every rank creates
    every group, as ``new_group`` requires.

    Raises:
        LayoutError: ``dp`` or ``tp`` not a positive int, or ``dp * tp`` not the world size
            (checked before any group is created, so every rank fails the same way).
    """
    if not is_distributed():
        raise LayoutError("grid_groups needs an initialized default process group")
    world = dist.get_world_size()
    for name, value in (("dp", dp), ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LayoutError(f"grid_groups: {name} must be a positive int, got {value!r}")
    if dp * tp != world:
        raise LayoutError(
            f"grid_groups: dp={dp} x tp={tp} = {dp * tp} ranks, but the default process group "
            f"has {world}: launch dp * tp processes, or choose dp and tp whose product is {world}"
        )
    rank, dp_group, tp_group = dist.get_rank(), None, None
    for i in range(tp):
        ranks = list(range(i, dp * tp, tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            dp_group = group
    for i in range(dp):
        ranks = list(range(i * tp, (i + 1) * tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            tp_group = group
    return dp_group, tp_group


def send(tensor: torch.Tensor, dst: int) -> None:
    """Send ``tensor`` to global rank ``dst`` over the default group, from its
    :func:`comm_device` (always: the receiver cannot know where the sender's tensor is, and
    both ends must use the same backend)."""
    sent = _on(tensor, comm_device(None))
    with _lost(lambda: f"rank {dst}", lambda: [dst]):
        dist.send(sent, dst=dst)


def recv(shape: Sequence[int], dtype: torch.dtype, src: int) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` received from global rank ``src`` over the default
    group, on the default group's :func:`comm_device` (copy it to where it is needed)."""
    tensor = torch.empty(tuple(shape), dtype=dtype, device=comm_device(None))
    with _lost(lambda: f"rank {src}", lambda: [src]):
        dist.recv(tensor, src=src)
    return tensor


def exchange(
    sends: Sequence[tuple[torch.Tensor, int]],
    receives: Sequence[tuple[int, int, torch.dtype]],
    device: torch.device,
) -> list[torch.Tensor]:
    """Point-to-point messages over the default group, all posted at once
    (``batch_isend_irecv``): send each ``(tensor, dst)``, receive each ``(src, numel, dtype)``
    as a 1-D tensor. Returns the received tensors, in the order of ``receives``, on ``device``.

    Every rank's sends must match its peers' receives (shape and dtype), at most one message per
    ordered pair of global ranks per call. Messages travel on the default group's
    :func:`comm_device`: NCCL moves CUDA tensors where they are, gloo copies them to the host.
    """
    on = comm_device(None)
    outgoing = [_on(tensor.reshape(-1), on) for tensor, _ in sends]
    incoming = [torch.empty(numel, dtype=dtype, device=on) for _, numel, dtype in receives]
    ops = [dist.P2POp(dist.isend, t, dst) for t, (_, dst) in zip(outgoing, sends, strict=True)]
    ops += [
        dist.P2POp(dist.irecv, t, src) for t, (src, _, _) in zip(incoming, receives, strict=True)
    ]
    peers = sorted({dst for _, dst in sends} | {src for src, _, _ in receives})
    with _lost(lambda: f"rank(s) {peers}", lambda: peers):
        for request in dist.batch_isend_irecv(ops) if ops else ():
            request.wait()
    return [t.to(device) for t in incoming]


def send_json(obj: Any, dst: int) -> None:
    payload = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    send(torch.tensor([payload.numel()], dtype=torch.int64), dst)
    if payload.numel():
        send(payload, dst)


def recv_json(src: int) -> Any:
    length = int(recv((1,), torch.int64, src).item())
    payload = recv((length,), torch.uint8, src) if length else torch.empty(0, dtype=torch.uint8)
    return json.loads(payload.cpu().numpy().tobytes().decode())


def gather_json(obj: Any, ranks: Sequence[int], dst: int) -> list[Any] | None:
    """On ``dst``: every rank's ``obj``, in the order of ``ranks``; elsewhere None.

    Point-to-point, so ``ranks`` need not form a process group.
    """
    me = global_rank()
    if me != dst:
        send_json(obj, dst)
        return None
    return [obj if rank == me else recv_json(rank) for rank in ranks]


def broadcast_json(obj: Any, ranks: Sequence[int], src: int) -> Any:
    """``src``'s ``obj`` on every rank of ``ranks`` (point-to-point)."""
    me = global_rank()
    if me == src:
        for rank in ranks:
            if rank != src:
                send_json(obj, rank)
        return obj
    return recv_json(src)


class CollectiveSteps(StepProtocol):
    """The step protocol (:class:`muonckpt.distributed.steps.StepProtocol`) over the job's process
    group:
    each rank's outcome travels to the root, and the root's to every rank, as JSON
    point-to-point (so ``ranks`` need not form a process group). A transfer that fails itself
    (a peer process dying, the network) is not a step's failure: the process group's timeout
    ends it."""

    def __init__(
        self, operation: str, ranks: Sequence[int], root: int, error: type[MuonCkptError]
    ) -> None:
        super().__init__(operation, ranks, root, error, global_rank())

    def _exchange(
        self, step: str, mine: Outcome, decide: Callable[[list[Outcome]], Outcome]
    ) -> Outcome:
        try:
            outcomes = gather_json(mine, self.ranks, self.root)
            outcome = decide(outcomes) if outcomes is not None else None
            return broadcast_json(outcome, self.ranks, self.root)
        except PeerLostError as exc:
            raise self.error(f"{self.operation} ({step}): {exc}") from exc


@contextmanager
def default_group_from_env(timeout: timedelta) -> Iterator[None]:
    """The default process group torchrun describes in the environment, over gloo.

    Joined here (and left on exit) unless one is already initialized.
    """
    if is_distributed():
        yield
        return
    dist.init_process_group("gloo", init_method="env://", timeout=timeout)
    try:
        yield
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# For the modules that may not import torch.distributed themselves (optim, demo, launch): the
# group queries without a single-process fallback, and the rendezvous of launch.py.
# --------------------------------------------------------------------------------------------


def size_and_rank(group: Group) -> tuple[int, int]:
    """This process's ``(size of group, rank in group)``.

    Unlike :func:`group_size` and :func:`group_rank`, no single-process fallback: without an
    initialized process group this raises as torch.distributed does.
    """
    return dist.get_world_size(group), dist.get_rank(group)


def tcp_store(host: str, port: int, world_size: int, **options: Any) -> dist.TCPStore:
    """``torch.distributed.TCPStore(host, port, world_size, **options)``: a rendezvous store
    (``port`` 0 with ``is_master=True`` picks a free port, then read ``.port``)."""
    return dist.TCPStore(host, port, world_size, **options)


def join_default_group(
    backend: str, store: dist.Store, rank: int, world_size: int, timeout: timedelta
) -> None:
    """Join the default process group of ``world_size`` ranks that meet at ``store``."""
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def leave_default_group() -> None:
    """Destroy the default process group (and every group made from it)."""
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# The rendezvous every collective operation starts with: bounded, through the default group's
# store, so that a rank that never comes (``if rank == 0: save(...)``) is an error on the
# ranks that did within ``timeout``, instead of a hang until the process group's own timeout.
# --------------------------------------------------------------------------------------------

DEFAULT_RENDEZVOUS_TIMEOUT_S: float = 60.0
"""How long, by default, the ranks of a muonckpt collective (``save``, ``async_save``,
``load``, ``state_dict()``, the offline tools under torchrun) wait for each other at its start;
overridden by the ``MUONCKPT_RENDEZVOUS_TIMEOUT`` environment variable (seconds) or
:func:`set_rendezvous_timeout`."""

_timeout_s: float | None = None
"""What :func:`set_rendezvous_timeout` set; None: the environment or the default."""


def rendezvous_timeout() -> float:
    """The rendezvous timeout in seconds now in force."""
    if _timeout_s is not None:
        return _timeout_s
    text = os.environ.get("MUONCKPT_RENDEZVOUS_TIMEOUT")
    if text is None:
        return DEFAULT_RENDEZVOUS_TIMEOUT_S
    try:
        return _checked_timeout(float(text))
    except (ValueError, CollectiveError) as exc:
        raise CollectiveError(
            f"MUONCKPT_RENDEZVOUS_TIMEOUT={text!r}: must be a number of seconds more than 0 "
            f"and at most {settings.MAX_WAIT_S:g}"
        ) from exc


def set_rendezvous_timeout(seconds: float | None) -> float:
    """Set how long the ranks of every muonckpt collective wait for each other at its start
    (None: back to ``MUONCKPT_RENDEZVOUS_TIMEOUT`` or the default, 60 s); returns the timeout
    in force before. Ranks that call a collective further apart than this fail it. At most
    :data:`muonckpt.settings.MAX_WAIT_S` (a week)."""
    global _timeout_s
    previous = rendezvous_timeout()
    _timeout_s = None if seconds is None else _checked_timeout(seconds)
    return previous


def _checked_timeout(seconds: Any) -> float:
    return settings.seconds(seconds, "the rendezvous timeout", CollectiveError)


_SEQUENCE: dict[tuple[int, ...], int] = {}
"""Per set of ranks, the number of its store-carried operations this process has begun (every
rank of a set begins the collectives over it in one order, so the n-th of one rank meets the
n-th of the others)."""


class StoreSteps(StepProtocol):
    """The step protocol (:class:`muonckpt.distributed.steps.StepProtocol`) through the default
    process
    group's store, with bounded waits: no rank waits longer than ``timeout`` seconds (default
    :func:`rendezvous_timeout`) for another, so a rank that never comes (``if rank == 0:
    save(...)``) is an error on the ranks that did, never a hang until the process group's
    own timeout. For the small exchanges that start an operation (its rendezvous, learning a
    grid's ranks), before any collective on the process groups.

    Each rank leaves its outcome under a key of its own; the first of ``ranks`` (the root)
    decides and leaves the verdict. A rank whose wait ends first claims the verdict instead
    (an atomic ``compare_set``: whoever decides first, every rank ends knowing that one
    outcome), naming the ranks that did not arrive. A rank that arrives after the others gave
    up on an operation without it leaves that one to them and meets their next operation over
    the same ranks instead, so that one late or missing call does not put the ranks out of step
    for good. The last rank to read a verdict deletes the step's keys (a failed step's stay, for
    late ranks to find).
    """

    def __init__(
        self,
        operation: str,
        ranks: Sequence[int],
        error: type[MuonCkptError],
        timeout: float | None = None,
        hint: str = "",
    ) -> None:
        super().__init__(operation, ranks, ranks[0], error, global_rank())
        self.timeout = rendezvous_timeout() if timeout is None else _checked_timeout(timeout)
        self.sequence = _next_sequence(self.ranks)
        self.hint = hint
        """What else to say when ranks do not arrive (the caller's likely mistake), or empty."""

    def _exchange(
        self, step: str, mine: Outcome, decide: Callable[[list[Outcome]], Outcome]
    ) -> Outcome:
        store = _default_store()
        try:
            return self._through(store, step, mine, decide)
        except dist.DistNetworkError as exc:  # the store's server is gone, not a late rank
            raise self.error(
                f"{self.operation} ({step}): {_store_gone(store)} ({_one_line(exc)})"
            ) from exc

    def _through(
        self,
        store: dist.Store,
        step: str,
        mine: Outcome,
        decide: Callable[[list[Outcome]], Outcome],
    ) -> Outcome:
        """The step's exchange through ``store`` (see the class docstring)."""
        wait = timedelta(seconds=self.timeout)
        while True:
            arrivals, verdict, done = store_keys(self.ranks, self.sequence, step)
            mine_key = arrivals[self.ranks.index(self.rank)]
            store.set(mine_key, json.dumps(mine))
            outcome = self._verdict(store, wait, arrivals, verdict, decide)
            if self.rank not in outcome.get("absent", ()):
                break
            # The others gave up on this operation before this rank came (and raised): it
            # is theirs alone. This call meets their next one instead.
            store.delete_key(mine_key)
            self.sequence = _next_sequence(self.ranks)
        if store.add(done, 1) == len(self.ranks):
            store.delete_key(verdict)
            store.delete_key(done)
        if "error" in outcome:
            store.delete_key(mine_key)  # (the first rank may not have read it)
        return outcome

    def _verdict(
        self,
        store: dist.Store,
        wait: timedelta,
        arrivals: list[str],
        verdict: str,
        decide: Callable[[list[Outcome]], Outcome],
    ) -> Outcome:
        """The step's one outcome: decided by the root when every rank has arrived, or claimed
        by the first rank whose wait ends (naming the ranks ``absent``)."""

        def claim(outcome: Outcome) -> Outcome:
            """The verdict: ``outcome`` unless another rank decided first."""
            return json.loads(store.compare_set(verdict, "", json.dumps(outcome)).decode())

        def timed_out() -> Outcome:
            present = [store.check([key]) for key in arrivals]
            absent = [r for r, came in zip(self.ranks, present, strict=True) if not came]
            came = [r for r in self.ranks if r not in absent]
            return {
                "error": f"rank(s) {absent} did not arrive within {self.timeout:g} s (ranks "
                f"{came} did): {self.operation} is a collective over ranks {self.ranks}, call "
                "it on every one of them (not under `if rank == 0:`), within the rendezvous "
                "timeout of each other (muonckpt.distributed.set_rendezvous_timeout, "
                f"MUONCKPT_RENDEZVOUS_TIMEOUT){'; ' + self.hint if self.hint else ''}",
                "absent": absent,
            }

        if store.check([verdict]):  # decided already: the others gave up before this came
            return json.loads(store.get(verdict).decode())
        if self.is_root:
            try:
                store.wait(arrivals, wait)
            except dist.DistStoreError:
                return claim(timed_out())
            outcome = claim(decide([json.loads(v) for v in store.multi_get(arrivals)]))
            for key in arrivals:
                store.delete_key(key)
            return outcome
        waited = _waited(store, verdict, wait)
        if waited is None and all(store.check([key]) for key in arrivals):
            waited = _waited(store, verdict, wait)  # all came: the root is deciding
        return waited if waited is not None else claim(timed_out())


def _next_sequence(ranks: Sequence[int]) -> int:
    """The number of this process's next :class:`StoreSteps` operation over ``ranks``."""
    members = tuple(ranks)
    sequence = _SEQUENCE.get(members, 0)
    _SEQUENCE[members] = sequence + 1
    return sequence


def store_keys(ranks: Sequence[int], sequence: int, step: str) -> tuple[list[str], str, str]:
    """The store keys of one step of the ``sequence``-th :class:`StoreSteps` operation over
    ``ranks``: each rank's arrival (in the order of ``ranks``), the verdict, the count of
    ranks that read it."""
    digest = hashlib.blake2b(repr(tuple(ranks)).encode(), digest_size=6).hexdigest()
    prefix = f"muonckpt/steps/{digest}/{sequence}/{step}"
    return [f"{prefix}/arrived/{rank}" for rank in ranks], f"{prefix}/verdict", f"{prefix}/done"


def _waited(store: dist.Store, key: str, wait: timedelta) -> Outcome | None:
    """The JSON value of ``key`` once it is set, or None when ``wait`` passes first."""
    try:
        store.wait([key], wait)
    except dist.DistStoreError:
        return None
    return json.loads(store.get(key).decode())


def rendezvous(
    operation: str,
    ranks: Sequence[int],
    arguments: dict[str, Any],
    error: type[MuonCkptError],
    timeout: float | None = None,
    hint: str = "",
) -> None:
    """The start of every collective ``operation`` over ``ranks``: a ``rendezvous`` step
    (:class:`StoreSteps`, bounded by ``timeout``) where the ranks check that they were called
    alike: the same call and ``arguments`` (JSON-safe). Raises ``error`` on every rank that
    came, with one message, naming the ranks that did not come or the argument that differs,
    and then ``hint`` (what the caller may have meant), if any. Nothing in one process."""
    if not is_distributed() or len(ranks) <= 1:
        return

    def agreed(given: list[dict[str, Any]]) -> None:
        differ = disagreement(given, ranks)
        if differ is not None:
            said = f"; {hint}" if hint else ""
            raise error(f"the ranks disagree on {differ}; nothing was done{said}")

    called = {"call": operation, **arguments}
    StoreSteps(operation, ranks, error, timeout, hint).each_then_root(
        "rendezvous", lambda: called, agreed
    )


def _default_store() -> dist.Store:
    """The default process group's store (where its ranks met)."""
    return dist.distributed_c10d._get_default_store()


def _store_gone(store: dist.Store) -> str:
    """What to tell a rank that has lost its connection to ``store``: where it was and what
    went away with it. torchrun's agent (the launcher) hosts the store its workers meet at
    (``TORCHELASTIC_USE_AGENT_STORE``); a group joined by ``env://`` otherwise meets at a
    store that rank 0 hosts."""
    while not isinstance(store, dist.TCPStore) and hasattr(store, "underlying_store"):
        store = store.underlying_store  # the PrefixStores the groups add
    where = f" at {store.host}:{store.port}" if isinstance(store, dist.TCPStore) else ""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        host = "the launcher that hosts it (torchrun's agent)"
    else:
        host = "the process that hosts it (rank 0, for a group joined by env://)"
    return f"the process group's store{where} is gone: {host} has exited or was killed"


def _one_line(exc: BaseException) -> str:
    """``Type: message`` on one line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
