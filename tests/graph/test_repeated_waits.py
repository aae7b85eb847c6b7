"""A collective waited more than once: the graph a tracer's CSE leaves when two collectives are equal (GPT-NeoX's
and Phi's parallel blocks reduce-scatter two equal bias gradients; ``tests/conformance/test_repeated_waits.py``
runs the model). Hand-built graphs, no tracing: the verifier accepts such waits where the graph had them before
the pass and rejects one a pass adds, and ``fold_repeated_waits`` leaves one wait that serves every reader."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from overlapcfg.errors import OverlapVerificationError
from overlapcfg.graph.collectives import find_collectives
from overlapcfg.graph.merge import fold_repeated_waits
from overlapcfg.graph.summary import summarize
from overlapcfg.graph.verify import verify

_c10d = torch.ops._c10d_functional


def _graph(waits: int) -> fx.GraphModule:
    """``g = x + 1``, reduce-scattered once and waited ``waits`` times, each wait returned (two gradients)."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(8)
    grad = graph.call_function(torch.ops.aten.add.Tensor, (x, 1), name="grad")
    grad.meta["val"] = torch.empty(8)
    rs = graph.call_function(_c10d.reduce_scatter_tensor.default, (grad, "sum", 2, "0"), name="rs")
    rs.meta["val"] = torch.empty(4)
    outs = []
    for i in range(waits):
        wait = graph.call_function(_c10d.wait_tensor.default, (rs,), name=f"wait_{i}")
        wait.meta["val"] = torch.empty(4)
        outs.append(wait)
    graph.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_the_summary_names_what_the_graph_waits_more_than_once() -> None:
    assert summarize(_graph(2)).waited_repeatedly == (("rs", 2),)
    assert summarize(_graph(1)).waited_repeatedly == ()


def test_a_graph_that_kept_its_repeated_waits_verifies() -> None:
    """What strategy "none" hands back on such a graph: no false alarm."""
    gm = _graph(2)
    assert verify(summarize(gm), gm) is None  # raises OverlapVerificationError on a false alarm


@pytest.mark.parametrize(("waits", "last_wait", "message"), [
    (1, "wait_0", r"rs: expected exactly one wait_tensor, found 2"),
    (2, "wait_1", r"rs: expected at most 2 wait_tensors \(as before the pass\), found 3"),
], ids=["a_second_wait", "a_third_wait_on_a_collective_already_waited_twice"])
def test_a_pass_that_adds_a_wait_is_caught(waits: int, last_wait: str, message: str) -> None:
    """Keeping or folding the waits the graph had is allowed; one more is not."""
    gm = _graph(waits)
    before = summarize(gm)
    rs = next(n for n in gm.graph.nodes if n.name == "rs")
    wait = next(n for n in gm.graph.nodes if n.name == last_wait)
    with gm.graph.inserting_after(wait):
        gm.graph.call_function(_c10d.wait_tensor.default, (rs,), name="extra_wait")
    with pytest.raises(OverlapVerificationError, match=message):
        verify(before, gm)


def test_folding_leaves_one_wait_serving_every_reader_and_the_same_outputs() -> None:
    gm = _graph(3)
    before = summarize(gm)
    (rs,) = find_collectives(gm.graph, lambda node: None)
    assert len(rs.waits) == 3
    assert fold_repeated_waits(gm.graph, rs) == 2
    waits = [n for n in gm.graph.nodes if n.target is _c10d.wait_tensor.default]
    assert [w.name for w in waits] == ["wait_0"]
    assert gm.graph.output_node().args[0] == (waits[0],) * 3
    verify(before, gm)  # outputs read the same contents; 'rs' had repeated waits, and now has one
    assert fold_repeated_waits(gm.graph, find_collectives(gm.graph, lambda node: None)[0]) == 0


def _gather_returned_raw() -> fx.GraphModule:
    """What torch 2.14 traces for a tied weight: ``p``'s all-gather waited, read, and also returned *unwaited* (saved
    for the backward as the collective's raw result)."""
    graph = fx.Graph()
    p = graph.placeholder("p")
    p.meta["val"] = torch.empty(4)
    ag = graph.call_function(_c10d.all_gather_into_tensor.default, (p, 2, "0"), name="ag")
    ag.meta["val"] = torch.empty(8)
    wait = graph.call_function(_c10d.wait_tensor.default, (ag,), name="wait")
    wait.meta["val"] = torch.empty(8)
    use = graph.call_function(torch.ops.aten.mul.Tensor, (wait, 2), name="use")
    use.meta["val"] = torch.empty(8)
    graph.output((use, ag))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_an_unwaited_return_reads_the_wait_after_folding_and_the_outputs_are_the_same() -> None:
    """The merge takes one reader per collective, its wait; the graph output that read the raw result reads the
    wait (the same tensor) and the verifier sees the same contents returned."""
    gm = _gather_returned_raw()
    before = summarize(gm, direction="forward")
    (ag,) = find_collectives(gm.graph, lambda node: None, direction="forward")
    assert [u.name for u in ag.start.users] == ["wait", "output"]
    assert fold_repeated_waits(gm.graph, ag) == 1
    assert [u.name for u in ag.start.users] == ["wait"]
    assert [a.name for a in gm.graph.output_node().args[0]] == ["use", "wait"]
    verify(before, gm, direction="forward")


def test_a_graph_returning_a_waited_collectives_raw_result_verifies_as_traced() -> None:
    """What strategy "none" hands back on torch 2.14's tied-weight forward: the output reads the gather's raw result,
    which it waited; no false alarm. Any other reader of the raw result is still a read before the wait."""
    gm = _gather_returned_raw()
    verify(summarize(gm, direction="forward"), gm, direction="forward")
    use = next(n for n in gm.graph.nodes if n.name == "use")
    ag = next(n for n in gm.graph.nodes if n.name == "ag")
    before = summarize(gm, direction="forward")
    use.replace_input_with(next(n for n in gm.graph.nodes if n.name == "wait"), ag)
    with pytest.raises(OverlapVerificationError, match="ag: read before its wait by use"):
        verify(before, gm, direction="forward")
