"""A config applied to a captured step: the one entry point for transforming a step to look at the result.

``apply_step(step, cfg)`` runs the pass (``overlapcfg.passes.apply``) on copies of a ``CapturedStep``'s forward
and backward graphs, inside the process groups they name (``CapturedStep.process_groups``), and returns an
``AppliedStep``: each transformed graph with its ``PassRecord``, beside the untransformed one. ``apply_graph(gm,
cfg)`` does the same for one untransformed graph module, and ``applied_graph(gm, cfg)`` wraps one the pass already
transformed. ``explain``, ``compare``, the tuner's profile and its verification, and the demo job all start here;
``overlapcfg.report`` only reads the result.

Two costs are paid once instead of once per config, because one captured step serves many configs:

- the copies are lazy graph modules (``compat.lazy_graph_module_copy``): nothing here runs them, so their Python
  code is generated only if someone calls or prints them (for a 64-layer backward, about 0.7 s per config);
- the summary the verifier compares each pass against (``overlapcfg.graph.summary.summarize``) is taken once per
  captured graph and handed to ``apply`` for every config (the captured graphs are read-only by contract; a
  fingerprint of their nodes guards the cache against a graph edited in place all the same).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

from torch import fx

from overlapcfg import compat
from overlapcfg.config import OverlapConfig
from overlapcfg.errors import OverlapLookupError, OverlapUsageError, UnsupportedGraphError
from overlapcfg.graph.attribution import ModuleFqnFn, module_fqn
from overlapcfg.graph.collectives import find_collectives
from overlapcfg.graph.meta import pass_record
from overlapcfg.graph.record import PassRecord
from overlapcfg.graph.summary import GraphSummary, summarize
from overlapcfg.kinds import DIRECTIONS, Direction
from overlapcfg.passes.pipeline import GraphKind, PassOptions, apply
from overlapcfg.passes.step import CapturedStep

__all__ = ["AppliedGraph", "AppliedStep", "applied_graph", "apply_graph", "apply_step", "graph_fingerprint"]


@dataclass(frozen=True, slots=True)
class AppliedGraph:
    """One graph after the pass: the transformed module, its record, and the module it was copied from."""

    name: str
    """``forward`` / ``backward``; for a lone graph module, its record's graph kind where that is one of them,
    else ``graph``."""
    graph: fx.GraphModule
    record: PassRecord
    original: fx.GraphModule | None
    """The untransformed graph (``None``: the graph module was given already transformed)."""
    module_fqn_fn: ModuleFqnFn
    """Attribution for the nodes of ``graph`` (a step's recorded owners, else the default evidence order)."""


@dataclass(frozen=True, slots=True)
class AppliedStep:
    """``config`` applied to a step's graphs (``apply_step``) or to one graph module (``apply_graph``)."""

    config: OverlapConfig
    graphs: tuple[AppliedGraph, ...]
    """Forward first, then backward; one entry for a lone graph module."""
    world_size: int
    """Ranks the graphs were traced for."""
    step: CapturedStep | None = None
    """The captured step, where one was applied."""

    def graph(self, name: str) -> AppliedGraph:
        for applied in self.graphs:
            if applied.name == name:
                return applied
        raise OverlapLookupError(f"no {name!r} graph; have {', '.join(a.name for a in self.graphs)}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.graphs)


def apply_step(step: CapturedStep, cfg: OverlapConfig) -> AppliedStep:
    """``cfg`` applied to copies of ``step``'s forward and backward graphs (``step`` is untouched)."""
    graphs = []
    with step.process_groups():  # a mesh step's sub-groups too: merging resolves groups by name
        for name in DIRECTIONS:
            original = step.graph(name)
            fqn_fn = step.module_fqn_fn(name)
            gm = apply(compat.lazy_graph_module_copy(original), cfg, module_fqn_fn=fqn_fn,
                       module_fqns=step.module_fqns, graph_kind=name,
                       options=PassOptions(summary=_summary(original, name) if cfg.verify else None))
            graphs.append(AppliedGraph(name, gm, _record(gm), original, fqn_fn))
    return AppliedStep(cfg, tuple(graphs), step.world_size, step)


def apply_graph(gm: fx.GraphModule, cfg: OverlapConfig, *, world_size: int,
                graph_kind: GraphKind = "auto") -> AppliedStep:
    """``cfg`` applied to a copy of one untransformed graph module (``graph_kind`` as for ``apply``), in the live
    process group, else in a fake one of ``world_size`` ranks as rank 0 (merging writes the rank into the graph)."""
    with _groups_for(gm, world_size):
        work = apply(compat.lazy_graph_module_copy(gm), cfg, graph_kind=graph_kind)
    record = _record(work)
    return AppliedStep(cfg, (AppliedGraph(_name(record), work, record, gm, module_fqn),), world_size)


def applied_graph(gm: fx.GraphModule, cfg: OverlapConfig, *, world_size: int) -> AppliedStep:
    """A graph module the pass already transformed (its record read off ``gm.meta``), as an ``AppliedStep``;
    ``cfg``: the config that was applied."""
    record = _record(gm)
    return AppliedStep(cfg, (AppliedGraph(_name(record), gm, record, None, module_fqn),), world_size)


def _name(record: PassRecord) -> str:
    return record.graph_kind if record.graph_kind in DIRECTIONS else "graph"


def _record(gm: fx.GraphModule) -> PassRecord:
    rec = pass_record(gm)
    if rec is None:
        raise OverlapUsageError(
            "this graph module has no overlapcfg pass record; run overlapcfg.apply on it first, or pass "
            "the CapturedStep")
    return rec


@contextlib.contextmanager
def _groups_for(gm: fx.GraphModule, world_size: int) -> Iterator[None]:
    if compat.process_group_initialized():
        yield
        return
    groups = sorted({c.group for c in find_collectives(gm.graph, module_fqn) if c.fsdp} - {"0"})
    if groups:  # a fake default group cannot stand in for mesh sub-groups (HSDP, FSDP + TP)
        raise UnsupportedGraphError(
            f"this graph's FSDP collectives run on process group(s) {', '.join(map(repr, groups))}, which do not "
            "exist in this process (merging needs them); transform it inside the process groups the graph was "
            "traced under, or give the CapturedStep")
    with compat.fake_process_group(world_size, 0):
        yield


_SUMMARIES: weakref.WeakKeyDictionary[fx.GraphModule, dict[str, tuple[int, GraphSummary]]] = \
    weakref.WeakKeyDictionary()
"""Captured graph -> direction -> (fingerprint of its nodes, its summary). Weak: a step's graphs take their
summaries with them when they go."""


def _summary(gm: fx.GraphModule, direction: Direction) -> GraphSummary:
    """``summarize(gm, direction=...)``, taken once per captured graph (see the module docstring)."""
    stamp = graph_fingerprint(gm)
    cached = _SUMMARIES.get(gm, {}).get(direction)
    if stamp is not None and cached is not None and cached[0] == stamp:
        return cached[1]
    summary = summarize(gm, direction=direction)
    if stamp is not None:
        _SUMMARIES.setdefault(gm, {})[direction] = (stamp, summary)
    return summary


def graph_fingerprint(gm: fx.GraphModule) -> int | None:
    """Every node's name, op, target and arguments, hashed (None where a constant argument is unhashable: then
    nothing is cached): what caches of a captured graph's derived values compare."""
    try:
        return hash(tuple((n.name, n.op, n.target, n.args, n.kwargs) for n in gm.graph.nodes))
    except TypeError:
        return None
