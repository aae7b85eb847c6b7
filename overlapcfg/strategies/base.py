"""The strategy interface: a bucketer that merges collectives, and a scheduler that places them.

``apply`` calls ``strategy.bucketer(gm, ctx)`` then ``strategy.scheduler(gm, ctx, merged)``. Strategies that
delegate to one upstream pass doing both (``torch_manual``, ``auto``) have a bucketer that merges nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from torch import fx

from overlapcfg.graph.collectives import Collective, Direction, ModuleFqnFn
from overlapcfg.graph.merge import MergedCollective
from overlapcfg.graph.schedule import ScheduleResult
from overlapcfg.resolve import ResolvedPlan
from overlapcfg.config.policy import PolicyBase

__all__ = ["Bucketer", "PassContext", "Scheduler", "Strategy"]


@dataclass(frozen=True, slots=True)
class PassContext:
    """Everything a bucketer or scheduler may read about the graph it is given."""

    plan: ResolvedPlan
    policy: PolicyBase
    collectives: tuple[Collective, ...]
    covered: tuple[tuple[int, Collective], ...]
    """FSDP collectives with the index of their bucket, graph order."""
    uncovered: tuple[Collective, ...]
    direction: Direction | None
    """Forced direction (a forward or backward graph), or None for joint graphs."""
    module_fqn_fn: ModuleFqnFn
    fresh_fake_values: bool = False
    """Every new node needs its own ``meta["val"]`` (a compiler such as inductor reads storages from them)."""


Bucketer: TypeAlias = Callable[[fx.GraphModule, PassContext], Sequence[MergedCollective]]
Scheduler: TypeAlias = Callable[[fx.GraphModule, PassContext, Sequence[MergedCollective]], ScheduleResult]


def no_bucketing(gm: fx.GraphModule, ctx: PassContext) -> Sequence[MergedCollective]:
    """The bucketer of strategies that merge elsewhere (or not at all)."""
    return ()


def no_scheduling(gm: fx.GraphModule, ctx: PassContext, merged: Sequence[MergedCollective]) -> ScheduleResult:
    return ScheduleResult((), ())


@dataclass(frozen=True, slots=True)
class Strategy:
    name: str
    bucketer: Bucketer
    scheduler: Scheduler
