"""overlapcfg in Hugging Face accelerate (FSDP plugin, ``fsdp_version: 2``): ``fully_shard(accelerator, model, cfg)``.

accelerate 1.15 shards in ``Accelerator.prepare``: its FSDP2 step (``fsdp2_prepare_model``) wraps by
``auto_wrap_policy`` (the decoder blocks under ``TRANSFORMER_BASED_WRAP``), then the input embedding and
``[final norm, lm_head]``, then the root, and leaves FSDP2's implicit prefetch; and it returns a model that is
already an ``FSDPModule`` as it is. So the integration shards first, with the plugin's own settings, and
``prepare`` does the rest (optimizer, data loaders, mixed precision, compile), as for its own FSDP2::

    model = fully_shard(accelerator, model, cfg)        # before creating the optimizer
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

The plugin's settings reach every ``fully_shard`` call as accelerate passes them: ``mixed_precision_policy``,
``cpu_offload``, ``reshard_after_forward`` (the default of buckets that set none), ``ignored_modules``, the mesh
(``accelerator.torch_device_mesh`` over ``parallelism_config.fsdp_dim_names``); trainable parameters are upcast to
float32 under mixed precision first, as accelerate does (FSDP2 needs one dtype per group).

Refused before anything is sharded, in accelerate's terms, every fault at once: an accelerate outside 1.15.x, an
accelerator not running FSDP2 (no FSDP plugin, ``fsdp_version: 1``, or the CPU, where accelerate never turns
FSDP on), plugin settings that ``prepare`` would apply to its own sharding and therefore skips for a model
overlapcfg sharded, silently: ``fsdp_auto_wrap_policy`` other than ``NO_WRAP`` (its wrapping would override the
plan), ``fsdp_activation_checkpointing`` (apply checkpointing to the model before this call),
``fsdp_cpu_ram_efficient_loading`` (rank 0's weights would never reach the other ranks); and a model
``prepare`` already sharded. The plan's own faults against the model follow (``overlapcfg.fully_shard``).
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy

from overlapcfg.config import load_config
from overlapcfg.config.boundary import user_paths
from overlapcfg.config.load import ConfigSource
from overlapcfg.errors import Fault
from overlapcfg.fsdp2 import fully_shard as overlap_fully_shard
from overlapcfg.fsdp2 import plan_layout
from overlapcfg.integrations.trainer_checks import raise_faults, version_fault

__all__ = ["TESTED", "fully_shard"]

logger = logging.getLogger(__name__)

TESTED = "1.15.0"
"""The accelerate release this integration is tested with (1.15.x is accepted)."""

HEADER = "overlapcfg cannot shard this model under accelerate's FSDP plugin"

M = TypeVar("M", bound=nn.Module)


def fully_shard(accelerator: Any, model: M, cfg: ConfigSource, *, config_root: str = "overlap") -> M:
    """Shard ``model`` by ``cfg`` with the settings of ``accelerator``'s FSDP2 plugin; returns ``model`` (sharded in
    place). Call it before creating the optimizer and before ``accelerator.prepare``."""
    config = load_config(cfg, root=config_root)
    faults: list[Fault | None] = [version_fault("accelerate", TESTED, extra="accelerate")]
    state = accelerator.state
    plugin = getattr(state, "fsdp_plugin", None)
    if not accelerator.is_fsdp2:
        faults.append(_not_fsdp2(state, plugin))
    else:
        faults += _plugin_faults(plugin)
    faults += _already_sharded(model)
    raise_faults(faults, HEADER)
    kwargs = _fully_shard_kwargs(accelerator, plugin, model)
    with user_paths(config.mount):  # the plan's faults before the upcast
        plan_layout(model, config, shard_size=None, kwargs={})
    _upcast_trainable(accelerator, model)
    return overlap_fully_shard(model, config, **kwargs)


def _not_fsdp2(state: Any, plugin: Any) -> Fault:
    kind = str(getattr(state, "distributed_type", "?")).rpartition(".")[2]
    if plugin is not None and getattr(plugin, "fsdp_version", None) == 1:
        why = "its FSDP plugin is fsdp_version 1 (FSDP1)"
    elif kind in ("MULTI_CPU", "NO"):
        why = (f"accelerate runs {kind}: it turns the FSDP plugin on for accelerator devices only, never on the CPU "
               "(and never in a single process)")
    else:
        why = f"accelerate runs {kind} with no FSDP plugin"
    return Fault("fsdp_config.fsdp_version", (
        f"the Accelerator is not running FSDP2: {why}. Launch with an accelerate config holding distributed_type: FSDP "
        "and fsdp_config.fsdp_version: 2, or pass Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin("
        "fsdp_version=2))"))


def _plugin_faults(plugin: Any) -> list[Fault]:
    faults = []
    policy = plugin.auto_wrap_policy
    if policy is not None:
        name = getattr(getattr(policy, "func", policy), "__name__", repr(policy))
        faults.append(Fault("fsdp_config.fsdp_auto_wrap_policy", (
            f"{name} wraps modules by accelerate's own policy, and prepare() skips it for a model overlapcfg already "
            "sharded, silently: the plan's buckets are the wrapping. Set fsdp_auto_wrap_policy: NO_WRAP "
            "(FullyShardedDataParallelPlugin(auto_wrap_policy='no_wrap'))")))
    if plugin.activation_checkpointing:
        faults.append(Fault("fsdp_config.fsdp_activation_checkpointing", (
            "prepare() would wrap the blocks in checkpoint wrappers after overlapcfg sharded them; set it false and "
            "apply activation checkpointing to the model before overlapcfg's fully_shard (the plan's patterns see "
            "through checkpoint wrappers)")))
    if plugin.cpu_ram_efficient_loading:
        faults.append(Fault("fsdp_config.fsdp_cpu_ram_efficient_loading", (
            "accelerate broadcasts rank 0's weights inside its own FSDP2 preparation, which prepare() skips for a "
            "model overlapcfg already sharded: the other ranks would train their empty weights; set it false")))
    return faults


def _already_sharded(model: nn.Module) -> list[Fault]:
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            where = f"module {name!r}" if name else "the model"
            return [Fault("accelerator.prepare", (
                f"{where} is already sharded with FSDP2 (prepare() ran, or a fully_shard of your own): call "
                "overlapcfg's fully_shard on the unsharded model, before creating the optimizer and before prepare()"))]
    return []


def _fully_shard_kwargs(accelerator: Any, plugin: Any, model: nn.Module) -> dict[str, Any]:
    """The keywords accelerate's ``fsdp2_prepare_model`` gives every ``fully_shard`` call."""
    from accelerate.utils.fsdp_utils import get_parameters_from_modules

    mesh = getattr(accelerator, "torch_device_mesh", None)
    kwargs: dict[str, Any] = {
        "reshard_after_forward": plugin.reshard_after_forward,
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        "mesh": mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None,
    }
    if isinstance(plugin.cpu_offload, OffloadPolicy):
        kwargs["offload_policy"] = plugin.cpu_offload
    if plugin.ignored_modules is not None:
        kwargs["ignored_params"] = get_parameters_from_modules(plugin.ignored_modules, model, accelerator.device)
    return kwargs


def _upcast_trainable(accelerator: Any, model: nn.Module) -> None:
    """Trainable parameters to float32 under mixed precision, as ``fsdp2_prepare_model`` does before sharding:
    FSDP2 wants one original dtype per group, and ``mp_policy.param_dtype`` casts for compute."""
    if accelerator.mixed_precision == "no":
        return
    upcast = []
    for name, param in model.named_parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.to(torch.float32)
            upcast.append(name)
    if upcast:
        logger.info("overlapcfg: upcast %d trainable parameters to float32 for FSDP2 under mixed precision "
                    "(as accelerate does): %s", len(upcast), ", ".join(upcast[:5]))
