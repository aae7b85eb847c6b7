"""``auto``: upstream's automatic ``schedule_overlap_bucketing``, its knobs validated by ``AutoPolicy``."""

from __future__ import annotations

from collections.abc import Sequence

from torch import fx

from overlapcfg import compat
from overlapcfg.graph.merge import MergedCollective
from overlapcfg.graph.schedule import ScheduleResult
from overlapcfg.resolve import ResolvedPlan
from overlapcfg.config.policy import AutoPolicy
from overlapcfg.strategies.base import PassContext, Strategy, no_bucketing

__all__ = ["make_strategy"]


def make_strategy(plan: ResolvedPlan, policy: AutoPolicy) -> Strategy:
    def scheduler(gm: fx.GraphModule, ctx: PassContext, merged: Sequence[MergedCollective]) -> ScheduleResult:
        with compat.no_triton_runtime_estimates():
            compat.schedule_overlap_bucketing(gm, **policy.model_dump())
        return ScheduleResult((), ())

    return Strategy("auto", no_bucketing, scheduler)
