"""Third-party model fixtures: build, shard and capture aot_autograd graphs WITHOUT overlapcfg's own tracing.

Nothing here imports ``overlapcfg``. It backs a conformance suite: overlapcfg must work on graphs it did not trace.

Models (each seeded and deterministic; tiny: 2 layers, hidden 64, vocab 128, batch 2, seq 16; nothing downloads):

- ``hf_llama()``, ``hf_qwen2()``, ``hf_mixtral()``, ``hf_tied()``, ``hf_t5()`` (encoder-decoder, one embedding
  shared by three modules): Hugging Face ``transformers`` models (5.x) built
  from a config in-process. Each returns ``(model, make_batch)``: ``model`` is the unsharded ``nn.Module`` exactly as
  HF builds it (FQNs ``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``, ...); ``make_batch()`` returns
  ``(inputs, loss_fn)`` where ``inputs`` is the tuple of positional arguments of the compiled call
  (``(input_ids,)``) and ``loss_fn(output) -> scalar`` runs OUTSIDE the compiled region
  (``cross_entropy(output.logits, targets)``). HF's ``*ForCausalLM.forward`` returns a ``CausalLMOutputWithPast``
  (a ``ModelOutput``); with ``use_cache=False`` (set here) its only tensor field is ``logits``, so the dynamo graph
  returns the logits alone and ``past_key_values`` (a ``DynamicCache``) never enters the graph.
- ``shard_simple_fsdp(module, world_size=, rank=)``: a minimal SimpleFSDP (dim-0 shards + a ``parametrize``
  parametrization that all-gathers with ``_functional_collectives.all_gather_single``), tied parameters handled.
- ``torchtitan_llama3(mode)``: torchtitan 0.3.0's own ``Llama3Model`` sharded by torchtitan's own
  ``torchtitan.experiments.graph_trainer.simple_fsdp.data_parallel`` (DTensor parameters). Needs a default process
  group (use ``fake_process_group``) because its DeviceMesh binds process groups at shard time. Modes
  ``fsdp_tp`` / ``fsdp_tp_no_sp``: FSDP + tensor parallel on a ``("fsdp", "tp")`` 2 x 2 mesh (4 ranks), TP by the
  model's own ``parallelize`` (sequence parallel on / off), as graph_trainer's ``parallelize_llama`` does.
- ``capture_graphs(model, inputs, loss_fn)``: ``torch.compile`` with an ``aot_autograd`` backend (min-cut
  partitioner, boxed eager), one forward + backward under a fake process group; returns the graphs.

Typical use::

    model, make_batch = hf_llama()
    shard_simple_fsdp(model, world_size=2, rank=0)
    inputs, loss_fn = make_batch()
    g = capture_graphs(model, inputs, loss_fn, world_size=2)      # g.forward, g.backward, g.dynamo_graph

    with fake_process_group(world_size=4):                         # torchtitan: the PG must exist before sharding
        model, make_batch = torchtitan_llama3("hybrid_shard")
        g = capture_graphs(model, *make_batch(), world_size=4)     # reuses the open group, leaves it open
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import os
import sys
import time
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

# Nothing may download. Set before transformers / huggingface_hub are imported (they read it at import time).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import fx, nn
from torch.nn.utils import parametrize
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = [
    "BATCH",
    "SEQ_LEN",
    "VOCAB",
    "CapturedGraphs",
    "capture_graphs",
    "fake_process_group",
    "hf_llama",
    "hf_mixtral",
    "hf_qwen2",
    "hf_t5",
    "hf_tied",
    "shard_simple_fsdp",
    "torchtitan_llama3",
    "torchtitan_stubs",
]

BATCH = 2
SEQ_LEN = 16
VOCAB = 128
HIDDEN = 64
LAYERS = 2
SEED = 0

Batch = tuple[tuple[torch.Tensor, ...], Callable[[Any], torch.Tensor]]


def _tokens(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    data = torch.randint(0, vocab, (BATCH, SEQ_LEN + 1), generator=gen)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _logits_loss(targets: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    """``loss_fn(output)``: cross entropy of ``output.logits`` (HF ``ModelOutput``) or of ``output`` (a tensor)."""

    def loss_fn(output: Any) -> torch.Tensor:
        logits = output.logits if hasattr(output, "logits") else output
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))

    return loss_fn


def _batch_fn(vocab: int, seed: int) -> Callable[[], Batch]:
    def make_batch() -> Batch:
        tokens, targets = _tokens(vocab, seed)
        return (tokens,), _logits_loss(targets)

    return make_batch


# --- Hugging Face transformers ------------------------------------------------------------------------------------

_HF_COMMON = dict(
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    use_cache=False,  # no DynamicCache in the output / graph
    attn_implementation="sdpa",
)


def _hf_build(config_cls_name: str, model_cls_name: str, seed: int, **overrides: Any) -> nn.Module:
    import transformers

    config = getattr(transformers, config_cls_name)(**{**_HF_COMMON, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls_name)(config)
    model.train()  # dropout probabilities are 0.0 in these configs; train() only sets the flag
    return model


def hf_llama(seed: int = SEED) -> tuple[nn.Module, Callable[[], Batch]]:
    """``LlamaForCausalLM``, 2 layers, hidden 64, 4 heads / 2 KV heads, vocab 128, untied head."""
    return _hf_build("LlamaConfig", "LlamaForCausalLM", seed, tie_word_embeddings=False), _batch_fn(VOCAB, seed)


def hf_qwen2(seed: int = SEED) -> tuple[nn.Module, Callable[[], Batch]]:
    """``Qwen2ForCausalLM`` (q/k/v projections carry biases), same sizes, untied head."""
    return _hf_build("Qwen2Config", "Qwen2ForCausalLM", seed, tie_word_embeddings=False), _batch_fn(VOCAB, seed)


def hf_mixtral(seed: int = SEED) -> tuple[nn.Module, Callable[[], Batch]]:
    """``MixtralForCausalLM``: 4 experts, top-2, 3-D expert parameters; ``experts_implementation="batched_mm"``
    (the default loop over experts graph-breaks). For bit-reproducible expert gradients run with one thread."""
    model = _hf_build("MixtralConfig", "MixtralForCausalLM", seed, num_local_experts=4, num_experts_per_tok=2,
                      tie_word_embeddings=False, experts_implementation="batched_mm", router_jitter_noise=0.0)
    return model, _batch_fn(VOCAB, seed)


def hf_tied(seed: int = SEED) -> tuple[nn.Module, Callable[[], Batch]]:
    """``LlamaForCausalLM`` with ``tie_word_embeddings=True``: ``lm_head.weight is model.embed_tokens.weight``."""
    model = _hf_build("LlamaConfig", "LlamaForCausalLM", seed, tie_word_embeddings=True)
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        raise AssertionError("hf_tied: transformers did not tie lm_head.weight to model.embed_tokens.weight")
    return model, _batch_fn(VOCAB, seed)


def hf_t5(seed: int = SEED) -> tuple[nn.Module, Callable[[], Batch]]:
    """``T5ForConditionalGeneration`` (encoder-decoder), 2 + 2 blocks, d_model 64, 4 heads, vocab 128, tied head.

    One embedding weight serves three modules: ``shared.weight`` is also ``encoder.embed_tokens.weight``,
    ``decoder.embed_tokens.weight`` and (tied) ``lm_head.weight``; each use gets its own partial gradient, so the
    shared weight's gradient is ``add(add(rs_a, rs_b), rs_c)`` of three reduce-scattered partials once sharded.
    ``make_batch()`` -> ``((input_ids, None, decoder_input_ids), loss_fn)`` (positional ``forward`` arguments:
    ``attention_mask`` is None); ``loss_fn(output)``: cross entropy of ``output.logits`` against the shifted
    targets."""
    import transformers

    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=16, d_ff=128, num_layers=LAYERS, num_decoder_layers=LAYERS,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=SEQ_LEN,
        dropout_rate=0.0, tie_word_embeddings=True, use_cache=False, decoder_start_token_id=0, pad_token_id=0,
        attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(config)
    model.train()
    shared = model.shared.weight
    if not (model.encoder.embed_tokens.weight is shared and model.decoder.embed_tokens.weight is shared
            and model.lm_head.weight is shared):
        raise AssertionError("hf_t5: transformers did not share the embedding between encoder, decoder and head")

    def make_batch() -> Batch:
        gen = torch.Generator().manual_seed(seed + 1)
        source = torch.randint(1, VOCAB, (BATCH, SEQ_LEN), generator=gen)
        target = torch.randint(1, VOCAB, (BATCH, SEQ_LEN + 1), generator=gen)
        return (source, None, target[:, :-1].contiguous()), _logits_loss(target[:, 1:].contiguous())

    return model, make_batch


def hf_gpt2(seed: int = SEED) -> tuple[nn.Module, Callable[[], Batch]]:
    """``GPT2LMHeadModel``, 2 blocks, hidden 64, 4 heads, vocab 128; ``lm_head.weight is transformer.wte.weight``
    (GPT-2 ties them), learned position embeddings (``transformer.wpe``), no dropout."""
    import transformers

    config = transformers.GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=4, vocab_size=VOCAB, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                     bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config)
    model.train()
    if model.lm_head.weight is not model.transformer.wte.weight:
        raise AssertionError("hf_gpt2: transformers did not tie lm_head.weight to transformer.wte.weight")
    return model, _batch_fn(VOCAB, seed)


def hf_gpt_neox(seed: int = SEED) -> tuple[nn.Module, Callable[[], Batch]]:
    """``GPTNeoXForCausalLM`` with ``use_parallel_residual`` (attention and MLP read the same input and their outputs
    are added: Pythia's and Phi's block), 2 layers, hidden 64, 4 heads, vocab 128, no dropout. The attention output
    projection's bias and the MLP's output bias get the same gradient, so the tracer's CSE leaves one reduce-scatter
    for both, waited once per gradient."""
    import transformers

    config = transformers.GPTNeoXConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                                        num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64,
                                        use_parallel_residual=True, hidden_dropout=0.0, attention_dropout=0.0,
                                        use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = transformers.GPTNeoXForCausalLM(config)
    model.train()
    return model, _batch_fn(VOCAB, seed)


def hf_gemma2(seed: int = SEED) -> tuple[nn.Module, Callable[[], Batch]]:
    """``Gemma2ForCausalLM``, same sizes (head_dim 16), tied head (Gemma's default), eager attention (Gemma2 has
    no SDPA path in transformers 5)."""
    model = _hf_build("Gemma2Config", "Gemma2ForCausalLM", seed, head_dim=16, attn_implementation="eager",
                      tie_word_embeddings=True)
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        raise AssertionError("hf_gemma2: transformers did not tie lm_head.weight to model.embed_tokens.weight")
    return model, _batch_fn(VOCAB, seed)


# --- minimal SimpleFSDP (no DTensor, no overlapcfg) -----------------------------------------------------------------

_RECOMPUTE = frozenset({
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.wait_tensor.default,
})


def _sac_policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE if op in _RECOMPUTE else CheckpointPolicy.MUST_SAVE


def _all_gather(shard: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return funcol.all_gather_tensor(shard, 0, group)


class GatherShard(nn.Module):
    """Parametrization: dim-0 shard -> full tensor by a functional all-gather over ``group`` (default: WORLD at
    call time, so a model can be sharded before the process group exists). Gradient: reduce-scatter, SUM over
    ranks (the functional all-gather's autograd formula)."""

    def __init__(self, group: dist.ProcessGroup | None = None, reshard_after_forward: bool = False) -> None:
        super().__init__()
        self.group = group
        self.reshard_after_forward = reshard_after_forward

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        group = self.group if self.group is not None else dist.group.WORLD
        if group is None:
            raise RuntimeError("GatherShard: no process group (init one, e.g. fake_process_group())")
        if not self.reshard_after_forward:
            return _all_gather(shard, group)
        context_fn = functools.partial(create_selective_checkpoint_contexts, _sac_policy)
        return checkpoint(_all_gather, shard, group, use_reentrant=False, context_fn=context_fn)


def shard_simple_fsdp(module: nn.Module, *, world_size: int, rank: int = 0, group: dist.ProcessGroup | None = None,
                      reshard_after_forward: bool = False) -> nn.Module:
    """Shard every parameter of ``module`` along dim 0 in place (rank keeps chunk ``rank``); return ``module``.

    Each distinct ``nn.Parameter`` gets ONE shard parameter and ONE ``GatherShard`` instance. A parameter shared by
    several owners (tied embeddings: ``lm_head.weight is model.embed_tokens.weight``) is parametrized on every
    owner with that same shard object and that same ``GatherShard``: ``named_parameters()`` then lists it once
    (``model.embed_tokens.parametrizations.weight.original``) and each owner's access all-gathers it.
    ``reshard_after_forward``: selective activation checkpointing with MUST_RECOMPUTE on the ``_c10d_functional``
    all-gather and wait, so the backward graph all-gathers again. Uneven dim 0 raises (no padding).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if any(isinstance(m, GatherShard) for m in module.modules()):
        raise RuntimeError("shard_simple_fsdp: module is already sharded")
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            owners.setdefault(id(p), []).append((mod, name))
            params[id(p)] = p
    bad = [f"{n}: {tuple(p.shape)}" for n, p in module.named_parameters() if p.dim() == 0 or p.shape[0] % world_size]
    if bad:
        raise ValueError(f"shard_simple_fsdp: dim 0 not divisible by world_size={world_size}: {bad}")
    for key, full in params.items():
        shard = nn.Parameter(full.detach().chunk(world_size, dim=0)[rank].clone(), requires_grad=full.requires_grad)
        gather = GatherShard(group, reshard_after_forward)
        for mod, name in owners[key]:
            del mod._parameters[name]
            setattr(mod, name, shard)
            parametrize.register_parametrization(mod, name, gather, unsafe=True)
    return module


def user_fqn(name: str) -> str:
    """``a.b.parametrizations.weight.original`` -> ``a.b.weight`` (parametrize's internal names -> the user's)."""
    parts = name.split(".")
    if "parametrizations" in parts:
        i = parts.index("parametrizations")
        return ".".join(parts[:i] + parts[i + 1:i + 2])
    return name


# --- process group ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def fake_process_group(world_size: int = 2, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """Default process group on torch's communication-free "fake" backend; destroyed on exit, ``sys.excepthook``
    restored (``init_process_group`` installs a ``[rankN]:`` prefixing excepthook and never removes it)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("fake_process_group: a default process group already exists")
    old_hook = sys.excepthook
    _forget_dtensor_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        assert dist.group.WORLD is not None
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
        _forget_dtensor_caches()
        sys.excepthook = old_hook


def _forget_dtensor_caches() -> None:
    """What any code that opens and destroys process groups in one process must do (README, "One process, many
    traces"): DTensor's sharding caches match device meshes by equality and would hand the next group's models the
    meshes of this one."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()


# --- torchtitan ---------------------------------------------------------------------------------------------------

# torchtitan 0.3.0: ``torchtitan.models.common.token_dispatcher`` imports ``torchtitan.distributed.minimal_async_ep``,
# whose ``api`` imports ``.kernels`` -> ``import triton`` (GPU-only, absent from the CPU wheel). Those kernels are
# for expert-parallel all-to-all only, never on the Llama3 + simple_fsdp path. We stub that one module while
# importing. Importing ``torchtitan.experiments.graph_trainer.llama3`` (the package) would also pull
# ``torchtitan.trainer`` -> ``torch.utils.tensorboard`` (needs tensorboard) and ``datasets``: we avoid it by using
# ``torchtitan.models.llama3.Llama3Model`` (graph_trainer's ``GraphTrainerLlama3Model`` only re-wraps
# ``init_states`` in ``disable_active_parametrization``, which we call before sharding anyway).
_TRITON_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
_KERNEL_NAMES = (
    "copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel", "topk_scores_grad_kernel",
)


def _unavailable(name: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{_TRITON_KERNELS}.{name} is a stub (triton kernels are not available on CPU)")

    return kernel


@contextlib.contextmanager
def torchtitan_stubs() -> Iterator[None]:
    """Temporarily put a stub for ``torchtitan.distributed.minimal_async_ep.kernels`` (triton) in ``sys.modules``.

    Only that entry is added, and only if it is not importable for real; it is removed on exit (modules imported
    meanwhile keep their references to the stub functions, which raise if ever called)."""
    try:
        import triton  # noqa: F401
        have_triton = True
    except ImportError:
        have_triton = False
    if have_triton or _TRITON_KERNELS in sys.modules:
        yield
        return
    stub = types.ModuleType(_TRITON_KERNELS)
    stub.__doc__ = "stub inserted by tests/thirdparty/models.py (no triton on CPU)"
    for name in _KERNEL_NAMES:
        setattr(stub, name, _unavailable(name))
    sys.modules[_TRITON_KERNELS] = stub
    try:
        yield
    finally:
        if sys.modules.get(_TRITON_KERNELS) is stub:
            del sys.modules[_TRITON_KERNELS]


def _torchtitan_config(vocab: int) -> Any:
    import torchtitan.models.llama3 as tt_llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention

    dim, n_heads = HIDDEN, 4
    config = tt_llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=tt_llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=tt_llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=tt_llama3._output_linear_init(dim)),
        layers=tt_llama3._build_llama3_layers(
            fuse_qkv=True, n_layers=LAYERS, dim=dim, n_heads=n_heads, n_kv_heads=2,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=64),  # 192
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=4 * SEQ_LEN, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )
    # As torchtitan's own graph_trainer tests do (common_utils.build_decoder_config_for_backend "sdpa"): build the
    # flex config and swap in SDPA, avoiding FlexAttention's BlockMask inputs.
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def torchtitan_llama3(mode: str = "fully_shard", *, seed: int = SEED, annotate: bool = True,
                      reshard_after_forward: bool = False) -> tuple[nn.Module, Callable[[], Batch]]:
    """torchtitan 0.3.0 ``Llama3Model`` (2 layers, dim 64, 4 heads / 2 KV heads, fused ``wqkv``, vocab 128, SDPA),
    sharded by ``torchtitan.experiments.graph_trainer.simple_fsdp.data_parallel(model, mesh, mode)`` applied once
    to the whole model, as graph_trainer's ``apply_simple_fsdp`` does (fp32, no mixed precision).

    Needs an initialized default process group (``fake_process_group``): ``mode="fully_shard"`` uses a 1-D mesh
    ``("fsdp",)`` of the whole world; ``"hybrid_shard"`` a 2-D mesh ``("dp_replicate", "fsdp")`` of shape
    ``(2, world_size // 2)`` (world size 4 -> 2 x 2). ``annotate=True`` applies graph_trainer's
    ``annotate_module_fqns`` first (``node.meta["custom"]["module_fqn"]`` on traced nodes), as its
    ``parallelize_llama`` does. The model returns logits (a tensor); ``loss_fn(logits)``.

    ``"fsdp_tp"`` / ``"fsdp_tp_no_sp"``: FSDP + TP on 4 ranks (see ``_torchtitan_llama3_fsdp_tp``).

    ``reshard_after_forward=True``: each parameter's gather (``ReplicateComputation.replicate_compute``) runs under
    selective activation checkpointing with MUST_RECOMPUTE on the ``_c10d_functional`` all-gather and wait, as
    SimpleFSDP's ``fsdp_policy`` did before torchtitan moved resharding into graph passes; the backward graph then
    all-gathers the parameters again (see ``_reshard_after_forward``).
    """
    if mode in _TP_MODES:
        model, make_batch = _torchtitan_llama3_fsdp_tp(sequence_parallel=mode == "fsdp_tp", seed=seed,
                                                       annotate=annotate)
        return (_reshard_after_forward(model) if reshard_after_forward else model), make_batch
    if mode not in ("fully_shard", "hybrid_shard"):
        raise ValueError(f"mode must be one of 'fully_shard', 'hybrid_shard', {', '.join(map(repr, _TP_MODES))}; "
                         f"got {mode!r}")
    if not dist.is_initialized():
        raise RuntimeError("torchtitan_llama3 needs a default process group: wrap it in fake_process_group(...)")
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    with torchtitan_stubs():
        from torchtitan.experiments.graph_trainer import simple_fsdp
        from torchtitan.experiments.graph_trainer.common_utils import annotate_module_fqns
        from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel, disable_active_parametrization

        config = _torchtitan_config(VOCAB)
    torch.manual_seed(seed)
    model = config.build()
    with disable_active_parametrization():
        model.init_states(buffer_device=torch.device("cpu"))
    if annotate:
        annotate_module_fqns(model)
    if mode == "fully_shard":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    else:
        if world % 2:
            raise ValueError(f"hybrid_shard needs an even world size, got {world}")
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "fsdp"))
    # torchtitan 0.3.0 caches one ``SimpleFSDP<Class>`` subclass per (module class, parameter names) in
    # ``simple_fsdp._wrap_class_cache``; its parameter properties close over the ReplicateComputation (mesh, mode)
    # of the FIRST module wrapped. Within one model that is harmless (one mesh), but a second model in the same
    # process (e.g. hybrid_shard after fully_shard) would silently use the first one's mesh. Clear it first.
    simple_fsdp._wrap_class_cache.clear()
    model = data_parallel(model, mesh, mode)
    model.train()
    return (_reshard_after_forward(model) if reshard_after_forward else model), _batch_fn(VOCAB, seed)


def _reshard_after_forward(model: nn.Module) -> nn.Module:
    """Wrap the forward of every SimpleFSDP ``ReplicateComputation`` of ``model`` in selective activation
    checkpointing that recomputes the functional all-gather and its wait (``_sac_policy``): the forward saves
    no gathered parameter, the backward gathers again. In torchtitan 0.3.0 the ``ReplicateComputation`` objects
    live only in the closures of the parameter properties ``data_parallel`` puts on each ``SimpleFSDP<Class>``;
    each gets an instance-level ``forward`` (the class is left alone). Returns ``model``."""
    with torchtitan_stubs():
        from torchtitan.experiments.graph_trainer import simple_fsdp

    found: dict[int, nn.Module] = {}
    for mod in model.modules():
        for attr in vars(type(mod)).values():
            closure = attr.fget.__closure__ if isinstance(attr, property) and attr.fget is not None else None
            for cell in closure or ():
                if isinstance(cell.cell_contents, simple_fsdp.ReplicateComputation):
                    found.setdefault(id(cell.cell_contents), cell.cell_contents)
    if not found:
        raise AssertionError("_reshard_after_forward: no SimpleFSDP ReplicateComputation found on the model")
    context_fn = functools.partial(create_selective_checkpoint_contexts, _sac_policy)

    def resharded(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not simple_fsdp._active_parametrization:
            return x
        return checkpoint(self.replicate_compute, x, use_reentrant=False, context_fn=context_fn)

    for rc in found.values():
        rc.forward = types.MethodType(resharded, rc)
    return model


_TP_MODES = ("fsdp_tp", "fsdp_tp_no_sp")


@contextlib.contextmanager
def _cpu_meshes() -> Iterator[None]:
    """torchtitan 0.3.0 picks the mesh device type at import (``tools.utils.device_type``): ``"cuda"`` when no
    accelerator is found, so ``ParallelDims.build_mesh`` and ``distribute_tensor`` would move tensors to CUDA on
    the CPU wheel. Point ``parallel_dims.device_type`` at ``"cpu"`` while the meshes are built; restored on exit
    (the DeviceMeshes remember their own device type)."""
    import torchtitan.distributed.parallel_dims as parallel_dims

    old = parallel_dims.device_type
    parallel_dims.device_type = "cpu"
    try:
        yield
    finally:
        parallel_dims.device_type = old


def _torchtitan_llama3_fsdp_tp(*, sequence_parallel: bool, seed: int, annotate: bool,
                               ) -> tuple[nn.Module, Callable[[], Batch]]:
    """torchtitan's FSDP + TP Llama3 exactly as graph_trainer's ``parallelize_llama`` builds it, on 4 ranks:

    - ``ParallelDims(dp_shard=2, tp=2, spmd_backend="partial_dtensor")`` (graph_trainer's ``to_graph_trainer_config``
      pins ``partial_dtensor``; ``set_spmd_backend`` is set to it, as the trainer does; a process global), whose
      ``build_mesh`` unflattens the world into ``("pp", "dp_replicate", "fsdp", "tp")`` = ``(1, 1, 2, 2)``;
    - ``set_llama3_sharding_config(config, enable_sp=sequence_parallel)`` (torchtitan's default is
      ``enable_sequence_parallel=True``): ``wqkv``/``w1``/``w3``/``lm_head`` colwise, ``wo``/``w2`` rowwise,
      ``tok_embeddings`` row-sharded (vocab), norms replicated; with SP the activations between blocks are
      ``Shard(1)`` (sequence) and the block boundaries all-gather / reduce-scatter on the tp group, without SP
      ``wo``/``w2``/the embedding all-reduce;
    - ``annotate_module_fqns``, then ``model.parallelize(parallel_dims)``, then ``data_parallel`` on the ``fsdp``
      mesh dimension, ``mode="fully_shard"`` (``apply_simple_fsdp``'s choice without ``dp_replicate``).

    The model's output is a ``Shard(-1)`` (vocab) DTensor on the tp mesh. Returning a DTensor from the compiled
    region makes aot's min-cut partitioner raise (torch 2.13: ``Node tangents_2 was invalid, but is output``; the
    tangent's ``device_mesh`` input), so the root ``forward`` returns ``logits.to_local()``, the first step of
    torchtitan's own loss for this layout (``components.loss.cross_entropy_loss``); ``loss_fn`` is the rest of it:
    ``_LossParallelCrossEntropy`` over the tp group, sum reduction, outside the compiled region.
    """
    if not dist.is_initialized():
        raise RuntimeError("torchtitan_llama3 needs a default process group: wrap it in fake_process_group(...)")
    world = dist.get_world_size()
    if world != 4:
        raise ValueError(f"FSDP + TP runs on a 2 x 2 mesh: needs world size 4, got {world}")
    with torchtitan_stubs():
        from torchtitan.components.loss import _LossParallelCrossEntropy
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.distributed.parallel_dims import ParallelDims
        from torchtitan.experiments.graph_trainer import simple_fsdp
        from torchtitan.experiments.graph_trainer.common_utils import annotate_module_fqns
        from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel, disable_active_parametrization
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        config = _torchtitan_config(VOCAB)
    set_llama3_sharding_config(config, enable_sp=sequence_parallel)
    dist_utils.set_spmd_backend("partial_dtensor")
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1, world_size=world,
                        spmd_backend="partial_dtensor")
    with _cpu_meshes():
        dims.build_mesh()
        torch.manual_seed(seed)
        model = config.build()
        with disable_active_parametrization():
            model.init_states(buffer_device=torch.device("cpu"))
        if annotate:
            annotate_module_fqns(model)
        model.parallelize(dims)
    simple_fsdp._wrap_class_cache.clear()  # see torchtitan_llama3
    model = data_parallel(model, dims.get_mesh(["fsdp"]), "fully_shard")
    model.train()
    if "forward" in vars(model):
        raise AssertionError("torchtitan's parallelize wrapped the root forward; _torchtitan_llama3_fsdp_tp expects "
                             "only submodules to be wrapped")

    def local_logits(self: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        return type(self).forward(self, *args, **kwargs).to_local()

    # A bound method (not a closure over the model): dynamo's root stays ``L['self']``, so parameter sources read
    # ``L['self']._modules['layers']...`` as for the other torchtitan modes.
    model.forward = types.MethodType(local_logits, model)
    tp_group = dims.get_mesh("tp").get_group()

    def make_batch() -> Batch:
        tokens, targets = _tokens(VOCAB, seed)

        def loss_fn(local_logits: torch.Tensor) -> torch.Tensor:
            return _LossParallelCrossEntropy.apply(local_logits.flatten(0, 1).float(), targets.flatten(0, 1),
                                                   tp_group, VOCAB, "sum")

        return (tokens,), loss_fn

    return model, make_batch


# --- graph capture ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class CapturedGraphs:
    """Copies of the graphs one compiled forward + backward produced (node ``meta`` dicts shallow-copied)."""

    dynamo_graph: fx.GraphModule
    forward: fx.GraphModule
    backward: fx.GraphModule
    joint_inputs: int  # number of flat inputs aot saw (for reference)
    seconds: float  # wall time of compile + forward + backward
    world_size: int
    rank: int
    extra_graphs: list[tuple[str, fx.GraphModule]] = dataclasses.field(default_factory=list)  # graph breaks


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """An independent ``GraphModule``: every node (placeholders and the output too) re-created with the same
    name, args and a shallow copy of ``meta``; attributes (get_attr targets, submodules) shared with ``gm``.
    (``copy.deepcopy`` re-creates the output node through ``Graph.output`` and loses its ``meta``.)"""
    graph = fx.Graph(tracer_cls=gm.graph._tracer_cls)
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
        if env[node].name != node.name:
            raise AssertionError(f"copy_graph_module: node {node.name} renamed to {env[node].name}")
    copied = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    copied.meta = dict(getattr(gm, "meta", {}))
    return copied


def _aot_capture_backend(captured: dict[str, list[fx.GraphModule]]) -> Callable[..., Any]:
    """aot_autograd with the min-cut partitioner whose forward / backward compilers keep copies of the graphs they
    are given and run them as they are (boxed eager)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def compiler(kind: str) -> Callable[[fx.GraphModule, Any], Callable[..., Any]]:
        def compile_graph(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
            captured[kind].append(copy_graph_module(gm))
            return make_boxed_func(gm.forward)

        return compile_graph

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                        partition_fn=min_cut_rematerialization_partition)


def capture_graphs(model: nn.Module, inputs: Sequence[Any], loss_fn: Callable[[Any], torch.Tensor], *,
                   world_size: int = 2, rank: int = 0, fullgraph: bool = True) -> CapturedGraphs:
    """Compile ``model`` (``torch.compile(model, backend=...)``), run ``loss_fn(compiled(*inputs)).backward()`` once
    and return copies of: the dynamo ``GraphModule`` handed to the backend, and aot_autograd's forward / backward
    graphs as given to its fw / bw compilers (partition_fn ``min_cut_rematerialization_partition``, boxed eager
    execution of the original graphs).

    Runs under ``fake_process_group(world_size, rank)``, destroyed afterwards; if a default process group already
    exists (torchtitan: its mesh was built under it) that one is used, checked against ``world_size``/``rank``, and
    left open. ``torch._dynamo.reset()`` is called before and after. Parameters' ``.grad`` are cleared afterwards.
    The fake backend does not communicate, so computed VALUES are garbage; graphs, shapes and dtypes are real.
    """
    torch._dynamo.reset()
    captured: dict[str, list[fx.GraphModule]] = {"dynamo": [], "forward": [], "backward": []}
    counts: list[int] = []
    aot_backend = _aot_capture_backend(captured)

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        captured["dynamo"].append(copy_graph_module(gm))
        counts.append(len(example_inputs))
        return aot_backend(gm, example_inputs)

    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise ValueError(f"capture_graphs: open process group is rank {dist.get_rank()} of "
                             f"{dist.get_world_size()}, asked for rank {rank} of {world_size}")
        pg: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    else:
        pg = fake_process_group(world_size, rank)
    start = time.perf_counter()
    try:
        with pg:
            compiled = torch.compile(model, backend=backend, fullgraph=fullgraph)
            loss = loss_fn(compiled(*inputs))
            loss.backward()
    finally:
        seconds = time.perf_counter() - start
        torch._dynamo.reset()
        model.zero_grad(set_to_none=True)
    if not captured["forward"] or not captured["backward"]:
        raise AssertionError("capture_graphs: missing graphs, got {k: len(v) for k, v in captured.items()}")
    extra = [(f"{k}[{i}]", g) for k, gs in captured.items() for i, g in enumerate(gs) if i]
    return CapturedGraphs(dynamo_graph=captured["dynamo"][0], forward=captured["forward"][0],
                          backward=captured["backward"][0], joint_inputs=counts[0], seconds=seconds,
                          world_size=world_size, rank=rank, extra_graphs=extra)
