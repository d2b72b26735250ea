"""The node-local tier (:class:`~muonckpt.checkpoint.options.LocalTier`): a save's local
step written per node and copied to peers on other nodes, and :func:`recover`, which finds
the newest step complete across what survives and loads it at any world size.

A local step is a checkpoint like any other, made by the same steps (:mod:`.saving`) and the
same write engine (:mod:`muonckpt.files.writing`), with two differences: each node writes
into a directory of its own (:class:`muonckpt.storage.NodeStore`), and between the write and
the commit each rank's files are copied to the ranks :func:`placement` names on ``replicas``
other nodes over a gloo group made for it up front
(:func:`muonckpt.distributed.groups.tier_group`), never the job's groups; the commit
(:func:`muonckpt.files.writing.commit_on_nodes`) counts the step only when every copy
arrived with the digest it left with, and each node then publishes its directory, manifest
last. docs/format.md ("The node-local tier") states the protocol and its guarantees.
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from .. import storage
from ..distributed import collectives, group_steps, groups
from ..errors import CheckpointError, CheckpointWarning, OptionError
from ..files import retention, writing
from ..files.attempt import Attempt
from ..files.pieces import file_problems, indexes_for, read_manifest
from ..files.progress import Progress
from ..format.manifest import all_files
from ..format.manifest_json import parse_manifest
from ..format.names import MANIFEST_NAME
from ..state.placement import Joined, Optimizers, describe
from ..storage import access
from ..storage.node_local import COPY_CHUNK_BYTES
from ..storage.places import target
from . import saving
from .loading import LoadReport, load, load_node_copy
from .options import LocalTier

__all__ = ["Recovery", "TierSave", "placement", "recover"]


def placement(nodes: Sequence[int], replicas: int) -> list[list[int]]:
    """For each rank (by its place in ``nodes``, each rank's node) the ranks whose nodes keep
    a copy of its files: the rank of its own position on each of the next ``replicas`` nodes
    (in node order, wrapping), so that in each round of copies every rank sends to one rank
    and receives from one. Every node must run as many ranks, and there must be more nodes
    than ``replicas``."""
    distinct = sorted(set(nodes))
    members = {n: [i for i, m in enumerate(nodes) if m == n] for n in distinct}
    if len({len(m) for m in members.values()}) > 1:
        counts = {n: len(m) for n, m in members.items()}
        raise OptionError(f"LocalTier needs as many ranks on every node, got {counts}")
    if replicas > len(distinct) - 1:
        raise OptionError(
            f"LocalTier(replicas={replicas}) needs at least {replicas + 1} nodes, the job has "
            f"{len(distinct)} ({distinct})"
        )
    return [
        [
            members[distinct[(distinct.index(node) + j) % len(distinct)]][members[node].index(rank)]
            for j in range(1, replicas + 1)
        ]
        for rank, node in enumerate(nodes)
    ]


@dataclass(frozen=True)
class _Nodes:
    """The job's ranks by node, agreed over the tier's group: each rank's node, this rank's
    place, whether it leads its node (the first of its ranks: it publishes and copies)."""

    group: collectives.Group
    ranks: list[int]
    nodes: list[int]
    me: int

    @property
    def leader(self) -> bool:
        return self.nodes.index(self.nodes[self.me]) == self.me

    def leader_of(self, node: int) -> int:
        """The place of ``node``'s leader."""
        return self.nodes.index(node)

    def of_node(self, node: int) -> list[int]:
        """The places of ``node``'s ranks, its leader first."""
        return [i for i, n in enumerate(self.nodes) if n == node]

    def share(self, names: Sequence[str]) -> list[str]:
        """This rank's part of work its node splits among its ranks: every n-th of ``names``
        (sorted), n the node's ranks, from this rank's place among them."""
        mine = self.of_node(self.nodes[self.me])
        return sorted(names)[mine.index(self.me) :: len(mine)]


def _nodes(tier: LocalTier) -> _Nodes:
    """(every rank of the default group, in the foreground) The tier's group and every
    rank's node: both found the first time a save or recovery asks (a collective then), and
    kept for the group, so that later saves make no exchange of their own for it."""
    if not collectives.is_distributed():
        raise CheckpointError(
            "the node-local tier copies between the ranks of a process group: launch the job "
            "with torchrun (or initialize the default process group)"
        )
    group = groups.tier_group(timedelta(seconds=group_steps.rendezvous_timeout()))
    node = tier.node_id()
    known = _KNOWN.get(node)
    if known is None or known.group is not group:
        ranks = collectives.group_ranks(None)
        found = collectives.all_gather_json([node, uuid.uuid4().hex], group)
        nodes = [int(n) for n, _ in found]
        known = _Nodes(group, ranks, nodes, ranks.index(collectives.global_rank()))
        _refuse_a_shared_root(known, os.path.abspath(tier.root), found[0][1])
        _KNOWN[node] = known
    return known


def _refuse_a_shared_root(nodes: _Nodes, root: str, job: str) -> None:
    """(every rank) An :class:`OptionError` on every rank when two nodes' tier roots are one
    directory (a shared filesystem, or one path given to all): each node's leader marks its
    root for ``job`` (rank 0's token) and looks for another node's mark there."""
    node = nodes.nodes[nodes.me]
    if nodes.leader:
        storage.mark_node(root, job, node, present=True)
    seen = collectives.all_gather_json(
        storage.nodes_marked(root, job) if nodes.leader else [], nodes.group
    )
    if nodes.leader:
        storage.mark_node(root, job, node, present=False)
    shared = next((marked for marked in seen if len(marked) > 1), None)
    if shared is not None:
        raise OptionError(
            f"LocalTier: nodes {shared} were given one directory as their root ({root} on "
            f"node {node}); each node needs a directory of its own, on its own disk"
        )


_KNOWN: dict[int, _Nodes] = {}
"""By this process's node, the ranks by node found over the tier's group."""


@dataclass(frozen=True)
class TierSave:
    """A save's local step, decided in the foreground: its ranks by node, where each rank's
    files are copied (:func:`placement`), this node's directory of it, and whether the save
    also writes the durable target."""

    tier: LocalTier
    nodes: _Nodes
    holders: list[list[int]]
    final: Path
    durable: bool
    overwrite: bool
    """Whether the durable target may be replaced (the save's ``overwrite``)."""

    def placement(self) -> dict[str, Any]:
        """The manifest's ``replicas`` field."""
        return {"nodes": self.nodes.nodes, "holders": self.holders}


_SAVES: dict[str, int] = {}
"""Tiered saves made by this process, per tier root: what ``durable_every`` counts."""


def prepare(
    tier: LocalTier,
    path: str | os.PathLike[str],
    participants: Sequence[int],
    overwrite: bool,
) -> TierSave:
    """(every rank, after the save's rendezvous) The :class:`TierSave` of a save to ``path``:
    its local step is ``tier.root / NAME``, NAME the last component of ``path``. A local
    durable target that this save would write and may not (it exists, without
    ``overwrite``) is refused here, before the local step is written: a local step
    published beside a refused durable save would be recovered as if it had succeeded."""
    nodes = _nodes(tier)
    if list(participants) != nodes.ranks:
        raise CheckpointError("a LocalTier save needs every rank of the default group")
    root = os.path.abspath(tier.root)
    count = _SAVES[root] = _SAVES.get(root, 0) + 1
    durable = tier.durable_every > 0 and count % tier.durable_every == 0
    where = target(path)
    if durable and isinstance(where, Path):  # refused before the local step is published
        storage.check_target(where, overwrite)
    name = Path(str(where)).name
    holders = placement(nodes.nodes, tier.replicas)
    return TierSave(tier, nodes, holders, Path(root) / name, durable, overwrite)


def commit(steps: writing.Steps, prepared: saving.PreparedSave, save: TierSave) -> Path:
    """Write this rank's files into its node's staging directory, copy them to their holders
    (:func:`_replicate`), commit the step on every node and prune each node's older ones."""
    written = saving.write(prepared)
    copies = _replicate(save, prepared.staging, written)
    committed = writing.commit_on_nodes(
        steps,
        prepared.store,
        prepared.staging,
        save.final,
        written,
        copies,
        prepared.draft,
        save.placement(),
        save.nodes.leader,
    )
    if save.nodes.leader:
        _prune(save.final.parent, save.tier.keep_last, committed)
    return committed


def _files_of(written: writing.Written) -> list[str]:
    """The files a rank wrote: its data files and those of its ``extra`` / ``rank_extra``."""
    extra = written.extra or {}
    return [*written.files, *(f["name"] for f in extra.get("files", ()))]


def _replicate(
    save: TierSave, staging: Path, written: Attempt[writing.Written]
) -> Attempt[dict[str, Any]]:
    """Copy this rank's files to each of its holders and receive the files of the ranks it
    holds copies of, into ``staging``, round by round (one copy of every rank's files each);
    every rank takes part even when its write failed (then sending nothing). The digests of
    what it sent and received, for the commit's check, or the failure."""
    nodes = save.nodes
    try:
        mine = _files_of(written.value) if written.value is not None else []
        listing = [(name, storage.file_size(staging / name)) for name in mine]
        every = collectives.all_gather_json(listing, nodes.group)
        sent: dict[str, str] = {}
        received: dict[str, str] = {}
        for j in range(save.tier.replicas):
            source = next(i for i, held in enumerate(save.holders) if held[j] == nodes.me)
            to = save.holders[nodes.me][j]
            incoming = [(str(name), int(size)) for name, size in every[source]]
            chunks = _sending(staging, listing, sent)
            received |= _received(
                staging, incoming, nodes, chunks, nodes.ranks[to], nodes.ranks[source], sync=False
            )
        return Attempt({"sent": sent, "received": received})
    except BaseException as exc:
        return Attempt(failure=exc)


def _sending(staging: Path, files: list[tuple[str, int]], sent: dict[str, str]) -> Any:
    """The chunks of ``files`` in order, each file's digest put in ``sent`` once read."""
    for name, _ in files:
        hasher = storage.Digest()
        for chunk in storage.file_chunks(staging / name, COPY_CHUNK_BYTES):
            hasher.update(chunk)
            yield chunk
        sent[name] = hasher.hexdigest()


def _chunk_sizes(files: Sequence[tuple[str, int]]) -> list[int]:
    """The sizes of the chunks ``files`` travel in (:func:`storage.file_chunks`)."""
    return [
        min(COPY_CHUNK_BYTES, size - offset)
        for _, size in files
        for offset in range(0, size, COPY_CHUNK_BYTES)
    ]


def _received(
    directory: Path,
    files: Sequence[tuple[str, int]],
    nodes: _Nodes,
    chunks: Any,
    to: int | None,
    source: int | None,
    *,
    sync: bool = True,
) -> dict[str, str]:
    """Send ``chunks`` to global rank ``to`` while ``files`` come from global rank ``source``
    into ``directory``; each received file's digest. ``sync`` False: the files are not
    fsynced here (a save's copies: its publish fsyncs them)."""
    stream = collectives.relay(chunks, to, _chunk_sizes(files), source, nodes.group)
    digests = {}
    for name, size in files:
        sink = storage.ReceivedFile(directory, name, sync=sync)
        try:
            for _ in range(0, size, COPY_CHUNK_BYTES):
                sink.write(next(stream))
            digests[name] = sink.close()
        except BaseException:
            sink.abandon()
            raise
    for _ in stream:  # what is left to send once everything came
        pass
    return digests


def _prune(root: Path, keep_last: int | None, keep: Path) -> None:
    """(a node's leader) Delete every local step of this node that records a later step than
    ``keep``, the one just committed (this run went on from an older state: a rollback, or
    another run on the same nodes; recovery would take them for its newest), and all but the
    newest ``keep_last`` of the others (by the step recorded, then commit time; ``keep``
    always kept; None: all kept)."""
    steps = _local_steps(root)
    now = next((s.order()[:2] for s in steps if s.path == keep), None)
    gone = [s for s in steps if now is not None and s.order()[:2] > now]
    steps = [s for s in steps if s not in gone]
    if keep_last is not None:
        gone += [s for s in steps[: max(len(steps) - keep_last, 0)] if s.path != keep]
    for step in gone:
        storage.remove_checkpoint(step.path)


@dataclass(frozen=True)
class _LocalStep:
    """A local step in a node's directory: its manifest's digest and step, and what it
    lists."""

    path: Path
    digest: str
    step: int | None
    committed_ns: int
    files: list[tuple[str, int]]

    def order(self) -> tuple[bool, int, int, str]:
        return (self.step is not None, self.step or 0, self.committed_ns, self.path.name)


def _local_steps(root: Path) -> list[_LocalStep]:
    """The local steps under ``root`` whose manifests parse, oldest first."""
    found = []
    for name in storage.NodeStore().directories(root):
        files = storage.files_at(root / name)
        try:
            manifest = read_manifest(files, pieces=False)
            listed = [(f.name, f.bytes) for f in all_files(manifest)]
            listed += [(e.name, e.bytes) for e in manifest.indexes]
            found.append(
                _LocalStep(
                    root / name,
                    manifest.digest(),
                    manifest.step,
                    files.committed_ns(),
                    [*listed, (MANIFEST_NAME, files.size(MANIFEST_NAME) or 0)],
                )
            )
        except (CheckpointError, OSError):
            continue
    return sorted(found, key=_LocalStep.order)


@dataclass
class Recovery:
    """What :func:`recover` loaded, from where, and what it refused on the way."""

    path: str
    """The checkpoint loaded: this node's copy of a local step, or the durable one."""
    tier: str
    """``"local"`` or ``"durable"``."""
    step: int | None
    """The step it records."""
    fetched: list[str] = field(default_factory=list)
    """The files this rank received from other nodes for its node (its node's ranks share
    them)."""
    refused: list[str] = field(default_factory=list)
    """Copies found damaged (never applied), and local steps passed over, one line each."""
    report: LoadReport = field(default_factory=LoadReport)
    """The load's own report."""


def recover(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    tier: LocalTier,
    durable: str | os.PathLike[str] | None = None,
    *,
    params: bool = True,
    extra: MutableMapping[str, Any] | None = None,
    rank_extra: MutableMapping[str, Any] | None = None,
    progress: Progress | None = None,
    check: bool = True,
) -> Recovery:
    """Load the newest state that survives, at this job's own topology (any world size, any
    dp x tp): the newest local step complete across every node's directory of ``tier`` (its
    files' own copies and their replicas, each checked against its checksums before it is
    used: a damaged copy is refused, another used), unless the newest complete checkpoint
    under ``durable`` (the directory the durable saves go to, or an ``s3://`` prefix) records
    a later step. The ranks agree on it, each node copies the files its ranks read from a node
    that holds them (over the tier's gloo group), and every rank loads it as :func:`load`
    does. Without a complete local step the durable one is loaded, with a
    :class:`~muonckpt.errors.CheckpointWarning` saying so; with neither, a
    :class:`CheckpointError`. A collective of every rank of the default group.

    Args:
        optimizer: as for :func:`load`.
        tier: this node's tier (its ``root`` this node's directory).
        durable: where the durable saves go (the parent of their paths), or None.
        params, extra, rank_extra, progress, check: as for :func:`load`.
    """
    ranks = collectives.group_ranks(None)
    where = None if durable is None else storage.resolved_place(durable)
    agreement = {"durable": where, "tier": tier.agreement(), "params": params}
    group_steps.rendezvous("recover", ranks, agreement, CheckpointError)
    nodes = _nodes(tier)
    root = Path(os.path.abspath(tier.root))
    newest_durable = _newest_durable(durable) if nodes.me == 0 else None
    survey = _survey(root) if nodes.leader else {}
    found = collectives.all_gather_json([survey, newest_durable], nodes.group)
    durable_at, durable_step = found[0][1] or (None, None)
    surveys = {
        nodes.nodes[i]: survey
        for i, (survey, _) in enumerate(found)
        if nodes.leader_of(nodes.nodes[i]) == i
    }
    kept = [p.name for p in describe(_joined(optimizer)).local()]
    recovery = _recover_local(nodes, root, surveys, durable_step, kept)
    kwargs: dict[str, Any] = {
        "params": params,
        "extra": extra,
        "rank_extra": rank_extra,
        "progress": progress,
        "check": check,
    }
    if recovery is not None:
        recovery.report = load_node_copy(optimizer, recovery.path, **kwargs)
        return recovery
    if durable_at is None:
        raise CheckpointError(
            "no complete local step survives on the nodes of this job, and no durable "
            "checkpoint was found" + ("" if durable is None else f" under {durable}"),
            path=root,
        )
    warnings.warn(
        f"no complete local step survives that is as new as the durable checkpoint: "
        f"loading {durable_at} (step {durable_step})",
        CheckpointWarning,
        stacklevel=2,
    )
    report = load(optimizer, durable_at, **kwargs)
    return Recovery(str(durable_at), "durable", durable_step, report=report)


def _joined(optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> Optimizers:
    """``optimizer`` as :func:`load` describes it: one, or several joined."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    return optimizer[0] if len(optimizer) == 1 else Joined(list(optimizer))


def _newest_durable(durable: str | os.PathLike[str] | None) -> list[Any] | None:
    """(rank 0) The newest complete durable checkpoint and its step, or None."""
    if durable is None:
        return None
    found = retention.latest(durable)
    if found is None:
        return None
    return [str(found), read_manifest(storage.files_at(found), pieces=False).step]


def _survey(root: Path) -> dict[str, Any]:
    """(a node's leader) This node's local steps: by name, the manifest's digest, its step,
    every file it lists and which of them are here at their size."""
    return {
        step.path.name: {
            "digest": step.digest,
            "step": step.step,
            "files": step.files,
            "here": storage.present(step.path, step.files),
        }
        for step in _local_steps(root)
    }


@dataclass
class _Candidate:
    """A local step complete across the nodes' surveys: its name, step, the files it lists
    (name, size) and which nodes hold a copy of each that is not known to be damaged."""

    name: str
    digest: str
    step: int | None
    files: list[tuple[str, int]]
    holders: dict[str, list[int]]

    def complete(self) -> bool:
        return all(self.holders.get(name) for name, _ in self.files)

    def missing(self) -> list[str]:
        return [name for name, _ in self.files if not self.holders.get(name)]


def _candidates(surveys: dict[int, Any], durable_step: int | None) -> list[_Candidate]:
    """The local steps complete across ``surveys`` (node -> :func:`_survey`), newest first;
    none older than ``durable_step`` (the durable tier's newest)."""
    found: dict[tuple[str, str], _Candidate] = {}
    for node in sorted(surveys):
        for name, info in surveys[node].items():
            files = [(str(f), int(size)) for f, size in info["files"]]
            key = (name, info["digest"])
            step = found.setdefault(key, _Candidate(*key, info["step"], files, {}))
            for file in info["here"]:
                step.holders.setdefault(file, []).append(node)
    complete = [c for c in found.values() if c.complete()]
    if durable_step is not None:
        complete = [c for c in complete if c.step is not None and c.step >= durable_step]
    return sorted(complete, key=lambda c: (c.step is not None, c.step or 0, c.name), reverse=True)


def _is_data(name: str) -> bool:
    """Whether a file of a local step holds tensors (not the manifest, not a piece index)."""
    return name.endswith(".safetensors")


def _recover_local(
    nodes: _Nodes,
    root: Path,
    surveys: dict[int, Any],
    durable_step: int | None,
    kept: list[str],
) -> Recovery | None:
    """Make this node's copy of the newest sound local step complete: every node's copies of
    its data files checked (a damaged one is never used), each file this node lacks copied
    from a node with a sound one, the manifest last, and the copies checked in turn; the next
    older step when a file has no sound copy left. None: no local step to load."""
    refused: list[str] = []
    for candidate in _candidates(surveys, durable_step):
        here = root / candidate.name
        needed = _needed(nodes, here, candidate, kept)
        mine = [f for f, held in candidate.holders.items() if nodes.nodes[nodes.me] in held]
        useful = set().union(*needed.values())  # here, or to be sent from here
        damaged = _damaged(
            nodes, here, nodes.share([f for f in mine if _is_data(f) and f in useful])
        )
        fetched: list[str] = []
        for _ in range(_TRIES):
            _drop(candidate, damaged, refused)
            if not candidate.complete():
                refused.append(
                    f"local step {candidate.name}: no sound copy of {candidate.missing()[0]} "
                    "survives; an older step is used"
                )
                break
            got = _fetch(nodes, root, candidate, needed)
            fetched += got
            damaged = _damaged(nodes, here, [f for f in got if _is_data(f)])
            if not any(damaged.values()):
                if refused:
                    warnings.warn("; ".join(refused), CheckpointWarning, stacklevel=3)
                return Recovery(str(here), "local", candidate.step, fetched, refused)
    if refused:
        warnings.warn("; ".join(refused), CheckpointWarning, stacklevel=3)
    return None


_TRIES = 3
"""How many times a step's files are fetched before a copy that keeps arriving damaged makes
recovery pass to an older step."""


def _damaged(nodes: _Nodes, here: Path, names: list[str]) -> dict[int, dict[str, str]]:
    """Every node's damaged copies among the data files ``names`` each of its ranks checked
    in its copy ``here`` (every header and checksum; the ranks of a node check files of
    their own, at once), by node."""
    problems = file_problems(here, sorted(names)) if names else {}
    damaged: dict[int, dict[str, str]] = {}
    for i, found in enumerate(collectives.all_gather_json(problems, nodes.group)):
        if found:
            damaged.setdefault(nodes.nodes[i], {}).update(found)
    return damaged


def _drop(candidate: _Candidate, damaged: dict[int, dict[str, str]], refused: list[str]) -> None:
    """Take the ``damaged`` copies out of ``candidate``'s holders, each said in ``refused``."""
    for node, problems in sorted(damaged.items()):
        for file, problem in sorted(problems.items()):
            if node in candidate.holders.get(file, []):
                candidate.holders[file].remove(node)
                refused.append(f"node {node}'s copy of {file} is refused: {problem}")


def _needed(
    nodes: _Nodes, here: Path, candidate: _Candidate, kept: list[str]
) -> dict[int, set[str]]:
    """By node, the data files of ``candidate`` its ranks read: those whose piece indexes
    hold a param one of them keeps (``kept``, this rank's), and every file of the job's own
    state. The manifest's text comes from the first node that holds it."""
    holder = nodes.leader_of(candidate.holders[MANIFEST_NAME][0])
    text = storage.read_text(here / MANIFEST_NAME) if nodes.me == holder else None
    manifest = parse_manifest(collectives.all_gather_json(text, nodes.group)[holder], here)
    extra = manifest.extra.files if manifest.extra is not None else ()
    mine = [e.file for e in indexes_for(manifest, kept)] + [f.name for f in extra]
    needed: dict[int, set[str]] = {}
    for node, files in zip(
        nodes.nodes, collectives.all_gather_json(mine, nodes.group), strict=True
    ):
        needed.setdefault(node, set()).update(files)
    return needed


def _fetch(
    nodes: _Nodes, root: Path, candidate: _Candidate, needed: dict[int, set[str]]
) -> list[str]:
    """Copy to each node every file of ``candidate`` its ranks read (``needed``) and every
    piece index, that its node lacks, from the first node holding a sound copy; the files
    this rank received. The data files and indexes first, the i-th copy between two nodes
    through their i-th ranks (mod their count: the pairs copy at once), then the manifests,
    between the nodes' leaders; each phase ends when every copy of it is done. Every rank
    walks the same list of copies, taking part in its own."""
    here = root / candidate.name
    copies = []
    for node in sorted(set(nodes.nodes)):
        lacking = [
            (name, size)
            for name, size in candidate.files
            if node not in candidate.holders[name] and (name in needed[node] or not _is_data(name))
        ]
        copies += [(candidate.holders[name][0], node, name, size) for name, size in lacking]
    got = []
    for manifests in (False, True):
        phase = [c for c in copies if (c[2] == MANIFEST_NAME) == manifests]
        for i, (source, to, name, size) in enumerate(phase):
            pair = 0 if manifests else i  # the leaders, or the i-th ranks
            senders, receivers = nodes.of_node(source), nodes.of_node(to)
            sending, receiving = senders[pair % len(senders)], receivers[pair % len(receivers)]
            if nodes.me == sending:
                chunks = storage.file_chunks(here / name, COPY_CHUNK_BYTES)
                _received(here, [], nodes, chunks, nodes.ranks[receiving], None)
            elif nodes.me == receiving:
                access.make_directories(here)
                _received(here, [(name, size)], nodes, iter(()), None, nodes.ranks[sending])
                got.append(name)
            candidate.holders[name].append(to)
        if phase:  # every copy of the phase done on every node before the next
            collectives.all_gather_json(None, nodes.group)
    return got
