"""``manual``: our bucketer (upstream merge ops, traced once per signature) and our depth-aware scheduler."""

from __future__ import annotations

from torch import fx

from overlapcfg import compat
from overlapcfg.config.policy import OverlapPolicy
from overlapcfg.errors import OverlapUsageError
from overlapcfg.graph.merge import merge_buckets
from overlapcfg.graph.schedule import schedule_manual
from overlapcfg.strategies.interface import PassContext, StrategyResult

__all__ = ["run"]


def run(gm: fx.GraphModule, ctx: PassContext) -> StrategyResult:
    policy = ctx.policy
    if not isinstance(policy, OverlapPolicy):  # the contract validates it; a direct caller may not have
        raise OverlapUsageError(f"manual: expected an OverlapPolicy, got {type(policy).__name__}")
    merged = merge_buckets(gm, ctx.covered, ctx.plan, policy.bucket_mode, fresh_fake_values=ctx.fresh_fake_values,
                           unmerged=policy.unmerged)
    result = schedule_manual(gm, ctx.plan, merged, policy.max_inflight_bytes, policy.issue_order)
    if policy.insert_overlap_deps and result.overlap_deps:
        compat.preserve_node_ordering(gm.graph, {n: compat.OrderedSet(d) for n, d in result.overlap_deps})
    return StrategyResult(tuple(merged), result.decisions)
