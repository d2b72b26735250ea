"""Which conversion ``muonckpt convert`` asks for, chosen from the one registry of foreign
formats (:data:`muonckpt.interop.FORMATS`): a muonckpt checkpoint rewritten for another
implementation or renamed, a foreign checkpoint read into muonckpt's format, or a muonckpt
checkpoint written as a foreign one. Every combination of options that asks for none of
these is refused here, before anything is read, naming the option at fault as the command
line spells it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import OptionError
from ..format import FAMILIES
from ..interop import FORMATS, ForeignFormat, detect, format_named
from .options import S3_SCHEME

__all__ = ["MUONCKPT", "Route", "reading_hint", "route"]

MUONCKPT = "muonckpt"
"""``convert --format``'s name of muonckpt's own format."""


@dataclass(frozen=True)
class Route:
    """A conversion: from a foreign format (``reads``), to one (``writes``), or, both None,
    from muonckpt's format to itself; with the options of the chosen format's reader or
    writer (an instance of its ``read_options`` or ``write_options``)."""

    reads: ForeignFormat[Any, Any] | None = None
    writes: ForeignFormat[Any, Any] | None = None
    options: Any = None
    source: str | None = None
    """The implementation that wrote a foreign checkpoint read (``--from``, or the one its
    files record)."""
    to: str | None = None
    """The family a foreign checkpoint read is converted for: ``--to``, else ``--from``'s
    where it is one of muonckpt's (None: the writer's own groups and form)."""
    inferred: bool = False
    """Whether :attr:`source` was inferred from what the files record (no ``--from``)."""


def route(
    src: str | os.PathLike[str],
    *,
    to: str | None,
    source: str | None,
    output_format: str,
    renamed: bool,
    overwrite: bool,
    options: Mapping[str, Any],
) -> Route:
    """The conversion of ``src`` that ``convert``'s options ask for: ``to`` (``--to``),
    ``source`` (``--from``), ``output_format`` (``--format``), ``renamed`` (any ``--rename``),
    ``overwrite`` (``--force``) and ``options``, the foreign formats' own options by name
    (``layout``, ``model_prefix``, ``world``), of which the route gives its format's options
    record those it has. ``--to NAME`` of a format that writes for itself (``--to deepspeed``) is
    ``--format NAME --to NAME``.

    Raises:
        OptionError: for options that ask for no conversion, or a value outside its choices.
    """
    foreign = [f.name for f in FORMATS]
    in_s3 = os.fspath(src).startswith(S3_SCHEME)  # foreign files are never looked for there
    detected = None if in_s3 else detect(src)
    if renamed and (output_format in foreign or source is not None or detected):
        raise OptionError("names are mapped between muonckpt checkpoints only")
    if output_format == MUONCKPT and to in foreign and to in format_named(to).targets:
        output_format = to
    if output_format != MUONCKPT and output_format not in foreign:
        raise OptionError(f"choose {' or '.join([MUONCKPT, *foreign])}", "--format")
    if in_s3 and (output_format != MUONCKPT or source is not None):
        raise OptionError(
            "foreign formats are converted from and to local directories only: copy "
            f"{os.fspath(src)} to a directory first"
        )
    if output_format != MUONCKPT:
        chosen = _writing(format_named(output_format), detected, to, overwrite, options)
    elif to is not None and to not in FAMILIES:
        written = [f.name for f in FORMATS if f.name in f.targets]  # (--to NAME: its files)
        raise OptionError(f"choose one of {', '.join([*FAMILIES, *written])}", "--to")
    elif detected is None and source is None:  # with --from, the reader says what SRC is
        if to is None and not renamed:
            raise OptionError("give --to, --rename or both", "--to")
        chosen = Route()
    else:
        chosen = _reading(src, to, source, options)
    _check_switches(chosen, options)
    return chosen


def _check_switches(chosen: Route, options: Mapping[str, Any]) -> None:
    """Refuse a switch (``--split-experts``, ``--model-buffers``, ``--allow-large-world``)
    turned on for a conversion whose reader or writer does not take it, rather than ignore it."""
    foreign = chosen.reads or chosen.writes
    taken = [f.name for f in dataclasses.fields(chosen.options)] if foreign is not None else []
    for option, value in options.items():
        if value is True and option not in taken:
            what = foreign.title if foreign is not None else "this conversion"
            raise OptionError(f"{what} does not take it", _flag(option))


def _options(kind: type[Any], options: Mapping[str, Any]) -> Any:
    """A format's options record (``kind``) of the values ``options`` has for its fields
    (the others at its defaults); a value outside a field's choices raises its
    :class:`~muonckpt.errors.OptionError`."""
    return kind(**{f.name: options[f.name] for f in dataclasses.fields(kind) if f.name in options})


def _writing(
    format_: ForeignFormat[Any, Any],
    detected: ForeignFormat[Any, Any] | None,
    to: str | None,
    overwrite: bool,
    options: Mapping[str, Any],
) -> Route:
    """A muonckpt checkpoint written as one of ``format_``, its options checked."""
    if format_.writer is None or format_.write_options is None:
        raise OptionError(f"muonckpt reads {format_.title} checkpoints but does not write them")
    if to not in format_.targets:
        raise OptionError(f"choose one of {', '.join(format_.targets)}", "--to")
    given = _options(format_.write_options, options)
    missing = [name for name in format_.write_requires if options.get(name) is None]
    if missing:
        needed = "; ".join(f"{_flag(n)}, {format_.write_requires[n]}" for n in missing)
        raise OptionError(f"{format_.title} output needs {needed}", _flag(missing[0]))
    if detected is format_:
        raise OptionError(f"SRC is a {format_.title} checkpoint already", "--format")
    if detected is not None:
        raise OptionError(
            f"SRC is a {detected.title} checkpoint: convert it to {MUONCKPT} first", "--format"
        )
    if overwrite:
        raise OptionError(f"{format_.title} output is never written over an existing directory")
    return Route(writes=format_, options=given)


def _reading(
    src: str | os.PathLike[str], to: str | None, source: str | None, options: Mapping[str, Any]
) -> Route:
    """A foreign checkpoint read: which format reads it, and from which implementation."""
    format_ = detect(src)
    if format_ is None and source is not None:
        # The first format that reads what ``source`` saves: it says why ``src`` is not one (an
        # unfinished save, say). A torchtitan ``step-N`` directory is plain DCP: read by DCP's
        # reader with ``--from torchtitan``.
        format_ = next((f for f in FORMATS if source in f.sources), None)
    candidates = [format_] if format_ is not None else list(FORMATS)
    titles = " or ".join(f.title for f in candidates)
    recorded = format_ is not None and format_.records_source
    sources = ", ".join(dict.fromkeys(s for f in candidates for s in f.sources))
    inferred = source is None and format_ is not None and recorded
    if inferred:
        assert format_ is not None
        source = format_.sources[0]
    if source is None:
        raise OptionError(
            f"a {titles} checkpoint does not record which optimizer wrote it, and muonckpt "
            f"never guesses its momentum form: pass --from, one of {sources}",
            "--from",
        )
    if format_ is None or source not in format_.sources:
        raise OptionError(f"choose one of {sources}", "--from")
    if to is None and not recorded and source in FAMILIES:
        to = source  # --from torch alone round-trips: torch in, torch out
    given = _options(format_.read_options, options)
    return Route(reads=format_, options=given, source=source, to=to, inferred=inferred)


def reading_hint(src: str | os.PathLike[str]) -> str | None:
    """For a foreign checkpoint ``src``: one sentence naming its format and the ``convert``
    command that reads it; None for anything else."""
    if os.fspath(src).startswith(S3_SCHEME):
        return None
    format_ = detect(src)
    if format_ is None:
        return None
    command = f"muonckpt convert {os.fspath(src)} -o OUT"
    if not format_.records_source:
        command += f" --from WRITER (one of {', '.join(format_.sources)}: its files do not say)"
    return f"{os.fspath(src)} is a {format_.title} checkpoint, not a muonckpt one: {command}"


def _flag(option: str) -> str:
    """An option's name as the command line spells it: ``model_prefix`` -> ``--model-prefix``."""
    return "--" + option.replace("_", "-")
