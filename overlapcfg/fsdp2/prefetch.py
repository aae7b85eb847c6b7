"""Explicit prefetch lists for FSDP2, from per-bucket depths, bucket sizes and the in-flight byte cap.

Pure and torch-free: positions, depths and byte counts in, prefetch lists and ``DepthDecision`` records out, so
the rule is testable without a process group and is the same rule the compiled path's scheduler applies
(``overlapcfg.graph.reach``): the bucket at position ``i`` (in one direction's order) reaches position
``r_i = i + depth_i``, clipped at the last bucket, never below what an earlier bucket already issued (``r`` is
monotone: FSDP2 cannot un-issue an all-gather), and lowered while the unsharded bytes of positions ``i..r_i``
exceed ``max_inflight_bytes``. Forward, depth 2, five buckets::

    position:        0       1       2       3      4
    prefetch list:  [1, 2]  [2, 3]  [3, 4]  [4]    []        (r = 2, 3, 4, 4, 4)

FSDP2 runs a bucket's list in its pre-forward (pre-backward), right after waiting for its own all-gather, so
while bucket ``i`` computes the all-gathers of ``i+1..r_i`` are in flight: the compiled path's meaning of depth.
A list is the window ``i+1..min(r_i, i+depth_i)``, as one would write it by hand; its entries that an earlier
bucket already issued are no-ops in FSDP2 (``unshard`` returns early while an all-gather is pending or done).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from overlapcfg.graph.reach import prefetch_reach
from overlapcfg.graph.record import DepthDecision
from overlapcfg.kinds import Direction

__all__ = ["DirectionPlan", "plan_direction"]


@dataclass(frozen=True, slots=True)
class DirectionPlan:
    """One direction's prefetch: per position, the positions it issues; and what was decided, per position."""

    lists: tuple[tuple[int, ...], ...]
    """``lists[i]``: the positions position ``i`` prefetches after its own wait (maybe none)."""
    reach: tuple[int, ...]
    """``reach[i]``: the last position whose all-gather has been issued once position ``i`` computes."""
    decisions: tuple[DepthDecision, ...]


def plan_direction(names: Sequence[str], depths: Sequence[int], sizes: Sequence[int], cap: int | None,
                   direction: Direction) -> DirectionPlan:
    """Prefetch lists for buckets at positions ``0..n-1`` of ``direction``'s order (backward: reverse forward).

    ``sizes[i]``: unsharded bytes position ``i``'s all-gather brings in (0 where it has none, e.g. no backward
    all-gather after ``reshard_after_forward=False``). ``cap``: ``max_inflight_bytes`` or None.
    """
    reach, decisions = prefetch_reach(names, depths, sizes, cap, direction, end="end of the model")
    lists = [tuple(range(i + 1, min(r, i + requested) + 1)) for i, (r, requested) in enumerate(zip(reach, depths,
                                                                                                   strict=True))]
    return DirectionPlan(tuple(lists), tuple(reach), tuple(decisions))
