"""``node_kind`` looks an op's kind up once (the cost model asks about every node of a step many times over); the
lookup must still follow torch's FLOP registry, which a user's module may extend after a graph was priced."""

from __future__ import annotations

import torch
from torch import fx
from torch.utils import flop_counter

from overlapcfg.cost.price import node_kind


@torch.library.custom_op("overlapcfg_kind_test::scaled", mutates_args=())
def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _one_call(target: object) -> fx.Node:
    graph = fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(target, (x,))
    graph.output(node)
    return node


def test_an_op_is_compute_once_a_flop_formula_is_registered_for_it_after_a_lookup() -> None:
    op = torch.ops.overlapcfg_kind_test.scaled.default
    node = _one_call(op)
    assert node_kind(node) == "memory"
    assert node_kind(_one_call(op)) == "memory"  # the looked-up answer, for another node of the same op
    packet = torch.ops.overlapcfg_kind_test.scaled
    flop_counter.register_flop_formula(packet)(lambda *args, **kwargs: 1)
    try:
        assert node_kind(node) == "compute"
    finally:
        del flop_counter.flop_registry[packet]
    assert node_kind(node) == "memory"


def test_a_wait_is_classified_by_what_it_waits_on_not_by_its_op() -> None:
    wait = torch.ops._c10d_functional.wait_tensor.default
    gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    graph = fx.Graph()
    x = graph.placeholder("x")
    loose = graph.call_function(wait, (x,))  # waits on no collective: an ordinary kernel
    start = graph.call_function(gather, (x, 2, "0"))
    waited = graph.call_function(wait, (start,))
    graph.output((loose, waited))
    assert [node_kind(n) for n in (loose, start, waited, loose)] == ["memory", "collective", "wait", "memory"]
