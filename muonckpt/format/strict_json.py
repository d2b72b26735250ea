"""Strict JSON, as the checkpoint format requires it: finite numbers, no key twice in an
object, bounded depth; parsed whole (:func:`strict_json`) or as a stream never held whole
(:func:`strict_json_chunks`); and which strings are text UTF-8 can hold (:func:`valid_text`).

Pure: the standard library's JSON decoder and nothing of the package.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

MAX_JSON_DEPTH = 32
"""How deeply a manifest's JSON may nest (a manifest needs 6 levels; hyperparameters such as
AdamW's ``betas`` one more each)."""


_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(value: str) -> bool:
    """Whether ``value`` is text UTF-8 can hold: no lone surrogate, which a JSON ``\\ud800``
    escape decodes to and no file, header or manifest can store (the readers refuse such a
    name where they read it, so that no writer meets it)."""
    return value.isascii() or _SURROGATE.search(value) is None


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


class TextWindow:
    """A window onto JSON text that arrives in chunks, at a position: the text before the
    position is dropped as the window moves on, so the text is never held whole (a manifest,
    and a safetensors header, of 100k params is tens of MB)."""

    def __init__(self, chunks: Iterable[str]) -> None:
        self._chunks = iter(chunks)
        self.text, self.pos, self._eof = "", 0, False

    def peek(self) -> str:
        """The next character after whitespace ('' at the end), the position moved to it."""
        while True:
            self.pos = _WHITESPACE.match(self.text, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.text):
                return self.text[self.pos]
            if not self.more():
                return ""

    def expect(self, char: str) -> None:
        """Step past ``char``, the next character after whitespace; ValueError if it is not."""
        if self.peek() != char:
            raise ValueError(f"expected {char!r}")
        self.pos += 1

    def scan(self, scan_once: Callable[[str, int], tuple[Any, int]]) -> Any:
        """The JSON value at the position, as a decoder's ``scan_once`` makes it, reading on
        where the window cut it short (an object, or a number: "2." of "2.5")."""
        self.peek()
        while True:
            try:
                value, end = scan_once(self.text, self.pos)
            except (StopIteration, json.JSONDecodeError):  # perhaps cut off by the window
                if self.more():
                    continue
                raise ValueError("not a JSON value") from None
            cut = end == len(self.text) or self.text[end] not in _AFTER_VALUE
            if cut and self.more():
                continue
            self.pos = end
            return value

    def more(self) -> bool:
        """Extend the window by at least what it holds past the position (so that a long value
        is read in linear time); False at the end."""
        if self._eof:
            return False
        self.text = self.text[self.pos :]
        self.pos = 0
        added: list[str] = []
        while sum(map(len, added)) <= len(self.text):
            chunk = next(self._chunks, None)
            if chunk is None:
                self._eof = True
                break
            added.append(chunk)
        self.text += "".join(added)
        return bool(added)


class _JsonStream:
    """A JSON object parsed from a window onto a stream of text (:func:`strict_json_chunks`)."""

    def __init__(
        self,
        chunks: Iterable[str],
        objects: Callable[[dict[str, Any]], Any] | None,
        elements: Mapping[str, Callable[[Any], Any]],
    ) -> None:
        self._window, self._elements = TextWindow(chunks), elements
        self._scan = json.JSONDecoder(**_strict_options(objects)).scan_once  # type: ignore[attr-defined]
        self._objects = objects

    def document(self) -> Any:
        window = self._window
        window.expect("{")
        body: dict[str, Any] = {}
        while window.peek() != "}" or body:
            if window.peek() != '"':
                raise ValueError("expected a member name")
            key = self._value(0)
            window.expect(":")
            if key in body:
                raise ValueError(f"key(s) {[key]} appear twice in one object")
            is_array = window.peek() == "["
            body[key] = self._array(self._elements.get(key)) if is_array else self._value(1)
            if window.peek() != ",":
                break
            window.pos += 1
        window.expect("}")
        if window.peek():
            raise ValueError("extra data after the object")
        return body if self._objects is None else self._objects(body)

    def _array(self, convert: Callable[[Any], Any] | None) -> list[Any]:
        window = self._window
        window.expect("[")
        items: list[Any] = []
        while window.peek() != "]" or items:
            item = self._value(2)
            items.append(item if convert is None else convert(item))
            if window.peek() != ",":
                break
            window.pos += 1
        window.expect("]")
        return items

    def _value(self, above: int) -> Any:
        """The value at the position, found ``above`` levels deep."""
        value = self._window.scan(self._scan)
        _check_depth(value, above)
        return value


def _children(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return list(value.values())
    return list(value) if isinstance(value, list) else []
