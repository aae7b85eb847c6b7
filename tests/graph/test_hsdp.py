"""HSDP gradient all-reduces on trace-free graphs, both chain orders: classified, bucketed per bucket and
scheduled with ``all_reduce_delay``, proven by the verifier and measured in the final graph.

torchtitan's own HSDP graphs (all-reduce first) are covered in ``test_conformance.py``; the demo's 2 x 2 meshes on
gloo in ``test_parallel_parity.py``.
"""

from __future__ import annotations

import copy
import itertools
from collections import Counter

import pytest
import torch
from torch import fx

import overlapcfg
from overlapcfg import compat
from overlapcfg.graph.attribution import module_fqn
from overlapcfg.graph.collectives import find_collectives, started_by
from overlapcfg.passes import apply
from tests.support.synthetic import backward_graph, new_capture

ORDERS = ("all_reduce_first", "reduce_scatter_first")
LAYERS = [[2, 1], [1], [3, 2], [1, 1]]
ONE_CAPTURE = new_capture()
"""The fake mode of every graph here: one capture, so each bucket merge is traced once for the file
(``overlapcfg.graph.traces``), not once per test; the pass rewrites the graphs, never the traces."""


def _run(order: str, policy: dict[str, object]) -> tuple[fx.GraphModule, fx.GraphModule]:
    syn = backward_graph(LAYERS, hsdp=order, fake_mode=ONE_CAPTURE)  # type: ignore[arg-type]
    original = copy.deepcopy(syn.gm)
    cfg = overlapcfg.load_config({"plan": {"name": "layers", "buckets": ["layers.*"]}, "policy": policy})
    with compat.fake_process_group(2):
        final = apply(syn.gm, cfg, graph_kind="backward", module_fqns=syn.module_fqns)
    return original, final


def _starts(gm: fx.GraphModule, kind: str) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and compat.op_name(n.target).startswith(
        f"_c10d_functional.{kind}")]


def _delays(gm: fx.GraphModule, kind: str) -> list[int]:
    """Per collective of ``kind`` in issue order: later ones of the same kind issued before its wait."""
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    starts = sorted(_starts(gm, kind), key=pos.__getitem__)
    waits = {started_by(n): n for n in gm.graph.nodes if started_by(n) is not None}
    return [sum(1 for later in starts[i + 1:] if pos[later] < pos[waits[s]]) for i, s in enumerate(starts)]


@pytest.mark.parametrize("order", ORDERS)
def test_each_all_reduce_is_paired_with_its_gradients_reduce_scatter(order: str) -> None:
    syn = backward_graph(LAYERS, hsdp=order, fake_mode=ONE_CAPTURE)  # type: ignore[arg-type]
    found = find_collectives(syn.gm.graph, module_fqn, direction="backward")
    assert Counter(c.role for c in found) == {"fsdp_reduce_scatter": 7, "hsdp_all_reduce": 7}
    for c in found:
        assert c.partner is not None and c.partner.target is not c.start.target
        assert c.module_fqn == syn.owners[c.start.name]  # each half belongs to its gradient's module
        assert c.direction == "backward"


def _append_all_reduce(order: str | None, *, into_compute: bool, group: str = "0") -> tuple[fx.GraphModule, fx.Node]:
    """The backward graph (HSDP in ``order``, or plain FSDP for None) plus one all-reduce of the last activation
    gradient on ``group``, read by compute (an activation collective) or only returned (a metric)."""
    syn = backward_graph(LAYERS, hsdp=order, fake_mode=ONE_CAPTURE)  # type: ignore[arg-type]
    graph = syn.gm.graph
    out = next(n for n in graph.nodes if n.op == "output")
    gy = out.args[0][-1]
    with graph.inserting_before(out):
        ar = graph.call_function(compat.ALL_REDUCE, (gy, "sum", group))
        wait = graph.call_function(compat.WAIT_TENSOR, (ar,))
        last = graph.call_function(torch.ops.aten.add.Tensor, (wait, gy)) if into_compute else wait
    for n in (ar, wait, last):
        n.meta["val"] = gy.meta["val"]
    out.args = ((*out.args[0][:-1], last),)
    syn.gm.recompile()
    return syn.gm, ar


def test_an_all_reduce_of_an_activation_is_other() -> None:
    """An all-reduce whose result feeds compute (a row-parallel layer's output, a loss) reduces no gradient: it
    is left alone, whatever group it runs on."""
    gm, ar = _append_all_reduce(None, into_compute=True)
    graph = gm.graph
    roles = {c.start.name: c.role for c in find_collectives(graph, module_fqn, direction="backward")}
    assert roles[ar.name] == "other"
    assert Counter(roles.values()) == {"fsdp_reduce_scatter": 7, "other": 1}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(("rs", "ar"), [(1, None), (0, 0), (2, 1), (1, 3)])
def test_all_reduces_are_bucketed_and_delayed_as_asked(order: str, rs: int, ar: int | None) -> None:
    policy: dict[str, object] = {"reduce_scatter_delay": rs}
    if ar is not None:
        policy["all_reduce_delay"] = ar
    original, final = _run(order, policy)  # apply verifies: same bytes reduced, every consumer reads the same
    assert (len(_starts(original, "all_reduce")), len(_starts(final, "all_reduce"))) == (7, 4)
    assert len(_starts(final, "reduce_scatter")) == 4
    want_ar = rs if ar is None else ar
    assert _delays(final, "all_reduce") == [min(want_ar, 3 - i) for i in range(4)]
    assert _delays(final, "reduce_scatter") == [min(rs, 3 - i) for i in range(4)]
    record = final.meta["overlapcfg"]
    got = [(d.bucket, d.requested, d.effective) for d in record.decisions if d.kind == "all_reduce"]
    assert got == [(f"layers.{3 - i}", want_ar, min(want_ar, 3 - i)) for i in range(4)]
    # the second half of each chain is issued right after the first half's result is ready
    pos = {n: i for i, n in enumerate(final.graph.nodes)}
    first, second = ("all_reduce", "reduce_scatter") if order == "all_reduce_first" else ("reduce_scatter",
                                                                                           "all_reduce")
    waits = {started_by(n): n for n in final.graph.nodes if started_by(n) is not None}
    for start in _starts(final, second):
        feeding = [s for s in _starts(final, first) if waits[s] in _ancestors(start)]
        assert len(feeding) == 1
        between = [n for n in final.graph.nodes if pos[waits[feeding[0]]] < pos[n] < pos[start]]
        assert not any(compat.is_functional_collective(n.target) for n in between if n.op == "call_function")


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def test_per_bucket_override_of_the_all_reduce_delay() -> None:
    cfg = {"reduce_scatter_delay": 1}
    syn = backward_graph(LAYERS, hsdp="all_reduce_first", fake_mode=ONE_CAPTURE)
    config = overlapcfg.load_config({"plan": {"name": "layers", "buckets": ["layers.*"]}, "policy": cfg,
                                     "overrides": [{"match": "layers.3", "all_reduce_delay": 0}]})
    with compat.fake_process_group(2):
        final = apply(syn.gm, config, graph_kind="backward", module_fqns=syn.module_fqns)
    record = final.meta["overlapcfg"]
    bucket = next(b for b in record.buckets if b.name == "layers.3")
    assert (bucket.all_reduce_delay, bucket.origin("all_reduce_delay")) == (0, "overrides[0]")
    assert _delays(final, "all_reduce") == [0, 1, 1, 0]


def test_the_all_reduce_delay_follows_the_reduce_scatter_delay_unless_set() -> None:
    config = overlapcfg.load_config({"plan": {"name": "layers", "buckets": ["layers.*"]},
                                     "policy": {"reduce_scatter_delay": 2},
                                     "overrides": [{"match": "layers.0", "reduce_scatter_delay": 0}]})
    syn = backward_graph(LAYERS, hsdp="reduce_scatter_first", fake_mode=ONE_CAPTURE)
    with compat.fake_process_group(2):
        final = apply(syn.gm, config, graph_kind="backward", module_fqns=syn.module_fqns)
    buckets = {b.name: b for b in final.meta["overlapcfg"].buckets}
    assert [buckets[f"layers.{i}"].all_reduce_delay for i in range(4)] == [0, 2, 2, 2]
    assert buckets["layers.1"].origin("all_reduce_delay") == "reduce_scatter_delay"


def test_torch_manual_says_whether_it_left_the_all_reduces_unbucketed() -> None:
    """Upstream's manual pass skips HSDP all-reduces before torch 2.14 and buckets them from 2.14: the record says
    "left unbucketed" exactly when the graph still has one all-reduce per gradient."""
    syn = backward_graph(LAYERS, hsdp="all_reduce_first", fake_mode=ONE_CAPTURE)
    cfg = overlapcfg.load_config({"strategy": "torch_manual", "plan": {"name": "layers", "buckets": ["layers.*"]}})
    with compat.fake_process_group(2):
        final = apply(syn.gm, cfg, graph_kind="backward", module_fqns=syn.module_fqns)
    left = len(_starts(final, "all_reduce"))
    said = any("7 HSDP gradient all-reduces" in n and "left unbucketed" in n for n in final.meta["overlapcfg"].notes)
    assert (left, said) in ((7, True), (len(LAYERS), False))


# --- the cost model knows groups ------------------------------------------------------------------------------------

NET = {"peak_flops": {"bf16": 1e12, "fp32": 1e12}, "mem_bandwidth": 1e12, "intra_node_bandwidth": 1e9,
       "inter_node_bandwidth": 1e8, "latency": 1e-9, "gpus_per_node": 8}


def test_an_inter_node_group_costs_its_own_links() -> None:
    """Same graph, same group size: placing the group across nodes costs the all-reduces at inter-node bandwidth
    (10x slower here), exactly the alpha-beta model's ratio."""
    from overlapcfg.cost import HardwareProfile
    from overlapcfg.cost.simulator import GroupPlacement, simulate

    syn = backward_graph(LAYERS, hsdp="reduce_scatter_first", fake_mode=ONE_CAPTURE)
    hw = HardwareProfile(name="net", **NET)  # type: ignore[arg-type]
    inside = simulate(syn.gm, hw, world_size=8, groups={"0": GroupPlacement(8, inter_node=False)})
    across = simulate(syn.gm, hw, world_size=8, groups={"0": GroupPlacement(8, inter_node=True)})
    fast = HardwareProfile(name="latency only", **{**NET, "intra_node_bandwidth": 1e15,  # type: ignore[arg-type]
                                                   "inter_node_bandwidth": 1e15})
    latency = simulate(syn.gm, fast, world_size=8, groups={"0": GroupPlacement(8, inter_node=False)}).comm_seconds
    assert across.comm_seconds - latency == pytest.approx(10 * (inside.comm_seconds - latency), rel=1e-6)
    assert across.step_seconds > inside.step_seconds


def test_collectives_no_schedule_can_hide_raise_the_lower_bound() -> None:
    """An activation all-reduce (role other: tensor parallel) sits between compute that makes and compute that
    reads it, so the bound is compute plus its time, not max(compute, comm)."""
    from overlapcfg.cost import HardwareProfile
    from overlapcfg.cost.simulator import GroupPlacement, simulate

    gm, _ = _append_all_reduce(None, into_compute=True, group="7")
    hw = HardwareProfile(name="net", **NET)  # type: ignore[arg-type]
    # The tp group across nodes (10x slower) makes the activation all-reduce the busiest stream, so compute plus
    # it exceeds max(compute, busiest stream): the old bound.
    sim = simulate(gm, hw, world_size=2, groups={"7": GroupPlacement(2, inter_node=True)})
    tp = next(s.busy_seconds for s in sim.streams if s.stream == "comm:7")
    busiest = max(s.busy_seconds for s in sim.streams if s.stream.startswith("comm:"))
    assert tp == busiest > sim.compute_seconds > 0
    assert sim.lower_bound_seconds == pytest.approx(sim.compute_seconds + tp)
    assert sim.lower_bound_seconds > max(sim.compute_seconds, busiest)
    assert sim.step_seconds >= sim.lower_bound_seconds


@pytest.mark.parametrize("order", ORDERS)
def test_the_verifier_catches_a_bucketed_all_reduce_handing_a_gradient_the_wrong_slice(order: str) -> None:
    """The proof covers all-reduces too: swap two slices of a merged all-reduce's result and it names them."""
    from overlapcfg.errors import OverlapVerificationError
    from overlapcfg.graph.verify import verify

    original, final = _run(order, {})
    pairs = []
    for start in _starts(final, "all_reduce"):
        wait = next(iter(start.users))
        for split in (u for u in wait.users if compat.op_name(u.target).startswith("aten.split")):
            slices = sorted(split.users, key=lambda u: u.args[1])
            pairs += [(a, b) for a, b in itertools.pairwise(slices) if a.meta["val"].shape == b.meta["val"].shape]
    assert pairs, "LAYERS has a layer of two equal parameters (layers.3): its bucket's slices match in shape"
    first, second = pairs[0]
    split = first.args[0]
    first.args, second.args = (split, second.args[1]), (split, first.args[1])
    final.recompile()
    swapped = r"graph output \d+ is (now the reduce-scattered gradient of|.* = all_reduce\[sum)"
    with pytest.raises(OverlapVerificationError, match=swapped):
        verify(original, final, direction="backward")


@pytest.mark.parametrize("order", ORDERS)
def test_reduce_scatter_first_issue_order_with_delayed_all_reduces(order: str) -> None:
    """``issue_order: reduce_scatter_first`` ties far prefetches to reduce-scatter starts; with HSDP those can sit
    behind a delayed all-reduce wait. Deep prefetch and long delays together still schedule, verified."""
    syn = backward_graph(LAYERS, hsdp=order, regather=True, fake_mode=ONE_CAPTURE)  # type: ignore[arg-type]
    policy = {"backward_prefetch": 3, "reduce_scatter_delay": 2, "all_reduce_delay": 3,
              "issue_order": "reduce_scatter_first"}
    cfg = overlapcfg.load_config({"plan": {"name": "layers", "buckets": ["layers.*"]}, "policy": policy})
    with compat.fake_process_group(2):
        final = apply(syn.gm, cfg, graph_kind="backward", module_fqns=syn.module_fqns)
    assert len(_starts(final, "all_reduce")) == 4
    assert _delays(final, "all_reduce") == [min(3, 3 - i) for i in range(4)]


@pytest.mark.parametrize("order", ORDERS)
def test_a_group_carrying_activations_is_not_an_hsdp_group_and_the_record_says_so(order: str) -> None:
    """The same chain on a group whose collectives also feed compute is tensor parallel's (sequence-parallel
    norms): never bucketed, and the pass record and a warning say why, instead of leaving it silently."""
    gm, _ = _append_all_reduce(order, into_compute=True)
    roles = Counter(c.role for c in find_collectives(gm.graph, module_fqn, direction="backward"))
    assert roles == {"fsdp_reduce_scatter": 7, "other": 8}
    cfg = overlapcfg.load_config({"plan": {"name": "layers", "buckets": ["layers.*"]}})
    with compat.fake_process_group(2):
        final = apply(gm, cfg, graph_kind="backward", module_fqns=backward_graph(LAYERS).module_fqns)
    assert len(_starts(final, "all_reduce")) == 8
    assert any("7 all-reduce(s) on group(s) '0' are chained with FSDP reduce-scatters" in n and "left alone" in n
               for n in final.meta["overlapcfg"].notes)


@pytest.mark.parametrize("order", ORDERS)
def test_a_returned_all_reduce_on_the_group_does_not_turn_hsdp_off(order: str) -> None:
    """A user all-reduce whose result is only returned (a metric) moves no activation: HSDP stays HSDP."""
    gm, _ = _append_all_reduce(order, into_compute=False)
    roles = Counter(c.role for c in find_collectives(gm.graph, module_fqn, direction="backward"))
    assert roles == {"fsdp_reduce_scatter": 7, "hsdp_all_reduce": 7, "other": 1}
