"""Matching a plan's patterns against one model, collecting faults (with bounded "did you mean" work).

Every lookup goes through one ``ModuleIndex`` (FQNs split and indexed once), so resolving a plan costs about
the number of FQNs each pattern can reach, not patterns x modules. Suggestions for an unmatched pattern are
the expensive part (string similarity against the model), so they are computed for the first
``SUGGESTED_PATTERNS`` unmatched patterns only; the rest are still reported, one fault each, without hints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from overlapcfg.config.module_index import ModuleIndex, suggest_fixes
from overlapcfg.config.patterns import AnySegments, IndexRange, Pattern, compile_pattern
from overlapcfg.errors import Fault, OverlapConfigError
from overlapcfg.module_paths import ancestors, split_fqn

__all__ = ["SUGGESTED_PATTERNS", "Matcher", "outermost", "range_past_the_model", "show"]

SUGGESTED_PATTERNS = 20
"""Unmatched patterns that get "did you mean" hints; a plan with more is wrong wholesale, not by a typo."""


@dataclass(slots=True)
class Matcher:
    """The model's indexed FQNs plus the fault list every lookup appends to (so all faults surface at once)."""

    index: ModuleIndex
    faults: list[Fault]
    unmatched: int = 0
    _cache: dict[str, list[str]] = field(default_factory=dict)

    @property
    def fqns(self) -> tuple[str, ...]:
        return self.index.fqns

    def match(self, text: str, path: str, entry: str) -> list[str]:
        """Matches of one pattern, in model order; a bad or unmatched pattern records a fault."""
        try:
            pattern = compile_pattern(text, path=path)
        except OverlapConfigError as err:
            self.faults += err.faults
            return []
        if text not in self._cache:
            self._cache[text] = self.index.match(pattern)
        hits = self._cache[text]
        where = "" if entry == text else f" (in entry {entry})"
        if not hits:
            self.unmatched += 1
            self.faults.append(Fault(path, f"pattern {text!r}{where} matches no module{self._suggest(pattern)}"))
        elif (past := range_past_the_model(pattern, hits, self.index)) is not None:
            self.faults.append(Fault(path, f"pattern {text!r}{where} {past}"))
        return list(hits)

    def match_all(self, patterns: Sequence[str], path: str, entry: str) -> list[str]:
        """The union of the patterns' matches in model order, nested ones collapsed."""
        hits: dict[str, None] = {}
        for j, pattern in enumerate(patterns):
            hits.update(dict.fromkeys(self.match(pattern, f"{path}[{j}]", entry)))
        position = self.index.position
        return outermost(sorted(hits, key=position.__getitem__))

    def _suggest(self, pattern: Pattern) -> str:
        if self.unmatched > SUGGESTED_PATTERNS:
            return f" (no suggestions past the first {SUGGESTED_PATTERNS} unmatched patterns)"
        fixes = suggest_fixes(pattern, self.index)
        near = self.index.closest_modules(pattern)
        hint = f"; did you mean {show(fixes)}?" if fixes else ""
        if near:
            return hint + f" (closest modules: {show(near)})"
        top = list(self.index.top_level[:6])
        return hint + (f" (top-level modules: {show(top)})" if top else " (the model has no named modules)")


def range_past_the_model(pattern: Pattern, hits: Sequence[str], index: ModuleIndex) -> str | None:
    """Why an index range reaching past the last numbered module is a fault, or None.

    ``layers.0:8`` on a 4-layer model matches ``layers.0``-``layers.3``; indices 4-7 match nothing. An unmatched
    pattern is an error, and so is this unmatched part of one: a range past the end means the config was
    written for another model (a deeper one, or a different count), and what it meant ("the first half") is
    not what it now selects (everything). A range that ends exactly at the end, or a gap inside the numbering,
    is fine. Only ranges whose position is fixed (no ``**`` before them) are checked.
    """
    for k, seg in enumerate(pattern.segments):
        if isinstance(seg, AnySegments):
            return None
        if not isinstance(seg, IndexRange) or seg.stop is None:
            continue
        parents = list(dict.fromkeys(".".join(split_fqn(h)[:k]) for h in hits if len(split_fqn(h)) > k))
        indices = [i for p in parents for i in index.numbered_children(p)]
        if not indices or seg.stop <= max(indices) + 1:
            continue
        last = max(indices)
        parts = pattern.text.split(".")
        fits = f"{seg.start}:{last + 1}" if seg.start < last else str(last)
        fixed = [".".join([*parts[:k], fits, *parts[k + 1:]])]
        if seg.start == 0:
            fixed.append(".".join([*parts[:k], "*", *parts[k + 1:]]))
        owner = parents[0] if len(parents) == 1 else f"{len(parents)} modules matched before it"
        selected = f"{seg.start}-{last}" if seg.start < last else str(last)
        missing = f"{last + 1}-{seg.stop - 1}" if seg.stop - 1 > last + 1 else str(last + 1)
        return (f"reaches past the model: {show([owner])} has indices up to {last}, so {seg} selects {selected} "
                f"and {missing} match nothing (written for another model?); write {' or '.join(map(repr, fixed))}")
    return None


def outermost(matches: list[str]) -> list[str]:
    """Drop matches nested inside another match (the outer module's bucket already holds them)."""
    present = set(matches)  # membership only; order comes from ``matches``
    return [m for m in matches if not any(a in present for a in ancestors(m))]


def show(items: Sequence[str], limit: int = 6) -> str:
    """Quoted FQNs for messages (at most ``limit``, then a count); the root module reads ``<root>``."""
    shown = ", ".join(repr(x) if x else "<root>" for x in items[:limit])
    return shown + (f" ... ({len(items)} in all)" if len(items) > limit else "")
