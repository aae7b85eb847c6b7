"""Trace one training step of the demo Llama (or any module) on a demo mesh, on top of the public capture.

``trace_train_step`` builds the model, opens a fake process group of the mesh's size, builds the mesh and shards
(``overlapcfg.demo.parallel``), then captures the step with ``overlapcfg.capture_step`` (the production backend,
``overlapcfg.passes.backend.GraphBackend``: aot_autograd with the min-cut partitioner). On ``device="meta"`` it
computes nothing. The same backend, given passes, is what executes transformed graphs on real ranks
(``compile_with_pass``), so traced graphs and executed graphs come from one construction.

Attribution is the production one (``overlapcfg.graph.attribution``, from aot's descriptors); the demo also
checks that every collective of its own SimpleFSDP sharding was attributed, since it knows they all are FSDP's.

Graphs are rank-specific in general (torch's merge helpers write the rank into them), and the fake group's name
is "0" in every trace. On a mesh (``parallel=ParallelDims(...)``: HSDP, FSDP + TP, see ``overlapcfg.demo.parallel``)
the fake group has the product size, the mesh's sub-groups are built first thing inside it (so their names are the
same in every trace), and ``TracedStep.process_groups`` rebuilds them for the pass.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeAlias, cast

import torch
from torch import fx, nn

from overlapcfg import compat
from overlapcfg.capture.simple_fsdp import AllGatherShard, is_sharded, sharded_parameters
from overlapcfg.capture.trace import capture_step
from overlapcfg.demo.dims import ParallelDims
from overlapcfg.demo.llama import Llama, LlamaConfig, cross_entropy_loss
from overlapcfg.demo.parallel import build_mesh, parallelize
from overlapcfg.errors import OverlapConfigError, OverlapLookupError, OverlapUsageError
from overlapcfg.graph.attribution import CollectiveOwner, module_fqn
from overlapcfg.kinds import Direction
from overlapcfg.passes.backend import CapturedStep, GraphBackend, GraphPass

__all__ = [
    "CollectiveOwner",
    "Direction",
    "GraphPass",
    "StepBackend",
    "TracedStep",
    "compile_with_pass",
    "demo_batch",
    "module_fqn",
    "trace_train_step",
    "train_step",
]

log = logging.getLogger(__name__)

Criterion: TypeAlias = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""The demo's loss from its logits and targets (cross-entropy by default); ``capture.trace.LossFn`` is the loss a
captured step reads off any model's output."""

StepBackend = GraphBackend
"""The demo traces with the production backend (no pass): the graphs it captures are the graphs users get."""


@dataclass(frozen=True, slots=True, repr=False)
class TracedStep(CapturedStep):
    """A captured step of the demo Llama, with how it was sharded and traced."""

    config: LlamaConfig | None = None
    reshard_after_forward: bool = False
    trace_seconds: float = 0.0
    param_dtype: torch.dtype | None = None
    """Dtype the shards were cast to before their all-gathers (``shard_module``'s option; ``None``: no cast)."""
    reduce_dtype: torch.dtype | None = None
    """Dtype gradients were reduce-scattered in (``None``: the gathered dtype, ``param_dtype`` if set)."""
    parallel: ParallelDims | None = None
    """The mesh the step was traced on (``dp_shard`` = ``world_size`` for plain FSDP)."""

    def group_of(self, dim: str) -> str:
        """The process-group name the graphs use for mesh dimension ``dim`` (``dp_replicate``, ``dp_shard``, ``tp``)."""
        found = dict(self.mesh_groups)
        if dim not in found:
            raise OverlapLookupError(
                f"TracedStep.group_of: no {dim!r} group in this trace; it has {', '.join(found) or 'none'}")
        return found[dim]

    @contextlib.contextmanager
    def process_groups(self) -> Iterator[object]:
        """Outside a job, the fake default group of the traced size with the mesh's sub-groups rebuilt under the
        names the graphs state: merging resolves groups by name, so the pass needs them
        (``overlapcfg.passes.apply_step``). Inside a job, the job's groups (``CapturedStep``'s rule)."""
        if compat.process_group_initialized():
            with CapturedStep.process_groups(self) as group:
                yield group
            return
        with compat.fake_process_group(self.world_size, self.rank) as group:
            if self.parallel is not None and not self.parallel.is_1d:
                rebuilt = build_mesh(self.parallel).group_names()
                if tuple(rebuilt.items()) != self.mesh_groups:
                    raise AssertionError(f"TracedStep.process_groups: rebuilt mesh groups {rebuilt} differ from the "
                                         f"traced ones {dict(self.mesh_groups)}")
            yield group


def compile_with_pass(model: nn.Module, fw_pass: GraphPass | None = None, bw_pass: GraphPass | None = None, *,
                      backend: StepBackend | None = None) -> nn.Module:
    """``torch.compile`` ``model`` so its forward/backward aot graphs go through the passes, then run eagerly.

    Resets dynamo first: the demo models share one ``forward`` code object, and stale cache entries compiled with
    another backend would otherwise be reused or hit the recompile limit. Pass ``backend`` to inspect the graphs.
    """
    if backend is not None and (fw_pass is not None or bw_pass is not None):
        raise OverlapUsageError("compile_with_pass: give the passes or a backend that holds them, not both")
    compat.dynamo_reset()
    backend = backend if backend is not None else StepBackend(fw_pass, bw_pass)
    return cast(nn.Module, torch.compile(model, backend=backend, fullgraph=True))  # a Module in, an OptimizedModule out


def demo_batch(vocab_size: int, *, batch: int = 2, seq_len: int = 16, seed: int = 0,
               device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded ``(tokens, targets)`` of shape ``(batch, seq_len)``; targets are tokens shifted by one."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq_len + 1), generator=gen)
    return ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)


def train_step(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, *,
               loss_fn: Criterion = cross_entropy_loss) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward + backward (no optimizer step). Returns the detached loss and each parameter's local gradient
    (the shard's, for a sharded model), cloned and keyed by user FQN. The loss is computed outside the model so
    the compiled region is the model alone and its module stacks are rooted at ``L['self']``."""
    for param in model.parameters():
        param.grad = None
    loss = loss_fn(model(tokens), targets)
    loss.backward()
    grads = {fqn: p.grad.detach().clone() for fqn, p in sharded_parameters(model) if p.grad is not None}
    return loss.detach(), grads


# --- tracing ---------------------------------------------------------------------------------------------------

def trace_train_step(model_or_config: nn.Module | LlamaConfig | None = None, *, world_size: int | None = None,
                     rank: int = 0, reshard_after_forward: bool = False, batch: int = 2, seq_len: int = 16,
                     device: torch.device | str = "cpu", seed: int = 0,
                     inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
                     loss_fn: Criterion = cross_entropy_loss, param_dtype: torch.dtype | None = None,
                     reduce_dtype: torch.dtype | None = None, parallel: ParallelDims | None = None) -> TracedStep:
    """Trace one training step of a SimpleFSDP-sharded model under a fake process group of ``world_size``.

    ``model_or_config``: a ``LlamaConfig`` (built with ``seed`` on ``device``), an unsharded module (deep-copied,
    then sharded; the caller's module is untouched) or an already sharded one (used as is). ``inputs`` default
    to ``demo_batch`` for models with ``config.vocab_size``. Use ``device="meta"`` for big shapes: nothing is
    computed. ``param_dtype`` / ``reduce_dtype`` are handed to ``shard_module`` (mixed precision: casts before
    the all-gathers and the reduce-scatters, see ``overlapcfg.capture.simple_fsdp``); an already sharded model
    keeps its own, and passing them with one raises ``TypeError``.
    ``parallel``: the mesh (HSDP ``dp_replicate`` x ``dp_shard``, tensor parallel ``tp``); the fake group then has
    ``parallel.world_size`` ranks (``world_size``, if given too, must agree) and ``rank`` is a rank of the whole
    mesh. Without it: plain FSDP over ``world_size`` ranks (default 2). A mesh needs an unsharded model.
    Must not be called while a default process group exists (it opens its own fake one; inside a job use
    ``overlapcfg.capture_step``), and resets dynamo.
    """
    dims = _dims(world_size, parallel)
    if isinstance(model_or_config, nn.Module):
        model = model_or_config if is_sharded(model_or_config) else copy.deepcopy(model_or_config)
    else:
        model = Llama(model_or_config, device=device, seed=seed)
    config: LlamaConfig | None = model.config if isinstance(model, Llama) else None
    sharded = is_sharded(model)
    if sharded and (param_dtype is not None or reduce_dtype is not None):
        raise OverlapUsageError("trace_train_step: the model is already sharded; give param_dtype/reduce_dtype to "
                                "shard_module instead")
    if sharded and not dims.is_1d:
        raise OverlapUsageError(
            "trace_train_step: a mesh (parallel=...) needs an unsharded model: its groups exist only in "
            "the process group this call opens")
    if inputs is None:
        if config is None:
            raise OverlapUsageError("trace_train_step: pass inputs=(tokens, targets) for a model that is not a Llama")
        inputs = demo_batch(config.vocab_size, batch=batch, seq_len=seq_len, seed=seed, device=device)
    tokens, targets = inputs
    start = time.perf_counter()
    with compat.fake_process_group(dims.world_size, rank):
        mesh = build_mesh(dims)  # first: sub-group names depend on creation order (see TracedStep.process_groups)
        groups = tuple(mesh.group_names().items())
        if not sharded:
            parallelize(model, mesh, reshard_after_forward=reshard_after_forward, param_dtype=param_dtype,
                        reduce_dtype=reduce_dtype)
        step = capture_step(model, (tokens,), loss_fn=lambda logits: loss_fn(logits, targets))
    seconds = time.perf_counter() - start
    return _traced_step(model, step, config=config, parallel=dims, mesh_groups=groups,
                        reshard_after_forward=reshard_after_forward, seconds=seconds)


def _dims(world_size: int | None, parallel: ParallelDims | None) -> ParallelDims:
    if parallel is None:
        return ParallelDims(dp_shard=2 if world_size is None else world_size)
    if world_size is not None and world_size != parallel.world_size:
        raise OverlapConfigError(
            f"trace_train_step: world_size={world_size} contradicts parallel={parallel.describe()} "
            f"({parallel.world_size} ranks); give one of them")
    return parallel


def _mixed_precision(model: nn.Module) -> tuple[torch.dtype | None, torch.dtype | None]:
    """``(param_dtype, reduce_dtype)`` the model was sharded with (``shard_module`` sets one pair for all)."""
    gather = next((m for m in model.modules() if isinstance(m, AllGatherShard)), None)
    return (gather.param_dtype, gather.reduce_dtype) if gather is not None else (None, None)


def _traced_step(model: nn.Module, step: CapturedStep, *, config: LlamaConfig | None, parallel: ParallelDims,
                 mesh_groups: tuple[tuple[str, str], ...], reshard_after_forward: bool,
                 seconds: float) -> TracedStep:
    param_dtype, reduce_dtype = _mixed_precision(model)
    fsdp_group = dict(mesh_groups)["dp_shard"]
    for name in ("forward", "backward"):
        _check_all_attributed(step.graph(name), name, fsdp_group, step.collectives_in(name))
    unattributed = [fqn for fqn, _ in sharded_parameters(model) if fqn not in step.param_fqns]
    if unattributed:
        raise AssertionError(f"tracing: no collective was attributed to {', '.join(unattributed[:4])}")
    traced = TracedStep(
        **{f.name: getattr(step, f.name) for f in dataclasses.fields(CapturedStep) if f.name != "mesh_groups"},
        config=config,
        reshard_after_forward=reshard_after_forward,
        trace_seconds=seconds,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        parallel=parallel,
        mesh_groups=mesh_groups,
    )
    log.info("traced %d-parameter step in %.2fs: %d forward / %d backward nodes, %d FSDP collectives",
             len(traced.param_fqns), seconds, len(traced.forward.graph.nodes), len(traced.backward.graph.nodes),
             len(traced.collectives))
    return traced


def _check_all_attributed(gm: fx.GraphModule, name: str, fsdp_group: str,
                          owners: tuple[CollectiveOwner, ...]) -> None:
    """Every all-gather and reduce-scatter on the demo's SimpleFSDP group is an FSDP one: all must carry an owner.
    (Other groups' collectives, tensor parallel's and HSDP's all-reduces, carry no parameter shard.)"""
    from overlapcfg.graph.ops import collective_kind, group_name

    found = [n.name for n in gm.graph.nodes
             if collective_kind(n) in ("all_gather", "reduce_scatter") and group_name(n) == fsdp_group]
    owned = {o.node for o in owners}
    attributed = sum(n in owned for n in found)
    if len(found) != attributed:
        raise AssertionError(f"tracing: {len(found) - attributed} of {len(found)} {name} collectives could not be "
                             "attributed to a parameter from the aot descriptors")
