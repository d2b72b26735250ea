"""The tensor and JSON collectives: every call muonckpt makes into torch.distributed to move
data (the optimizer's gathers and Newton-Schulz exchange, the state dict's pieces, the step
protocol's messages), and the queries of a group's size and ranks.

Ranks are global ranks unless a name says otherwise. Small metadata travels as UTF-8 JSON in
uint8 tensors (no pickle, unlike torch's ``*_object`` collectives). Every tensor muonckpt
creates for torch.distributed, and every point-to-point message, is on the device
:func:`comm_device` names for its group (the CPU for gloo, the current CUDA device for NCCL);
a collective on the caller's tensors uses their own device where the group serves it. Results
come back on the device the caller's tensors are on.

The step protocol over a group is :mod:`.group_steps`; making groups and joining them,
:mod:`.groups`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import CollectiveError, PeerLostError

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
    r"Connection (closed|reset) by peer|Broken pipe|ECONNRESET|EPIPE|Socket Timeout"
    r"|Timed out waiting \d+ms for (recv|send) operation",
    re.I,
)
"""What torch.distributed says when the process at the other end went away (gloo's pairs,
the store's socket; a transfer with it that never completes, when gloo did not see its
connection close: a node killed while its peers wait): in a rank's error, a consequence of
another's death, not its cause."""


@contextmanager
def _lost(peer: Callable[[], str], peers: Callable[[], Sequence[int]]) -> Iterator[None]:
    """Turn torch's error for a process gone from under a transfer into a
    :class:`PeerLostError` naming ``peer()``, the process(es) at the other end: ``peers()``."""
    try:
        yield
    except RuntimeError as exc:
        if not (isinstance(exc, dist.DistNetworkError) or PEER_LOST.search(str(exc))):
            raise
        message = f"lost the connection to {peer()} ({one_line(exc)})"
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


def size_and_rank(group: Group) -> tuple[int, int]:
    """This process's ``(size of group, rank in group)``.

    Unlike :func:`group_size` and :func:`group_rank`, no single-process fallback: without an
    initialized process group this raises as torch.distributed does.
    """
    return dist.get_world_size(group), dist.get_rank(group)


def send(tensor: torch.Tensor, dst: int) -> None:
    """Send ``tensor`` to global rank ``dst`` over the default group, from its
    :func:`comm_device` (always: the receiver cannot know where the sender's tensor is, and
    both ends must use the same backend)."""
    sent = _on(tensor, comm_device(None))
    with _lost_peer(dst):
        dist.send(sent, dst=dst)


def recv(shape: Sequence[int], dtype: torch.dtype, src: int) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` received from global rank ``src`` over the default
    group, on the default group's :func:`comm_device` (copy it to where it is needed)."""
    tensor = torch.empty(tuple(shape), dtype=dtype, device=comm_device(None))
    with _lost_peer(src):
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


_HEAD_BYTES = 4096
"""The first transfer of every JSON message: its length (8 bytes, little-endian) and as much
of it as fits after that, so that a message of up to 4,088 bytes (a step's outcome, as a
rule) is one transfer; a longer one's rest follows in a second."""
_INLINE_BYTES = _HEAD_BYTES - 8


def _encoded(obj: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``obj`` as JSON: the head transfer, and the rest (None: it fits in the head)."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    head = bytearray(_HEAD_BYTES)
    head[:8] = len(data).to_bytes(8, "little")
    inline = data[:_INLINE_BYTES]
    head[8 : 8 + len(inline)] = inline
    rest = data[_INLINE_BYTES:]
    return _bytes_tensor(head), _bytes_tensor(bytearray(rest)) if rest else None


def _rest_bytes(head: torch.Tensor) -> int:
    """How many bytes of a message follow its ``head`` in a second transfer."""
    return max(0, int.from_bytes(_tensor_bytes(head[:8]), "little") - _INLINE_BYTES)


def _decoded(head: torch.Tensor, rest: torch.Tensor | None) -> Any:
    length = int.from_bytes(_tensor_bytes(head[:8]), "little")
    data = _tensor_bytes(head[8 : 8 + min(length, _INLINE_BYTES)])
    return json.loads(data + (_tensor_bytes(rest) if rest is not None else b""))


def _bytes_tensor(data: bytearray) -> torch.Tensor:
    return _on(torch.frombuffer(data, dtype=torch.uint8), comm_device(None))


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.cpu().numpy().tobytes())


_HEAD_TAG, _REST_TAG = 0, 1
"""The tags of a JSON message's two transfers: gloo matches a tag's transfers apart from the
other's, NCCL keeps a pair's transfers in the order posted."""


def _send_json(obj: Any, dsts: Sequence[int]) -> None:
    """``obj`` to each global rank of ``dsts``: every transfer posted before any is waited for
    (a long message's rest too, so that it moves as soon as its receiver asks for it)."""
    head, rest = _encoded(obj)
    parts = [(head, _HEAD_TAG)] + ([(rest, _REST_TAG)] if rest is not None else [])
    _wait_all([(dst, _posted(dist.isend, part, dst, tag)) for dst in dsts for part, tag in parts])


def _recv_json(srcs: Sequence[int]) -> list[Any]:
    """One JSON message from each global rank of ``srcs``, received from all at once: every
    head posted, then each waited for in the order of ``srcs`` and a long message's rest
    asked for once its head is in."""
    device = comm_device(None)
    heads = {src: torch.empty(_HEAD_BYTES, dtype=torch.uint8, device=device) for src in srcs}
    posted = [(src, _posted(dist.irecv, heads[src], src, _HEAD_TAG)) for src in srcs]
    rests: dict[int, torch.Tensor] = {}
    asked = []
    for src, work in posted:
        _wait_all([(src, work)])
        if length := _rest_bytes(heads[src]):
            rests[src] = torch.empty(length, dtype=torch.uint8, device=device)
            asked.append((src, _posted(dist.irecv, rests[src], src, _REST_TAG)))
    _wait_all(asked)
    return [_decoded(heads[src], rests.get(src)) for src in srcs]


def _posted(post: Callable[..., Any], tensor: torch.Tensor, peer: int, tag: int) -> Any:
    """``post`` (``dist.isend`` or ``dist.irecv``) of ``tensor`` with global rank ``peer``: its
    work; a peer gone is a :class:`PeerLostError` naming it."""
    with _lost_peer(peer):
        return post(tensor, peer, tag=tag)


def _wait_all(posted: Sequence[tuple[int, Any]]) -> None:
    """Wait for each ``(peer, work)`` in turn; a peer gone is a :class:`PeerLostError` (the
    transfers posted to the others are left unwaited: the group is of no use after it)."""
    for peer, work in posted:
        with _lost_peer(peer):
            work.wait()


def _lost_peer(peer: int) -> AbstractContextManager[None]:
    """:func:`_lost` for a transfer with global rank ``peer``."""
    return _lost(lambda: f"rank {peer}", lambda: [peer])


def gather_json(obj: Any, ranks: Sequence[int], dst: int) -> list[Any] | None:
    """On ``dst``: every rank's ``obj``, in the order of ``ranks``; elsewhere None.

    Point-to-point, so ``ranks`` need not form a process group; ``dst`` receives from every
    rank at once (one transfer each, as a rule: :data:`_HEAD_BYTES`).
    """
    me = global_rank()
    if me != dst:
        _send_json(obj, [dst])
        return None
    others = [rank for rank in ranks if rank != me]
    received = dict(zip(others, _recv_json(others), strict=True))
    return [obj if rank == me else received[rank] for rank in ranks]


def broadcast_json(obj: Any, ranks: Sequence[int], src: int) -> Any:
    """``src``'s ``obj`` on every rank of ``ranks`` (point-to-point, sent to all at once)."""
    me = global_rank()
    if me == src:
        _send_json(obj, [rank for rank in ranks if rank != src])
        return obj
    return _recv_json([src])[0]


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def all_gather_json(obj: Any, group: Group) -> list[Any]:
    """Every rank's ``obj`` of ``group``, in group-rank order, as JSON (two all-gathers: the
    lengths, then the bytes padded to the longest)."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    on = comm_device(group)
    lengths = all_gather_ints([len(data)], group)
    longest = max(n for (n,) in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=on)
    if data:
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    with _lost(_members(group), lambda: group_ranks(group)):
        gathered = all_gather_list(padded, group)
    return [json.loads(_tensor_bytes(t[:n])) for t, (n,) in zip(gathered, lengths, strict=True)]


def relay(
    chunks: Iterator[np.ndarray],
    to: int | None,
    sizes: Sequence[int],
    source: int | None,
    group: Group,
) -> Iterator[np.ndarray]:
    """Send ``chunks`` to global rank ``to`` while receiving from global rank ``source``
    chunks of ``sizes`` bytes, which are yielded as they come (None: no such side), both
    posted before either is waited for, so that a ring of ranks moves at once. The next
    chunk to send is taken from ``chunks`` (read) while one travels, and the next is posted
    to receive before one is yielded (written by the caller): reads, transfers and writes
    overlap, two chunks in flight each way at most. Every chunk travels on the CPU over
    ``group`` (gloo)."""
    pending = iter(sizes) if source is not None else iter(())
    outgoing = chunks if to is not None else iter(())
    peers = [p for p in (to, source) if p is not None]

    def post(chunk: np.ndarray | None, size: int | None) -> tuple[list[Any], torch.Tensor | None]:
        posted = []
        if chunk is not None:
            posted.append(dist.isend(torch.from_numpy(chunk), to, group=group))
        incoming = None
        if size is not None:
            incoming = torch.empty(size, dtype=torch.uint8)
            posted.append(dist.irecv(incoming, source, group=group))
        return posted, incoming

    with _lost(lambda: f"rank(s) {peers}", lambda: peers):
        posted, incoming = post(next(outgoing, None), next(pending, None))
    while posted:
        following = next(outgoing, None)  # read while the current chunk travels
        with _lost(lambda: f"rank(s) {peers}", lambda: peers):
            for work in posted:
                assert work is not None  # (a rank of the group: torch gives its work)
                work.wait()
            posted, arrived = post(following, next(pending, None))
        if incoming is not None:
            yield incoming.numpy()
        incoming = arrived
