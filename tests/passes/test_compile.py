"""torch.compile integration: ``backend(cfg)`` with the eager and inductor compilers, ``inductor_pass(cfg)`` as
inductor's post-grad pass and its cache key, and config errors raised when the backend is built."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from overlapcfg import compat, load_config
from overlapcfg.capture import shard_module
from overlapcfg.demo import Llama, LlamaConfig
from overlapcfg.demo.gloo import run_on_gloo
from overlapcfg.demo.tracing import StepBackend, compile_with_pass, demo_batch, train_step
from overlapcfg.errors import OverlapConfigError, OverlapVerificationError
from overlapcfg.graph.stamp import forget_traces
from overlapcfg.graph.verify import summarize, verify
from overlapcfg.passes import PassOptions, apply, apply_step
from overlapcfg.passes.compile import INDUCTOR_SETTINGS, OverlapGraphPass, backend, inductor_pass
from tests.support.rank_warmup import preloaded
from tests.support.traces import traced_step

MODEL = LlamaConfig(n_layers=2)
MANUAL: dict[str, Any] = {"strategy": "manual", "plan": "llama_layers"}
INDUCTOR_CFG: dict[str, Any] = {**MANUAL, "policy": {"forward_prefetch": 2, "insert_overlap_deps": True}}

# Measured here (torch 2.13 CPU, gcc, 2 ranks, 1 thread each): the loss is bitwise equal; gradients differ by at
# most 3.7e-8 absolute (largest gradient element 0.15; relative norm error 5.3e-7 per parameter): inductor fuses and
# vectorizes with other reduction orders. 1e-5 leaves two orders of magnitude across compilers and ISAs while
# still catching a wrong schedule (a read before its wait sees an unfinished buffer: errors of O(1)).
RTOL = ATOL = 1e-5


def _sharded(rank: int = 0, world_size: int = 2, reshard: bool = True) -> torch.nn.Module:
    return shard_module(Llama(MODEL, seed=0), world_size=world_size, rank=rank, reshard_after_forward=reshard)


def _fsdp_counts(step_backend: StepBackend) -> dict[str, tuple[int, int]]:
    return {name: (gm.meta["overlapcfg"].before.total_fsdp, gm.meta["overlapcfg"].after.total_fsdp)
            for name, gm in step_backend.graphs.items()}


# --- construction --------------------------------------------------------------------------------------------

def test_backend_rejects_a_bad_config_before_anything_compiles() -> None:
    with pytest.raises(OverlapConfigError, match=r"overlap\.strategy: unknown strategy 'manul'"):
        backend({"strategy": "manul", "plan": "llama_layers"})
    with pytest.raises(OverlapConfigError, match=r"overlap\.policy"):
        backend({**MANUAL, "policy": {"forward_prefetch": -1}})


def test_backend_rejects_an_unknown_compiler() -> None:
    with pytest.raises(TypeError, match="compiler must be 'eager' or 'inductor', got 'aot_eager'"):
        backend(MANUAL, compiler="aot_eager")  # type: ignore[arg-type]


def test_printing_the_backend_never_reads_a_parameter() -> None:
    """``torch.compile`` calls ``str(backend)``; a repr that printed the model would run every ``extra_repr``
    (HF's ``LlamaRMSNorm`` reads ``self.weight``), and each read of a SimpleFSDP-parametrized weight is an
    all-gather that nobody waits for."""
    from tests.thirdparty import models as M

    with compat.fake_process_group(2, 0):
        model = M.shard_simple_fsdp(M.hf_llama()[0], world_size=2)
        reads: list[str] = []
        for name, module in model.named_modules():
            if isinstance(module, M.GatherShard):
                module.register_forward_hook(lambda m, *_, name=name: reads.append(name))
        model.model.norm.weight.sum()  # the counter counts (and the all-gather is waited: .sum() uses it)
        assert len(reads) == 1
        built = backend({"plan": "hf_decoder_layers"}, model=model)  # a plan that fits: checked when built
        text = f"{built} {built!r}"
    assert len(reads) == 1, f"printing the backend read {len(reads) - 1} parametrized weight(s)"
    assert "model=LlamaForCausalLM" in text


def test_inductor_pass_uuid_is_stable_for_equal_configs_and_changes_with_the_config() -> None:
    first = inductor_pass(MANUAL)
    assert isinstance(first, compat.CustomGraphPass)
    assert first.uuid() == inductor_pass(dict(MANUAL)).uuid()
    assert first.uuid() == inductor_pass("strategy: manual\nplan: llama_layers\n").uuid()
    deeper = inductor_pass({**MANUAL, "policy": {"forward_prefetch": 2}})
    other_plan = inductor_pass({**MANUAL, "plan": "single_bucket"})
    assert len({first.uuid(), deeper.uuid(), other_plan.uuid()}) == 3


def test_inductor_pass_bypasses_the_fx_graph_cache_only_where_the_same_schedule_check_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache hit skips post-grad passes: on some ranks but not others, it would skip the check there (upstream's
    hang). So the uuid is None (inductor bypasses its cache) in a multi-rank job with the check on, and a key where
    the check cannot run (no group, one rank, the fake group) or is off."""
    import overlapcfg.passes.compile as compile_module

    checked, unchecked = inductor_pass(MANUAL), inductor_pass({**MANUAL, "check_same_schedule": False})
    assert checked.uuid() is not None and unchecked.uuid() is not None  # no process group here
    monkeypatch.setattr(compile_module, "not_checked", lambda: None)  # as in a job of several ranks
    assert checked.uuid() is None
    assert unchecked.uuid() is not None


def test_inductor_pass_rejects_a_bad_config_at_construction() -> None:
    with pytest.raises(OverlapConfigError, match=r"overlap\.plan: unknown plan preset 'llama_layer'"):
        inductor_pass({"strategy": "manual", "plan": "llama_layer"})


# --- eager compiler, one process -----------------------------------------------------------------------------

@pytest.mark.slow
def test_eager_backend_rewrites_forward_and_backward_graphs() -> None:
    tokens, targets = demo_batch(MODEL.vocab_size)
    step_backend = backend(MANUAL)
    with compat.fake_process_group(2, 0):
        train_step(compile_with_pass(_sharded(), backend=step_backend), tokens, targets)
    # 21 parameters: 21 forward all-gathers; backward re-gathers 20 (not the embedding) and reduce-scatters 21.
    # llama_layers has 4 buckets, and the embedding's bucket has no backward all-gather.
    assert _fsdp_counts(step_backend) == {"forward": (21, 4), "backward": (41, 7)}


@pytest.mark.slow
def test_verify_and_record_see_through_the_control_deps_of_insert_overlap_deps() -> None:
    step = traced_step(MODEL.n_layers, reshard_after_forward=True)  # shared, read-only: apply_step copies
    counts = {}
    for applied in apply_step(step, load_config(INDUCTOR_CFG)).graphs:
        wrapped = [n for n in applied.graph.graph.nodes if "control_deps" in str(n.target)]
        assert wrapped, "insert_overlap_deps=True should have wrapped the waits"
        counts[applied.name] = applied.record.after.fsdp
    assert counts == {"forward": (("forward", "all_gather", 4),),
                      "backward": (("backward", "all_gather", 3), ("backward", "reduce_scatter", 4))}


@pytest.mark.slow
def test_verify_still_catches_a_wrapped_wait_moved_before_its_start() -> None:
    step = traced_step(MODEL.n_layers, reshard_after_forward=False)  # shared, read-only: deep-copied below
    with compat.fake_process_group(2, 0):
        gm = apply(copy.deepcopy(step.forward), load_config(INDUCTOR_CFG), module_fqn_fn=step.module_fqn_fn("forward"),
                   module_fqns=step.module_fqns, graph_kind="forward")
    wrapped = next(n for n in gm.graph.nodes if "control_deps" in str(n.target))
    start = compat.unwrap_control_deps(wrapped)[1][0]
    start.prepend(wrapped)  # the wait now runs before the collective it waits on
    with pytest.raises(OverlapVerificationError, match=wrapped.name):
        verify(summarize(gm, direction="forward"), gm, direction="forward")


# --- inductor --------------------------------------------------------------------------------------------------

def _inductor_worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """The same step eagerly (untransformed) and through ``backend(cfg, compiler="inductor")``.

    The reference runs the sharded model without compiling it: the untransformed aot-eager route is bitwise the eager
    step on this model (``tests/demo/test_models.py``, parity on gloo), so a compile of its own would only add a
    dynamo and aot trace per rank."""
    tokens, targets = demo_batch(MODEL.vocab_size, seed=100 + rank)
    ref_loss, ref_grads = train_step(_sharded(rank, world_size), tokens, targets)
    step_backend = backend(cfg, compiler="inductor")
    loss, grads = train_step(compile_with_pass(_sharded(rank, world_size), backend=step_backend), tokens, targets)
    return {"ref_loss": ref_loss, "ref_grads": ref_grads, "loss": loss, "grads": grads,
            "merged": {name: len([n for n in gm.graph.nodes if "all_gather" in str(n.target)])
                       for name, gm in step_backend.graphs.items()},
            "checked": [gm.meta["overlapcfg"].same_schedule for gm in step_backend.graphs.values()]}


@pytest.mark.slow
def test_inductor_backend_matches_eager_within_tolerance_on_two_gloo_ranks() -> None:
    """Each graph's schedule is also checked the same on both ranks, silently, before inductor lowers it."""
    for rank, res in enumerate(run_on_gloo(_inductor_worker, INDUCTOR_CFG, world_size=2, timeout_s=280,
                                                preload=preloaded(__name__))):
        torch.testing.assert_close(res["loss"], res["ref_loss"], rtol=RTOL, atol=ATOL)
        assert list(res["grads"]) == list(res["ref_grads"])
        for name, grad in res["grads"].items():
            torch.testing.assert_close(grad, res["ref_grads"][name], rtol=RTOL, atol=ATOL, msg=f"rank {rank} {name}")
        assert res["merged"]["forward"] < 21  # the graphs inductor lowered were the rewritten ones
        assert len(res["checked"]) == 2 and all(c.startswith("checked: the same ") for c in res["checked"])


@pytest.mark.slow
def test_inductor_pass_rewrites_inductors_post_grad_graphs() -> None:
    # No FX graph cache: an earlier compile of the same graph with the same pass uuid would be a cache hit (which is
    # the point of uuid()) and the pass would not run at all. Compiled kernels may come from the cache (the gloo
    # test above compiled this model's kernels): the pass runs on the graph before them. ``seen`` proves it ran.
    seen: list[Any] = []
    rewritten: list[torch.fx.GraphModule] = []
    left_to_inductor: list[bool] = []

    class Recording(OverlapGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            super().__call__(graph)
            gm = graph.owning_module
            seen.append(gm.meta["overlapcfg"])
            rewritten.append(gm)
            if not isinstance(gm, compat.LazyGraphModule):  # reading a lazy module's code would generate it
                left_to_inductor.append(gm.code != graph.python_code(root_module="self").src)

    tokens, targets = demo_batch(MODEL.vocab_size)
    post_pass = Recording(inductor_pass(MANUAL).cfg)
    compat.dynamo_reset()
    with compat.fake_process_group(2, 0), \
            compat.inductor_config_patch({**INDUCTOR_SETTINGS, "post_grad_custom_post_pass": post_pass,
                                          "fx_graph_cache": False}):
        train_step(torch.compile(_sharded(), fullgraph=True), tokens, targets)
    compat.dynamo_reset()
    assert [(r.before.total_fsdp, r.after.total_fsdp) for r in seen] == [(21, 4), (41, 7)]
    # Offline (a fake group): nothing to compare with, said in the record; the FX graph cache stays usable.
    assert {r.same_schedule for r in seen} == {"not checked: fake process group (offline tracing: no other rank runs)"}
    # The hook leaves the code of the backward (an eager module; inductor hands the forward over lazy) to inductor,
    # whose post-grad passes regenerate it last: after the compile the code is the rewritten graph's.
    backward = rewritten[1]
    assert not isinstance(backward, compat.LazyGraphModule) and left_to_inductor == [True]
    assert backward.code == backward.graph.python_code(root_module="self").src


@pytest.mark.slow
def test_apply_leaves_the_code_to_a_caller_that_regenerates_it() -> None:
    """``recompile=False`` (inductor's hook): the graph is rewritten, its Python code is not regenerated."""
    step = traced_step(MODEL.n_layers, reshard_after_forward=True)  # shared, read-only: deep-copied below
    codes = {}
    for recompile in (True, False):
        gm = copy.deepcopy(step.backward)
        assert not isinstance(gm, compat.LazyGraphModule)  # a lazy module would defer the codegen either way
        before = gm.code
        with compat.fake_process_group(2, 0):
            apply(gm, load_config(MANUAL), module_fqn_fn=step.module_fqn_fn("backward"), graph_kind="backward",
                  options=PassOptions(recompile=recompile))
        codes[recompile] = gm.code
        assert gm.graph.python_code(root_module="self").src != before  # rewritten either way
    assert codes[True] != codes[False]
    assert codes[False] == copy.deepcopy(step.backward).code  # untouched: the caller's recompile is still owed


@pytest.mark.slow
def test_graphs_for_inductor_get_one_fake_value_per_node() -> None:
    """Identical buckets share one traced merge; for a compiler each stamped node still gets its own fake tensor."""
    # The session's 2-layer trace (read-only: deep-copied below): layers.0 and layers.1 are two identical buckets in
    # the backward (both re-gathered and reduce-scattered), which is all the sharing needs; more layers add more of
    # the same.
    step = traced_step(MODEL.n_layers, reshard_after_forward=True)
    forget_traces()  # this capture makes the traces: stamps of another capture's never share their values

    def shared(for_compiler: bool) -> int:
        with compat.fake_process_group(2, 0):
            gm = apply(copy.deepcopy(step.backward), load_config(MANUAL), module_fqn_fn=step.module_fqn_fn("backward"),
                       graph_kind="backward", options=PassOptions(for_compiler=for_compiler))
        ids = [id(n.meta["val"]) for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        return len(ids) - len(set(ids))

    assert shared(for_compiler=False) > 0  # the fast path: identical layers share the cached trace's values
    assert shared(for_compiler=True) == 0
