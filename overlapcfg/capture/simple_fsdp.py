"""SimpleFSDP-style sharding (arXiv 2411.00284) for any ``nn.Module``, compact and without DTensor: the sharder
``overlapcfg.shard_module`` documents for models that are not sharded yet (Hugging Face, timm, your own).

Why ours and not torchtitan's ``data_parallel``: torchtitan is an optional install (``--no-deps``, a pinned
version, a triton-only module to stub on CPU) that Hugging Face users do not have; its DTensor parameters need a
device mesh, so a process group must exist before the model is sharded; and it caches one wrapper class per module
class across models. This one needs torch only, shards before any group exists (the group is looked up when a
parameter is used), and handles tied parameters, mixed precision and HSDP. A model torchtitan already sharded is
captured as it is (``overlapcfg.capture_step``); so is any other sharder whose collectives are in the graph.

Each parameter is replaced by its dim-0 shard and a ``torch.nn.utils.parametrize`` parametrization that all-gathers
it with the functional collective ``all_gather_single`` (``all_gather_tensor`` on torch 2.11:
``compat.functional_all_gather``) on every access. Traced by ``torch.compile`` this yields
one ``_c10d_functional.all_gather_into_tensor`` + ``wait_tensor`` per parameter in the forward graph. Its autograd
formula (registered by torch on ``_c10d_functional::all_gather_into_tensor``) is
``reduce_scatter_tensor(grad, "sum", ...)``: the backward graph gets one reduce-scatter per parameter and **the
shard's gradient is the SUM over ranks** (not the average). Divide by the world size yourself if you want data
parallel averaging; a plain sum keeps a 2-rank run bit-identical to ``g0 + g1`` computed unsharded.

``reshard_after_forward=True`` wraps the gather in selective activation checkpointing with ``MUST_RECOMPUTE`` on
the collective ops, so the partitioner drops the full weight after forward and the backward graph all-gathers it
again (only for parameters whose backward needs the weight: an embedding's does not).

Mixed precision (``param_dtype`` / ``reduce_dtype``, FSDP2's ``MixedPrecisionPolicy`` and torchtitan SimpleFSDP's
``redistribute(forward_dtype=..., backward_dtype=...)``): the shard keeps its dtype (fp32 master weights and fp32
gradients); it is cast to ``param_dtype`` *before* the all-gather, so the wire and the gathered weight are in
``param_dtype``; in backward the gathered weight's gradient (``param_dtype``) is cast to ``reduce_dtype``
*before* the reduce-scatter, and the reduced shard gradient is cast back to the shard's dtype. A custom autograd
function (``_ShardGather``) is needed for the second part: the functional all-gather's own autograd
formula reduce-scatters in the dtype of the gathered tensor, so a plain ``all_gather(shard.to(bf16))`` would
reduce in bf16. ``reduce_dtype=None`` reduces in the gathered dtype (FSDP2's default, not DTensor's). With both
``None`` nothing changes: the plain functional all-gather, as before. The traced aot graphs then contain, per
parameter (``param_dtype=bf16``, ``reduce_dtype=fp32``, fp32 shards)::

    forward:   _to_copy(primal, bf16) -> all_gather_into_tensor (bf16) -> wait_tensor
    backward:  grad (bf16) -> _to_copy(fp32) -> reduce_scatter_tensor (fp32, "sum") -> wait_tensor -> output

(``_to_copy`` is ``aten._to_copy``; inductor's decompositions turn it into ``prims.convert_element_type``, and
torch's bucketing folds either kind of cast into a merged all-gather: ``has_mergeable_all_gather_convert_dtype``.)
With ``reduce_dtype`` equal to ``param_dtype`` the backward cast moves after the wait instead:
``reduce_scatter_tensor (bf16) -> wait_tensor -> _to_copy(fp32) -> output``. With reshard-after-forward the
cast is recomputed in backward with the all-gather (``_to_copy(primal)`` -> all-gather), as torchtitan's SAC
policy does; otherwise the partitioner would save the bf16 shard and the backward all-gather would read a saved
activation instead of a parameter. Compute runs in ``param_dtype`` wherever the model does not upcast itself
(torch's ``rms_norm`` computes in fp32 inside, the demo loss upcasts the logits). Double backward through the
mixed-precision gather is not supported.

HSDP (torchtitan SimpleFSDP's ``mode="hybrid_shard"``: placements ``(Replicate(), Shard(0))`` on a
``(dp_replicate, dp_shard)`` mesh): give ``shard_module`` the shard group (``group``, ``world_size``, ``rank``:
this rank's position in it) and the ``replicate_group``. Forward is unchanged (the all-gather runs on the shard
group; a replicated dimension needs no communication); in backward the gradient is reduced on both groups, one
group at a time as DTensor does it, in the order ``hsdp_reduce`` says::

    all_reduce_first (torchtitan's graphs):  grad -> all_reduce (replicate, full size) -> wait
                                                  -> reduce_scatter (shard) -> wait -> output
    reduce_scatter_first (FSDP2's order):    grad -> reduce_scatter (shard) -> wait
                                                  -> all_reduce (replicate, shard size) -> wait -> output

Both sum over every data-parallel rank. Tensor parallel first (``parallelize_module``, see
``overlapcfg.demo.parallel``): a DTensor parameter is sharded by its *local* tensor (this rank's TP shard) over the
data-parallel groups only, and the gathered local tensor is wrapped back into a DTensor on the TP mesh with the
parameter's TP placements (torchtitan's ``_distribute_dtensor`` / ``replicate_compute`` do the same with one
spanned mesh). The TP plan's own activation collectives then run on the TP group, as they would without FSDP.

Tied parameters (``lm_head.weight is embed_tokens.weight``) stay tied: one shard and one all-gather
parametrization serve every owner, so ``named_parameters()`` lists the shard once and its gradient sums what each
use contributes (two partial reduce-scatters, added: the pass recognizes the pair).

Not supported, on purpose: padding of uneven dim 0 (parity with the unsharded model would need masking; we raise
instead).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.nn.utils import parametrize
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from overlapcfg import compat
from overlapcfg.capture.hsdp import HSDP_REDUCE_ORDERS, HsdpReduce
from overlapcfg.errors import Fault, OverlapConfigError, OverlapStateError, OverlapUsageError
from overlapcfg.module_paths import user_fqn

__all__ = [
    "AllGatherShard",
    "gather_full_grads",
    "is_sharded",
    "shard_module",
    "sharded_parameters",
    "user_fqn",
]

# parametrize inserts segments: ``wq.weight`` becomes ``wq.parametrizations.weight.original``; ``user_fqn``
# (overlapcfg.graph.attribution) maps them back.

_RECOMPUTED_OPS = frozenset({
    compat.ALL_GATHER_INTO_TENSOR,
    compat.WAIT_TENSOR,
    # The mixed-precision cast before the all-gather (the checkpointed region holds nothing else): recomputing it
    # keeps the backward all-gather reading the parameter, not a saved low-precision copy of the shard.
    torch.ops.aten._to_copy.default,
    torch.ops.prims.convert_element_type.default,
})


def _recompute_collectives(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    """SAC policy: never save the gathered weight; recompute the all-gather (its wait, its cast) in backward."""
    return CheckpointPolicy.MUST_RECOMPUTE if op in _RECOMPUTED_OPS else CheckpointPolicy.MUST_SAVE


class _ShardGather(torch.autograd.Function):
    """All-gather in ``param_dtype``; reduce the gradient in ``reduce_dtype``; return it in the shard's dtype.

    The same contract as DTensor's ``Redistribute`` with ``forward_dtype`` / ``backward_dtype``, written with the
    functional collectives so traced graphs hold ``_c10d_functional`` ops only. The gradient is the SUM over ranks,
    like the plain path's. With a ``replicate_group`` (HSDP) it is also all-reduced there, before or after the
    reduce-scatter as ``order`` says.
    """

    # ``ctx``: autograd's context, a bag of attributes forward leaves for backward (typed Any: it has no fields).
    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, group: dist.ProcessGroup,
                param_dtype: torch.dtype, reduce_dtype: torch.dtype, replicate_group: dist.ProcessGroup | None,
                order: HsdpReduce) -> torch.Tensor:
        ctx.group = group
        ctx.reduce_dtype = reduce_dtype
        ctx.shard_dtype = shard.dtype
        ctx.replicate_group = replicate_group
        ctx.order = order
        return compat.functional_all_gather(shard.to(param_dtype), gather_dim=0, group=group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        group, reduce_dtype, shard_dtype = ctx.group, ctx.reduce_dtype, ctx.shard_dtype
        replicate_group, order = ctx.replicate_group, ctx.order
        fc = compat.functional_collectives
        reduced = grad.to(reduce_dtype)
        if replicate_group is not None and order == "all_reduce_first":
            reduced = fc.all_reduce(reduced, "sum", replicate_group)
        reduced = fc.reduce_scatter_tensor(reduced, "sum", 0, group)
        if replicate_group is not None and order == "reduce_scatter_first":
            reduced = fc.all_reduce(reduced, "sum", replicate_group)
        return reduced.to(shard_dtype), None, None, None, None, None


def _gather(shard: torch.Tensor, group: dist.ProcessGroup, param_dtype: torch.dtype | None = None,
            reduce_dtype: torch.dtype | None = None, replicate_group: dist.ProcessGroup | None = None,
            order: HsdpReduce = "all_reduce_first") -> torch.Tensor:
    if param_dtype is None and reduce_dtype is None and replicate_group is None:
        return compat.functional_all_gather(shard, gather_dim=0, group=group)
    gathered = param_dtype or shard.dtype
    return _ShardGather.apply(shard, group, gathered, reduce_dtype or gathered, replicate_group, order)


class AllGatherShard(nn.Module):
    """Parametrization turning a dim-0 shard into the full parameter by an all-gather over ``group``.

    ``group=None`` resolves to the default group at call time, so a model can be sharded before the process group
    exists (and re-used under a new fake group in another trace). ``param_dtype`` / ``reduce_dtype``: see the
    module docstring (``None``: the shard's dtype / the gathered dtype). ``replicate_group`` / ``hsdp_reduce``:
    HSDP's second group and reduction order; ``tp_mesh`` / ``tp_placements``: the parameter was a tensor-parallel
    DTensor, and the gathered local tensor is wrapped back into one. ``world_size`` / ``rank``: what the shard was
    cut for (``capture_step`` traces at that size when no process group exists).
    """

    def __init__(self, group: dist.ProcessGroup | None, reshard_after_forward: bool,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None, *,
                 replicate_group: dist.ProcessGroup | None = None, hsdp_reduce: HsdpReduce = "all_reduce_first",
                 tp_mesh: DeviceMesh | None = None, tp_placements: tuple[Placement, ...] = (),
                 world_size: int | None = None, rank: int = 0) -> None:
        super().__init__()
        self.world_size = world_size
        """The ranks ``shard_module`` sharded for (``None``: not recorded), and this shard's rank."""
        self.rank = rank
        self.group = group
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.replicate_group = replicate_group
        self.hsdp_reduce = hsdp_reduce
        self.tp_mesh = tp_mesh
        self.tp_placements = tp_placements

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        group = self.group if self.group is not None else dist.group.WORLD
        if group is None:
            raise OverlapStateError("SimpleFSDP parameter accessed without a process group; init one first")
        args = (shard, group, self.param_dtype, self.reduce_dtype, self.replicate_group, self.hsdp_reduce)
        if not self.reshard_after_forward:
            full = _gather(*args)
        else:
            context_fn = functools.partial(create_selective_checkpoint_contexts, _recompute_collectives)
            full = checkpoint(_gather, *args, use_reentrant=False, context_fn=context_fn)
        if self.tp_mesh is None:
            return full
        return DTensor.from_local(full, self.tp_mesh, self.tp_placements, run_check=False)


def _local(param: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel parameter's own shard (what data parallelism shards further); any other tensor as is."""
    return param.to_local() if isinstance(param, DTensor) else param


def _check_divisible(module: nn.Module, world_size: int) -> None:
    tp_note = " (this rank's tensor-parallel shard)"
    faults = [
        Fault(name, f"dim 0 has size {p.shape[0] if p.dim() else 'none (0-d)'}"
                    f"{tp_note if isinstance(param, DTensor) else ''}, not divisible by world_size={world_size}; "
                    "SimpleFSDP here shards dim 0 evenly and does not pad")
        for name, param in module.named_parameters()
        if (p := _local(param)).dim() == 0 or p.shape[0] % world_size
    ]
    if faults:
        raise OverlapConfigError(faults, header="cannot shard module")


def _group_facts(group: dist.ProcessGroup | None, world_size: int | None,
                 rank: int | None) -> tuple[int, int]:
    """``(world_size, rank)`` to shard for: as given, else from ``group`` (or the live default group)."""
    live = group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)
    if world_size is None:
        if live is None:
            raise OverlapUsageError(
                "shard_module: no process group exists yet; pass world_size= (the ranks you shard for) "
                "and rank= (default 0)")
        world_size = live.size()
    if live is not None and live.size() != world_size:
        which = "group" if group is not None else "the default process group"
        raise OverlapConfigError(f"shard_module: {which} has {live.size()} ranks but world_size={world_size}")
    if rank is None:
        rank = dist.get_rank(live) if live is not None else 0
    if world_size < 1 or not 0 <= rank < world_size:
        raise OverlapConfigError(f"need 0 <= rank < world_size, got world_size={world_size}, rank={rank}")
    return world_size, rank


def _owners(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Each distinct parameter's ``(owner module, attribute)`` pairs, model order: a tied parameter has several."""
    uses: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in module.modules():
        for name, param in mod.named_parameters(recurse=False, remove_duplicate=False):
            uses.setdefault(id(param), []).append((mod, name))
    return list(uses.values())


def shard_module(module: nn.Module, *, world_size: int | None = None, rank: int | None = None,
                 group: dist.ProcessGroup | None = None, reshard_after_forward: bool = False,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 replicate_group: dist.ProcessGroup | None = None,
                 hsdp_reduce: HsdpReduce = "all_reduce_first") -> nn.Module:
    """Shard every parameter of ``module`` in place (rank ``rank`` keeps chunk ``rank`` of dim 0); return it.

    ``world_size`` / ``rank``: the ranks to shard for and this one's position; by default those of ``group`` or of
    the default process group (under ``torchrun``: nothing to pass). Before any group exists, give ``world_size``
    (rank defaults to 0): the all-gathers look the group up when a parameter is used, so the model can be sharded
    first and captured later, under a live or a fake group of that size.

    Works on meta tensors. Parameters keep ``requires_grad`` and their dtype (the shards are the master weights);
    tied parameters stay tied (one shard). ``module.named_parameters()`` then yields
    ``<owner>.parametrizations.<name>.original`` shards; ``user_fqn`` maps them back. ``param_dtype``: dtype the
    shard is cast to before its all-gather (the dtype compute sees); ``reduce_dtype``: dtype gradients are
    reduce-scattered in (``None``: the gathered dtype). Both ``None``: no casts at all. Raises
    ``OverlapConfigError`` listing every parameter whose dim 0 does not divide by ``world_size``, and
    ``ValueError`` for a dtype that is not floating point.

    HSDP: ``group`` / ``world_size`` / ``rank`` describe the shard group, ``replicate_group`` the replicas, and
    ``hsdp_reduce`` the order the gradient is reduced in (module docstring). DTensor parameters (tensor parallel
    applied first) are sharded by their local tensor and wrapped back on their mesh after each all-gather.
    """
    world_size, rank = _group_facts(group, world_size, rank)
    if is_sharded(module):
        raise OverlapStateError("shard_module: module is already sharded")
    if hsdp_reduce not in HSDP_REDUCE_ORDERS:
        raise OverlapConfigError(f"shard_module: hsdp_reduce must be one of {', '.join(HSDP_REDUCE_ORDERS)}, got "
                                 f"{hsdp_reduce!r}")
    for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise OverlapConfigError(
                f"shard_module: {name} must be a floating-point torch.dtype or None, got {dtype!r}")
    _check_divisible(module, world_size)
    for uses in _owners(module):
        first, attr = uses[0]
        full = getattr(first, attr)
        shard = nn.Parameter(_local(full.detach()).chunk(world_size, dim=0)[rank].clone(),
                             requires_grad=full.requires_grad)
        tp = (full.device_mesh, tuple(full.placements)) if isinstance(full, DTensor) else (None, ())
        gather = AllGatherShard(group, reshard_after_forward, param_dtype, reduce_dtype,
                                replicate_group=replicate_group, hsdp_reduce=hsdp_reduce,
                                tp_mesh=tp[0], tp_placements=tp[1], world_size=world_size, rank=rank)
        for mod, name in uses:  # a tied parameter: every owner gets the same shard and the same all-gather
            setattr(mod, name, shard)
            parametrize.register_parametrization(mod, name, gather, unsafe=True)
    return module


def is_sharded(module: nn.Module) -> bool:
    """Whether any submodule carries our all-gather parametrization."""
    return any(isinstance(m, AllGatherShard) for m in module.modules())


def sharded_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``(user FQN, shard parameter)`` in model order, e.g. ``("layers.0.attention.wq.weight", <shard>)``."""
    for name, param in module.named_parameters():
        yield user_fqn(name), param


def gather_full_grads(module: nn.Module, group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """All-gather each shard's ``.grad`` into the full gradient, keyed by user FQN (collective: call on all ranks).

    Parameters without a gradient are skipped. Uses the c10d (non-functional) all-gather so it runs eagerly.
    """
    group = group if group is not None else dist.group.WORLD
    world_size = dist.get_world_size(group)
    grads: dict[str, torch.Tensor] = {}
    for fqn, param in sharded_parameters(module):
        if param.grad is None:
            continue
        shard = param.grad.contiguous()
        out = torch.empty((world_size * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
        compat.c10d_all_gather(out, shard, group=group)
        grads[fqn] = out
    return grads
