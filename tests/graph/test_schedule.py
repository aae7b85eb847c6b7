"""The ``manual`` scheduler on traced demo graphs, measured by an independent checker (``tests/support/checker.py``).

Forward and backward graphs, with and without reshard-after-forward (a backward all-gather per block only with
it), prefetch depths 0-3, reduce-scatter delays 0-2, per-bucket values, overrides and a binding memory cap. Then
the invariants every schedule keeps (bucket counts, issue order, compute order), and equality with upstream
``manual_overlap_bucketing`` at depth 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from overlapcfg.demo.tracing import TracedStep
from overlapcfg.graph.collectives import is_compute_node
from overlapcfg.kinds import Direction
from tests.support.checker import (
    achieved_delays,
    achieved_prefetch,
    bucket_sizes,
    collective_starts,
    expected_delays,
    expected_prefetch,
    inflight_bytes,
    merged_collectives,
    original_order,
    two_layers_bucket,
)
from tests.support.releases import upstream_is_the_reference
from tests.support.traces import ApplyFn, traced_step

pytestmark = pytest.mark.slow

# (reshard_after_forward, graph, all-gather direction): every graph that holds FSDP all-gathers.
AG_GRAPHS = [(False, "forward"), (True, "forward"), (True, "backward")]
RS_GRAPHS = [False, True]


def _step(reshard: bool) -> TracedStep:
    return traced_step(4, reshard)


def _ks(order: list[str], default: int, per: Mapping[str, int] | None = None) -> list[int]:
    return [(per or {}).get(b, default) for b in order]


def _prefetch_field(graph: Direction) -> str:
    return "forward_prefetch" if graph == "forward" else "backward_prefetch"


def _check_prefetch(applied: ApplyFn, reshard: bool, graph: Direction, cfg: dict[str, Any], default: int,
                    per: Mapping[str, int] | None = None) -> tuple[list[int], list[int], Any]:
    step = _step(reshard)
    gm = applied(step, graph, cfg)
    order = original_order(step, graph, "all_gather")
    got = achieved_prefetch(gm, merged_collectives(gm, step, graph), graph)
    want = expected_prefetch(_ks(order, default, per))
    assert [got[b] for b in order] == want, f"buckets {order}"
    return [got[b] for b in order], want, gm


# --- achieved depths ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize(("reshard", "graph"), AG_GRAPHS)
def test_uniform_prefetch_depth_is_achieved_at_every_bucket(applied: ApplyFn, reshard: bool, graph: Direction,
                                                            k: int) -> None:
    got, _, _ = _check_prefetch(applied, reshard, graph,
                                {"plan": "llama_layers", "policy": {_prefetch_field(graph): k}}, k)
    n = len(got)
    assert got == [min(k, n - 1 - j) for j in range(n)]


@pytest.mark.parametrize("d", [0, 1, 2])
@pytest.mark.parametrize("reshard", RS_GRAPHS)
def test_uniform_reduce_scatter_delay_is_achieved_at_every_bucket(applied: ApplyFn, reshard: bool, d: int) -> None:
    step = _step(reshard)
    gm = applied(step, "backward", {"plan": "llama_layers", "policy": {"reduce_scatter_delay": d}})
    order = original_order(step, "backward", "reduce_scatter")
    got = achieved_delays(gm, merged_collectives(gm, step, "backward"))
    assert [got[b] for b in order] == expected_delays([d] * len(order)) == [min(d, len(order) - 1 - i)
                                                                            for i in range(len(order))]


@pytest.mark.parametrize(("reshard", "graph"), AG_GRAPHS)
def test_zero_prefetch_issues_every_all_gather_right_before_its_wait(applied: ApplyFn, reshard: bool,
                                                                     graph: Direction) -> None:
    step = _step(reshard)
    gm = applied(step, graph, {"plan": "llama_layers", "policy": {_prefetch_field(graph): 0}})
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    between = {}
    for m in merged_collectives(gm, step, graph):
        if m.kind != "all_gather":
            continue
        copy_in = _exclusive_inputs(m.start)
        between[m.bucket] = [n.name for n in nodes[pos[m.start] + 1:pos[m.wait]] if n not in copy_in]
    assert between == {bucket: [] for bucket in between}


def _exclusive_inputs(start: Any) -> set[Any]:
    """The copy-in chain of a merged all-gather: computed nodes whose only consumers lie in the chain."""
    chain = {start}
    frontier = list(start.all_input_nodes)
    while frontier:
        node = frontier.pop()
        if node.op == "call_function" and node not in chain and all(u in chain for u in node.users):
            chain.add(node)
            frontier += node.all_input_nodes
    return chain


def test_override_lowers_one_bucket_but_earlier_reach_carries_over(applied: ApplyFn) -> None:
    # k = 2 everywhere but layers.0 (bucket 1) asks for 0. Bucket 0 already issued bucket 2 before bucket 1
    # computes, so bucket 1 still sees one all-gather in flight: reach is monotone.
    cfg = {"plan": "llama_layers", "policy": {"forward_prefetch": 2},
           "overrides": [{"match": "layers.0", "forward_prefetch": 0}]}
    got, _, gm = _check_prefetch(applied, False, "forward", cfg, 2, {"layers.0": 0})
    assert got == [2, 1, 2, 2, 1, 0]
    assert {s.bucket: s.requested for s in gm.meta["overlapcfg"].decisions}["layers.0"] == 0


def test_override_to_zero_after_depth_one_leaves_that_bucket_alone(applied: ApplyFn) -> None:
    cfg = {"plan": "llama_layers", "overrides": [{"match": "layers.2.attention", "forward_prefetch": 0}]}
    got, _, _ = _check_prefetch(applied, False, "forward", cfg, 1, {"layers.2": 0})
    assert got == [1, 1, 1, 0, 1, 0]


def test_override_of_backward_prefetch_leaves_forward_alone(applied: ApplyFn) -> None:
    cfg = {"plan": "llama_layers", "policy": {"forward_prefetch": 1, "backward_prefetch": 1},
           "overrides": [{"match": "layers.3", "backward_prefetch": 3}]}
    fw, _, _ = _check_prefetch(applied, True, "forward", cfg, 1)
    bw, _, _ = _check_prefetch(applied, True, "backward", cfg, 1, {"layers.3": 3})
    assert fw == [1, 1, 1, 1, 1, 0]
    assert bw == [1, 3, 2, 1, 0]  # backward order: norm+output, layers.3, layers.2, layers.1, layers.0


PER_BUCKET_PLAN = {"buckets": [
    "tok_embeddings",
    {"modules": ["layers.0"], "forward_prefetch": 3, "reduce_scatter_delay": 2},
    "layers.1", "layers.2",
    {"modules": ["layers.3"], "backward_prefetch": 0, "reduce_scatter_delay": 0},
    ["norm", "output"],
]}


def test_per_bucket_values_in_a_mapping_entry_set_depths_for_their_buckets(applied: ApplyFn) -> None:
    cfg = {"plan": PER_BUCKET_PLAN, "policy": {"forward_prefetch": 1, "backward_prefetch": 2,
                                               "reduce_scatter_delay": 1}}
    fw, _, _ = _check_prefetch(applied, True, "forward", cfg, 1, {"layers.0": 3})
    assert fw == [1, 3, 2, 1, 1, 0]
    bw, _, gm = _check_prefetch(applied, True, "backward", cfg, 2, {"layers.3": 0})
    assert bw == [2, 1, 2, 1, 0]
    step = _step(True)
    order = original_order(step, "backward", "reduce_scatter")
    got = achieved_delays(gm, merged_collectives(gm, step, "backward"))
    ds = _ks(order, 1, {"layers.0": 2, "layers.3": 0})
    assert [got[b] for b in order] == expected_delays(ds)


def test_per_bucket_delay_override_is_independent_of_neighbours(applied: ApplyFn) -> None:
    step = _step(False)
    cfg = {"plan": "llama_layers", "policy": {"reduce_scatter_delay": 2},
           "overrides": [{"match": "layers.2", "reduce_scatter_delay": 0}]}
    gm = applied(step, "backward", cfg)
    order = original_order(step, "backward", "reduce_scatter")
    got = achieved_delays(gm, merged_collectives(gm, step, "backward"))
    assert order == ["norm+output", "layers.3", "layers.2", "layers.1", "layers.0", "tok_embeddings"]
    assert [got[b] for b in order] == [2, 2, 0, 2, 1, 0]


@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize(("reshard", "graph"), [(False, "forward"), (True, "backward")])
def test_depths_hold_for_buckets_of_two_layers(applied: ApplyFn, reshard: bool, graph: Direction, k: int) -> None:
    step = _step(reshard)
    gm = applied(step, graph, {"plan": "two_layers_per_bucket",
                               "policy": {_prefetch_field(graph): k, "reduce_scatter_delay": k}})
    merged = merged_collectives(gm, step, graph, two_layers_bucket)
    order = original_order(step, graph, "all_gather", two_layers_bucket)
    got = achieved_prefetch(gm, merged, graph)
    assert [got[b] for b in order] == expected_prefetch([k] * len(order))
    if graph == "backward":
        rs = original_order(step, graph, "reduce_scatter", two_layers_bucket)
        delays = achieved_delays(gm, merged)
        assert [delays[b] for b in rs] == expected_delays([k] * len(rs))
    assert len(order) == (4 if graph == "forward" else 3)  # tok, 0-1, 2-3, norm+output (no embedding backward)


def test_checker_expectations_on_hand_examples() -> None:
    """The expected-depth model itself, on the cases the module docstring of ``tests.support.checker`` reasons
    through."""
    assert expected_prefetch([1, 1, 1, 1]) == [1, 1, 1, 0]
    assert expected_prefetch([2, 0, 2, 2, 2, 2]) == [2, 1, 2, 2, 1, 0]  # reach carried over from bucket 0
    assert expected_prefetch([0, 3, 0, 0, 0]) == [0, 3, 2, 1, 0]
    assert expected_prefetch([2, 2, 2], sizes=[5, 5, 5], cap=10) == [1, 1, 0]
    assert expected_prefetch([2, 2, 2], sizes=[5, 5, 5], cap=4) == [0, 0, 0]  # a bucket alone above the cap
    assert expected_prefetch([3, 0, 0, 0], sizes=[1, 1, 1, 9], cap=3) == [2, 1, 0, 0]  # capped before the big one
    assert expected_delays([2, 0, 2, 1]) == [2, 0, 1, 0]


# --- memory cap --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("reshard", "graph"), AG_GRAPHS)
def test_binding_memory_cap_shrinks_depth_where_it_binds_and_says_why(applied: ApplyFn, reshard: bool,
                                                                     graph: Direction) -> None:
    step = _step(reshard)
    order = original_order(step, graph, "all_gather")
    sizes = bucket_sizes(step, graph, "all_gather")
    layer = max(sizes[b] for b in order if b.startswith("layers."))
    cap = 2 * layer  # two blocks fit, a block plus its two successors does not
    k = 2
    gm = applied(step, graph, {"plan": "llama_layers",
                               "policy": {_prefetch_field(graph): k, "max_inflight_bytes": cap}})
    merged = merged_collectives(gm, step, graph)
    got = achieved_prefetch(gm, merged, graph)
    ordered_sizes = [sizes[b] for b in order]
    want = expected_prefetch([k] * len(order), ordered_sizes, cap)
    free = expected_prefetch([k] * len(order))
    assert [got[b] for b in order] == want
    bound = [b for b, w, f in zip(order, want, free, strict=True) if w < f]
    assert bound, "the cap was meant to bind somewhere"
    assert max(inflight_bytes(gm, merged, graph, sizes).values()) <= cap
    records = {s.bucket: s for s in gm.meta["overlapcfg"].decisions if s.kind == "all_gather"}
    for b, w in zip(order, want, strict=True):
        assert records[b].effective == w
        says_cap = "max_inflight_bytes" in (records[b].reason or "")
        assert says_cap == (b in bound), f"{b}: {records[b]}"


def test_cap_below_one_bucket_serialises_all_gathers_and_says_so(applied: ApplyFn) -> None:
    step = _step(False)
    order = original_order(step, "forward", "all_gather")
    sizes = bucket_sizes(step, "forward", "all_gather")
    cap = min(sizes.values()) - 1
    gm = applied(step, "forward", {"plan": "llama_layers", "policy": {"forward_prefetch": 3,
                                                                      "max_inflight_bytes": cap}})
    got = achieved_prefetch(gm, merged_collectives(gm, step, "forward"), "forward")
    assert [got[b] for b in order] == [0] * len(order)
    reasons = [s.reason or "" for s in gm.meta["overlapcfg"].decisions]
    assert all("smaller than this bucket" in r for r in reasons), reasons


# --- invariants --------------------------------------------------------------------------------------------

INVARIANT_CASES = [
    {"forward_prefetch": 0, "backward_prefetch": 0, "reduce_scatter_delay": 0},
    {"forward_prefetch": 1, "backward_prefetch": 1, "reduce_scatter_delay": 1},
    {"forward_prefetch": 3, "backward_prefetch": 2, "reduce_scatter_delay": 2},
]


@pytest.mark.parametrize("policy", INVARIANT_CASES, ids=["k0d0", "k1d1", "k3k2d2"])
@pytest.mark.parametrize(("reshard", "graph"), [(False, "forward"), (False, "backward"), (True, "forward"),
                                                (True, "backward")])
def test_schedule_keeps_bucket_counts_issue_order_and_compute_order(applied: ApplyFn, reshard: bool,
                                                                    graph: Direction,
                                                                    policy: dict[str, int]) -> None:
    step = _step(reshard)
    gm = applied(step, graph, {"plan": "llama_layers", "policy": policy})
    merged = merged_collectives(gm, step, graph)
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    record = gm.meta["overlapcfg"]
    for kind in ("all_gather", "reduce_scatter"):
        expected = original_order(step, graph, kind)
        mine = sorted((m for m in merged if m.kind == kind), key=lambda m: pos[m.start])
        # one merged collective per bucket, and nothing left unmerged
        assert [m.bucket for m in mine] == expected, f"{kind} issue order"
        assert sum(1 for k, _ in collective_starts(gm) if k == kind) == len(expected)
        assert record.after.get(graph, kind) == len(expected)
        assert all(m.direction == graph for m in mine)
        # issue order of one process group (all share the default group here) is the original issue order
        assert [m.bucket for m in mine] == original_order(step, graph, kind, by="start")
        if kind == "all_gather":
            assert [m.bucket for m in sorted(mine, key=lambda m: pos[m.wait])] == expected, "compute order"
    compute_before = [n.name for n in step.graph(graph).graph.nodes if is_compute_node(n)]
    compute_after = [n.name for n in gm.graph.nodes if is_compute_node(n)]
    assert compute_after == compute_before


def test_every_merged_collective_carries_exactly_its_buckets_sources(applied: ApplyFn) -> None:
    step = _step(True)
    gm = applied(step, "backward", {"plan": "llama_layers"})
    merged = merged_collectives(gm, step, "backward")
    sources = sorted(s for m in merged for s in m.sources)
    assert sources == sorted(c.node for c in step.collectives_in("backward"))


def test_bucket_record_lists_the_parameters_each_bucket_gathers(applied: ApplyFn) -> None:
    step = _step(False)
    gm = applied(step, "forward", {"plan": "llama_layers"})
    want: dict[str, list[str]] = {}
    for c in step.collectives_in("forward", "all_gather"):  # the parameter FQNs the descriptors name
        want.setdefault(c.module_fqn.split(".")[0] if not c.module_fqn.startswith("layers") else
                        ".".join(c.module_fqn.split(".")[:2]), []).append(c.param_fqn)
    got = {b.name: list(b.params) for b in gm.meta["overlapcfg"].buckets}
    want["norm+output"] = want.pop("norm") + want.pop("output")
    assert got == want


# --- upstream equality -------------------------------------------------------------------------------------

UPSTREAM_PLANS = ["llama_layers", "two_layers_per_bucket", "single_bucket"]


def _order(gm: Any) -> list[tuple[str, str]]:
    return [(n.name, str(n.target)) for n in gm.graph.nodes]


def _order_with_inputs(gm: Any) -> list[tuple[str, str, tuple[str, ...]]]:
    return [(n.name, str(n.target), tuple(a.name for a in n.all_input_nodes)) for n in gm.graph.nodes]


@pytest.fixture(scope="module")
def depth_one_pair(applied: ApplyFn) -> Iterator[Callable[[bool, Direction, str], tuple[Any, Any]]]:
    """``pair(reshard, graph, plan) -> (ours, upstream's)``: the 2-layer step's graph after ``manual`` at depth 1
    and after ``torch_manual``, each applied once for the module. The two upstream tests below read both (they
    never rewrite them); applying again per test would redo the same passes."""
    cache: dict[tuple[bool, str, str], tuple[Any, Any]] = {}

    def pair(reshard: bool, graph: Direction, plan: str) -> tuple[Any, Any]:
        if (reshard, graph, plan) not in cache:
            step = traced_step(2, reshard)
            cache[(reshard, graph, plan)] = (applied(step, graph, {"plan": plan}),
                                             applied(step, graph, {"plan": plan, "strategy": "torch_manual"}))
        return cache[(reshard, graph, plan)]

    yield pair
    cache.clear()


@upstream_is_the_reference
@pytest.mark.parametrize("plan", UPSTREAM_PLANS)
@pytest.mark.parametrize(("reshard", "graph"), [(False, "forward"), (False, "backward"), (True, "forward"),
                                                (True, "backward")])
def test_depth_one_node_order_equals_upstream_manual_overlap_bucketing(
        depth_one_pair: Callable[[bool, Direction, str], tuple[Any, Any]], reshard: bool, graph: Direction,
        plan: str) -> None:
    ours, upstream = depth_one_pair(reshard, graph, plan)
    assert _order(ours) == _order(upstream)


@upstream_is_the_reference
@pytest.mark.parametrize("plan", UPSTREAM_PLANS)
@pytest.mark.parametrize(("reshard", "graph"), [(False, "forward"), (False, "backward"), (True, "forward"),
                                                (True, "backward")])
def test_depth_one_merged_inputs_are_in_upstream_order(
        depth_one_pair: Callable[[bool, Direction, str], tuple[Any, Any]], reshard: bool, graph: Direction,
        plan: str) -> None:
    """Stronger than names and targets: every node reads the same inputs in the same order (buffer layout)."""
    ours, upstream = depth_one_pair(reshard, graph, plan)
    assert _order_with_inputs(ours) == _order_with_inputs(upstream)
