"""Run a step's graphs as the pass wrote them, timed: the compiler ``measure`` gives ``torch.compile``.

``Recorder.compiler(graph)`` is a ``GraphBackend`` compiler (aot's boxed calling convention): it runs each graph
module as it is (the kernels an untransformed eager run has, in the pass's order), and

- always inside a ``torch.profiler.record_function`` range named ``overlapcfg::<graph>`` (a profiler sees where
  each graph ran; free when no profiler is on);
- in mode ``timed``, between two ``Clock`` marks: the seconds each graph took, step by step, and the seconds
  between them (``between_regions``); on a CPU also the seconds its collective waits blocked (``take_waited``),
  through a copy of the graph whose ``wait_tensor`` calls are timed (two clock reads each). That is the step's
  exposed communication measured in the very steps whose times are reported, every one of them, with no profiler
  on. Against the profiler's figure on 2 gloo ranks here (2026-12-08, four sweeps of 7-8 configs): timed over
  profiled 0.61-1.30 per config, in no consistent direction. On a GPU a wait returns at once on the host (it
  orders the streams), so there the profiler's trace stays the measure;
- in mode ``nodes``, through an ``fx.Interpreter`` with a ``Clock`` mark around every compute-stream node (the
  kinds ``NodeCosts`` holds): per-node seconds under the node's name, which is how a profile maps to fx nodes.
  This run is slower (one Python dispatch per node) and is used for node durations only, never for step times.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from torch import fx
from torch.profiler import record_function

from overlapcfg import compat
from overlapcfg.cost.node_costs import MEASURABLE_KINDS, NodeCosts, node_signature
from overlapcfg.cost.price import node_kind
from overlapcfg.graph.ops import started_by
from overlapcfg.measuring.clock import Clock, Mark
from overlapcfg.passes.backend import GraphCompiler

__all__ = ["REGION", "Recorder"]

REGION = "overlapcfg::"
"""Prefix of the profiler range each graph runs in (``overlapcfg::forward``)."""

Mode = Literal["plain", "timed", "nodes"]


class _NodeTimer(fx.Interpreter):
    """Runs a graph node by node, marking the clock around each compute-stream node."""

    def __init__(self, gm: fx.GraphModule, clock: Clock, marks: list[tuple[fx.Node, Mark, Mark]]) -> None:
        super().__init__(gm)
        self.clock, self.marks = clock, marks

    def run_node(self, n: fx.Node) -> Any:
        if n.op != "call_function" or node_kind(n) not in MEASURABLE_KINDS:
            return super().run_node(n)
        start = self.clock.mark()
        out = super().run_node(n)
        self.marks.append((n, start, self.clock.mark()))
        return out


class Recorder:
    """Compilers that run graphs as they are, and what they measured (see the module docstring)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.mode: Mode = "plain"
        self._regions: list[tuple[str, Mark, Mark]] = []
        self._nodes: dict[str, dict[str, tuple[str, list[float]]]] = {}
        self._waited = 0.0
        self.waits_timed = not clock.cuda
        """Whether every graph's waits are timed in the ``timed`` runs (else ``take_waited`` is not the whole
        exposure: the profiler's trace is the measure)."""

    def compiler(self, graph: str) -> GraphCompiler:
        def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[object]) -> Callable[..., object]:
            timed = self._with_timed_waits(gm) if not self.clock.cuda else None
            if timed is None:
                self.waits_timed = False
            return compat.make_boxed_func(lambda *args: self._run(graph, gm, gm if timed is None else timed, args))

        return compile_graph

    def _with_timed_waits(self, gm: fx.GraphModule) -> fx.GraphModule | None:
        """A copy of ``gm`` (the same code, sharing its attributes) whose collective waits add the seconds they
        block to the recorder's count; None where a wait is not a plain ``wait_tensor`` call (one wrapped by
        ``insert_overlap_deps``' ordering edges), which the copy could not time. The graph itself is left as it is:
        the ``nodes`` mode and the prediction read its waits as waits."""
        wait = compat.WAIT_TENSOR
        now = time.perf_counter

        def timed_wait(tensor: Any) -> Any:
            start = now()
            out = wait(tensor)
            self._waited += now() - start
            return out

        graph = fx.Graph()
        graph.output(graph.graph_copy(gm.graph, {}))
        timed = fx.GraphModule(gm, graph)  # its submodules (a wrapped wait's body) are gm's
        waits = [n for n in timed.graph.nodes if started_by(n) is not None]
        if any(n.target is not wait for n in waits):
            return None
        for node in waits:
            node.target = timed_wait
        timed.recompile()
        return timed

    def take_waited(self) -> float:
        """Seconds the collective waits of the ``timed`` runs blocked since the last call, then forget them."""
        out, self._waited = self._waited, 0.0
        return out

    def _run(self, graph: str, gm: fx.GraphModule, timed: fx.GraphModule, args: tuple[object, ...]) -> object:
        """``gm`` on ``args`` in the current mode; ``timed``: its copy with timed waits (``gm`` itself where its waits
        are not timed), which the ``timed`` mode runs."""
        with record_function(f"{REGION}{graph}"):
            if self.mode == "nodes":
                marks: list[tuple[fx.Node, Mark, Mark]] = []
                out = _NodeTimer(gm, self.clock, marks).run(*args)
                seen = self._nodes.setdefault(graph, {})
                for node, start, end in marks:
                    seen.setdefault(node.name, (node_signature(node), []))[1].append(self.clock.seconds(start, end))
                return out
            if self.mode == "timed":
                start = self.clock.mark()
                out = timed(*args)
                self._regions.append((graph, start, self.clock.mark()))
                return out
            return gm(*args)

    def between_regions(self) -> float:
        """Seconds between the graphs recorded since the last ``take_regions``, summed: from each graph's end to the
        next one's start (the step's own work outside them: an eager loss, autograd's start)."""
        regions = self._regions
        return sum(self.clock.seconds(regions[i - 1][2], regions[i][1]) for i in range(1, len(regions)))

    def take_regions(self) -> dict[str, float]:
        """Seconds per graph since the last call (summed if a graph ran more than once), then forget them."""
        out: dict[str, float] = {}
        for graph, start, end in self._regions:
            out[graph] = out.get(graph, 0.0) + self.clock.seconds(start, end)
        self._regions.clear()
        return out

    def node_seconds(self) -> dict[str, dict[str, tuple[str, float]]]:
        """Per graph and node: ``(signature, median seconds)`` over the ``nodes`` runs so far."""
        return {g: {n: (sig, statistics.median(ts)) for n, (sig, ts) in nodes.items()}
                for g, nodes in self._nodes.items()}


def merge_node_seconds(per_rank: Sequence[dict[str, dict[str, tuple[str, float]]]], source: str) -> NodeCosts:
    """One ``NodeCosts`` from every rank's: per node, the mean over the ranks that measured it with rank 0's
    signature (ranks run the same kernels; a rank whose graph differs there is left out for that node)."""
    first = per_rank[0]
    graphs: dict[str, dict[str, tuple[str, float]]] = {}
    for graph, nodes in first.items():
        merged = {}
        for name, (sig, _) in nodes.items():
            values = [r[graph][name][1] for r in per_rank if r.get(graph, {}).get(name, ("",))[0] == sig]
            merged[name] = (sig, sum(values) / len(values))
        graphs[graph] = merged
    return NodeCosts(source=source, graphs=graphs)
