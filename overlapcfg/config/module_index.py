"""Many patterns against one model: the model's FQNs split once and indexed, matching, and "did you mean".

A literal pattern is one dict lookup and a pattern starting with a literal segment only visits the FQNs starting
with it, so a plan of 10k literal FQNs on a 10k-module model is linear, not 10**8 walks. Suggestions for an
unmatched pattern are bounded (``SUGGEST_EDITS`` candidate fixes, ``SHAPE_POOL`` module shapes).
The grammar itself lives in ``overlapcfg.config.patterns``.
"""

from __future__ import annotations

import bisect
import difflib
from collections.abc import Iterable, Iterator, Sequence

from overlapcfg.config.patterns import (
    _INDEX,
    AnySegment,
    AnySegments,
    IndexRange,
    Literal,
    Pattern,
    Segment,
    _match,
    _min_parts,
    compile_pattern,
)
from overlapcfg.errors import natural_key
from overlapcfg.module_paths import normalize_fqns, split_fqn

__all__ = ["SHAPE_POOL", "SUGGEST_EDITS", "ModuleIndex", "suggest_fixes"]


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
        self.numbered_children(node)
        numbered = self._numbered[node]
        lo = bisect.bisect_left(numbered, (seg.start, ""))
        hi = len(numbered) if seg.stop is None else bisect.bisect_left(numbered, (seg.stop, ""))
        return [c for _, c in numbered[lo:hi]]

    def numbered_children(self, node: str) -> list[int]:
        """The indices of ``node``'s numbered children (a ``ModuleList``'s ``0..n-1``), ascending."""
        if node not in self._numbered:
            self._numbered[node] = sorted((int(k), c) for k, c in self._kids.get(node, {}).items()
                                          if _INDEX.fullmatch(k))
        return [i for i, _ in self._numbered[node]]

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


