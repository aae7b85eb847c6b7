"""Interval arithmetic on sorted, merged intervals: unions, how much of a span they cover, what they leave.

One rule for every number a diagnosis gives: compute, communication, exposed communication and idle time are all
lengths of unions and differences of intervals, computed here. ``Cover`` answers "how much of ``[a, b]`` is covered"
in ``O(log n)`` with a prefix sum, so covering thousands of collectives against hundreds of thousands of kernels
stays cheap.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

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
    """A union of intervals (numpy arrays: millions of kernels stay a few arrays), queried for how much of a span it
    covers."""

    __slots__ = ("_cum", "ends", "starts")

    def __init__(self, spans: Iterable[tuple[float, float]] | np.ndarray) -> None:
        pairs = np.asarray(spans if isinstance(spans, np.ndarray) else list(spans), dtype=np.float64).reshape(-1, 2)
        pairs = pairs[pairs[:, 1] > pairs[:, 0]]
        if len(pairs):
            pairs = pairs[np.argsort(pairs[:, 0], kind="stable")]
            reach = np.maximum.accumulate(pairs[:, 1])
            breaks = np.flatnonzero(pairs[1:, 0] > reach[:-1])
            self.starts = pairs[np.r_[0, breaks + 1], 0]
            self.ends = reach[np.r_[breaks, len(pairs) - 1]]
        else:
            self.starts = self.ends = np.zeros(0)
        self._cum = np.r_[0.0, np.cumsum(self.ends - self.starts)]

    @property
    def total(self) -> float:
        return float(self._cum[-1])

    def spans(self) -> list[tuple[float, float]]:
        return list(zip(self.starts.tolist(), self.ends.tolist(), strict=True))

    def within(self, a: float, b: float) -> list[tuple[float, float]]:
        """The union's intervals clipped to ``[a, b]``."""
        i, j = int(np.searchsorted(self.ends, a, "right")), int(np.searchsorted(self.starts, b, "left"))
        return [(max(s, a), min(e, b)) for s, e in zip(self.starts[i:j].tolist(), self.ends[i:j].tolist(),
                                                       strict=True)]

    def _upto(self, t: float) -> float:
        """Covered length in ``(-inf, t]``."""
        i = int(np.searchsorted(self.starts, t, "right"))
        if i == 0:
            return 0.0
        return float(self._cum[i - 1] + min(t, self.ends[i - 1]) - self.starts[i - 1])

    def covered(self, a: float, b: float) -> float:
        """Length of ``[a, b]`` inside the union."""
        return max(0.0, self._upto(b) - self._upto(a)) if b > a else 0.0

    def gaps(self, a: float, b: float) -> list[tuple[float, float]]:
        """The parts of ``[a, b]`` outside the union, in order."""
        out = []
        t = a
        i = int(np.searchsorted(self.ends, a, "left"))
        while t < b and i < len(self.starts):
            s, e = float(self.starts[i]), float(self.ends[i])
            if s >= b:
                break
            if s > t:
                out.append((t, s))
            t = max(t, e)
            i += 1
        if t < b:
            out.append((t, b))
        return out
