"""The eager FSDP2 driver (``overlapcfg.fully_shard``): one plan and policy drive ``fully_shard`` grouping and
explicit prefetch.

Fast tests run in one process (the prefetch rule is pure; sharding itself needs only the communication-free fake
process group). The slow ones run 2 real gloo ranks and check, against plain per-block FSDP2 without explicit
prefetch, that losses and every local gradient shard are bit-for-bit equal over three SGD steps, and, with a probe
that watches FSDP2's own all-gathers and the buckets' first kernels (``tests/support/fsdp2_ranks.py``), that exactly
the all-gathers the policy asks for have been issued when each bucket starts computing, forward and backward.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import overlapcfg
from overlapcfg.compat import fake_process_group
from overlapcfg.demo.gloo import run_on_gloo
from overlapcfg.demo.llama import Llama, LlamaConfig
from overlapcfg.errors import OverlapConfigError
from overlapcfg.fsdp2 import RECORD_ATTR, read_record
from overlapcfg.fsdp2.prefetch import plan_direction
from tests.support.fsdp2_ranks import ROOT, STEPS, Event, train_models
from tests.support.rank_warmup import preloaded
from tests.thirdparty import models as M

# --- the prefetch rule (pure) ---------------------------------------------------------------------------------------


def test_prefetch_lists_are_the_next_k_buckets_clipped_at_the_end() -> None:
    plan = plan_direction(list("abcde"), [2] * 5, [1] * 5, None, "forward")
    assert plan.lists == ((1, 2), (2, 3), (3, 4), (4,), ())
    assert [d.effective for d in plan.decisions] == [2, 2, 2, 1, 0]
    assert [d.reason for d in plan.decisions][-2:] == ["end of the model", "end of the model"]


def test_depth_zero_prefetches_nothing_but_cannot_unissue_an_earlier_prefetch() -> None:
    plan = plan_direction(list("abcde"), [2, 0, 1, 1, 1], [1] * 5, None, "backward")
    assert plan.lists == ((1, 2), (), (3,), (4,), ())
    assert plan.reach == (2, 2, 3, 4, 4)
    assert plan.decisions[1].reason == "an earlier bucket's depth already issued up to c"
    assert plan.decisions[1].direction == "backward"


def test_byte_cap_shortens_the_window_and_says_why() -> None:
    # Demo Llama, 4 layers: embedding 64 KiB, each layer 160.5 KiB, norm+output 64.25 KiB (fp32).
    sizes = [65536, 164352, 164352, 164352, 164352, 65792]
    plan = plan_direction([f"b{i}" for i in range(6)], [2] * 6, sizes, 400_000, "forward")
    assert plan.reach == (2, 2, 3, 5, 5, 5)
    assert [d.effective for d in plan.decisions] == [2, 1, 1, 2, 1, 0]
    assert plan.decisions[1].reason == "max_inflight_bytes=400000 binds"
    assert all(d.inflight_bytes <= 400_000 for d in plan.decisions)


def test_a_bucket_larger_than_the_cap_still_gathers_itself() -> None:
    plan = plan_direction(["a", "b"], [1, 1], [10, 10], 5, "forward")
    assert plan.lists == ((), ())
    assert plan.decisions[0].reason == "max_inflight_bytes=5 is smaller than this bucket (10 bytes)"


# --- sharding in one process (fake process group) -------------------------------------------------------------------


@pytest.fixture
def mesh() -> Iterator[Any]:
    with fake_process_group(2, 0):
        yield init_device_mesh("cpu", (2,))


def _demo(n_layers: int = 4) -> nn.Module:
    return Llama(LlamaConfig(n_layers=n_layers), seed=0)


def test_each_bucket_is_one_fsdp2_group_and_the_root_takes_the_rest(mesh: Any) -> None:
    model = _demo()
    overlapcfg.fully_shard(model, {"plan": {"buckets": ["layers.*", ["norm", "output"]]}}, mesh=mesh)
    state = torch_fully_shard.state
    assert state(model.norm) is state(model.output)
    assert len({state(layer) for layer in model.layers.values()}) == 4
    assert state(model) not in {state(model.norm), *(state(layer) for layer in model.layers.values())}
    assert isinstance(model.tok_embeddings.weight, DTensor)  # sharded by the root's group
    record = read_record(model)
    assert record.root_params == ("tok_embeddings.weight",)
    assert record.record.uncovered[0].owner == "tok_embeddings"
    assert record.forward_order == ("layers.0", "layers.1", "layers.2", "layers.3", "norm+output")


def test_record_reads_like_the_compiled_path(mesh: Any) -> None:
    model = _demo()
    overlapcfg.fully_shard(model, {"plan": "llama_layers", "policy": {"forward_prefetch": 2}}, mesh=mesh)
    record = read_record(model)
    assert record.record.graph_kind == "fsdp2"
    layer = record.bucket("layers.0")
    assert layer.param_count == 9 and layer.numel == 41088
    assert layer.unsharded_bytes == 41088 * 4 and layer.sharded_bytes == 41088 * 2
    assert [(c.direction, c.kind, c.before, c.after) for c in layer.collectives] == [
        ("forward", "all_gather", 9, 1), ("backward", "all_gather", 9, 1), ("backward", "reduce_scatter", 9, 1)]
    forward = {d.bucket: d.effective for d in record.decisions if (d.direction, d.kind) == ("forward", "all_gather")}
    assert forward == {"tok_embeddings": 2, "layers.0": 2, "layers.1": 2, "layers.2": 2, "layers.3": 1,
                       "norm+output": 0}
    assert dict(record.forward_prefetch)["layers.0"] == ("layers.1", "layers.2")
    assert dict(record.forward_prefetch)[ROOT] == ("tok_embeddings",)
    assert dict(record.backward_prefetch)["layers.0"] == ("tok_embeddings",)


def test_bucket_reshard_after_forward_reaches_fsdp2(mesh: Any) -> None:
    model = _demo(2)
    plan = {"buckets": ["tok_embeddings", {"modules": ["layers.*"], "group_size": 1, "reshard_after_forward": False},
                        ["norm", "output"]]}
    overlapcfg.fully_shard(model, {"plan": plan}, mesh=mesh)
    model(torch.zeros(1, 4, dtype=torch.long))  # the fake group's all-gathers return garbage; only states matter
    assert not isinstance(model.layers["0"].attention.wq.weight, DTensor)  # kept unsharded after forward
    assert isinstance(model.output.weight, DTensor)  # resharded (FSDP2's default)
    assert dict(read_record(model).reshard_after_forward) == {"tok_embeddings": None, "layers.0": False,
                                                         "layers.1": False, "norm+output": None}


def test_compiled_only_settings_are_noted_not_dropped(mesh: Any) -> None:
    model = _demo(2)
    overlapcfg.fully_shard(model, {"plan": "llama_layers", "policy": {"insert_overlap_deps": True}}, mesh=mesh)
    assert any("insert_overlap_deps is ignored" in n for n in read_record(model).record.notes)


def test_fully_shard_is_exported_at_the_top_level() -> None:
    from overlapcfg.fsdp2 import fully_shard

    assert overlapcfg.fully_shard is fully_shard
    assert "fully_shard" in overlapcfg.__all__


def test_explain_refuses_a_model_it_did_not_shard() -> None:
    with pytest.raises(TypeError, match=r"not sharded by overlapcfg\.fully_shard"):
        read_record(_demo(1))


# --- bad input: an error before anything is sharded -----------------------------------------------------------------


Snapshot = tuple[dict[str, torch.Tensor], list[tuple[str, type]], list[tuple[str, dict[str, list[Any]]]],
                 list[tuple[str, type]]]


def _snapshot(model: nn.Module) -> Snapshot:
    """State dict values, module types, every hook of every module, parameter types: what "untouched" means."""
    hooks = [(n, {k: list(v.items()) for k, v in vars(m).items() if "hook" in k and isinstance(v, dict)})
             for n, m in model.named_modules()]
    return ({k: v.clone() for k, v in model.state_dict().items()}, [(n, type(m)) for n, m in model.named_modules()],
            hooks, [(n, type(p)) for n, p in model.named_parameters()])


def _assert_untouched(model: nn.Module, before: Snapshot) -> None:
    state, types, hooks, params = _snapshot(model)
    assert types == before[1]
    assert hooks == before[2]
    assert params == before[3]
    assert state.keys() == before[0].keys()
    assert all(torch.equal(state[k], before[0][k]) and not isinstance(state[k], DTensor) for k in state)
    assert not any(isinstance(m, FSDPModule) for m in model.modules())
    assert RECORD_ATTR not in vars(model)


BAD_CONFIGS = {
    "unknown pattern": ({"plan": {"buckets": ["tok_embeddings", "layer.*", ["norm", "output"]]}},
                        "overlap.plan.buckets[1]", "did you mean 'layers.*'"),
    "reduce_scatter_delay 2": ({"plan": "llama_layers", "policy": {"reduce_scatter_delay": 2}},
                               "overlap.policy.reduce_scatter_delay", "FSDP2 has no per-bucket reduce-scatter delay"),
    "reduce_scatter_delay 0 on an entry": (
        {"plan": {"buckets": [{"modules": ["layers.*"], "group_size": 1, "reduce_scatter_delay": 0}]}},
        "overlap.plan.buckets[0].reduce_scatter_delay", "got 0"),
    "reduce_scatter_delay in an override": (
        {"plan": "llama_layers", "overrides": [{"match": "layers.0", "reduce_scatter_delay": 3}]},
        "overlap.overrides[0].reduce_scatter_delay", "got 3"),
    "strategy auto": ({"strategy": "auto"}, "overlap.strategy", "no graph to reorder"),
    "strategy torch_manual": ({"strategy": "torch_manual", "plan": "llama_layers"}, "overlap.strategy",
                              "runs no graph pass"),
    "module claimed twice": ({"plan": {"buckets": ["layers.*", "layers.0.attention"]}}, "overlap.plan.buckets[1]",
                             "a module belongs to one bucket only"),
    "reshard to 3 of 2 ranks": (
        {"plan": {"buckets": [{"modules": ["layers.*"], "group_size": 1, "reshard_after_forward": 3}]}},
        "overlap.plan.buckets[0].reshard_after_forward", "does not divide the shard world size 2"),
    "the root as a bucket": ({"plan": {"buckets": ["**"]}}, "overlap.plan.buckets[0]", "holds the root module"),
    "coverage": ({"plan": {"buckets": ["layers.*"], "require_full_coverage": True}},
                 "overlap.plan.require_full_coverage", "'tok_embeddings', 'norm', 'output'"),
    "override reaching nothing": ({"plan": {"buckets": ["layers.*"]},
                                   "overrides": [{"match": "norm", "forward_prefetch": 0}]},
                                  "overlap.overrides[0].match", "belong to no bucket"),
    "bad field value": ({"plan": "llama_layers", "policy": {"forward_prefetch": -1}},
                        "overlap.policy.forward_prefetch", "expected an integer >= 0"),
}


def _assert_refused_untouched(model: nn.Module, cfg: Any, mesh: Any, path: str, text: str) -> None:
    before = _snapshot(model)
    with pytest.raises(OverlapConfigError) as err:
        overlapcfg.fully_shard(model, cfg, mesh=mesh)
    assert any(f.path == path and text in f.message for f in err.value.faults), str(err.value)
    _assert_untouched(model, before)


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_raises_before_any_module_is_sharded(case: str, mesh: Any) -> None:
    cfg, path, text = BAD_CONFIGS[case]
    _assert_refused_untouched(_demo(2), cfg, mesh, path, text)


def test_every_fault_is_reported_at_once_under_the_users_mount_point(mesh: Any) -> None:
    model = _demo(2)
    before = _snapshot(model)
    cfg = {"plan": {"buckets": ["layer.*"]}, "policy": {"reduce_scatter_delay": 0}}
    with pytest.raises(OverlapConfigError) as err:
        overlapcfg.fully_shard(model, cfg, mesh=mesh, config_root="trainer.overlap")
    assert {f.path for f in err.value.faults} == {"trainer.overlap.plan.buckets[0]",
                                                 "trainer.overlap.policy.reduce_scatter_delay"}
    _assert_untouched(model, before)


def test_tied_parameters_in_two_buckets_are_refused_with_the_fix(mesh: Any) -> None:
    model, _ = M.hf_tied()
    before = _snapshot(model)
    with pytest.raises(OverlapConfigError, match=r"put both modules in one bucket \(\[model.embed_tokens, lm_head\]\)"):
        overlapcfg.fully_shard(model, {"plan": "hf_decoder_layers"}, mesh=mesh)
    _assert_untouched(model, before)


def test_tied_parameters_in_one_bucket_are_one_tensor(mesh: Any) -> None:
    model, _ = M.hf_tied()
    plan = {"buckets": [["model.embed_tokens", "lm_head"], "model.layers.*", "model.norm"],
            "require_full_coverage": True}
    overlapcfg.fully_shard(model, {"plan": plan}, mesh=mesh)
    tied = read_record(model).bucket("model.embed_tokens+lm_head")
    assert tied.params == ("model.embed_tokens.weight",)
    assert tied.unsharded_bytes == M.VOCAB * 64 * 4


GPT2_PLAN = {"buckets": [["transformer.wte", "lm_head"], "transformer.wpe", "transformer.h.*", "transformer.ln_f"],
             "require_full_coverage": True}
GPT2_TIED = "transformer.wte+lm_head"


def test_a_tied_bucket_is_first_in_backward_and_the_record_says_why(mesh: Any) -> None:
    """``[transformer.wte, lm_head]`` (the fix FSDP2's tie error suggests) starts forward at ``wte`` and backward
    at ``lm_head``: backward is not the reverse of forward, and the lists must follow backward's own order."""
    model, _ = M.hf_gpt2()
    overlapcfg.fully_shard(model, {"plan": GPT2_PLAN, "policy": {"backward_prefetch": 2}}, mesh=mesh)
    record = read_record(model)
    assert record.forward_order == (GPT2_TIED, "transformer.wpe", "transformer.h.0", "transformer.h.1",
                                    "transformer.ln_f")
    assert record.backward_order == (GPT2_TIED, "transformer.ln_f", "transformer.h.1", "transformer.h.0",
                                     "transformer.wpe")
    backward = dict(record.backward_prefetch)
    assert backward[ROOT] == (GPT2_TIED,)
    assert backward[GPT2_TIED] == ("transformer.ln_f", "transformer.h.1")
    assert backward["transformer.wpe"] == ()
    tied = [d for d in record.bucket(GPT2_TIED).decisions if (d.direction, d.kind) == ("backward", "all_gather")]
    assert [(d.position, d.effective, d.reason) for d in tied] == [(0, 2, None)]
    assert any(n.startswith(f"bucket {GPT2_TIED!r} runs apart: transformer.wte runs before and lm_head after "
                            "transformer.wpe, transformer.h.0, transformer.h.1 ...") for n in record.record.notes)


class _NormFirst(nn.Module):
    """Registers ``norm`` before the blocks it follows: registration order is not the order forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def test_the_first_forward_measures_the_bucket_order_and_replans_the_lists(mesh: Any) -> None:
    model = _NormFirst()
    overlapcfg.fully_shard(model, {"plan": {"buckets": ["norm", "blocks.*"]},
                                   "policy": {"forward_prefetch": 1, "backward_prefetch": 1}}, mesh=mesh)
    assert read_record(model).forward_order == ("norm", "blocks.0", "blocks.1")  # registration order, a guess
    model(torch.zeros(2, 8))  # the fake group's all-gathers return garbage; only the order matters
    record = read_record(model)
    assert record.forward_order == ("blocks.0", "blocks.1", "norm")
    assert record.backward_order == ("norm", "blocks.1", "blocks.0")
    assert dict(record.forward_prefetch)["blocks.0"] == ("blocks.1",)
    assert dict(record.backward_prefetch)["norm"] == ("blocks.1",)
    assert any("differs from registration order, prefetch re-planned" in n for n in record.record.notes)
    state = torch_fully_shard.state  # what FSDP2 itself holds now
    assert state(model.blocks[0])._states_to_forward_prefetch == [state(model.blocks[1])]
    assert state(model.norm)._states_to_backward_prefetch == [state(model.blocks[1])]
    model(torch.zeros(2, 8))  # the hooks are gone: nothing is measured twice
    assert sum("bucket order" in n for n in read_record(model).record.notes) == 1


def test_a_model_run_in_registration_order_keeps_its_lists_and_says_it_checked(mesh: Any) -> None:
    model = _demo(2)
    overlapcfg.fully_shard(model, {"plan": "llama_layers"}, mesh=mesh)
    before = read_record(model)
    model(torch.zeros(1, 4, dtype=torch.long))
    after = read_record(model)
    assert after.forward_prefetch == before.forward_prefetch and after.backward_prefetch == before.backward_prefetch
    assert "bucket order checked on the first forward: as planned" in after.record.notes


def _with_scalar(model: nn.Module) -> nn.Module:
    model.layers["1"].scale = nn.Parameter(torch.tensor(1.0))  # type: ignore[index]
    return model


REFUSED_BY_TORCH = {
    # torch refuses these at one bucket's fully_shard, after earlier buckets (or parameters) were sharded.
    "a ModuleDict bucket": (_demo, {"plan": {"buckets": ["tok_embeddings", "layers", ["norm", "output"]]}},
                            "overlap.plan.buckets[1]", "'layers', a ModuleDict with no forward of its own"),
    "a 0-dim parameter": (lambda: _with_scalar(_demo(2)), {"plan": "llama_layers"}, "overlap.plan.buckets[1]",
                          "parameter 'layers.1.scale' in bucket 'layers.1' is a 0-dim tensor"),
}


@pytest.mark.parametrize("case", list(REFUSED_BY_TORCH))
def test_what_fsdp2_would_refuse_half_way_is_refused_before_any_module_is_sharded(case: str, mesh: Any) -> None:
    build, cfg, path, text = REFUSED_BY_TORCH[case]
    _assert_refused_untouched(build(), cfg, mesh, path, text)


def test_a_failure_inside_torchs_fully_shard_rolls_the_model_back(mesh: Any) -> None:
    """A ``shard_placement_fn`` raising at the second bucket, after the first was sharded (and, inside the
    failing bucket, after some parameters were replaced): the model comes back as given and can be sharded."""
    model = _demo(2)
    before = _snapshot(model)
    calls: list[tuple[int, ...]] = []

    def placement(param: nn.Parameter) -> None:
        calls.append(tuple(param.shape))
        if len(calls) == 13:  # layers.0 has 9 parameters: the 4th of layers.1
            raise RuntimeError("placement refused")

    with pytest.raises(RuntimeError, match="placement refused"):
        overlapcfg.fully_shard(model, {"plan": "llama_layers"}, mesh=mesh, shard_placement_fn=placement)
    assert len(calls) == 13
    _assert_untouched(model, before)
    overlapcfg.fully_shard(model, {"plan": "llama_layers"}, mesh=mesh)
    assert isinstance(model.layers["0"], FSDPModule) and isinstance(model.layers["1"].attention.wq.weight, DTensor)
    model(torch.zeros(1, 4, dtype=torch.long))  # hooks work: the fake group's all-gathers return garbage


def test_a_3d_mesh_is_refused_with_the_sub_mesh_to_pass() -> None:
    with fake_process_group(8, 0):
        mesh3 = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        model = _demo(1)
        before = _snapshot(model)
        with pytest.raises(ValueError, match=r'mesh has 3 dims \(dp_replicate=2 x dp_shard=2 x tp=2\).*'
                                             r'sub-mesh \(mesh\["dp_replicate", "dp_shard"\]\)'):
            overlapcfg.fully_shard(model, {"plan": "llama_layers"}, mesh=mesh3)
        _assert_untouched(model, before)


def test_unknown_keyword_is_a_type_error_before_sharding(mesh: Any) -> None:
    model = _demo(1)
    before = _snapshot(model)
    with pytest.raises(TypeError, match="did you mean 'reshard_after_forward'"):
        overlapcfg.fully_shard(model, {"plan": "llama_layers"}, mesh=mesh, reshard_after_froward=False)
    _assert_untouched(model, before)


def test_a_model_already_under_fsdp2_is_refused(mesh: Any) -> None:
    model = _demo(1)
    torch_fully_shard(model.layers["0"], mesh=mesh)
    with pytest.raises(RuntimeError, match=r"module 'layers\.0' is already sharded with FSDP2"):
        overlapcfg.fully_shard(model, {"plan": "llama_layers"}, mesh=mesh)


# --- two gloo ranks: parity and measured prefetch -------------------------------------------------------------------

DEMO_BUCKETS = {"tok_embeddings": ["tok_embeddings"], **{f"layers.{i}": [f"layers.{i}"] for i in range(4)},
                "norm+output": ["norm", "output"]}
HF_BUCKETS = {"model.embed_tokens": ["model.embed_tokens"],
              **{f"model.layers.{i}": [f"model.layers.{i}"] for i in range(2)},
              "model.norm+lm_head": ["model.norm", "lm_head"]}


def _depth(plan: Any, k: int, **extra: Any) -> dict[str, Any]:
    return {"plan": plan, "policy": {"forward_prefetch": k, "backward_prefetch": k, **extra}}


DEMO_VARIANTS: dict[str, Any] = {
    "plain": None,
    "depth 0": _depth("llama_layers", 0),
    "depth 1": _depth("llama_layers", 1),
    "depth 2": _depth("llama_layers", 2),
    "override": {**_depth("llama_layers", 1),
                 "overrides": [{"match": "layers.1", "forward_prefetch": 0, "backward_prefetch": 2}]},
    "cap": _depth("llama_layers", 2, max_inflight_bytes=400_000),
    "no reshard for layers": {"plan": {"buckets": [
        "tok_embeddings", {"modules": ["layers.*"], "group_size": 1, "reshard_after_forward": False},
        ["norm", "output"]]}},
}
HF_VARIANTS: dict[str, Any] = {
    "plain": None,
    "depth 0": _depth("hf_decoder_layers", 0),
    "depth 1": _depth("hf_decoder_layers", 1),
    "depth 2": _depth("hf_decoder_layers", 2),
    "override": {**_depth("hf_decoder_layers", 1),
                 "overrides": [{"match": "model.layers.0", "forward_prefetch": 0, "backward_prefetch": 2}]},
    "cap": _depth("hf_decoder_layers", 2, max_inflight_bytes=200_000),
}


# Tied embedding and head in one bucket (FSDP2 refuses them in two): forward starts at the embedding, backward at
# the head, so each direction has its own order (``overlapcfg.fsdp2.layout``).
GPT2_BUCKETS = {GPT2_TIED: ["transformer.wte", "lm_head"], "transformer.wpe": ["transformer.wpe"],
                "transformer.h.0": ["transformer.h.0"], "transformer.h.1": ["transformer.h.1"],
                "transformer.ln_f": ["transformer.ln_f"]}
GPT2_BACKWARD = [GPT2_TIED, "transformer.ln_f", "transformer.h.1", "transformer.h.0", "transformer.wpe"]
GEMMA2_TIED = "model.embed_tokens+lm_head"
GEMMA2_BUCKETS = {GEMMA2_TIED: ["model.embed_tokens", "lm_head"], "model.layers.0": ["model.layers.0"],
                  "model.layers.1": ["model.layers.1"], "model.norm": ["model.norm"]}
GEMMA2_BACKWARD = [GEMMA2_TIED, "model.norm", "model.layers.1", "model.layers.0"]
GEMMA2_PLAN = {"buckets": [["model.embed_tokens", "lm_head"], "model.layers.*", "model.norm"],
               "require_full_coverage": True}
TIED_VARIANTS: dict[str, dict[str, Any]] = {
    "gpt2": {"plain": None, "depth 1": _depth(GPT2_PLAN, 1), "depth 2": _depth(GPT2_PLAN, 2)},
    "gemma2": {"plain": None, "depth 2": _depth(GEMMA2_PLAN, 2)},
}


@pytest.fixture(scope="module")
def gloo_runs() -> list[dict[str, dict[str, dict[str, Any]]]]:
    """Every model, every variant, 2 ranks, one spawn: ``runs[rank][model][variant]``."""
    jobs = {"demo": (DEMO_VARIANTS, DEMO_BUCKETS), "hf": (HF_VARIANTS, HF_BUCKETS),
            "gpt2": (TIED_VARIANTS["gpt2"], GPT2_BUCKETS), "gemma2": (TIED_VARIANTS["gemma2"], GEMMA2_BUCKETS)}
    return run_on_gloo(train_models, jobs, world_size=2, timeout_s=300, preload=preloaded(__name__))


@pytest.fixture(scope="module")
def demo_runs(gloo_runs: Any) -> list[dict[str, dict[str, Any]]]:
    return [per_rank["demo"] for per_rank in gloo_runs]


@pytest.fixture(scope="module")
def hf_runs(gloo_runs: Any) -> list[dict[str, dict[str, Any]]]:
    return [per_rank["hf"] for per_rank in gloo_runs]


def _assert_bitwise_like_plain(runs: list[dict[str, dict[str, Any]]], variant: str) -> None:
    for rank, results in enumerate(runs):
        ref, got = results["plain"], results[variant]
        for step in range(STEPS):
            assert torch.equal(got["losses"][step], ref["losses"][step]), (variant, rank, step)
            assert got["grads"][step].keys() == ref["grads"][step].keys()
            for name, grad in got["grads"][step].items():
                assert torch.equal(grad, ref["grads"][step][name]), (variant, rank, step, name)
        for name, param in got["params"].items():
            assert torch.equal(param, ref["params"][name]), (variant, rank, "after the last step", name)
        assert ref["losses"][-1] < ref["losses"][0]  # it trains: the comparison is not between constants


@pytest.mark.slow
def test_every_sharding_checked_its_schedule_across_the_ranks_silently(gloo_runs: Any) -> None:
    """Each ``overlapcfg.fully_shard`` of every model and variant compared its groups and prefetch lists across the
    2 gloo ranks before sharding (``overlapcfg.graph.same_schedule``), found them equal and said so in the record;
    the bitwise comparisons around prove nothing else changed."""
    for rank, per_rank in enumerate(gloo_runs):
        for model, variants in per_rank.items():
            for variant, res in variants.items():
                if "record" in res:
                    outcome = res["record"]["same_schedule"]
                    assert outcome.startswith("checked: the same ") and "(2 ranks)" in outcome, (rank, model, variant)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [v for v in DEMO_VARIANTS if v != "plain"])
def test_demo_losses_and_gradient_shards_match_plain_fsdp2_bit_for_bit(demo_runs: Any, variant: str) -> None:
    _assert_bitwise_like_plain(demo_runs, variant)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [v for v in HF_VARIANTS if v != "plain"])
def test_hf_llama_losses_and_gradient_shards_match_plain_fsdp2_bit_for_bit(hf_runs: Any, variant: str) -> None:
    _assert_bitwise_like_plain(hf_runs, variant)


def _issued_when_starting(events: list[Event], phase: str) -> dict[str, set[str]]:
    """For each bucket, the buckets whose all-gathers of ``phase`` were issued when it started computing."""
    issued: set[str] = set()
    out: dict[str, set[str]] = {}
    for what, ph, bucket in events:
        if ph != phase:
            continue
        if what == "all_gather" and bucket != ROOT:
            issued.add(bucket)
        elif what == "start" and bucket not in out:
            out[bucket] = set(issued)
    return out


def _windows(order: list[str], reach: list[int], gathered: set[str] | None = None) -> dict[str, set[str]]:
    """Bucket at position p of ``order`` starts with positions 0..reach[p] issued (those that all-gather)."""
    keep = set(order) if gathered is None else gathered
    return {b: set(order[:reach[p] + 1]) & keep for p, b in enumerate(order)}


def _uniform(n: int, k: int) -> list[int]:
    return [min(p + k, n - 1) for p in range(n)]


# The policy's meaning worked out by hand (positions in each direction's order; backward = reverse forward):
# ``reach[p]`` = last position issued once position p computes = max(reach[p-1], p + depth[p]), clipped at the end,
# lowered where the unsharded bytes of positions p..reach[p] would exceed the cap.
DEMO_EXPECTED: dict[str, tuple[list[int], list[int], set[str] | None]] = {
    "depth 0": (_uniform(6, 0), _uniform(6, 0), None),
    "depth 1": (_uniform(6, 1), _uniform(6, 1), None),
    "depth 2": (_uniform(6, 2), _uniform(6, 2), None),
    # layers.1 (forward position 2, backward position 3): forward depth 0, backward depth 2; the rest depth 1.
    "override": ([1, 2, 2, 4, 5, 5], [1, 2, 3, 5, 5, 5], None),
    # sizes (bytes) forward: 65536, 164352 x 4, 65792; a window may hold at most 400000.
    "cap": ([2, 2, 3, 5, 5, 5], [2, 2, 3, 5, 5, 5], None),
    # layers keep their parameters after forward: no backward all-gather for them.
    "no reshard for layers": (_uniform(6, 1), _uniform(6, 1), {"tok_embeddings", "norm+output"}),
}
HF_EXPECTED: dict[str, tuple[list[int], list[int], set[str] | None]] = {
    "depth 0": (_uniform(4, 0), _uniform(4, 0), None),
    "depth 1": (_uniform(4, 1), _uniform(4, 1), None),
    "depth 2": (_uniform(4, 2), _uniform(4, 2), None),
    "override": ([1, 1, 3, 3], [1, 2, 3, 3], None),
    # sizes: embed 32768, layers 147968 each, norm+lm_head 33024; cap 200000.
    "cap": ([1, 1, 3, 3], [1, 1, 3, 3], None),
}


def _assert_measured(runs: list[dict[str, dict[str, Any]]], buckets: dict[str, Any], variant: str,
                     expected: tuple[list[int], list[int], set[str] | None],
                     backward_order: list[str] | None = None) -> None:
    order = list(buckets)
    forward, backward, gathered = expected
    want_forward = _windows(order, forward)
    want_backward = _windows(backward_order or order[::-1], backward, gathered)
    for rank, results in enumerate(runs):
        for step, events in enumerate(results[variant]["events"]):
            assert _issued_when_starting(events, "forward") == want_forward, (variant, rank, step, "forward")
            assert _issued_when_starting(events, "backward") == want_backward, (variant, rank, step, "backward")


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(DEMO_EXPECTED))
def test_demo_buckets_start_with_exactly_the_requested_all_gathers_issued(demo_runs: Any, variant: str) -> None:
    _assert_measured(demo_runs, DEMO_BUCKETS, variant, DEMO_EXPECTED[variant])


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(HF_EXPECTED))
def test_hf_buckets_start_with_exactly_the_requested_all_gathers_issued(hf_runs: Any, variant: str) -> None:
    _assert_measured(hf_runs, HF_BUCKETS, variant, HF_EXPECTED[variant])


TIED_CASES = [("gpt2", "depth 1"), ("gpt2", "depth 2"), ("gemma2", "depth 2")]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "variant"), TIED_CASES)
def test_tied_hf_models_match_plain_fsdp2_bit_for_bit(gloo_runs: Any, kind: str, variant: str) -> None:
    _assert_bitwise_like_plain([per_rank[kind] for per_rank in gloo_runs], variant)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "variant"), TIED_CASES)
def test_a_tied_bucket_prefetches_at_its_depth_from_the_first_backward_kernel(gloo_runs: Any, kind: str,
                                                                             variant: str) -> None:
    """Measured on GPT-2 and Gemma2: the tied bucket computes first in backward and prefetches as deep as asked
    (before, it was handed no list: depths [0, 2, 1, 0] where [2, 2, 1, 0] was asked and recorded)."""
    buckets, order = (GPT2_BUCKETS, GPT2_BACKWARD) if kind == "gpt2" else (GEMMA2_BUCKETS, GEMMA2_BACKWARD)
    k = int(variant.rsplit(maxsplit=1)[-1])
    _assert_measured([per_rank[kind] for per_rank in gloo_runs], buckets, variant,
                     (_uniform(len(buckets), k), _uniform(len(buckets), k), None), backward_order=order)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "variant"), TIED_CASES)
def test_fsdp2_holds_the_lists_the_record_gives_and_each_bucket_starts_at_its_recorded_depth(
        gloo_runs: Any, kind: str, variant: str) -> None:
    """The record tells the truth about a tied ``[embed, lm_head]`` bucket (reported: backward depths [0, 2, 1, 0]
    measured where [2, 2, 1, 0] was asked and recorded). Read back from FSDP2 itself after three steps, every
    group's prefetch lists are the record's; and in every step, forward and backward, each bucket starts computing
    with exactly as many later buckets' all-gathers issued as the record's effective depth says."""
    buckets = GPT2_BUCKETS if kind == "gpt2" else GEMMA2_BUCKETS
    for rank, per_rank in enumerate(gloo_runs):
        res = per_rank[kind][variant]
        record = res["record"]
        assert res["readback"] == {name: (record["forward"][name], record["backward"][name])
                                   for name in (ROOT, *buckets)}, rank
        orders = {"forward": list(buckets), "backward": list(record["backward_order"])}
        for direction, order in orders.items():
            want = {b: effective for d, b, _, effective in record["effective"] if d == direction}
            assert set(want) == set(order) and want[order[0]] == int(variant.rsplit(maxsplit=1)[-1])
            for step, events in enumerate(res["events"]):
                issued = _issued_when_starting(events, direction)
                got = {b: max(order.index(x) for x in issued[b] if x in order) - p for p, b in enumerate(order)}
                assert got == want, (rank, step, direction)


@pytest.mark.slow
def test_probe_sees_plain_fsdp2_defaults_forward_0_backward_1(demo_runs: Any) -> None:
    """The probe checked on FSDP2 alone: no forward prefetch, implicit depth-1 backward prefetch (the root's group
    holds tok_embeddings, norm and output, so only the layers have all-gathers of their own)."""
    layers = [f"layers.{i}" for i in range(4)]
    events = demo_runs[0]["plain"]["events"][0]
    forward = _issued_when_starting(events, "forward")
    backward = _issued_when_starting(events, "backward")
    assert [forward[b] for b in layers] == [set(layers[:i + 1]) for i in range(4)]
    assert [backward[b] for b in layers[::-1]] == [set(layers[::-1][:min(i + 2, 4)]) for i in range(4)]


def test_a_deep_copy_of_the_config_shards_the_same(mesh: Any) -> None:
    """The config is data: loading it twice (or copying it) gives the same layout."""
    cfg = overlapcfg.load_config(DEMO_VARIANTS["cap"])
    a, b = _demo(), _demo()
    overlapcfg.fully_shard(a, cfg, mesh=mesh)
    overlapcfg.fully_shard(b, copy.deepcopy(cfg), mesh=mesh)
    assert read_record(a).model_dump(exclude={"record": {"seconds"}}) == read_record(b).model_dump(exclude={"record":
                                                                                                      {"seconds"}})


def test_overlapcfg_explain_reports_an_fsdp2_model_like_a_graph(mesh: Any) -> None:
    """One report for both paths: buckets, modules, parameters, bytes, effective depths and why."""
    from rich.console import Console

    from overlapcfg.report import Report
    from overlapcfg.report.render import report_table

    cfg = overlapcfg.load_config({"plan": "llama_layers", "policy": {"forward_prefetch": 2}})
    model = _demo()
    overlapcfg.fully_shard(model, cfg, mesh=mesh)
    report = overlapcfg.explain(model, cfg)
    assert [b.name for b in report.buckets] == ["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3",
                                                "norm+output"]
    assert report.bucket("layers.0").param_count == 9
    assert {d.effective for d in report.bucket("layers.0").decisions if d.direction == "forward"} == {2}
    assert Report.from_json(report.to_json()) == report
    console = Console(width=160, record=True, file=io.StringIO())
    console.print(report_table(report))
    row = next(line for line in console.export_text().splitlines() if line.startswith("│ fsdp2"))
    assert [cell.strip() for cell in row.strip("│").split("│")][:3] == ["fsdp2", "—", "117 → 18"]  # no graph
    with pytest.raises(TypeError, match="no prediction for eager FSDP2"):
        overlapcfg.explain(model, cfg, hardware="h100_nvlink")


def test_a_per_bucket_reshard_setting_is_noted_as_ignored_by_the_compiled_path() -> None:
    from overlapcfg.passes import apply
    from tests.support.synthetic import forward_graph

    built = forward_graph([[2], [2]])
    cfg = overlapcfg.load_config({"plan": {"buckets": [{"modules": ["layers.*"], "per": "layers.*",
                                                        "reshard_after_forward": False}]}})
    with fake_process_group(2):
        gm = apply(built.gm, cfg, module_fqns=built.module_fqns, graph_kind="forward")
    assert any("reshard_after_forward is ignored" in n for n in gm.meta["overlapcfg"].notes)
