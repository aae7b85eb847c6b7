"""``overlapcfg.measure``: real steps on two gloo ranks give complete, sane records next to the prediction; the
records round-trip through ``measure.json``; the interval arithmetic behind exposed communication.

No timing thresholds: timings on a shared machine say nothing reliable about speed, only that the machinery
measured what it claims (every field filled, every collective matched, every rank agreeing).
"""

from __future__ import annotations

from typing import Any

import pytest

import overlapcfg
from overlapcfg.cost.node_costs import NodeCosts
from overlapcfg.measuring.measure_result import Measurement
from overlapcfg.measuring.measured_trace import uncovered_seconds
from tests.support.rank_warmup import preloaded
from tests.support.traces import traced_step

CONFIGS: dict[str, dict[str, Any]] = {
    "none": {"strategy": "none"},
    "d1": {"plan": "llama_layers", "policy": {"forward_prefetch": 1, "backward_prefetch": 1,
                                              "reduce_scatter_delay": 1}},
    "split_d2": {"plan": "per_block_split", "policy": {"forward_prefetch": 2, "backward_prefetch": 2,
                                                       "reduce_scatter_delay": 2}},
}
STEPS = 3


def test_uncovered_seconds_is_the_union_outside_the_cover() -> None:
    assert uncovered_seconds([(0, 4), (2, 6)], [(1, 2), (5, 10)]) == pytest.approx(4.0)  # [0,1) + [2,5)
    assert uncovered_seconds([(0, 1)], []) == 1.0
    assert uncovered_seconds([(0, 1)], [(-1, 2)]) == 0.0


def test_unreadable_node_costs_are_a_fault_at_tune_node_costs(tmp_path) -> None:
    from overlapcfg.demo.tune_job import _node_costs
    from overlapcfg.errors import OverlapConfigError

    (tmp_path / "costs.json").write_text('{"schema": "something else"}')
    with pytest.raises(OverlapConfigError, match=r"tune\.node_costs: node costs file '.*missing.json' does not exist"):
        _node_costs(str(tmp_path / "missing.json"))
    with pytest.raises(OverlapConfigError, match=r"invalid node costs in '.*costs.json' \(tune\.node_costs\)"):
        _node_costs(str(tmp_path / "costs.json"))
    assert _node_costs(None) is None


def _measure_worker(rank: int, world_size: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Every config interleaved, with node costs; then two configs one at a time, without, on a one-layer model (one
    pair of ranks for both: starting and warming ranks costs as much as a measurement)."""
    from overlapcfg.demo.measure_job import demo_step
    from overlapcfg.demo.settings import demo_settings

    make_step = demo_step(demo_settings({"model": {"n_layers": 2}, "batch": 2, "seq_len": 16}))
    result = overlapcfg.measure(make_step, CONFIGS, hardware="cpu_gloo", warmup=1, steps=STEPS, profiled_steps=1)
    assert result.measured_node_costs is not None
    configs = {name: CONFIGS[name] for name in ("none", "d1")}
    # At one layer: the fields a run one config at a time fills do not depend on the depth, and each config
    # compiles the model again (dynamo's and aot's time grows with the layers).
    one_layer = demo_step(demo_settings({"model": {"n_layers": 1}, "batch": 2, "seq_len": 16}))
    one_at_a_time = overlapcfg.measure(one_layer, configs, hardware="cpu_gloo", warmup=1, steps=2, profiled_steps=1,
                                       interleave=False, node_costs=False)
    return result.to_dict(), result.measured_node_costs.to_dict(), one_at_a_time.to_dict()


@pytest.fixture(scope="module")
def ranks() -> list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    from overlapcfg.demo.gloo import run_on_gloo

    return run_on_gloo(_measure_worker, world_size=2, timeout_s=280, preload=preloaded(__name__))


@pytest.fixture(scope="module")
def measured(ranks: list[tuple[dict[str, Any], ...]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Per rank: the interleaved measurement and its node costs."""
    return [(data, costs) for data, costs, _ in ranks]


@pytest.mark.slow
def test_every_rank_returns_the_same_measurement(measured) -> None:
    (first, first_costs), (second, second_costs) = measured
    assert first == second and first_costs == second_costs


@pytest.mark.slow
def test_each_config_has_a_complete_sane_record(measured) -> None:
    data, _ = measured[0]
    m = Measurement.from_json(data)
    assert [c.name for c in m.configs] == list(CONFIGS)
    assert (m.world_size, m.backend, m.steps, m.profiled_steps) == (2, "gloo", STEPS, 1)
    assert m.hardware.name == "cpu_gloo" and m.node_costs is not None and m.node_costs.startswith("none on gloo")
    # the eager loss between the graphs: measured, and less than a whole step
    assert m.between_graphs_s is not None and 0 < m.between_graphs_s < m.config("none").measured_wall_s
    for c in m.configs:
        assert c.overrides == CONFIGS[c.name]
        assert len(c.step_seconds) == STEPS and all(s > 0 for s in c.step_seconds), c.name
        assert c.measured_step_s == sorted(c.step_seconds)[STEPS // 2]
        assert c.measured_spread_s >= 0 and c.measured_wall_s >= c.measured_step_s, c.name
        # on a CPU the exposed communication is the timed steps' own waits (no profiler on), a part of them
        assert c.measured_exposed_in == "timed steps", c.name
        assert 0 <= c.measured_exposed_s <= max(c.step_seconds), c.name
        assert len(c.measured_exposed_by_rank_s) == 2 and min(c.measured_exposed_by_rank_s) >= 0, c.name
        # the profiler's figure is kept beside it, a part of the profiled step it was measured in
        assert c.measured_profiled_exposed_s is not None, c.name
        assert 0 <= c.measured_profiled_exposed_s <= c.measured_profiled_step_s, c.name
        assert c.predicted_step_s > 0 and 0 <= c.predicted_exposed_s <= c.predicted_step_s
        assert c.predicted_profiled_step_s is not None and c.predicted_profiled_step_s > 0
        # cpu_gloo carries achievable kernel rates (docs/cost-model.md): the model's label for them
        assert {s.source for s in c.cost_sources if s.part == "compute"} == {"achievable"}
        assert "measured" in {s.source for s in c.profiled_cost_sources if s.part == "compute"}
        assert c.collectives and all(k.measured_s is not None and k.measured_s > 0 for k in c.collectives), (
            c.name, [k.node for k in c.collectives if not k.measured_s])
        assert all(k.predicted_s > 0 and k.bytes > 0 for k in c.collectives)
    by_name = {c.name: c for c in m.configs}
    assert len(by_name["d1"].collectives) < len(by_name["none"].collectives)  # the pass merged them
    for key in ("predicted_step_s", "measured_step_s", "predicted_profiled_step_s"):
        assert sorted(m.ranking(key)) == sorted(CONFIGS)
    assert data["summary"]["median_abs_error"] == m.median_abs_error()


@pytest.mark.slow
@pytest.mark.slow
def test_the_unbucketed_step_waits_in_its_timed_steps(measured) -> None:
    """Every collective of ``none`` is waited for right after it is issued, on gloo's thread: its timed steps block
    on each (0 here would mean the timed copies of the graphs did not run)."""
    m = Measurement.from_json(measured[0][0])
    assert m.config("none").measured_exposed_s > 0 and min(m.config("none").measured_exposed_by_rank_s) > 0


def test_the_measurement_round_trips_through_json(measured) -> None:
    data, costs = measured[0]
    m = Measurement.from_json(data)
    assert Measurement.from_json(m.to_json()) == m
    node_costs = NodeCosts.from_json(costs)
    assert set(node_costs.graphs) == {"forward", "backward"} and len(node_costs) > 20
    assert NodeCosts.from_json(node_costs.to_json()) == node_costs


@pytest.mark.slow
def test_measured_node_costs_price_the_untransformed_step(measured) -> None:
    """The node costs of the ``none`` config, measured on real ranks, match the demo step traced in one process
    under the fake group node for node (same graph, same names, same shapes): the simulator prices every kernel
    by them, none by the roofline."""
    node_costs = NodeCosts.from_json(measured[0][1])
    step = traced_step(2, reshard_after_forward=True)  # the suite's shared trace of the same step (read-only)
    sim = overlapcfg.explain(step, {"strategy": "none"}, hardware="cpu_gloo", node_costs=node_costs).simulation
    assert sim is not None
    compute = {s.source: s for s in sim.cost_sources if s.part == "compute"}
    assert set(compute) == {"measured"} and compute["measured"].nodes > 100  # every kernel: the same graph


@pytest.mark.slow
def test_one_config_at_a_time_gives_the_same_records(ranks: list[tuple[dict[str, Any], ...]]) -> None:
    """``interleave=False`` (one model in memory at a time) fills the same fields; no node costs when asked not to."""
    first, second = (one_at_a_time for _, _, one_at_a_time in ranks)
    assert first == second
    m = Measurement.from_json(first)
    assert [c.name for c in m.configs] == ["none", "d1"] and m.node_costs is None
    for c in m.configs:
        assert len(c.step_seconds) == 2 and c.measured_step_s > 0 and c.predicted_profiled_step_s is None
        assert c.collectives and all(k.measured_s is not None for k in c.collectives)
