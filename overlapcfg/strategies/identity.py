"""``none``: leaves the graph as it is (the baseline for ablations); the record still counts collectives."""

from __future__ import annotations

from overlapcfg.resolve import ResolvedPlan
from overlapcfg.config.policy import PolicyBase
from overlapcfg.strategies.base import Strategy, no_bucketing, no_scheduling

__all__ = ["make_strategy"]


def make_strategy(plan: ResolvedPlan, policy: PolicyBase) -> Strategy:
    return Strategy("none", no_bucketing, no_scheduling)
