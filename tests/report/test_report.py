"""``explain`` on the 2-layer demo: bucket contents and bytes checked against the model's own parameters,
collective counts, warnings, the compact order, JSON round-trip and the rich table."""

from __future__ import annotations

import json

import pytest
from rich.console import Console
from torch import fx

from overlapcfg.demo import Llama, LlamaConfig
from overlapcfg.graph.record import BucketRecord, CollectiveChange
from overlapcfg.report import SCHEMA, Report, explain
from overlapcfg.report.explain import _warnings
from overlapcfg.report.render import report_table

pytestmark = pytest.mark.slow

DEFAULT = {"plan": "llama_layers"}


@pytest.fixture(scope="module")
def report(traced_2l_reshard) -> Report:
    return explain(traced_2l_reshard, DEFAULT, hardware="h100_nvlink")


def _model_params() -> dict[str, int]:
    """Parameter FQN -> numel, from a fresh unsharded model (independent of tracing and the pass)."""
    return {name: p.numel() for name, p in Llama(LlamaConfig(n_layers=2)).named_parameters()}


def test_bucket_contents_and_bytes_match_the_models_parameters(report):
    params = _model_params()
    owners = {"tok_embeddings": ("tok_embeddings.",), "layers.0": ("layers.0.",), "layers.1": ("layers.1.",),
              "norm+output": ("norm.", "output.")}
    assert [b.name for b in report.buckets] == list(owners)
    for bucket in report.buckets:
        mine = [p for p in params if p.startswith(owners[bucket.name])]
        assert list(bucket.params) == mine
        assert bucket.param_count == len(mine)
        assert bucket.numel == sum(params[p] for p in mine)
        assert bucket.unsharded_bytes == sum(params[p] * 4 for p in mine)  # fp32
        assert bucket.sharded_bytes == bucket.unsharded_bytes // 2  # traced at world size 2
    layer = report.bucket("layers.0")
    assert layer.param_count == 9 and layer.unsharded_bytes == 4 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64)


def test_collectives_merge_to_one_per_bucket_direction_and_kind(report):
    counts = {b.name: {(c.direction, c.kind): (c.before, c.after) for c in b.collectives} for b in report.buckets}
    assert counts["layers.0"] == {("forward", "all_gather"): (9, 1), ("backward", "all_gather"): (9, 1),
                                  ("backward", "reduce_scatter"): (9, 1)}
    # An embedding's backward does not read its weight: no backward all-gather (reshard-after-forward or not).
    assert counts["tok_embeddings"] == {("forward", "all_gather"): (1, 1), ("backward", "reduce_scatter"): (1, 1)}
    assert counts["norm+output"][("forward", "all_gather")] == (2, 1)
    n_params = len(_model_params())
    fw, bw = report.graph("forward"), report.graph("backward")
    assert (fw.collectives_before, fw.collectives_after) == (n_params, 4)
    assert (bw.collectives_before, bw.collectives_after) == (2 * n_params - 1, 7)
    assert fw.uncovered == () and fw.non_fsdp == ()


def test_bucket_reports_its_source_entry_and_depth_decisions(report):
    layer = report.bucket("layers.1")
    assert (layer.entry_index, layer.entry_text) == (1, "layers.*")
    assert report.bucket("norm+output").entry_text == "[norm, output]"
    last = next(d for d in report.bucket("norm+output").decisions if d.direction == "forward")
    assert (last.requested, last.effective, last.reason) == (1, 0, "end of graph")


def test_compact_order_shows_prefetch_of_the_next_bucket(report):
    order = report.graph("forward").order
    assert order.startswith("AG[tok_embeddings] AG[layers.0] W[tok_embeddings] AG[layers.1] W[layers.0] C×")
    assert "RS[layers.1]" in report.graph("backward").order


def test_byte_cap_reason_and_always_binding_warning(traced_2l_reshard):
    cfg = {"plan": "llama_layers", "policy": {"forward_prefetch": 2, "backward_prefetch": 2,
                                              "max_inflight_bytes": 200_000}}
    report = explain(traced_2l_reshard, cfg)
    reasons = [d.reason for b in report.buckets for d in b.decisions if d.kind == "all_gather"]
    assert any(r and "max_inflight_bytes=200000" in r for r in reasons)
    assert any("max_inflight_bytes binds at every forward all-gather" in w for w in report.warnings)


def test_spanning_warning_fires_above_two_layers_and_not_at_two(traced_2l_reshard):
    cfg = {"plan": {"buckets": [["tok_embeddings", "layers.*", "norm", "output"]]}}
    report = explain(traced_2l_reshard, cfg)
    assert len(report.buckets) == 1 and report.buckets[0].param_count == len(_model_params())
    assert not any("spans" in w for w in report.warnings)  # two layers: within the threshold
    wide = BucketRecord(name="all", entry_index=0, entry_text="['*']", modules=("layers.0", "layers.1", "layers.2"),
                        params=(), param_count=0, numel=0, unsharded_bytes=0, sharded_bytes=0,
                        collectives=(CollectiveChange(direction="forward", kind="all_gather", before=0, after=0,
                                                      unsharded_bytes=0),),
                        forward_prefetch=1, backward_prefetch=1, reduce_scatter_delay=1)
    warnings = _warnings([wide], {})
    assert any("spans 3 layers" in w for w in warnings)
    assert any("has no FSDP collectives" in w for w in warnings)


def test_uncovered_collectives_are_listed_with_their_owners(traced_2l_reshard):
    report = explain(traced_2l_reshard, {"plan": {"buckets": ["layers.*"]}})
    owners = [u.owner for u in report.graph("forward").uncovered]
    assert owners == ["tok_embeddings", "norm", "output"]
    assert any("3 FSDP collectives unbucketed, outside every bucket (owners: tok_embeddings, norm, output)" in w
               for w in report.warnings)


def test_json_round_trip_is_lossless_and_versioned(report):
    text = report.to_json()
    data = json.loads(text)
    assert data["schema"] == SCHEMA == "overlapcfg.report/5"
    assert "forward" not in data and data["simulation"]["hardware"] == "h100_nvlink"
    again = Report.from_json(text)
    assert again == report and again.to_json() == text
    assert again.forward is None and isinstance(report.forward, fx.GraphModule)
    with pytest.raises(ValueError, match="schema"):
        Report.from_json({**data, "schema": "overlapcfg.report/0"})


def test_explain_accepts_a_graph_module_that_already_went_through_apply(report):
    bare = explain(report.forward, DEFAULT)
    assert [g.name for g in bare.graphs] == ["forward"]
    assert [b.name for b in bare.buckets] == [b.name for b in report.buckets]
    assert bare.graph("forward").order == report.graph("forward").order
    with pytest.raises(TypeError, match="names its group size"):
        explain(fx.symbolic_trace(lambda x: x + 1), DEFAULT)


def test_explain_applies_the_config_to_a_copy_of_an_untransformed_graph(report, traced_2l_reshard):
    """Issue: explain(gm, cfg) on a graph apply had not seen raised 'run overlapcfg.apply on it first'."""
    original = traced_2l_reshard.forward
    code = original.code
    bare = explain(original, DEFAULT, graph_kind="forward")
    assert original.code == code and "overlapcfg" not in original.meta
    assert [b.name for b in bare.buckets] == [b.name for b in report.buckets]
    assert bare.graph("forward").collectives_after < bare.graph("forward").collectives_before


def test_a_bare_graph_is_predicted_at_its_traced_group_size(report):
    """No TracedStep to ask: the group size comes from the graph's collectives, so communication is not 0."""
    bare = explain(report.forward, DEFAULT, hardware="h100_nvlink")
    full = explain(report.forward, DEFAULT, hardware="h100_nvlink", world_size=2)
    assert bare.simulation is not None and bare.simulation.world_size == 2
    assert bare.simulation.comm_seconds > 0
    assert bare.simulation.comm_seconds == full.simulation.comm_seconds


def test_table_renders_buckets_order_and_prediction(report):
    console = Console(width=220, record=True)
    console.print(report_table(report))
    text = console.export_text()
    for needle in ("layers.0", "[2] [norm, output]", "fw AG", "9→1 d1", "forward order: AG[tok_embeddings]",
                   "Prediction: h100_nvlink", "lower bound", "legend: AG all-gather"):
        assert needle in text


def test_table_reads_at_100_columns_with_clamps_explained_and_step_time_before_after(report, traced_2l_reshard):
    """Issue 11: rows wrapping over five lines at 100 columns, an empty why for end-of-graph clamps, and no way
    to see what the pass bought."""
    baseline = explain(traced_2l_reshard, {"strategy": "none"}, hardware="h100_nvlink").simulation
    console = Console(width=100, record=True)
    console.print(report_table(report, baseline=baseline))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 100
    clamped = next(line for line in text.splitlines() if line.startswith("norm+output"))
    assert "d1→0" in clamped and "fw AG: end of graph" in clamped
    step = next(line for line in text.splitlines() if "step time" in line)
    assert "before (no pass)" in text and step.count(" ms") + step.count(" µs") == 2 and "%)" in step
    assert baseline.step_seconds > report.simulation.step_seconds
