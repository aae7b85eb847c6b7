"""Mixed-precision SimpleFSDP (bf16 all-gathers, fp32 or bf16 reduce-scatters) through tracing and the pass.

FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` puts a cast in front of every all-gather
(which torch's bucketing folds into the merged copy-in: ``has_mergeable_all_gather_convert_dtype``) and one in
front of every reduce-scatter; ``reduce_dtype=None`` reduces in bf16 and casts *after* the wait instead. Both
shapes are checked: tracing (counts, owners, dtypes), the ``manual`` scheduler against the independent depth
checker (``tests/support/checker.py``), node-for-node equality with upstream at depth 1, and bitwise parity of one
training step on two gloo ranks (gloo on CPU reduces and gathers bf16; checked when these tests were written).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import fx

from overlapcfg.capture import shard_module
from overlapcfg.demo import Llama, LlamaConfig
from overlapcfg.demo.gloo import run_on_gloo
from overlapcfg.demo.tracing import (
    TracedStep,
    compile_with_pass,
    demo_batch,
    trace_train_step,
    train_step,
)
from overlapcfg.graph.attribution import stack_module_fqn
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
)
from tests.support.rank_warmup import preloaded
from tests.support.releases import upstream_is_the_reference
from tests.support.traces import apply_to
from tests.support.variants import REFERENCE, REFERENCE_AGAIN, TAMPERED, Variants, assert_harness_ran_what_it_selected

pytestmark = pytest.mark.slow

CFG = LlamaConfig(n_layers=2)
BF16, FP32 = torch.bfloat16, torch.float32
_c10d = torch.ops._c10d_functional
_CASTS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)

_TRACES: dict[tuple[bool, torch.dtype | None], TracedStep] = {}


def mp_step(reshard: bool, reduce_dtype: torch.dtype | None = FP32) -> TracedStep:
    """The 2-layer step traced with ``param_dtype=bf16`` and ``reduce_dtype`` (memoized; do not mutate it)."""
    key = (reshard, reduce_dtype)
    if key not in _TRACES:
        _TRACES[key] = trace_train_step(CFG, world_size=2, rank=0, reshard_after_forward=reshard,
                                        param_dtype=BF16, reduce_dtype=reduce_dtype)
    return _TRACES[key]


@pytest.fixture(scope="module")
def mp_2l_reshard() -> TracedStep:
    return mp_step(True)


def _expected_params() -> list[tuple[str, str]]:
    return [(name.rpartition(".")[0], name) for name, _ in Llama(CFG).named_parameters()]


def _nodes(gm: fx.GraphModule, target: object) -> list[fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=target))


def _owners(step: TracedStep, graph: Direction, kind: str) -> list[tuple[str, str]]:
    return sorted((c.module_fqn, c.param_fqn) for c in step.collectives_in(graph, kind))  # type: ignore[arg-type]


# --- (a) tracing ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("reshard", [False, True], ids=["keep", "reshard"])
def test_every_parameter_is_gathered_and_reduced_once_and_attributed_to_its_module(reshard: bool) -> None:
    step = mp_step(reshard)
    expected = sorted(_expected_params())
    assert len(_nodes(step.forward, _c10d.all_gather_into_tensor.default)) == len(expected)
    assert len(_nodes(step.backward, _c10d.reduce_scatter_tensor.default)) == len(expected)
    assert _owners(step, "forward", "all_gather") == expected
    assert _owners(step, "backward", "reduce_scatter") == expected
    regathered = [pair for pair in expected if pair[0] != "tok_embeddings"] if reshard else []
    assert _owners(step, "backward", "all_gather") == regathered
    assert (step.param_dtype, step.reduce_dtype) == (BF16, FP32)


@pytest.mark.parametrize("reshard", [False, True], ids=["keep", "reshard"])
def test_all_gathers_cast_the_fp32_primal_to_bf16_just_before_gathering(reshard: bool) -> None:
    """Also in a reshard backward: the cast is recomputed with the gather, so it reads the parameter."""
    step = mp_step(reshard)
    for graph in ("forward", "backward"):
        gm = step.graph(graph)
        for ag in _nodes(gm, _c10d.all_gather_into_tensor.default):
            cast = ag.args[0]
            assert cast.target in _CASTS and len(cast.users) == 1, ag.name
            assert cast.args[0].op == "placeholder", ag.name
            assert cast.args[0].meta["val"].dtype == FP32 and cast.meta["val"].dtype == BF16
            assert ag.meta["val"].dtype == BF16


@pytest.mark.parametrize("reduce_dtype", [FP32, None], ids=["fp32", "bf16"])
def test_reduce_scatters_run_in_the_reduce_dtype_and_return_fp32_gradients(reduce_dtype: torch.dtype | None) -> None:
    step = mp_step(False, reduce_dtype)
    wire = reduce_dtype or BF16
    for rs in _nodes(step.backward, _c10d.reduce_scatter_tensor.default):
        assert rs.args[0].meta["val"].dtype == wire and rs.meta["val"].dtype == wire, rs.name
        assert rs.args[1] == "sum"
        (wait,) = rs.users
        if wire == FP32:  # cast before the reduce-scatter: the wait is the gradient itself
            assert rs.args[0].target in _CASTS
            assert [u.op for u in wait.users] == ["output"]
        else:  # bf16 on the wire: the cast to the shard's dtype follows the wait
            (cast,) = wait.users
            assert cast.target in _CASTS and cast.meta["val"].dtype == FP32
            assert [u.op for u in cast.users] == ["output"]


def test_records_agree_with_bf16_shapes_and_module_stacks(mp_2l_reshard: TracedStep) -> None:
    full_shapes = {name: p.shape for name, p in Llama(CFG).named_parameters()}
    for rec in mp_2l_reshard.collectives:
        node = next(n for n in mp_2l_reshard.graph(rec.graph).graph.nodes if n.name == rec.node)
        full = full_shapes[rec.param_fqn]
        shard = torch.Size((full[0] // 2, *full[1:]))
        out_shape, in_shape = (full, shard) if rec.kind == "all_gather" else (shard, full)
        assert node.meta["val"].shape == out_shape and node.args[0].meta["val"].shape == in_shape, rec
        assert stack_module_fqn(node) == rec.module_fqn, rec


def test_bad_mixed_precision_options_are_refused_before_any_tracing() -> None:
    with pytest.raises(ValueError, match="param_dtype must be a floating-point"):
        shard_module(Llama(CFG), world_size=2, rank=0, param_dtype=torch.int8)
    sharded = shard_module(Llama(CFG), world_size=2, rank=0, param_dtype=BF16)
    with pytest.raises(TypeError, match="already sharded"):
        trace_train_step(sharded, param_dtype=BF16)


# --- (b) the manual scheduler, measured by the independent checker ---------------------------------------------

GRAPHS = [(False, "forward"), (False, "backward"), (True, "forward"), (True, "backward")]


def _has_all_gathers(reshard: bool, graph: Direction) -> bool:
    return graph == "forward" or reshard


def _check_counts_and_dtypes(gm: fx.GraphModule, step: TracedStep, graph: Direction) -> None:
    """One merged collective per bucket and kind, in the wire dtype, and nothing left unmerged."""
    record = gm.meta["overlapcfg"]
    starts = collective_starts(gm)
    for kind, wire in (("all_gather", BF16), ("reduce_scatter", step.reduce_dtype or BF16)):
        buckets = original_order(step, graph, kind)
        assert sum(1 for k, _ in starts if k == kind) == len(buckets) == record.after.get(graph, kind), kind
        assert {n.meta["val"].dtype for k, n in starts if k == kind} <= {wire}, kind


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize(("reshard", "graph"), GRAPHS)
def test_depths_and_bucket_counts_hold_with_casts_in_the_graph(reshard: bool, graph: Direction, k: int) -> None:
    step = mp_step(reshard)
    gm = apply_to(step, graph, {"plan": "llama_layers", "policy": {
        "forward_prefetch": k, "backward_prefetch": k, "reduce_scatter_delay": k}})  # debug=True: verified
    merged = merged_collectives(gm, step, graph)
    _check_counts_and_dtypes(gm, step, graph)
    if _has_all_gathers(reshard, graph):
        order = original_order(step, graph, "all_gather")
        got = achieved_prefetch(gm, merged, graph)
        assert [got[b] for b in order] == expected_prefetch([k] * len(order)), order
    if graph == "backward":
        order = original_order(step, graph, "reduce_scatter")
        delays = achieved_delays(gm, merged)
        assert [delays[b] for b in order] == expected_delays([k] * len(order)), order
    # The folded casts are gone: merged all-gathers read the fp32 primals themselves.
    assert not [n for n in gm.graph.nodes if n.target in _CASTS and n.meta["val"].dtype == BF16
                and n.args[0].op == "placeholder"]


@pytest.mark.parametrize(("reshard", "graph"), [g for g in GRAPHS if _has_all_gathers(*g)])
def test_memory_cap_counts_bf16_bytes_and_binds_where_the_checker_says(reshard: bool, graph: Direction) -> None:
    step = mp_step(reshard)
    order = original_order(step, graph, "all_gather")
    sizes = bucket_sizes(step, graph, "all_gather")  # from the gathered tensors: 2 bytes per element
    layer_elems = sum(p.numel() for n, p in Llama(CFG).named_parameters() if n.startswith("layers.0."))
    assert sizes["layers.0"] == 2 * layer_elems
    cap = 2 * sizes["layers.0"]
    gm = apply_to(step, graph, {"plan": "llama_layers", "policy": {
        "forward_prefetch": 2, "backward_prefetch": 2, "max_inflight_bytes": cap}})
    merged = merged_collectives(gm, step, graph)
    _check_counts_and_dtypes(gm, step, graph)
    got = achieved_prefetch(gm, merged, graph)
    want = expected_prefetch([2] * len(order), [sizes[b] for b in order], cap)
    assert [got[b] for b in order] == want
    assert want != expected_prefetch([2] * len(order)), "the cap was meant to bind"
    assert max(inflight_bytes(gm, merged, graph, sizes).values()) <= cap
    records = {s.bucket: s for s in gm.meta["overlapcfg"].decisions if s.kind == "all_gather"}
    assert [records[b].effective for b in order] == want
    buckets = {b.name: b for b in gm.meta["overlapcfg"].buckets}
    assert all(buckets[b].changes(graph, "all_gather").unsharded_bytes == sizes[b] for b in order)


# --- (c) equality with upstream at depth 1 -----------------------------------------------------------------------

def _order_with_inputs(gm: fx.GraphModule) -> list[tuple[str, str, tuple[str, ...]]]:
    return [(n.name, str(n.target), tuple(a.name for a in n.all_input_nodes)) for n in gm.graph.nodes]


@upstream_is_the_reference
@pytest.mark.parametrize("plan", ["llama_layers", "two_layers_per_bucket", "single_bucket"])
@pytest.mark.parametrize("reduce_dtype", [FP32, None], ids=["rs_fp32", "rs_bf16"])
@pytest.mark.parametrize(("reshard", "graph"), GRAPHS)
def test_depth_one_equals_upstream_node_for_node_with_casts(reshard: bool, graph: Direction,
                                                           reduce_dtype: torch.dtype | None, plan: str) -> None:
    """Same nodes, same order, same inputs. With bf16 reduce-scatters the casts after each merged wait used to
    come out in their original order where upstream emits them breadth first from the wait (buffer layout)."""
    step = mp_step(reshard, reduce_dtype)
    ours = apply_to(step, graph, {"plan": plan})
    upstream = apply_to(step, graph, {"plan": plan, "strategy": "torch_manual"})
    assert _order_with_inputs(ours) == _order_with_inputs(upstream)


# --- (d) numerical parity on two gloo ranks ------------------------------------------------------------------

def _manual(k: int, **policy: Any) -> dict[str, Any]:
    return {"strategy": "manual", "plan": "llama_layers",
            "policy": {"forward_prefetch": k, "backward_prefetch": k, "reduce_scatter_delay": k, **policy}}


_BF16_LAYER_BYTES = 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64)
"""Unsharded bf16 bytes of one transformer block's parameters (one ``layers.*`` bucket)."""
PARITY_CONFIGS: dict[str, dict[str, Any]] = {
    "manual_k0": _manual(0),
    "manual_k1": _manual(1),
    "manual_k2": _manual(2),
    "manual_capped": _manual(2, max_inflight_bytes=_BF16_LAYER_BYTES + 35_000),
}
# (reshard, reduce_dtype, configs). Every config merges the same buckets, and merging is what could change bits;
# the depths only reorder (and ``verify`` checks each order). So each case runs few configs, chosen so that depths
# 0, 1 and 2 and a binding cap all run. Each case is one compile per rank; each config adds an apply and a step.
PARITY_CASES: list[tuple[bool, torch.dtype | None, tuple[str, ...]]] = [
    (False, FP32, ("manual_k1",)),
    (True, FP32, ("manual_k0", "manual_capped")),
    (True, None, ("manual_k2",)),
]


def _run(compiled: torch.nn.Module, variants: Variants, name: str, tokens: torch.Tensor,
         targets: torch.Tensor) -> dict[str, Any]:
    variants.selected = name
    loss, grads = train_step(compiled, tokens, targets)
    graphs = {graph: gms[name] for graph, gms in variants.graphs.items()}
    records = {graph: gm.meta.get("overlapcfg") for graph, gm in graphs.items()}
    wire = {graph: sorted({str(n.meta["val"].dtype) for n in gm.graph.nodes if n.op == "call_function"
                           and str(n.target).startswith(("_c10d_functional.all_gather", "_c10d_functional.reduce"))})
            for graph, gm in graphs.items()}
    return {"loss": loss, "grads": grads, "wire": wire,
            "counts": {graph: (r.before.total_fsdp, r.after.total_fsdp) for graph, r in records.items() if r},
            "capped": [s.bucket for r in records.values() if r for s in r.decisions if s.effective < s.requested
                       and "max_inflight_bytes" in (s.reason or "")],
            "depths": sorted({s.effective for r in records.values() if r for s in r.decisions})}


def _case(model: torch.nn.Module, names: tuple[str, ...], tokens: torch.Tensor,
          targets: torch.Tensor) -> dict[str, Any]:
    """One compile (``tests/support/variants.Variants``): the reference, each named config, the tampered step and
    the reference again."""
    variants = Variants({name: PARITY_CONFIGS[name] for name in names})
    compiled = compile_with_pass(model, backend=variants.backend)
    return {key: _run(compiled, variants, name, tokens, targets) for key, name in variants.runs()}


def _parity_worker(rank: int, world_size: int) -> dict[str, Any]:
    tokens, targets = demo_batch(CFG.vocab_size, seed=100 + rank)
    out: dict[str, Any] = {}
    for reshard, reduce_dtype, names in PARITY_CASES:
        model = shard_module(Llama(CFG, seed=0), world_size=world_size, rank=rank, reshard_after_forward=reshard,
                             param_dtype=BF16, reduce_dtype=reduce_dtype)
        out[f"{reshard}-{reduce_dtype}"] = _case(model, names, tokens, targets)
    out["fp32"] = _case(shard_module(Llama(CFG, seed=0), world_size=world_size, rank=rank), (), tokens, targets)
    return out


@pytest.fixture(scope="module")
def parity() -> list[dict[str, Any]]:
    return run_on_gloo(_parity_worker, world_size=2, timeout_s=240, preload=preloaded(__name__))


@pytest.mark.parametrize(("reshard", "reduce_dtype", "names"), PARITY_CASES,
                         ids=["keep-rs_fp32", "reshard-rs_fp32", "reshard-rs_bf16"])
def test_mixed_precision_step_is_bitwise_identical_to_the_untransformed_step(
        parity: list[dict[str, Any]], reshard: bool, reduce_dtype: torch.dtype | None,
        names: tuple[str, ...]) -> None:
    for rank, res in enumerate(parity):
        case = res[f"{reshard}-{reduce_dtype}"]
        ref = case[REFERENCE]
        for name in names:
            got = case[name]
            assert torch.equal(got["loss"], ref["loss"]), (rank, name)
            assert list(got["grads"]) == list(ref["grads"])
            for param, grad in got["grads"].items():
                assert grad.dtype == FP32 and torch.equal(grad, ref["grads"][param]), (rank, name, param)
            assert all(0 < after < before for before, after in got["counts"].values()), (name, got["counts"])
            assert got["wire"] == ref["wire"], name  # merging kept every collective's dtype
        if "manual_capped" in names:
            assert case["manual_capped"]["capped"], "max_inflight_bytes never reduced a depth"
            assert case["manual_capped"]["depths"] == [0, 1, 2], "the cap left no bucket at depth 2"


def test_the_wire_dtypes_are_what_was_configured_and_matter(parity: list[dict[str, Any]]) -> None:
    """Evidence that the casts happen where configured: bf16 compute changes the loss versus fp32, and only a
    bf16 reduce-scatter leaves every gradient exactly representable in bf16."""
    for res in parity:
        fp32, rs_fp32 = res["fp32"][REFERENCE], res["True-torch.float32"][REFERENCE]
        rs_bf16 = res["True-None"][REFERENCE]
        assert fp32["wire"] == {"forward": ["torch.float32"], "backward": ["torch.float32"]}
        assert rs_fp32["wire"] == {"forward": ["torch.bfloat16"], "backward": ["torch.bfloat16", "torch.float32"]}
        assert rs_bf16["wire"] == {"forward": ["torch.bfloat16"], "backward": ["torch.bfloat16"]}
        assert not torch.equal(fp32["loss"], rs_fp32["loss"])
        assert torch.equal(rs_fp32["loss"], rs_bf16["loss"])  # the reduce dtype touches gradients only

        def bf16_exact(grads: dict[str, torch.Tensor]) -> bool:
            return all(torch.equal(g, g.to(BF16).to(FP32)) for g in grads.values())

        assert bf16_exact(rs_bf16["grads"]) and not bf16_exact(rs_fp32["grads"])


def test_the_harness_runs_the_graphs_it_selects(parity: list[dict[str, Any]]) -> None:
    for res in parity:
        for case in [res[f"{reshard}-{reduce_dtype}"] for reshard, reduce_dtype, _ in PARITY_CASES] + [res["fp32"]]:
            assert_harness_ran_what_it_selected(*((case[key]["loss"], case[key]["grads"])
                                                  for key in (REFERENCE, REFERENCE_AGAIN, TAMPERED)))
