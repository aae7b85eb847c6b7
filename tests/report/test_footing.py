"""Profile-guided costs on one footing: the nodes a measurement lacks are priced by the roofline scaled to the
measured nodes of their kind; measured durations are put on the timed steps' clock; both survive ``node_costs.json``.

Fast tier: synthetic steps and made-up durations.
"""

from __future__ import annotations

import random

import pytest

import overlapcfg
from overlapcfg.cost.node_costs import MEASURABLE_KINDS, NodeCosts, fit_footing, node_signature
from overlapcfg.cost.price import node_kind
from overlapcfg.cost.pricer import node_seconds, priced_plan
from overlapcfg.cost.pricing import Pricing
from overlapcfg.measuring.measure_run import _RankResult, on_timed_clock
from overlapcfg.report.compare import compare
from tests.support.synthetic import captured_step

LAYERS = [[2, 1], [1], [3, 2], [1, 1]]


def test_the_footing_scale_is_the_measured_rate_against_the_roofline_per_kind() -> None:
    rng = random.Random(0)
    pairs = [("memory", r, 3.0 * r * (1 + rng.uniform(-0.01, 0.01))) for r in (1e-6, 5e-6, 2e-5, 1e-4)]
    pairs += [("compute", r, 1.5 * r) for r in (1e-5, 1e-4, 1e-3)]
    pairs += [("free", 0.0, 2e-6)] * 5 + [("memory", 1e-6, 0.0)]  # views have no roofline; a zero is dropped
    footing = fit_footing(pairs)
    assert set(footing.scales) == {"memory", "compute", "all"}
    assert footing.scales["memory"] == pytest.approx(3.0, rel=0.02)
    assert footing.scales["compute"] == pytest.approx(1.5)
    assert footing.price("free", 0.0) == 0.0 and footing.price("memory", 2.0) == pytest.approx(6.0, rel=0.02)
    assert fit_footing(pairs[:2]).scales == {}  # too few: the bare roofline
    only_compute = fit_footing(pairs[4:7])
    assert only_compute.price("memory", 2.0) == pytest.approx(3.0)  # no memory kernel measured: the pooled scale


def _measured(step, hw: str, scale: float) -> NodeCosts:
    """Every node of the untransformed step measured at ``scale`` times its model price on ``hw`` (the kernel model
    as the simulator prices an unmeasured node of that step: eager views, chains by their bytes)."""
    hardware = overlapcfg.load_hardware(hw)
    names = ("forward", "backward")
    graphs = [step.graph(name) for name in names]
    plan, _ = priced_plan(graphs, names, hardware, Pricing(), world_size=2, traced_world_size=2, as_dtype=None)
    costs = {name: {n.name: (node_signature(n), scale * node_seconds(n, name, hardware, None, world_size=2,
                                                                     traced_world_size=2, as_dtype=None, plan=plan,
                                                                     graph_index=gi).seconds)
                    for n in graphs[gi].graph.nodes if n.op == "call_function" and node_kind(n) in MEASURABLE_KINDS}
             for gi, name in enumerate(names)}
    return NodeCosts(source="made up", graphs=costs)


def test_nodes_the_pass_creates_are_priced_on_the_measurements_footing() -> None:
    """A machine 4x slower than the profile's roofline, every traced node measured: a merged config's copies
    (unmeasured) are priced 4x their roofline too, so the prediction is what the roofline predicts, 4x over."""
    step = captured_step(LAYERS)
    cfg = {"plan": {"buckets": ["layers.*"]}, "policy": {"forward_prefetch": 0, "backward_prefetch": 0,
                                                          "reduce_scatter_delay": 0}}
    hw = overlapcfg.HardwareProfile.model_validate({**overlapcfg.load_hardware("cpu_gloo").model_dump(),
                                                    "name": "slow", "intra_node_bandwidth": 1e15,
                                                    "latency": 1e-9})  # communication ~ free: compute is the step
    plain = compare(step, [cfg], hardware=hw, world_size=2).rows[0].simulation
    costs = _measured(step, "cpu_gloo", 4.0)
    guided = compare(step, [cfg], hardware=hw, world_size=2, node_costs=costs).rows[0].simulation
    assert guided.compute_seconds == pytest.approx(4.0 * plain.compute_seconds, rel=1e-6)
    sources = {(s.part, s.source) for s in guided.cost_sources}
    assert ("compute", "achievable") in sources and ("compute", "measured") in sources  # the copies: unmeasured
    assert guided.node_costs is not None and "unmeasured nodes on its footing: compute x4 roofline; all x4 " \
        "roofline" in guided.node_costs


def _rank(graph_s: float, profiled_s: float, exposed_s: float) -> _RankResult:
    return _RankResult((graph_s,) * 3, (graph_s * 1.2,) * 3, (0.0,) * 3, (exposed_s,) * 2, (profiled_s,) * 2,
                       ({}, {}), {}, None)


def test_node_durations_are_put_on_the_timed_steps_clock_and_round_trip() -> None:
    """Timed steps took 100 ms, of which the profiled steps spent 20 % waiting: 80 ms of compute. The nodes were
    timed at 40 ms in all (a quieter moment): each is doubled."""
    costs = NodeCosts(source="m", graphs={"forward": {"a": ("sig-a", 0.03)}, "backward": {"b": ("sig-b", 0.01)}})
    scaled = on_timed_clock(costs, [_rank(0.1, 0.125, 0.025), _rank(0.09, 0.12, 0.025)])  # the slowest rank
    assert scaled.clock_scale == pytest.approx(2.0)
    assert scaled.graphs["forward"]["a"][1] == pytest.approx(0.06)
    again = NodeCosts.from_json(scaled.to_json())
    assert again == scaled
    legacy = {k: v for k, v in costs.to_dict().items() if k != "clock_scale"}  # written before the field
    assert NodeCosts.from_json(legacy).clock_scale == 1.0
    waiting = on_timed_clock(costs, [_rank(0.1, 0.1, 0.1)])  # nothing left for compute: not scaled
    assert waiting is costs
