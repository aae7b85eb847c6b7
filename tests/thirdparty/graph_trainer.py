"""torchtitan 0.3.0 graph_trainer whole-step graphs, captured exactly as its trainer captures them. No overlapcfg.

The graph trainer's default ``compile.mode="aot_fx_trace"`` traces forward + loss + backward (optionally the
optimizer step) into ONE graph with ``make_fx_tracer.minimal_fx_tracer``, then runs the passes
``passes.compile_time_passes`` lists. This module does the same on tiny models, on CPU, and stops before the one
pass overlapcfg replaces: ``fsdp_passes.joint_transformer_block_bucketing_reordering_pass``. That pass is kept,
configured as ``compile_time_passes`` configures it, so a test can run torchtitan's own bucketing on the same graph
and compare.

What a captured graph looks like (torch 2.13, 2 ranks): inputs ``arg0_1 ...`` (each DTensor parameter is two flat
inputs: the local shard and an int64 mesh-coordinate tensor), no aot descriptors, no ``primals_`` names, no
``nn_module_stack``; module names only in ``meta["custom"]["module_fqn"]`` (copied onto backward nodes; the loss
labelled ``loss``); backward nodes carry ``meta["autograd_backward"]``; with reshard "always" the remat pass emits
recomputed forward ops, parameter re-gathers included, into the backward.

Models (2 layers, dim 64, vocab 128, batch 2, seq 16; SimpleFSDP ``data_parallel(..., mode="fully_shard")`` on a
1-D ``("fsdp",)`` mesh of the whole world, fp32):

- ``llama3``: torchtitan's ``Llama3Model`` (``models.torchtitan_llama3``);
- ``qwen3_tied``: torchtitan's ``GraphTrainerQwen3Model`` with ``enable_weight_tying=True`` (``tok_embeddings``
  tied to ``lm_head``), built in the trainer's order: ``annotate_module_fqns`` -> ``data_parallel`` (which unties)
  -> ``init_states`` (which re-ties).

Variants: ``reshard`` ("always" / "never": ``parallelism.fsdp_reshard_after_forward``, read by the memory policy),
``optimizer`` (False: the trainer's own step function, gradients returned as graph outputs; True: the same step
with ``torch.optim.AdamW`` traced in, as ``minimal_fx_tracer(fn, module=model, optimizer=opt)`` supports: the
gradients are consumed by in-place optimizer updates, the step returns the loss only) and ``loss``
("cross_entropy": ``CrossEntropyLoss``, as torchtitan's own pass tests use; "chunked": the loss the graph
trainer's Llama3 configs train with, ``graph_trainer_llama3_debugmodel`` and ``graph_trainer_llama3_8b`` included:
``ChunkedLossWrapper`` (8 sequence chunks) turned into ``ChunkedLossWrapperWithParamGrads`` by
``to_graph_trainer_config``, the model run with ``_skip_lm_head`` and ``lm_head`` called once per chunk, as the
trainer sets it up. Traced, ``lm_head``'s weight gradient is reduce-scattered once per chunk and the 8 partials are
accumulated in place, ``add_``).

CPU set-up quirks handled here (see NOTES.md section 6): the default SAC policy's save list holds only the CUDA SDPA
ops, and the remat pass cannot recompute ``aten._scaled_dot_product_flash_attention_for_cpu`` (nondeterministic
seeded), so it is added to the saved ops while the passes run, as the GPU path saves flash attention. Importing the
graph trainer's passes pulls ``torchtitan.trainer`` -> ``torch.utils.tensorboard`` and ``datasets``, neither
needed here: stubbed while importing, if absent (``graph_trainer_stubs``).

Typical use::

    with fake_process_group(2):                         # DeviceMesh binds the group at shard time
        step = capture_whole_step("llama3", reshard="always")
    gm = step.copy()                                    # the normalized graph, to transform
    with fake_process_group(2):
        theirs = step.torchtitan_bucketing()            # torchtitan's own joint pass on a copy
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import sys
import time
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from . import models as M

__all__ = [
    "BUCKETING_PASS",
    "MODELS",
    "LOSSES",
    "RESHARD",
    "WholeStep",
    "batch",
    "build_model",
    "capture_whole_step",
    "graph_trainer_stubs",
    "run_whole_step",
    "whole_step_parity_worker",
]

MODELS = ("llama3", "qwen3_tied")
RESHARD = ("always", "never")
LOSSES = ("cross_entropy", "chunked")
BUCKETING_PASS = "joint_transformer_block_bucketing_reordering_pass"
LR = 1e-2
"""AdamW learning rate of the traced optimizer step (large enough that one step visibly moves every parameter)."""


# --- imports -----------------------------------------------------------------------------------------------------

def _stub(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__doc__ = "stub inserted by tests/thirdparty/graph_trainer.py (not installed, not needed here)"
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def _unavailable(name: str) -> Any:
    class Unavailable:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"{name} is a stub: it is not installed in this test environment")

    return Unavailable


@contextlib.contextmanager
def graph_trainer_stubs() -> Iterator[None]:
    """``models.torchtitan_stubs`` plus stubs for ``torch.utils.tensorboard`` and ``datasets``, each only if it is
    not importable for real. ``torchtitan.experiments.graph_trainer.passes`` imports ``configs`` -> ``torchtitan.
    trainer`` -> metrics (tensorboard) and the validator's data loader (``datasets``); a trainer run needs them,
    tracing and the graph passes do not. Stubs are removed on exit (modules imported meanwhile keep them)."""
    stubs: dict[str, types.ModuleType] = {}
    if importlib.util.find_spec("tensorboard") is None and "torch.utils.tensorboard" not in sys.modules:
        stubs["torch.utils.tensorboard"] = _stub("torch.utils.tensorboard",
                                                 SummaryWriter=_unavailable("tensorboard.SummaryWriter"))
    if importlib.util.find_spec("datasets") is None and "datasets" not in sys.modules:
        stubs["datasets"] = _stub("datasets", Dataset=_unavailable("datasets.Dataset"),
                                  load_dataset=_unavailable("datasets.load_dataset"))
        stubs["datasets.distributed"] = _stub("datasets.distributed",
                                              split_dataset_by_node=_unavailable("datasets.split_dataset_by_node"))
    sys.modules.update(stubs)
    try:
        with M.torchtitan_stubs():
            yield
    finally:
        for name, module in stubs.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]


# --- models --------------------------------------------------------------------------------------------------------

def _qwen3_tied(seed: int) -> nn.Module:
    """Tiny ``GraphTrainerQwen3Model`` (tied), sharded in the graph trainer's order; needs the default group."""
    from torch.distributed.device_mesh import init_device_mesh

    with graph_trainer_stubs():
        from torchtitan.experiments.graph_trainer import simple_fsdp
        from torchtitan.experiments.graph_trainer.common_utils import annotate_module_fqns
        from torchtitan.experiments.graph_trainer.qwen3.model import GraphTrainerQwen3Model
        from torchtitan.models import qwen3 as tt_qwen3
        from torchtitan.models.common import CosSinRoPE, Embedding, Linear
        from torchtitan.models.common.attention import ScaledDotProductAttention

    dim, head_dim = M.HIDDEN, 16
    config = GraphTrainerQwen3Model.Config(
        vocab_size=M.VOCAB, dim=dim, norm=tt_qwen3._qwen3_norm(dim), enable_weight_tying=True,
        tok_embeddings=Embedding.Config(num_embeddings=M.VOCAB, embedding_dim=dim,
                                        param_init=tt_qwen3._EMBEDDING_SKIP_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=M.VOCAB, param_init=tt_qwen3._LINEAR_INIT),
        layers=tt_qwen3._build_qwen3_layers(
            fuse_qkv=True, n_layers=M.LAYERS, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim, hidden_dim=128,
            attn_backend="flex", rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=4 * M.SEQ_LEN, theta=1e6)),
    )
    for layer in config.layers:  # as models._torchtitan_config: SDPA instead of FlexAttention's BlockMask inputs
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(seed)
    model = config.build()
    annotate_module_fqns(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    simple_fsdp._wrap_class_cache.clear()  # see models.torchtitan_llama3
    model = simple_fsdp.data_parallel(model, mesh, "fully_shard")
    model.init_states(buffer_device=torch.device("cpu"))  # re-ties tok_embeddings.weight to lm_head.weight
    if model.tok_embeddings._parameters["weight"] is not model.lm_head._parameters["weight"]:
        raise AssertionError("qwen3_tied: init_states did not re-tie tok_embeddings.weight to lm_head.weight")
    model.train()
    return model


def build_model(name: str, *, seed: int = M.SEED) -> nn.Module:
    """``llama3`` or ``qwen3_tied``, sharded over the open default process group's world."""
    if not dist.is_initialized():
        raise RuntimeError("build_model needs a default process group (fake_process_group or gloo)")
    if name == "llama3":
        model, _ = M.torchtitan_llama3("fully_shard", seed=seed)
        return model
    if name == "qwen3_tied":
        return _qwen3_tied(seed)
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")


def _model_config(model: nn.Module) -> Any:
    return model.config


def batch(seed: int = M.SEED) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens, labels, global_valid_tokens)``, identical on every rank (each rank computes the full batch: only
    parameters are sharded)."""
    tokens, labels = M._tokens(M.VOCAB, seed)
    return tokens, labels, torch.tensor(float(labels.numel()))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """torchtitan's default optimizer (AdamW, weight decay 0.1) with its state initialized, as
    ``minimal_fx_tracer`` requires: one step at learning rate 0 with zero gradients (parameters unchanged)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)
    for group in opt.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    for group in opt.param_groups:
        group["lr"] = LR
    return opt


def _loss_fn(model: nn.Module, loss: str) -> Any:
    """The trainer's loss function for ``loss`` (``LOSSES``), set up on ``model`` as ``Trainer.__init__`` does."""
    with graph_trainer_stubs():
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.experiments.graph_trainer.chunked_loss import ChunkedLossWrapperWithParamGrads

    if loss == "cross_entropy":
        return CrossEntropyLoss(CrossEntropyLoss.Config())
    if loss != "chunked":
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    chunked = ChunkedLossWrapperWithParamGrads(ChunkedLossWrapperWithParamGrads.Config(
        loss_fn=CrossEntropyLoss.Config()))
    chunked.set_lm_head(model.lm_head)
    model._skip_lm_head = True  # type: ignore[assignment]
    return chunked


def _step_fn(model: nn.Module, optimizer: torch.optim.Optimizer | None,
             loss: str = "cross_entropy") -> Callable[..., Any]:
    """The graph trainer's ``make_fwd_bwd_step`` (forward, annotated loss, ``torch.autograd.grad``); with an
    optimizer, the gradients are then summed per live parameter and ``optimizer.step()`` is traced in too; the step
    returns ``[loss]``.

    Tied parameters: ``minimal_fx_tracer`` wraps each *name* of a tied parameter in its own DTensor (one local
    input, two wrappers), so ``torch.autograd.grad`` returns one partial gradient per use; without an optimizer the
    graph returns both and the trainer sums them outside the graph (``accumulate_param_grads_`` on the live, tied
    parameter). Inside the graph the trainer's helper would not sum them (the wrappers are distinct tensors) and the
    optimizer, which holds one wrapper per live parameter, would drop the other use's partial; so the partials are
    summed here by the live parameter's identity, as eager accumulation does: ``add(rs_tok_embeddings,
    rs_lm_head)`` feeds the update."""
    with graph_trainer_stubs():
        from torchtitan.experiments.graph_trainer.trainer import make_fwd_bwd_step

    fwd_bwd = make_fwd_bwd_step(model, _loss_fn(model, loss))
    if optimizer is None:
        return fwd_bwd
    live = [p for _, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
    group = [next(i for i, q in enumerate(live) if q is p) for p in live]  # first name of the same live parameter

    def fwd_bwd_opt(inputs: Any, labels: Any, global_valid_tokens: Any, extra_kwargs: Any) -> list[torch.Tensor]:
        loss, *grads = fwd_bwd(inputs, labels, global_valid_tokens, extra_kwargs)
        params = [p for _, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
        totals: dict[int, torch.Tensor] = {}
        for g, first in zip(grads, group, strict=True):
            totals[first] = g if first not in totals else totals[first] + g
        for p, first in zip(params, group, strict=True):
            p.grad = totals[first]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return [loss]

    return fwd_bwd_opt


def loss_config(loss: str) -> Any:
    """The trainer config's ``loss`` for ``loss`` (``LOSSES``): ``compile_time_passes`` reads it (a chunked loss
    adds ``loss`` to the head's bucket of its plan)."""
    with graph_trainer_stubs():
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.experiments.graph_trainer.chunked_loss import ChunkedLossWrapperWithParamGrads

    if loss == "chunked":
        return ChunkedLossWrapperWithParamGrads.Config(loss_fn=CrossEntropyLoss.Config())
    return CrossEntropyLoss.Config()


def _trainer_config(model: nn.Module, reshard: str, loss: str = "cross_entropy") -> Any:
    """The slice of ``GraphTrainer.Config`` that ``compile_time_passes`` reads (as torchtitan's own
    ``test_passes.py`` builds it): default compile config, the loss, the model's layers, and
    ``parallelism.fsdp_reshard_after_forward``."""
    with graph_trainer_stubs():
        from torchtitan.config import ParallelismConfig
        from torchtitan.experiments.graph_trainer.configs import GraphTrainerCompileConfig

    return types.SimpleNamespace(
        compile=GraphTrainerCompileConfig(), loss=loss_config(loss),
        model_spec=types.SimpleNamespace(model=_model_config(model)),
        parallelism=ParallelismConfig(fsdp_reshard_after_forward=reshard))


@contextlib.contextmanager
def _cpu_sdpa_saved() -> Iterator[None]:
    """The default SAC policy saves the CUDA SDPA ops only; on CPU it would ask the remat pass to recompute
    ``_scaled_dot_product_flash_attention_for_cpu``, which it refuses (nondeterministic seeded). Save it, as the GPU
    path saves flash attention."""
    from torchtitan.experiments.graph_trainer import memory_policy

    original = memory_policy._get_default_save_ops
    cpu_sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    memory_policy._get_default_save_ops = lambda: {*original(), cpu_sdpa}
    try:
        yield
    finally:
        memory_policy._get_default_save_ops = original


# --- capture -------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class WholeStep:
    """One captured whole-step graph after torchtitan's normalization passes (not yet bucketed)."""

    model: str
    reshard: str
    optimizer: bool
    loss: str
    world_size: int
    rank: int
    traced: Any
    """torchtitan's ``TracedResult``; ``traced.gm`` is the normalized graph (shared: use ``copy()`` to change it)."""
    module_bucket_plans: list[Any]
    """The plan ``compile_time_passes`` builds: ``tok_embeddings``, ``layers.N``, ``[norm, lm_head]``."""
    bucketing_pass: Callable[..., fx.GraphModule]
    """torchtitan's ``joint_transformer_block_bucketing_reordering_pass``, bound as ``compile_time_passes`` binds
    it (plan and FSDP2 parameter-module order from ``state_fqns``): ``bucketing_pass(gm, example_inputs)``."""
    pass_names: tuple[str, ...]
    """The passes that ran, in order (torchtitan's list without the bucketing pass)."""
    seconds: float

    @property
    def name(self) -> str:
        return step_name(self.model, self.reshard, self.optimizer, self.loss)

    @property
    def gm(self) -> fx.GraphModule:
        return self.traced.gm

    def copy(self) -> fx.GraphModule:
        """An independent copy of the normalized graph (same node names, ``meta`` shallow-copied)."""
        return M.copy_graph_module(self.traced.gm)

    def torchtitan_bucketing(self, *, fsdp2_order: bool = True,
                             module_bucket_plans: list[Any] | None = None) -> fx.GraphModule:
        """torchtitan's own joint bucketing pass on a copy (needs a process group of ``world_size``, e.g. fake; on a
        CPU-only torch its scheduler also needs triton's bandwidth estimate faked). ``fsdp2_order=False``: bound
        with an empty ``fsdp_param_module_order``, so each bucket is packed as upstream ``manual_overlap_bucketing``
        packs it (plan module by plan module, graph order within) instead of in FSDP2's parameter order.
        ``module_bucket_plans``: another plan than the one ``compile_time_passes`` builds."""
        keywords = dict(self.bucketing_pass.keywords)
        if not fsdp2_order:
            keywords["fsdp_param_module_order"] = {}
        if module_bucket_plans is not None:
            keywords["module_bucket_plans"] = module_bucket_plans
        pass_fn = functools.partial(self.bucketing_pass.func, **keywords)
        return pass_fn(self.copy(), self.traced.example_inputs)

    def input_fqns(self) -> dict[str, str]:
        """``{placeholder name: state FQN}`` for the model-state inputs, from torchtitan's ``TracedResult``
        (``state_fqns`` in flat order, each DTensor flattened into ``num_tensors`` inputs, its local shard first)."""
        placeholders = [n.name for n in self.gm.graph.find_nodes(op="placeholder")]
        layouts = self.traced.input_subclass_layouts
        out, position = {}, 0
        for i, fqn in enumerate(self.traced.state_fqns):
            out[placeholders[position]] = fqn
            position += layouts[i].num_tensors if i in layouts else 1
        return out

    def with_graph(self, gm: fx.GraphModule) -> Any:
        """A shallow copy of ``traced`` whose graph is ``gm`` (what ``run_traced`` runs)."""
        return dataclasses.replace(self.traced, gm=gm)


def _normalize(traced: Any, config: Any) -> tuple[fx.GraphModule, Callable[..., fx.GraphModule], tuple[str, ...],
                                                   list[Any]]:
    with graph_trainer_stubs():
        from torchtitan.experiments.graph_trainer import passes as P

    passes = P.compile_time_passes(traced, config, include_inductor=False)
    bucketing = [p for p in passes if P._get_pass_name(p) == BUCKETING_PASS]
    if len(bucketing) != 1:
        raise AssertionError(f"expected one {BUCKETING_PASS} in {[P._get_pass_name(p) for p in passes]}")
    kept = [p for p in passes if p is not bucketing[0]]
    gm = traced.gm
    with _cpu_sdpa_saved():
        for pass_fn in kept:
            gm = pass_fn(gm, traced.example_inputs)
            if not isinstance(gm, fx.GraphModule):
                raise AssertionError(f"{P._get_pass_name(pass_fn)} returned {type(gm).__name__}")
    plans = bucketing[0].keywords["module_bucket_plans"]
    return gm, bucketing[0], tuple(P._get_pass_name(p) for p in kept), plans


def step_name(model: str, reshard: str, optimizer: bool, loss: str = "cross_entropy") -> str:
    """``llama3-always``, ``qwen3_tied-never-optim``, ``llama3-always-chunked``."""
    return f"{model}-{reshard}{'-optim' if optimizer else ''}{'-chunked' if loss == 'chunked' else ''}"


def trace(model: nn.Module, *, reshard: str, optimizer: torch.optim.Optimizer | None,
          loss: str = "cross_entropy") -> tuple[Any, Any]:
    """Trace one whole step of ``model`` (and ``optimizer``) and normalize it; returns ``(traced, extras)`` where
    ``extras`` is ``(bucketing_pass, pass_names, module_bucket_plans)``. The default group must be open."""
    if reshard not in RESHARD:
        raise ValueError(f"reshard must be one of {RESHARD}, got {reshard!r}")
    with graph_trainer_stubs():
        from torchtitan.experiments.graph_trainer.make_fx_tracer import minimal_fx_tracer

    tokens, labels, valid = batch()
    traced = minimal_fx_tracer(_step_fn(model, optimizer, loss), module=model, optimizer=optimizer)(
        tokens, labels, valid, {})
    gm, bucketing, names, plans = _normalize(traced, _trainer_config(model, reshard, loss))
    traced.gm = gm
    return traced, (bucketing, names, plans)


def capture_whole_step(model: str, *, reshard: str = "always", optimizer: bool = False,
                       loss: str = "cross_entropy") -> WholeStep:
    """Build ``model``, trace its whole step as the graph trainer does and run torchtitan's passes up to (not
    including) its joint bucketing pass. Runs under the open default group (fake for capture, gloo for parity)."""
    started = time.perf_counter()
    module = build_model(model)
    opt = _optimizer(module) if optimizer else None
    traced, (bucketing, names, plans) = trace(module, reshard=reshard, optimizer=opt, loss=loss)
    return WholeStep(model, reshard, optimizer, loss, dist.get_world_size(), dist.get_rank(), traced, plans,
                     bucketing, names, time.perf_counter() - started)


def run_whole_step(traced: Any, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Run a traced whole step on live state with torchtitan's ``run_traced`` (real collectives on the open
    group); returns the graph's outputs (``[loss, *grads]``, or ``[loss]`` with the optimizer traced in, which then
    updates ``model``'s parameters and ``optimizer``'s state in place)."""
    with graph_trainer_stubs():
        from torchtitan.experiments.graph_trainer.make_fx_tracer import run_traced

    tokens, labels, valid = batch()
    return list(run_traced(traced, module=model, optimizer=optimizer)(tokens, labels, valid, {}))


# --- 2-rank parity ----------------------------------------------------------------------------------------------

def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return (to_local() if to_local is not None else t).detach().clone()


def whole_step_parity_worker(rank: int, world_size: int, jobs: Sequence[tuple[Any, ...]],
                             transform: Callable[[fx.GraphModule, dict[str, Any]], fx.GraphModule],
                             ) -> dict[str, Any]:
    """For each ``(model, reshard, optimizer, cfg[, loss])``: capture the whole step on this rank's gloo group
    (``loss``: ``LOSSES``, cross entropy by default; results keyed by ``step_name``), run it once
    untransformed and once as ``transform(copy, cfg)`` returns it, each from the same freshly built model (and
    optimizer) state. Returns per job the losses, the outputs (gradient shards) and, with the optimizer, the
    updated parameter shards of both runs, plus ``transform``'s graph for inspection counts.

    ``transform`` is the caller's (overlapcfg's pass, from the test): this module itself imports no overlapcfg."""
    out: dict[str, Any] = {}
    for model_name, reshard, with_optimizer, cfg, *rest in jobs:
        loss = rest[0] if rest else "cross_entropy"
        started = time.perf_counter()
        results = {}
        step = capture_whole_step(model_name, reshard=reshard, optimizer=with_optimizer, loss=loss)
        transformed = transform(step.copy(), cfg)
        for label, gm in (("reference", step.gm), ("transformed", transformed)):
            model = build_model(model_name)
            opt = _optimizer(model) if with_optimizer else None
            outputs = run_whole_step(step.with_graph(gm), model, opt)
            results[label] = {
                "loss": outputs[0].detach().clone(),
                "outputs": [_local(t) for t in outputs[1:]],
                "params": {n: _local(p) for n, p in model.named_parameters()} if with_optimizer else {},
                "collectives": _collective_counts(gm),
                # what the same-schedule check found (a transform that runs it records it on the graph)
                "same_schedule": getattr(gm.meta.get("overlapcfg"), "same_schedule", None),
            }
        results["seconds"] = time.perf_counter() - started
        out[step_name(model_name, reshard, with_optimizer, loss)] = results
    return out


def _collective_counts(gm: fx.GraphModule) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and str(node.target).startswith("_c10d_functional.") \
                and "wait_tensor" not in str(node.target):
            name = str(node.target).split(".")[1]
            counts[name] = counts.get(name, 0) + 1
    return counts


def deepcopy_traced(traced: Any) -> Any:
    """A ``TracedResult`` with an independent copy of its graph."""
    return dataclasses.replace(traced, gm=M.copy_graph_module(traced.gm))

