"""Which overlap config torchtitan's ``overlapcfg`` pipeline runs: one environment variable, ``OVERLAPCFG_CONFIG``.

Why an environment variable and not a field: torchtitan's trainer config is a closed tree of dataclasses parsed
by tyro (``--compile.pass_pipeline`` names a pipeline, nothing more), so a pipeline cannot add a flag of its own
without a subclassed trainer config; and ``torchrun`` hands the environment to every rank, so every rank reads the
same config. The value is one of:

- **unset or empty**: torchtitan's own buckets for the model being trained (the ``module_bucket_plans`` its joint
  bucketing pass would get: ``tok_embeddings``, ``layers.N``, ``[norm, lm_head]``, MoE splits included) with the
  default policy (depth 1): the pipeline does what torchtitan's default does, verified;
- **a policy preset name** (``aggressive``, ``memory_saving``, ``default``, ``auto``; ``overlapcfg.preset_names
  ("policy")``): that policy with torchtitan's buckets (``auto`` switches the strategy as the preset says);
- **anything else is a YAML file path** (``~`` expanded, relative to the working directory): a complete overlap
  config, read as ``overlapcfg.load_config(pathlib.Path(value))`` reads it (an ``overlap:`` key is unwrapped, so
  a recipe file works; ``plan: torchtitan_layers`` names torchtitan's dense buckets as a preset).

A preset name wins over a file of the same name; a value that is neither is an ``OverlapConfigError`` naming the
variable, the closest preset and the missing file. Configs select registered names only, as everywhere: nothing
is imported or instantiated from the value or the file.

No torch and no torchtitan here: the trainer's post-init hook runs the lookup before anything is traced.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from overlapcfg.config import OverlapConfig, load_config, load_preset, preset_names
from overlapcfg.config.depths import DEPTH_FIELDS, FOLLOWED
from overlapcfg.errors import Fault, OverlapConfigError, closest_first, did_you_mean

__all__ = ["ENV_VAR", "TORCHTITAN_PLAN_NAME", "describe_config", "find_config", "preset_config", "torchtitan_plan"]

ENV_VAR = "OVERLAPCFG_CONFIG"
"""The environment variable naming the overlap config (see the module docstring)."""

TORCHTITAN_PLAN_NAME = "torchtitan"
"""The plan's name in reports when it is torchtitan's own ``module_bucket_plans``."""

ModuleBucketPlans = Sequence["str | Sequence[str]"]
"""torchtitan's plan: an exact module FQN per bucket, or a list of FQNs sharing one bucket."""


def torchtitan_plan(module_bucket_plans: ModuleBucketPlans) -> dict[str, Any]:
    """torchtitan's ``module_bucket_plans`` as an overlapcfg plan: each FQN an exact pattern (one bucket), each list
    one bucket. Every module must be covered, as torchtitan's pass assumes."""
    buckets: list[str | list[str]] = []
    for entry in module_bucket_plans:
        buckets.append(entry if isinstance(entry, str) else list(entry))
    return {"name": TORCHTITAN_PLAN_NAME, "buckets": buckets, "require_full_coverage": True}


def find_config(module_bucket_plans: ModuleBucketPlans | Mapping[str, Any],
                environ: Mapping[str, str] | None = None) -> OverlapConfig:
    """The overlap config ``OVERLAPCFG_CONFIG`` selects (module docstring), or ``OverlapConfigError``.

    ``module_bucket_plans``: torchtitan's own plan for this model, used unless a file gives a plan: the graph
    trainer's ``module_bucket_plans`` list, or a whole plan mapping (the main trainer's, whose buckets carry
    ``reshard_after_forward``)."""
    plan = dict(module_bucket_plans) if isinstance(module_bucket_plans, Mapping) else \
        torchtitan_plan(module_bucket_plans)
    value = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
    if not value:
        return load_config({"plan": plan}, root=ENV_VAR)
    policies = preset_names("policy")
    if value in policies:
        return load_config(preset_config(value, plan), root=f"{ENV_VAR}={value}")
    path = Path(value).expanduser()
    if not path.exists():
        near = did_you_mean(value, policies)
        raise OverlapConfigError(
            [Fault(ENV_VAR, (
            f"{value!r} is neither a policy preset{near} nor an existing file (looked for {str(path.absolute())!r}); "
            f"policy presets: {', '.join(closest_first(value, policies))}; a whole config goes in a YAML file"))],
            header="invalid overlap config")
    try:
        return load_config(path)
    except OverlapConfigError as err:
        raise OverlapConfigError(err.faults, header=f"invalid overlap config in {str(path)!r} ({ENV_VAR})") from None


def describe_config(environ: Mapping[str, str] | None = None) -> str:
    """What ``OVERLAPCFG_CONFIG`` selects, validated as far as it can be without the model (one line to print), or
    ``OverlapConfigError``: ``python -m overlapcfg.integrations.torchtitan --check``, on any machine."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_VAR, "").strip()
    cfg = find_config((), env)  # torchtitan's buckets stand in empty: the model is not here
    if not value:
        return f"{ENV_VAR} unset: torchtitan's own buckets for the model trained, {_depths(cfg)}"
    if value in preset_names("policy"):
        return f"{ENV_VAR}={value}: policy preset {value!r} with torchtitan's own buckets, {_depths(cfg)}"
    plan = cfg.plan
    what = "no plan" if plan is None else f"plan {plan.name or '(unnamed)'} with {len(plan.buckets)} entries"
    return (f"{ENV_VAR}={value}: a valid config, strategy {cfg.strategy}, {what}, {_depths(cfg)}; its patterns are "
            "matched against the model's modules when the trainer starts, before tracing")


def _depths(cfg: OverlapConfig) -> str:
    fields = [f for f in DEPTH_FIELDS if f not in FOLLOWED]  # the depths a policy always sets
    shown = [f"{f} {getattr(cfg.policy, f)}" for f in fields if hasattr(cfg.policy, f)]
    return ", ".join(shown) if shown else f"policy {type(cfg.policy).__name__}"


def preset_config(name: str, plan: Mapping[str, Any]) -> dict[str, Any]:
    """A policy preset with torchtitan's buckets; a preset that selects its own strategy (``auto``: torch's
    automatic scheduler, which buckets by its own estimates and takes no plan) brings it along."""
    preset = load_preset("policy", name)
    strategy = preset.get("strategy") if isinstance(preset.get("policy"), dict) else None
    if strategy is not None:
        return {"strategy": strategy, "policy": name}
    return {"plan": dict(plan), "policy": name}
