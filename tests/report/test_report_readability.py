"""What a report says, read by someone who did not write it: ``report.json`` carries the "before" prediction the
table shows, the lower bound sits under the step time it bounds (and, with several process groups, each group's
time is shown under their sum), groups are named by mesh dimension where the mesh is known, timeline stalls say
which kind of collective they wait on, and a strategy without plan buckets gets neither a plan in its title nor an
empty table.

Fast tier: synthetic graphs and hand-made report data. Slow tier: the demo traced on an HSDP mesh.
"""

from __future__ import annotations

import json

import pytest
from rich.console import Console

import overlapcfg
from overlapcfg.cost.prediction import Simulation, StreamTime
from overlapcfg.graph.record import GroupTraffic
from overlapcfg.report import Report
from overlapcfg.report.model import GraphReport
from overlapcfg.report.render import report_table
from overlapcfg.report.timeline import _LEGEND, chrome_trace, stream_label
from tests.support.synthetic import captured_step

LAYERS = [[2, 1], [1], [3, 2]]
PLAN = {"plan": {"name": "layers", "buckets": ["layers.*"]}}


def _text(report: Report, width: int = 120) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(report_table(report))
    return console.export_text()


def test_report_json_carries_the_before_prediction_the_table_shows() -> None:
    step = captured_step(LAYERS)
    report = overlapcfg.explain(step, PLAN, hardware="h100_nvlink")
    untouched = overlapcfg.explain(step, {"strategy": "none"}, hardware="h100_nvlink").simulation
    assert report.baseline is not None and untouched is not None
    assert report.baseline.step_seconds == untouched.step_seconds > report.simulation.step_seconds
    data = json.loads(report.to_json())
    assert data["baseline"]["step_seconds"] == untouched.step_seconds
    assert Report.from_json(report.to_json()) == report
    text = _text(report)
    assert "before (no pass)" in text  # the table reads it from the report: nobody passes baseline= any more
    assert overlapcfg.explain(step, PLAN).baseline is None  # no hardware, no prediction


def test_timeline_stalls_say_which_collective_they_wait_on() -> None:
    """The untransformed step stalls on every all-gather (forward) and every reduce-scatter (backward)."""
    report = overlapcfg.explain(captured_step(LAYERS), {"strategy": "none"}, hardware="h100_nvlink")
    sim = report.simulation
    assert sim is not None
    kinds = {(e.graph, e.waits_on) for e in sim.events if e.kind == "wait"}
    assert kinds == {("forward", "all_gather"), ("backward", "all_gather"), ("backward", "reduce_scatter")}
    names = {e["name"].split("[")[0] for e in chrome_trace([("none", sim)])["traceEvents"] if e.get("cat") == "wait"}
    assert names == {"wait AG", "wait RS"}
    assert {"wait:all_gather", "wait:reduce_scatter"} <= set(_LEGEND)
    assert _LEGEND["wait:all_gather"] != _LEGEND["wait:reduce_scatter"]


def _hsdp_report() -> Report:
    """An HSDP report's shape, by hand: shard group 3 and replicate group 1, their sum above the bound."""
    streams = (StreamTime(stream="compute", busy_seconds=126e-6), StreamTime(stream="comm:3", busy_seconds=47.8e-6),
               StreamTime(stream="comm:1", busy_seconds=88.2e-6))

    def sim(step: float, scale: float) -> Simulation:
        return Simulation(hardware="h100_nvlink", world_size=4, step_seconds=step, compute_seconds=126e-6,
                          comm_seconds=136e-6 * scale, exposed_comm_seconds=49.2e-6, overlap_ratio=0.638,
                          lower_bound_seconds=126e-6, peak_inflight_bytes=2**21, peak_unsharded_param_bytes=2**22,
                          peak_activation_bytes=None,
                          streams=tuple(t.model_copy(update={"busy_seconds": t.busy_seconds * scale}) for t in streams))

    groups = (GroupTraffic(group="1", size=2, role="hsdp_all_reduce", before=39, after=6, unsharded_bytes=2**22),
              GroupTraffic(group="3", size=2, role="fsdp_reduce_scatter", before=39, after=6, unsharded_bytes=2**22))
    graph = GraphReport(name="backward", strategy="manual", nodes=1057, collectives_before=116, collectives_after=17,
                        non_fsdp=(), groups=groups, uncovered=(), order="", pass_seconds=0.4)
    return Report(strategy="manual", plan_name="llama_layers", config={}, world_size=4, buckets=(), graphs=(graph,),
                  simulation=sim(175.2e-6, 1.0), baseline=sim(526.1e-6, 3.0),
                  mesh=(("dp_replicate", "1"), ("dp_shard", "3")))


def test_the_lower_bound_reads_as_a_bound_on_the_step_and_groups_by_mesh_dimension() -> None:
    """The trial on HSDP: "lower bound" (busiest group) printed below "communication" (all groups summed)."""
    text = _text(_hsdp_report())
    lines = text.split("Prediction:", 1)[1].splitlines()
    at = {key: next(i for i, line in enumerate(lines) if key in line)
          for key in ("step time", "lower bound: max(compute + unhidable, busiest group)",
                      "communication, all groups summed", "dp_shard (group 3)", "dp_replicate (group 1)")}
    assert at["step time"] + 1 == at["lower bound: max(compute + unhidable, busiest group)"]
    assert at["communication, all groups summed"] < min(at["dp_shard (group 3)"], at["dp_replicate (group 1)"])
    shard = lines[at["dp_shard (group 3)"]]
    assert "143.4 µs" in shard and "47.8 µs" in shard  # before and after, per group
    assert "dp_replicate (group 1)" in text.split("process groups", 1)[1].split("Prediction:")[0]  # groups table
    assert stream_label("comm:3", {"3": "dp_shard"}) == "comm: dp_shard (group 3)"
    assert stream_label("comm:9", {"3": "dp_shard"}) == "comm:9" and stream_label("compute") == "compute"


def test_a_strategy_without_plan_buckets_gets_no_plan_title_and_no_empty_table() -> None:
    """The trial's ``strategy: auto`` output: "plan llama_layers" in the title (ignored), a bucket table with
    headers and no rows. ``none`` stands in for ``auto`` here (auto needs triton's estimates)."""
    step = captured_step(LAYERS)
    report = overlapcfg.explain(step, {"strategy": "none", "plan": "llama_layers"})
    assert report.plan_name is None
    text = _text(report)
    assert "plan llama_layers" not in text and "why (depth lowered)" not in text
    assert "no plan buckets: nothing merged, the" in text
    manual = _text(overlapcfg.explain(step, PLAN))
    assert "plan layers" in manual and "why (depth lowered)" in manual


def test_torchs_bucketing_summary_stays_off_the_console_while_our_strategies_run_it() -> None:
    """The trial's ``strategy: auto`` run printed ``[rank0]:I... pre_bucket_fsdp_collectives: ...`` twice in the
    middle of the report: torch sets that module's logger to INFO at import. Inside the scope our strategies call
    torch's schedulers in, the records below WARNING this thread logs there are dropped; warnings, other threads'
    records and the logger itself (its level, its filters once the scope is left) are untouched."""
    import logging
    import threading

    from overlapcfg import compat

    with compat.upstream_scheduler_scope():  # imports torch's module, which sets its logger's level
        pass
    fsdp = logging.getLogger("torch._inductor.fx_passes.fsdp")
    level, filters = fsdp.level, list(fsdp.filters)
    assert level == logging.INFO  # torch's, left as it is
    seen: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = _Keep(logging.DEBUG)
    fsdp.addHandler(handler)
    try:
        with compat.upstream_scheduler_scope():
            fsdp.info("summary from this thread")
            fsdp.warning("warning from this thread")
            other = threading.Thread(target=lambda: fsdp.info("summary from another thread"))
            other.start()
            other.join()
        fsdp.info("summary after the scope")
    finally:
        fsdp.removeHandler(handler)
    assert seen == ["warning from this thread", "summary from another thread", "summary after the scope"]
    assert (fsdp.level, fsdp.filters) == (level, filters)


@pytest.mark.slow
def test_an_hsdp_demo_report_names_its_groups_by_mesh_dimension() -> None:
    from tests.support.traces import traced_hsdp_step

    step = traced_hsdp_step(2)  # shared with the other HSDP report test in this process (read-only)
    report = overlapcfg.explain(step, {"plan": "llama_layers"}, hardware="h100_nvlink")
    assert {dim for dim, _ in report.mesh} == {"dp_replicate", "dp_shard"}
    text = _text(report, 100)
    for dim, group in report.mesh:
        assert f"{dim} (group {group})" in text
    sim = report.simulation
    assert sim is not None and report.baseline is not None
    busiest = max(s.busy_seconds for s in sim.streams if s.stream.startswith("comm:"))
    assert sim.comm_seconds > busiest and sim.lower_bound_seconds >= busiest
