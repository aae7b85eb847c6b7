"""Fits of timings to the cost model's own formulas, by least squares on relative error (numpy).

A collective over ``p`` ranks of ``n`` full-size bytes is modelled as ``steps(p) * latency + volume(p, n) /
bandwidth`` (``overlapcfg.cost.price.collective_cost``: ``steps = p - 1`` and ``volume = (p - 1) / p * n``
for an all-gather or reduce-scatter, twice both for an all-reduce). That is linear in ``(latency,
1 / bandwidth)``, so timings of one kind on one kind of link, over any sizes and any groups, fit by one linear
least squares: each row ``(steps, volume) -> seconds``. Rows are weighted by ``1 / seconds`` so that a 4 KiB and a
64 MiB timing count alike (absolute errors would let the largest sizes decide everything and leave the latency
to noise), and the residual is reported the same way: the root-mean-square relative error at the samples.
Coefficients are kept non-negative (a negative latency is noise around zero): a coefficient that comes out
negative is pinned at zero and the rest refitted, the active-set step of non-negative least squares, which for
two unknowns is exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from overlapcfg.errors import OverlapConfigError

__all__ = ["LinearFit", "fit_line", "fit_nonnegative", "ring_terms"]


@dataclass(frozen=True, slots=True)
class LinearFit:
    """``seconds ~= design @ coefficients``, and how well."""

    coefficients: tuple[float, ...]
    residual: float
    """Root-mean-square relative error at the samples (0.05: within about 5 %)."""
    samples: int

    def predict(self, row: Sequence[float]) -> float:
        return float(np.dot(row, self.coefficients))


def fit_nonnegative(design: Sequence[Sequence[float]], seconds: Sequence[float]) -> LinearFit:
    """Non-negative least squares of ``seconds`` on the columns of ``design``, on relative error."""
    a = np.asarray(design, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != t.shape[0] or a.shape[0] < a.shape[1]:
        raise OverlapConfigError(
            f"fit: {t.shape[0]} timings for {a.shape[1] if a.ndim == 2 else '?'} unknowns; need at "
            "least as many timings as unknowns (raise the time budget)")
    if np.any(t <= 0) or not np.all(np.isfinite(t)):
        raise OverlapConfigError("fit: timings must be positive and finite")
    weighted, ones = a / t[:, None], np.ones_like(t)
    free = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while free:
        solution, *_ = np.linalg.lstsq(weighted[:, free], ones, rcond=None)
        if np.all(solution >= 0):
            coef[free] = solution
            break
        free.pop(int(np.argmin(solution)))  # pin the most negative at zero and refit the others
    relative = (a @ coef - t) / t
    return LinearFit(tuple(float(c) for c in coef), float(np.sqrt(np.mean(relative**2))), int(t.shape[0]))


def fit_line(work: Sequence[float], seconds: Sequence[float]) -> LinearFit:
    """``seconds ~= overhead + work * per_unit``: coefficients ``(overhead, per_unit)``, both >= 0."""
    return fit_nonnegative([(1.0, float(w)) for w in work], seconds)


def ring_terms(kind: str, group_size: int, nbytes: float) -> tuple[float, float]:
    """``(steps, volume)``: the regressors of latency and of 1 / bandwidth for one collective (see the module)."""
    p = group_size
    steps, volume = float(p - 1), (p - 1) / p * float(nbytes)
    return (2 * steps, 2 * volume) if kind == "all_reduce" else (steps, volume)
