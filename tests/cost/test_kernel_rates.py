"""Achievable kernel rates, each term pinned on a hand computation: a GEMM's share of the peak at two shapes (waves,
tiles, the k pipeline, the sustained clock), attention interpolated between measured points, memory-bound kernels
fused against one kernel per op, and reductions at their own rate.

Fast tier: hand-built FX graphs with fake tensors, no tracing.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import fx

from overlapcfg.cost.achievable import AttentionPoint, AttentionRates, MatmulRate
from overlapcfg.cost.fusion import chain_nodes, fusion_plan
from overlapcfg.cost.hardware import hardware_from
from overlapcfg.cost.price import compute_seconds, matmul_shape
from tests.support.synthetic import with_fake_values

H100_LIKE = MatmulRate(efficiency=0.9, sustained=0.9, tile=(128, 256), units=132, half_k=700)

BASE = {"name": "hand", "peak_flops": {"bf16": 1e15, "fp32": 1e14}, "mem_bandwidth": 2e12,
        "intra_node_bandwidth": 4e11, "inter_node_bandwidth": 5e10, "latency": 1e-6, "gpus_per_node": 8}


def test_a_large_gemm_loses_only_its_waves_and_k_pipeline() -> None:
    # 8192 x 4096 x 4096: 64 x 16 = 1024 tiles of 128 x 256 on 132 SMs = 8 waves (1024 / 1056 busy), no partial
    # tile; k = 4096 against a half of 700: 4096 / 4796. Share = 0.9 x 0.9 x 1024/1056 x 4096/4796.
    expected = 0.81 * (1024 / 1056) * (4096 / 4796)
    assert expected == pytest.approx(0.670814, abs=1e-6)
    assert H100_LIKE.share(1, 8192, 4096, 4096) == pytest.approx(expected, rel=1e-12)


def test_a_skinny_gemm_runs_far_below_the_peak() -> None:
    # 1024 x 1024 x 64: 8 x 1 tiles = one wave on 8 of 132 SMs; each tile computes 64 of its 256 columns; k = 1024.
    expected = 0.81 * (8 / 132) * (1024 * 64 / (1024 * 256)) * (1024 / 1724)
    assert expected == pytest.approx(0.0072896, abs=1e-7)
    assert H100_LIKE.share(1, 1024, 1024, 64) == pytest.approx(expected, rel=1e-12)


def _graph(build) -> fx.GraphModule:  # type: ignore[no-untyped-def]
    graph = fx.Graph()
    inputs = build(graph)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    return with_fake_values(gm, inputs)


def test_a_matmul_node_is_priced_at_its_shapes_share_plus_a_launch() -> None:
    """``compute_seconds`` of an ``mm`` node: launch + FLOPs / (peak x share) (it is compute-bound)."""
    def build(g: fx.Graph):  # type: ignore[no-untyped-def]
        a, b = g.placeholder("a"), g.placeholder("b")
        g.output(g.call_function(torch.ops.aten.mm.default, (a, b)))
        return [(a, (8192, 4096)), (b, (4096, 4096))]

    gm = _graph(build)
    mm = next(n for n in gm.graph.nodes if n.op == "call_function")
    hw = hardware_from({**BASE, "achievable": {
        "matmul": {"bf16": H100_LIKE.model_dump() | {"launch_seconds": 2e-6},
                   "fp32": H100_LIKE.model_dump() | {"launch_seconds": 2e-6}},
        "memory": {"efficiency": 0.9}}})
    assert matmul_shape(mm) == (1, 8192, 4096, 4096)
    flops = 2 * 8192 * 4096 * 4096
    expected = 2e-6 + flops / (1e14 * 0.81 * (1024 / 1056) * (4096 / 4796))  # fp32 tensors: the fp32 peak
    cost = compute_seconds(mm, hw)
    assert cost.flops == flops and cost.bound == "compute"
    assert cost.seconds == pytest.approx(expected, rel=1e-12)


def test_attention_is_interpolated_in_log_sequence_length_at_the_nearest_head_dimension() -> None:
    rates = AttentionRates(backend="flash", backends={"flash": (
        AttentionPoint(seq_len=4096, head_dim=128, forward=0.30, backward=0.20, forward_causal=0.25),
        AttentionPoint(seq_len=8192, head_dim=128, forward=0.40, backward=0.30, forward_causal=0.35),
        AttentionPoint(seq_len=8192, head_dim=64, forward=0.10, backward=0.10))}, sustained=0.5)
    middle = round(math.sqrt(4096 * 8192))  # halfway in log length
    w = (math.log(middle) - math.log(4096)) / math.log(2)
    assert rates.share("flash", middle, 128, backward=False, causal=False) == pytest.approx(
        0.5 * (0.30 + w * 0.10), rel=1e-12)
    assert rates.share("flash", 8192, 120, backward=True, causal=True) == pytest.approx(0.5 * 0.30)  # no causal bwd
    assert rates.share("flash", 8192, 128, backward=False, causal=True) == pytest.approx(0.5 * 0.35)
    assert rates.share("flash", 65536, 128, backward=False, causal=False) == pytest.approx(0.5 * 0.40)  # held flat
    assert rates.share("flash", 8192, 70, backward=False, causal=False) == pytest.approx(0.5 * 0.10)


def test_fused_memory_bound_nodes_move_what_enters_and_leaves_their_group() -> None:
    """``c = (a + b) * 2`` then ``d = mm(c, w)``: fused, the group reads a and b once and writes c once (the add's
    result never reaches memory); one kernel per op reads and writes everything."""
    def build(g: fx.Graph):  # type: ignore[no-untyped-def]
        a, b, w = g.placeholder("a"), g.placeholder("b"), g.placeholder("w")
        added = g.call_function(torch.ops.aten.add.Tensor, (a, b))
        scaled = g.call_function(torch.ops.aten.mul.Tensor, (added, 2.0))
        g.output(g.call_function(torch.ops.aten.mm.default, (scaled, w)))
        return [(a, (256, 64)), (b, (256, 64)), (w, (64, 64))]

    gm = _graph(build)
    plan = fusion_plan(gm, chain=set())
    nodes = {n.name: n for n in gm.graph.nodes}
    tensor = 256 * 64 * 4
    assert plan[nodes["add_tensor"]] == (2 * tensor, 0, False)  # reads a and b; its result stays inside
    assert plan[nodes["mul_tensor"]] == (tensor, 1, False)  # writes c: the one kernel
    eager = compute_seconds(nodes["add_tensor"], hardware_from(BASE)).bytes + \
        compute_seconds(nodes["mul_tensor"], hardware_from(BASE)).bytes
    assert eager == 3 * tensor + 2 * tensor


def test_a_reducing_kernel_runs_at_the_reduction_rate() -> None:
    def build(g: fx.Graph):  # type: ignore[no-untyped-def]
        a = g.placeholder("a")
        g.output(g.call_function(torch.ops.aten.sum.dim_IntList, (a, [1])))
        return [(a, (1024, 1024))]

    gm = _graph(build)
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    hw = hardware_from({**BASE, "achievable": {
        "matmul": {"bf16": {"efficiency": 1.0}, "fp32": {"efficiency": 1.0}},
        "memory": {"efficiency": 0.9, "reduction_efficiency": 0.6}}})
    nbytes = (1024 * 1024 + 1024) * 4
    assert compute_seconds(node, hw).seconds == pytest.approx(nbytes / (2e12 * 0.6), rel=1e-12)


def test_a_kernel_calibration_timed_is_priced_as_timed_in_its_own_layout() -> None:
    """A CPU's GEMM of one shape can take 4x longer with a transposed factor: calibration times the step's shapes
    in the step's layouts, and the model prices exactly those kernels as timed, any other by its rate model."""
    def build(g: fx.Graph):  # type: ignore[no-untyped-def]
        a, w = g.placeholder("a"), g.placeholder("w")
        wt = g.call_function(torch.ops.aten.t.default, (w,))
        g.output(g.call_function(torch.ops.aten.mm.default, (a, wt)))  # a @ w.t(): b read transposed
        return [(a, (1024, 64)), (w, (8192, 64))]

    gm = _graph(build)
    mm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
    from overlapcfg.cost.price import matmul_layout

    assert matmul_layout(mm) == "nt" and matmul_shape(mm) == (1, 1024, 64, 8192)
    timed = {"efficiency": 0.5, "timed": [{"shape": [1, 1024, 64, 8192], "layout": "nt", "seconds": 0.19}]}
    hw = hardware_from({**BASE, "achievable": {"matmul": {"bf16": timed, "fp32": timed},
                                               "memory": {"efficiency": 1.0}}})
    assert compute_seconds(mm, hw).seconds == 0.19
    other = {"efficiency": 0.5, "timed": [{"shape": [1, 1024, 64, 8192], "layout": "nn", "seconds": 0.05}]}
    hw_nn = hardware_from({**BASE, "achievable": {"matmul": {"bf16": other, "fp32": other},
                                                  "memory": {"efficiency": 1.0}}})
    assert compute_seconds(mm, hw_nn).seconds == pytest.approx(2 * 1024 * 64 * 8192 / (1e14 * 0.5))


def _gradient_graph(merged: bool) -> fx.GraphModule:
    """``g = a + b`` read by two parameters' gradients ``u = g * 2`` and ``v = g * 3``, each cast and flattened,
    then reduce-scattered: one collective per parameter (the finest grouping), or one for both (a merged bucket)."""
    rs, wait = torch.ops._c10d_functional.reduce_scatter_tensor.default, torch.ops._c10d_functional.wait_tensor.default

    def build(g: fx.Graph):  # type: ignore[no-untyped-def]
        a, b = g.placeholder("a"), g.placeholder("b")
        summed = g.call_function(torch.ops.aten.add.Tensor, (a, b))
        lanes = [g.call_function(torch.ops.aten.view.default, (
            g.call_function(torch.ops.aten._to_copy.default, (
                g.call_function(torch.ops.aten.mul.Tensor, (summed, factor)),), {"dtype": torch.bfloat16}), [-1]))
            for factor in (2.0, 3.0)]
        inputs = [g.call_function(torch.ops.aten.cat.default, (lanes,))] if merged else lanes
        g.output([g.call_function(wait, (g.call_function(rs, (x, "sum", 2, "0")),)) for x in inputs])
        return [(a, (64, 32)), (b, (64, 32))]

    return _graph(build)


def test_a_node_on_two_parameters_lanes_is_in_no_chain_whatever_the_grouping() -> None:
    """Which of the model's nodes are collective-chain nodes (priced by bytes alone, unfused) must not depend on
    the bucketing, or the tuner's quick model (its units' chains summed) parts from the full simulation: the sum
    ``g`` feeds two reduce-scatters apart and one merged, and is in neither's chain; each lane's mul, cast and view
    are in both."""
    chains = []
    for merged in (False, True):
        gm = _gradient_graph(merged)
        chains.append({n.name for n in chain_nodes(gm)})
    apart, together = chains
    lanes = {"mul_tensor", "mul_tensor_1", "_to_copy_default", "_to_copy_default_1", "view_default",
             "view_default_1"}
    assert lanes <= apart and lanes <= together
    assert "add_tensor" not in apart and "add_tensor" not in together
    assert together - apart == {"cat_default"} and "wait_tensor_default" in apart
