"""Candidates: one grouping plus the schedule knobs, scored by the quick model, and turned into a config.

A candidate's per-bucket values (from the refinement) are written as ``overrides`` matching one module of the
bucket, so the tuned config stays a compact plan plus a short list of exceptions. Torch-free apart from scoring.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from overlapcfg.config import OverlapConfig, load_config
from overlapcfg.config.depths import DEPTH_FIELDS, DEPTH_LABELS, SEARCHED_DEPTHS, Depths
from overlapcfg.config.policy import IssueOrder
from overlapcfg.resolve import ResolvedPlan
from overlapcfg.tuning.merged import Grouped
from overlapcfg.tuning.quick import Score, Stall, score
from overlapcfg.tuning.structure import Grouping

__all__ = ["Arm", "Candidate", "Knobs", "TIE_TOLERANCE", "choose"]

TIE_TOLERANCE = 1e-3
"""Candidates whose predicted step is within this fraction (0.1 %) of the fastest are a tie, and the tie goes to
the one needing the fewest bytes in flight. The cost model leaves out launch overheads, SM/HBM contention and
NCCL's tuning, each worth more than 0.1 % of a step, so a smaller predicted difference is noise, not a reason to
hold more memory (the demo trial: +0.007 % speed for +76 % bytes in flight)."""


@dataclass(frozen=True, slots=True)
class Knobs:
    """The schedule half of a candidate: global values and per-bucket exceptions."""

    depths: Depths
    """The global depths (``overlapcfg.config.depths.Depths``): the policy's."""
    issue_order: IssueOrder
    max_inflight_bytes: int | None
    per_bucket: tuple[tuple[int, str, int], ...] = ()
    """``(bucket index, depth field, value)``, sorted: where a bucket departs from the global value."""

    def values(self, name: str, buckets: int) -> list[int]:
        """Depth ``name`` of each of ``buckets`` buckets."""
        out = [getattr(self.depths, name)] * buckets
        for bucket, field_name, value in self.per_bucket:
            if field_name == name:
                out[bucket] = value
        return out

    def per_bucket_depths(self, buckets: int) -> dict[str, list[int]]:
        """Every searched depth of each of ``buckets`` buckets, by field: what ``quick.score`` replays."""
        return {name: self.values(name, buckets) for name in SEARCHED_DEPTHS}

    def with_bucket(self, bucket: int, name: str, value: int) -> Knobs:
        """These knobs with one per-bucket value set (dropped again when it equals the global one)."""
        rest = [(b, f, v) for b, f, v in self.per_bucket if (b, f) != (bucket, name)]
        if value != getattr(self.depths, name):
            rest.append((bucket, name, value))
        return replace(self, per_bucket=tuple(sorted(rest)))


@dataclass(slots=True)
class Arm:
    """One grouping, resolved and merged once, with everything its candidates share."""

    grouping: Grouping
    plan: dict[str, Any]
    resolved: ResolvedPlan
    grouped: Grouped
    names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.names = tuple(b.name for b in self.resolved.buckets)

    def score(self, knobs: Knobs, *, memory: bool = False, stalls: list[Stall] | None = None) -> Score:
        return score(self.grouped, knobs.per_bucket_depths(len(self.names)),
                     max_inflight_bytes=knobs.max_inflight_bytes, issue_order=knobs.issue_order, memory=memory,
                     stalls=stalls)

    def config(self, knobs: Knobs) -> OverlapConfig:
        """The candidate as an ``OverlapConfig``: the plan, the global policy, one override per bucket that
        departs from it (matching the bucket's first module)."""
        overrides: dict[int, dict[str, Any]] = {}
        for bucket, name, value in knobs.per_bucket:
            overrides.setdefault(bucket, {"match": self.resolved.buckets[bucket].modules[0]})[name] = value
        return load_config({
            "strategy": "manual", "plan": self.plan,
            "policy": {**knobs.depths.model_dump(include=set(DEPTH_FIELDS), exclude_none=True),
                       "issue_order": knobs.issue_order, "max_inflight_bytes": knobs.max_inflight_bytes,
                       "unmerged": list(self.grouping.unmerged)},
            "overrides": [overrides[b] for b in sorted(overrides)]})


@dataclass(frozen=True, slots=True)
class Candidate:
    """A scored point of the search."""

    name: str
    """``2 blocks/bucket fp2 bp3 rs2`` or a preset's name."""
    arm: int
    """Index of its grouping among the search's arms (-1: a preset scored through its own resolution; -2: a
    competitor applied and simulated for real, ``overlapcfg.tuning.competitors``)."""
    knobs: Knobs
    score: Score
    config: OverlapConfig | None = None
    """Filled for what the result shows (building configs for every grid point would cost more than scoring)."""

    @property
    def step_seconds(self) -> float:
        return self.score.step_seconds

    @property
    def peak_inflight_bytes(self) -> int:
        return self.score.peak_inflight_bytes


def describe(grouping: Grouping, knobs: Knobs, cap_text: str | None) -> str:
    """``attn|ffn split fp4 bp3 rs3 rs-first cap=2.0GiB +2 per-bucket``."""
    depths = (f"{DEPTH_LABELS[name]}{getattr(knobs.depths, name)}" for name in SEARCHED_DEPTHS)
    text = " ".join((grouping.label, *depths))
    if knobs.issue_order != "gather_first":
        text += " rs-first"
    if cap_text:
        text += f" cap={cap_text}"
    if knobs.per_bucket:
        text += f" +{len(knobs.per_bucket)} per-bucket"
    return text


def choose(candidates: Sequence[Candidate], tolerance: float = TIE_TOLERANCE, *,
           ceiling: float | None = None) -> Candidate:
    """The winner: among the candidates within ``tolerance`` of the fastest step (and no slower than ``ceiling``:
    the fastest config the user could pick instead), the fewest peak bytes in flight, then the fastest, then the
    fewest per-bucket exceptions; a full tie keeps the first (the search's fixed order)."""
    fastest = min(c.step_seconds for c in candidates)
    limit = fastest * (1 + tolerance) if ceiling is None else max(fastest, min(fastest * (1 + tolerance), ceiling))
    ties = [c for c in candidates if c.step_seconds <= limit]
    return min(ties, key=lambda c: (c.peak_inflight_bytes, c.step_seconds, len(c.knobs.per_bucket)))


def pareto(candidates: Sequence[Candidate]) -> tuple[Candidate, ...]:
    """The candidates no other beats on both step time and peak in-flight bytes, lightest first."""
    front: list[Candidate] = []
    for c in sorted(candidates, key=lambda c: (c.peak_inflight_bytes, c.step_seconds)):
        if not front or c.step_seconds < front[-1].step_seconds:
            front.append(c)
    return tuple(front)
