"""The module-FQN pattern grammar: how plans name modules, and nothing else (resolution lives in ``resolve``).

Patterns are matched against the *whole* FQN, one ``.``-separated segment at a time:

=============  ================================================================================
``layers``     a literal segment, compared exactly
``*``          exactly one segment
``**``         zero or more segments (so ``**`` alone also matches the root module ``""``)
``a:b``        one integer segment ``i`` with ``a <= i < b`` (``layers.0:16`` = layers 0-15);
               open ends are allowed: ``:b`` means ``0:b``, ``a:`` means ``a`` and above
=============  ================================================================================

Why not fnmatch (see NOTES.md section 4): ``[0-15]`` is a character class and ``*`` crosses dots, so the same
text means different things in different tools. Everything outside the table above is rejected with a hint
instead of being guessed at: ``layers.[0-15]`` ("use layers.0:16"), partial wildcards (``layer*``, ``lay?rs``),
empty segments (``layers..0``, leading/trailing dots, the empty pattern), ``***``, a bare ``:``, an empty
range (``a:b`` with ``a >= b``) and wrapper segments inside a pattern.

Wrapper segments (``_orig_mod`` from ``torch.compile``, ``_checkpoint_wrapped_module``, ``_fsdp_wrapped_module``)
are not part of the FQN a user thinks in, so they are dropped from module FQNs before matching
(``overlapcfg.module_paths.strip_wrappers``). A pattern that spells one is rejected, since it could never match.

Matching is a linear-time NFA walk over the segments (no regexes, no backtracking), so ``**.**.**.x``
against a deep FQN costs ``O(len(pattern) * len(fqn))``; a pattern needing more segments than an FQN has (or,
without ``**``, fewer) is rejected before the walk.

Matching many patterns against one model goes through ``overlapcfg.config.module_index.ModuleIndex`` (which also
makes the "did you mean" suggestions).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import TypeAlias

from overlapcfg.errors import OverlapConfigError, OverlapUsageError
from overlapcfg.module_paths import WRAPPER_SEGMENTS, split_fqn, strip_wrappers

__all__ = [
    "AnySegment",
    "AnySegments",
    "IndexRange",
    "Literal",
    "Pattern",
    "Segment",
    "compile_pattern",
]

_INDEX = re.compile(r"[0-9]+")
_RANGE = re.compile(r"(-?[0-9]*):(-?[0-9]*)")
_CHAR_CLASS = re.compile(r"\[([0-9]+)(?:-([0-9]+))?\]")


@dataclass(frozen=True, slots=True)
class Literal:
    """A segment compared exactly (``layers``, ``0``)."""

    text: str

    def accepts(self, part: str) -> bool:
        return part == self.text

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True, slots=True)
class AnySegment:
    """``*``: exactly one segment, whatever it is."""

    def accepts(self, part: str) -> bool:
        return True

    def __str__(self) -> str:
        return "*"


@dataclass(frozen=True, slots=True)
class AnySegments:
    """``**``: zero or more segments. Handled by the matcher itself; ``accepts`` is for symmetry."""

    def accepts(self, part: str) -> bool:
        return True

    def __str__(self) -> str:
        return "**"


@dataclass(frozen=True, slots=True)
class IndexRange:
    """``start:stop``: one decimal-integer segment in ``[start, stop)``; ``stop=None`` is unbounded."""

    start: int
    stop: int | None

    def accepts(self, part: str) -> bool:
        if not _INDEX.fullmatch(part):
            return False
        value = int(part)
        return value >= self.start and (self.stop is None or value < self.stop)

    def __str__(self) -> str:
        return f"{self.start}:{'' if self.stop is None else self.stop}"


Segment: TypeAlias = Literal | AnySegment | AnySegments | IndexRange


@dataclass(frozen=True, slots=True)
class Pattern:
    """A compiled pattern. Build with :func:`compile_pattern`; ``text`` is what the user wrote."""

    text: str
    segments: tuple[Segment, ...]

    def matches(self, fqn: str) -> bool:
        """Whether the whole ``fqn`` (wrapper segments dropped) matches this pattern."""
        return _match(self.segments, split_fqn(strip_wrappers(fqn)))

    def __str__(self) -> str:
        return self.text


def compile_pattern(text: str, *, path: str = "") -> Pattern:
    """Parse ``text`` into a :class:`Pattern`.

    Raises ``OverlapConfigError`` (one fault at ``path``) naming the pattern, what is wrong and the fix.
    ``TypeError`` for a non-string: that is API misuse, not bad config data (the schema checks types first).
    """
    if not isinstance(text, str):
        raise OverlapUsageError(f"compile_pattern expects a str, got {type(text).__name__}: {text!r}")
    parsed = _parse(text)
    if isinstance(parsed, str):
        raise OverlapConfigError.single(path, f"bad pattern {text!r}: {parsed}")
    return Pattern(text, parsed)


def _min_parts(segments: tuple[Segment, ...]) -> int:
    return sum(1 for seg in segments if not isinstance(seg, AnySegments))


def _fits(segments: tuple[Segment, ...], n_parts: int) -> bool:
    """Cheap length filter: without ``**`` the lengths must be equal, with one the FQN must be long enough."""
    need = _min_parts(segments)
    if any(isinstance(seg, AnySegments) for seg in segments):
        return n_parts >= need
    return n_parts == need


def _match(segments: tuple[Segment, ...], parts: tuple[str, ...]) -> bool:
    """NFA simulation over the set of live states: state ``i`` means the first ``i`` pattern segments can
    consume the parts read so far. Only live states are visited, so a step costs at most ``len(pattern)``."""
    if not _fits(segments, len(parts)):
        return False
    n = len(segments)
    live = _close({0}, segments)
    for part in parts:
        step: set[int] = set()
        for i in live:
            if i == n:
                continue
            seg = segments[i]
            if isinstance(seg, AnySegments):
                step.add(i)
            elif seg.accepts(part):
                step.add(i + 1)
        if not step:
            return False
        live = _close(step, segments)
    return n in live


def _close(live: set[int], segments: tuple[Segment, ...]) -> set[int]:
    """Let every live ``**`` also match zero segments (follow the epsilon edges, which only go forward)."""
    todo = [i for i in live if i < len(segments) and isinstance(segments[i], AnySegments)]
    while todo:
        nxt = todo.pop() + 1
        if nxt not in live:
            live.add(nxt)
            if nxt < len(segments) and isinstance(segments[nxt], AnySegments):
                todo.append(nxt)
    return live


@functools.lru_cache(maxsize=4096)
def _parse(text: str) -> tuple[Segment, ...] | str:
    """Segments of ``text``, or the reason it is rejected (cached: plans reuse the same few patterns)."""
    if not text.strip():
        return "a pattern needs at least one segment; '**' matches every module, the root included"
    raw = text.split(".")
    if "" in raw:
        return _empty_segment_hint(text, raw)
    segments: list[Segment] = []
    for i, part in enumerate(raw):
        seg = _parse_segment(part, text, raw, i)
        if isinstance(seg, str):
            return seg
        if isinstance(seg, AnySegments) and segments and isinstance(segments[-1], AnySegments):
            continue  # '**.**' is '**'; collapsing keeps the matcher's state count minimal
        segments.append(seg)
    return tuple(segments)


def _parse_segment(part: str, text: str, raw: list[str], i: int) -> Segment | str:
    if part == "*":
        return AnySegment()
    if part == "**":
        return AnySegments()
    if part.strip() != part or any(c.isspace() for c in part):
        return f"segment {part!r} contains whitespace; module names never do"
    if part in WRAPPER_SEGMENTS:
        fixed = _replace(raw, i, None) or "**"
        return (
            f"wrapper segment {part!r} is dropped from module FQNs before matching, so it never matches; "
            f"write {fixed}"
        )
    if ":" in part:
        return _parse_range(part)
    if "[" in part or "]" in part:
        return _bracket_hint(part, raw, i)
    if "{" in part or "}" in part:
        return f"segment {part!r}: '{{a,b}}' alternatives are not supported; list each pattern in a list entry"
    if "*" in part or "?" in part:
        return _partial_wildcard_hint(part, raw, i)
    return Literal(part)


def _parse_range(part: str) -> IndexRange | str:
    m = _RANGE.fullmatch(part)
    if m is None:
        return f"segment {part!r}: ':' is only allowed in an index range 'start:stop' of non-negative integers"
    lo_text, hi_text = m.groups()
    if not lo_text and not hi_text:
        return "a bare ':' is not a range; write '0:' for any index or '*' for any segment"
    if lo_text.startswith("-") or hi_text.startswith("-"):
        return f"range {part!r}: indices are non-negative, negative (from-the-end) indices are not supported"
    lo = int(lo_text) if lo_text else 0
    hi = int(hi_text) if hi_text else None
    if hi is not None and lo >= hi:
        return f"range {part!r} is empty: 'start:stop' is half-open and needs start < stop (e.g. '{lo}:{lo + 1}')"
    return IndexRange(lo, hi)


def _empty_segment_hint(text: str, raw: list[str]) -> str:
    fixed = ".".join(p for p in raw if p)
    where = "a leading or trailing '.'" if raw[0] == "" or raw[-1] == "" else "'..'"
    fix = f"; write {fixed}" if fixed else ""
    return f"empty segment ({where}): segments are separated by exactly one '.'{fix}"


def _bracket_hint(part: str, raw: list[str], i: int) -> str:
    m = _CHAR_CLASS.fullmatch(part)
    if m is None:
        return (
            f"segment {part!r}: '[...]' is not supported (it is an fnmatch character class, not a range); "
            "write an index range 'start:stop' (half-open) as a whole segment, e.g. layers.0:16"
        )
    lo, hi = m.group(1), m.group(2)
    replacement = lo if hi is None else f"{lo}:{int(hi) + 1}"
    if hi is not None and int(lo) > int(hi):
        return f"segment {part!r}: '[a-b]' is not supported and this range is empty (start > end)"
    return (
        f"segment {part!r}: '[a-b]' is an fnmatch character class, not a range; "
        f"ranges are half-open 'start:stop', use {_replace(raw, i, replacement)}"
    )


def _partial_wildcard_hint(part: str, raw: list[str], i: int) -> str:
    if part.strip("*") == "":
        return f"segment {part!r} is not a wildcard; write '*' for exactly one segment or '**' for any number"
    one = _replace(raw, i, "*")
    hint = f"'*' matches a whole segment, not part of one; write {one} for any segment here"
    stem = part.rstrip("*")
    if part.endswith("*") and "*" not in stem and "?" not in stem:
        hint += f", {_replace(raw, i, stem + '.*')} for the children of {stem!r}, or list the exact names"
    else:
        hint += ", or list the exact names"
    if "?" in part:
        return f"segment {part!r}: '?' is not supported; {hint}"
    return f"segment {part!r}: {hint}"


def _replace(raw: list[str], i: int, new: str | None) -> str:
    """``raw`` joined with segment ``i`` replaced (``None`` drops it): the corrected pattern for a hint."""
    out = [*raw[:i], *([] if new is None else [new]), *raw[i + 1 :]]
    return ".".join(out)
