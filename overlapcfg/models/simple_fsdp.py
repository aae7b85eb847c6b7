"""SimpleFSDP-style sharding (arXiv 2411.00284) for any ``nn.Module``, compact and without DTensor.

Each parameter is replaced by its dim-0 shard and a ``torch.nn.utils.parametrize`` parametrization that all-gathers
it with the functional collective ``all_gather_single`` on every access. Traced by ``torch.compile`` this yields
one ``_c10d_functional.all_gather_into_tensor`` + ``wait_tensor`` per parameter in the forward graph. Its autograd
formula (registered by torch on ``_c10d_functional::all_gather_into_tensor``) is
``reduce_scatter_tensor(grad, "sum", ...)``: the backward graph gets one reduce-scatter per parameter and **the
shard's gradient is the SUM over ranks** (not the average). Divide by the world size yourself if you want data
parallel averaging; a plain sum keeps a 2-rank run bit-identical to ``g0 + g1`` computed unsharded.

``reshard_after_forward=True`` wraps the gather in selective activation checkpointing with ``MUST_RECOMPUTE`` on
the collective ops, so the partitioner drops the full weight after forward and the backward graph all-gathers it
again (only for parameters whose backward needs the weight: an embedding's does not).

Not supported, on purpose: padding of uneven dim 0 (parity with the unsharded model would need masking; we raise
instead), tied/shared parameters, mixed precision.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from overlapcfg.errors import Fault, OverlapConfigError

__all__ = [
    "AllGatherShard",
    "gather_full_grads",
    "is_sharded",
    "shard_module",
    "sharded_parameters",
    "user_fqn",
]

# parametrize inserts these segments: ``wq.weight`` becomes ``wq.parametrizations.weight.original`` and the
# parametrization module itself is ``wq.parametrizations.weight.0``.
_PARAMETRIZATIONS = "parametrizations"
_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def user_fqn(fqn: str) -> str:
    """A parameter or module FQN as the user wrote the model, without parametrization internals and wrappers.

    ``layers.0.attention.wq.parametrizations.weight.original`` -> ``layers.0.attention.wq.weight``;
    ``layers.0.attention.wq.parametrizations.weight.0`` -> ``layers.0.attention.wq`` (the owning module);
    ``_orig_mod.norm`` -> ``norm``.
    """
    parts = [s for s in fqn.split(".") if s and s not in _WRAPPER_SEGMENTS]
    if _PARAMETRIZATIONS not in parts:
        return ".".join(parts)
    cut = parts.index(_PARAMETRIZATIONS)
    owner, rest = parts[:cut], parts[cut + 1 :]
    if len(rest) >= 2 and rest[1].startswith("original"):
        owner.append(rest[0])
    return ".".join(owner)


def _recompute_collectives(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    """SAC policy: never save the gathered weight; recompute the all-gather (and its wait) in backward."""
    if op in (torch.ops._c10d_functional.all_gather_into_tensor.default,
              torch.ops._c10d_functional.wait_tensor.default):
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def _gather(shard: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return funcol.all_gather_single(shard, gather_dim=0, group=group)


class AllGatherShard(nn.Module):
    """Parametrization turning a dim-0 shard into the full parameter by an all-gather over ``group``.

    ``group=None`` resolves to the default group at call time, so a model can be sharded before the process group
    exists (and re-used under a new fake group in another trace).
    """

    def __init__(self, group: dist.ProcessGroup | None, reshard_after_forward: bool) -> None:
        super().__init__()
        self.group = group
        self.reshard_after_forward = reshard_after_forward

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        group = self.group if self.group is not None else dist.group.WORLD
        if group is None:
            raise RuntimeError("SimpleFSDP parameter accessed without a process group; init one first")
        if not self.reshard_after_forward:
            return _gather(shard, group)
        context_fn = functools.partial(create_selective_checkpoint_contexts, _recompute_collectives)
        return checkpoint(_gather, shard, group, use_reentrant=False, context_fn=context_fn)


def _check_divisible(module: nn.Module, world_size: int) -> None:
    faults = [
        Fault(name, f"dim 0 has size {p.shape[0] if p.dim() else 'none (0-d)'}, not divisible by "
                    f"world_size={world_size}; SimpleFSDP here shards dim 0 evenly and does not pad")
        for name, p in module.named_parameters()
        if p.dim() == 0 or p.shape[0] % world_size
    ]
    if faults:
        raise OverlapConfigError(faults, header="cannot shard module")


def shard_module(module: nn.Module, *, world_size: int, rank: int, group: dist.ProcessGroup | None = None,
                 reshard_after_forward: bool = False) -> nn.Module:
    """Shard every parameter of ``module`` in place (rank ``rank`` keeps chunk ``rank`` of dim 0); return it.

    Works on meta tensors. Parameters keep ``requires_grad``. ``module.named_parameters()`` then yields
    ``<owner>.parametrizations.<name>.original`` shards; ``user_fqn`` maps them back. Raises
    ``OverlapConfigError`` listing every parameter whose dim 0 does not divide by ``world_size``.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got world_size={world_size}, rank={rank}")
    if is_sharded(module):
        raise RuntimeError("shard_module: module is already sharded")
    if group is not None and group.size() != world_size:
        raise ValueError(f"shard_module: group has {group.size()} ranks but world_size={world_size}")
    _check_divisible(module, world_size)
    owners = [(mod, name) for mod in module.modules() for name, _ in mod.named_parameters(recurse=False)]
    for mod, name in owners:
        full = getattr(mod, name)
        shard = full.detach().chunk(world_size, dim=0)[rank].clone()
        setattr(mod, name, nn.Parameter(shard, requires_grad=full.requires_grad))
        parametrize.register_parametrization(mod, name, AllGatherShard(group, reshard_after_forward), unsafe=True)
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
        dist.all_gather_single(out, shard, group=group)
        grads[fqn] = out
    return grads
