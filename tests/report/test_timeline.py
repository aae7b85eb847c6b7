"""``compare`` and its timeline files: one row per config, a Chrome trace that parses, a PNG that is a PNG."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from overlapcfg.report import compare
from overlapcfg.report.render import comparison_table
from overlapcfg.report.timeline import write_timeline

pytestmark = pytest.mark.slow

CONFIGS = [
    {"strategy": "none"},
    {"strategy": "torch_manual", "plan": "llama_layers"},
    {"plan": "llama_layers"},
    {"plan": "llama_layers", "policy": {"forward_prefetch": 2, "backward_prefetch": 2}},
]


@pytest.fixture(scope="module")
def comparison(traced_2l_reshard):
    return compare(traced_2l_reshard, CONFIGS, hardware="a100_ib", world_size=8)


def test_comparison_has_one_row_per_config_with_baselines(comparison):
    assert [r.name for r in comparison.rows] == ["none", "torch_manual", "manual fp1 bp1 rs1", "manual fp2 bp2 rs1"]
    none, torch_manual, manual = comparison.rows[:3]
    assert none.collectives == 62 and manual.collectives == torch_manual.collectives == 11
    assert none.simulation.exposed_comm_seconds >= manual.simulation.exposed_comm_seconds
    assert all(r.simulation.world_size == 8 and r.pass_seconds > 0 for r in comparison.rows)
    data = json.loads(comparison.to_json())
    assert data["schema"] == "overlapcfg.compare/1" and len(data["rows"]) == 4
    assert data["rows"][1]["simulation"]["step_seconds"] == torch_manual.simulation.step_seconds


def test_comparison_table_lists_every_config(comparison):
    console = Console(width=220, record=True)
    console.print(comparison_table(comparison))
    text = console.export_text()
    assert all(r.name in text for r in comparison.rows) and "exposed" in text and "…" not in text


def test_names_must_match_configs(traced_2l_reshard):
    with pytest.raises(TypeError, match="2 names for 1 configs"):
        compare(traced_2l_reshard, CONFIGS[:1], hardware="a100_ib", names=["a", "b"])


def test_timeline_files_are_a_valid_chrome_trace_and_png(comparison, tmp_path):
    trace_path, png_path = write_timeline(comparison, tmp_path)
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png_path.stat().st_size > 10_000
    trace = json.loads(trace_path.read_text())
    events = trace["traceEvents"]
    processes = [e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    assert processes == [r.name for r in comparison.rows]
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(1, "compute"), (1, "comm: dp_shard (group 0)")} <= threads  # named by mesh dimension
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert {"all_gather", "reduce_scatter", "wait"} <= {e["cat"] for e in spans}
    assert any(e["name"] == "AG[layers.0]" for e in spans)
    # the forward/backward boundary: one marker per run, where the backward graph's first event starts
    markers = [e for e in events if e["ph"] == "i" and e["name"] == "backward starts"]
    assert len(markers) == len(comparison.rows)
    first = {e["pid"]: min(s["ts"] for s in spans if s["pid"] == e["pid"] and s["args"]["graph"] == "backward")
             for e in markers}
    assert all(e["ts"] == first[e["pid"]] > 0 for e in markers)


def test_the_default_demo_size_makes_prefetch_depths_differ(tmp_path):
    """Issue 11: the default demo was all stall, so depths 1-3 predicted (and drew) the same step. The command's
    own defaults (vocabulary, batch, sequence; 2 layers here to keep it quick), its default hardware and its
    default compare rows must tell depth 1 from depth 2."""
    from hydra import compose, initialize_config_dir

    from overlapcfg.config.presets import command_conf_dir
    from overlapcfg.demo.job import compare_configs, demo_spec, hardware_of, traced

    with initialize_config_dir(str(command_conf_dir()), version_base="1.3"):
        cfg = compose("overlapcfg", overrides=["model.n_layers=2", "mode=compare"])
    names, configs = compare_configs(cfg)
    rows = {r.name: r.simulation for r in compare(traced(demo_spec(cfg)), configs, hardware=hardware_of(cfg),
                                                  names=names).rows}
    assert rows["none"].step_seconds > rows["manual_d1"].step_seconds > rows["manual_d2"].step_seconds
    assert rows["manual_d1"].exposed_comm_seconds > 1.05 * rows["manual_d2"].exposed_comm_seconds
