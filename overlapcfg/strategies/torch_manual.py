"""``torch_manual``: upstream ``manual_overlap_bucketing`` on the resolved plan, the reference we compare with.

Upstream finds a bucket's nodes through a module stack; we hand it ours (``module_fqn_fn``), so it sees the same
attribution as ``manual``. On a CPU-only torch its scheduler set-up needs triton; the workaround is scoped to
the call (``compat.no_triton_runtime_estimates``).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import fx, nn

from overlapcfg import compat
from overlapcfg.graph.merge import MergedCollective
from overlapcfg.graph.schedule import ScheduleResult
from overlapcfg.resolve import ResolvedPlan
from overlapcfg.config.policy import TorchManualPolicy
from overlapcfg.strategies.base import PassContext, Strategy, no_bucketing

__all__ = ["make_strategy"]


def make_strategy(plan: ResolvedPlan, policy: TorchManualPolicy) -> Strategy:
    def scheduler(gm: fx.GraphModule, ctx: PassContext, merged: Sequence[MergedCollective]) -> ScheduleResult:
        def module_stack(node: fx.Node) -> list[tuple[str, type]]:
            fqn = ctx.module_fqn_fn(node)
            return [(fqn, nn.Module)] if fqn else []

        with compat.no_triton_runtime_estimates():
            compat.manual_overlap_bucketing(
                gm,
                plan.module_lists(),
                insert_overlap_deps=policy.insert_overlap_deps,
                module_stack_fn=module_stack,
                bucket_mode=policy.bucket_mode,
            )
        return ScheduleResult((), ())

    return Strategy("torch_manual", no_bucketing, scheduler)
