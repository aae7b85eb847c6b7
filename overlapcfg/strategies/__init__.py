"""Strategies: a registry of ``Strategy`` objects (config contract + graph call) and the built-ins ``manual``,
``torch_manual``, ``auto`` and ``none``."""

from overlapcfg.strategies.interface import PassContext, Strategy, StrategyFn, StrategyResult
from overlapcfg.strategies.registry import available_strategies, get_strategy, register_strategy

__all__ = ["PassContext", "Strategy", "StrategyFn", "StrategyResult", "available_strategies", "get_strategy",
           "register_strategy"]
