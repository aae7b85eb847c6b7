"""Strategy registry: the strategies layer's side of the one catalog (``overlapcfg.config.contracts``).

The built-ins (``manual``, ``torch_manual``, ``auto``, ``none``) are declared there, torch-free, each naming the
module of this package that holds its graph call; third-party code registers with ``register_strategy`` (a
decorator on its graph call, declaring the contract and the call in one step) or through an installed entry point in
the ``overlapcfg.strategies`` group.
"""

from __future__ import annotations

from collections.abc import Callable

from overlapcfg.config import contracts
from overlapcfg.config.contracts import ENTRY_POINT_GROUP, StrategyContract
from overlapcfg.config.policy import OverlapPolicy, PolicyBase
from overlapcfg.errors import OverlapUsageError
from overlapcfg.strategies.interface import Strategy, StrategyFn

__all__ = ["ENTRY_POINT_GROUP", "Strategy", "available_strategies", "get_strategy", "register_strategy"]


def register_strategy(name: str, *, policy: type[PolicyBase] = OverlapPolicy, uses_plan: bool = True,
                      reads_policy: bool = True, origin: str | None = None) -> Callable[[StrategyFn], StrategyFn]:
    """Register ``run(gm, ctx) -> StrategyResult`` under ``name``, with the policy model its config is validated
    against (plan entries' and overrides' depths too, against the policy's fields of the same name).

    >>> @register_strategy("my_sched", policy=MyPolicy)   # doctest: +SKIP
    ... def run(gm, ctx): ...
    """
    if not isinstance(policy, type) or not issubclass(policy, PolicyBase):
        raise OverlapUsageError(f"register_strategy({name!r}): policy must be a PolicyBase subclass, got {policy!r}")

    def decorator(run: StrategyFn) -> StrategyFn:
        source = origin or getattr(run, "__module__", None) or "unknown"
        # raises, naming both registrants, if the name is taken
        contracts.declare(StrategyContract(name, policy, uses_plan, reads_policy, source, run))
        return run

    return decorator


def available_strategies() -> tuple[str, ...]:
    """Every registered name, sorted."""
    return contracts.strategy_names()


def get_strategy(name: str) -> Strategy:
    """The strategy registered under ``name``; an unknown name lists what is available, closest first."""
    return Strategy(contracts.contract_of(name))  # loads entry points; OverlapConfigError for unknown names
