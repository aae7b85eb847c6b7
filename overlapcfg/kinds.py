"""The words every layer uses for a collective: which side of autograd it runs on and what it does. One
definition each, torch-free, below every layer (like ``errors``), so the config layer's depth table
(``overlapcfg.config.depths``) and the graph layer's op vocabulary (``overlapcfg.graph.ops``) say the same thing.
"""

from __future__ import annotations

from typing import Literal, TypeAlias

__all__ = ["DIRECTIONS", "GRAPH_REGION", "BucketKind", "CollectiveKind", "Direction"]

Direction: TypeAlias = Literal["forward", "backward"]
"""Which side of autograd a node, a collective, a graph of a captured step or a decision is on
(``overlapcfg.graph.ops.node_direction``)."""

DIRECTIONS: tuple[Direction, ...] = ("forward", "backward")
"""Both, in the order a step runs them (a captured step's graphs, a report's graphs)."""

CollectiveKind: TypeAlias = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "other"]
"""The one classification of ``_c10d_functional`` collectives (merged and coalesced forms included)."""

BucketKind: TypeAlias = Literal["all_gather", "reduce_scatter", "all_reduce"]
"""The kinds a bucket merges and a depth schedules (FSDP all-gathers and reduce-scatters, HSDP all-reduces);
calibration fits the same three."""

GRAPH_REGION = "overlapcfg.graph::"
"""How a profiler trace names a graph ``overlapcfg.backend`` compiled: the range each call runs in and the key of the
graph's collectives at the trace's top level (``overlapcfg.graph::3/forward``), written by
``overlapcfg.passes.trace_label`` and read by ``overlapcfg.diagnose``."""
