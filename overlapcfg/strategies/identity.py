"""``none``: leaves the graph as it is (the baseline for ablations); the record still counts collectives."""

from __future__ import annotations

from torch import fx

from overlapcfg.strategies.interface import PassContext, StrategyResult

__all__ = ["run"]


def run(gm: fx.GraphModule, ctx: PassContext) -> StrategyResult:
    return StrategyResult()
