"""overlapcfg in torchtitan's main trainer (``torchtitan.train``, eager FSDP2): a ``ModelSpec.parallelize_fn``.

torchtitan 0.3's ``parallelize_llama`` (and the other decoders' ``parallelize_*``) applies tensor/context
parallelism, activation checkpointing and per-block ``torch.compile``, then calls
``torchtitan.distributed.fsdp.apply_fsdp_to_decoder``: one ``fully_shard`` for ``tok_embeddings``, one per block,
one for ``[norm, lm_head]`` (``reshard_after_forward`` only under ``fsdp_reshard_after_forward=always``; with tied
weights one for ``[tok_embeddings, norm, lm_head]``), one on the root, then FSDP2's implicit prefetch (forward
none, backward one). ``parallelize_fn(base)`` is ``base`` with exactly that one call replaced by
``overlapcfg.fully_shard`` with torchtitan's own arguments (its mesh and ``dp_mesh_dims``, its mixed precision
without casting forward inputs, CPU offload, the reshard policy as every bucket's default), followed by what
torchtitan does after sharding (no FSDP gradient division: torchtitan scales by the global token count; symmetric
memory if enabled). Everything else ``base`` does stays torchtitan's. Use it from your config module::

    # my_configs.py  (torchrun ... -m torchtitan.train --module my_configs --config llama3_8b_overlapcfg)
    from overlapcfg.integrations.torchtitan.fsdp2 import use_overlapcfg
    from torchtitan.models.llama3.config_registry import llama3_8b

    def llama3_8b_overlapcfg():
        return use_overlapcfg(llama3_8b())

Which config: ``cfg`` if given, else ``OVERLAPCFG_CONFIG`` as for the graph trainer (``source``): unset is
torchtitan's own grouping above at depth 1, a policy preset name is that policy on the same grouping, a path is a
whole config file.

How the call is replaced: ``base`` looks ``apply_fsdp_to_decoder`` up in its module's globals when it runs, so the
name is bound to ours for the duration of the call and restored afterwards (also on error). A ``base`` that does
not call it (the graph trainer's ``parallelize``, which uses SimpleFSDP) is refused before anything runs, and one
that returns without calling it is an error, not an unsharded model.

Before ``base`` runs (so before anything is applied to the model, in ``Trainer.__init__``, before the first step),
every fault is raised at once in torchtitan's terms: a torchtitan outside 0.3.x, pipeline parallelism
(``parallelize_fn`` runs per stage on a part of the model), expert parallelism or MoE blocks (torchtitan places
expert shards with a ``shard_placement_fn`` of its own), and every fault of the plan against the model (a pattern
that matches nothing, with the closest FQN, ...).

Which policy presets run here: those ``overlapcfg.fsdp2.checks.check_config`` accepts (``fsdp2_presets()``:
``default`` and ``memory_saving``). ``aggressive`` asks for ``reduce_scatter_delay: 2`` and ``auto`` is a graph
strategy; FSDP2 has neither, so either is refused naming the nearest accepted preset (and, for a depth the driver
can give, the file that keeps it). ``check_trainer_config`` runs all these checks without a GPU, on the model
built on the meta device: ``python -m overlapcfg.integrations.torchtitan --check --module M --config C``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from overlapcfg.config import OverlapConfig, OverlapPolicy, load_config, preset_names
from overlapcfg.config.boundary import user_paths
from overlapcfg.config.load import ConfigSource
from overlapcfg.errors import Fault, OverlapConfigError, OverlapStateError, OverlapUsageError
from overlapcfg.fsdp2 import fully_shard, plan_layout
from overlapcfg.fsdp2.checks import NATIVE_REDUCE_SCATTER_DELAY, check_config
from overlapcfg.integrations.torchtitan.source import ENV_VAR, TORCHTITAN_PLAN_NAME, find_config, preset_config
from overlapcfg.integrations.trainer_checks import raise_faults, version_fault

__all__ = ["FSDP_STEP", "TESTED", "check_trainer_config", "fsdp2_presets", "parallelize_fn", "torchtitan_fsdp2_plan",
           "use_overlapcfg"]

logger = logging.getLogger(__name__)

TESTED = "0.3.0"
"""The torchtitan release this integration is tested with (0.3.x is accepted)."""

FSDP_STEP = "apply_fsdp_to_decoder"
"""The one call of torchtitan's ``parallelize_*`` that is replaced."""

HEADER = "overlapcfg cannot shard this model in torchtitan's trainer"

ParallelizeFn = Callable[..., nn.Module]

_WRAPPED = "__overlapcfg_fsdp2__"
"""Attribute of a ``parallelize_fn`` made here: ``(base, given config or None)``, for ``check_trainer_config``."""


def use_overlapcfg(trainer_config: Any, cfg: ConfigSource | None = None) -> Any:
    """``trainer_config`` (a ``torchtitan.trainer.Trainer.Config``) with its ``model_spec.parallelize_fn`` wrapped
    by ``parallelize_fn``; returned for use as a config-registry function's result."""
    spec = trainer_config.model_spec
    spec.parallelize_fn = parallelize_fn(spec.parallelize_fn, cfg)
    return trainer_config


def parallelize_fn(base: ParallelizeFn, cfg: ConfigSource | None = None) -> ParallelizeFn:
    """``base`` (torchtitan's ``parallelize_llama``, ...) with its FSDP step done by ``overlapcfg.fully_shard``.

    ``cfg``: an overlap config (anything ``overlapcfg.load_config`` reads); None: ``OVERLAPCFG_CONFIG``, read when
    the trainer calls the function (on every rank, with the model at hand). A given ``cfg`` is loaded now.
    """
    config = load_config(cfg) if cfg is not None else None
    step_owner = getattr(base, "__globals__", {})

    @functools.wraps(base)
    def parallelize(model: nn.Module, *, parallel_dims: Any, parallelism: Any, **kwargs: Any) -> nn.Module:
        chosen = _preflight(base, config, model, parallel_dims, parallelism)
        logger.info("overlapcfg: torchtitan's %s by overlapcfg.fully_shard, config %s (plan %s)", FSDP_STEP,
                    "given" if config is not None else f"from {ENV_VAR}", chosen.plan.name if chosen.plan else None)
        calls: list[nn.Module] = []
        with _replaced(step_owner, functools.partial(_apply_fsdp, cfg=chosen, calls=calls)):
            out = base(model, parallel_dims=parallel_dims, parallelism=parallelism, **kwargs)
        if len(calls) != 1:
            raise OverlapStateError(f"overlapcfg: {_name(base)} called {FSDP_STEP} {len(calls)} times, expected once; "
                                    "the model is not sharded as the overlap config says")
        return out

    setattr(parallelize, _WRAPPED, (base, config))
    return parallelize


def _preflight(base: ParallelizeFn, config: OverlapConfig | None, model: nn.Module, parallel_dims: Any,
               parallelism: Any) -> OverlapConfig:
    """Every check ``parallelize`` runs before ``base`` touches the model (the trainer's, and ``--check``'s on the
    meta device); returns the config that will shard it."""
    faults = [version_fault("torchtitan", TESTED, extra="torchtitan")]
    if FSDP_STEP not in getattr(base, "__globals__", {}):
        faults.append(Fault("model_spec.parallelize_fn", (
            f"{_name(base)} does not call torchtitan.distributed.fsdp.{FSDP_STEP}, the one step this integration "
            "replaces (the graph trainer's parallelize uses SimpleFSDP: use compile.pass_pipeline=overlapcfg "
            "there, overlapcfg.integrations.torchtitan)")))
    faults += _setting_faults(model, parallel_dims)
    raise_faults(faults, HEADER)
    chosen = config or find_config(torchtitan_fsdp2_plan(model, parallelism.fsdp_reshard_after_forward))
    _check_plan(model, chosen, parallelism, "the overlap config given" if config is not None else
                f"{ENV_VAR}={os.environ.get(ENV_VAR, '').strip()!r}")
    return chosen


def check_trainer_config(trainer_config: Any) -> str:
    """``--check --module M --config C`` for torchtitan's main trainer: the checks the trainer runs when it calls
    ``parallelize_fn`` (versions, settings, the config against the model), on the config function's model built on
    the meta device, so on any machine; one line saying what will be sharded how, or ``OverlapConfigError``.

    ``trainer_config``: what the config function returned (``use_overlapcfg(...)``), with torchtitan's command-line
    overrides applied (``ConfigManager``)."""
    spec = trainer_config.model_spec
    wrapped = getattr(spec.parallelize_fn, _WRAPPED, None)
    if wrapped is None:
        raise OverlapUsageError(
            f"model_spec.parallelize_fn is {_name(spec.parallelize_fn)}, not overlapcfg's: this config does not "
            "shard with overlapcfg in torchtitan's main trainer (wrap it: use_overlapcfg(config)); a graph trainer "
            f"config selects the pass pipeline instead, and --check without --module validates {ENV_VAR} for it")
    base, config = wrapped
    parallelism = trainer_config.parallelism
    dims = types.SimpleNamespace(pp=parallelism.pipeline_parallel_degree, ep=parallelism.expert_parallel_degree,
                                 pp_enabled=parallelism.pipeline_parallel_degree > 1)
    with torch.device("meta"):
        model = spec.model.build()
    chosen = _preflight(base, config, model, dims, parallelism)
    with user_paths(chosen.mount):  # checked by _preflight already: this only reads the buckets' names
        layout = plan_layout(model, chosen, shard_size=None, kwargs={})
    names = [b.name for b in layout.buckets]
    shown = ", ".join(names) if len(names) <= 6 else f"{', '.join(names[:3])} … {', '.join(names[-2:])}"
    policy = chosen.policy if isinstance(chosen.policy, OverlapPolicy) else OverlapPolicy()
    source = "the config given to use_overlapcfg" if config is not None else \
        f"{ENV_VAR}={os.environ.get(ENV_VAR, '').strip() or '(unset)'}"
    return (f"{source}: fits {type(model).__name__} ({len(names)} FSDP2 groups: {shown}), forward_prefetch "
            f"{policy.forward_prefetch}, backward_prefetch {policy.backward_prefetch}, reduce_scatter_delay "
            f"{policy.reduce_scatter_delay}, fsdp_reshard_after_forward={parallelism.fsdp_reshard_after_forward}; "
            "checked on the meta device, as the trainer checks before its first step")


def fsdp2_presets() -> tuple[str, ...]:
    """The policy presets the FSDP2 driver runs (``overlapcfg.fsdp2.checks.check_config`` finds no fault in them;
    the others ask for what FSDP2 has no knob for), in ``preset_names`` order."""
    return tuple(name for name in preset_names("policy") if not _refusals(name))


def _refusals(name: str) -> list[Fault]:
    any_plan = {"buckets": ["layers.*"]}  # the checks of a policy do not depend on the plan's entries
    return check_config(load_config(preset_config(name, any_plan)))


def _nearest_preset(name: str) -> str:
    """Of ``fsdp2_presets()``, the one whose policy differs from ``name``'s in the fewest fields (ties: the
    first)."""
    def fields(preset: str) -> dict[str, Any]:
        cfg = load_config(preset_config(preset, {"buckets": ["layers.*"]}))
        return {"strategy": cfg.strategy, **cfg.policy.model_dump()}

    mine = fields(name)
    return min(fsdp2_presets(), key=lambda other: sum(
        mine.get(k) != v for k, v in fields(other).items()) + len(mine.keys() - fields(other).keys()))


def _preset_hint(value: str) -> Fault | None:
    """For ``OVERLAPCFG_CONFIG=<a preset the FSDP2 driver refuses>``: the presets it runs, the nearest one, and
    where the refused setting is a reduce-scatter delay, the file that keeps the preset's prefetch depths."""
    if value not in preset_names("policy") or not _refusals(value):
        return None
    accepted = fsdp2_presets()
    text = (f"{value!r} is a policy preset the FSDP2 driver cannot run (above); the presets it runs: "
            f"{', '.join(accepted)}; nearest: {ENV_VAR}={_nearest_preset(value)}")
    cfg = load_config(preset_config(value, {"buckets": ["layers.*"]}))
    if cfg.strategy == "manual" and isinstance(cfg.policy, OverlapPolicy):
        p = cfg.policy
        text += (f"; to keep its prefetch depths, a config file with policy: {{forward_prefetch: {p.forward_prefetch}, "
                 f"backward_prefetch: {p.backward_prefetch}, reduce_scatter_delay: {NATIVE_REDUCE_SCATTER_DELAY}}} "
                 f"(as examples/torchtitan/overlap.yaml), {ENV_VAR}=<its path>")
    return Fault(ENV_VAR, text)


def torchtitan_fsdp2_plan(model: nn.Module, reshard_policy: str) -> dict[str, Any]:
    """torchtitan's own FSDP2 grouping of ``model`` as a plan (what ``apply_fsdp_to_decoder`` does for a dense
    decoder): ``tok_embeddings``, each block, ``[norm, lm_head]`` kept unsharded after forward unless the policy
    is ``always`` (with tied weights ``[tok_embeddings, norm, lm_head]``, the same); blocks take the policy's
    default, passed to every ``fully_shard`` call as torchtitan passes it."""
    present = [name for name in ("tok_embeddings", "norm", "lm_head") if getattr(model, name, None) is not None]
    tail_reshard = reshard_policy == "always"
    buckets: list[Any] = []
    if getattr(model, "enable_weight_tying", False):
        buckets.append({"modules": present, "reshard_after_forward": tail_reshard})
    else:
        if "tok_embeddings" in present:
            buckets.append("tok_embeddings")
        if "norm" in present and "lm_head" in present:
            buckets.append({"modules": ["norm", "lm_head"], "reshard_after_forward": tail_reshard})
    layers = getattr(model, "layers", None)
    names = list(layers.keys()) if isinstance(layers, nn.ModuleDict) else \
        [str(i) for i in range(len(layers))] if isinstance(layers, nn.ModuleList) else []
    buckets += [f"layers.{name}" for name in names]
    return {"name": TORCHTITAN_PLAN_NAME, "buckets": buckets, "require_full_coverage": True}


def _setting_faults(model: nn.Module, parallel_dims: Any) -> list[Fault]:
    faults = []
    if getattr(parallel_dims, "pp_enabled", False):
        faults.append(Fault("parallelism.pipeline_parallel_degree", (
            f"{parallel_dims.pp}: pipeline parallelism calls parallelize_fn once per stage, on a part of the model; "
            "this integration shards whole models only (set it to 1)")))
    if getattr(parallel_dims, "ep", 1) > 1:
        faults.append(Fault("parallelism.expert_parallel_degree", (
            f"{parallel_dims.ep}: torchtitan shards routed experts on their own mesh with a shard_placement_fn and "
            "sets its own prefetch lists, which this integration does not reproduce (set it to 1)")))
    layers = getattr(model, "layers", None)
    moe = [name for name, block in (layers.items() if isinstance(layers, nn.ModuleDict) else ())
           if getattr(block, "moe_enabled", False)]
    if moe:
        faults.append(Fault("model", (
            f"MoE blocks (layers.{moe[0]}{' ...' if len(moe) > 1 else ''}): torchtitan may shard experts on dim 1 "
            "with a shard_placement_fn of its own; this integration supports dense decoders only")))
    return faults


def _check_plan(model: nn.Module, cfg: OverlapConfig, parallelism: Any, where: str) -> None:
    """Every fault of ``cfg``'s plan against ``model``, now: before ``base`` applies anything."""
    try:
        with user_paths(cfg.mount):
            plan_layout(model, cfg, shard_size=None, kwargs={})
    except OverlapConfigError as err:
        hint = None if cfg.config_root != f"{ENV_VAR}={_env_value()}" else _preset_hint(_env_value())
        raise OverlapConfigError([*err.faults, *([hint] if hint else [])],
                                 header=f"{HEADER}: {where} does not fit the model (fsdp_reshard_after_forward="
                                        f"{parallelism.fsdp_reshard_after_forward})") from None


def _env_value() -> str:
    return os.environ.get(ENV_VAR, "").strip()


def _apply_fsdp(model: nn.Module, dp_mesh: Any, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
                pp_enabled: bool, cpu_offload: bool = False, reshard_after_forward_policy: str = "default",
                ep_degree: int = 1, edp_mesh: Any = None, dp_mesh_dims: Any = None, edp_mesh_dims: Any = None,
                enable_symm_mem: bool = False, *, cfg: OverlapConfig, calls: list[nn.Module]) -> None:
    """``apply_fsdp_to_decoder``'s signature and post-sharding steps, with the grouping and prefetch from
    ``cfg``: torchtitan's keywords pass through to every ``fully_shard`` call (``overlapcfg.fully_shard``)."""
    from torchtitan.distributed.fsdp import (
        disable_fsdp_gradient_division,
        enable_fsdp_symm_mem,
        get_fsdp_reshard_after_forward_policy,
    )

    if ep_degree > 1 or edp_mesh is not None or edp_mesh_dims is not None:
        raise AssertionError("overlapcfg: expert parallelism reached apply_fsdp_to_decoder past the pre-checks")
    calls.append(model)
    kwargs: dict[str, Any] = {
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                          cast_forward_inputs=False),
        "reshard_after_forward": get_fsdp_reshard_after_forward_policy(reshard_after_forward_policy, pp_enabled),
    }
    if dp_mesh_dims is not None:
        kwargs["dp_mesh_dims"] = dp_mesh_dims
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    fully_shard(model, cfg, mesh=dp_mesh, **kwargs)
    # What torchtitan does to a sharded decoder after fully_shard, in its order: symmetric-memory buffers when asked
    # for, then gradient division left to the loss (torchtitan divides by the global token count itself).
    finishing = [enable_fsdp_symm_mem] if enable_symm_mem else []
    for finish in [*finishing, disable_fsdp_gradient_division]:
        finish(model)


@contextlib.contextmanager
def _replaced(namespace: dict[str, Any], replacement: Callable[..., None]) -> Iterator[None]:
    original = namespace[FSDP_STEP]
    namespace[FSDP_STEP] = replacement
    try:
        yield
    finally:
        namespace[FSDP_STEP] = original


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"

