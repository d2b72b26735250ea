"""The checkpoint manifest: versioned dataclasses to and from JSON, with schema checks.

Pure: no tensors, no collectives, no file I/O. ``manifest.json`` is written last by a save and
is its commit marker; docs/format.md specifies every field.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from . import kinds
from .errors import CheckpointError
from .kinds import KNOWN
from .layout import Region, matrix_view

FORMAT_NAME = "muonckpt"
FORMAT_VERSION = 2
"""Version 2 added the params' own values (``value_dtype``, pieces of key :data:`PARAM_KEY`);
version 1 checkpoints are still read (they hold optimizer state only)."""
PARAM_KEY = "param"
"""The piece key of a param's own values, beside its state keys (never a state key itself)."""
CHECKSUM_ALGORITHM = "xxh3-64"
"""XXH3 64-bit (seed 0) of each chunk of a tensor's data, as 16 lowercase hex digits."""
MANIFEST_NAME = "manifest.json"
PER_RANK = "per-rank"
CONSOLIDATED = "consolidated"
KINDS = (PER_RANK, CONSOLIDATED)
_DIGEST = re.compile("[0-9a-f]{16}")

DTYPE_BYTES: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
"""Bytes per element of each safetensors dtype a checkpoint may hold."""

STATE_STEM = "optimizer"
"""Consolidated state goes to ``optimizer.safetensors`` (or ``optimizer-0000i-of-0000N``)."""
VALUE_STEM = "model"
"""Consolidated param values go to ``model.safetensors``, keyed by param name, as HF has it."""
CONSOLIDATED_FILE = f"{STATE_STEM}.safetensors"
INDEX_FILE = f"{STATE_STEM}.safetensors.index.json"
MODEL_FILE = f"{VALUE_STEM}.safetensors"
MODEL_INDEX_FILE = f"{VALUE_STEM}.safetensors.index.json"


def tensor_key(param: str, key: str) -> str:
    """The key a stored tensor has in its file: the param's name for its values, else torch's
    flattened optimizer-state key ``state.<param name>.<state key>``."""
    return param if key == PARAM_KEY else f"state.{param}.{key}"


def index_file(stem: str) -> str:
    """The Hugging Face style index of a family of sharded files."""
    return f"{stem}.safetensors.index.json"


def stem_of(key: str) -> str:
    """The consolidated file family of a stored tensor: values to ``model``, state to
    ``optimizer``."""
    return VALUE_STEM if key == PARAM_KEY else STATE_STEM


Rename = Callable[[str], str] | Mapping[str, str]
"""How :func:`muonckpt.load` and ``convert`` rename a checkpoint's params: a function of the
saved name, or prefix replacements (``{"module.": ""}`` strips DDP's prefix, ``{"": "model."}``
adds one; the longest matching prefix applies, names matching none stay)."""

WRAPPER_PREFIXES = {
    "module.": "DDP's or DataParallel's wrapper",
    "_orig_mod.": "torch.compile's wrapper",
    "model.": "a wrapping module named model",
}
"""Prefixes that wrappers add to every param name, and who adds them."""


def renamer(rename: Rename) -> Callable[[str], str]:
    """``rename`` as a function of the saved name (prefix replacements applied)."""
    if callable(rename):
        return rename
    if not isinstance(rename, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in rename.items()
    ):
        raise CheckpointError(
            f"rename must be a function of the name or a mapping of prefixes, got {rename!r}"
        )
    prefixes = sorted(rename, key=len, reverse=True)

    def replace_prefix(name: str) -> str:
        for old in prefixes:
            if name.startswith(old):
                return rename[old] + name[len(old) :]
        return name

    return replace_prefix


def prefix_fix(saved: Iterable[str], current: Iterable[str]) -> dict[str, str] | None:
    """The prefix replacement that turns the ``saved`` names into the ``current`` ones
    exactly (``{"module.": ""}``: strip DDP's prefix), or None when no prefix does."""
    saved, current = sorted(set(saved)), sorted(set(current))
    if not saved or saved == current or len(saved) != len(current):
        return None
    old, new = _dotted_prefix(saved), _dotted_prefix(current)
    while old and new and old.split(".")[-2] == new.split(".")[-2]:  # a shared tail stays
        old, new = old[: old.rstrip(".").rfind(".") + 1], new[: new.rstrip(".").rfind(".") + 1]
    if old == new or sorted(renamer({old: new})(n) for n in saved) != current:
        return None
    return {old: new}


def prefix_hint(saved: Iterable[str], current: Iterable[str]) -> str | None:
    """One sentence naming the prefix by which the checkpoint's (``saved``) and the
    optimizer's (``current``) names differ, and the ``rename`` that fixes it; None when they do
    not differ by a prefix."""
    fix = prefix_fix(saved, current)
    if fix is None:
        return None
    ((old, new),) = fix.items()

    def who(prefix: str) -> str:
        wrappers = [w for p, w in WRAPPER_PREFIXES.items() if f".{prefix}".find(f".{p}") >= 0]
        return f" ({', '.join(wrappers)})" if wrappers else ""

    if not new:
        differ = f"the checkpoint's start with {old!r}{who(old)}, the optimizer's do not"
    elif not old:
        differ = f"the optimizer's start with {new!r}{who(new)}, the checkpoint's do not"
    else:
        differ = f"the checkpoint's start with {old!r} where the optimizer's start with {new!r}"
    return (
        f"the param names differ by a prefix: {differ}; load(..., rename={fix!r}) maps them "
        f"(muonckpt convert: --rename {old}={new})"
    )


def _dotted_prefix(names: Sequence[str]) -> str:
    """The longest prefix of every name that ends with a dot ('' when none)."""
    first, last = min(names), max(names)
    common = 0
    while common < min(len(first), len(last)) and first[common] == last[common]:
        common += 1
    return first[: first.rfind(".", 0, common) + 1]


def rank_file(rank: int, world_size: int) -> str:
    """The file of rank ``rank``'s pieces in a per-rank checkpoint."""
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


EXTRA_FILE = "extra.safetensors"
"""The tensors of a save's ``extra`` (the training job's own state, the same on every rank)."""


def extra_rank_file(rank: int, world_size: int) -> str:
    """The tensors of rank ``rank``'s ``rank_extra`` (its own values: RNG, data position)."""
    return f"extra-rank-{rank:05d}-of-{world_size:05d}.safetensors"


EXTRA_DEPTH = 24
"""How deeply ``extra`` values may nest (the manifest around them takes the rest of
:data:`MAX_JSON_DEPTH`)."""
EXTRA_JSON_BYTES = 16 << 20
"""The most bytes of JSON one save's ``extra`` and ``rank_extra`` values may take in the
manifest; larger data goes in tensors."""


@dataclass(frozen=True, slots=True)
class Scalar:
    """A state value that is not a tensor shaped like its param: a plain number, or a 0-d tensor
    (torch keeps AdamW's ``step`` so), stored in the manifest itself."""

    value: int | float | bool | str | None
    dtype: str | None = None
    """safetensors dtype of a 0-d tensor; None for a plain Python number."""


@dataclass(frozen=True, slots=True)
class ParamEntry:
    """One param of the optimizer that was saved."""

    name: str
    shape: tuple[int, ...]
    """Full (logical) shape of the param, and of each of its stored tensors."""
    tp_split_dim: int
    """Dimension split across TP ranks in the source run (-1: replicated)."""
    group: int
    """Index of its param group."""
    dtypes: Mapping[str, str]
    """safetensors dtype of each stored tensor, by key: its state tensors (shaped like the
    param) and, when saved, its own values under :data:`PARAM_KEY`."""
    scalars: Mapping[str, Scalar] = field(default_factory=dict)
    """Its state values that are numbers or 0-d tensors, by key."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def state_keys(self) -> tuple[str, ...]:
        """Keys of its state tensors, sorted (empty: no tensor state)."""
        return tuple(sorted(k for k in self.dtypes if k != PARAM_KEY))

    @property
    def value_dtype(self) -> str | None:
        """dtype of the param's own saved values; None when they were not saved."""
        return self.dtypes.get(PARAM_KEY)

    @property
    def tensor_keys(self) -> tuple[str, ...]:
        """Keys of everything stored for the param: its state keys, then :data:`PARAM_KEY`."""
        return self.state_keys + ((PARAM_KEY,) if self.value_dtype is not None else ())

    def dtype_of(self, key: str) -> str:
        """The safetensors dtype of the stored tensor ``key`` (a state key or the values)."""
        return self.dtypes[key]


@dataclass(frozen=True)
class GroupEntry:
    """One param group: its hyperparameters (step counter included) and its params' names."""

    hyperparams: dict[str, Any]
    params: tuple[str, ...]
    optimizer: dict[str, Any] = field(default_factory=dict)
    """What the group computed (:class:`muonckpt.kinds.GroupKind` as JSON: optimizer class,
    Muon or AdamW, momentum form, mu, nesterov, lr scale rule, where AdamW counts steps);
    empty when unknown (version 1)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """One stored tensor: a region of one param's state tensor, in one file."""

    param: str
    key: str
    file: str
    tensor: str
    """Key of the tensor inside the safetensors file."""
    region: Region
    """Which elements of the full tensor it holds, in its own (flat) order."""
    checksums: tuple[str, ...]
    """One checksum per ``chunk_bytes`` of the tensor's data."""
    chunk_bytes: int


@dataclass(frozen=True)
class ModelFile:
    """What a consolidated save given the model (``save(..., model=model)``) adds to
    ``model.safetensors`` beyond the optimizer's params, so that it holds the model's whole
    ``state_dict()``."""

    tensors: tuple[ParamEntry, ...]
    """The model's other tensors (buffers, params no optimizer group holds), each stored
    whole under its name (group -1, never split)."""
    pieces: tuple[Piece, ...]
    """Where each of them is stored, with its checksums."""
    aliases: Mapping[str, str] = field(default_factory=dict)
    """state_dict names of tied tensors stored once: alias -> the stored name (as
    ``safetensors.torch.save_model`` records them in the file's metadata)."""


@dataclass(frozen=True, slots=True)
class FileEntry:
    name: str
    bytes: int


ValuePath = tuple[str | int, ...]
"""Where a value lies in a tree of ``extra`` values: dict keys and list indices."""


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
    pieces: tuple[Piece, ...]
    format_version: int = FORMAT_VERSION
    checksum_algorithm: str = CHECKSUM_ALGORITHM
    model: ModelFile | None = None
    """A consolidated save's model tensors beyond the optimizer's params (None: none)."""
    recorded_step: int | None = None
    """The training step the save recorded (``"step"``): ``extra["step"]`` when given, else
    the optimizer's own count where it keeps one; None: unknown (and in older manifests)."""
    extra: Extra | None = None
    """The training job's own state (``"extra"``); None: none was saved."""

    def param(self, name: str) -> ParamEntry:
        by_name = self.__dict__.get("_by_name")
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
                raise CheckpointError(f"rename gave {new!r}, not a name", param=entry.name)
            names[entry.name] = new
        seen: dict[str, str] = {}
        for old, new in names.items():
            if new in seen:
                raise CheckpointError(
                    f"rename gives params {seen[new]!r} and {old!r} one name {new!r}"
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
            model=model,
            groups=tuple(replace(g, params=tuple(names[n] for n in g.params)) for g in self.groups),
            params=tuple(replace(e, name=names[e.name]) for e in self.params),
            pieces=tuple(replace(p, param=names[p.param]) for p in self.pieces),
        )

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

    def json_chunks(self) -> Iterator[str]:
        """The text of :meth:`to_json` in consecutive pieces, each line made as it is asked
        for (the text of 100k params is 89 MB: written or hashed so, it is never whole).

        Built field by field: ``dataclasses.asdict`` deep-copies every value, seconds at 100k
        params."""
        lists: dict[str, tuple[Sequence[Any], Callable[[Any], Any]]] = {
            "groups": (self.groups, _group_to_json),
            "params": (self.params, _param_to_json),
            "files": (self.files, _file_to_json),
            "pieces": (self.pieces, piece_to_json),
        }
        body: dict[str, Any] = {
            "format": FORMAT_NAME,
            "kind": self.kind,
            "topology": dict(self.topology),
            **dict.fromkeys(lists),
            "format_version": self.format_version,
            "checksum_algorithm": self.checksum_algorithm,
            "step": self.recorded_step,
            "extra": None if self.extra is None else extra_to_json(self.extra),
        }
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
            yield (",\n" if index else "") + _compact(key) + ": "
            items, to_json = lists.get(key, ((), _compact))
            if not items:
                yield _compact([] if key in lists else value)
                continue
            yield "[\n"
            for number, item in enumerate(items):
                yield (",\n" if number else "") + _compact(to_json(item))
            yield "\n]"
        yield "\n}\n"

    def coverage_problems(self) -> list[str]:
        """Gaps, overlaps and stray pieces: every state tensor must be covered exactly once."""
        problems = []
        grouped, covered = self.pieces_of(), 0
        for entry in self.params:
            for key in entry.tensor_keys:
                pieces = grouped[entry.name, key]
                covered += len(pieces)
                problems += _coverage(entry, key, pieces)
        if self.model is not None:
            held = defaultdict(list)
            for piece in self.model.pieces:
                held[piece.param].append(piece)
            for entry in self.model.tensors:
                problems += _coverage(entry, PARAM_KEY, held.get(entry.name, []))
        if covered != len(self.pieces):  # pieces of tensors that no param lists
            listed = {(entry.name, key) for entry in self.params for key in entry.tensor_keys}
            strays = dict.fromkeys((p.param, p.key) for p in self.pieces)
            problems += [
                f"piece of param {param!r} state {key!r} that the manifest's params do not list"
                for param, key in strays
                if (param, key) not in listed
            ]
        return problems


class PieceIndex:
    """The pieces of each stored tensor, by (param, key); a tensor that none holds has none.

    One dict per key, of each param's piece, or of its list where several pieces hold it: most
    tensors have one, and a dict of (param, key) tuples and lists took 55 MB at 100k params."""

    __slots__ = ("_by_key",)

    def __init__(self, pieces: Iterable[Piece]) -> None:
        self._by_key: dict[str, dict[str, Piece | list[Piece]]] = {}
        for piece in pieces:
            held = self._by_key.setdefault(piece.key, {})
            found = held.get(piece.param)
            if found is None:
                held[piece.param] = piece
            elif isinstance(found, list):
                found.append(piece)
            else:
                held[piece.param] = [found, piece]

    def __getitem__(self, tensor: tuple[str, str]) -> Sequence[Piece]:
        param, key = tensor
        found = self._by_key.get(key, {}).get(param)
        if found is None:
            return ()
        return found if isinstance(found, list) else (found,)


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def _group_to_json(g: GroupEntry) -> dict[str, Any]:
    return {"hyperparams": g.hyperparams, "params": list(g.params), "optimizer": g.optimizer}


def _param_to_json(e: ParamEntry) -> dict[str, Any]:
    return {
        "name": e.name,
        "shape": list(e.shape),
        "tp_split_dim": e.tp_split_dim,
        "group": e.group,
        "dtypes": dict(e.dtypes),
        "scalars": {k: {"value": v.value, "dtype": v.dtype} for k, v in e.scalars.items()},
    }


def _file_to_json(f: FileEntry) -> dict[str, Any]:
    return {"name": f.name, "bytes": f.bytes}


def _coverage(entry: ParamEntry, key: str, pieces: Sequence[Piece]) -> list[str]:
    intervals = sorted(iv for piece in pieces for iv in piece.region.intervals())
    where = f"param {entry.name!r} state {key!r}"
    cursor = 0
    for lo, hi in intervals:
        if lo < cursor:
            return [f"{where}: elements [{lo}, {min(hi, cursor)}) stored twice (overlap)"]
        if lo > cursor:
            return [f"{where}: elements [{cursor}, {lo}) stored nowhere (gap)"]
        cursor = hi
    if cursor != entry.numel:
        return [f"{where}: elements [{cursor}, {entry.numel}) stored nowhere (gap)"]
    return []


MAX_JSON_DEPTH = 32
"""How deeply a manifest's JSON may nest (a manifest needs 6 levels; hyperparameters such as
AdamW's ``betas`` one more each)."""


def strict_json(text: str | bytes, objects: Callable[[dict[str, Any]], Any] | None = None) -> Any:
    """``json.loads`` as the format requires: numbers finite (no ``NaN``, ``Infinity`` or a
    float that overflows to one), no key twice in an object, at most :data:`MAX_JSON_DEPTH`
    levels. Raises ValueError otherwise.

    ``objects``, when given, turns each JSON object (a dict, innermost first) into what the
    result holds instead, as it is parsed (so that 300k pieces are never all dicts at once)."""
    body = json.loads(text, **_strict_options(objects))
    _check_depth(body, 0)
    return body


def _strict_options(objects: Callable[[dict[str, Any]], Any] | None) -> dict[str, Any]:
    """The decoder options of :func:`strict_json`."""

    def finite(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            raise ValueError(f"number {literal} is not finite")
        return value

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not a JSON number")

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        body = dict(pairs)
        if len(body) != len(pairs):
            counts = Counter(key for key, _ in pairs)
            twice = sorted(key for key, count in counts.items() if count > 1)
            raise ValueError(f"key(s) {twice[:3]} appear twice in one object")
        return body if objects is None else objects(body)

    return {"parse_float": finite, "parse_constant": refuse, "object_pairs_hook": unique}


def _check_depth(value: Any, above: int) -> None:
    """Refuse ``value`` if, found ``above`` levels deep, it nests past :data:`MAX_JSON_DEPTH`."""
    level, deepest = [value], 1 + above
    while level:
        inner = [v for item in level for v in _children(item) if isinstance(v, (dict, list))]
        if inner:
            deepest += 1
            if deepest > MAX_JSON_DEPTH:
                raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep")
        level = inner


def strict_json_chunks(
    chunks: Iterable[str],
    objects: Callable[[dict[str, Any]], Any] | None = None,
    elements: Mapping[str, Callable[[Any], Any]] | None = None,
) -> Any:
    """:func:`strict_json` of the text that ``chunks`` make up, for a JSON object (a
    manifest), without ever holding the text whole: each member, and each element of a member
    that is an array, is parsed from a window of the text (100k params make an 89 MB
    manifest). ``elements[name]``, when given, turns each element of the array member ``name``
    into what the result holds instead, as it is parsed. Raises ValueError for anything that
    is not a strict JSON object; which problem it names may differ from :func:`strict_json` (a
    caller that shows it parses again)."""
    return _JsonStream(chunks, objects, elements or {}).document()


_WHITESPACE = re.compile(r"[ \t\n\r]*")
_AFTER_VALUE = " \t\n\r,:]}"


class _JsonStream:
    """A JSON object parsed from a window onto a stream of text (:func:`strict_json_chunks`)."""

    def __init__(
        self,
        chunks: Iterable[str],
        objects: Callable[[dict[str, Any]], Any] | None,
        elements: Mapping[str, Callable[[Any], Any]],
    ) -> None:
        self._chunks, self._elements = iter(chunks), elements
        self._scan = json.JSONDecoder(**_strict_options(objects)).scan_once  # type: ignore[attr-defined]
        self._objects = objects
        self._text, self._pos, self._eof = "", 0, False

    def document(self) -> Any:
        self._expect("{")
        body: dict[str, Any] = {}
        while self._next() != "}" or body:
            if self._next() != '"':
                raise ValueError("expected a member name")
            key = self._value(0)
            self._expect(":")
            if key in body:
                raise ValueError(f"key(s) {[key]} appear twice in one object")
            is_array = self._next() == "["
            body[key] = self._array(self._elements.get(key)) if is_array else self._value(1)
            if self._next() != ",":
                break
            self._pos += 1
        self._expect("}")
        if self._next():
            raise ValueError("extra data after the object")
        return body if self._objects is None else self._objects(body)

    def _array(self, convert: Callable[[Any], Any] | None) -> list[Any]:
        self._expect("[")
        items: list[Any] = []
        while self._next() != "]" or items:
            item = self._value(2)
            items.append(item if convert is None else convert(item))
            if self._next() != ",":
                break
            self._pos += 1
        self._expect("]")
        return items

    def _value(self, above: int) -> Any:
        """The value at the position, found ``above`` levels deep."""
        self._next()
        while True:
            try:
                value, end = self._scan(self._text, self._pos)
            except (StopIteration, json.JSONDecodeError):  # perhaps cut off by the window
                if self._more():
                    continue
                raise ValueError("not a JSON value") from None
            cut = end == len(self._text) or self._text[end] not in _AFTER_VALUE
            if cut and self._more():  # a number cut by the window ("2." of "2.5"): read on
                continue
            self._pos = end
            _check_depth(value, above)
            return value

    def _expect(self, char: str) -> None:
        if self._next() != char:
            raise ValueError(f"expected {char!r}")
        self._pos += 1

    def _next(self) -> str:
        """The next character after whitespace ('' at the end)."""
        while True:
            self._pos = _WHITESPACE.match(self._text, self._pos).end()  # type: ignore[union-attr]
            if self._pos < len(self._text):
                return self._text[self._pos]
            if not self._more():
                return ""

    def _more(self) -> bool:
        """Extend the window by at least what it holds (past the position); False at the end."""
        if self._eof:
            return False
        self._text = self._text[self._pos :]
        self._pos = 0
        added: list[str] = []
        while sum(map(len, added)) <= len(self._text):
            chunk = next(self._chunks, None)
            if chunk is None:
                self._eof = True
                break
            added.append(chunk)
        self._text += "".join(added)
        return bool(added)


def _children(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return list(value.values())
    return list(value) if isinstance(value, list) else []


def parse_manifest(text: str | bytes, source: object) -> Manifest:
    """Parse and schema-check a manifest; every problem is a :class:`CheckpointError`."""
    shared = _Shared()
    return _checked(lambda: strict_json(text, shared.piece), shared, source)


def parse_manifest_chunks(chunks: Iterable[str], source: object) -> Manifest:
    """:func:`parse_manifest` of the text that ``chunks`` make up, never held whole
    (:func:`strict_json_chunks`). A problem may be named otherwise than
    :func:`parse_manifest` names it: to show one, parse the whole text again."""
    shared = _Shared()
    parse = lambda: strict_json_chunks(chunks, shared.piece, {"params": shared.param})  # noqa: E731
    return _checked(parse, shared, source)


def _checked(parse: Callable[[], Any], shared: _Shared, source: object) -> Manifest:
    try:
        body = parse()
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(f"manifest is not valid JSON: {exc!r:.200}", path=source) from None
    try:
        return _manifest_from(body, shared)
    except CheckpointError as exc:
        raise CheckpointError(str(exc), path=source) from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(
            f"manifest does not follow the format: {exc!r}", path=source
        ) from None


def _manifest_from(body: Any, shared: _Shared) -> Manifest:
    _expect(isinstance(body, dict), "manifest is not a JSON object")
    _expect(body.get("format") == FORMAT_NAME, "not a muonckpt manifest (format field)")
    version = body.get("format_version")
    _expect(_pos_int(version), "format_version missing or not a positive int")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"format version {version} is newer than this muonckpt reads ({FORMAT_VERSION}); "
            "upgrade muonckpt"
        )
    _expect(body["kind"] in KINDS, f"unknown kind {body['kind']!r}")
    _expect(
        body["checksum_algorithm"] == CHECKSUM_ALGORITHM,
        f"checksum_algorithm {body['checksum_algorithm']!r} is not {CHECKSUM_ALGORITHM!r}",
    )
    topology = body["topology"]
    _expect(
        isinstance(topology, dict) and all(_pos_int(v) for v in topology.values()),
        "topology must map names to positive ints",
    )
    params = tuple(shared.entry(p, version) for p in body["params"])
    names = [p.name for p in params]
    _expect(len(set(names)) == len(names), "duplicate param names")
    for p in params:
        _expect(not set(p.scalars) & set(p.dtypes), f"param {p.name!r}: a key is stored twice")
    with_values = {p.value_dtype is not None for p in params}
    _expect(len(with_values) <= 1, "some params have saved values and others not")
    groups = tuple(
        GroupEntry(
            hyperparams=_hyperparams(g["hyperparams"]),
            params=tuple(sys.intern(_str(n)) for n in g["params"]),
            optimizer=_group_optimizer(g.get("optimizer", {})),
        )
        for g in body["groups"]
    )
    _expect(
        sorted(n for g in groups for n in g.params) == sorted(names),
        "groups and params list different names",
    )
    by_name = {p.name: p for p in params}
    for index, group in enumerate(groups):
        for name in group.params:
            _expect(
                by_name[name].group == index,
                f"param {name!r} says group {by_name[name].group}, but group {index} lists it",
            )
    files = tuple(FileEntry(_safe_name(f["name"]), _nonneg_int(f["bytes"])) for f in body["files"])
    file_names = {f.name for f in files}
    pieces = []
    raw_pieces = body["pieces"]
    _expect(isinstance(raw_pieces, list), "pieces must be a list")
    for raw in raw_pieces:
        piece = raw if isinstance(raw, Piece) else piece_from_json(raw)
        _expect(
            piece.file in file_names, f"piece {piece.tensor!r} names unlisted file {piece.file!r}"
        )
        entry = by_name.get(piece.param)
        if entry is None:
            raise CheckpointError(f"piece {piece.tensor!r} of unknown param {piece.param!r}")
        _expect(
            piece.key in entry.dtypes,
            f"piece {piece.tensor!r}: param {piece.param!r} lists no stored key {piece.key!r}",
        )
        _check_region(entry, piece.region, piece.tensor)
        pieces.append(piece)
    step = body.get("step")
    _expect(step is None or _int(step) >= 0, f"step must be a non-negative int, got {step!r}")
    extra = body.get("extra")
    return Manifest(
        kind=body["kind"],
        topology=dict(topology),
        groups=groups,
        params=params,
        files=files,
        pieces=tuple(pieces),
        format_version=version,
        model=_model_file(body["model"], by_name, file_names) if "model" in body else None,
        recorded_step=step,
        extra=None if extra is None else extra_from_json(extra, file_names),
    )


def _one(pool: dict[Any, Any], value: Any) -> Any:
    """``value``, or the equal one already in ``pool`` (frozen values: shared, not copied)."""
    return pool.setdefault(tuple(value.items()) if isinstance(value, dict) else value, value)


def model_tensor(name: str, shape: Sequence[int], dtype: str) -> ParamEntry:
    """A model tensor of :class:`ModelFile`: stored whole, in no group."""
    return ParamEntry(name, tuple(shape), -1, -1, {PARAM_KEY: dtype})


def _model_file(raw: Any, params: Mapping[str, ParamEntry], file_names: set[str]) -> ModelFile:
    _expect(isinstance(raw, dict), "model is not a JSON object")
    tensors = tuple(
        model_tensor(_str(t["name"]), [_nonneg_int(n) for n in t["shape"]], _dtypes_of(t["dtype"]))
        for t in raw["tensors"]
    )
    by_name = {t.name: t for t in tensors}
    _expect(len(by_name) == len(tensors), "model: a tensor listed twice")
    _expect(not set(by_name) & set(params), "model: a tensor named like an optimizer param")
    pieces = []
    for item in raw["pieces"]:
        piece = item if isinstance(item, Piece) else piece_from_json(item)
        entry = by_name.get(piece.param)
        if entry is None:
            raise CheckpointError(f"model: piece of unknown tensor {piece.param!r}")
        _expect(
            piece.key == PARAM_KEY and piece.file in file_names, f"model: piece {piece.tensor!r}"
        )
        _check_region(entry, piece.region, piece.tensor)
        pieces.append(piece)
    aliases = raw["aliases"]
    stored = set(by_name) | set(params)
    _expect(
        isinstance(aliases, dict)
        and all(isinstance(k, str) and v in stored and k not in stored for k, v in aliases.items()),
        "model: aliases must map other names to stored tensors",
    )
    return ModelFile(tensors, tuple(pieces), dict(aliases))


def _dtypes_of(value: Any) -> str:
    _expect(value in DTYPE_BYTES, f"unknown dtype {value!r}")
    return value


def extra_to_json(extra: Extra) -> dict[str, Any]:
    """An :class:`Extra` in its JSON form (what :func:`extra_from_json` reads)."""

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


def extra_from_json(raw: Any, data_files: Iterable[str] = ()) -> Extra:
    """A schema-checked :class:`Extra`: its files plain names of no data file, each tensor in
    a listed file, at a path of its values that holds ``null``, no two at one path or under
    one file key, and as many checksums as its bytes need."""
    _expect(isinstance(raw, dict), "extra must be an object")
    _expect(
        set(raw) == {"global", "ranks", "files"},
        f"extra has fields {sorted(raw)}, not ['files', 'global', 'ranks']",
    )
    _expect(isinstance(raw["files"], list), "extra files must be a list")
    files = tuple(FileEntry(_safe_name(f["name"]), _nonneg_int(f["bytes"])) for f in raw["files"])
    names = [f.name for f in files]
    _expect(len(set(names)) == len(names), "extra lists a file twice")
    taken = set(names) & (set(data_files) | {MANIFEST_NAME})
    _expect(not taken, f"extra file(s) {sorted(taken)} are the optimizer's files")
    _expect(isinstance(raw["ranks"], list), "extra ranks must be a list")
    shared = None if raw["global"] is None else _extra_values(raw["global"], "extra")
    ranks = tuple(_extra_values(r, f"rank_extra[{i}]") for i, r in enumerate(raw["ranks"]))
    extra = Extra(shared, ranks, files)
    keys = [(t.file, t.tensor) for t in extra.tensors()]
    _expect(len(set(keys)) == len(keys), "two extra tensors are stored under one file key")
    unlisted = sorted({t.file for t in extra.tensors()} - set(names))
    _expect(not unlisted, f"extra tensors name unlisted file(s) {unlisted}")
    owners = [f for _, tree in extra.trees() for f in {t.file for t in tree.tensors}]
    _expect(len(set(owners)) == len(owners), "two trees of extra share a file")
    return extra


def _extra_values(raw: Any, where: str) -> ExtraValues:
    _expect(isinstance(raw, dict) and set(raw) == {"values", "tensors"}, f"{where}: bad fields")
    _expect(isinstance(raw["tensors"], list), f"{where}: tensors must be a list")
    values, tensors = _as_json(raw["values"]), []
    paths = set()
    for item in raw["tensors"]:
        _expect(
            isinstance(item, dict) and set(item) == set(_EXTRA_TENSOR_FIELDS),
            f"{where}: a tensor entry must have exactly the fields {list(_EXTRA_TENSOR_FIELDS)}",
        )
        for name in ("path", "shape", "checksums"):
            _expect(isinstance(item[name], list), f"{where}: a tensor's {name} must be a list")
        path = tuple(item["path"])
        _expect(bool(path), f"{where}: a tensor with an empty path (the values are a dict)")
        for step in path:
            _expect(
                isinstance(step, str) or (isinstance(step, int) and not isinstance(step, bool)),
                f"{where}: tensor path {list(path)} holds {step!r}",
            )
        _expect(path not in paths, f"{where}: two tensors at {list(path)}")
        _expect(_holds_null(values, path), f"{where}: tensor path {list(path)} is not a null")
        paths.add(path)
        dtype = _str(item["dtype"])
        _expect(dtype in DTYPE_BYTES, f"{where} {list(path)}: unknown dtype {dtype!r}")
        tensor = ExtraTensor(
            path=path,
            file=_safe_name(item["file"]),
            tensor=_str(item["tensor"]),
            dtype=dtype,
            shape=tuple(_nonneg_int(n) for n in item["shape"]),
            checksums=tuple(_digest(c) for c in item["checksums"]),
            chunk_bytes=_pos_int_value(item["chunk_bytes"]),
        )
        _expect(
            len(tensor.checksums) == -(-tensor.nbytes // tensor.chunk_bytes),
            f"{where} {list(path)}: {len(tensor.checksums)} checksums for {tensor.nbytes} bytes",
        )
        tensors.append(tensor)
    return ExtraValues(values, tuple(tensors))


_EXTRA_TENSOR_FIELDS = ("path", "file", "tensor", "dtype", "shape", "checksums", "chunk_bytes")


def _holds_null(values: Any, path: ValuePath) -> bool:
    """Whether ``path`` leads to a ``null`` in ``values``."""
    for step in path:
        if isinstance(values, dict) and isinstance(step, str) and step in values:
            values = values[step]
            continue
        if isinstance(values, list) and isinstance(step, int) and 0 <= step < len(values):
            values = values[step]
            continue
        return False
    return values is None


def piece_to_json(piece: Piece) -> dict[str, Any]:
    """A :class:`Piece` in its JSON form (what :func:`piece_from_json` reads)."""
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


_REGION_FIELDS = ("cols", "block_start", "block_width", "start", "stop")


def piece_from_json(
    raw: Mapping[str, Any], regions: dict[tuple[int, ...], Region] | None = None
) -> Piece:
    """A schema-checked :class:`Piece` from its JSON form (as in ``manifest.json``).

    Its names are interned: a manifest of 100k params repeats each file name in every piece,
    and a file's header names each tensor again. Equal regions are one object, kept in
    ``regions`` (one dict for a whole manifest)."""
    bounds = tuple(_nonneg_int(raw["region"][k]) for k in _REGION_FIELDS)
    region = regions.get(bounds) if regions is not None else None
    if region is None:
        region = Region(*bounds)
        if regions is not None:
            regions[bounds] = region
    return Piece(
        param=sys.intern(_str(raw["param"])),
        key=sys.intern(_str(raw["key"])),
        file=sys.intern(_safe_name(raw["file"])),
        tensor=sys.intern(_str(raw["tensor"])),
        region=region,
        checksums=tuple(_digest(c) for c in raw["checksums"]),
        chunk_bytes=_pos_int_value(raw["chunk_bytes"]),
    )


def _check_region(entry: ParamEntry, region: Region, tensor: str) -> None:
    numel = entry.numel
    ok = (
        (region.block_width > 0 or region.start == region.stop)
        and region.block_start + region.block_width <= region.cols
        and region.start <= region.stop
    )
    if ok and region.cols and region.numel:
        rows = numel // region.cols if numel % region.cols == 0 else -1
        ok = rows >= 0 and region.stop <= rows * region.block_width
    if ok and region.numel and region.block_width != region.cols:
        ok = region.cols == matrix_view(entry.shape, entry.tp_split_dim)[1]
    if not ok:
        raise CheckpointError(
            f"piece {tensor!r}: region {asdict(region)} lies outside param shape {entry.shape}"
        )


def _hyperparams(raw: Any) -> dict[str, Any]:
    _expect(isinstance(raw, dict), "group hyperparams must be an object")
    if "step" in raw:
        _nonneg_int(raw["step"])
    return _as_json(raw)


_PIECE_FIELDS = ("param", "key", "file", "tensor", "region", "checksums", "chunk_bytes")


class _Shared:
    """What one manifest's parse shares: equal regions, shapes and dtypes as one object each
    (frozen, so shared, not copied), and the hooks that make pieces and params as soon as
    their objects are parsed (a manifest of 100k params holds 300k pieces: a dict each, all
    alive at once, was most of the memory a reader needed)."""

    def __init__(self) -> None:
        self.regions: dict[tuple[int, ...], Region] = {}
        self._shapes: dict[Any, Any] = {}
        self._dtypes: dict[Any, Any] = {}
        self._no_scalars: dict[str, Scalar] = {}

    def piece(self, raw: dict[str, Any]) -> Any:
        """(the objects hook of :func:`strict_json`) A piece-shaped object as a piece; anything
        else, and such an object that is not a valid piece, stays a dict (checked where it is
        used)."""
        if len(raw) != len(_PIECE_FIELDS) or any(k not in raw for k in _PIECE_FIELDS):
            return raw
        try:
            return piece_from_json(raw, self.regions)
        except (CheckpointError, KeyError, TypeError, ValueError, AttributeError):
            return raw

    def param(self, raw: Any) -> Any:
        """(for each element of ``params``) A param of the current format as a
        :class:`ParamEntry`; anything else stays as it is (checked by :meth:`entry`)."""
        if not isinstance(raw, dict) or set(raw) - {"scalars"} != _PARAM_FIELDS:
            return raw
        try:
            return self.entry(raw, FORMAT_VERSION)
        except (CheckpointError, KeyError, TypeError, ValueError, AttributeError):
            return raw

    def entry(self, raw: Any, version: int) -> ParamEntry:
        """A schema-checked param of a manifest of format ``version``."""
        if isinstance(raw, ParamEntry):  # made by param() as the current format reads it
            if version < 2:
                raise KeyError("state_keys")  # what the fields of format 1 lack
            return raw
        return ParamEntry(
            name=sys.intern(_str(raw["name"])),
            shape=_one(self._shapes, tuple(_nonneg_int(s) for s in raw["shape"])),
            tp_split_dim=_int(raw["tp_split_dim"]),
            group=_nonneg_int(raw["group"]),
            dtypes=_one(self._dtypes, _dtypes(raw, version)),
            scalars=_scalars(raw.get("scalars", {}) if version >= 2 else {}) or self._no_scalars,
        )


_PARAM_FIELDS = {"name", "shape", "tp_split_dim", "group", "dtypes"}


def _as_json(value: Any) -> Any:
    """``value`` with any :class:`Piece` the parser made of a piece-shaped object (found where
    no piece belongs: a hyperparameter) back in its JSON form."""
    if isinstance(value, Piece):
        return piece_to_json(value)
    if isinstance(value, dict):
        return {k: _as_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_json(v) for v in value]
    return value


def _dtypes(raw: Mapping[str, Any], version: int) -> dict[str, str]:
    """Each stored key's dtype: version 2 lists them, version 1 has one dtype for all state."""
    if version < 2:
        keys = [_str(k) for k in raw["state_keys"]]
        _expect(PARAM_KEY not in keys, f"state key {PARAM_KEY!r} is reserved for the values")
        return {k: _str(raw["dtype"]) for k in keys}
    dtypes = raw["dtypes"]
    _expect(isinstance(dtypes, dict), "dtypes must map stored keys to dtype strings")
    return {sys.intern(_str(k)): sys.intern(_str(v)) for k, v in dtypes.items()}


def _scalars(raw: Any) -> dict[str, Scalar]:
    _expect(isinstance(raw, dict), "scalars must map state keys to values")
    scalars = {}
    for key, item in raw.items():
        _expect(isinstance(item, dict), f"scalar {key!r} must be an object")
        value, dtype = item.get("value"), item.get("dtype")
        _expect(
            value is None or isinstance(value, (int, float, bool, str)),
            f"scalar {key!r} must hold a number, a string or null",
        )
        _expect(dtype is None or dtype in DTYPE_BYTES, f"scalar {key!r}: unknown dtype {dtype!r}")
        if dtype is not None:
            _expect(_fits(value, dtype), f"scalar {key!r}: {value!r} is not a {dtype} value")
        if key == "step":
            _expect(
                value is None or (_number(value) and value >= 0),
                f"scalar 'step' must be a non-negative number, got {value!r}",
            )
        scalars[_str(key)] = Scalar(value, dtype)
    return scalars


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fits(value: Any, dtype: str) -> bool:
    """Whether a 0-d tensor of safetensors ``dtype`` can hold ``value`` exactly as written."""
    if dtype == "BOOL":
        return isinstance(value, bool)
    if dtype[0] in "IU":
        bits = 8 * DTYPE_BYTES[dtype]
        low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1)) if dtype[0] == "I" else (0, 2**bits)
        return isinstance(value, int) and not isinstance(value, bool) and low <= value < high
    return _number(value)


_GROUP_OPTIMIZER = {
    "role": ("muon", "adamw", None),
    "momentum_form": ("sum", "ema", None),
    "step_in": ("group", "tensor", "int", None),
    "lr_rule": ("moonlight", "aspect", None),
}


def _group_optimizer(value: Any) -> dict[str, Any]:
    """A group's ``optimizer`` object: empty (unknown), or naming the optimizer with valid
    fields, since a load across implementations acts on them."""
    _expect(isinstance(value, dict), "group optimizer must be an object")
    if not value:
        return {}
    _expect(isinstance(value.get("optimizer"), str), "group optimizer must name the optimizer")
    _expect(
        value["optimizer"] in KNOWN or value.get("role") is None,
        f"group optimizer {value['optimizer']!r} is not one muonckpt knows, yet has a role",
    )
    for field_name, allowed in _GROUP_OPTIMIZER.items():
        _expect(value.get(field_name) in allowed, f"group optimizer {field_name} not in {allowed}")
    for field_name in ("momentum", "matched_adamw_rms"):
        number = value.get(field_name)
        _expect(
            number is None or _number(number),
            f"group optimizer {field_name} must be a number or null",
        )
    if value.get("momentum_form") is not None:  # a form is converted by 1 - mu
        mu = value.get("momentum")
        _expect(
            _number(mu) and 0 <= mu < 1,
            f"group optimizer momentum must be in [0, 1) for its momentum_form, got {mu!r}",
        )
    _expect(value.get("nesterov") in (True, False, None), "group optimizer nesterov: a bool")
    return _as_json(value)


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckpointError(message)


def _str(value: Any) -> str:
    _expect(isinstance(value, str), f"expected a string, got {value!r}")
    return value


def _int(value: Any) -> int:
    _expect(
        isinstance(value, int) and not isinstance(value, bool), f"expected an int, got {value!r}"
    )
    return value


def _nonneg_int(value: Any) -> int:
    _expect(_int(value) >= 0, f"expected a non-negative int, got {value!r}")
    return value


def _pos_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _pos_int_value(value: Any) -> int:
    _expect(_pos_int(value), f"expected a positive int, got {value!r}")
    return value


def _digest(value: Any) -> str:
    _expect(
        isinstance(value, str) and _DIGEST.fullmatch(value) is not None,
        f"expected a checksum of 16 lowercase hex digits, got {value!r}",
    )
    return value


def _safe_name(value: Any) -> str:
    name = _str(value)
    _expect(
        name not in ("", ".", "..") and "/" not in name and "\\" not in name,
        f"file name {name!r} is not a plain file name",
    )
    return name


def json_safe(value: Any) -> Any:
    """Hyperparameter values as JSON: tuples become lists; anything else JSON can't hold fails."""
    if isinstance(value, float) and not math.isfinite(value):
        raise CheckpointError(f"hyperparameter value {value!r} cannot be stored in JSON")
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    raise CheckpointError(f"hyperparameter value {value!r} cannot be stored in the manifest")


def converted_manifest(
    manifest: Manifest, to: str | None, *, path: object = None
) -> tuple[Manifest, list[float]]:
    """``manifest`` with its state rewritten for the family ``to`` (``packaged``, ``torch``,
    ``keller-jordan``): each group records what it now holds (:func:`muonckpt.kinds.converted`)
    and where its AdamW counts steps; with the factor each group's ``momentum_buffer`` is
    multiplied by (sum and EMA form differ by ``1 - mu``). Files and pieces are kept.
    ``to=None`` keeps every group as it is.

    Raises:
        CheckpointError: (naming ``path``) for a group that does not say which optimizer saved
            it (format 1).
    """
    if to is None:
        return manifest, [1.0] * len(manifest.groups)
    groups, scales = [], []
    for g, group in enumerate(manifest.groups):
        source = group_kind(group, g, path)
        target = kinds.converted(source, to)
        factor = kinds.state_mapping(source, target, f"group {g}", None).keys
        scales.append(factor.get("momentum_buffer", ("", 1.0))[1])
        hyper = dict(group.hyperparams)
        step = manifest.latest_step(group.params)
        if target.step_in == "group" and step is not None:
            hyper["step"] = step
        groups.append(replace(group, hyperparams=hyper, optimizer=target.to_json()))
    params = tuple(_converted_steps(manifest, e, groups[e.group]) for e in manifest.params)
    return replace(manifest, groups=tuple(groups), params=params), scales


def group_kind(group: GroupEntry, index: int, path: object = None) -> kinds.GroupKind:
    """The optimizer kind group ``index`` records, for a conversion; refused (naming ``path``)
    for a group that records none (format 1)."""
    if not group.optimizer:
        raise CheckpointError(
            f"group {index} does not say which optimizer saved it (format 1): cannot convert",
            path=path,
        )
    return kinds.GroupKind.from_json(group.optimizer)


def _converted_steps(manifest: Manifest, entry: ParamEntry, group: GroupEntry) -> ParamEntry:
    """The param with its AdamW step count where the target keeps it."""
    step_in = group.optimizer.get("step_in")
    step = manifest.step_of(entry)
    scalars = {k: v for k, v in entry.scalars.items() if k != "step"}
    if step is not None and entry.state_keys and step_in == "tensor":
        scalars["step"] = Scalar(float(step), "F32")
    elif step is not None and entry.state_keys and step_in == "int":
        scalars["step"] = Scalar(int(step), None)
    return replace(entry, scalars=scalars)
