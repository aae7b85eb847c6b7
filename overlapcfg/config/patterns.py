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
(:func:`strip_wrappers`). A pattern that spells one is rejected, since it could never match.

Matching is a linear-time NFA walk over the segments (no regexes, no backtracking), so ``**.**.**.x``
against a deep FQN costs ``O(len(pattern) * len(fqn))``; a pattern needing more segments than an FQN has (or,
without ``**``, fewer) is rejected before the walk.

Matching many patterns against one model goes through :class:`ModuleIndex`, which splits the FQNs once and
indexes them, so that a literal pattern is one dict lookup and a pattern starting with a literal segment only
visits the FQNs starting with it: a plan of 10k literal FQNs on a 10k-module model is linear, not 10**8 walks.
"""

from __future__ import annotations

import bisect
import difflib
import functools
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from overlapcfg.errors import OverlapConfigError, natural_key

__all__ = [
    "WRAPPER_SEGMENTS",
    "AnySegment",
    "AnySegments",
    "IndexRange",
    "Literal",
    "ModuleIndex",
    "Pattern",
    "Segment",
    "compile_pattern",
    "is_inside",
    "match_modules",
    "normalize_fqns",
    "split_fqn",
    "strip_wrappers",
    "suggest_fixes",
]

WRAPPER_SEGMENTS: tuple[str, ...] = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
"""Segments inserted by ``torch.compile``, activation checkpointing and FSDP1 wrappers; never matched."""

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

    @property
    def is_literal(self) -> bool:
        """True when the pattern names one FQN exactly (no wildcard, no range)."""
        return all(isinstance(s, Literal) for s in self.segments)

    @property
    def min_parts(self) -> int:
        """Fewest FQN segments this pattern can match (every segment but ``**`` consumes one)."""
        return _min_parts(self.segments)

    def matches(self, fqn: str) -> bool:
        """Whether the whole ``fqn`` (wrapper segments dropped) matches this pattern."""
        return _match(self.segments, split_fqn(strip_wrappers(fqn)))

    def __str__(self) -> str:
        return self.text


def split_fqn(fqn: str) -> tuple[str, ...]:
    """Segments of an FQN; the root module ``""`` has none (``"".split(".")`` would give one empty segment)."""
    return tuple(fqn.split(".")) if fqn else ()


def strip_wrappers(fqn: str) -> str:
    """``_orig_mod.layers.0._checkpoint_wrapped_module.attention`` -> ``layers.0.attention``."""
    if not any(w in fqn for w in WRAPPER_SEGMENTS):
        return fqn
    return ".".join(p for p in split_fqn(fqn) if p not in WRAPPER_SEGMENTS)


def normalize_fqns(fqns: Iterable[str]) -> tuple[str, ...]:
    """Wrapper-stripped FQNs in first-seen order, duplicates dropped.

    A compiled model lists both ``""`` and ``_orig_mod``, which are the same module once stripped.
    """
    return tuple(dict.fromkeys(strip_wrappers(f) for f in fqns))


def is_inside(fqn: str, ancestor: str) -> bool:
    """Whether ``fqn`` is ``ancestor`` or nested in it, by whole segments: ``layers.10`` is not in ``layers.1``.

    Every module is inside the root ``""``.
    """
    return not ancestor or fqn == ancestor or fqn.startswith(ancestor + ".")


def compile_pattern(text: str, *, path: str = "") -> Pattern:
    """Parse ``text`` into a :class:`Pattern`.

    Raises ``OverlapConfigError`` (one fault at ``path``) naming the pattern, what is wrong and the fix.
    ``TypeError`` for a non-string: that is API misuse, not bad config data (the schema checks types first).
    """
    if not isinstance(text, str):
        raise TypeError(f"compile_pattern expects a str, got {type(text).__name__}: {text!r}")
    parsed = _parse(text)
    if isinstance(parsed, str):
        raise OverlapConfigError.single(path, f"bad pattern {text!r}: {parsed}")
    return Pattern(text, parsed)


SUGGEST_EDITS = 24
"""Most candidate fixes tried for one unmatched pattern (each costs up to one scan of the model)."""
SHAPE_POOL = 1_000
"""Most module shapes compared with an unmatched pattern when looking for the closest modules."""


class ModuleIndex:
    """One model's FQNs (wrappers stripped, model order, each once), split once and indexed for matching.

    ``visited`` counts the FQNs handed to the NFA: the work counter that tests assert on instead of timings.
    """

    def __init__(self, fqns: Iterable[str]) -> None:
        self.fqns: tuple[str, ...] = normalize_fqns(fqns)
        self.parts: tuple[tuple[str, ...], ...] = tuple(split_fqn(f) for f in self.fqns)
        self.position: dict[str, int] = {f: i for i, f in enumerate(self.fqns)}
        # A trie of FQN prefixes (intermediate ones included): children by segment, and every FQN below.
        self._kids: dict[str, dict[str, str]] = {}
        self._under: dict[str, list[int]] = {}
        self._numbered: dict[str, list[tuple[int, str]]] = {}
        self.by_last: dict[str, list[int]] = {}
        for i, segs in enumerate(self.parts):
            prefix = ""
            self._under.setdefault("", []).append(i)
            for seg in segs:
                child = f"{prefix}.{seg}" if prefix else seg
                self._kids.setdefault(prefix, {})[seg] = child
                self._under.setdefault(child, []).append(i)
                prefix = child
            if segs:
                self.by_last.setdefault(segs[-1], []).append(i)
        self.max_parts = max((len(p) for p in self.parts), default=0)
        self.top_level: tuple[str, ...] = tuple(f for f in self.fqns if f and "." not in f)
        self.visited = 0
        self._vocabulary: list[str] | None = None
        self._shapes: dict[str, list[int]] | None = None
        self._closest_words: dict[str, list[str]] = {}

    def match(self, pattern: Pattern | str) -> list[str]:
        """The FQNs matching ``pattern``, in model order."""
        pat = compile_pattern(pattern) if isinstance(pattern, str) else pattern
        return [self.fqns[i] for i in self._hits(pat.segments)]

    def any_match(self, segments: tuple[Segment, ...]) -> bool:
        """Whether some FQN matches (stops at the first)."""
        return next(self._hits(segments), None) is not None

    def _hits(self, segments: tuple[Segment, ...]) -> Iterator[int]:
        for i in self._candidates(segments):
            self.visited += 1
            if _match(segments, self.parts[i]):
                yield i

    def _candidates(self, segments: tuple[Segment, ...]) -> Sequence[int]:
        """FQN positions that can match, in model order: walk the trie along the segments before the first
        ``**`` (a literal is one lookup, a range a slice of the numbered children), then take everything below
        the nodes reached, or the FQNs ending in the pattern's last literal if those are fewer."""
        if _min_parts(segments) > self.max_parts:
            return ()
        nodes = [""]
        walked = 0
        for seg in segments:
            if isinstance(seg, AnySegments):
                break
            nodes = [c for node in nodes for c in self._step(node, seg)]
            walked += 1
            if not nodes:
                return ()
        if walked == len(segments):
            return sorted(self.position[n] for n in nodes if n in self.position)
        pool = [i for n in nodes for i in self._under.get(n, ())]
        last = segments[-1]
        if isinstance(last, Literal) and len(ending := self.by_last.get(last.text, ())) < len(pool):
            return ending
        return sorted(pool) if len(nodes) > 1 else pool

    def _step(self, node: str, seg: Segment) -> Iterable[str]:
        kids = self._kids.get(node)
        if not kids:
            return ()
        if isinstance(seg, Literal):
            child = kids.get(seg.text)
            return () if child is None else (child,)
        if isinstance(seg, AnySegment):
            return kids.values()
        assert isinstance(seg, IndexRange)
        if node not in self._numbered:
            self._numbered[node] = sorted((int(k), c) for k, c in kids.items() if _INDEX.fullmatch(k))
        numbered = self._numbered[node]
        lo = bisect.bisect_left(numbered, (seg.start, ""))
        hi = len(numbered) if seg.stop is None else bisect.bisect_left(numbered, (seg.stop, ""))
        return [c for _, c in numbered[lo:hi]]

    @property
    def vocabulary(self) -> list[str]:
        """Every segment name in the model, in natural order (the pool for "did you mean" on one segment)."""
        if self._vocabulary is None:
            words = dict.fromkeys(p for segs in self.parts for p in segs)
            self._vocabulary = sorted(words, key=natural_key)
        return self._vocabulary

    def closest_words(self, word: str) -> list[str]:
        """The three segment names closest to ``word`` (cached: a pattern repeats its literals)."""
        if word not in self._closest_words:
            self._closest_words[word] = difflib.get_close_matches(word, self.vocabulary, n=3, cutoff=0.5)
        return self._closest_words[word]

    def closest_modules(self, pattern: Pattern, n: int = 3) -> list[str]:
        """FQNs resembling ``pattern``, with bounded work: the pattern is compared with module *shapes*
        (``layers.#.attention``: index segments folded) rather than with every FQN, then within the closest
        shapes with at most 200 of their modules."""
        if self._shapes is None:
            self._shapes = {}
            for i, segs in enumerate(self.parts):
                if segs:
                    self._shapes.setdefault(_shape(segs), []).append(i)
        target = _shape(tuple(str(s) if not isinstance(s, IndexRange) else "#" for s in pattern.segments))
        pool = list(self._shapes)
        if len(pool) > SHAPE_POOL:
            same = [sh for sh in pool if sh.count(".") == target.count(".")]
            pool = (same + [sh for sh in pool if sh.count(".") != target.count(".")])[:SHAPE_POOL]
        out: list[str] = []
        for shape in difflib.get_close_matches(target, pool, n=n, cutoff=0.5):
            members = [self.fqns[i] for i in self._shapes[shape][:200]]
            best = difflib.get_close_matches(pattern.text, members, n=1, cutoff=0.0)
            out.append(best[0] if best else members[0])
        return out


def _shape(segs: tuple[str, ...]) -> str:
    return ".".join("#" if s.isascii() and s.isdigit() else s for s in segs)


def match_modules(pattern: Pattern | str, fqns: Sequence[str] | ModuleIndex) -> list[str]:
    """The wrapper-stripped FQNs matching ``pattern``, in the given (model) order, each once."""
    index = fqns if isinstance(fqns, ModuleIndex) else ModuleIndex(fqns)
    return index.match(pattern)


def suggest_fixes(pattern: Pattern, fqns: Sequence[str] | ModuleIndex, n: int = 3) -> list[str]:
    """Patterns one edit away from ``pattern`` that do match some of ``fqns`` (for "did you mean").

    An edit replaces one literal segment with the closest real segment name (``layer.*`` -> ``layers.*``) or
    widens a ``*`` to ``**`` (``*.wq`` -> ``**.wq``). If no single edit works, every literal segment that no
    FQN contains is replaced by its closest name at once (``layer.*.atention`` -> ``layers.*.attention``).
    At most ``SUGGEST_EDITS`` candidates are tried: a long pattern has many possible edits, and a hint is
    not worth a long wait.
    """
    index = fqns if isinstance(fqns, ModuleIndex) else ModuleIndex(fqns)
    found: list[str] = []
    for tried, candidate in enumerate(_single_edits(pattern.segments, index)):
        if len(found) >= n or tried >= SUGGEST_EDITS:
            break
        text = ".".join(map(str, candidate))
        if text not in found and index.any_match(candidate):
            found.append(text)
    if not found:
        known = set(index.vocabulary)
        combined = tuple(_closest_literal(s, index, known) for s in pattern.segments)
        if combined != pattern.segments and index.any_match(combined):
            found.append(".".join(map(str, combined)))
    return found


def _single_edits(segments: tuple[Segment, ...], index: ModuleIndex) -> Iterator[tuple[Segment, ...]]:
    for i, seg in enumerate(segments):
        if isinstance(seg, Literal):
            for word in index.closest_words(seg.text):
                yield (*segments[:i], Literal(word), *segments[i + 1 :])
        elif isinstance(seg, AnySegment):
            yield (*segments[:i], AnySegments(), *segments[i + 1 :])


def _closest_literal(seg: Segment, index: ModuleIndex, known: set[str]) -> Segment:
    if not isinstance(seg, Literal) or seg.text in known:
        return seg
    hits = index.closest_words(seg.text)
    return Literal(hits[0]) if hits else seg


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
