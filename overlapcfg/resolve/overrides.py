"""Per-module overrides applied to resolved buckets: later overrides win, each must reach a bucket.

Cost: one indexed match per override, then one ancestor walk per hit (``ResolvedPlan.bucket_index``) and one
update per targeted bucket; never overrides x buckets x modules.
"""

from __future__ import annotations

from collections.abc import Sequence

from overlapcfg.config.depths import DEPTH_FIELDS, settle
from overlapcfg.config.plan import ModuleOverride
from overlapcfg.errors import Fault
from overlapcfg.module_paths import ancestors
from overlapcfg.resolve.matcher import Matcher, show
from overlapcfg.resolve.resolved import ResolvedBucket, ResolvedPlan

__all__ = ["apply_overrides"]


def apply_overrides(
    plan: ResolvedPlan, overrides: Sequence[ModuleOverride], path: str, m: Matcher, *, plan_ok: bool
) -> list[ResolvedBucket]:
    """The plan's buckets with ``overrides`` applied in order (checked only once the plan itself resolved)."""
    out = list(plan.buckets)
    for k, override in enumerate(overrides):
        where = f"{path}[{k}]"
        hits = m.match(override.match, f"{where}.match", override.match)
        if not hits or not plan_ok:
            continue
        targets = dict.fromkeys(i for x in hits if (i := plan.bucket_index(x)) is not None)
        if not targets:
            m.faults.append(_unreached(plan, override, hits, where))
            continue
        for i in targets:
            out[i] = _override(out[i], override, where)
    return out


def _unreached(plan: ResolvedPlan, override: ModuleOverride, hits: list[str], where: str) -> Fault:
    matched = set(hits)
    inner = [b.name for b in plan.buckets if any(a in matched for x in b.modules for a in ancestors(x))]
    hint = f"; buckets inside them: {show(inner)} (write {override.match}.** to reach them)" if inner else ""
    return Fault(f"{where}.match", f"override {override.match!r} matches {show(hits)}, which belong to no bucket"
                 f"{hint}")


def _override(bucket: ResolvedBucket, override: ModuleOverride, where: str) -> ResolvedBucket:
    # what was set, and by whom (a depth still following another is not set: settle fills it in again)
    set_values = {key: (getattr(bucket, key), source) for key, source in bucket.origins if source not in DEPTH_FIELDS}
    set_values.update({key: (value, where) for key, value in override.changes().items()})
    settled = settle(set_values)
    return bucket.model_copy(update={**{key: value for key, (value, _) in settled.items()},
                                     "overridden_by": (*bucket.overridden_by, where),
                                     "origins": tuple((key, source) for key, (_, source) in settled.items())})
