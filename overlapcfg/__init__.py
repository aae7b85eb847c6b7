"""overlapcfg: declarative bucketing and overlap of FSDP collectives over torch.fx graphs.

The pipeline a config flows through, one sub-package or module per stage:
``schema`` (what users write) → ``patterns`` / ``resolve`` (patterns matched against a model's modules) →
``registry`` / ``strategies`` (bucketer + scheduler) → ``passes`` / ``verify`` (rewrite the graph, then prove it)
→ ``report`` (what happened and what it will cost).

Names are exported lazily so ``import overlapcfg`` stays cheap and imports no torch until a graph is touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from overlapcfg._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "OverlapConfigError": "overlapcfg.errors",
    "OverlapVerificationError": "overlapcfg.errors",
    "Fault": "overlapcfg.errors",
    "OverlapConfig": "overlapcfg.schema",
    "BucketPlan": "overlapcfg.schema",
    "Bucket": "overlapcfg.schema",
    "OverlapPolicy": "overlapcfg.schema",
    "TorchManualPolicy": "overlapcfg.schema",
    "AutoPolicy": "overlapcfg.schema",
    "PolicyBase": "overlapcfg.schema",
    "ModuleOverride": "overlapcfg.schema",
    "load_config": "overlapcfg.schema",
    "from_hydra": "overlapcfg.schema",
    "preset_names": "overlapcfg.schema",
    "resolve_plan": "overlapcfg.resolve",
    "ResolvedPlan": "overlapcfg.resolve",
    "ResolvedBucket": "overlapcfg.resolve",
    "register_strategy": "overlapcfg.registry",
    "get_strategy": "overlapcfg.registry",
    "available_strategies": "overlapcfg.registry",
    "apply": "overlapcfg.passes",
    "PassRecord": "overlapcfg.passes",
    "verify": "overlapcfg.verification",
    "Strategy": "overlapcfg.strategies.base",
    "PassContext": "overlapcfg.strategies.base",
    "trace_train_step": "overlapcfg.tracing",
    "backend": "overlapcfg.compile",
    "inductor_pass": "overlapcfg.compile",
    "explain": "overlapcfg.report",
    "simulate": "overlapcfg.report",
    "compare": "overlapcfg.report",
    "Report": "overlapcfg.report",
    "HardwareProfile": "overlapcfg.report",
    "load_hardware": "overlapcfg.report",
}

__all__ = [
    "__version__",
    "AutoPolicy",
    "Bucket",
    "BucketPlan",
    "Fault",
    "HardwareProfile",
    "ModuleOverride",
    "OverlapConfig",
    "OverlapConfigError",
    "OverlapPolicy",
    "OverlapVerificationError",
    "PassContext",
    "PassRecord",
    "PolicyBase",
    "Report",
    "ResolvedBucket",
    "ResolvedPlan",
    "Strategy",
    "TorchManualPolicy",
    "apply",
    "available_strategies",
    "backend",
    "compare",
    "explain",
    "from_hydra",
    "get_strategy",
    "inductor_pass",
    "load_config",
    "load_hardware",
    "preset_names",
    "register_strategy",
    "resolve_plan",
    "simulate",
    "trace_train_step",
    "verify",
]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)


if TYPE_CHECKING:
    from overlapcfg.compile import backend, inductor_pass
    from overlapcfg.errors import Fault, OverlapConfigError, OverlapVerificationError
    from overlapcfg.passes import PassRecord, apply
    from overlapcfg.registry import available_strategies, get_strategy, register_strategy
    from overlapcfg.report import HardwareProfile, Report, compare, explain, load_hardware, simulate
    from overlapcfg.resolve import ResolvedBucket, ResolvedPlan, resolve_plan
    from overlapcfg.schema import (
        AutoPolicy,
        Bucket,
        BucketPlan,
        ModuleOverride,
        OverlapConfig,
        OverlapPolicy,
        PolicyBase,
        TorchManualPolicy,
        from_hydra,
        load_config,
        preset_names,
    )
    from overlapcfg.strategies.base import PassContext, Strategy
    from overlapcfg.tracing import trace_train_step
    from overlapcfg.verification import verify
