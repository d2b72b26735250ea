"""Reading manifests: strict JSON (whole, or as a stream never held whole) and the schema
checks that turn it into :class:`~muonckpt.format.manifest.Manifest` and its parts.

Pure: no tensors, no collectives, no file I/O. Every problem is a
:class:`~muonckpt.errors.CheckpointError`; docs/format.md specifies every field.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeGuard

from ..errors import CheckpointError
from ..layout.state_shapes import RULES, StateShape
from ..layout.topology import Region
from .kinds import COMPUTE_VIEWS, FORMS, KNOWN, UNKNOWN
from .manifest import (
    CHECKSUM_ALGORITHM,
    DATA_PREFIX,
    DTYPE_BYTES,
    FORMAT_NAME,
    FORMAT_VERSION,
    KINDS,
    PREFIXED_VERSION,
    Extra,
    ExtraTensor,
    ExtraValues,
    FileEntry,
    GroupEntry,
    IndexEntry,
    Manifest,
    ModelFile,
    ParamEntry,
    Piece,
    Scalar,
    ValuePath,
    chunk_bytes_of,
    has_version_5_optimizer,
    model_tensor,
    pack_checksums,
    piece_to_json,
    values_problem,
)
from .names import MANIFEST_NAME, PARAM_KEY
from .piece_index import check_region, index_name
from .records import fits
from .strict_json import strict_json, strict_json_chunks, valid_text

_DIGEST = re.compile("[0-9a-f]{16}")


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
    if version >= 3:
        params = _params_v3(body["params"], body["param_kinds"], shared, version)
    else:
        params = tuple(shared.entry(p, version) for p in body["params"])
    names = [p.name for p in params]
    _expect(len(set(names)) == len(names), "duplicate param names")
    for p in params:
        _expect(not set(p.scalars) & set(p.dtypes), f"param {p.name!r}: a key is stored twice")
        _expect(
            not p.state_shapes or version >= PREFIXED_VERSION,
            f"param {p.name!r}: a version {version} manifest has no state_shapes",
        )
    mixed = values_problem(params)
    _expect(mixed is None, mixed or "")
    groups = _groups(body["groups"], params, version)
    by_name = {p.name: p for p in params}
    files = tuple(FileEntry(_safe_name(f["name"]), _nonneg_int(f["bytes"])) for f in body["files"])
    file_names = {f.name for f in files}
    if version >= 3:
        _expect("pieces" not in body, "a version 3 manifest lists its pieces in its indexes")
        pieces: list[Piece] = []
        indexes = _indexes(body["indexes"], file_names, len(params))
    else:
        pieces, indexes = _pieces(body["pieces"], by_name, file_names), ()
    step = body.get("step")
    _expect(step is None or _int(step) >= 0, f"step must be a non-negative int, got {step!r}")
    prefix, dcp_layout, environment = _version_5_fields(body, version)
    extra = body.get("extra")
    return Manifest(
        kind=body["kind"],
        topology=dict(topology),
        groups=groups,
        params=params,
        files=files,
        pieces=tuple(pieces),
        format_version=version,
        indexes=indexes,
        complete=not indexes,
        model=_model_file(body["model"], by_name, file_names) if "model" in body else None,
        recorded_step=step,
        extra=None if extra is None else extra_from_json(extra, file_names),
        data_prefix=prefix,
        dcp_layout=dcp_layout,
        environment=environment,
        zero_stage=_zero_stage_field(body, version),
        replicas=replica_placement(body, version),
        split_experts=_split_experts_field(body, version),
    )


def _version_5_fields(body: dict[str, Any], version: int) -> tuple[str, str, Any]:
    """The top-level fields version 5 added, each checked (absent: ``""``, ``""``, None):
    ``data_prefix``, ``dcp_layout`` and ``environment``; refused in an older version."""
    prefix = body.get("data_prefix", "")
    _expect(
        isinstance(prefix, str) and DATA_PREFIX.fullmatch(prefix) is not None,
        f"data_prefix {prefix!r:.80} is not a save prefix (s-<16 hex digits>/)",
    )
    _expect(
        not prefix or version >= PREFIXED_VERSION,
        f"a version {version} manifest has no data_prefix (version {PREFIXED_VERSION} has)",
    )
    dcp_layout = body.get("dcp_layout", "")
    _expect(
        isinstance(dcp_layout, str) and DCP_LAYOUT.fullmatch(dcp_layout) is not None,
        f"dcp_layout {dcp_layout!r:.80} is not a layout's name",
    )
    _expect(
        not dcp_layout or version >= PREFIXED_VERSION,
        f"a version {version} manifest has no dcp_layout (version {PREFIXED_VERSION} has)",
    )
    environment = body.get("environment")
    _expect(
        environment is None
        or (
            version >= 5
            and isinstance(environment, dict)
            and all(isinstance(v, str | int | bool | None) for v in environment.values())
        ),
        "environment must be an object of strings, ints and booleans (version 5)",
    )
    return prefix, dcp_layout, environment


def _zero_stage_field(body: dict[str, Any], version: int) -> int:
    """The version 5 field ``zero_stage`` (absent: 0, none recorded): the ZeRO stage, 1 to 3,
    of the DeepSpeed checkpoint a checkpoint was converted from; refused in an older version."""
    stage = body.get("zero_stage", 0)
    _expect(
        stage == 0 or (type(stage) is int and 1 <= stage <= 3),
        f"zero_stage {stage!r:.80} is not a ZeRO stage (1, 2 or 3)",
    )
    _expect(
        not stage or version >= PREFIXED_VERSION,
        f"a version {version} manifest has no zero_stage (version {PREFIXED_VERSION} has)",
    )
    return int(stage)


def _split_experts_field(body: dict[str, Any], version: int) -> tuple[str, ...]:
    """The version 5 field ``split_experts`` (absent: none recorded): the names, sorted and
    each once, of the stacked params a conversion split into one param per matrix; refused in
    an older version."""
    names = body.get("split_experts", [])
    _expect(
        isinstance(names, list) and all(isinstance(n, str) for n in names),
        "split_experts must be a list of param names",
    )
    _expect(names == sorted(set(names)), "split_experts must be sorted, each name once")
    _expect(
        not names or version >= PREFIXED_VERSION,
        f"a version {version} manifest has no split_experts (version {PREFIXED_VERSION} has)",
    )
    return tuple(sys.intern(_str(n)) for n in names)


def replica_placement(body: dict[str, Any], version: int) -> dict[str, Any] | None:
    """(version 5, optional) ``replicas``, a node-local step's placement: ``nodes``, a
    non-negative int per rank (its node), and ``holders``, per rank the other ranks whose
    nodes hold a copy of its files; absent (None): not a local step."""
    placement = body.get("replicas")
    if placement is None:
        return None
    _expect(version >= 5, f"a version {version} manifest has no replicas (version 5 has)")
    _expect(
        isinstance(placement, dict) and set(placement) == {"nodes", "holders"},
        "replicas must be an object of nodes and holders",
    )
    nodes, holders = placement["nodes"], placement["holders"]
    _expect(
        isinstance(nodes, list) and all(_int(n) >= 0 for n in nodes),
        "replicas.nodes must be a list of non-negative ints",
    )
    ranks = range(len(nodes))
    _expect(
        isinstance(holders, list)
        and len(holders) == len(nodes)
        and all(
            isinstance(h, list) and all(_int(r) in ranks and r != i for r in h)
            for i, h in enumerate(holders)
        ),
        "replicas.holders must list, for each rank, other ranks",
    )
    return {"nodes": nodes, "holders": holders}


DCP_LAYOUT = re.compile(r"[a-z_]{0,32}")
"""What a manifest's ``dcp_layout`` may be (whole): none, or a layout's name."""


def _groups(raw: Any, params: tuple[ParamEntry, ...], version: int) -> tuple[GroupEntry, ...]:
    """The groups, each listing exactly the params that name it (in version 3 the list is
    made from the params' order, not written)."""
    _expect(isinstance(raw, list), "groups must be a list")
    listed: list[list[str]] = [[] for _ in raw]
    for p in params:
        _expect(p.group < len(raw), f"param {p.name!r} says group {p.group}, which is not listed")
        listed[p.group].append(p.name)
    groups = tuple(
        GroupEntry(
            hyperparams=_hyperparams(g["hyperparams"]),
            params=(
                tuple(sys.intern(_str(n)) for n in g["params"])
                if version < 3
                else tuple(listed[index])
            ),
            optimizer=_version_5_optimizer(
                _group_optimizer(g.get("optimizer", {}), index), version
            ),
            tuples=_tuples(g.get("tuples", []), g["hyperparams"], version),
        )
        for index, g in enumerate(raw)
    )
    for index, group in enumerate(groups):
        _expect(
            list(group.params) == listed[index] or sorted(group.params) == sorted(listed[index]),
            f"group {index} lists params {list(group.params)[:3]}..., the params that say "
            f"group {index} are {listed[index][:3]}... (groups and params list different names)",
        )
    return groups


def _params_v3(raw: Any, raw_kinds: Any, shared: _Shared, version: int) -> tuple[ParamEntry, ...]:
    """Version 3's params: ``[name, kind]``, each kind a param's fields but its name; version
    4's ``[shared, rest, kind]``: the first ``shared`` characters of the previous name, then
    ``rest`` (docs/format.md §3)."""
    _expect(isinstance(raw, list) and isinstance(raw_kinds, list), "params, param_kinds: lists")
    kinds = [shared.entry({**k, "name": ""}, FORMAT_VERSION) for k in raw_kinds]
    params, name = [], ""
    fields, form = (3, "[shared, rest, kind]") if version >= 4 else (2, "[name, kind]")
    for item in raw:
        _expect(isinstance(item, list) and len(item) == fields, f"param {item!r:.80}: not {form}")
        *spelled, kind = item
        if version >= 4:
            kept, rest = spelled
            _expect(
                0 <= _int(kept) <= len(name),
                f"param {item!r:.80}: shares {kept!r} characters of the previous name {name!r}",
            )
            name = name[:kept] + _str(rest)
        else:
            name = _str(spelled[0])
        _expect(_int(kind) < len(kinds) and kind >= 0, f"param {name!r}: no kind {kind!r}")
        params.append(kinds[kind].named(sys.intern(name)))
    return tuple(params)


def _pieces(raw: Any, by_name: Mapping[str, ParamEntry], file_names: set[str]) -> list[Piece]:
    """Version 1 and 2's pieces, listed in the manifest itself."""
    _expect(isinstance(raw, list), "pieces must be a list")
    pieces = []
    for item in raw:
        piece = item if isinstance(item, Piece) else piece_from_json(item)
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
        check_region(entry, piece.key, piece.region, piece.tensor)
        pieces.append(piece)
    return pieces


_INDEX_FIELDS = {"name", "file", "bytes", "checksum", "pieces", "params"}


def _indexes(raw: Any, file_names: set[str], n_params: int) -> tuple[IndexEntry, ...]:
    """Version 3's piece indexes: one per data file at most, each named after its file, its
    param spans increasing ranges of positions in ``params``."""
    _expect(isinstance(raw, list), "indexes must be a list")
    indexes = []
    for item in raw:
        _expect(isinstance(item, dict) and set(item) == _INDEX_FIELDS, f"index {item!r:.80}")
        file = _safe_name(item["file"])
        _expect(file in file_names, f"index of unlisted file {file!r}")
        name = _safe_name(item["name"])
        _expect(name == index_name(file), f"index {name!r} is not named after {file!r}")
        spans, last = [], 0
        for span in item["params"]:
            _expect(isinstance(span, list) and len(span) == 2, f"index {name!r}: span {span!r}")
            lo, hi = _nonneg_int(span[0]), _nonneg_int(span[1])
            _expect(last <= lo < hi <= n_params, f"index {name!r}: param span {span!r}")
            spans.append((lo, hi))
            last = hi
        checksum = _digest(item["checksum"])
        count = _nonneg_int(item["pieces"])
        indexes.append(
            IndexEntry(name, file, _nonneg_int(item["bytes"]), checksum, count, tuple(spans))
        )
    _expect(len({i.file for i in indexes}) == len(indexes), "two indexes of one data file")
    return tuple(indexes)


def _one(pool: dict[Any, Any], value: Any) -> Any:
    """``value``, or the equal one already in ``pool`` (frozen values: shared, not copied)."""
    return pool.setdefault(tuple(value.items()) if isinstance(value, dict) else value, value)


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
        check_region(entry, piece.key, piece.region, piece.tensor)
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
    return _str(value)


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
            chunk_bytes=chunk_bytes_of(item["chunk_bytes"]),
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


_REGION_FIELDS = ("cols", "block_start", "block_width", "start", "stop")


def piece_from_json(raw: Mapping[str, Any], shared: dict[Any, Any] | None = None) -> Piece:
    """A schema-checked :class:`Piece` from its JSON form (as in ``manifest.json``).

    Compact, since a manifest of 100k params holds 300k pieces: its names are interned (each
    file name is repeated in every piece, and a file's header names each tensor again), its
    checksums packed (:func:`~muonckpt.format.manifest.pack_checksums`), and equal regions and chunk
    sizes are one object each, kept in ``shared`` (one dict for a whole manifest)."""
    pool = shared if shared is not None else {}
    bounds = tuple(_nonneg_int(raw["region"][k]) for k in _REGION_FIELDS)
    region = pool.get(bounds)
    if region is None:
        region = pool[bounds] = Region(*bounds)
    chunk_bytes = chunk_bytes_of(raw["chunk_bytes"])
    return Piece(
        param=sys.intern(_str(raw["param"])),
        key=sys.intern(_str(raw["key"])),
        file=sys.intern(_safe_name(raw["file"])),
        tensor=sys.intern(_str(raw["tensor"])),
        region=region,
        digests=pack_checksums(_digest(c) for c in raw["checksums"]),
        chunk_bytes=pool.setdefault(chunk_bytes, chunk_bytes),
    )


def _hyperparams(raw: Any) -> dict[str, Any]:
    _expect(isinstance(raw, dict), "group hyperparams must be an object")
    if "step" in raw:
        _nonneg_int(raw["step"])
    return _as_json_object(raw)


_PIECE_FIELDS = ("param", "key", "file", "tensor", "region", "checksums", "chunk_bytes")


class _Shared:
    """What one manifest's parse shares: equal regions, chunk sizes, shapes and dtypes as one
    object each (frozen, so shared, not copied), and the hooks that make pieces and params as
    soon as their objects are parsed (a manifest of 100k params holds 300k pieces: a dict
    each, all alive at once, was most of the memory a reader needed)."""

    def __init__(self) -> None:
        self.pieces: dict[Any, Any] = {}  # regions by bounds, chunk sizes (piece_from_json)
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
            return piece_from_json(raw, self.pieces)
        except (CheckpointError, KeyError, TypeError, ValueError, AttributeError):
            return raw

    def param(self, raw: Any) -> Any:
        """(for each element of ``params``) A param of the current format as a
        :class:`ParamEntry`; anything else stays as it is (checked by :meth:`entry`)."""
        if not isinstance(raw, dict) or set(raw) - {"scalars", "state_shapes"} != _PARAM_FIELDS:
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
        dtypes = _one(self._dtypes, _dtypes(raw, version))
        return ParamEntry(
            name=sys.intern(_str(raw["name"])),
            shape=_one(self._shapes, tuple(_nonneg_int(s) for s in raw["shape"])),
            tp_split_dim=_int(raw["tp_split_dim"]),
            group=_nonneg_int(raw["group"]),
            dtypes=dtypes,
            scalars=_scalars(raw.get("scalars", {}) if version >= 2 else {}) or self._no_scalars,
            state_shapes=state_shapes_from_json(raw.get("state_shapes", {}), dtypes),
        )


_PARAM_FIELDS = {"name", "shape", "tp_split_dim", "group", "dtypes"}


def _as_json(value: Any) -> Any:
    """``value`` with any :class:`Piece` the parser made of a piece-shaped object (found where
    no piece belongs: a hyperparameter) back in its JSON form, its strings checked as names are."""
    if isinstance(value, Piece):
        return piece_to_json(value)
    if isinstance(value, dict):
        return _as_json_object(value)
    if isinstance(value, list):
        return [_as_json(v) for v in value]
    return _str(value) if isinstance(value, str) else value


def _as_json_object(value: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`_as_json` of a JSON object, its keys checked too."""
    return {_str(k): _as_json(v) for k, v in value.items()}


def _dtypes(raw: Mapping[str, Any], version: int) -> dict[str, str]:
    """Each stored key's dtype: version 2 lists them, version 1 has one dtype for all state."""
    keys = [_str(k) for k in raw["state_keys"]] if version < 2 else []
    _expect(PARAM_KEY not in keys, f"state key {PARAM_KEY!r} is reserved for the values")
    dtypes = {k: raw["dtype"] for k in keys} if version < 2 else raw["dtypes"]
    _expect(isinstance(dtypes, dict), "dtypes must map stored keys to dtype strings")
    unknown = {k: d for k, d in dtypes.items() if d not in DTYPE_BYTES}
    _expect(not unknown, f"unknown dtype(s) of stored keys: {unknown!r:.100}")
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
            _expect(fits(value, dtype), f"scalar {key!r}: {value!r} is not a {dtype} value")
        if key == "step":
            _expect(
                value is None or (_number(value) and value >= 0),
                f"scalar 'step' must be a non-negative number, got {value!r}",
            )
        scalars[_str(key)] = Scalar(value, dtype)
    return scalars


def state_shapes_from_json(raw: Any, dtypes: Any = None) -> dict[str, StateShape]:
    """(version 5) The state tensors not shaped like their param: each a stored key's shape
    and rule (:mod:`muonckpt.layout.state_shapes`), each key one of ``dtypes`` where given."""
    _expect(isinstance(raw, dict), "state_shapes must map state keys to shapes")
    shapes = {}
    for key, item in raw.items():
        _expect(
            isinstance(item, dict) and set(item) == {"rule", "shape"},
            f"state_shapes {key!r}: not {{rule, shape}}",
        )
        _expect(item["rule"] in RULES, f"state_shapes {key!r}: unknown rule {item['rule']!r:.40}")
        _expect(isinstance(item["shape"], list), f"state_shapes {key!r}: shape is not a list")
        known = dtypes is None or (key in dtypes and key != PARAM_KEY)
        _expect(known, f"state_shapes {key!r}: no such state tensor")
        shape = tuple(_nonneg_int(n) for n in item["shape"])
        shapes[sys.intern(_str(key))] = StateShape(item["rule"], shape)
    return shapes


def _tuples(raw: Any, hyperparams: Any, version: int) -> tuple[ValuePath, ...]:
    """(version 5) Where a group's settings held tuples: each a path to a list in them."""
    _expect(isinstance(raw, list), "a group's tuples must be a list of paths")
    _expect(not raw or version >= PREFIXED_VERSION, f"a version {version} manifest has no tuples")
    paths = []
    for path in raw:
        _expect(isinstance(path, list), f"tuples: {path!r:.80} is not a path")
        node = hyperparams
        for step in path:
            found = isinstance(node, dict) and isinstance(step, str) and step in node
            index = isinstance(step, int) and not isinstance(step, bool)
            found = found or (isinstance(node, list) and index and 0 <= step < len(node))
            _expect(found, f"tuples: {path!r:.80} names no setting")
            node = node[step]
        _expect(isinstance(node, list) and path, f"tuples: {path!r:.80} names no list")
        paths.append(tuple(path))
    return tuple(paths)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_GROUP_OPTIMIZER = {
    "role": ("muon", "adamw", None),
    "momentum_form": (*FORMS, UNKNOWN, None),
    "step_in": ("group", "tensor", "int", None),
    "lr_rule": ("moonlight", "aspect", None),
    "second_moment": ("element", "row", None),
    "compute_view": (*COMPUTE_VIEWS, None),
}
"""The allowed values of a group optimizer's fields (version 5 added ``momentum_form``
``unknown``, ``second_moment`` and ``compute_view``)."""


def _group_optimizer(value: Any, group: int) -> dict[str, Any]:
    """Group ``group``'s ``optimizer`` object: empty (unknown), or naming the optimizer with
    valid fields, since a load across implementations acts on them. A known optimizer's form
    is known: ``unknown`` there would let a conversion guess it."""
    _expect(isinstance(value, dict), f"group {group}: optimizer must be an object")
    if not value:
        return {}
    _expect(
        isinstance(value.get("optimizer"), str), f"group {group}: optimizer must name the optimizer"
    )
    _expect(
        value["optimizer"] in KNOWN or value.get("role") is None,
        f"group {group}: optimizer {value['optimizer']!r} is not one muonckpt knows, "
        "yet has a role",
    )
    _expect(
        value["optimizer"] not in KNOWN or value.get("momentum_form") != UNKNOWN,
        f"group {group}: optimizer {value['optimizer']!r} is one muonckpt knows, yet records "
        f"the momentum_form {UNKNOWN!r}",
    )
    for field_name, allowed in _GROUP_OPTIMIZER.items():
        _expect(value.get(field_name) in allowed, f"group optimizer {field_name} not in {allowed}")
    for field_name in ("momentum", "matched_adamw_rms"):
        number = value.get(field_name)
        _expect(
            number is None or _number(number),
            f"group optimizer {field_name} must be a number or null",
        )
    if value.get("momentum_form") in FORMS:  # a form is converted by 1 - mu
        mu = value.get("momentum")
        _expect(
            _number(mu) and 0 <= mu < 1,
            f"group optimizer momentum must be in [0, 1) for its momentum_form, got {mu!r}",
        )
    _expect(value.get("nesterov") in (True, False, None), "group optimizer nesterov: a bool")
    return _as_json_object(value)


def _version_5_optimizer(value: dict[str, Any], version: int) -> dict[str, Any]:
    """A group optimizer's version 5 values, refused in an older version: a ``compute_view``,
    the ``momentum_form`` ``unknown``."""
    _expect(
        version >= 5 or not has_version_5_optimizer(value),
        f"a version {version} manifest's group optimizer has no compute_view nor momentum_form "
        f"{UNKNOWN!r} (version 5 has)",
    )
    return value


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckpointError(message)


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise CheckpointError(f"expected a string, got {value!r}")
    _expect(valid_text(value), f"{value!r} is not valid Unicode: it holds a lone surrogate")
    return value


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise CheckpointError(f"expected an int, got {value!r}")
    return value


def _nonneg_int(value: Any) -> int:
    number = _int(value)
    _expect(number >= 0, f"expected a non-negative int, got {value!r}")
    return number


def _pos_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _digest(value: Any) -> str:
    if not isinstance(value, str) or _DIGEST.fullmatch(value) is None:
        raise CheckpointError(f"expected a checksum of 16 lowercase hex digits, got {value!r}")
    return value


def _safe_name(value: Any) -> str:
    name = _str(value)
    _expect(
        name not in ("", ".", "..") and "/" not in name and "\\" not in name,
        f"file name {name!r} is not a plain file name",
    )
    return name
