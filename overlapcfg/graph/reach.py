"""How far ahead all-gathers are issued: one rule for the compiled scheduler and the eager FSDP2 driver.

Buckets at positions ``0..n-1`` of one direction's compute order, bucket ``i`` asking for depth ``k_i``: by the
time bucket ``i`` computes, every bucket up to ``reach_i`` has been issued, where ``reach_i = i + k_i`` clipped at
the last bucket, never below an earlier bucket's reach (issue is monotone: an all-gather cannot be un-issued), and
lowered while the unsharded bytes of buckets ``i..reach_i`` exceed ``max_inflight_bytes`` (never below ``i``: a
bucket alone above the cap still runs, at depth 0). Pure: sizes and depths in, reach and decisions out.
"""

from __future__ import annotations

from collections.abc import Sequence

from overlapcfg.graph.record import DepthDecision
from overlapcfg.kinds import Direction

__all__ = ["prefetch_reach", "reach"]


def reach(depths: Sequence[int], sizes: Sequence[int], cap: int | None) -> list[int]:
    """``reach[i]`` for one direction (the rule above); no records, for the tuner's replay of many schedules."""
    last = len(depths) - 1
    out: list[int] = []
    prev = -1
    for i, requested in enumerate(depths):
        floor = max(prev, i)
        r = max(floor, min(i + requested, last))
        if cap is not None:
            while r > floor and sum(sizes[i:r + 1]) > cap:
                r -= 1
        out.append(r)
        prev = r
    return out


def prefetch_reach(names: Sequence[str], depths: Sequence[int], sizes: Sequence[int], cap: int | None,
                   direction: Direction, *, end: str = "end of graph") -> tuple[tuple[int, ...],
                                                                               tuple[DepthDecision, ...]]:
    """``(reach, decisions)`` for one direction; ``end`` names why the last buckets' depth is clipped."""
    if not len(names) == len(depths) == len(sizes):
        raise AssertionError(f"prefetch_reach: {len(names)} names, {len(depths)} depths, {len(sizes)} sizes")
    reached = reach(depths, sizes, cap)
    last = len(names) - 1
    decisions: list[DepthDecision] = []
    prev = -1
    for i, (requested, r) in enumerate(zip(depths, reached, strict=True)):
        unbound = max(prev, i, min(i + requested, last))  # the reach before the cap lowers it
        reason = end if i + requested > last and unbound < i + requested else None
        if cap is not None:
            if r < unbound:
                reason = f"max_inflight_bytes={cap} binds"
            if r == i and sizes[i] > cap:
                reason = f"max_inflight_bytes={cap} is smaller than this bucket ({sizes[i]} bytes)"
        if r > i + requested:  # an earlier, deeper bucket already issued it
            reason = f"an earlier bucket's depth already issued up to {names[r]}"
        decisions.append(DepthDecision(bucket=names[i], direction=direction, kind="all_gather", position=i,
                                       requested=requested, effective=r - i, inflight_bytes=sum(sizes[i:r + 1]),
                                       reason=reason))
        prev = r
    return tuple(reached), tuple(decisions)
