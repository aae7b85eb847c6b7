"""Every figure says which world size it is for. A step traced at 2 ranks and predicted at 64 printed "each of the
2 ranks keeps 1/2" right above "Prediction: h100_nvlink, world size 64" with nothing tying either number to the
trace; an HSDP trace of 4 ranks (2 replicas of 2 shards) said "each of the 4 ranks keeps 1/4" where each keeps 1/2.
Now the tables made at the trace's size say so, the prediction says its size and the trace's, and what a rank
keeps is read off the records."""

from __future__ import annotations

import pytest
from rich.console import Console

import overlapcfg
from overlapcfg.cost import Simulation
from overlapcfg.report import Report
from overlapcfg.report.render import comparison_table, report_table
from overlapcfg.report.sweep import sweep_table
from tests.support.synthetic import captured_step

LAYERS = [[2, 1], [1], [3, 2]]
PLAN = {"plan": {"name": "layers", "buckets": ["layers.*"]}}


def _text(renderable: object, width: int = 120) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return " ".join(console.export_text().split())  # titles and notes may wrap: read them as one line


def test_a_report_predicted_at_another_world_size_names_both() -> None:
    """README's walk-through: traced at 2 ranks, explained at 64."""
    report = overlapcfg.explain(captured_step(LAYERS), PLAN, hardware="h100_nvlink", world_size=64)
    text = _text(report_table(report))
    assert "overlapcfg: strategy manual, plan layers, traced at world size 2" in text
    assert "each of the 2 traced ranks keeps 1/2 of it" in text
    assert "graphs, traced at world size 2" in text
    assert "Prediction: h100_nvlink, world size 64 (traced at 2)" in text
    assert "each of the 2 ranks keeps" not in text  # the old note, with no size it was for


def test_a_report_predicted_at_its_own_world_size_says_it_once() -> None:
    report = overlapcfg.explain(captured_step(LAYERS, world_size=4), PLAN, hardware="h100_nvlink")
    text = _text(report_table(report))
    assert "Prediction: h100_nvlink, world size 4 " in f"{text} " and "(traced at" not in text
    assert "each of the 4 traced ranks keeps 1/4 of it" in text


def test_the_comparison_says_the_size_it_predicts_and_the_trace_s() -> None:
    comparison = overlapcfg.compare(captured_step(LAYERS), [PLAN, {"strategy": "none"}], hardware="h100_nvlink",
                                    world_size=64)
    assert "compare: h100_nvlink, world size 64 (traced at 2)" in _text(comparison_table(comparison))


def _job(traced: int, predicted: int | None) -> Report:
    sim = None if predicted is None else Simulation(
        hardware="h100_nvlink", world_size=predicted, step_seconds=1e-3, compute_seconds=1e-3, comm_seconds=0.0,
        exposed_comm_seconds=0.0, overlap_ratio=None, lower_bound_seconds=1e-3, peak_inflight_bytes=0,
        peak_unsharded_param_bytes=0, peak_activation_bytes=None)
    return Report(strategy="manual", plan_name="p", config={}, world_size=traced, buckets=(), graphs=(),
                  simulation=sim)


def test_a_sweep_says_its_world_size_in_the_title_or_per_row() -> None:
    same = _text(sweep_table([(["a=1"], _job(2, 64)), (["a=2"], _job(2, 64))]))
    assert "sweep: 2 jobs, traced at world size 2, predicted at 64" in same
    mixed = _text(sweep_table([(["world_size=2"], _job(2, 2)), (["world_size=4"], _job(4, 64))]))
    assert "world_size=2 2 0" in mixed and "world_size=4 4→64 0" in mixed  # a world size column: 2, and 4→64
    assert "traced at world size" not in mixed


def test_tune_tables_say_the_size_they_were_searched_at() -> None:
    from overlapcfg.tuning.render_tune import tune_tables
    from tests.tuning.test_tune_report import _result

    text = _text(tune_tables(_result()))
    for title in ("Tuned for h100_nvlink at 2 ranks", "Top candidates within the budget (h100_nvlink, 2 ranks)",
                  "Pareto front: step time vs peak all-gathers in flight (h100_nvlink, 2 ranks)",
                  "Shipped presets on the same trace (h100_nvlink, 2 ranks)"):
        assert title in text, title


@pytest.mark.slow  # traces the demo on a 2 x 2 mesh
def test_an_hsdp_report_says_each_rank_keeps_its_shard_of_the_shard_group() -> None:
    from tests.support.traces import traced_hsdp_step

    step = traced_hsdp_step(2)  # shared with the other HSDP report test in this process (read-only)
    report = overlapcfg.explain(step, {"plan": "llama_layers"}, hardware="h100_nvlink")
    text = _text(report_table(report))
    assert "each rank keeps 1/2 of it, its shard of the 2-rank group that gathers it (traced at world size 4)" in text
    assert all(b.unsharded_bytes == 2 * b.sharded_bytes for b in report.buckets)
    assert "process groups, traced at world size 4" in text
