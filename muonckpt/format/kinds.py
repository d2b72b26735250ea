"""What each optimizer group computes, and how state moves between Muon implementations.

Pure: optimizer classes are recognised by module and name, groups read as mappings; no torch.

Three Muon implementations keep their momentum under the same key, ``momentum_buffer``, in two
forms. The packaged :class:`muonckpt.optim.muon.Muon` keeps sum form, ``b = mu * b + g``;
torch.optim.Muon and KellerJordan's Muon keep EMA form, ``m = mu * m + (1 - mu) * g``. With a
constant ``mu`` and a zero start, ``m = (1 - mu) * b`` at every step, and Newton-Schulz divides
by the norm first, so the updates agree up to rounding once the buffer is scaled by ``1 - mu``.
Copying the raw buffer instead makes the momentum ``1 / (1 - mu)`` times too large (or small).
Their lr scale rules and defaults differ too; :func:`trajectory_notes` says which target
settings continue the source's trajectory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import StateDictError

SUM, EMA = "sum", "ema"
FORMS = (SUM, EMA)
UNKNOWN = "unknown"
"""The momentum form recorded (version 5) for an optimizer muonckpt does not know: whatever
its momentum is, no conversion can rely on a form."""
WHOLE, SPLIT_QKV, PER_HEAD, PER_EXPERT = "whole", "split_qkv", "per_head", "per_expert"
COMPUTE_VIEWS = (WHOLE, SPLIT_QKV, PER_HEAD, PER_EXPERT)
"""What a Muon orthogonalizes (version 5, a group's ``compute_view``): each matrix whole, a
fused QKV matrix as its Q, K and V blocks apart, each attention head's block, each expert's
matrix of a stacked param. Unrecorded: each matrix whole, as the packaged Muon, torch's and
KellerJordan's do."""
MOONLIGHT = "moonlight"
"""``lr * matched_adamw_rms * sqrt(max(A, B))``: the packaged Muon, Moonlight, and torch's
``adjust_lr_fn="match_rms_adamw"`` (with its fixed 0.2)."""
ASPECT = "aspect"
"""``lr * sqrt(max(1, A / B))``: torch's default (``adjust_lr_fn`` None or "original") and
KellerJordan's ``max(1, A / B) ** 0.5``."""
MUON_STATE_KEYS = ("momentum_buffer",)
"""The state keys of a Muon param in the packaged Muon (and torch's, and KellerJordan's)."""
ADAMW_STATE_KEYS = ("exp_avg", "exp_avg_sq")
"""The state keys of an AdamW param in the packaged Muon."""
DEEPSPEED = "deepspeed.MuonWithAuxAdam"
"""DeepSpeed's ZeRO-1/2 Muon as a checkpoint read from its files names it."""
MEGATRON = "megatron.core.optimizer.TensorParallelMuon"
"""Megatron-Core's layer-wise Muon (emerging-optimizers', EMA form) as read from its files."""
TORCHTITAN = "torchtitan.DistMuon"
"""torchtitan 0.3.0's FSDP2 Muon (EMA form, Nesterov by default, torch's lr rules), read from
its DCP checkpoints."""
FAMILIES = {"packaged": "muonckpt.Muon", "torch": "torch.optim", "keller-jordan": "muon"}
KNOWN = (
    "muonckpt.Muon",
    "torch.optim.Muon",
    "torch.optim.AdamW",
    "torch.optim.Adam",
    "muon.Muon",
    "muon.SingleDeviceMuon",
    "muon.MuonWithAuxAdam",
    "muon.SingleDeviceMuonWithAuxAdam",
    DEEPSPEED,
    MEGATRON,
    TORCHTITAN,
)
"""The optimizers whose groups muonckpt knows how to convert (``deepspeed.MuonWithAuxAdam``:
DeepSpeed's ZeRO-1/2 Muon, KellerJordan's update in EMA form, read from its checkpoints;
``megatron.core.optimizer.TensorParallelMuon``: Megatron-Core's, EMA form, likewise)."""
MOMENTUM_FORMS = {
    "muonckpt.Muon": SUM,
    "torch.optim.Muon": EMA,
    **{name: EMA for name in KNOWN if name.startswith("muon.")},
    DEEPSPEED: EMA,
    MEGATRON: EMA,
    TORCHTITAN: EMA,
}
"""The momentum form each Muon implementation of :data:`KNOWN` keeps (with
:data:`DCP_FAMILIES`'s: :func:`kept_form`)."""


@dataclass(frozen=True)
class GroupKind:
    """What one param group of one optimizer computes, as far as resuming elsewhere needs."""

    optimizer: str
    """``module.Class`` of the optimizer (``torch.optim.Muon``, ``muon.MuonWithAuxAdam``)."""
    role: str | None
    """``muon``, ``adamw``, or None for an optimizer muonckpt does not know."""
    momentum_form: str | None = None
    """Muon groups: :data:`SUM` or :data:`EMA`."""
    momentum: float | None = None
    nesterov: bool | None = None
    lr_rule: str | None = None
    """Muon groups: :data:`MOONLIGHT` or :data:`ASPECT`."""
    matched_adamw_rms: float | None = None
    """The factor of the :data:`MOONLIGHT` rule (0.2 in torch)."""
    step_in: str | None = None
    """AdamW groups: where the step count lives: ``group`` (packaged), ``tensor`` (torch: a
    0-d float32 tensor per param) or ``int`` (KellerJordan: a plain int per param)."""
    converted_from: str | None = None
    """Set by ``muonckpt convert``: the optimizer whose state this group's was converted from
    (its hyperparams are that optimizer's, so a load keeps the target's own settings)."""
    second_moment: str | None = None
    """Muon groups of the packaged Muon: ``element`` or ``row``, the second moment of the
    orthogonalized update it keeps (``update_sq``) and normalizes by; None: none (written
    only when set, version 5)."""
    compute_view: str | None = None
    """Muon groups: one of :data:`COMPUTE_VIEWS`, as the trainer's settings state it
    (Megatron's ``muon_split_qkv``); None: unrecorded, each matrix whole (written only when
    set, version 5)."""

    @property
    def family(self) -> str:
        for family, prefix in FAMILIES.items():
            if self.optimizer == prefix or self.optimizer.startswith(prefix + "."):
                return family
        return "other"

    def to_json(self) -> dict[str, Any]:
        fields = asdict(self)
        for optional in ("second_moment", "compute_view"):
            if fields[optional] is None:
                del fields[optional]
        return fields

    @property
    def view(self) -> str:
        """What its Muon orthogonalizes: :attr:`compute_view`, unrecorded: :data:`WHOLE`."""
        return self.compute_view or WHOLE

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> GroupKind:
        fields: dict[str, Any] = {k: raw.get(k) for k in cls.__dataclass_fields__}
        return cls(**fields)


def optimizer_name(optimizer: object) -> str:
    """``module.Class`` with torch's private modules hidden (``torch.optim.AdamW``)."""
    kind = type(optimizer)
    module = kind.__module__
    if module.startswith("torch.optim."):
        module = "torch.optim"
    if module == "muonckpt.optim.muon":
        module = "muonckpt"
    return f"{module}.{kind.__name__}"


def group_kind(optimizer: object, group: Mapping[str, Any]) -> GroupKind:
    """What ``group`` of ``optimizer`` computes (role None for unknown optimizers)."""
    name = optimizer_name(optimizer)
    if name == "muonckpt.Muon":
        if group.get("use_muon", False):
            return GroupKind(
                name,
                "muon",
                MOMENTUM_FORMS[name],
                group["momentum"],
                group["nesterov"],
                MOONLIGHT,
                group["matched_adamw_rms"],
                second_moment=group.get("second_moment"),
            )
        return GroupKind(name, "adamw", step_in="group")
    if name == "torch.optim.Muon":
        rule = MOONLIGHT if group.get("adjust_lr_fn") == "match_rms_adamw" else ASPECT
        rms = 0.2 if rule == MOONLIGHT else None
        form = MOMENTUM_FORMS[name]
        return GroupKind(name, "muon", form, group["momentum"], group["nesterov"], rule, rms)
    if name in ("torch.optim.AdamW", "torch.optim.Adam"):
        return GroupKind(name, "adamw", step_in="tensor")
    if name.startswith("muon.") and name in KNOWN:
        if group.get("use_muon", name.endswith("Muon")):
            return GroupKind(name, "muon", MOMENTUM_FORMS[name], group["momentum"], True, ASPECT)
        return GroupKind(name, "adamw", step_in="int")
    return GroupKind(name, None, UNKNOWN)


def settings_view(settings: Mapping[str, Any]) -> str | None:
    """The compute view a Muon group's own settings state, as dion's groups do:
    ``num_heads`` above 1 (:data:`PER_HEAD`), ``split_sizes`` (row blocks of a fused QKV
    weight: :data:`SPLIT_QKV`); None where they say nothing."""
    heads = settings.get("num_heads")
    if isinstance(heads, int) and not isinstance(heads, bool) and heads > 1:
        return PER_HEAD
    return SPLIT_QKV if settings.get("split_sizes") else None


@dataclass(frozen=True)
class KeyMap:
    """How one param's saved state becomes a target group's: each target key from a source key
    times a factor, and where the AdamW step count goes."""

    keys: dict[str, tuple[str, float]]
    step: bool
    """Whether an AdamW step count moves (source's and target's ``step_in``)."""
    note: str | None
    """What was converted, for the report (None: nothing)."""


def state_mapping(
    source: GroupKind, target: GroupKind, param: str, momentum_form: str | None
) -> KeyMap:
    """The key map from ``source``'s state of ``param`` to ``target``'s.

    ``momentum_form`` states the form of a target muonckpt does not know. Raises
    :class:`StateDictError` naming the param when the roles differ or a form is unknown.
    """
    if momentum_form is not None and momentum_form not in FORMS:
        raise StateDictError(f"momentum_form must be 'sum' or 'ema', got {momentum_form!r}")
    role = target.role or source.role
    if target.role is None and source.role == "adamw" and target.optimizer != source.optimizer:
        raise StateDictError(
            f"param {param!r}: muonckpt does not know how {target.optimizer} keeps the AdamW "
            f"state the checkpoint's {source.optimizer} saved: load it into an AdamW"
        )
    if target.role is not None and source.role is not None and source.role != target.role:
        raise StateDictError(
            f"param {param!r} ran {source.role} in {source.optimizer}, the target "
            f"{target.optimizer} runs {target.role} on it: load it into an optimizer that runs "
            f"{source.role}"
        )
    if source.role is None:
        raise StateDictError(
            f"param {param!r}: the checkpoint's {source.optimizer} is not an optimizer muonckpt "
            f"can convert; load it into a {source.optimizer}"
        )
    if source.second_moment != target.second_moment:
        raise StateDictError(
            f"param {param!r}: the checkpoint's {source.optimizer} keeps "
            f"{_second_moment(source)}, the target {target.optimizer} {_second_moment(target)}: "
            "no conversion maps one onto the other; load it into a Muon with "
            f"second_moment={source.second_moment!r}"
        )
    if role == "adamw":
        keys = {k: (k, 1.0) for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")}
        return KeyMap(keys, True, None)
    to_form = momentum_form or target.momentum_form
    if to_form in (None, UNKNOWN):
        raise StateDictError(
            f"param {param!r}: the checkpoint's Muon momentum is {source.momentum_form}-form "
            f"({source.optimizer}), and muonckpt does not know the form {target.optimizer} "
            "keeps: pass momentum_form='sum' (b = mu * b + g) or momentum_form='ema' "
            "(m = mu * m + (1 - mu) * g)"
        )
    factor, note = 1.0, None
    mu = source.momentum
    if source.momentum_form not in FORMS:
        raise StateDictError(
            f"param {param!r}: the checkpoint's {source.optimizer} group records its Muon "
            f"momentum's form as {source.momentum_form!r}, neither 'sum' nor 'ema': no "
            f"conversion to {to_form}-form can rely on it"
        )
    if source.momentum_form != to_form:
        if mu is None:
            raise StateDictError(
                f"param {param!r}: the checkpoint's {source.optimizer} group records no momentum "
                f"to convert its {source.momentum_form}-form buffers by"
            )
        factor = form_factor(source.momentum_form, to_form, mu)
        note = f"{source.momentum_form} -> {to_form} (x {factor:.6g}, mu={mu})"
    return KeyMap({"momentum_buffer": ("momentum_buffer", factor)}, False, note)


def form_factor(source: str | None, target: str | None, mu: float) -> float:
    """What a momentum buffer of form ``source`` is multiplied by to be one of form ``target``
    (with momentum ``mu``): ``1 - mu`` from sum to EMA form, its inverse back, else 1.
    Raises :class:`StateDictError` for a form that is neither (:data:`UNKNOWN`, None)."""
    if source not in FORMS or target not in FORMS:
        raise StateDictError(
            f"a momentum form is {source!r} -> {target!r}, not 'sum' or 'ema': "
            "no factor converts it"
        )
    if source == target:
        return 1.0
    return (1 - mu) if target == EMA else 1 / (1 - mu)


def _second_moment(kind: GroupKind) -> str:
    if kind.second_moment is None:
        return "no second moment of its update"
    return f"a {kind.second_moment} second moment of its update (update_sq)"


def converted(kind: GroupKind, family: str) -> GroupKind:
    """What ``kind``'s group becomes when its state is rewritten for ``family``
    (``packaged``, ``torch`` or ``keller-jordan``)."""
    if kind.role is None:
        raise StateDictError(f"{kind.optimizer} is not an optimizer muonckpt can convert")
    if kind.second_moment is not None:
        raise StateDictError(
            f"{kind.optimizer} with second_moment={kind.second_moment!r} keeps "
            f"{_second_moment(kind)}, which no other implementation has: it cannot be converted"
        )
    if family not in FAMILIES:
        raise StateDictError(f"cannot convert to {family!r}: choose one of {sorted(FAMILIES)}")
    names = {
        "packaged": ("muonckpt.Muon", "muonckpt.Muon"),
        "torch": ("torch.optim.Muon", "torch.optim.AdamW"),
        "keller-jordan": ("muon.MuonWithAuxAdam", "muon.MuonWithAuxAdam"),
    }[family]
    origin = kind.converted_from or kind.optimizer
    if kind.role == "adamw":
        step_in = {"packaged": "group", "torch": "tensor", "keller-jordan": "int"}[family]
        return GroupKind(names[1], "adamw", step_in=step_in, converted_from=origin)
    form = SUM if family == "packaged" else EMA
    nesterov = True if family == "keller-jordan" else kind.nesterov
    return GroupKind(
        names[0],
        "muon",
        form,
        kind.momentum,
        nesterov,
        kind.lr_rule,
        kind.matched_adamw_rms,
        converted_from=origin,
    )


def trajectory_notes(source: GroupKind, target: GroupKind) -> list[str]:
    """Settings of the target group that cannot continue the source's trajectory, each with
    the setting that would (or why none does)."""
    if source.role == target.role == "adamw":
        return _adamw_notes(source, target)
    if source.role != "muon" or target.role != "muon":
        return []
    notes = compute_view_notes(source, target)
    if source.momentum is not None and target.momentum != source.momentum:
        notes.append(f"momentum is {target.momentum}, the checkpoint's {source.momentum}")
    if source.nesterov is not None and target.nesterov != source.nesterov:
        notes.append(f"nesterov is {target.nesterov}, the checkpoint's {source.nesterov}")
    if (source.lr_rule, source.matched_adamw_rms) != (target.lr_rule, target.matched_adamw_rms):
        notes.append(
            f"the lr scale rule is {_rule(target)}, the checkpoint's {_rule(source)}; "
            + _fix(source, target)
        )
    return notes


def compute_view_notes(source: GroupKind, target: GroupKind) -> list[str]:
    """The note for a Muon group whose target orthogonalizes other blocks than the
    checkpoint's optimizer did (its update differs; the state itself maps as it is)."""
    if source.role != "muon" or target.role != "muon" or source.view == target.view:
        return []
    return [
        f"the checkpoint's {source.optimizer} orthogonalized {_VIEWS[source.view]}, "
        f"the target {target.optimizer} {_VIEWS[target.view]}: its updates differ from here on"
    ]


_VIEWS = {
    WHOLE: "each matrix whole",
    SPLIT_QKV: "a fused QKV matrix as its Q, K and V blocks apart (split_qkv)",
    PER_HEAD: "each attention head's block apart (per_head)",
    PER_EXPERT: "each expert's matrix apart (per_expert)",
}


def _adamw_notes(source: GroupKind, target: GroupKind) -> list[str]:
    placements = {"group": "eps + sqrt(v) before bias correction", "tensor": "sqrt(v_hat) + eps"}
    placements["int"] = placements["tensor"]
    a, b = placements.get(source.step_in or ""), placements.get(target.step_in or "")
    if a and b and a != b:
        return [
            f"AdamW adds eps as {b}, the checkpoint's optimizer as {a}: no setting matches it "
            "exactly (the difference is of the order of eps)"
        ]
    return []


def _rule(kind: GroupKind) -> str:
    if kind.lr_rule == MOONLIGHT:
        return f"{kind.matched_adamw_rms} * sqrt(max(A, B))"
    return "sqrt(max(1, A / B))"


def _fix(source: GroupKind, target: GroupKind) -> str:
    if source.lr_rule == MOONLIGHT and target.family == "torch":
        if source.matched_adamw_rms == 0.2:
            return 'adjust_lr_fn="match_rms_adamw" continues it'
        return (
            f"torch's rule fixes the factor at 0.2, the checkpoint's is {source.matched_adamw_rms}"
        )
    if source.lr_rule == ASPECT and target.family == "torch":
        return "adjust_lr_fn=None continues it"
    if source.lr_rule == MOONLIGHT and target.family == "packaged":
        return f"matched_adamw_rms={source.matched_adamw_rms} continues it"
    return "no setting of this optimizer reproduces it: scale lr per param shape to match"


@dataclass(frozen=True)
class DcpFamily:
    """How one Muon implementation keeps its state in a PyTorch DCP checkpoint (a DCP
    checkpoint does not record its optimizer: the user names the family)."""

    name: str
    muon: str
    """``module.Class`` of its Muon groups' optimizer."""
    adamw: str
    """``module.Class`` of the optimizer that runs its AdamW params."""
    momentum_form: str
    momentum_key: str
    """The state key of a Muon param's momentum."""
    adamw_keys: tuple[tuple[str, str], ...] = (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))
    """(our key, its key) of an AdamW param's state tensors."""
    mu_setting: str = "momentum"
    """The param-group setting that holds mu."""
    step_in: str = "tensor"
    """Where its AdamW counts steps (as :attr:`GroupKind.step_in`)."""
    lr_rule: str | None = None
    """Its lr scale rule; None: torch's, chosen by the setting ``adjust_lr_fn``."""
    role_setting: str | None = None
    """A param-group setting naming the algorithm of a group (its value ``muon`` or not), or a
    bool ``use_muon``; None: the state keys tell."""
    as_is: bool = False
    """An optimizer muonckpt does not convert (dion's NorMuon): every group is of :attr:`muon`
    with role None and form :data:`UNKNOWN`, as a native save records it; its state keys,
    settings and scalars are kept as they are, in and out."""

    def their_key(self, role: str, key: str) -> str:
        """The family's name of our state key ``key`` of a ``role`` param."""
        if self.as_is:
            return key
        if role == "muon":
            return self.momentum_key if key == "momentum_buffer" else key
        return dict(self.adamw_keys).get(key, key)

    def our_key(self, role: str, key: str) -> str | None:
        """Our name of the family's state key ``key`` of a ``role`` param; None: unknown."""
        if self.as_is:
            return key
        if role == "muon":
            return "momentum_buffer" if key == self.momentum_key else None
        return {theirs: ours for ours, theirs in self.adamw_keys}.get(key)

    def role(self, settings: Mapping[str, Any], keys: Sequence[str]) -> str | None:
        """``muon`` or ``adamw`` for a param with group ``settings`` and state ``keys``
        (:data:`UNKNOWN` for every param of an :attr:`as_is` family)."""
        if self.as_is:
            return UNKNOWN
        if self.role_setting is not None and self.role_setting in settings:
            value = settings[self.role_setting]
            if isinstance(value, int) and value in (0, 1):  # use_muon=1 from a YAML or JSON file
                value = bool(value)
            if value is True or value == "muon":
                return "muon"
            return "adamw" if value is False or value == "adamw" else None  # dion's "lion"
        adamw = {theirs for _, theirs in self.adamw_keys} - {self.momentum_key}
        if adamw & set(keys):  # (dion's AdamW keeps its first moment under Muon's key)
            return "adamw"
        if self.momentum_key in keys:
            return "muon"
        if keys:  # state, but not this family's
            return None
        if "betas" in settings:  # no state yet (never stepped): the settings tell
            return "adamw"
        return "muon" if self.mu_setting in settings else None

    def group_kind(self, role: str, settings: Mapping[str, Any]) -> GroupKind:
        """What a group of this family with ``settings`` computes."""
        if self.as_is:
            return GroupKind(self.muon, None, UNKNOWN)
        if role == "adamw":
            return GroupKind(self.adamw, "adamw", step_in=self.step_in)
        adjust = settings.get("adjust_lr_fn")
        if self.lr_rule is None and adjust not in (None, "original", "match_rms_adamw"):
            raise StateDictError(
                f"the {self.name} Muon group setting 'adjust_lr_fn' is {adjust!r}: muonckpt "
                "knows None, 'original' and 'match_rms_adamw', and no other Muon's rule is it"
            )
        rule = self.lr_rule or (MOONLIGHT if adjust == "match_rms_adamw" else ASPECT)
        rms = settings.get("matched_adamw_rms", 0.2) if rule == MOONLIGHT else None
        mu = settings.get(self.mu_setting)
        if not isinstance(mu, (int, float)) or isinstance(mu, bool) or not 0 <= mu < 1:
            raise StateDictError(
                f"the {self.name} Muon group setting {self.mu_setting!r} (mu) is {mu!r}, "
                "not a number in [0, 1)"
            )
        if rms is not None and (
            not isinstance(rms, (int, float)) or isinstance(rms, bool) or not 0 < rms < math.inf
        ):
            raise StateDictError(
                f"the {self.name} Muon group setting 'matched_adamw_rms' is {rms!r}, not a "
                "positive number"
            )
        nesterov = settings.get("nesterov", True)
        if not isinstance(nesterov, int) or nesterov not in (0, 1):
            raise StateDictError(
                f"the {self.name} Muon group setting 'nesterov' is {nesterov!r}, not a bool"
            )
        view = settings_view(settings)
        return GroupKind(
            self.muon,
            "muon",
            self.momentum_form,
            float(mu),
            bool(nesterov),
            rule,
            rms,
            compute_view=view,
        )

    def target_kind(self, source: GroupKind) -> GroupKind:
        """What ``source``'s group becomes in this family (its form, the source's mu, rule).
        An :attr:`as_is` family takes only a group of its own optimizer (or of a class of its
        name, a port of it: ``tests.dion_normuon.NorMuon``), which it keeps unconverted."""
        if self.as_is:
            own_class = source.optimizer.rsplit(".", 1)[-1] == self.muon.rsplit(".", 1)[-1]
            if source.role is not None or not own_class:
                raise StateDictError(
                    f"{source.optimizer} is not {self.muon}: muonckpt writes {self.name} "
                    f"state only from a {self.muon} checkpoint, unconverted"
                )
            return GroupKind(self.muon, None, UNKNOWN)
        if source.role == "adamw":
            return GroupKind(self.adamw, "adamw", step_in=self.step_in)
        if source.role != "muon":
            raise StateDictError(f"{source.optimizer} is not an optimizer muonckpt can convert")
        return GroupKind(
            self.muon,
            "muon",
            self.momentum_form,
            source.momentum,
            source.nesterov,
            source.lr_rule,
            source.matched_adamw_rms,
        )


DCP_FAMILIES: dict[str, DcpFamily] = {
    f.name: f
    for f in (
        DcpFamily("packaged", "muonckpt.Muon", "muonckpt.Muon", SUM, "momentum_buffer",
                  step_in="group", lr_rule=MOONLIGHT, role_setting="use_muon"),
        DcpFamily("torch", "torch.optim.Muon", "torch.optim.AdamW", EMA, "momentum_buffer"),
        DcpFamily("torchtitan", TORCHTITAN, "torch.optim.AdamW", EMA,
                  "momentum_buffer"),
        DcpFamily("keller-jordan", "muon.MuonWithAuxAdam", "muon.MuonWithAuxAdam", EMA,
                  "momentum_buffer", step_in="int", role_setting="use_muon"),
        DcpFamily("dion", "dion.Muon", "dion.Muon", SUM, "momentum",
                  (("exp_avg", "momentum"), ("exp_avg_sq", "variance")), mu_setting="mu",
                  role_setting="algorithm"),
        DcpFamily("muon-fsdp2", "muon_fsdp2.Muon", "muon_fsdp2.Muon", EMA, "m",
                  step_in="int", role_setting="use_muon"),
        DcpFamily("dion-normuon", "dion.NorMuon", "dion.NorMuon", UNKNOWN, "momentum",
                  mu_setting="mu", step_in="group", role_setting="algorithm", as_is=True),
    )
}  # fmt: skip
"""The implementations whose DCP state muonckpt reads and writes, by the name ``--from`` /
``--to`` take: keys, momentum form, mu's setting and where AdamW counts steps."""


def kept_form(optimizer: str) -> str | None:
    """The momentum form the Muon implementation ``optimizer`` (``module.Class``) keeps; None
    for one muonckpt does not know."""
    if optimizer in MOMENTUM_FORMS:
        return MOMENTUM_FORMS[optimizer]
    return next((f.momentum_form for f in DCP_FAMILIES.values() if f.muon == optimizer), None)
