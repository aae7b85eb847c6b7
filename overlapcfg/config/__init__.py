"""Pydantic models of what users write (no torch, no Hydra): plans, policies, overrides, the whole config."""

from overlapcfg.config.command_line import hydra_overrides, with_hydra_overrides
from overlapcfg.config.faults import faults_from_validation_error
from overlapcfg.config.load import from_hydra, load_config
from overlapcfg.config.overlap import OverlapConfig
from overlapcfg.config.plan import Bucket, BucketEntry, BucketPlan, ModuleOverride
from overlapcfg.config.policy import AutoPolicy, BucketMode, OverlapPolicy, PolicyBase, TorchManualPolicy
from overlapcfg.config.presets import conf_dir, load_preset, preset_names

__all__ = [
    "AutoPolicy",
    "Bucket",
    "BucketEntry",
    "BucketMode",
    "BucketPlan",
    "ModuleOverride",
    "OverlapConfig",
    "OverlapPolicy",
    "PolicyBase",
    "TorchManualPolicy",
    "conf_dir",
    "faults_from_validation_error",
    "from_hydra",
    "hydra_overrides",
    "load_config",
    "load_preset",
    "preset_names",
    "with_hydra_overrides",
]
