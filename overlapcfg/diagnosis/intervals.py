"""Interval arithmetic on sorted, merged intervals: unions, how much of a span they cover, what they leave.

One rule for every number a diagnosis gives: compute, communication, exposed communication and idle time are all
lengths of unions and differences of intervals, computed here. ``Cover`` answers "how much of ``[a, b]`` is covered"
in ``O(log n)`` with a prefix sum, so covering thousands of collectives against hundreds of thousands of kernels
stays cheap.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from itertools import accumulate

__all__ = ["Cover", "union"]


def union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The disjoint, sorted union of ``spans`` (empty spans dropped; touching spans joined)."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


class Cover:
    """A union of intervals, queried for how much of a span it covers."""

    __slots__ = ("_cum", "ends", "starts")

    def __init__(self, spans: Iterable[tuple[float, float]]) -> None:
        merged = union(spans)
        self.starts = [a for a, _ in merged]
        self.ends = [b for _, b in merged]
        self._cum = [0.0, *accumulate(b - a for a, b in merged)]

    @property
    def total(self) -> float:
        return self._cum[-1]

    def spans(self) -> list[tuple[float, float]]:
        return list(zip(self.starts, self.ends, strict=True))

    def within(self, a: float, b: float) -> list[tuple[float, float]]:
        """The union's intervals clipped to ``[a, b]``."""
        i, j = bisect_right(self.ends, a), bisect_left(self.starts, b)
        return [(max(s, a), min(e, b)) for s, e in zip(self.starts[i:j], self.ends[i:j], strict=True)]

    def _upto(self, t: float) -> float:
        """Covered length in ``(-inf, t]``."""
        i = bisect_right(self.starts, t)
        if i == 0:
            return 0.0
        return self._cum[i - 1] + min(t, self.ends[i - 1]) - self.starts[i - 1]

    def covered(self, a: float, b: float) -> float:
        """Length of ``[a, b]`` inside the union."""
        return max(0.0, self._upto(b) - self._upto(a)) if b > a else 0.0

    def gaps(self, a: float, b: float) -> list[tuple[float, float]]:
        """The parts of ``[a, b]`` outside the union, in order."""
        out = []
        t = a
        i = max(0, bisect_left(self.ends, a))
        while t < b and i < len(self.starts):
            s, e = self.starts[i], self.ends[i]
            if s >= b:
                break
            if s > t:
                out.append((t, s))
            t = max(t, e)
            i += 1
        if t < b:
            out.append((t, b))
        return out
