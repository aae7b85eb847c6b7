"""What the FSDP2 driver reads from an ``nn.Module`` before sharding anything: module FQNs, parameter owners, and
each parameter's size, unsharded and as one rank's FSDP2 shard.

Read-only: nothing here changes the model. Sizes come from the parameters themselves (shape and dtype, so meta
tensors work too), never from a run; the in-flight cap is applied to these static numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import nn

from overlapcfg.module_paths import strip_wrappers

__all__ = ["ModuleTree", "ParamInfo", "module_tree", "param_info"]


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """One parameter as FSDP2 will hold it."""

    fqn: str
    """Its first name in ``named_parameters()`` order, wrappers stripped (``layers.0.attention.wq.weight``)."""
    owner: str
    """The module holding it directly (``layers.0.attention.wq``)."""
    numel: int
    unsharded_bytes: int
    """Bytes of the all-gathered parameter (in ``mp_policy.param_dtype`` where one is set)."""
    sharded_bytes: int
    """Bytes of one rank's dim-0 shard, padded as FSDP2 pads it; 0 where the shard world size is unknown."""
    requires_grad: bool


@dataclass(frozen=True, slots=True)
class ModuleTree:
    """The module tree by wrapper-stripped FQN, in ``named_modules()`` order (the outermost module per FQN)."""

    fqns: tuple[str, ...]
    modules: Mapping[str, nn.Module]
    owners: tuple[str, ...]
    """FQNs of the modules holding a parameter directly (what plan coverage counts)."""
    direct: Mapping[str, tuple[tuple[str, nn.Parameter], ...]]
    """``owner fqn -> ((name, parameter), ...)``: each module's own parameters (``recurse=False``)."""
    order: Mapping[str, int]
    """``fqn -> position`` in ``fqns``."""
    ends: Mapping[str, int]
    """``fqn -> position`` of the last module of its subtree (``named_modules()`` lists a subtree contiguously):
    where the module's forward ends, if modules run in the order they are registered."""


def module_tree(model: nn.Module) -> ModuleTree:
    """Read ``model``'s modules and direct parameters (a shared module or parameter is listed at its first name)."""
    modules: dict[str, nn.Module] = {}
    direct: dict[str, tuple[tuple[str, nn.Parameter], ...]] = {}
    for raw, module in model.named_modules():
        fqn = strip_wrappers(raw)
        if fqn in modules:  # a wrapper and the module it wraps share one stripped FQN: keep the outer one
            continue
        modules[fqn] = module
        own = tuple((name, p) for name, p in module.named_parameters(recurse=False))
        if own:
            direct[fqn] = own
    order = {f: i for i, f in enumerate(modules)}
    return ModuleTree(tuple(modules), MappingProxyType(modules), tuple(direct), MappingProxyType(direct),
                      MappingProxyType(order), MappingProxyType(_subtree_ends(tuple(modules))))


def _subtree_ends(fqns: tuple[str, ...]) -> dict[str, int]:
    """For pre-order ``fqns`` (``""`` the root): the position of each one's last descendant (itself if none)."""
    ends: dict[str, int] = {}
    open_: list[str] = []
    for i, fqn in enumerate(fqns):
        while open_ and not (open_[-1] == "" or fqn.startswith(open_[-1] + ".")):
            ends[open_.pop()] = i - 1
        open_.append(fqn)
    for fqn in open_:
        ends[fqn] = len(fqns) - 1
    return ends


def param_info(owner: str, name: str, param: nn.Parameter, *, shard_size: int | None,
               param_dtype: torch.dtype | None) -> ParamInfo:
    """Sizes of ``param`` under FSDP2: all-gathered in ``param_dtype`` (floating parameters, when set), sharded
    on dim 0 into ``shard_size`` equal chunks (the last padded), as ``fully_shard`` does."""
    gathered = param_dtype if param_dtype is not None and param.is_floating_point() else param.dtype
    item = param.element_size()
    numel = param.numel()
    if shard_size is None:
        sharded = 0
    elif param.dim() == 0:
        sharded = item
    else:
        rows = param.shape[0]
        sharded = math.ceil(rows / shard_size) * (numel // rows if rows else 0) * item
    fqn = f"{owner}.{name}" if owner else name
    return ParamInfo(fqn, owner, numel, numel * _itemsize(gathered), sharded, param.requires_grad)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()

