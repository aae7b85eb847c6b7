"""Activation checkpointing priced: the recompute a chosen mode adds to a step traced without it, pinned on a hand
computation (which forward nodes, how many seconds, charged where the block's backward starts), the recompute a
trace already holds, and the modes that cannot be priced refused at their field.

Fast tier: a hand-built forward and backward (matmuls and a ReLU in one block, one matmul outside it).
"""

from __future__ import annotations

import pytest
import torch
from torch import fx

from overlapcfg.cost.hardware import hardware_from
from overlapcfg.cost.simulator import simulate
from overlapcfg.errors import OverlapConfigError
from tests.support.synthetic import with_fake_values

PEAK, BW = 1e12, 1e12
HW = hardware_from({"name": "roofline", "peak_flops": {"bf16": PEAK, "fp32": PEAK}, "mem_bandwidth": BW,
                    "intra_node_bandwidth": 1e11, "inter_node_bandwidth": 1e10, "latency": 1e-6,
                    "gpus_per_node": 8})
ROWS, DIM = 64, 32
MM = 2 * ROWS * DIM * DIM / PEAK  # a [64, 32] @ [32, 32] matmul: compute-bound (131072 FLOPs, 20480 bytes)
RELU = 2 * ROWS * DIM * 4 / BW  # reads and writes [64, 32] fp32


def _node(g: fx.Graph, name: str, target: object, args: tuple, fqn: str) -> fx.Node:  # type: ignore[type-arg]
    node = g.create_node("call_function", target, args, {}, name=name)
    node.meta["custom"] = {"module_fqn": fqn}
    return node


def _forward(recompute_in_backward: bool = False) -> tuple[fx.GraphModule, fx.GraphModule]:
    mm, relu = torch.ops.aten.mm.default, torch.ops.aten.relu.default
    g = fx.Graph()
    x, w1, w2, w3, w4 = (g.placeholder(n) for n in ("x", "w1", "w2", "w3", "w4"))
    a = _node(g, "mm_q", mm, (x, w1), "layers.0.attention.wq")
    b = _node(g, "mm_k", mm, (a, w2), "layers.0.attention.wk")
    r = _node(g, "relu", relu, (b,), "layers.0.feed_forward")
    c = _node(g, "mm_w1", mm, (r, w3), "layers.0.feed_forward.w1")
    d = _node(g, "mm_w2", mm, (c, w4), "layers.0.feed_forward.w2")
    head = _node(g, "mm_head", mm, (d, w1), "output")  # outside every block: never checkpointed
    g.output((head, d))
    square = (DIM, DIM)
    forward = with_fake_values(fx.GraphModule(torch.nn.Module(), g),
                               [(x, (ROWS, DIM)), (w1, square), (w2, square), (w3, square), (w4, square)])
    gb = fx.Graph()
    gy, v4, v1 = gb.placeholder("gy"), gb.placeholder("v4"), gb.placeholder("v1")
    first = _node(gb, "mm_grad_head", mm, (gy, v1), "output")
    grad = _node(gb, "mm_grad_w2", mm, (first, v4), "layers.0.feed_forward.w2")
    outs: list[fx.Node] = [grad]
    if recompute_in_backward:  # what aot's partitioner leaves of a checkpointed block: a forward node copied here,
        copied = _node(gb, "mm_k", mm, (grad, v4), "layers.0.attention.wk")  # with its region's policy
        copied.meta["recompute"] = torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
        outs.append(copied)
    gb.output(tuple(outs))
    backward = with_fake_values(fx.GraphModule(torch.nn.Module(), gb),
                                [(gy, (ROWS, DIM)), (v4, square), (v1, square)])
    return forward, backward


def _step(mode: str, graphs: tuple[fx.GraphModule, fx.GraphModule] | None = None):  # type: ignore[no-untyped-def]
    return simulate(list(graphs or _forward()), HW, world_size=1, pricing={"activation_checkpointing": mode})


def test_selective_recomputes_every_second_matmul_of_a_block_and_its_memory_bound_ops() -> None:
    """torchtitan's per-op policy: the block's matmuls in forward order are wq, wk, w1, w2; the second and fourth
    (wk, w2) are recomputed, wq and w1 saved; the ReLU recomputed; the head is outside the block."""
    plain, selective = _step("as_traced"), _step("selective")
    added = 2 * MM + RELU
    assert selective.step_seconds - plain.step_seconds == pytest.approx(added, rel=1e-9)
    assert selective.graph_flops - plain.graph_flops == 2 * (2 * ROWS * DIM * DIM)
    assert selective.recompute.startswith("selective: 3 nodes")


def test_full_recomputes_the_whole_block_where_its_backward_starts() -> None:
    plain, full = _step("as_traced"), _step("full")
    assert full.step_seconds - plain.step_seconds == pytest.approx(4 * MM + RELU, rel=1e-9)
    # charged before the block's first backward matmul (after the head's gradient, which is outside the block)
    compute = [e for e in full.events if e.stream == "compute" and e.graph == "backward"]
    assert [e.node for e in compute] == ["mm_grad_head", "mm_grad_w2"]
    assert compute[1].end - compute[1].start == pytest.approx(MM + 4 * MM + RELU, rel=1e-9)


def test_recompute_a_trace_holds_is_priced_as_traced_and_reported() -> None:
    graphs = _forward(recompute_in_backward=True)
    traced = _step("as_traced", graphs)
    assert traced.recompute.startswith("as traced: 1 nodes")


@pytest.mark.parametrize("mode, says", [
    ("selective", "already recomputes 1 FLOP-counted forward nodes"),
    ("none", "it was traced with activation checkpointing"),
])
def test_a_mode_that_contradicts_the_trace_is_refused_at_its_field(mode: str, says: str) -> None:
    with pytest.raises(OverlapConfigError) as err:
        _step(mode, _forward(recompute_in_backward=True))
    assert "pricing.activation_checkpointing" in str(err.value) and says in str(err.value)


def test_an_unknown_mode_is_refused_listing_the_modes() -> None:
    with pytest.raises(OverlapConfigError) as err:
        _step("offload")
    message = str(err.value)
    assert "pricing.activation_checkpointing" in message and "'selective'" in message
