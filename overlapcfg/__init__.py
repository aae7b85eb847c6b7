"""overlapcfg: declarative bucketing and overlap of FSDP collectives over torch.fx graphs.

The pipeline a config flows through, one sub-package per stage:
``config`` (what users write) → ``resolve`` (patterns matched against a model's modules) → ``graph`` (collectives,
attribution, merge, schedule, verify) → ``strategies`` → ``passes`` (rewrite the graph, then prove it; the
``torch.compile`` backend; the ``CapturedStep``) | ``fsdp2`` → ``cost`` (what a step will cost) → ``report`` (what
happened, and the prediction, drawn) | ``capture`` (your model's step as a ``CapturedStep``) → ``tuning`` |
``measuring`` → ``diagnosis`` (a job's own profiler traces read back into a config) → ``demo`` | ``integrations``.

Names are exported lazily so ``import overlapcfg`` stays cheap and imports no torch until a graph is touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from overlapcfg._lazy import lazy_exports
from overlapcfg._version import __version__

# The one table of exports: name -> the module ``__getattr__`` imports it from. ``__all__`` and the TYPE_CHECKING
# imports restate it only because linters and type checkers read them without running anything;
# tests/package/test_package.py fails when either disagrees with it.
_EXPORTS: dict[str, str] = {
    "OverlapcfgError": "overlapcfg.errors",
    "OverlapConfigError": "overlapcfg.errors",
    "OverlapUsageError": "overlapcfg.errors",
    "OverlapStateError": "overlapcfg.errors",
    "OverlapLookupError": "overlapcfg.errors",
    "OverlapVerificationError": "overlapcfg.errors",
    "UnsupportedGraphError": "overlapcfg.errors",
    "UpstreamPassError": "overlapcfg.errors",
    "SameScheduleError": "overlapcfg.errors",
    "AttributionError": "overlapcfg.errors",
    "Fault": "overlapcfg.errors",
    "OverlapConfig": "overlapcfg.config",
    "BucketPlan": "overlapcfg.config",
    "Bucket": "overlapcfg.config",
    "OverlapPolicy": "overlapcfg.config",
    "TorchManualPolicy": "overlapcfg.config",
    "AutoPolicy": "overlapcfg.config",
    "PolicyBase": "overlapcfg.config",
    "ModuleOverride": "overlapcfg.config",
    "load_config": "overlapcfg.config",
    "from_hydra": "overlapcfg.config",
    "hydra_overrides": "overlapcfg.config",
    "hydra_main": "overlapcfg.config.hydra_app",
    "with_hydra_overrides": "overlapcfg.config.hydra_app",
    "preset_names": "overlapcfg.config",
    "resolve_plan": "overlapcfg.resolve",
    "ResolvedPlan": "overlapcfg.resolve",
    "ResolvedBucket": "overlapcfg.resolve",
    "register_strategy": "overlapcfg.strategies.registry",
    "get_strategy": "overlapcfg.strategies.registry",
    "available_strategies": "overlapcfg.strategies.registry",
    "apply": "overlapcfg.passes",
    "PassRecord": "overlapcfg.passes",
    "verify": "overlapcfg.graph.verify",
    "Strategy": "overlapcfg.strategies.interface",
    "PassContext": "overlapcfg.strategies.interface",
    "trace_train_step": "overlapcfg.demo.tracing",
    "capture_step": "overlapcfg.capture.trace",
    "CapturedStep": "overlapcfg.passes.step",
    "ensure_process_group": "overlapcfg.passes.step",
    "shard_module": "overlapcfg.capture.simple_fsdp",
    "backend": "overlapcfg.passes.compile",
    "inductor_pass": "overlapcfg.passes.compile",
    "fully_shard": "overlapcfg.fsdp2",
    "exit_process": "overlapcfg.process_exit",
    "explain": "overlapcfg.report.explain",
    "simulate": "overlapcfg.cost",
    "compare": "overlapcfg.report.compare",
    "tune": "overlapcfg.tuning",
    "calibrate": "overlapcfg.measuring",
    "measure": "overlapcfg.measuring",
    "diagnose": "overlapcfg.diagnosis",
    "DiagnoseResult": "overlapcfg.diagnosis",
    "Measurement": "overlapcfg.measuring",
    "NodeCosts": "overlapcfg.cost",
    "save_hardware": "overlapcfg.cost",
    "TuneResult": "overlapcfg.tuning",
    "TuneSpace": "overlapcfg.tuning",
    "Report": "overlapcfg.report",
    "HardwareProfile": "overlapcfg.cost",
    "load_hardware": "overlapcfg.cost",
}

__all__ = [
    "__version__",
    "AttributionError",
    "AutoPolicy",
    "Bucket",
    "CapturedStep",
    "BucketPlan",
    "DiagnoseResult",
    "Fault",
    "HardwareProfile",
    "Measurement",
    "ModuleOverride",
    "NodeCosts",
    "OverlapConfig",
    "OverlapConfigError",
    "OverlapLookupError",
    "OverlapPolicy",
    "OverlapStateError",
    "OverlapUsageError",
    "OverlapVerificationError",
    "OverlapcfgError",
    "PassContext",
    "PassRecord",
    "PolicyBase",
    "Report",
    "ResolvedBucket",
    "ResolvedPlan",
    "SameScheduleError",
    "Strategy",
    "TorchManualPolicy",
    "TuneResult",
    "TuneSpace",
    "UnsupportedGraphError",
    "UpstreamPassError",
    "apply",
    "available_strategies",
    "backend",
    "capture_step",
    "calibrate",
    "compare",
    "diagnose",
    "ensure_process_group",
    "exit_process",
    "explain",
    "from_hydra",
    "hydra_main",
    "hydra_overrides",
    "fully_shard",
    "get_strategy",
    "inductor_pass",
    "load_config",
    "load_hardware",
    "measure",
    "preset_names",
    "register_strategy",
    "resolve_plan",
    "shard_module",
    "save_hardware",
    "simulate",
    "trace_train_step",
    "with_hydra_overrides",
    "tune",
    "verify",
]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)


if TYPE_CHECKING:
    from overlapcfg.capture.simple_fsdp import shard_module
    from overlapcfg.capture.trace import capture_step
    from overlapcfg.config import (
        AutoPolicy,
        Bucket,
        BucketPlan,
        ModuleOverride,
        OverlapConfig,
        OverlapPolicy,
        PolicyBase,
        TorchManualPolicy,
        from_hydra,
        hydra_overrides,
        load_config,
        preset_names,
    )
    from overlapcfg.config.hydra_app import hydra_main, with_hydra_overrides
    from overlapcfg.cost import HardwareProfile, NodeCosts, load_hardware, save_hardware, simulate
    from overlapcfg.demo.tracing import trace_train_step
    from overlapcfg.diagnosis import DiagnoseResult, diagnose
    from overlapcfg.errors import (
        AttributionError,
        Fault,
        OverlapcfgError,
        OverlapConfigError,
        OverlapLookupError,
        OverlapStateError,
        OverlapUsageError,
        OverlapVerificationError,
        SameScheduleError,
        UnsupportedGraphError,
        UpstreamPassError,
    )
    from overlapcfg.fsdp2 import fully_shard
    from overlapcfg.graph.verify import verify
    from overlapcfg.measuring import Measurement, calibrate, measure
    from overlapcfg.passes import PassRecord, apply
    from overlapcfg.passes.compile import backend, inductor_pass
    from overlapcfg.passes.step import CapturedStep, ensure_process_group
    from overlapcfg.process_exit import exit_process
    from overlapcfg.report import Report
    from overlapcfg.report.compare import compare
    from overlapcfg.report.explain import explain
    from overlapcfg.resolve import ResolvedBucket, ResolvedPlan, resolve_plan
    from overlapcfg.strategies.interface import PassContext, Strategy
    from overlapcfg.strategies.registry import available_strategies, get_strategy, register_strategy
    from overlapcfg.tuning import TuneResult, TuneSpace, tune
