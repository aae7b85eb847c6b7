"""``resolve_config(cfg, facts)``: a whole config's plan, overrides and policy depths against one model's facts.

The one way a config becomes buckets: the pass, the ``torch.compile`` backend's early check, the demo's, the
torchtitan pipeline's, the FSDP2 driver and the tuner all call it, with the model as ``ModelFacts`` (made from a
live model, a traced step or the names at hand), so each reads the model's modules and owners the same way. Fault
paths are relative to the config (``plan.buckets[1]``, ``overrides[0]``: a ``RelativeConfigError``); the entry point
that called it names them where the user put the config (``overlapcfg.config.boundary``).
"""

from __future__ import annotations

from overlapcfg.config.boundary import RelativeConfigError
from overlapcfg.config.contracts import contract_of
from overlapcfg.config.depths import depths_of
from overlapcfg.config.overlap import OverlapConfig
from overlapcfg.config.plan import BucketPlan
from overlapcfg.errors import OverlapConfigError
from overlapcfg.module_paths import ModelFacts
from overlapcfg.resolve.plan_resolution import resolve_plan
from overlapcfg.resolve.resolved import ResolvedPlan

__all__ = ["resolve_config"]


def resolve_config(cfg: OverlapConfig, facts: ModelFacts, *, coverage: bool = True) -> ResolvedPlan:
    """``cfg``'s plan resolved against ``facts`` (``resolve_plan``, with ``cfg.overrides`` and the policy's depths);
    no buckets where the strategy reads no plan or there is none. ``RelativeConfigError`` lists every fault, its
    path from the config node; the buckets' ``origins`` are such paths too.

    ``coverage=False`` leaves ``require_full_coverage`` to a later check: an early check before the graph exists
    cannot know which parameters will be FSDP's (a model may keep some unsharded).
    """
    if cfg.plan is None or not contract_of(cfg.strategy).uses_plan:
        return ResolvedPlan(())
    plan = cfg.plan if coverage else BucketPlan.model_validate({**cfg.plan.model_dump(),
                                                                 "require_full_coverage": False})
    try:
        return resolve_plan(plan, facts.modules, facts.owners if coverage else None, overrides=cfg.overrides,
                            policy=depths_of(cfg.policy), path="plan", overrides_path="overrides")
    except OverlapConfigError as err:
        raise RelativeConfigError(err.faults, header=err.header) from None
