"""What the tuner derives from a traced step alone, kept per step across searches.

``tune`` is often called on one traced step many times (``benchmarks/tune.py``: 2 machines x 4 world sizes; a
user trying budgets). Some of what a search derives depends on the step and nothing else: the unit plan applied
for the profile, the competitors applied by their own rules (``overlapcfg.tuning.competitors``), the pricing plans
of those graphs (``overlapcfg.cost.pricing_plan.step_plans_kept``: what fuses, what checkpointing recomputes), each
grouping's plan and resolution, each preset's resolution. Rewriting graphs is machine-independent (the machine only
prices the result), so these are made once per step and every later search reuses them; what depends on the machine
(prices, scores, simulations) is never kept here. Nor is the winner's verified apply: winners differ from search to
search, and keeping a graph pair per winner would grow without bound for the rare search that repeats one.

Keys: the step's forward graph (weakly, so a step's entries go with it), then what the value depends on besides
the step. A fingerprint of the step (both graphs' nodes, as ``overlapcfg.passes.applied`` takes it for its
summaries, plus the step's model facts) guards every entry: a step edited in place, or another ``CapturedStep``
around the same forward graph with different facts, misses instead of reading a stale value. A step whose
fingerprint cannot be taken (an unhashable constant argument) is never cached.

Values are shared: callers must treat them as read-only (the applied graphs are only read, the plans are
frozen or copied by the caller before any change).
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import TypeVar

from torch import fx

from overlapcfg.passes.applied import graph_fingerprint
from overlapcfg.passes.backend import CapturedStep

__all__ = ["cached", "fingerprinted", "step_fingerprint"]

T = TypeVar("T")

_HELD: contextvars.ContextVar[tuple[CapturedStep, int | None] | None] = contextvars.ContextVar(
    "overlapcfg_step_fingerprint", default=None)
"""The step of the open ``fingerprinted`` block and its fingerprint."""
_CACHE: weakref.WeakKeyDictionary[fx.GraphModule, tuple[int, dict[Hashable, object]]] = weakref.WeakKeyDictionary()
"""Forward graph -> (fingerprint of the step, values by key)."""


def step_fingerprint(step: CapturedStep) -> int | None:
    """Both graphs' nodes and the step's model facts, hashed; None where a graph cannot be fingerprinted."""
    graphs = (graph_fingerprint(step.forward), graph_fingerprint(step.backward))
    if None in graphs:
        return None
    return hash((graphs, step.module_fqns, step.param_fqns, step.param_owners, step.collectives, step.world_size,
                 step.rank, step.module_types, step.mesh_groups))


@contextlib.contextmanager
def fingerprinted(step: CapturedStep) -> Iterator[None]:
    """Within the block, ``cached`` uses ``step``'s fingerprint as taken when the block opens, instead of taking it
    at every call (about 20 ms for the 32-layer Llama step; a search asks the cache some fifty times). For a block
    that only reads the step, as a search does."""
    token = _HELD.set((step, step_fingerprint(step)))
    try:
        yield
    finally:
        _HELD.reset(token)


def cached(step: CapturedStep, key: Hashable, make: Callable[[], T]) -> T:
    """``make()``, once per ``step`` (as fingerprinted) and ``key``."""
    held = _HELD.get()
    stamp = held[1] if held is not None and held[0] is step else step_fingerprint(step)
    if stamp is None:
        return make()
    entry = _CACHE.get(step.forward)
    if entry is None or entry[0] != stamp:
        entry = (stamp, {})
        _CACHE[step.forward] = entry
    values = entry[1]
    if key not in values:
        values[key] = make()
    return values[key]  # type: ignore[return-value]  # the key says what was made
