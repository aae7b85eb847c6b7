"""The pass runs with Python's cyclic garbage collector paused (``cyclic_gc_paused``, around
``overlapcfg.passes.pipeline.apply``).
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["cyclic_gc_paused"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def cyclic_gc_paused(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``fn`` with Python's cyclic garbage collector paused (reference counting still frees what is no longer
    used; cycles left behind are collected once it resumes).

    Why: a pass allocates hundreds of thousands of small objects (nodes, fake tensors, the verifier's contents), so
    the collector runs many times during one, and each run that reaches the oldest generation walks every object of
    the process: in a compiling process that is the model, dynamo's and aot's state and every graph, millions of
    objects. Measured on a 32-layer step captured through ``overlapcfg.backend``: the pass took 2 to 4 times as long
    with the collector running as with it paused, by how many full collections happened to land in it, and more in
    processes holding bigger heaps (a Hugging Face model's), which is how a pass came to cost several times as much
    per node on one model as on another."""

    @functools.wraps(fn)
    def paused(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return paused
