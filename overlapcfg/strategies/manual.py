"""``manual``: our bucketer (upstream merge ops, traced once per signature) and our depth-aware scheduler."""

from __future__ import annotations

from collections.abc import Sequence

from torch import fx

from overlapcfg import compat
from overlapcfg.graph.merge import MergedCollective, merge_buckets
from overlapcfg.graph.schedule import ScheduleResult, schedule_manual
from overlapcfg.resolve import ResolvedPlan
from overlapcfg.config.policy import OverlapPolicy
from overlapcfg.strategies.base import PassContext, Strategy

__all__ = ["make_strategy"]


def make_strategy(plan: ResolvedPlan, policy: OverlapPolicy) -> Strategy:
    def bucketer(gm: fx.GraphModule, ctx: PassContext) -> Sequence[MergedCollective]:
        return merge_buckets(gm, ctx.covered, ctx.plan, policy.bucket_mode, fresh_fake_values=ctx.fresh_fake_values)

    def scheduler(gm: fx.GraphModule, ctx: PassContext, merged: Sequence[MergedCollective]) -> ScheduleResult:
        result = schedule_manual(gm, ctx.plan, merged, policy.max_inflight_bytes)
        if policy.insert_overlap_deps and result.overlap_deps:
            compat.preserve_node_ordering(gm.graph, {n: compat.OrderedSet(d) for n, d in result.overlap_deps})
        return result

    return Strategy("manual", bucketer, scheduler)
