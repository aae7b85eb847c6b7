"""Conformance on models nobody here wrote: Hugging Face Llama / Qwen2 / Mixtral / tied-embedding Llama (sharded
SimpleFSDP-style by ``tests/thirdparty/models.py``) and torchtitan's Llama3 sharded by torchtitan's own
``data_parallel`` (fully_shard, and hybrid_shard on 4 fake ranks).

For each model, three routes into overlapcfg:

- ``apply``: graphs captured WITHOUT overlapcfg, no ``module_fqn_fn``: attribution comes from the graphs' own
  metadata (module stacks with HF's ``L['args'][0]`` root, torchtitan's ``meta["custom"]``). They are aot's graphs
  of the backend route's compile, copied as aot hands them over, before overlapcfg reads or stamps them
  (``_captured``): node for node what ``capture_graphs`` traces in a compile of its own, for half the tracing;
- ``backend``: ``torch.compile(model, backend=overlapcfg.backend(cfg), fullgraph=True)``, one forward + backward;
- ``explain``: on an untransformed captured graph (it applies the config to a copy).

Every expectation is measured independently of overlapcfg (``tests/thirdparty/conformance.py`` reads only the final
graphs): collective counts per graph and kind, which parameters each merged collective carries (sizes per bucket,
from aot descriptors and dynamo sources), the prefetch depths and reduce-scatter delays the final node order
achieves. Two models also run one step on 2 real gloo ranks, bit for bit against an untransformed compile.

Each model is captured once per module (``runs``); torchtitan's models are built, captured and transformed inside
one fake process group (their DeviceMesh binds its groups at shard time), which is closed before the test body
sees the results. No test may leave a default process group open (``_no_process_group_left_open``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import fx

import overlapcfg
from overlapcfg import compat
from overlapcfg.demo.gloo import run_on_gloo
from overlapcfg.passes import apply
from overlapcfg.report.explain import explain
from tests.support.merge_traces import CountedTraces, fake_mode_of, graph_layout, tensor_values
from tests.support.rank_warmup import preloaded
from tests.support.releases import TORCH_RELEASE
from tests.thirdparty import conformance as C
from tests.thirdparty import models as M

GRAPHS = ("forward", "backward")
DEPTHS = (1, 2)
BACKEND_DEPTH = 2

# Collectives per graph, counted in the graphs themselves: (before, after). 2 layers, hidden 64, 2 ranks.
EXPECTED: dict[str, dict[str, tuple[dict[str, int], dict[str, int]]]] = {
    "hf_llama": {"forward": ({"all_gather": 21}, {"all_gather": 4}),
                 "backward": ({"all_gather": 20, "reduce_scatter": 21}, {"all_gather": 3, "reduce_scatter": 4})},
    "hf_qwen2": {"forward": ({"all_gather": 27}, {"all_gather": 4}),
                 "backward": ({"all_gather": 20, "reduce_scatter": 27}, {"all_gather": 3, "reduce_scatter": 4})},
    # embed, (dense, experts) x 2, [norm, lm_head]; the backward re-gathers neither the embedding nor the 3-D experts.
    "hf_mixtral": {"forward": ({"all_gather": 21}, {"all_gather": 6}),
                   "backward": ({"all_gather": 16, "reduce_scatter": 21}, {"all_gather": 3, "reduce_scatter": 6})},
    # The tied weight's gradient is two reduce-scatters added before the output; both are merged.
    "hf_tied": {"forward": ({"all_gather": 20}, {"all_gather": 4}),
                "backward": ({"all_gather": 20, "reduce_scatter": 21}, {"all_gather": 4, "reduce_scatter": 4})},
    "tt_fully_shard": {"forward": ({"all_gather": 17}, {"all_gather": 4}),
                       "backward": ({"reduce_scatter": 17}, {"reduce_scatter": 4})},
    # One embedding weight serves encoder, decoder and the tied head: its gradient is the sum of three
    # reduce-scattered partials, all merged into the bucket of its first user (encoder.embed_tokens).
    "hf_t5": {"forward": ({"all_gather": 47}, {"all_gather": 7}),
              "backward": ({"all_gather": 45, "reduce_scatter": 49}, {"all_gather": 7, "reduce_scatter": 7})},
    # torchtitan's Qwen3 ties tok_embeddings to lm_head: two partial gradients, one owner (tok_embeddings).
    "tt_qwen3_tied": {"forward": ({"all_gather": 20}, {"all_gather": 4}),
                      "backward": ({"reduce_scatter": 21}, {"reduce_scatter": 4})},
    "tt_hybrid_shard": {"forward": ({"all_gather": 17}, {"all_gather": 4}),
                        # HSDP: each gradient all-reduced on the replicate group, then reduce-scattered on the
                        # shard group; both halves bucketed (one all-reduce and one reduce-scatter per bucket).
                        "backward": ({"all_reduce": 17, "reduce_scatter": 17},
                                     {"all_reduce": 4, "reduce_scatter": 4})},
}
# Both routes recognize the tied weight's two partial-gradient reduce-scatters (summed before the output) and
# merge them (see test_tied_gradient_reduce_scatters_are_bucketed_alike_by_apply_and_backend).
NON_FSDP: dict[tuple[str, str, str], int] = {}
BUCKET_NAMES = {
    "hf_decoder_layers": ["model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head+model.norm"],
    "torchtitan_layers": ["tok_embeddings", "layers.0", "layers.1", "lm_head+norm"],
}
CASES = list(EXPECTED)


# --- one capture per model and module -----------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
    case: C.Case
    captured: M.CapturedGraphs
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    """Parameter FQN -> (local shard shape, full shape)."""
    errors: dict[str, Exception] = dataclasses.field(default_factory=dict)
    """Route -> what it raised in the fixture; ``require`` re-raises it in that route's tests only."""
    applied: dict[int, dict[str, fx.GraphModule]] = dataclasses.field(default_factory=dict)
    """depth -> graph -> a copy of the captured graph after ``apply``."""
    backend: Any = None
    """The ``GraphBackend`` after one compiled forward + backward at ``BACKEND_DEPTH``."""
    backend_dynamo: fx.GraphModule | None = None
    backend_pre: dict[str, fx.GraphModule] = dataclasses.field(default_factory=dict)
    """aot's graphs as the backend's passes received them (owners stamped, not yet transformed)."""
    explained: dict[str, Any] = dataclasses.field(default_factory=dict)
    """graph -> ``explain`` report on the untransformed captured graph."""
    untouched: dict[str, bool] = dataclasses.field(default_factory=dict)
    """graph -> whether the captured graph kept its node names and got no pass record while being explained."""

    def original(self, graph: str) -> fx.GraphModule:
        return getattr(self.captured, graph)

    def require(self, *routes: str) -> Run:
        for route in routes:
            if route in self.errors:
                raise AssertionError(f"{self.case.name}: the {route} route failed") from self.errors[route]
        return self

    @contextlib.contextmanager
    def route(self, name: str) -> Iterator[None]:
        try:
            yield
        except Exception as err:
            self.errors[name] = err


def _names(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes]


def _explain(run: Run) -> None:
    with run.route("explain"):
        for name in GRAPHS:
            gm = run.original(name)
            before = _names(gm)
            run.explained[name] = explain(gm, {"plan": run.case.plan}, graph_kind=name)
            run.untouched[name] = _names(gm) == before and "overlapcfg" not in gm.meta


@contextlib.contextmanager
def _aot_graphs_handed_to_the_backend(into: dict[str, list[fx.GraphModule]]) -> Iterator[None]:
    """While active, ``into["forward"]`` / ``into["backward"]`` receive copies of the graphs aot_autograd hands the
    overlapcfg backend's compilers, taken before the backend reads or stamps them: aot_autograd as
    ``overlapcfg.passes.backend`` calls it (through ``overlapcfg.compat``) gets compilers that copy first."""
    real = compat.aot_autograd

    def keep(kind: str, compiler: Callable[..., Any]) -> Callable[..., Any]:
        def compile_graph(gm: fx.GraphModule, example_inputs: Any) -> Any:
            into[kind].append(M.copy_graph_module(gm))
            return compiler(gm, example_inputs)

        return compile_graph

    def aot_autograd(*, fw_compiler: Callable[..., Any], bw_compiler: Callable[..., Any], **kwargs: Any) -> Any:
        return real(fw_compiler=keep("forward", fw_compiler), bw_compiler=keep("backward", bw_compiler), **kwargs)

    compat.aot_autograd = aot_autograd
    try:
        yield
    finally:
        compat.aot_autograd = real


def _backend(case: C.Case, model: torch.nn.Module, inputs: tuple[Any, ...], loss_fn: Callable[[Any], Any],
             pre: dict[str, fx.GraphModule], dynamo: list[fx.GraphModule],
             plain: dict[str, list[fx.GraphModule]]) -> Any:
    """One compiled forward + backward with ``overlapcfg.backend`` at ``BACKEND_DEPTH``; returns the backend.
    ``plain`` receives aot's graphs before the backend touched them (``_aot_graphs_handed_to_the_backend``)."""
    be = overlapcfg.backend(case.config(BACKEND_DEPTH))
    torch._dynamo.reset()
    try:
        with _aot_graphs_handed_to_the_backend(plain):
            compiled = torch.compile(model, backend=C.spied_backend(be, dynamo, pre), fullgraph=True)
            loss_fn(compiled(*inputs)).backward()
    finally:
        torch._dynamo.reset()
        model.zero_grad(set_to_none=True)
    assert len(dynamo) == 1, f"{len(dynamo)} dynamo graphs (graph break)"
    return be


def _captured(dynamo: list[fx.GraphModule], plain: dict[str, list[fx.GraphModule]], world_size: int,
              seconds: float) -> M.CapturedGraphs | None:
    """The graphs captured without overlapcfg: the backend route's dynamo graph and the forward and backward graphs
    aot_autograd made from it, copied as aot handed them to the backend's compilers, before overlapcfg read or
    stamped anything. The backend runs aot_autograd exactly as ``M.capture_graphs`` does (min-cut partitioner; the
    compilers see aot's graphs as they are), so these are the graphs a second compile with ``M.capture_graphs``
    would trace again (twice the tracing time): compared node for node (names, targets, arguments, ``meta`` but for
    process-wide counters: ``seq_nr``, ``from_node``'s graph ids) for every case when this was written. None if
    the backend route did not get that far (it then fails its own tests; the capture traces afresh)."""
    if len(dynamo) == 1 and len(plain["forward"]) == 1 and len(plain["backward"]) == 1:
        inputs = len(dynamo[0].graph.find_nodes(op="placeholder"))  # what dynamo handed the backend, aot's inputs
        return M.CapturedGraphs(dynamo_graph=M.copy_graph_module(dynamo[0]), forward=plain["forward"][0],
                                backward=plain["backward"][0], joint_inputs=inputs, seconds=seconds,
                                world_size=world_size, rank=0)
    return None


def _run(case: C.Case) -> Run:
    ws = case.world_size
    torchtitan = case.needs_group
    # torchtitan's mesh binds process groups at shard time: one group for build, backend, capture and apply.
    with M.fake_process_group(ws) if torchtitan else contextlib.nullcontext():
        model, make_batch = C.build(case)
        inputs, loss_fn = make_batch()
        shapes = C.param_shapes(model, ws)
        with contextlib.nullcontext() if torchtitan else M.fake_process_group(ws):
            pre: dict[str, fx.GraphModule] = {}
            dynamo: list[fx.GraphModule] = []
            plain: dict[str, list[fx.GraphModule]] = {"forward": [], "backward": []}
            backend_error: Exception | None = None
            started = time.perf_counter()
            try:
                be = _backend(case, model, inputs, loss_fn, pre, dynamo, plain)
            except Exception as err:  # as ``Run.route``: the backend route's tests re-raise it
                backend_error = err
            seconds = time.perf_counter() - started  # the compile, forward and backward both routes share
            captured = _captured(dynamo, plain, ws, seconds) or M.capture_graphs(model, inputs, loss_fn, world_size=ws)
            run = Run(case, captured, shapes, backend_pre=pre)
            if backend_error is not None:
                run.errors["backend"] = backend_error
            else:
                run.backend, run.backend_dynamo = be, dynamo[0]
            with run.route("apply"):
                for depth in DEPTHS:
                    cfg = overlapcfg.load_config(case.config(depth))
                    run.applied[depth] = {name: apply(M.copy_graph_module(run.original(name)), cfg, graph_kind=name)
                                          for name in GRAPHS}
        # explain opens its own fake group for a bare graph; torchtitan HSDP's graphs name mesh sub-groups that
        # only the group they were traced under has (see test_explain_bare_hsdp_graph_without_its_groups).
        if torchtitan:
            _explain(run)
    if not torchtitan:
        _explain(run)
    return run


@pytest.fixture(scope="module")
def runs() -> Iterator[Callable[[str], Run]]:
    cache: dict[str, Run] = {}

    def get(name: str) -> Run:
        if name not in cache:
            cache[name] = _run(C.CASES[name])
        return cache[name]

    yield get
    cache.clear()


@pytest.fixture(autouse=True)
def _no_process_group_left_open() -> Iterator[None]:
    assert not dist.is_initialized(), "a default process group was open before this test"
    yield
    leaked = dist.is_initialized()
    if leaked:
        dist.destroy_process_group()
    assert not leaked, "this test left a default process group open"


# --- expectations -----------------------------------------------------------------------------------------------

def _expected(path: str, case: str, graph: str) -> tuple[dict[str, int], dict[str, int], int]:
    """``(graph counts before, graph counts after, non-FSDP collectives)`` for a route (``apply``/``backend``)."""
    before, after = EXPECTED[case][graph]
    return before, after, NON_FSDP.get((path, case, graph), 0)


def _fsdp(graph: str, graph_counts: dict[str, int], non_fsdp_rs: int) -> dict[tuple[str, str], int]:
    """The FSDP part of a graph's counts, keyed as overlapcfg's record keys them."""
    out = {(graph, k): n for k, n in graph_counts.items() if k in ("all_gather", "reduce_scatter", "all_reduce")}
    if non_fsdp_rs:
        out[(graph, "reduce_scatter")] -= non_fsdp_rs
    return out


def _assert_counts(path: str, case: str, graph: str, final: fx.GraphModule) -> None:
    record = final.meta["overlapcfg"]
    before, after, non_fsdp = _expected(path, case, graph)
    rs_left = non_fsdp if case == "hf_tied" else 0
    assert C.counts(final) == after
    assert {(d, k): n for d, k, n in record.before.fsdp} == _fsdp(graph, before, rs_left)
    assert {(d, k): n for d, k, n in record.after.fsdp} == _fsdp(graph, after, rs_left)
    assert record.before.other == record.after.other == len(record.non_fsdp) == non_fsdp
    assert record.uncovered == ()


def _assert_depths(run: Run, graph: str, final: fx.GraphModule, depth: int) -> dict[str, list[int]]:
    original = run.original(graph)
    ags = C.merged(final, original, "all_gather")
    rss = C.merged(final, original, "reduce_scatter")
    ars = C.merged(final, original, "all_reduce")
    got = {"all_gather": C.prefetch_depths(final, ags), "reduce_scatter": C.reduce_scatter_delays(final, rss),
           "all_reduce": C.reduce_scatter_delays(final, ars)}
    want = {"all_gather": C.expected_depths(depth, len(ags)), "reduce_scatter": C.expected_depths(depth, len(rss)),
            "all_reduce": C.expected_depths(depth, len(ars))}
    assert got == want, (graph, depth)
    return got


def _assert_bucket_contents(run: Run, graph: str, final: fx.GraphModule) -> None:
    """Merged collectives carry exactly the parameters the hand-written plan puts in each bucket: full-size
    elements per merged all-gather in compute order, per merged reduce-scatter as a multiset."""
    original, dynamo = run.original(graph), run.captured.dynamo_graph
    ags = C.merged(final, original, "all_gather")
    want_ag = C.bucket_numels(original, dynamo, "all_gather", run.case.bucket_of)
    assert C.compute_order_numels(final, ags) == list(want_ag.values()), list(want_ag)
    rss = C.merged(final, original, "reduce_scatter")
    left = final.meta["overlapcfg"].non_fsdp
    want_rs = C.bucket_numels(original, dynamo, "reduce_scatter", run.case.bucket_of, skip=left)
    assert sorted(c.numel for c in rss) == sorted(want_rs.values()), list(want_rs)


# --- (a) apply on graphs captured without overlapcfg ------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_apply_on_captured_graphs_merges_every_fsdp_collective_and_leaves_the_rest(
        runs: Callable[[str], Run], case: str) -> None:
    run = runs(case).require("apply")
    for graph in GRAPHS:
        assert C.counts(run.original(graph)) == EXPECTED[case][graph][0]
        # captured without overlapcfg: nothing of its own on any node (``_captured`` copies before the backend)
        assert not [n.name for n in run.original(graph).graph.nodes if "overlapcfg" in n.meta], graph
        for depth in DEPTHS:
            final = run.applied[depth][graph]
            _assert_counts("apply", case, graph, final)
            _assert_bucket_contents(run, graph, final)


@pytest.mark.slow
@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("case", CASES)
def test_apply_achieves_the_requested_depths(runs: Callable[[str], Run], case: str, depth: int) -> None:
    run = runs(case).require("apply")
    got = {graph: _assert_depths(run, graph, run.applied[depth][graph], depth) for graph in GRAPHS}
    assert len(got["forward"]["all_gather"]) == EXPECTED[case]["forward"][1]["all_gather"]


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if isinstance(C.CASES[c].plan, str)])
def test_apply_names_buckets_by_module_fqns_without_the_dynamo_root(runs: Callable[[str], Run], case: str) -> None:
    """Regression: HF's decorated ``forward`` makes the dynamo root ``L['args'][0]``; it once leaked into module
    FQNs as a ``0.`` segment (``0.model.layers.0``), so no pattern matched. torchtitan's graphs once came back with
    every collective uncovered. Per bucket, the record's counts must match the independent attribution."""
    run = runs(case).require("apply")
    for graph in GRAPHS:
        record = run.applied[1][graph].meta["overlapcfg"]
        assert [b.name for b in record.buckets] == BUCKET_NAMES[run.case.plan]
        for b in record.buckets:
            assert all(not m.split(".")[0].isdigit() and "[" not in m for m in b.modules), b.modules
        independent: Counter[tuple[str, str, int]] = Counter()
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            per_bucket = _owner_counts(run, graph, kind, skip=record.non_fsdp)
            independent.update((kind, b, n) for b, n in per_bucket.items())
        recorded = Counter((c.kind, _tag(b.name), c.before) for b in record.buckets for c in b.collectives)
        assert recorded == independent


def _tag(bucket_name: str) -> str:
    """overlapcfg's bucket names -> the hand-written plan's (``model.layers.0`` -> ``layers.0``)."""
    if "norm" in bucket_name:
        return "head"
    if "embed" in bucket_name:
        return "embed"
    return bucket_name.removeprefix("model.")


def _owner_counts(run: Run, graph: str, kind: str, skip: tuple[str, ...]) -> dict[str, int]:
    original, dynamo = run.original(graph), run.captured.dynamo_graph
    out: Counter[str] = Counter()
    for c in C.collectives(original):
        if c.kind != kind or c.start.name in skip:
            continue
        if kind == "all_reduce":  # HSDP (torchtitan: all-reduce first): the gradient its reduce-scatter returns
            rs = [u for u in c.wait.users if u.target is compat.REDUCE_SCATTER_TENSOR]
            waits = [w for w in rs[0].users] if len(rs) == 1 else []
            param = C.reduced_param(waits[0], dynamo) if len(waits) == 1 else None
        elif kind == "all_gather":
            param = C.gathered_param(c.start, dynamo)
        else:
            param = C.reduced_param(c.wait, dynamo)
        if param is not None:
            out[run.case.bucket_of(param.rpartition(".")[0])] += 1
    return dict(out)


@pytest.mark.slow
def test_mixtral_dense_and_experts_are_separate_buckets_gathered_in_compute_order(runs: Callable[[str], Run]) -> None:
    """Mixtral's plan puts each layer's attention, norms and router in one bucket and its experts in another: six
    forward all-gathers, gathered embed, dense 0, experts 0, dense 1, experts 1, head (sizes from the model)."""
    run = runs("hf_mixtral").require("apply", "backend")
    dense = ("input_layernorm", "mlp.gate", "post_attention_layernorm", "self_attn")
    want_modules = [("model.embed_tokens",), *[tuple(f"model.layers.{i}.{m}" for m in dense) for i in (0, 1)],
                    ("model.layers.0.mlp.experts",), ("model.layers.1.mlp.experts",), ("lm_head", "model.norm")]
    order = ["embed", "layers.0.dense", "layers.0.experts", "layers.1.dense", "layers.1.experts", "head"]
    sizes: Counter[str] = Counter()
    for param, (_, full) in run.shapes.items():
        sizes[run.case.bucket_of(param.rpartition(".")[0])] += int(torch.Size(full).numel())
    assert set(sizes) == set(order)
    for original, final in ((run.original("forward"), run.applied[1]["forward"]),
                            (run.backend_pre["forward"], run.backend.graphs["forward"])):
        assert [b.modules for b in final.meta["overlapcfg"].buckets] == want_modules
        ags = C.merged(final, original, "all_gather")
        assert C.compute_order_numels(final, ags) == [sizes[b] for b in order]


@pytest.mark.slow
def test_a_second_capture_of_a_third_party_model_is_merged_from_the_kept_traces_with_values_of_its_own(
        runs: Callable[[str], Run], monkeypatch: pytest.MonkeyPatch) -> None:
    """The merge's traces are shared between captures of the same shapes (``overlapcfg.graph.traces``): a second,
    independent capture of Hugging Face's Llama (its own dynamo run, aot trace and fake mode) is merged with no
    merge function traced, into the graph the first capture's merge gave, and every fake value of the result is
    of the second capture's mode, on storages the first capture's merged graph does not use."""
    run = runs("hf_llama").require("apply")
    cfg = overlapcfg.load_config(run.case.config(1))
    with M.fake_process_group(run.case.world_size):
        # the first capture merged again: its traces are the most recently used, whatever ran in this process since
        first = {name: apply(M.copy_graph_module(run.original(name)), cfg, graph_kind=name) for name in GRAPHS}
        counted = CountedTraces(monkeypatch)
        model, make_batch = C.build(run.case)
        inputs, loss_fn = make_batch()
        again = M.capture_graphs(model, inputs, loss_fn, world_size=run.case.world_size)
        second = {name: apply(M.copy_graph_module(getattr(again, name)), cfg, graph_kind=name) for name in GRAPHS}
    assert counted.calls == 0  # every bucket stamped from a kept trace
    for name in GRAPHS:
        mode = fake_mode_of(getattr(again, name))
        assert mode is not fake_mode_of(run.original(name))
        assert graph_layout(second[name]) == graph_layout(first[name]), name
        values = tensor_values(second[name])
        assert all(v.fake_mode is mode for v in values), name
        theirs = {compat.storage_id(v) for v in tensor_values(first[name])}
        assert not theirs & {compat.storage_id(v) for v in values}, name
    assert C.counts(second["forward"]) == EXPECTED["hf_llama"]["forward"][1]


# --- (b) the torch.compile backend ------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_backend_merges_every_fsdp_collective_and_achieves_the_depths(runs: Callable[[str], Run], case: str) -> None:
    run = runs(case).require("backend")
    for graph in GRAPHS:
        assert C.counts(run.backend_pre[graph]) == EXPECTED[case][graph][0]
        final = run.backend.graphs[graph]
        _assert_counts("backend", case, graph, final)
        _assert_depths(_as_original(run, graph), graph, final, BACKEND_DEPTH)


def _as_original(run: Run, graph: str) -> Run:
    """The backend's own pre-pass graphs as the originals (their node names are what the final graph kept)."""
    captured = dataclasses.replace(run.captured, dynamo_graph=run.backend_dynamo, **{
        name: run.backend_pre[name] for name in GRAPHS})
    return dataclasses.replace(run, captured=captured)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_backend_attributes_each_collective_to_the_parameter_it_carries(runs: Callable[[str], Run],
                                                                        case: str) -> None:
    """Regression: a DTensor parameter is two aot flat inputs (local shard + mesh), so flat positions do not index
    dynamo's inputs; attribution once named the wrong parameter. Each attributed collective's ``param_fqn`` must
    be the one its descriptor names (FINDINGS.md algorithm, written here) and match the shapes moved."""
    run = runs(case).require("backend")
    for graph in GRAPHS:
        pre = {n.name: n for n in run.backend_pre[graph].graph.nodes}
        owners = run.backend.collectives[graph]
        fsdp = [c for c in C.collectives(run.backend_pre[graph]) if c.kind in ("all_gather", "reduce_scatter")]
        assert [o.node for o in owners] == [c.start.name for c in fsdp]
        for owner in owners:
            start, wait = pre[owner.node], pre[owner.wait]
            shard, full = run.shapes[owner.param_fqn]
            assert owner.module_fqn == owner.param_fqn.rpartition(".")[0]
            if owner.kind == "all_gather":
                assert C.gathered_param(start, run.backend_dynamo) == owner.param_fqn, owner
                assert tuple(start.args[0].meta["val"].shape) == shard, owner
                assert tuple(start.meta["val"].shape) == full, owner
            else:
                assert C.reduced_param(wait, run.backend_dynamo) == owner.param_fqn, owner
                assert tuple(start.args[0].meta["val"].shape) == full, owner
                assert tuple(wait.meta["val"].shape) == shard, owner


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_backend_module_tree_has_no_dynamo_root_segment(runs: Callable[[str], Run], case: str) -> None:
    run = runs(case).require("backend")
    fqns = run.backend.module_fqns
    layer = {"hf_t5": "encoder.block.0"}.get(case, "model.layers.0" if run.case.hf else "layers.0")
    assert layer in fqns
    assert not [f for f in fqns if f.split(".")[0].isdigit() or "args" in f or "[" in f]


# --- (c) explain on an untransformed graph ----------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_explain_applies_to_a_copy_of_an_untransformed_graph(runs: Callable[[str], Run], case: str) -> None:
    """Regression: ``explain`` on a graph ``apply`` never saw used to raise (no pass record)."""
    run = runs(case).require("explain", "apply")
    for graph in GRAPHS:
        report = run.explained[graph]
        assert run.untouched[graph], "explain changed the graph it was given"
        (g,) = report.graphs
        before, after, non_fsdp = _expected("apply", case, graph)
        rs_left = non_fsdp if case == "hf_tied" else 0
        assert g.name == graph
        assert g.collectives_before == sum(_fsdp(graph, before, rs_left).values())
        assert g.collectives_after == sum(_fsdp(graph, after, rs_left).values())
        assert g.uncovered == ()
        assert len(g.non_fsdp) == non_fsdp
        assert [b.name for b in report.buckets] == [b.name for b in run.applied[1][graph].meta["overlapcfg"].buckets]
        assert C.counts(report.forward if graph == "forward" else report.backward) == after


# --- non-FSDP collectives ----------------------------------------------------------------------------------------

def _all_reduces(gm: fx.GraphModule) -> list[tuple[str, tuple[Any, ...], str]]:
    return [(c.start.name, tuple(a.name if isinstance(a, fx.Node) else a for a in c.start.args), c.wait.name)
            for c in C.collectives(gm) if c.kind == "all_reduce"]


@pytest.mark.slow
def test_hsdp_all_reduces_are_bucketed_on_their_own_group_and_chained(runs: Callable[[str], Run]) -> None:
    """torchtitan HSDP reduces each gradient twice: all-reduce on the replicate group ('1'), then reduce-scatter on
    the shard group ('3'). Both halves are bucketed: per bucket one all-reduce on '1' carrying exactly the bytes
    of its gradients, read by that bucket's reduce-scatter; delays as asked, measured in the final graph."""
    run = runs("tt_hybrid_shard").require("apply", "backend", "explain")
    original = run.original("backward")
    want = sorted(c.numel for c in C.collectives(original) if c.kind == "all_reduce")
    assert len(want) == 17 and {c.start.args[-1] for c in C.collectives(original) if c.kind == "all_reduce"} == {"1"}
    for depth, final in [(d, run.applied[d]["backward"]) for d in DEPTHS] + [
            (BACKEND_DEPTH, run.backend.graphs["backward"])]:
        ars = [c for c in C.collectives(final) if c.kind == "all_reduce"]
        rss = [c for c in C.collectives(final) if c.kind == "reduce_scatter"]
        assert len(ars) == len(rss) == 4 and {c.start.args[-1] for c in ars} == {"1"}
        assert {c.start.args[-1] for c in rss} == {"3"}
        assert sum(c.numel for c in ars) == sum(want)  # no gradient dropped or reduced twice
        pos = {n: i for i, n in enumerate(final.graph.nodes)}
        for ar in ars:  # each bucket's reduce-scatter is issued after its all-reduce completes
            readers = [rs for rs in rss if ar.wait in _ancestors(rs.start, 6)]
            assert len(readers) == 1 and pos[readers[0].start] > pos[ar.wait]
        assert C.reduce_scatter_delays(final, ars) == C.expected_depths(depth, 4)
        record = final.meta["overlapcfg"]
        assert record.non_fsdp == ()
        assert [(d.bucket, d.effective) for d in record.decisions if d.kind == "all_reduce"] == list(
            zip(["lm_head+norm", "layers.1", "layers.0", "tok_embeddings"], C.expected_depths(depth, 4), strict=True))
    roles = run.explained["backward"].graphs[0].roles
    assert dict(roles) == {"fsdp_reduce_scatter": 17, "hsdp_all_reduce": 17}


def _ancestors(node: fx.Node, depth: int) -> set[fx.Node]:
    seen, frontier = set(), {node}
    for _ in range(depth):
        frontier = {i for n in frontier for i in n.all_input_nodes} - seen
        seen |= frontier
    return seen


SHARED = {  # case -> (the shared weight as dynamo names it (first access), its uses, the bucket owning its gradient)
    "hf_tied": ("model.embed_tokens.weight", 2, "model.embed_tokens"),
    "hf_t5": ("encoder.embed_tokens.weight", 3, "encoder.embed_tokens"),
    "tt_qwen3_tied": ("tok_embeddings.weight", 2, "tok_embeddings"),
}


def _partials(run: Run, original: fx.GraphModule, dynamo: fx.GraphModule) -> list[C.Coll]:
    return [c for c in C.collectives(original) if c.kind == "reduce_scatter"
            and C.reduced_param(c.wait, dynamo, through_sum=False) is None]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SHARED))
def test_apply_buckets_a_shared_weights_partial_gradient_reduce_scatters(runs: Callable[[str], Run],
                                                                        case: str) -> None:
    """On a captured graph, a weight used by N modules has one reduce-scatter per use, summed before the output
    (``add(add(rs_a, rs_b), rs_c)`` for T5's embedding, shared by encoder, decoder and the tied head): torch's
    ``is_fsdp_reduce_scatter`` misses them; overlapcfg recognizes every partial as FSDP's and merges all of them
    into the bucket of the weight's first user, as the backend (which has the descriptors) does. On the tied
    torchtitan Qwen3 the backend once raised an AttributionError (descriptor: tok_embeddings; custom: lm_head)."""
    run = runs(case).require("apply", "backend")
    param, uses, owner = SHARED[case]
    original, final = run.original("backward"), run.applied[1]["backward"]
    record = final.meta["overlapcfg"]
    assert record.non_fsdp == ()
    summed = _partials(run, original, run.captured.dynamo_graph)
    assert len(summed) == uses
    assert all(C.reduced_param(c.wait, run.captured.dynamo_graph) == param for c in summed)
    buckets = {b.name: b for b in record.buckets}
    before_rs = sum(n for k, n in EXPECTED[case]["backward"][0].items() if k == "reduce_scatter")
    assert record.before.get("backward", "reduce_scatter") == before_rs
    assert any(b.name.startswith(owner) for b in buckets.values())
    by_backend = run.backend.graphs["backward"].meta["overlapcfg"]
    assert (record.before, record.after) == (by_backend.before, by_backend.after)
    for rec in (record, by_backend):  # the partials' bucket, by the bytes it reduces: the owner's plus the rest
        (bucket,) = [b for b in rec.buckets if b.name.startswith(owner)]
        change = bucket.changes("backward", "reduce_scatter")
        assert change is not None and change.before >= uses and change.after == 1


# --- explain with no process group, on a graph that names mesh sub-groups --------------------------------------

@pytest.mark.slow
def test_explain_bare_hsdp_graph_without_its_groups_says_what_to_do(runs: Callable[[str], Run]) -> None:
    """A fake default group cannot stand in for mesh sub-groups ('3' = fsdp): a clear error, not torch's
    'Could not resolve the process group registered under the name 3' from inside the merge."""
    from overlapcfg.errors import UnsupportedGraphError

    run = runs("tt_hybrid_shard")
    with pytest.raises(UnsupportedGraphError, match=r"process group\(s\) '3'.*inside the process groups"):
        explain(run.original("forward"), {"plan": "torchtitan_layers"}, graph_kind="forward")


@pytest.mark.slow
def test_explain_bare_fully_shard_graph_outside_its_group(runs: Callable[[str], Run]) -> None:
    """The same without sub-groups works: torchtitan fully_shard names only the default group ``'0'``."""
    run = runs("tt_fully_shard")
    report = explain(run.original("forward"), {"plan": "torchtitan_layers"}, graph_kind="forward")
    assert (report.graphs[0].collectives_before, report.graphs[0].collectives_after) == (17, 4)


# --- 2-rank gloo parity ---------------------------------------------------------------------------------------------

PARITY = ("hf_llama", "hf_tied", "tt_fully_shard")
PARITY_TIMEOUT_S = 420  # a hang guard for the whole spawn, which runs alongside this module's captures


@pytest.fixture(scope="module", autouse=True)
def _parity_in_background(request: pytest.FixtureRequest) -> Iterator[dict[str, Future[list[dict[str, Any]]]]]:
    """Start the gloo parity run (2 spawned ranks, both models) before this module's first capture, if a parity
    test is selected: the ranks' imports and compiles then overlap the captures instead of adding their wall time
    at the end. The executor is joined at module teardown, so no rank outlives the module."""
    futures: dict[str, Future[list[dict[str, Any]]]] = {}
    # Only the cases whose tests run (a selection by node id, or the compat tier skipping torchtitan's models where
    # they do not import): a rank building a skipped case's model would fail the run for every case.
    selected = {item.callspec.params["case"] for item in request.session.items
                if item.module is request.module and "parity" in getattr(item, "fixturenames", ())
                and item.get_closest_marker("skip") is None}
    if not selected:
        yield futures
        return
    jobs = [(case, {"strategy": "manual", "plan": C.CASES[case].plan, "policy": {"forward_prefetch": 2}})
            for case in PARITY if case in selected]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="conformance-gloo") as pool:
        futures["parity"] = pool.submit(run_on_gloo, C.parity_worker, jobs, world_size=2,
                                        timeout_s=PARITY_TIMEOUT_S, preload=preloaded(C.__name__))
        yield futures


@pytest.fixture(scope="module")
def parity(_parity_in_background: dict[str, Future[list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    results = _parity_in_background["parity"].result()
    assert not dist.is_initialized()
    return results


@pytest.mark.slow
@pytest.mark.parametrize("case", PARITY)
def test_one_training_step_on_gloo_is_bitwise_identical_to_the_untransformed_compile(
        parity: list[dict[str, Any]], case: str) -> None:
    results = [res[case] for res in parity]
    for rank, res in enumerate(results):
        got, ref = res["transformed"], res["reference"]
        assert got["uncovered"] == 0
        # each graph's schedule compared across both ranks by the backend, found equal, silently
        assert len(got["same_schedule"]) == 2, rank
        assert all(c.startswith("checked: the same ") for c in got["same_schedule"]), (rank, got["same_schedule"])
        if TORCH_RELEASE < (2, 14):
            assert got["counts"] == {g: EXPECTED[case][g][1] for g in GRAPHS}, rank
            assert ref["counts"] == {g: EXPECTED[case][g][0] for g in GRAPHS}, rank
        else:  # torch 2.14 traces these models otherwise (a tied weight's gather is saved for the backward, not
            # gathered again; torchtitan gathers the embedding twice): EXPECTED is 2.11-2.13's; buckets still merge
            assert all(sum(got["counts"][g].values()) <= sum(ref["counts"][g].values()) for g in GRAPHS), rank
            assert sum(sum(got["counts"][g].values()) for g in GRAPHS) < sum(
                sum(ref["counts"][g].values()) for g in GRAPHS), rank
        assert torch.isfinite(got["loss"]) and torch.equal(got["loss"], ref["loss"]), rank
        assert list(got["grads"]) == list(ref["grads"]) and got["grads"], rank
        for name, grad in got["grads"].items():
            assert torch.equal(grad, ref["grads"][name]), (rank, name)
        if "eager_loss" in res:  # the collectives really communicated: the sharded loss is the unsharded one
            torch.testing.assert_close(got["loss"], res["eager_loss"])
    # Both ranks computed the same full-model loss from their own shards, and hold different gradient shards.
    assert torch.equal(results[0]["transformed"]["loss"], results[1]["transformed"]["loss"])
    assert list(results[0]["transformed"]["grads"]) == list(results[1]["transformed"]["grads"])
    assert any(not torch.equal(a, b) for a, b in zip(results[0]["transformed"]["grads"].values(),
                                                      results[1]["transformed"]["grads"].values(), strict=True))


# --- the independent checker itself (no capture) ----------------------------------------------------------------

def _hand_built(order: str) -> fx.GraphModule:
    """A graph of all-gathers ``a``/``b``/``c`` started (``S``) and waited (``W``) in the order given, e.g.
    ``"Sa Sb Wa Sc Wb Wc"``."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    starts: dict[str, fx.Node] = {}
    outs = []
    for op in order.split():
        name = op[1]
        if op[0] == "S":
            starts[name] = graph.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default,
                                               (x, 2, "0"), name=f"ag_{name}")
        else:
            outs.append(graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (starts[name],),
                                            name=f"wait_{name}"))
    graph.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize(("order", "depths"), [
    ("Sa Wa Sb Wb Sc Wc", [0, 0, 0]),
    ("Sa Sb Wa Sc Wb Wc", [1, 1, 0]),
    ("Sa Sb Sc Wa Wb Wc", [2, 1, 0]),
    ("Sb Sa Wa Wb Sc Wc", [1, 0, 0]),
])
def test_depth_checker_counts_other_gathers_in_flight_at_each_wait(order: str, depths: list[int]) -> None:
    gm = _hand_built(order)
    assert C.prefetch_depths(gm, C.collectives(gm)) == depths
    assert C.expected_depths(2, 3) == [2, 1, 0] and C.expected_depths(1, 4) == [1, 1, 1, 0]


@pytest.mark.slow  # traces the third-party models (the module's shared captures)
@pytest.mark.parametrize("case", ["hf_llama", "hf_qwen2", "tt_fully_shard"])
def test_calibration_finds_one_attention_call_per_layer_at_the_models_own_shape(runs: Callable[[str], Run],
                                                                               case: str) -> None:
    """What calibration times for attention, read from graphs nobody here wrote: one call per decoder layer, at
    the batch x query heads, sequence length and head dimension the tiny configs give (KV heads grouped or not,
    the FLOPs are the query heads'). Causal as the pricing reads the call: torchtitan's attention passes
    ``is_causal=True`` (a kernel that skips the masked half); Hugging Face's builds its mask from the positions and
    passes it as a tensor, so the kernel computes every score, and it is priced and timed as a full call."""
    from overlapcfg.measuring.attention_timing import attention_shapes

    run = runs(case)
    shapes = attention_shapes([run.original("forward"), run.original("backward")])
    heads = 4  # tests.thirdparty.models: 4 query heads (2 KV heads) in every one of these configs
    causal = case.startswith("tt_")
    assert shapes == Counter({(M.BATCH * heads, M.SEQ_LEN, M.HIDDEN // heads, causal): M.LAYERS}), shapes


@pytest.mark.slow  # traces the third-party models (the module's shared captures)
@pytest.mark.parametrize("case", ["hf_llama", "hf_t5", "tt_fully_shard"])
def test_calibration_probes_the_skew_with_one_of_the_models_own_all_gathers(runs: Callable[[str], Run],
                                                                           case: str) -> None:
    """The skew's probe (``overlapcfg.measuring.skew.skew_unit``) is an all-gather of the step's median all-gather
    size: every all-gather of graphs nobody here wrote is counted at its gathered size, checked against the
    conformance reader's own count and sizes (``tests/thirdparty/conformance.py``)."""
    from overlapcfg.measuring.kernels import matmul_mix
    from overlapcfg.measuring.skew import skew_unit

    run = runs(case)
    graphs = [run.original("forward"), run.original("backward")]
    gathers = [c for gm in graphs for c in C.collectives(gm) if c.kind == "all_gather"]
    expected = Counter(c.numel * c.start.meta["val"].dtype.itemsize for c in gathers)
    mix = matmul_mix(graphs)
    assert mix.gathers == expected
    assert sum(expected.values()) == sum(EXPECTED[case][g][0].get("all_gather", 0) for g in GRAPHS)
    sizes = sorted(expected.elements())
    assert skew_unit(mix).probe_bytes == sizes[(len(sizes) - 1) // 2]  # the lower median by count


@pytest.mark.slow  # a 2-rank gloo run (forked warm) beside the module's shared captures
def test_the_skew_probe_runs_on_two_gloo_ranks_at_a_third_party_models_own_sizes(runs: Callable[[str], Run]) -> None:
    """Calibration's skew and wake-up timing (``time_skew``) with the compute and the probe all-gather read from
    Hugging Face Llama's captured step, on 2 real gloo ranks: both ranks run the same cycles (the repeats are agreed,
    else the ranks would issue different numbers of all-gathers and hang) and return the same gathered waits; the
    no-compute reference repeats most, the longest length once a round; the fit takes the waits."""
    from overlapcfg.measuring.kernels import matmul_mix
    from overlapcfg.measuring.skew import LENGTHS, MAX_REPEATS, skew_fit, skew_unit

    run = runs("hf_llama")
    mix = matmul_mix([run.original("forward"), run.original("backward")])
    rounds = 2
    first, second = run_on_gloo(C.skew_worker, mix, rounds, world_size=2, timeout_s=180,
                                preload=preloaded(C.__name__))
    assert first == second
    unit = skew_unit(mix)
    assert first.unit == unit.describe() and unit.probe_bytes in mix.gathers  # one of the model's own sizes
    cycles = [len(length) for length in first.waits]
    assert len(cycles) == len(LENGTHS["cpu"]) and cycles[0] == rounds * MAX_REPEATS and cycles[-1] == rounds
    assert all(len(cycle) == 2 and min(cycle) > 0 for length in first.waits for cycle in length)
    assert list(first.compute) == sorted(first.compute) and first.compute[-1] > 0.05  # about 0.1 s, the longest
    skew, samples = skew_fit(first)
    assert len(samples.sigma_seconds) == len(cycles) and len(skew.wake) >= 2


@pytest.mark.slow  # a 2-rank gloo run (forked warm) compiling the model once per config
def test_measure_on_two_gloo_ranks_reads_a_third_party_models_collectives_and_each_ranks_exposed_time() -> None:
    """``overlapcfg.measure`` on Hugging Face Llama sharded by SimpleFSDP, unbucketed and one bucket per decoder
    layer: every rank returns the same measurement; every collective of the graphs it ran (found in the profiler's
    trace by issue order) has a measured duration; each rank's exposed communication is kept, their mean is the
    column (two timed steps: each median is a mean), the bucketed graphs issued fewer collectives, and the eager
    loss's stretch between the graphs is measured."""
    from overlapcfg.measuring.measure_result import Measurement

    configs = {"none": {"strategy": "none"}, "layers": {"plan": "hf_decoder_layers"}}
    first, second = run_on_gloo(C.measure_worker, "hf_llama", configs, world_size=2, timeout_s=240,
                                preload=preloaded(C.__name__))
    assert first == second
    m = Measurement.from_json(first)
    assert [c.name for c in m.configs] == list(configs) and m.world_size == 2
    for c in m.configs:
        assert c.collectives and all(k.measured_s is not None and k.measured_s > 0 for k in c.collectives), (
            c.name, [k.node for k in c.collectives if not k.measured_s])
        assert len(c.measured_exposed_by_rank_s) == 2 and min(c.measured_exposed_by_rank_s) >= 0, c.name
        assert c.measured_exposed_s == pytest.approx(sum(c.measured_exposed_by_rank_s) / 2, rel=1e-9), c.name
        # measured in the timed step itself (its waits timed), a part of it; the profiler's figure kept beside
        assert c.measured_exposed_in == "timed steps" and 0 <= c.measured_exposed_s <= max(c.step_seconds), c.name
        assert c.measured_profiled_exposed_s is not None and c.predicted_step_s > 0, c.name
    none, layers = m.configs
    assert none.measured_exposed_s > 0  # every collective waited for as it is issued
    assert len(layers.collectives) < len(none.collectives)  # the pass merged them
    # the loss runs eagerly between the compiled forward and backward: the gap the ranks drift across is measured
    assert m.between_graphs_s is not None and 0 < m.between_graphs_s < min(c.measured_wall_s for c in m.configs)


@pytest.mark.slow  # traces the third-party models (the module's shared captures)
@pytest.mark.parametrize("case", ["hf_llama", "hf_mixtral", "tt_fully_shard"])
def test_calibration_replays_the_kernels_of_graphs_nobody_here_wrote(runs: Callable[[str], Run], case: str) -> None:
    """The in-turn replay (``overlapcfg.measuring.step_kernels``) on Hugging Face's and torchtitan's captured
    steps: every kind of kernel is found, every node is either a replayed call or counted as left out, and the
    replay runs each call it keeps on made-up tensors of the traced layout."""
    from overlapcfg.cost.price import node_kind
    from overlapcfg.measuring.step_kernels import kernel_census, replayed, time_in_turn

    run = runs(case)
    graphs = [run.original("forward"), run.original("backward")]
    calls, left_out = kernel_census(graphs)
    assert {c.kind for c in calls} == {"compute", "memory", "view"}, calls
    kernel_nodes = sum(1 for gm in graphs for n in gm.graph.nodes if n.op == "call_function"
                       and node_kind(n) in ("compute", "memory", "free") and n.target is not operator.getitem
                       and getattr(n.target, "__module__", None) not in ("_operator", "builtins", "math"))
    assert sum(calls.values()) + left_out == kernel_nodes  # nothing dropped without being counted
    kept = replayed(calls)
    seconds = time_in_turn(kept, torch.device("cpu"), rounds=2).seconds
    refused = sorted({c.op for c, s in zip(kept, seconds, strict=True) if s is None})
    assert refused == [], refused
