"""Python's cyclic garbage collector paused while the pass rewrites and proves a graph (``cyclic_gc_paused``,
entered by ``overlapcfg.passes.pipeline.apply`` around summarize → rewrite → verify → recompile).

Why: the rewrite allocates hundreds of thousands of objects that outlive the young generations (new nodes, fake
tensors, the verifier's contents, the generated code), and that is what makes Python run a full collection, which
walks every object of the process: in a compiling process the model, dynamo's and aot's state and every graph,
millions of objects. Measured (``benchmarks/pass_speed.py --gc running``, and per phase with ``gc.callbacks``): on
the 64-layer demo backward (11.8k nodes, 1.3M tracked objects) one full collection of 2.8-4.4 s landed in each
pass, in the merge, the summary or the codegen by chance, on top of a pass of 6-8 s; the young collections cost
0.3-0.5 s spread over the same phases. The phases before (finding collectives, resolving the plan) allocate little
that survives and take a few percent of the pass, so the collector runs there; nothing is paused where the pass
ends before rewriting (a config error, a graph with nothing to do).

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
