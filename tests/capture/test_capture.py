"""From your own model to a ``CapturedStep``: the public sharder, ``capture_step``, process groups that come from the
job when one exists, the backend's own capture, and ``print(report)``.

Fast tier: hand-built graphs and small modules, no tracing. Slow tier: Hugging Face Mixtral (MoE), torchtitan's
Llama3 and a timm-style model, each captured, tuned with no ``space=``, and the winner compiled through
``overlapcfg.backend`` on the same model. Hugging Face Llama takes the same path in README's "Your own model"
(``tests/package/test_readme.py`` runs it, alone and on 2 gloo ranks, and checks what it captured, found and compiled).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import overlapcfg
from overlapcfg import compat
from overlapcfg.capture import default_loss, ensure_process_group, shard_module
from overlapcfg.demo import Llama, LlamaConfig
from overlapcfg.errors import OverlapConfigError, UnsupportedGraphError
from overlapcfg.passes.step import CapturedStep
from overlapcfg.tuning import TuneSpace
from overlapcfg.tuning.structure import find_blocks, find_parts, find_structure
from tests.support.synthetic import backward_graph, forward_graph
from tests.thirdparty import models as M

SMALL = LlamaConfig(n_layers=2, vocab_size=64, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=64)


def _synthetic_step() -> CapturedStep:
    layers = [[2, 1], [1], [3, 2]]
    fw, bw = forward_graph(layers), backward_graph(layers, regather=True)
    owners = tuple(dict.fromkeys(fw.owners.values()))
    return CapturedStep(forward=fw.gm, backward=bw.gm, module_fqns=fw.module_fqns,
                        param_fqns=tuple(f"{o}.weight" for o in owners), param_owners=owners, collectives=(),
                        world_size=2, rank=0)


# --- process groups: the job's when there is one, a fake one only where none exists ------------------------------

def test_explain_inside_a_live_process_group_uses_it_instead_of_opening_a_fake_one() -> None:
    """Issue: explain / tune on a captured step inside a job failed with 'a default process group is already
    initialized; destroy it first'."""
    step = _synthetic_step()
    with compat.fake_process_group(2) as job:
        report = overlapcfg.explain(step, {"plan": {"buckets": ["layers.*"]}})
        assert dist.is_initialized() and dist.group.WORLD is job  # the job's group, still open
    assert sum(g.collectives_after for g in report.graphs) < sum(g.collectives_before for g in report.graphs)
    assert not dist.is_initialized()


def test_ensure_process_group_opens_a_fake_group_only_where_none_exists() -> None:
    with ensure_process_group(4, rank=3) as fake:
        assert dist.get_world_size() == 4 and dist.get_rank() == 3
        with ensure_process_group(4) as inner:
            assert inner is fake  # reused, not replaced
        assert dist.is_initialized()  # the inner context did not close the outer group
        with pytest.raises(UnsupportedGraphError, match="has 4 ranks, but 2 were asked for"), \
                ensure_process_group(2):
            pass
    assert not dist.is_initialized()


def test_a_step_naming_groups_this_process_lacks_says_where_to_explain_it() -> None:
    step = _synthetic_step()
    fw = step.forward
    start = next(n for n in fw.graph.nodes if "all_gather" in str(n.target))
    renamed = CapturedStep(**{**{f: getattr(step, f) for f in step.__dataclass_fields__},
                              "collectives": (overlapcfg.graph.attribution.CollectiveOwner(
                                  "forward", start.name, "all_gather", "layers.0.wq", "layers.0.wq.weight",
                                  next(iter(start.users)).name),)})
    start.update_arg(len(start.args) - 1, "7")
    try:
        with pytest.raises(UnsupportedGraphError, match=r"process group\(s\) '7'.* captured under"):
            overlapcfg.explain(renamed, {"plan": {"buckets": ["layers.*"]}})
    finally:
        start.update_arg(len(start.args) - 1, "0")


# --- the backend: checked when built, a short repr, its own capture ----------------------------------------------

def test_a_plan_that_does_not_fit_the_model_fails_when_the_backend_is_built() -> None:
    """Issue: backend(cfg, model=m) with an unfit plan failed only at the first forward, as BackendCompilerFailed
    behind 3.7 KB of repr."""
    model = Llama(SMALL, device="meta")
    with pytest.raises(OverlapConfigError) as info:
        overlapcfg.backend({"plan": "hf_decoder_layers"}, model=model)
    assert info.value.faults[0].path == "overlap.plan.buckets[0]"
    assert "'model.embed_tokens' matches no module" in info.value.faults[0].message
    assert "closest modules: 'tok_embeddings'" in info.value.faults[0].message
    overlapcfg.backend({"plan": "llama_layers"}, model=model)  # a fitting plan builds


def test_the_backend_repr_is_one_line_and_never_reads_the_model() -> None:
    """torch.compile calls str(backend); the dataclass repr printed the model, whose parametrized weights are
    all-gathered when read (here: no process group, so reading one raises)."""
    model = shard_module(Llama(SMALL), world_size=2)
    text = repr(overlapcfg.backend({"plan": "llama_layers"}, model=model))
    assert text == "GraphBackend(passes=[forward, backward], model=Llama, compiled=[], regions=0)"


def test_the_backend_has_no_step_before_it_compiled_one() -> None:
    with pytest.raises(RuntimeError, match="no forward or backward graph was compiled yet"):
        overlapcfg.backend({"plan": "llama_layers"}).step()


# --- the sharder --------------------------------------------------------------------------------------------------

class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight


def test_shard_module_keeps_tied_parameters_tied() -> None:
    model = shard_module(_Tied(), world_size=2, rank=1)
    names = [n for n, _ in model.named_parameters()]
    assert names.count("embed.parametrizations.weight.original") == 1 and not any(n.startswith("head") for n in names)
    assert model.head.parametrizations.weight.original is model.embed.parametrizations.weight.original
    assert model.head.parametrizations.weight[0] is model.embed.parametrizations.weight[0]
    assert tuple(model.embed.parametrizations.weight.original.shape) == (4, 4)


def test_shard_module_takes_world_size_and_rank_from_the_live_group() -> None:
    with compat.fake_process_group(4, rank=2):
        model = shard_module(nn.Linear(4, 8))
        gather = model.parametrizations.weight[0]
        assert (gather.world_size, gather.rank) == (4, 2)
        assert tuple(model.parametrizations.weight.original.shape) == (2, 4)
        with pytest.raises(ValueError, match="the default process group has 4 ranks but world_size=2"):
            shard_module(nn.Linear(4, 8), world_size=2)
    with pytest.raises(TypeError, match="pass world_size="):
        shard_module(nn.Linear(4, 8))


# --- the loss of a captured step -----------------------------------------------------------------------------------

def test_default_loss_reads_losses_and_sums_other_outputs() -> None:
    x = torch.ones(2, 3, requires_grad=True)
    loss = (x * 2).sum()

    class Output:  # a ModelOutput computed with labels carries .loss
        def __init__(self) -> None:
            self.loss, self.logits = loss, x * 3

    assert default_loss(Output()) is loss
    assert default_loss({"loss": loss, "logits": x}) is loss
    assert default_loss(loss) is loss
    assert default_loss((x * 3, {"aux": x, "ids": torch.ones(2, dtype=torch.long)})).item() == 24.0
    with pytest.raises(TypeError, match="pass loss_fn="):
        default_loss({"ids": torch.ones(2, dtype=torch.long)})


# --- print(report) ---------------------------------------------------------------------------------------------------

def test_print_report_shows_the_tables_and_repr_is_one_line() -> None:
    """Issue: print(overlapcfg.explain(...)) printed a 10 KB single-line pydantic repr."""
    report = overlapcfg.explain(_synthetic_step(), {"plan": {"buckets": ["layers.*"]}}, hardware="h100_nvlink")
    text = str(report)
    assert "overlapcfg: strategy manual" in text and "Prediction: h100_nvlink" in text and "legend:" in text
    assert "BucketRecord(" not in text and "\x1b[" not in text
    assert max(len(line) for line in text.splitlines()) <= 120
    assert "\n" not in repr(report) and len(repr(report)) < 200
    assert repr(report).startswith("Report(strategy='manual', 3 buckets, forward ")


# --- blocks and parts from the module tree (torch-free) -----------------------------------------------------------

def _hf_llama(n: int) -> tuple[list[str], list[str], list[str]]:
    """Module FQNs, their classes and the parameter owners of a Hugging Face Llama with ``n`` layers."""
    fqns, types = ["model", "model.embed_tokens", "model.layers"], ["LlamaModel", "Embedding", "ModuleList"]
    owners = ["model.embed_tokens"]
    for i in range(n):
        layer = f"model.layers.{i}"
        children = [("self_attn", "LlamaAttention"), *((f"self_attn.{p}_proj", "Linear") for p in "qkvo"),
                    ("mlp", "LlamaMLP"), *((f"mlp.{p}_proj", "Linear") for p in ("gate", "up", "down")),
                    ("input_layernorm", "LlamaRMSNorm"), ("post_attention_layernorm", "LlamaRMSNorm")]
        fqns += [layer, *(f"{layer}.{c}" for c, _ in children)]
        types += ["LlamaDecoderLayer", *(t for _, t in children)]
        owners += [f"{layer}.{c}" for c, t in children if t != "LlamaAttention" and t != "LlamaMLP"]
    fqns += ["model.norm", "model.rotary_emb", "lm_head"]
    types += ["LlamaRMSNorm", "LlamaRotaryEmbedding", "Linear"]
    return fqns, types, [*owners, "model.norm", "lm_head"]


def test_blocks_are_the_container_of_same_class_modules_holding_most_parameters() -> None:
    fqns, types, owners = _hf_llama(3)
    assert find_blocks(fqns, owners, types) == ("model.layers.*", "3 LlamaDecoderLayer blocks 'model.layers.*'")
    # an MoE layer's experts are a numbered list too; the decoder layers around them hold more owners
    moe = [f"model.layers.{i}.mlp.experts.{e}" for i in range(3) for e in range(4)]
    assert find_blocks([*fqns, *moe], [*owners, *moe], [*types, *["LlamaMLP"] * len(moe)])[0] == "model.layers.*"
    # a ModuleDict keyed "0".."n-1" (torchtitan) and a Sequential under the root (timm) count, names only
    assert find_blocks(["tok", "layers", "layers.0", "layers.1", "out"], ["tok", "layers.0", "layers.1", "out"]) \
        == ("layers.*", "2 blocks 'layers.*'")
    assert find_blocks(["stem", "blocks", "blocks.0", "blocks.1", "blocks.extra"], ["blocks.0", "blocks.1"])[0] \
        == "blocks.0:2"


def test_blocks_of_different_classes_are_not_repeated_blocks() -> None:
    with pytest.raises(OverlapConfigError, match=r"space\.blocks: found no repeated blocks .* name them"):
        find_blocks(["stages", "stages.0", "stages.1"], ["stages.0", "stages.1"], ["ModuleList", "Stem", "Stage"])


def test_block_parts_are_children_in_compute_order_with_norms_sharing_the_next_part() -> None:
    fqns, types, owners = _hf_llama(2)
    blocks = ["model.layers.0", "model.layers.1"]
    order = {"input_layernorm": 0, "self_attn": 1, "post_attention_layernorm": 5, "mlp": 6}
    size = {"input_layernorm": 256, "self_attn": 65536, "post_attention_layernorm": 256, "mlp": 196608}
    facts = {o: (10 * i + order[o.split(".")[3]] + 0.1 * j, size[o.split(".")[3]])
             for i in range(2) for j, o in enumerate(x for x in owners if x.startswith(f"model.layers.{i}."))}
    parts, why = find_parts(blocks, owners, facts)
    assert parts == (("input_layernorm", "self_attn"), ("post_attention_layernorm", "mlp")), why
    # without sizes and order (a hand-built step): every parameter-owning child is a part, model order
    assert find_parts(blocks, owners)[0] == (("self_attn",), ("mlp",), ("input_layernorm",),
                                             ("post_attention_layernorm",))
    structure = find_structure(fqns, owners, TuneSpace(), module_types=types, facts=facts)
    assert structure.pattern == "model.layers.*" and structure.head == ("model.embed_tokens",)
    assert structure.tail == ("model.norm", "lm_head")
    assert structure.found == ("2 LlamaDecoderLayer blocks 'model.layers.*'; parts input_layernorm+self_attn | "
                               "post_attention_layernorm+mlp")


def test_two_stacks_of_blocks_side_by_side_are_the_users_call() -> None:
    """An encoder-decoder: grouping the decoder and folding the whole encoder into one head bucket is a guess."""
    fqns = ["enc", "enc.0", "enc.1", "shared", "dec", "dec.0", "dec.1", "dec.2"]
    owners = ["enc.0", "enc.1", "shared", "dec.0", "dec.1", "dec.2"]
    with pytest.raises(OverlapConfigError, match=r"more than one stack of repeated blocks \('dec\.\*', 'enc\.\*'\)"):
        find_structure(fqns, owners, TuneSpace())
    structure = find_structure(fqns, owners, TuneSpace(blocks="dec.*"))  # named: the encoder is the head
    assert structure.head == ("enc.0", "enc.1", "shared") and structure.blocks == ("dec.0", "dec.1", "dec.2")


# --- third-party models, captured, tuned with no space, the winner compiled (slow) --------------------------------

@contextlib.contextmanager
def _group(world_size: int = 2) -> Iterator[None]:
    with ensure_process_group(world_size):
        yield


def _run_winner(model: nn.Module, config: overlapcfg.OverlapConfig, step_call: Callable[[nn.Module], Any],
                ) -> Any:
    """One step of ``model`` compiled with ``backend(config, model=model)``; the backend after it."""
    compat.dynamo_reset()
    be = overlapcfg.backend(config, model=model)
    try:
        step_call(torch.compile(model, backend=be, fullgraph=True))
    finally:
        compat.dynamo_reset()
    return be


def _assert_winner_applied(be: Any, result: overlapcfg.TuneResult) -> None:
    buckets = len(result.verification.report.buckets) if result.verification is not None else None
    for name in ("forward", "backward"):
        record = be.graphs[name].meta["overlapcfg"]
        assert not record.uncovered, name
        assert record.after.total_fsdp < record.before.total_fsdp, name
    assert buckets is not None and len({b.name for n in ("forward", "backward")
                                         for b in be.graphs[n].meta["overlapcfg"].buckets}) == buckets


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread (Mixtral's expert kernels), the process's own count restored for the tests after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_tune_finds_mixtral_blocks_and_its_winner_compiles() -> None:
    """Sharded by the test suite's own SimpleFSDP (the sharding a user already applied); a user loss_fn."""
    model, make_batch = M.hf_mixtral()
    M.shard_simple_fsdp(model, world_size=2, rank=0, reshard_after_forward=True)
    inputs, loss_fn = make_batch()
    step = overlapcfg.capture_step(model, inputs, loss_fn=loss_fn, world_size=2)
    result = overlapcfg.tune(step, hardware="h100_nvlink", world_size=64, memory_budget=None)
    assert result.space.blocks == "model.layers.*"
    parts = result.space.block_parts
    assert parts is not None and {m for p in parts for m in p} == {"input_layernorm", "self_attn",
                                                                    "post_attention_layernorm", "mlp"}
    with _group():
        be = _run_winner(model, result.config, lambda m: loss_fn(m(*inputs)).backward())
    _assert_winner_applied(be, result)


@pytest.mark.slow
def test_tune_finds_torchtitan_llama3_blocks_and_its_winner_compiles() -> None:
    """torchtitan's data_parallel needs its process group before sharding: everything runs inside one."""
    with _group():
        model, make_batch = M.torchtitan_llama3("fully_shard")
        inputs, loss_fn = make_batch()
        step = overlapcfg.capture_step(model, inputs, loss_fn=loss_fn)
        result = overlapcfg.tune(step, hardware="h100_nvlink", world_size=64, memory_budget=None)
        be = _run_winner(model, result.config, lambda m: loss_fn(m(*inputs)).backward())
    assert result.space.blocks == "layers.*"
    _assert_winner_applied(be, result)


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), nn.Linear(dim, dim)
        self.norm2, self.mlp = nn.LayerNorm(dim), nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(),
                                                                nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _TinyViT(nn.Module):
    """timm's shape: ``patch_embed``, ``blocks`` (an ``nn.Sequential``), ``norm``, ``head``; a dict output."""

    def __init__(self, dim: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(12, dim)
        self.blocks = nn.Sequential(*(_Block(dim) for _ in range(depth)))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.norm(self.blocks(self.patch_embed(x)))
        return {"logits": self.head(features.mean(1)), "features": features}


@pytest.mark.slow
def test_a_timm_style_model_with_a_dict_output_is_captured_and_tuned_with_no_space() -> None:
    """Also: the capture leaves the model as it was (no gradients, same weights and RNG state)."""
    torch.manual_seed(0)
    model = shard_module(_TinyViT(), world_size=2)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    images = torch.randn(4, 8, 12)
    rng = torch.get_rng_state()
    step = overlapcfg.capture_step(model, images)  # default loss: the sum of both outputs
    assert torch.equal(torch.get_rng_state(), rng) and not dist.is_initialized()
    assert all(p.grad is None and torch.equal(p, weights[n]) for n, p in model.named_parameters())
    assert (step.world_size, step.rank) == (2, 0) and step.param_owners[0] == "patch_embed"
    assert dict(zip(step.module_fqns, step.module_types, strict=True))["blocks.2"] == "_Block"
    result = overlapcfg.tune(step, hardware="h100_nvlink", world_size=8, memory_budget=None,
                             space={"per_bucket_rounds": 1})
    assert result.space.blocks == "blocks.*"
    assert result.space.block_parts == (("norm1", "attn"), ("norm2", "mlp"))
    assert result.verification is not None and result.verification.agreement < 0.01


@pytest.mark.slow
def test_capturing_an_unsharded_model_says_how_to_shard_it() -> None:
    with pytest.raises(UnsupportedGraphError, match=r"no FSDP collective.*overlapcfg\.shard_module"):
        overlapcfg.capture_step(nn.Linear(4, 4), torch.randn(2, 4), world_size=2)


class _Breaks(nn.Module):
    """A forward dynamo cannot trace as one graph, as a model's loss does when it logs a warning (GPT-2 with
    ``labels``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        y = self.proj(x)
        if labels is not None:
            logging.getLogger("tests.capture").warning("a loss that logs")  # a graph break under fullgraph=True
            y = y - labels
        return y


@pytest.mark.slow
def test_a_forward_that_breaks_the_graph_is_one_error_saying_where_and_what_to_do() -> None:
    model = overlapcfg.shard_module(_Breaks(), world_size=2)
    x = torch.randn(2, 4)
    with pytest.raises(UnsupportedGraphError) as caught:
        overlapcfg.capture_step(model, (x,), {"labels": x})
    message = str(caught.value)
    assert "does not trace as one graph" in message and "Explanation:" in message  # dynamo's report
    assert "a loss that logs" in message  # dynamo's "from user code": the line that broke it
    assert "pass loss_fn=" in message and caught.value.__cause__ is None
    step = overlapcfg.capture_step(model, (x,), loss_fn=lambda out: out.sum())  # the way out it names
    assert step.collectives


@pytest.mark.slow
def test_gpt2_called_with_labels_names_its_loss_and_captures_with_loss_fn() -> None:
    """Hugging Face GPT-2 computes its loss from ``labels`` through ``loss_function``, which logs a warning dynamo
    cannot trace; the error says so and the loss_fn route it names captures the model. One block (``M.LAYERS`` is 2):
    the graph break is in the loss, after the blocks, and dynamo's time grows with the blocks."""
    with mock.patch.object(M, "LAYERS", 1):
        model, _ = M.hf_gpt2()
    tokens = torch.randint(0, M.VOCAB, (M.BATCH, M.SEQ_LEN), generator=torch.Generator().manual_seed(0))
    overlapcfg.shard_module(model, world_size=2, reshard_after_forward=True)
    with pytest.raises(UnsupportedGraphError, match=r"(?s)does not trace as one graph.*loss_function.*loss_fn="):
        overlapcfg.capture_step(model, (tokens,), {"labels": tokens})
    step = overlapcfg.capture_step(model, (tokens,), loss_fn=lambda out: out.logits.float().square().mean())
    assert step.collectives


@pytest.mark.slow
def test_a_capture_works_where_lightning_has_wrapped_torch_compile() -> None:
    """Importing Lightning replaces ``torch.compile`` for the whole process by a wrapper that deep-copies the keyword
    arguments of every ``torch.compile(module, ...)``: the capture's backend holds the model and its process groups,
    which do not copy. The backend is a handle, and copies as itself."""
    import lightning.fabric  # noqa: F401  (the import is what wraps torch.compile)

    assert torch.compile.__code__.co_name == "_capture", "Lightning no longer wraps torch.compile"
    from overlapcfg.compat import fake_process_group

    torch.manual_seed(0)
    with fake_process_group(world_size=2) as group:  # a job's group, held by the model as under torchrun
        model = shard_module(_TinyViT(depth=1), group=group)
        step = overlapcfg.capture_step(model, torch.randn(4, 8, 12))
    assert step.param_owners[0] == "patch_embed" and len(step.collectives) > 0
