"""Every strategy, declared once: what a config may say for it (the contract) and what it does to a graph.

One ``StrategyContract`` per name, in one catalog, here in the torch-free config layer: validating a config must
not import torch (a typo on the command line is reported in a fraction of a second). The graph call
(``run(gm, ctx) -> StrategyResult``) needs torch, so a built-in names the module of overlapcfg's strategies layer
whose ``run`` it is (``defined_in``), imported the first time the call is asked for (``graph_call()``): every
built-in is complete from the moment this module is imported, whatever else is, and declaring one imports
nothing. Third-party strategies give the call itself (``overlapcfg.strategies.register_strategy``, or a bare
function as an entry point). ``overlapcfg.strategies.Strategy`` is the typed view of one declaration; nothing else
holds strategies.

A strategy's rules on settings are its policy model's, and only its policy model's: a value a plan entry or an
override writes stands in for the policy's value for those buckets, so ``OverlapConfig`` validates it against the
policy field of the same name (``TorchManualPolicy`` fixes the depths at 1, and that one rule covers the policy,
every plan entry and every override).

Names come from three places, in this order: the built-ins below, Python registration, and installed entry points
in the ``overlapcfg.strategies`` group (imported lazily, once, the first time an unknown name is looked up).
A config can never name an import path: YAML selects a key of this catalog and nothing else.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TypeAlias, cast

from overlapcfg.config.policy import AutoPolicy, OverlapPolicy, PolicyBase, TorchManualPolicy
from overlapcfg.errors import OverlapConfigError, OverlapUsageError, closest_first, did_you_mean, show_value

__all__ = ["ENTRY_POINT_GROUP", "GraphCall", "StrategyContract", "contract_of", "declare", "strategy_names"]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "overlapcfg.strategies"

GraphCall: TypeAlias = Callable[..., object]
"""``run(gm, ctx) -> StrategyResult``; typed as ``overlapcfg.strategies.StrategyFn`` there (this layer cannot name
torch's types)."""


@dataclass(frozen=True, slots=True)
class StrategyContract:
    """One strategy: what configs may say for it and, once the strategies layer attached it, its graph call."""

    name: str
    policy: type[PolicyBase]
    """The model ``policy`` is validated against (a knob the strategy would ignore is then an unknown field); plan
    entries' and overrides' depths are validated against its fields of the same name."""
    uses_plan: bool = True
    """Buckets by ``plan``: a plan is required, and ``overrides`` apply."""
    reads_policy: bool = True
    """False for strategies that read no policy (``none``): a non-default policy is reported as ignored."""
    origin: str = "builtin"
    """Who declared it: ``builtin``, a module name, or ``entry point <dist>``."""
    run: GraphCall | None = None
    """The graph call, given with the declaration (third-party strategies)."""
    defined_in: str | None = None
    """Built-ins: the ``overlapcfg.strategies`` module whose ``run`` is the graph call (imported on first use)."""

    def __post_init__(self) -> None:
        if (self.run is None) == (self.defined_in is None):
            raise OverlapUsageError(f"strategy {self.name!r}: give its graph call (run) or, for a built-in, the "
                                    "module defining it (defined_in), exactly one of the two")
        if self.defined_in is not None and not self.defined_in.startswith(_BUILTIN_PACKAGE):
            raise OverlapUsageError(f"strategy {self.name!r}: defined_in names modules of {_BUILTIN_PACKAGE} only, "
                                    f"got {self.defined_in!r}; other strategies give their graph call (run)")

    def graph_call(self) -> GraphCall:
        """The graph call: ``run``, or the ``run`` of the built-in's module, imported now if it was not yet (which
        imports torch)."""
        if self.run is not None:
            return self.run
        return cast(GraphCall, importlib.import_module(cast(str, self.defined_in)).run)


_BUILTIN_PACKAGE = "overlapcfg.strategies."


_CONTRACTS: dict[str, StrategyContract] = {}
_entry_points_loaded = False


def declare(contract: StrategyContract) -> None:
    """Add ``contract``; a taken name raises ``ValueError`` naming both registrants."""
    taken = _CONTRACTS.get(contract.name)
    if taken is not None:
        raise OverlapConfigError(
            f"strategy {contract.name!r} is already registered (by {taken.origin}); {contract.origin} tried to "
            "register it again. Pick another name."
        )
    _CONTRACTS[contract.name] = contract


declare(StrategyContract("manual", OverlapPolicy, defined_in="overlapcfg.strategies.manual"))
declare(StrategyContract("torch_manual", TorchManualPolicy, defined_in="overlapcfg.strategies.torch_manual"))
declare(StrategyContract("auto", AutoPolicy, uses_plan=False, defined_in="overlapcfg.strategies.auto"))
# `none` accepts the manual policy so that `-m overlap.strategy=none,manual` sweeps need no other change.
declare(StrategyContract("none", OverlapPolicy, uses_plan=False, reads_policy=False,
                         defined_in="overlapcfg.strategies.identity"))


def _load_entry_points() -> None:
    """Import each installed plugin once; importing it registers its strategies (``register_strategy``)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if ep.name in _CONTRACTS:
            continue
        try:
            obj = ep.load()
        except Exception:  # a broken plugin must not break every other config
            logger.exception("overlapcfg: could not load strategy entry point %r (%s)", ep.name, ep.value)
            continue
        if ep.name in _CONTRACTS:
            continue
        if not callable(obj):
            logger.error("overlapcfg: entry point %r is neither registered nor a strategy function", ep.name)
            continue
        # A bare strategy function: the manual policy, a plan, and the function as its graph call.
        dist = getattr(getattr(ep, "dist", None), "name", "?")
        declare(StrategyContract(ep.name, OverlapPolicy, origin=f"entry point {dist}", run=obj))


def strategy_names() -> tuple[str, ...]:
    """Every declared name, sorted (entry points included)."""
    _load_entry_points()
    return tuple(sorted(_CONTRACTS))


def contract_of(name: str) -> StrategyContract:
    """The contract declared under ``name``; an unknown name lists what is available, closest first."""
    if name not in _CONTRACTS:
        _load_entry_points()
    contract = _CONTRACTS.get(name)
    if contract is None:
        names = strategy_names()
        raise OverlapConfigError.single(
            "strategy", f"unknown strategy {show_value(name)}; available (closest first): "
                        f"{', '.join(closest_first(name, names))}{did_you_mean(name, names)}"
        )
    return contract
