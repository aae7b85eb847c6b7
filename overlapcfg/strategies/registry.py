"""Strategy registry: a config names a strategy; this module maps the name to a policy model and a factory.

Names come from three places, in this order: the built-ins below, ``register_strategy`` calls made by Python
code, and installed entry points in the ``overlapcfg.strategies`` group (loaded lazily, once). A config can
never name an import path: YAML selects a key of this registry and nothing else.

Importing this module imports no torch: a built-in's factory is loaded the first time it is asked for.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, TypeAlias

from overlapcfg.errors import OverlapConfigError, closest_first, did_you_mean
from overlapcfg.config.policy import AutoPolicy, OverlapPolicy, PolicyBase, TorchManualPolicy

if TYPE_CHECKING:
    from overlapcfg.resolve import ResolvedPlan

__all__ = ["ENTRY_POINT_GROUP", "StrategySpec", "available_strategies", "get_strategy", "register_strategy"]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "overlapcfg.strategies"

StrategyFactory: TypeAlias = Callable[["ResolvedPlan", Any], Any]
"""``factory(resolved_plan, policy) -> Strategy`` (see ``overlapcfg.strategies.base.Strategy``)."""


@dataclass(frozen=True, slots=True)
class StrategySpec:
    """A registered strategy: its name, the policy model its config is validated against, and its factory."""

    name: str
    policy: type[PolicyBase]
    uses_plan: bool
    origin: str
    """Where it was registered: ``builtin``, a module name, or ``entry point <dist>``."""
    loader: Callable[[], StrategyFactory]
    uses_policy: bool = True
    """False for strategies that read no policy (``none``): a non-default policy is then reported as ignored."""

    @property
    def factory(self) -> StrategyFactory:
        return self.loader()


_REGISTRY: dict[str, StrategySpec] = {}
_entry_points_loaded = False


def _add(spec: StrategySpec) -> None:
    taken = _REGISTRY.get(spec.name)
    if taken is not None:
        raise ValueError(
            f"strategy {spec.name!r} is already registered (by {taken.origin}); {spec.origin} tried to "
            f"register it again. Pick another name."
        )
    _REGISTRY[spec.name] = spec


def register_strategy(
    name: str, *, policy: type[PolicyBase] = OverlapPolicy, uses_plan: bool = True
) -> Callable[[StrategyFactory], StrategyFactory]:
    """Register ``factory(resolved_plan, policy) -> Strategy`` under ``name``.

    >>> @register_strategy("my_sched", policy=MyPolicy)   # doctest: +SKIP
    ... def make(plan, policy): return MyStrategy(plan, policy)
    """
    if not isinstance(policy, type) or not issubclass(policy, PolicyBase):
        raise TypeError(f"register_strategy({name!r}): policy must be a PolicyBase subclass, got {policy!r}")

    def decorator(factory: StrategyFactory) -> StrategyFactory:
        origin = getattr(factory, "__module__", None) or "unknown"
        _add(StrategySpec(name, policy, uses_plan, origin, lambda: factory))
        return factory

    return decorator


def _builtin(name: str, policy: type[PolicyBase], uses_plan: bool, module: str, *, uses_policy: bool = True) -> None:
    def load() -> StrategyFactory:
        return importlib.import_module(f"overlapcfg.strategies.{module}").make_strategy

    _add(StrategySpec(name, policy, uses_plan, "builtin", load, uses_policy))


_builtin("manual", OverlapPolicy, True, "manual")
_builtin("torch_manual", TorchManualPolicy, True, "torch_manual")
_builtin("auto", AutoPolicy, False, "auto")
# `none` accepts the manual policy so that `-m overlap.strategy=none,manual` sweeps need no other change.
_builtin("none", OverlapPolicy, False, "identity", uses_policy=False)


def _load_entry_points() -> None:
    """Import each installed plugin once; importing it registers its strategies."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if ep.name in _REGISTRY:
            continue
        try:
            obj = ep.load()
        except Exception:  # a broken plugin must not break every other config
            logger.exception("overlapcfg: could not load strategy entry point %r (%s)", ep.name, ep.value)
            continue
        if ep.name not in _REGISTRY:
            if not callable(obj):
                logger.error("overlapcfg: entry point %r is neither registered nor a factory", ep.name)
                continue
            dist = getattr(getattr(ep, "dist", None), "name", "?")
            _add(StrategySpec(ep.name, OverlapPolicy, True, f"entry point {dist}", lambda obj=obj: obj))


def available_strategies() -> tuple[str, ...]:
    """Every registered name, sorted."""
    _load_entry_points()
    return tuple(sorted(_REGISTRY))


def get_strategy(name: str) -> StrategySpec:
    """The spec registered under ``name``; an unknown name lists what is available, closest first."""
    if name not in _REGISTRY:
        _load_entry_points()
    spec = _REGISTRY.get(name)
    if spec is None:
        names = available_strategies()
        raise OverlapConfigError.single(
            "strategy", f"unknown strategy {name!r}; available (closest first): "
                        f"{', '.join(closest_first(name, names))}{did_you_mean(name, names)}"
        )
    return spec
