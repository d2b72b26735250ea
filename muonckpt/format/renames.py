"""How a checkpoint's param names are mapped onto an optimizer's: the ``rename`` argument of
:func:`muonckpt.load` and ``convert``, and the heuristics that tell which prefix a wrapper
(DDP, ``torch.compile``) added or removed.

Pure: names only. A change to how names are matched or how a mismatch is explained goes here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from ..errors import ArgumentError

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
        raise ArgumentError(
            f"rename must be a function of the name or a mapping of prefixes, got {rename!r}",
            argument="rename",
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


UNNAMED_HINT = (
    "the optimizer's params have no names (it was built from model.parameters(): muonckpt "
    "calls them '0', '1', ...) and the checkpoint's have: build it from "
    "model.named_parameters(), as the optimizer that saved was"
)
"""Why an optimizer over unnamed params cannot load a checkpoint of named ones, and the fix."""


def names_hint(saved: Iterable[str], current: Iterable[str]) -> str | None:
    """One sentence saying why the checkpoint's (``saved``) and the optimizer's (``current``)
    names differ and how to fix it: an optimizer without names (:data:`UNNAMED_HINT`), or the
    prefix by which they differ and the ``rename`` that maps it; None when neither explains it."""
    saved, current = list(saved), list(current)
    if current and all(n.isdecimal() for n in current) and any(not n.isdecimal() for n in saved):
        return UNNAMED_HINT
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
