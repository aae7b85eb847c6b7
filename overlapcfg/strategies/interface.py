"""The strategy interface: one object holding the config contract and the graph call.

``apply`` builds a ``PassContext`` (the resolved plan, the collectives found and attributed) and calls
``strategy.run(gm, ctx)``; the strategy rewrites ``gm`` in place and returns what it merged and decided, which
``apply`` turns into the pass record. Strategies that delegate to one upstream pass (``torch_manual``, ``auto``)
return no merges or decisions: the record then counts the collectives the upstream pass left.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeAlias, cast

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.config.boundary import RelativeConfigError
from overlapcfg.config.contracts import StrategyContract
from overlapcfg.config.policy import PolicyBase
from overlapcfg.errors import OverlapcfgError, UpstreamPassError, shorten
from overlapcfg.graph.attribution import ModuleFqnFn
from overlapcfg.graph.collectives import Collective
from overlapcfg.graph.merge import MergedCollective
from overlapcfg.graph.record import DepthDecision
from overlapcfg.kinds import Direction
from overlapcfg.resolve import ResolvedPlan

__all__ = ["PassContext", "Strategy", "StrategyFn", "StrategyResult", "this_torch_supports", "torch_pass_failures"]


@dataclass(frozen=True, slots=True)
class PassContext:
    """Everything a strategy may read about the graph it is given."""

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


@dataclass(frozen=True, slots=True)
class StrategyResult:
    """What a strategy did: the merged collectives (graph order) and the scheduler's depth decisions."""

    merged: tuple[MergedCollective, ...] = ()
    decisions: tuple[DepthDecision, ...] = ()
    notes: tuple[str, ...] = field(default=())


StrategyFn: TypeAlias = Callable[[fx.GraphModule, PassContext], StrategyResult]
"""``run(gm, ctx) -> StrategyResult``: rewrite ``gm`` in place (``apply`` lints, verifies and recompiles)."""


@dataclass(frozen=True, slots=True)
class Strategy:
    """A registered strategy, typed: its declaration (``contract``, from the one catalog in
    ``overlapcfg.config.contracts``) and what it does to a graph (``run``, the call attached to it)."""

    contract: StrategyContract

    @property
    def run(self) -> StrategyFn:
        return cast(StrategyFn, self.contract.graph_call())

    @property
    def name(self) -> str:
        return self.contract.name

    @property
    def policy(self) -> type[PolicyBase]:
        return self.contract.policy

    @property
    def uses_plan(self) -> bool:
        return self.contract.uses_plan

    @property
    def reads_policy(self) -> bool:
        return self.contract.reads_policy


@contextlib.contextmanager
def torch_pass_failures(strategy: str) -> Iterator[None]:
    """Within the block, an exception from torch's own pass (anything but overlapcfg's own errors) becomes an
    ``UpstreamPassError`` naming the strategy and the torch release, torch's error as its cause. ``apply`` puts the
    graph back either way; the class lets a caller trying torch's pass as one option among others (the tuner) leave
    it out, and tells a user the config was not at fault. Seen: torch 2.12's ``auto`` views a transposed gradient
    it reduce-scatters ("Cannot view a tensor with shape ... and strides ..."), torch 2.14's ``torch_manual`` with
    ``bucket_mode: coalesced`` on a tensor-parallel backward uses a node before defining it."""
    try:
        yield
    except OverlapcfgError:
        raise
    except Exception as err:
        raise UpstreamPassError(
            f"strategy {strategy!r}: torch {torch.__version__}'s own pass failed on this graph ({type(err).__name__}: "
            f"{shorten(str(err), 300)}); the graph is left as it was. The config is not at fault: use strategy "
            "'manual' (overlapcfg's own merge and schedule) or another torch release") from err


@contextlib.contextmanager
def this_torch_supports() -> Iterator[None]:
    """Within the block, an upstream pass's refusal of a setting the installed torch cannot honour
    (``compat.UnsupportedByThisTorch``) becomes a config error at that setting's path, ``policy.<setting>`` (a
    ``RelativeConfigError``: ``apply`` names it where the user put the config)."""
    try:
        yield
    except compat.UnsupportedByThisTorch as err:
        raise RelativeConfigError.single(f"policy.{err.setting}", str(err)) from None
