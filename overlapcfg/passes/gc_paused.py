"""Python's cyclic garbage collector paused while the pass rewrites and proves a graph (``cyclic_gc_paused``,
entered by ``overlapcfg.passes.pipeline.apply`` around summarize → rewrite → verify → recompile).

Why: the rewrite allocates hundreds of thousands of objects that outlive the young generations (new nodes, fake
tensors, the verifier's contents, the generated code), and that is what makes Python run a full collection, which
walks every object of the process: in a compiling process the model, dynamo's and aot's state and every graph,
millions of objects. Measured (``benchmarks/pass_speed.py --gc-study``, 2026-12-06, shared machine, CPU time): on
the 64-layer demo backward (11.8k nodes, ~1M tracked objects) a pass that never pauses the collector had a full
collection of 1.1-1.9 s inside it in every run (2.66 s against 2.03 s paused as here); attributed per phase with
``gc.callbacks``, the full collection landed in the merge, the summary or the codegen, whichever allocation crossed
the threshold. The phases before the rewrite (finding collectives, resolving the plan) allocate little that
survives and take a few percent of the pass, so the collector runs there; nothing is paused where the pass ends
before rewriting (a config error, a graph with nothing to do). Pausing the whole call instead measured the same
(1.98 s, plus 0.03 s of young collection owed after it).

Reference counting still frees what is no longer used while paused; cycles left behind are collected once the
collector resumes.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["cyclic_gc_paused"]

_LOCK = threading.Lock()
_holders = 0
"""How many ``cyclic_gc_paused`` blocks are open, in every thread."""
_resume = False
"""Whether the collector was running when the first of them opened (and so is resumed when the last closes)."""


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Pause the cyclic collector for the block; resume it on every way out (an exception included) if it was
    running when paused. Nested blocks and blocks in several threads share one pause: the collector resumes when the
    last open block closes, and only if it was running before the first opened; a collector the caller paused
    stays paused."""
    global _holders, _resume
    with _LOCK:
        if _holders == 0:
            _resume = gc.isenabled()
            gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _LOCK:
            _holders -= 1
            if _holders == 0 and _resume:
                gc.enable()
