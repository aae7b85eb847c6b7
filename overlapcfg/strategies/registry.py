"""Strategy registry: names map to ``Strategy`` objects (contract + graph call).

The built-ins (``manual``, ``torch_manual``, ``auto``, ``none``) are registered when this module is imported;
third-party code registers with ``register_strategy`` (a decorator on its graph call) or through an installed
entry point in the ``overlapcfg.strategies`` group. The contracts live in ``overlapcfg.config.contracts`` so that
configs validate without importing torch; this module adds the graph calls.
"""

from __future__ import annotations

from collections.abc import Callable

from overlapcfg.config import contracts
from overlapcfg.config.contracts import ENTRY_POINT_GROUP, ConfigCheck, StrategyContract
from overlapcfg.config.policy import OverlapPolicy, PolicyBase
from overlapcfg.strategies import auto, identity, manual, torch_manual
from overlapcfg.strategies.base import Strategy, StrategyFn

__all__ = ["ENTRY_POINT_GROUP", "Strategy", "available_strategies", "get_strategy", "register_strategy"]

_STRATEGIES: dict[str, Strategy] = {}


def _add(strategy: Strategy) -> None:
    contracts.declare(strategy.contract)  # raises, naming both registrants, if the name is taken
    _STRATEGIES[strategy.name] = strategy


def register_strategy(name: str, *, policy: type[PolicyBase] = OverlapPolicy, uses_plan: bool = True,
                      reads_policy: bool = True, check: ConfigCheck | None = None,
                      origin: str | None = None) -> Callable[[StrategyFn], StrategyFn]:
    """Register ``run(gm, ctx) -> StrategyResult`` under ``name``, with the policy model its config is validated
    against.

    >>> @register_strategy("my_sched", policy=MyPolicy)   # doctest: +SKIP
    ... def run(gm, ctx): ...
    """
    if not isinstance(policy, type) or not issubclass(policy, PolicyBase):
        raise TypeError(f"register_strategy({name!r}): policy must be a PolicyBase subclass, got {policy!r}")

    def decorator(run: StrategyFn) -> StrategyFn:
        source = origin or getattr(run, "__module__", None) or "unknown"
        _add(Strategy(StrategyContract(name, policy, uses_plan, reads_policy, check, source), run))
        return run

    return decorator


for _name, _run in (("manual", manual.run), ("torch_manual", torch_manual.run), ("auto", auto.run),
                   ("none", identity.run)):
    _STRATEGIES[_name] = Strategy(contracts.contract_of(_name), _run)


def available_strategies() -> tuple[str, ...]:
    """Every registered name, sorted."""
    return contracts.strategy_names()


def get_strategy(name: str) -> Strategy:
    """The strategy registered under ``name``; an unknown name lists what is available, closest first."""
    contract = contracts.contract_of(name)  # loads entry points; raises OverlapConfigError for unknown names
    strategy = _STRATEGIES.get(name)
    if strategy is None:
        bare = contracts.bare_entry_point(name)
        if bare is None:
            raise LookupError(f"strategy {name!r} has a contract ({contract.origin}) but no registered graph call; "
                              "register it with overlapcfg.register_strategy")
        strategy = _STRATEGIES[name] = Strategy(contract, bare)  # type: ignore[arg-type]
    return strategy
