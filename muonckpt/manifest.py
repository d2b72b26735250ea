"""The checkpoint manifest: versioned dataclasses to and from JSON, with schema checks.

Pure: no tensors, no collectives, no file I/O. ``manifest.json`` is written last by a save and
is its commit marker; docs/format.md specifies every field.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

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


def rank_file(rank: int, world_size: int) -> str:
    """The file of rank ``rank``'s pieces in a per-rank checkpoint."""
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


@dataclass(frozen=True)
class Scalar:
    """A state value that is not a tensor shaped like its param: a plain number, or a 0-d tensor
    (torch keeps AdamW's ``step`` so), stored in the manifest itself."""

    value: int | float | bool | str | None
    dtype: str | None = None
    """safetensors dtype of a 0-d tensor; None for a plain Python number."""


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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
class FileEntry:
    name: str
    bytes: int


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {entry.name: entry for entry in self.params})

    def param(self, name: str) -> ParamEntry:
        entry = self._by_name.get(name)  # type: ignore[attr-defined]
        if entry is None:
            raise CheckpointError("no such param in the checkpoint", param=name)
        return entry

    def step_of(self, entry: ParamEntry) -> int | float | None:
        """The step count the checkpoint holds for a param: its own scalar (torch and
        KellerJordan AdamW count per param), else its group's."""
        if "step" in entry.scalars:
            return entry.scalars["step"].value
        return self.groups[entry.group].hyperparams.get("step")

    def latest_step(self, names: Iterable[str]) -> int | None:
        """The largest step count of the named params (None: none has one)."""
        steps = [s for s in (self.step_of(self.param(n)) for n in names) if s is not None]
        return int(max(steps)) if steps else None

    @property
    def has_values(self) -> bool:
        """Whether the params' own values were saved (every param's, or none)."""
        return bool(self.params) and all(e.value_dtype is not None for e in self.params)

    def pieces_of(self) -> dict[tuple[str, str], list[Piece]]:
        """Pieces grouped by (param, state key)."""
        grouped: dict[tuple[str, str], list[Piece]] = defaultdict(list)
        for piece in self.pieces:
            grouped[piece.param, piece.key].append(piece)
        return grouped

    @property
    def step(self) -> int | None:
        steps = [g.hyperparams.get("step") for g in self.groups if "step" in g.hyperparams]
        return max(steps) if steps else None

    def digest(self) -> str:
        """A short hash of :meth:`to_json`: what the ranks of one load (or offline tool)
        compare to know they read one checkpoint."""
        return hashlib.blake2b(self.to_json().encode(), digest_size=8).hexdigest()

    def to_json(self) -> str:
        """The manifest as written: one compact JSON line per group, param, file and piece
        (readable, and half the size of indented JSON: 100k params fit the 100 MB limit).

        Built field by field: ``dataclasses.asdict`` deep-copies every value, seconds at 100k
        params."""
        body = {
            "format": FORMAT_NAME,
            "kind": self.kind,
            "topology": dict(self.topology),
            "groups": [
                {"hyperparams": g.hyperparams, "params": list(g.params), "optimizer": g.optimizer}
                for g in self.groups
            ],
            "params": [
                {
                    "name": e.name,
                    "shape": list(e.shape),
                    "tp_split_dim": e.tp_split_dim,
                    "group": e.group,
                    "dtypes": dict(e.dtypes),
                    "scalars": {
                        k: {"value": v.value, "dtype": v.dtype} for k, v in e.scalars.items()
                    },
                }
                for e in self.params
            ],
            "files": [{"name": f.name, "bytes": f.bytes} for f in self.files],
            "pieces": [piece_to_json(p) for p in self.pieces],
            "format_version": self.format_version,
            "checksum_algorithm": self.checksum_algorithm,
        }

        def compact(value: Any) -> str:
            return json.dumps(value, separators=(",", ":"), allow_nan=False)

        fields = [
            f"{compact(key)}: "
            + (
                "[\n" + ",\n".join(compact(item) for item in value) + "\n]"
                if isinstance(value, list) and value
                else compact(value)
            )
            for key, value in body.items()
        ]
        return "{\n" + ",\n".join(fields) + "\n}\n"

    def coverage_problems(self) -> list[str]:
        """Gaps, overlaps and stray pieces: every state tensor must be covered exactly once."""
        problems = []
        grouped = self.pieces_of()
        for entry in self.params:
            for key in entry.tensor_keys:
                problems += _coverage(entry, key, grouped.pop((entry.name, key), []))
        for param, key in grouped:
            problems.append(
                f"piece of param {param!r} state {key!r} that the manifest's params do not list"
            )
        return problems


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


def strict_json(text: str | bytes) -> Any:
    """``json.loads`` as the format requires: numbers finite (no ``NaN``, ``Infinity`` or a
    float that overflows to one), no key twice in an object, at most :data:`MAX_JSON_DEPTH`
    levels. Raises ValueError otherwise."""

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
            seen: set[str] = set()
            twice = sorted({key for key, _ in pairs if key in seen or seen.add(key)})
            raise ValueError(f"key(s) {twice[:3]} appear twice in one object")
        return body

    body = json.loads(text, parse_float=finite, parse_constant=refuse, object_pairs_hook=unique)
    level, deepest = [body], 1
    while level:
        inner = [v for item in level for v in _children(item) if isinstance(v, (dict, list))]
        if inner:
            deepest += 1
            if deepest > MAX_JSON_DEPTH:
                raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep")
        level = inner
    return body


def _children(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return list(value.values())
    return list(value) if isinstance(value, list) else []


def parse_manifest(text: str | bytes, source: object) -> Manifest:
    """Parse and schema-check a manifest; every problem is a :class:`CheckpointError`."""
    try:
        body = strict_json(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(f"manifest is not valid JSON: {exc!r:.200}", path=source) from None
    try:
        return _manifest_from(body)
    except CheckpointError as exc:
        raise CheckpointError(str(exc), path=source) from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(
            f"manifest does not follow the format: {exc!r}", path=source
        ) from None


def _manifest_from(body: Any) -> Manifest:
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
    params = tuple(
        ParamEntry(
            name=_str(p["name"]),
            shape=tuple(_nonneg_int(s) for s in p["shape"]),
            tp_split_dim=_int(p["tp_split_dim"]),
            group=_nonneg_int(p["group"]),
            dtypes=_dtypes(p, version),
            scalars=_scalars(p.get("scalars", {}) if version >= 2 else {}),
        )
        for p in body["params"]
    )
    names = [p.name for p in params]
    _expect(len(set(names)) == len(names), "duplicate param names")
    for p in params:
        _expect(not set(p.scalars) & set(p.dtypes), f"param {p.name!r}: a key is stored twice")
    with_values = {p.value_dtype is not None for p in params}
    _expect(len(with_values) <= 1, "some params have saved values and others not")
    groups = tuple(
        GroupEntry(
            hyperparams=_hyperparams(g["hyperparams"]),
            params=tuple(_str(n) for n in g["params"]),
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
    for raw in body["pieces"]:
        piece = piece_from_json(raw)
        _expect(
            piece.file in file_names, f"piece {piece.tensor!r} names unlisted file {piece.file!r}"
        )
        entry = by_name.get(piece.param)
        _expect(entry is not None, f"piece {piece.tensor!r} of unknown param {piece.param!r}")
        _expect(
            piece.key in entry.dtypes,
            f"piece {piece.tensor!r}: param {piece.param!r} lists no stored key {piece.key!r}",
        )
        _check_region(entry, piece.region, piece.tensor)
        pieces.append(piece)
    return Manifest(
        kind=body["kind"],
        topology=dict(topology),
        groups=groups,
        params=params,
        files=files,
        pieces=tuple(pieces),
        format_version=version,
    )


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


def piece_from_json(raw: Mapping[str, Any]) -> Piece:
    """A schema-checked :class:`Piece` from its JSON form (as in ``manifest.json``)."""
    region = Region(
        **{
            k: _nonneg_int(raw["region"][k])
            for k in ("cols", "block_start", "block_width", "start", "stop")
        }
    )
    return Piece(
        param=_str(raw["param"]),
        key=_str(raw["key"]),
        file=_safe_name(raw["file"]),
        tensor=_str(raw["tensor"]),
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
    _expect(ok, f"piece {tensor!r}: region {asdict(region)} lies outside param shape {entry.shape}")


def _hyperparams(raw: Any) -> dict[str, Any]:
    _expect(isinstance(raw, dict), "group hyperparams must be an object")
    if "step" in raw:
        _nonneg_int(raw["step"])
    return dict(raw)


def _dtypes(raw: Mapping[str, Any], version: int) -> dict[str, str]:
    """Each stored key's dtype: version 2 lists them, version 1 has one dtype for all state."""
    if version < 2:
        keys = [_str(k) for k in raw["state_keys"]]
        _expect(PARAM_KEY not in keys, f"state key {PARAM_KEY!r} is reserved for the values")
        return {k: _str(raw["dtype"]) for k in keys}
    dtypes = raw["dtypes"]
    _expect(isinstance(dtypes, dict), "dtypes must map stored keys to dtype strings")
    return {_str(k): _str(v) for k, v in dtypes.items()}


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
    return dict(value)


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
