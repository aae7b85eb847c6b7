"""Built-in strategies (``manual``, ``torch_manual``, ``auto``, ``none``); ``overlapcfg.strategies.registry`` names them."""

from overlapcfg.strategies.base import PassContext, Strategy

__all__ = ["PassContext", "Strategy"]
