"""What the tuner derives from a traced step alone, kept per step across searches.

``tune`` is often called on one traced step many times (``benchmarks/tune.py``: 2 machines x 4 world sizes; a
user trying budgets). Some of what a search derives depends on the step and nothing else: the unit plan applied
for the profile, the competitors applied by their own rules (``overlapcfg.tuning.competitors``), each grouping's
plan and resolution, each preset's resolution. Rewriting graphs is machine-independent (the machine only prices
the result), so these are made once per step and every later search reuses them; what depends on the machine
(prices, scores, simulations) is never kept here.

Keys: the step's forward graph (weakly, so a step's entries go with it), then what the value depends on besides
the step. A fingerprint of the step (both graphs' nodes, as ``overlapcfg.passes.applied`` takes it for its
summaries, plus the step's model facts) guards every entry: a step edited in place, or another ``CapturedStep``
around the same forward graph with different facts, misses instead of reading a stale value. A step whose
fingerprint cannot be taken (an unhashable constant argument) is never cached.

Values are shared: callers must treat them as read-only (the applied graphs are only read, the plans are
frozen or copied by the caller before any change).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import TypeVar

from torch import fx

from overlapcfg.passes.applied import graph_fingerprint
from overlapcfg.passes.backend import CapturedStep

__all__ = ["cached", "step_fingerprint"]

T = TypeVar("T")

_CACHE: weakref.WeakKeyDictionary[fx.GraphModule, tuple[int, dict[Hashable, object]]] = weakref.WeakKeyDictionary()
"""Forward graph -> (fingerprint of the step, values by key)."""


def step_fingerprint(step: CapturedStep) -> int | None:
    """Both graphs' nodes and the step's model facts, hashed; None where a graph cannot be fingerprinted."""
    graphs = (graph_fingerprint(step.forward), graph_fingerprint(step.backward))
    if None in graphs:
        return None
    return hash((graphs, step.module_fqns, step.param_fqns, step.param_owners, step.collectives, step.world_size,
                 step.rank, step.module_types, step.mesh_groups))


def cached(step: CapturedStep, key: Hashable, make: Callable[[], T], *, stamp: int | None = None) -> T:
    """``make()``, once per ``step`` (as fingerprinted) and ``key``; ``stamp``: the step's fingerprint where the
    caller took it already (one search takes it once)."""
    stamp = step_fingerprint(step) if stamp is None else stamp
    if stamp is None:
        return make()
    held = _CACHE.get(step.forward)
    if held is None or held[0] != stamp:
        held = (stamp, {})
        _CACHE[step.forward] = held
    values = held[1]
    if key not in values:
        values[key] = make()
    return values[key]  # type: ignore[return-value]  # the key says what was made
