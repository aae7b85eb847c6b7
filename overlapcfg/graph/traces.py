"""The merge's traces, kept: a bucket merge function traced once per signature is stamped again for every later
bucket, graph, config and capture with the same signature (``overlapcfg.graph.stamp``).

A trace is a function of its signature (the merge function, its tensors' shapes, strides, offsets, dtypes, devices
and whether they require grad, its other arguments by value: group name and size, reduce op), so the nodes it
stamps are the same whoever traced it. Its fake values are not: they belong to the fake mode of the capture that
traced it (``Trace.mode``), and a graph of another capture must never see them. So a trace stamped into another
capture's graph always gets fake values of that graph's own mode, laid from the trace's layouts
(``overlapcfg.graph.fresh_values``; ~10 us a tensor, where tracing again costs tens of milliseconds a bucket). Only
traces whose layouts can be laid so are shared between captures: static sizes, and a recipe
(``fresh_values.recipe_of``: no value that requires grad, no two inputs on one storage). Any other trace is kept
for its own capture only, as all of them were before.

The table is overlapcfg's own, not an attribute of torch's mode objects, bounded to the ``KEPT_TRACES`` traces used
most recently (a trace holds its fake values, so its capture's mode, alive). A trace dropped and needed again is
traced afresh: that costs time, never a different graph. ``forget_traces`` drops them all.

Safe with threads: the table is behind a lock, and ``traces_used`` collects per thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.graph.fresh_values import Recipe, recipe_of

__all__ = ["KEPT_TRACES", "Trace", "forget_traces", "trace_of", "traces_used"]

KEPT_TRACES = 256
"""How many traces are kept (the most recently used). A model's buckets have a handful of signatures (identical
layers share one); a tuner's search over bucket sizes, or a test session over many models, needs tens to a few
hundred."""

Signature = tuple[object, ...]


@dataclass(slots=True)
class Trace:
    """One traced merge function: its graph, its placeholders in input order, the fake mode its values belong to,
    and how to lay them on new storages (``overlapcfg.graph.fresh_values``), worked out on first need."""

    gm: fx.GraphModule
    placeholders: tuple[fx.Node, ...]
    mode: object
    """The fake mode of the capture that traced it: its values may be stamped into that capture's graphs only."""
    _recipe: Recipe | None = None
    _recipe_known: bool = False

    def recipe(self) -> Recipe | None:
        if not self._recipe_known:
            self._recipe, self._recipe_known = recipe_of(self.gm, self.placeholders), True
        return self._recipe


_LOCK = threading.Lock()
_TRACES: OrderedDict[tuple[object, ...], Trace] = OrderedDict()
"""``(None, signature)`` for a trace any capture may stamp; ``(id(mode), signature)`` for one only its own capture
may (the mode is held by the trace, so the id stays its own while the entry lives)."""
_LOCAL = threading.local()


def _signature(fn: object, inps: Sequence[object]) -> tuple[Signature, bool]:
    """The signature of ``fn(*inps)``, and whether every size in it is a plain integer (a trace other captures may
    share; a symbolic size belongs to its capture's shape environment)."""
    static = True

    def key(x: object) -> object:
        nonlocal static
        if isinstance(x, torch.Tensor):
            numbers = (*x.shape, *x.stride(), x.storage_offset())
            static = static and all(type(n) is int for n in numbers)
            return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, str(x.device), x.storage_offset(),
                    x.requires_grad)
        if isinstance(x, (list, tuple)):
            return tuple(key(y) for y in x)
        return x

    keyed = key(inps)
    return (fn, keyed), static


def _used_stack() -> list[set[Signature]]:
    stack: list[set[Signature]] | None = getattr(_LOCAL, "used", None)
    if stack is None:
        stack = _LOCAL.used = []
    return stack


def trace_of(fn: Callable[..., object], inps: Sequence[object]) -> tuple[Trace, bool]:
    """The trace of ``fn`` on ``inps`` and whether it was made now (else kept from an earlier bucket, perhaps of
    another capture: ``Trace.mode`` says whose its fake values are)."""
    signature, static = _signature(fn, inps)
    used = _used_stack()
    if used:
        used[-1].add(signature)
    mode = compat.detect_fake_mode(inps)
    if mode is None:
        raise AssertionError("overlapcfg merge: the collectives' inputs carry no fake values (meta['val'])")
    keys = [(None, signature), (id(mode), signature)] if static else [(id(mode), signature)]
    with _LOCK:
        for key in keys:
            kept = _TRACES.get(key)
            if kept is not None:
                _TRACES.move_to_end(key)
                return kept, False
    gm = compat.trace_with_fake_mode(fn, inps, mode)  # outside the lock: tracing is the slow part
    made = Trace(gm, tuple(gm.graph.find_nodes(op="placeholder")), mode)
    shared = static and made.recipe() is not None
    key = (None, signature) if shared else (id(mode), signature)
    with _LOCK:
        kept = _TRACES.setdefault(key, made)  # another thread may have traced it meanwhile
        _TRACES.move_to_end(key)
        while len(_TRACES) > KEPT_TRACES:
            _TRACES.popitem(last=False)
    return kept, kept is made


def forget_traces() -> None:
    """Drop every kept trace: the next merge traces as the first did (``benchmarks/pass_speed.py`` times each run
    cold, as upstream's pass always runs)."""
    with _LOCK:
        _TRACES.clear()


@contextlib.contextmanager
def traces_used() -> Iterator[set[Signature]]:
    """Within the block, collect the signatures this thread spliced (how many distinct traces a merge needed)."""
    stack = _used_stack()
    stack.append(set())
    try:
        yield stack[-1]
    finally:
        stack.pop()
