"""``auto``: upstream's automatic ``schedule_overlap_bucketing``, its knobs validated by ``AutoPolicy``."""

from __future__ import annotations

from torch import fx

from overlapcfg import compat
from overlapcfg.config.policy import AutoPolicy
from overlapcfg.strategies.base import PassContext, StrategyResult

__all__ = ["run"]


def run(gm: fx.GraphModule, ctx: PassContext) -> StrategyResult:
    if not isinstance(ctx.policy, AutoPolicy):
        raise TypeError(f"auto: expected an AutoPolicy, got {type(ctx.policy).__name__}")
    with compat.no_triton_runtime_estimates():
        compat.schedule_overlap_bucketing(gm, **ctx.policy.model_dump())
    return StrategyResult()
