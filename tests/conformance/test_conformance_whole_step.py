"""Conformance on torchtitan graph_trainer's whole-step graphs: the joint route (``apply(gm, cfg, graph_kind=
"joint")``) on graphs torchtitan traced and normalized itself (``tests/thirdparty/graph_trainer.py``, no overlapcfg).

Models: torchtitan's Llama3 and a tied Qwen3 (``tok_embeddings`` tied to ``lm_head``), SimpleFSDP ``fully_shard``
on 2 ranks, reshard-after-forward "always" and "never", with and without the optimizer step traced in. Plan
``torchtitan_layers`` (torchtitan's own: ``tok_embeddings``, ``layers.N``, ``[norm, lm_head]``).

Every expectation is measured independently of overlapcfg (``tests/thirdparty/conformance.py`` reads the final
graphs: op targets, node order, ``meta["val"]`` sizes, the ``autograd_backward`` tags and torchtitan's own
``meta["custom"]["module_fqn"]``): collective counts per direction and kind, the parameters each merged
collective carries (sizes per bucket), the depths the node order achieves, and that no backward all-gather is
issued while the forward still computes. torchtitan's own joint pass runs on the same graphs for comparison; one
step on 2 real gloo ranks is bit for bit the untransformed step's.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import textwrap
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import fx

import overlapcfg
from overlapcfg import compat
from overlapcfg.demo.gloo import run_on_gloo
from overlapcfg.graph.parameters import state_input_names
from overlapcfg.passes import PassOptions, apply
from tests.support.rank_warmup import preloaded
from tests.support.warm_cli import shared
from tests.thirdparty import conformance as C
from tests.thirdparty import graph_trainer as G

pytestmark = pytest.mark.slow

VARIANTS = [(m, r, o) for m in G.MODELS for r in G.RESHARD for o in (False, True)]
IDS = [f"{m}-{r}{'-optim' if o else ''}" for m, r, o in VARIANTS]
DEPTHS = (1, 2)
DIRECTED = (("forward", "all_gather"), ("backward", "all_gather"), ("backward", "reduce_scatter"))

# Collectives per (direction, kind), counted in the graphs: (before, after). 2 layers, 2 ranks. The optimizer
# changes none of them. Qwen3 has q/k norms (9 parameters a block); its tied weight is one input gathered once,
# whose two uses (tok_embeddings, lm_head) get one reduce-scatter each. "always": the remat pass re-gathers every
# block's and the head's parameters in backward, not the embedding's (15 / 19).
EXPECTED: dict[tuple[str, str], dict[tuple[str, str], tuple[int, int]]] = {
    ("llama3", "always"): {DIRECTED[0]: (17, 4), DIRECTED[1]: (15, 3), DIRECTED[2]: (17, 4)},
    ("llama3", "never"): {DIRECTED[0]: (17, 4), DIRECTED[2]: (17, 4)},
    ("qwen3_tied", "always"): {DIRECTED[0]: (20, 4), DIRECTED[1]: (19, 3), DIRECTED[2]: (21, 4)},
    ("qwen3_tied", "never"): {DIRECTED[0]: (20, 4), DIRECTED[2]: (21, 4)},
}


def _config(depth: int, **extra: Any) -> dict[str, Any]:
    policy = {"forward_prefetch": depth, "backward_prefetch": depth, "reduce_scatter_delay": depth}
    return {"strategy": "manual", "plan": "torchtitan_layers", "policy": policy, **extra}


def _counts(gm: fx.GraphModule) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for c in C.collectives(gm):
        key = (C.direction(c.start), c.kind)
        out[key] = out.get(key, 0) + 1
    return out


@pytest.fixture(scope="module")
def joint(whole_step: Callable[..., G.WholeStep]) -> Iterator[Callable[..., fx.GraphModule]]:
    """``joint(model, reshard, optimizer, depth, graph_kind="joint")``: the captured graph after ``apply``, cached
    for the module (a fake group of 2 is open only while applying)."""
    cache: dict[tuple[Any, ...], fx.GraphModule] = {}

    def get(model: str, reshard: str, optimizer: bool, depth: int, graph_kind: str = "joint") -> fx.GraphModule:
        key = (model, reshard, optimizer, depth, graph_kind)
        if key not in cache:
            step = whole_step(model, reshard, optimizer)
            with compat.fake_process_group(step.world_size):
                cache[key] = apply(step.copy(), overlapcfg.load_config(_config(depth)), graph_kind=graph_kind)
        return cache[key]

    yield get
    cache.clear()


def _torchtitan(step: G.WholeStep, **kwargs: Any) -> fx.GraphModule:
    with compat.fake_process_group(step.world_size), compat.upstream_scheduler_scope():
        return step.torchtitan_bucketing(**kwargs)


# --- recognition and counts --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("model", "reshard", "optimizer"), VARIANTS, ids=IDS)
def test_every_fsdp_collective_of_a_whole_step_graph_is_recognized_and_merged(
        whole_step: Callable[..., G.WholeStep], joint: Callable[..., fx.GraphModule],
        model: str, reshard: str, optimizer: bool) -> None:
    """Regression: the graph's inputs are ``arg0_1 ...`` with no aot descriptors, so every all-gather used to be
    classified "other" and left at depth 0, silently (and with the optimizer traced in, the reduce-scatters too,
    with a warning about FSDP2). The structure says which inputs are parameter shards."""
    step = whole_step(model, reshard, optimizer)
    want = EXPECTED[(model, reshard)]
    assert _counts(step.gm) == {k: before for k, (before, _) in want.items()}
    for depth in DEPTHS:
        final = joint(model, reshard, optimizer, depth)
        record = final.meta["overlapcfg"]
        assert _counts(final) == {k: after for k, (_, after) in want.items()}
        assert {(d, k): n for d, k, n in record.before.fsdp} == {k: before for k, (before, _) in want.items()}
        assert {(d, k): n for d, k, n in record.after.fsdp} == {k: after for k, (_, after) in want.items()}
        assert record.before.other == record.after.other == 0
        assert record.uncovered == ()
        assert not [n for n in record.notes if "FSDP2" in n or "shard views" in n or "look like FSDP" in n]


@pytest.mark.parametrize(("model", "reshard", "optimizer"), VARIANTS, ids=IDS)
def test_merged_collectives_carry_the_plans_parameters_in_each_direction(
        whole_step: Callable[..., G.WholeStep], joint: Callable[..., fx.GraphModule],
        model: str, reshard: str, optimizer: bool) -> None:
    """Per direction: the full-size elements of each merged all-gather in compute order, and of the merged
    reduce-scatters as a multiset, are the hand-written plan's buckets (torchtitan's annotations; a tied weight's
    partial gradients in the bucket of its first user)."""
    step = whole_step(model, reshard, optimizer)
    final = joint(model, reshard, optimizer, 1)
    for which, kind in EXPECTED[(model, reshard)]:
        want = C.whole_step_bucket_numels(step.gm, kind, which, C._tt_bucket)
        got = C.of_direction(C.merged(final, step.gm, kind), which)
        if kind == "all_gather":
            assert C.compute_order_numels(final, got) == list(want.values()), (which, list(want))
        else:
            assert sorted(c.numel for c in got) == sorted(want.values()), list(want)


def test_gathered_inputs_are_the_parameters_torchtitan_traced_as_state(whole_step: Callable[..., G.WholeStep],
                                                                       joint: Callable[..., fx.GraphModule]) -> None:
    """What overlapcfg recognized by structure agrees with torchtitan's own record of its inputs (``TracedResult.
    state_fqns``): every gathered input is a parameter of the module the annotation names; and the record names
    parameters by those FQNs when the state list is given as evidence."""
    step = whole_step("llama3", "always", False)
    names = step.input_fqns()
    layouts = step.traced.input_subclass_layouts
    counts = [layouts[i].num_tensors if i in layouts else 1 for i in range(len(step.traced.state_fqns))]
    assert state_input_names(step.gm.graph, step.traced.state_fqns, counts) == names
    gathered = [c for c in C.collectives(step.gm) if c.kind == "all_gather"]
    assert len(gathered) == 32
    for c in gathered:
        assert names[c.start.args[0].name].rpartition(".")[0] == C.custom_module(c.start), c.start.name
    with compat.fake_process_group(step.world_size):
        named = apply(step.copy(), overlapcfg.load_config(_config(1)), graph_kind="joint",
                      options=PassOptions(state_inputs=names))
    by_bucket = {b.name: set(b.params) for b in named.meta["overlapcfg"].buckets}
    assert by_bucket == {
        "tok_embeddings": {"tok_embeddings.weight"}, "lm_head+norm": {"norm.weight", "lm_head.weight"},
        **{f"layers.{i}": {n for n in names.values() if n.startswith(f"layers.{i}.") and n.endswith(".weight")}
           for i in (0, 1)}}
    assert joint("llama3", "always", False, 1).code == named.code


# --- depths ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize(("model", "reshard", "optimizer"), VARIANTS, ids=IDS)
def test_forward_backward_prefetch_and_reduce_scatter_delay_mean_what_they_mean_on_split_graphs(
        whole_step: Callable[..., G.WholeStep], joint: Callable[..., fx.GraphModule],
        model: str, reshard: str, optimizer: bool, depth: int) -> None:
    step = whole_step(model, reshard, optimizer)
    final = joint(model, reshard, optimizer, depth)
    for which, kind in EXPECTED[(model, reshard)]:
        got = C.of_direction(C.merged(final, step.gm, kind), which)
        measured = C.prefetch_depths(final, got) if kind == "all_gather" else C.reduce_scatter_delays(final, got)
        assert measured == C.expected_depths(depth, len(got)), (which, kind)


@pytest.mark.parametrize(("model", "reshard", "optimizer"), [v for v in VARIANTS if v[1] == "always"],
                         ids=[i for i, v in zip(IDS, VARIANTS, strict=True) if v[1] == "always"])
def test_no_backward_all_gather_is_issued_before_the_last_forward_compute(
        joint: Callable[..., fx.GraphModule], model: str, reshard: str, optimizer: bool) -> None:
    """The first backward bucket is prefetched behind the loss, not hoisted into the forward (where it would hold
    a second copy of the head's parameters across the whole forward)."""
    for depth in DEPTHS:
        final = joint(model, reshard, optimizer, depth)
        nodes = list(final.graph.nodes)
        first_backward = next(i for i, n in enumerate(nodes) if C.direction(n) == "backward")
        last_forward_compute = max(i for i, n in enumerate(nodes[:first_backward])
                                   if n.op == "call_function" and compat.flop_formula(n.target) is not None)
        pos = {n: i for i, n in enumerate(nodes)}
        starts = [pos[c.start] for c in C.collectives(final) if c.kind == "all_gather"
                  and C.direction(c.start) == "backward"]
        assert starts and min(starts) > last_forward_compute


_SEEDED = textwrap.dedent("""
    import hashlib, sys
    sys.path.insert(0, sys.argv[1])
    from tests.support.traces import whole_step_capture
    import overlapcfg
    from overlapcfg import compat
    from overlapcfg.passes import apply

    step = whole_step_capture("llama3", "always", True)
    cfg = {"strategy": "manual", "plan": "torchtitan_layers",
           "policy": {"forward_prefetch": 2, "backward_prefetch": 2, "reduce_scatter_delay": 2}}
    with compat.fake_process_group(2):
        gm = apply(step.copy(), overlapcfg.load_config(cfg), graph_kind="joint")
    print("RESULT " + hashlib.sha256(gm.code.encode()).hexdigest())
""")


def test_a_whole_step_schedule_is_the_same_under_two_hash_seeds(joint: Callable[..., fx.GraphModule]) -> None:
    """Capture, recognition and scheduling (in-place write edges included) are functions of the model: a fresh
    interpreter with another ``PYTHONHASHSEED`` than this one's emits this process's code (a process forked from
    ``tests/support/warm_cli.shared``, which keeps that interpreter's hash seed)."""
    repo = str(Path(__file__).resolve().parents[2])  # on sys.path there: ``tests`` is a package
    proc = shared().run([sys.executable, "-c", _SEEDED, repo], cwd=Path.cwd(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    digest = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")).removeprefix("RESULT ")
    assert digest == hashlib.sha256(joint("llama3", "always", True, 2).code.encode()).hexdigest()


def test_joint_and_auto_graph_kinds_schedule_a_whole_step_alike(joint: Callable[..., fx.GraphModule]) -> None:
    for depth in DEPTHS:
        assert joint("llama3", "always", True, depth, "auto").code == joint("llama3", "always", True, depth).code


# --- against torchtitan's own joint pass -------------------------------------------------------------------------

def _canonical(gm: fx.GraphModule) -> list[tuple[str, str, str, str]]:
    """Every node as (op, target, args, kwargs) with node arguments replaced by their positions: two graphs are
    the same program, node for node, when these lists are equal."""
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}

    def by_position(value: Any) -> str:
        return str(fx.node.map_arg(value, lambda n: pos[n]))

    return [(n.op, str(n.target), by_position(n.args), by_position(n.kwargs)) for n in gm.graph.nodes]


@pytest.mark.parametrize(("model", "reshard"), list(EXPECTED), ids=[f"{m}-{r}" for m, r in EXPECTED])
def test_depth_one_is_torchtitans_joint_pass_node_for_node_where_buckets_are_packed_alike(
        whole_step: Callable[..., G.WholeStep], joint: Callable[..., fx.GraphModule], model: str,
        reshard: str) -> None:
    """torchtitan's ``joint_transformer_block_bucketing_reordering_pass`` and ``apply`` at depth 1 emit the same
    program, node for node, once both pack each bucket's merged buffer in the same order: torchtitan's pass with
    upstream's packing (no FSDP2 parameter order) and its head bucket listed as overlapcfg resolves it (module-tree
    order: ``[lm_head, norm]``)."""
    step = whole_step(model, reshard, False)
    theirs = _torchtitan(step, fsdp2_order=False,
                         module_bucket_plans=["tok_embeddings", "layers.0", "layers.1", ["lm_head", "norm"]])
    assert _canonical(joint(model, reshard, False, 1)) == _canonical(theirs)


_PACKING = ("bucketing._pre_bucket_all_gather", "bucketing._pre_bucket_reduce_scatter", "aten.split_with_sizes")


@pytest.mark.parametrize(("model", "reshard"), list(EXPECTED), ids=[f"{m}-{r}" for m, r in EXPECTED])
def test_depth_one_differs_from_torchtitans_defaults_only_in_the_order_parameters_are_packed(
        whole_step: Callable[..., G.WholeStep], joint: Callable[..., fx.GraphModule], model: str,
        reshard: str) -> None:
    """torchtitan's pass as its trainer binds it packs each bucket in FSDP2's parameter registration order
    (``state_fqns``: ``wqkv, wo, w1, w2, w3, attention_norm, ffn_norm``) and the head bucket as listed
    (``norm, lm_head``); overlapcfg packs as upstream ``manual_overlap_bucketing`` does (module by module in
    module-tree order, graph order within: ``attention_norm, wqkv, wo, ffn_norm, w1, w3, w2``). Same collectives,
    same positions, same buckets and depths: the copy-ins take the same inputs in another order, the splits cut
    the same sizes in another order, and the per-parameter views after them follow."""
    step = whole_step(model, reshard, False)
    ours, theirs = joint(model, reshard, False, 1), _torchtitan(step)
    a, b = _canonical(ours), _canonical(theirs)
    assert [(op, target) for op, target, _, _ in a] == [(op, target) for op, target, _, _ in b]
    assert [C.direction(n) for n in ours.graph.nodes] == [C.direction(n) for n in theirs.graph.nodes]
    differing = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    assert differing  # FSDP2 order and upstream's differ inside every transformer block
    mine, tt = list(ours.graph.nodes), list(theirs.graph.nodes)
    for i in differing:
        if compat.op_name(mine[i].target) in _PACKING:
            first, second = mine[i].args[0], tt[i].args[0]
            same = sorted(map(str, first)) == sorted(map(str, second)) if isinstance(first, list) else \
                sorted(mine[i].args[1]) == sorted(tt[i].args[1])
            assert same, (mine[i].name, mine[i].args, tt[i].args)
        else:  # unpacking: views of a split's pieces, the ops reading them, the outputs
            assert mine[i].target == tt[i].target and len(mine[i].args) == len(tt[i].args), mine[i].name
    for kind in ("all_gather", "reduce_scatter"):
        mine_c, tt_c = C.merged(ours, step.gm, kind), C.merged(theirs, step.gm, kind)
        assert [(C.direction(c.start), c.numel) for c in mine_c] == [(C.direction(c.start), c.numel) for c in tt_c]


@pytest.mark.parametrize(("model", "reshard"), list(EXPECTED), ids=[f"{m}-{r}" for m, r in EXPECTED])
def test_with_the_optimizer_traced_in_reduce_scatters_are_bucketed_where_torchtitans_pass_leaves_them(
        whole_step: Callable[..., G.WholeStep], joint: Callable[..., fx.GraphModule], model: str, reshard: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """With the optimizer in the graph, gradients feed in-place updates (``_foreach_lerp_``, ``_foreach_addcmul_``)
    instead of outputs: torch's ``is_fsdp_reduce_scatter`` (and so torchtitan's pass) no longer sees them. They are
    still gradients: bucketed, at the asked delay, with no warning. The all-gathers are torchtitan's either way."""
    step = whole_step(model, reshard, True)
    theirs = _counts(_torchtitan(step))
    want = EXPECTED[(model, reshard)]
    assert theirs[("backward", "reduce_scatter")] == want[("backward", "reduce_scatter")][0]
    with caplog.at_level(logging.WARNING, logger="overlapcfg"), compat.fake_process_group(step.world_size):
        ours = apply(step.copy(), overlapcfg.load_config(_config(1)), graph_kind="joint")
    assert _counts(ours)[("backward", "reduce_scatter")] == want[("backward", "reduce_scatter")][1]
    assert {k: v for k, v in theirs.items() if k[1] == "all_gather"} == {
        k: v for k, v in _counts(ours).items() if k[1] == "all_gather"}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_tied_weights_gradient_summed_for_the_optimizer_is_reduced_in_its_first_users_bucket(
        whole_step: Callable[..., G.WholeStep], joint: Callable[..., fx.GraphModule]) -> None:
    """Qwen3's tied weight: in the traced optimizer step its two partial gradients (``tok_embeddings``'s and
    ``lm_head``'s reduce-scatters) are summed and feed one update. Both are FSDP's and go to the bucket of the
    weight's first user in forward (``tok_embeddings``), the rule the split-graph routes follow too."""
    step = whole_step("qwen3_tied", "always", True)
    partials = [c for c in C.collectives(step.gm) if c.kind == "reduce_scatter"
                and C.summed_partials(c.wait) is not None]
    assert sorted(C.custom_module(c.start) for c in partials) == ["lm_head", "tok_embeddings"]
    record = joint("qwen3_tied", "always", True, 1).meta["overlapcfg"]
    buckets = {b.name: b.changes("backward", "reduce_scatter") for b in record.buckets}
    assert buckets["tok_embeddings"] is not None and buckets["tok_embeddings"].before == 2
    assert buckets["lm_head+norm"] is not None and buckets["lm_head+norm"].before == 1


# --- 2-rank gloo parity --------------------------------------------------------------------------------------------

PARITY = [("llama3", "always", False, "cross_entropy"), ("qwen3_tied", "always", True, "cross_entropy"),
          ("llama3", "always", False, "chunked")]
"""``(model, reshard, optimizer, loss)``; ``chunked``: the graph trainer's default loss, whose 8 per-chunk
reduce-scatters of ``lm_head``'s gradient are merged into one over the concatenated partials."""
PARITY_DEPTH = 2
PARITY_TIMEOUT_S = 600


@pytest.fixture(scope="module", autouse=True)
def _parity_in_background(request: pytest.FixtureRequest) -> Iterator[dict[str, Future[list[dict[str, Any]]]]]:
    """Start the gloo run before this module's first capture if a parity test is selected (the ranks' imports and
    traces overlap the captures); joined at module teardown."""
    futures: dict[str, Future[list[dict[str, Any]]]] = {}
    if not any("whole_step_parity" in getattr(item, "fixturenames", ()) for item in request.session.items
               if item.module is request.module):
        yield futures
        return
    jobs = [(m, r, o, _config(PARITY_DEPTH), loss) for m, r, o, loss in PARITY]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="whole-step-gloo") as pool:
        futures["parity"] = pool.submit(run_on_gloo, G.whole_step_parity_worker, jobs, C.joint_apply,
                                        world_size=2, timeout_s=PARITY_TIMEOUT_S,
                                        preload=preloaded(G.__name__, C.__name__))
        yield futures


@pytest.fixture(scope="module")
def whole_step_parity(_parity_in_background: dict[str, Future[list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    results = _parity_in_background["parity"].result()
    assert not dist.is_initialized()
    return results


@pytest.mark.parametrize(("model", "reshard", "optimizer", "loss"), PARITY, ids=[G.step_name(*p) for p in PARITY])
def test_one_whole_step_on_gloo_is_bitwise_identical_to_the_untransformed_step(
        whole_step_parity: list[dict[str, Any]], model: str, reshard: str, optimizer: bool, loss: str) -> None:
    """The traced step run by torchtitan's ``run_traced`` on 2 gloo ranks, transformed at depth 2 by the pass
    torchtitan's pipeline runs (its schedule checked the same on both ranks, silently) vs as traced:
    the same loss, the same gradient shards (without the optimizer: the graph's outputs) or the same updated
    parameter shards (with it: the step writes them in place), bit for bit. With the chunked loss, ``lm_head``'s
    8 per-chunk partial gradients travel in one reduce-scatter with ``norm``'s and are summed after it as traced:
    every element is reduced over the same ranks, so the sum is the same bits."""
    name = G.step_name(model, reshard, optimizer, loss)
    results = [res[name] for res in whole_step_parity]
    for rank, res in enumerate(results):
        got, ref = res["transformed"], res["reference"]
        assert ref["collectives"] != got["collectives"], rank  # the step really was transformed
        assert got["same_schedule"].startswith("checked: the same "), (rank, got["same_schedule"])
        if loss == "chunked":  # lm_head's 8 partials and the other 16 gradients: 4 reduce-scatters
            assert (ref["collectives"]["reduce_scatter_tensor"], got["collectives"]["reduce_scatter_tensor"]) == (
                24, 4), rank
        assert torch.isfinite(got["loss"]) and torch.equal(got["loss"], ref["loss"]), rank
        assert len(got["outputs"]) == len(ref["outputs"]) and len(got["params"]) == len(ref["params"]), rank
        assert got["outputs"] or got["params"], rank
        for a, b in zip(got["outputs"], ref["outputs"], strict=True):
            assert torch.equal(a, b), rank
        for key, value in got["params"].items():
            assert torch.equal(value, ref["params"][key]), (rank, key)
    # Both ranks computed the same loss from their own shards and hold different shards of the result.
    assert torch.equal(results[0]["transformed"]["loss"], results[1]["transformed"]["loss"])
    first, second = (r["transformed"]["outputs"] or list(r["transformed"]["params"].values()) for r in results)
    assert any(not torch.equal(a, b) for a, b in zip(first, second, strict=True))
