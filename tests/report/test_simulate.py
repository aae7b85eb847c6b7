"""The cost model and replay: bounds, monotonicity in bandwidth, no-collective graphs, depth 0, alpha-beta sizes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from overlapcfg.cost import HardwareProfile, load_hardware, simulate
from overlapcfg.cost.hardware import hardware_names
from overlapcfg.cost.price import collective_cost
from overlapcfg.errors import OverlapConfigError
from overlapcfg.report import explain
from tests.support.releases import upstream_is_the_reference

pytestmark = pytest.mark.slow

# Slow compute and a lean network so the 2-layer demo's compute and communication are of one order.
BALANCED = HardwareProfile(
    name="balanced", peak_flops={"bf16": 2e10, "fp32": 1e10}, mem_bandwidth=1e11, intra_node_bandwidth=1e9,
    inter_node_bandwidth=2.5e8, latency=1e-9, gpus_per_node=8,
)
POLICIES = {
    "fp0": {"forward_prefetch": 0, "backward_prefetch": 0, "reduce_scatter_delay": 0},
    "fp1": {},
    "fp2": {"forward_prefetch": 2, "backward_prefetch": 2},
}


def _cfg(policy: str = "fp1", strategy: str = "manual") -> dict:
    if strategy == "none":
        return {"strategy": "none"}
    return {"strategy": strategy, "plan": "llama_layers", "policy": POLICIES[policy]}


@pytest.fixture(scope="module")
def reports(traced_2l_reshard):
    out = {p: explain(traced_2l_reshard, _cfg(p)) for p in POLICIES}
    out["none"] = explain(traced_2l_reshard, _cfg(strategy="none"))
    out["torch_manual"] = explain(traced_2l_reshard, _cfg(strategy="torch_manual"))
    return out


def _graphs(report):
    return [report.forward, report.backward]


@pytest.mark.parametrize("world_size", [2, 8, 64])
@pytest.mark.parametrize("hardware", ["h100_nvlink", "a100_ib", "cpu_gloo", BALANCED])
def test_prediction_is_never_below_the_lower_bound(reports, hardware, world_size):
    for name, report in reports.items():
        sim = simulate(_graphs(report), hardware, world_size=world_size)
        assert sim.step_seconds >= sim.lower_bound_seconds * (1 - 1e-9), name
        assert sim.lower_bound_seconds == max(sim.compute_seconds, sim.comm_seconds)  # one process group
        # docs/cost-model.md: step = compute + contention + exposed (the GPU profiles slow compute under a
        # collective in flight; skew shows as exposed time)
        assert sim.step_seconds == pytest.approx(
            sim.compute_seconds + sim.contention_seconds + sim.exposed_comm_seconds, rel=1e-9)


def _scaled(hw: HardwareProfile, factor: float) -> HardwareProfile:
    """``hw`` with every link and every collective rate on it ``factor`` times as fast (a collective's achievable
    bandwidth may not exceed its physical link, so the two scale together)."""
    data = hw.model_dump()
    data["intra_node_bandwidth"] = hw.intra_node_bandwidth * factor
    data["inter_node_bandwidth"] = hw.inter_node_bandwidth * factor
    for link in (data.get("collectives") or {}).values():
        for fit in (link or {}).values():
            for name in ("bandwidth", "nvls_bandwidth"):
                if fit and fit.get(name) is not None:
                    fit[name] *= factor
    return hw.model_validate(data)


@settings(max_examples=15, deadline=None)
@given(low=st.floats(0.05, 20.0), ratio=st.floats(1.0, 50.0), policy=st.sampled_from(["fp0", "fp1", "fp2"]),
       world_size=st.sampled_from([8, 64]))
def test_more_bandwidth_never_increases_exposed_communication(reports, low, ratio, policy, world_size):
    graphs = _graphs(reports[policy])
    for base in (BALANCED, load_hardware("h100_nvlink")):
        slow = simulate(graphs, _scaled(base, low), world_size=world_size)
        fast = simulate(graphs, _scaled(base, low * ratio), world_size=world_size)
        assert fast.exposed_comm_seconds <= slow.exposed_comm_seconds + 1e-12
        assert fast.step_seconds <= slow.step_seconds + 1e-12


def test_graph_without_collectives_predicts_no_exposed_communication():
    def mlp(x, w1, w2):
        return torch.relu(x @ w1) @ w2

    gm = make_fx(mlp, tracing_mode="fake")(torch.randn(64, 128), torch.randn(128, 256), torch.randn(256, 128))
    sim = simulate(gm, BALANCED, world_size=8)
    assert sim.exposed_comm_seconds == 0.0
    assert sim.comm_seconds == 0.0 and sim.overlap_ratio is None
    flops = 2 * 64 * 128 * 256 * 2
    assert sim.compute_seconds >= flops / BALANCED.peak_flops.fp32
    assert sim.step_seconds == pytest.approx(sim.compute_seconds) == pytest.approx(sim.lower_bound_seconds)


def test_depth_zero_exposes_every_forward_all_gather(reports):
    sim = simulate(reports["fp0"].forward, BALANCED, world_size=8, names=["forward"])
    gathers = [e for e in sim.events if e.kind == "all_gather"]
    stalls = {e.node: e for e in sim.events if e.kind == "wait"}
    assert len(gathers) == 4 and len(stalls) == 4
    assert sim.exposed_comm_seconds == pytest.approx(sim.comm_seconds)
    assert sim.overlap_ratio == pytest.approx(0.0, abs=1e-9)


def test_prefetching_hides_communication_that_depth_zero_exposes(reports):
    exposed = {p: simulate(_graphs(reports[p]), BALANCED, world_size=8).exposed_comm_seconds for p in POLICIES}
    none = simulate(_graphs(reports["none"]), BALANCED, world_size=8)
    assert exposed["fp1"] < exposed["fp0"] <= none.exposed_comm_seconds
    assert none.overlap_ratio == pytest.approx(0.0, abs=1e-9)


@upstream_is_the_reference
def test_torch_manual_and_manual_at_depth_one_predict_the_same_step(reports):
    a = simulate(_graphs(reports["fp1"]), BALANCED, world_size=8)
    b = simulate(_graphs(reports["torch_manual"]), BALANCED, world_size=8)
    assert a.step_seconds == pytest.approx(b.step_seconds)


def test_peak_inflight_bytes_matches_the_schedulers_record(reports):
    for policy in ("fp1", "fp2"):
        gm = reports[policy].forward
        steps = [s for s in gm.meta["overlapcfg"].decisions if s.kind == "all_gather"]
        sim = simulate(gm, BALANCED, world_size=8)
        assert sim.peak_inflight_bytes == max(s.inflight_bytes for s in steps)


def test_collective_time_is_the_ring_alpha_beta_model_at_the_requested_world_size(reports):
    hw = load_hardware("h100_nvlink")
    nbytes = reports["fp1"].bucket("layers.0").unsharded_bytes
    # docs/cost-model.md, with the profile's achievable all-gather rates (conf/hardware/h100_nvlink.yaml):
    # (p - 1) x latency + (p - 1)/p x bytes / bus bandwidth. Inside a node: NVLink's 370 GB/s, 2 us a ring step.
    # Across nodes: 47 GB/s a NIC x 8 NICs a node = 376 GB/s, capped at the 370 GB/s NVLink its data also
    # crosses, 18 us a ring step. The profile's compute slowdown leaves a collective's own time alone.
    for world_size, bw, latency in ((8, 370e9, 2e-6), (64, min(8 * 47e9, 370e9), 18e-6)):
        sim = simulate(reports["fp1"].forward, hw, world_size=world_size)
        event = next(e for e in sim.events if e.kind == "all_gather" and e.nbytes == nbytes)
        expected = (world_size - 1) / world_size * nbytes / bw + (world_size - 1) * latency
        assert event.end - event.start == pytest.approx(expected)
    assert collective_cost("all_gather", nbytes, hw, 1).seconds == 0.0


def test_bf16_costing_halves_collective_bytes(reports):
    fp32 = simulate(reports["fp1"].forward, BALANCED, world_size=8)
    bf16 = simulate(reports["fp1"].forward, BALANCED, world_size=8, as_dtype=torch.bfloat16)
    assert bf16.peak_inflight_bytes * 2 == fp32.peak_inflight_bytes
    assert bf16.comm_seconds == pytest.approx(fp32.comm_seconds / 2, rel=1e-3)  # all bandwidth: 1 ns latency


def test_shipped_profiles_carry_the_cited_numbers():
    assert set(hardware_names()) >= {"h100_nvlink", "a100_ib", "cpu_gloo"}
    h100, a100 = load_hardware("h100_nvlink"), load_hardware("a100_ib")
    assert (h100.peak_flops.bf16, h100.mem_bandwidth, h100.intra_node_bandwidth) == (989e12, 3.35e12, 450e9)
    assert h100.inter_node_bandwidth == 400e9 / 8  # 400 Gb/s per direction
    assert (a100.peak_flops.bf16, a100.intra_node_bandwidth, a100.inter_node_bandwidth) == (312e12, 300e9, 25e9)
    assert (h100.peak_flops.fp32, a100.peak_flops.fp32, a100.mem_bandwidth) == (67e12, 19.5e12, 2.0e12)
    assert (h100.gpus_per_node, a100.gpus_per_node) == (8, 8)
    # Per ring step, from ~10-20 us for a small all-gather over 8 GPUs (7 steps): a few microseconds.
    assert 1e-6 <= h100.latency <= 3e-6 and 1e-6 <= a100.latency <= 3e-6


def test_unknown_hardware_lists_profiles_closest_first():
    with pytest.raises(OverlapConfigError) as err:
        load_hardware("h100")
    message = str(err.value)
    assert message.startswith("hardware: unknown hardware profile 'h100'")
    assert message.index("h100_nvlink") < message.index("a100_ib")
    assert message.index("h100_nvlink") < message.index("cpu_gloo")


def test_hardware_profile_rejects_unknown_fields_with_a_suggestion():
    with pytest.raises(ValueError, match=r"latencyy.*did you mean 'latency'"):
        HardwareProfile.model_validate({**BALANCED.model_dump(), "latencyy": 1.0})
