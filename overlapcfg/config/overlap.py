"""The top-level config a user writes: which strategy, which plan, which policy, which overrides.

Validation order matters and is deliberate: ``strategy`` first, because it selects the policy model that
``policy`` is validated against and says whether a ``plan`` is needed.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import Field, SerializeAsAny, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from overlapcfg.errors import OverlapConfigError, closest_first, did_you_mean
from overlapcfg.config.base import ConfigModel
from overlapcfg.config.plan import Bucket, BucketPlan, ModuleOverride
from overlapcfg.config.policy import OverlapPolicy, PolicyBase, TorchManualPolicy
from overlapcfg.config.presets import load_preset, preset_names

__all__ = ["OverlapConfig"]


class OverlapConfig(ConfigModel):
    """Everything overlapcfg needs to rewrite a graph. Load one with ``overlapcfg.load_config``."""

    strategy: str = "manual"
    """A registered strategy name (``overlapcfg.available_strategies()``): ``manual``, ``torch_manual``,
    ``auto``, ``none``, or one registered by a third-party package."""

    plan: BucketPlan | None = Field(None, validate_default=True)
    """Which modules share a bucket: a mapping, or the name of a shipped preset (``llama_layers``). Required by
    strategies that bucket by plan (``manual``, ``torch_manual``); others may leave it out."""

    policy: SerializeAsAny[PolicyBase] = Field(None, validate_default=True)  # type: ignore[assignment]
    """Depths and limits, validated against the strategy's own policy model; defaults to that model's defaults."""

    overrides: tuple[ModuleOverride, ...] = ()
    """Per-module depths; each applies to the buckets holding a module it matches, later entries win."""

    @field_validator("strategy", mode="after")
    @classmethod
    def _known_strategy(cls, name: str) -> str:
        from overlapcfg.strategies.registry import available_strategies

        names = available_strategies()
        if name not in names:
            raise PydanticCustomError(
                "unknown_strategy",
                "unknown strategy {name}; available (closest first): {names}{hint}",
                {"name": repr(name), "names": ", ".join(closest_first(name, names)), "hint": did_you_mean(name, names)},
            )
        return name

    @field_validator("plan", mode="before")
    @classmethod
    def _plan_preset(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            strategy = info.data.get("strategy")
            if strategy is not None and _spec(strategy).uses_plan:
                raise PydanticCustomError(
                    "plan_required",
                    "strategy {strategy} needs a plan: a preset name ({presets}) or a mapping with 'buckets'",
                    {"strategy": repr(strategy), "presets": ", ".join(preset_names("plan"))},
                )
            return None
        if not isinstance(value, str):
            return value
        try:
            data = load_preset("plan", value)
        except KeyError:
            names = preset_names("plan")
            raise PydanticCustomError(
                "unknown_preset",
                "unknown plan preset {name}; available (closest first): {names}{hint}",
                {"name": repr(value), "names": ", ".join(closest_first(value, names)),
                 "hint": did_you_mean(value, names)},
            ) from None
        data.setdefault("name", value)
        return data

    @field_validator("policy", mode="before")
    @classmethod
    def _policy_of_strategy(cls, value: Any, info: ValidationInfo) -> Any:
        strategy = info.data.get("strategy")
        if strategy is None:  # the strategy itself is invalid; that fault is reported on its own
            return OverlapPolicy()
        model = _spec(strategy).policy
        if value is None:
            return model()
        if isinstance(value, model):
            return value
        if isinstance(value, PolicyBase):
            value = value.model_dump(exclude_unset=True)
        return model.model_validate(value)

    @model_validator(mode="after")
    def _fixed_depth_strategies_take_no_other_depths(self) -> OverlapConfig:
        """torch_manual runs upstream at depth 1: a per-bucket or per-module depth other than 1 would be ignored."""
        if not isinstance(self.policy, TorchManualPolicy):
            return self
        found: list[tuple[tuple[str | int, ...], int]] = []
        entries = self.plan.buckets if self.plan is not None else ()
        for i, entry in enumerate(entries):
            if isinstance(entry, Bucket):
                found += [(("plan", "buckets", i, k), v) for k, v in _depths(entry) if v != 1]
        for i, override in enumerate(self.overrides):
            found += [(("overrides", i, k), v) for k, v in _depths(override) if v != 1]
        if found:
            raise ValidationError.from_exception_data("OverlapConfig", [
                InitErrorDetails(type=PydanticCustomError(
                    "torch_manual_depth",
                    "torch_manual has a fixed depth of 1 (upstream manual_overlap_bucketing), got {got}; use "
                    "strategy 'manual' for other depths", {"got": repr(value)}), loc=loc, input=value)
                for loc, value in found])
        return self

    def to_yaml(self) -> str:
        """YAML that ``load_config`` reads back to an equal config."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _depths(model: Bucket | ModuleOverride) -> list[tuple[str, int]]:
    keys = ("forward_prefetch", "backward_prefetch", "reduce_scatter_delay")
    return [(k, getattr(model, k)) for k in keys if getattr(model, k) is not None]


def _spec(strategy: str) -> Any:
    from overlapcfg.strategies.registry import get_strategy

    try:
        return get_strategy(strategy)
    except OverlapConfigError:  # pragma: no cover - strategy validated first
        return get_strategy("manual")
