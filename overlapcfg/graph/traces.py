"""The merge's traces, kept per capture: a bucket merge function traced once per signature is stamped again for
every later bucket, graph and config of the same capture (``overlapcfg.graph.stamp``).

A capture is its fake mode: the traces' fake values belong to it, and a graph of another capture (another mode)
must never see them. The traces are kept in overlapcfg's own table, not on torch's mode object. A table keyed
*weakly* by the mode would never free anything, since the traces' fake values refer to their mode (a weak key
kept alive by its own value); so the table holds the traces of the ``KEPT_CAPTURES`` captures merged most recently
and drops the oldest beyond that. A capture dropped and merged again is traced afresh: that costs time, never a
different graph (a trace is a function of its signature). ``forget_traces`` drops them all.

Safe with threads: the table is behind a lock, and ``traces_used`` collects per thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.graph.fresh_values import Recipe, recipe_of

__all__ = ["KEPT_CAPTURES", "Trace", "forget_traces", "trace_of", "traces_used"]

KEPT_CAPTURES = 4
"""How many captures' traces are kept (the most recently merged). A tuner or a benchmark alternates between a
step's forward and backward graph, which share one capture; a handful covers interleaving a few steps."""

Signature = tuple[object, ...]


@dataclass(slots=True)
class Trace:
    """One traced merge function: its graph, its placeholders in input order, and how to lay its fake values on
    new storages (``overlapcfg.graph.fresh_values``), worked out on first need and kept with it."""

    gm: fx.GraphModule
    placeholders: tuple[fx.Node, ...]
    _recipe: Recipe | None = None
    _recipe_known: bool = False

    def recipe(self) -> Recipe | None:
        if not self._recipe_known:
            self._recipe, self._recipe_known = recipe_of(self.gm, self.placeholders), True
        return self._recipe


@dataclass(slots=True)
class _Capture:
    mode: object
    """Held so that the key, its id, stays this mode's while the entry lives."""
    traces: dict[Signature, Trace] = field(default_factory=dict)


_LOCK = threading.Lock()
_CAPTURES: OrderedDict[int, _Capture] = OrderedDict()
_LOCAL = threading.local()


def _signature(fn: object, inps: Sequence[object]) -> Signature:
    def key(x: object) -> object:
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, str(x.device), x.storage_offset())
        if isinstance(x, (list, tuple)):
            return tuple(key(y) for y in x)
        return x

    return (fn, key(inps))


def _used_stack() -> list[set[Signature]]:
    stack: list[set[Signature]] | None = getattr(_LOCAL, "used", None)
    if stack is None:
        stack = _LOCAL.used = []
    return stack


def trace_of(fn: Callable[..., object], inps: Sequence[object]) -> tuple[Trace, bool]:
    """The trace of ``fn`` on ``inps`` and whether it was made now (else kept from an earlier bucket)."""
    signature = _signature(fn, inps)
    used = _used_stack()
    if used:
        used[-1].add(signature)
    mode = compat.detect_fake_mode(inps)
    if mode is None:
        raise AssertionError("overlapcfg merge: the collectives' inputs carry no fake values (meta['val'])")
    with _LOCK:
        capture = _CAPTURES.get(id(mode))
        if capture is not None:
            _CAPTURES.move_to_end(id(mode))
            kept = capture.traces.get(signature)
            if kept is not None:
                return kept, False
    gm = compat.trace_with_fake_mode(fn, inps, mode)  # outside the lock: tracing is the slow part
    made = Trace(gm, tuple(gm.graph.find_nodes(op="placeholder")))
    with _LOCK:
        capture = _CAPTURES.get(id(mode))
        if capture is None:
            capture = _CAPTURES[id(mode)] = _Capture(mode)
            while len(_CAPTURES) > KEPT_CAPTURES:
                _CAPTURES.popitem(last=False)
        _CAPTURES.move_to_end(id(mode))
        kept = capture.traces.setdefault(signature, made)  # another thread may have traced it meanwhile
    return kept, kept is made


def forget_traces() -> None:
    """Drop every kept trace: the next merge traces as the first did (``benchmarks/pass_speed.py`` times each run
    cold, as upstream's pass always runs)."""
    with _LOCK:
        _CAPTURES.clear()


@contextlib.contextmanager
def traces_used() -> Iterator[set[Signature]]:
    """Within the block, collect the signatures this thread spliced (how many distinct traces a merge needed)."""
    stack = _used_stack()
    stack.append(set())
    try:
        yield stack[-1]
    finally:
        stack.pop()
