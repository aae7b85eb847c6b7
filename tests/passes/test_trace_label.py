"""A graph compiled by ``overlapcfg.backend`` runs inside its own profiler range and, while a profiler records,
leaves its collectives' record at the top level of the trace (``overlapcfg.passes.trace_label``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.kinds import GRAPH_REGION
from overlapcfg.passes.trace_label import graph_collectives, labelled


def _graph() -> fx.GraphModule:
    return fx.symbolic_trace(lambda x: torch.relu(x) * 2)


def test_a_labelled_graph_runs_in_its_range_and_leaves_its_record_only_while_profiling(tmp_path: Path) -> None:
    gm = _graph()
    run = labelled(compat.make_boxed_func(gm.forward), gm, "forward")
    assert run._boxed_call  # type: ignore[attr-defined]
    assert torch.equal(run([torch.ones(3)]), torch.full((3,), 2.0))  # not profiling: the graph, nothing else
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run([torch.ones(3)])
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    trace = json.loads((tmp_path / "trace.json").read_text())
    regions = [e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith(GRAPH_REGION)]
    assert len(regions) == 1 and regions[0].endswith("/forward")
    record = trace[regions[0]]
    assert record == {"graph": "forward", "buckets": {}, "collectives": []}


def test_an_unboxed_compiled_function_is_called_with_its_arguments() -> None:
    gm = _graph()
    def unboxed(x: torch.Tensor) -> torch.Tensor:
        return gm(x)

    run = labelled(unboxed, gm, "backward")
    assert torch.equal(run([torch.full((2,), -1.0)]), torch.zeros(2))


def test_a_graph_without_a_pass_record_lists_its_collectives_without_buckets() -> None:
    assert graph_collectives(_graph()) == []
