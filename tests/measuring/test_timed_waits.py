"""``Recorder``'s timed runs on a CPU: a copy of each graph whose collective waits count the seconds they block,
the graph itself left as the pass wrote it (its waits are what the node-timed runs and the prediction read)."""

from __future__ import annotations

import torch
from torch import fx

from overlapcfg import compat, load_config
from overlapcfg.cost.price import node_kind
from overlapcfg.measuring.clock import Clock
from overlapcfg.measuring.runner import Recorder
from overlapcfg.passes import apply
from tests.support.synthetic import forward_graph


def _all_reduce_then_double(group_name: str) -> fx.GraphModule:
    """``x -> wait(all_reduce(x)) * 2``, the way the captured graphs call the functional collectives."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    start = graph.call_function(compat.ALL_REDUCE, (x, "sum", group_name))
    waited = graph.call_function(compat.WAIT_TENSOR, (start,))
    graph.output(graph.call_function(torch.ops.aten.mul.Tensor, (waited, 2)))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_timed_runs_count_the_waits_and_leave_the_graph_as_it_is() -> None:
    with compat.fake_process_group(world_size=2) as group:
        gm = _all_reduce_then_double(group.group_name)
        recorder = Recorder(Clock("cpu"))
        run = recorder.compiler("forward")(gm, [])
        recorder.mode = "timed"
        out = run([torch.ones(4)])
        assert torch.equal(out, torch.full((4,), 2.0))  # the copy computes what the graph does
        assert recorder.waits_timed and recorder.take_waited() > 0
        assert recorder.take_waited() == 0.0  # taken: the count starts again
        recorder.mode = "plain"
        run([torch.ones(4)])
        assert recorder.take_waited() == 0.0  # only the timed runs count
    # the compiled graph keeps its wait (node kinds, node-timed runs and the prediction read it)
    assert [node_kind(n) for n in gm.graph.nodes if n.target is compat.WAIT_TENSOR] == ["wait"]


def test_a_graph_whose_waits_are_wrapped_in_ordering_edges_is_not_timed() -> None:
    """``insert_overlap_deps`` wraps waits in ``control_deps``, which the copy does not time: the recorder says so,
    and ``measure`` reads the profiler's trace for that config instead of a partial count."""
    cfg = load_config({"plan": {"buckets": ["layers.*"]}, "policy": {"insert_overlap_deps": True}})
    with compat.fake_process_group(2, 0):
        gm = apply(forward_graph([[1], [1], [1]]).gm, cfg, graph_kind="forward")
    assert any(n.target is compat.control_deps for n in gm.graph.nodes)
    recorder = Recorder(Clock("cpu"))
    recorder.compiler("forward")(gm, [])
    assert not recorder.waits_timed
