"""Pydantic models of what users write (no torch, no Hydra): plans, policies, overrides, the whole config.

The Hydra glue (``hydra_main``, ``with_hydra_overrides``: ``overlapcfg.config.hydra_app``) is exported lazily:
importing the config layer does not import Hydra.
"""

from typing import TYPE_CHECKING

from overlapcfg._lazy import lazy_exports
from overlapcfg.config.command_line import hydra_overrides
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
    "hydra_main",
    "hydra_overrides",
    "load_config",
    "load_preset",
    "preset_names",
    "with_hydra_overrides",
]

__getattr__, __dir__ = lazy_exports(__name__, globals(), {"hydra_main": "overlapcfg.config.hydra_app",
                                                          "with_hydra_overrides": "overlapcfg.config.hydra_app"})

if TYPE_CHECKING:
    from overlapcfg.config.hydra_app import hydra_main, with_hydra_overrides
