"""A proposed change written as a whole config the user passes back: the job's config with that one change, or,
where the job ran without one, a config holding the buckets the trace shows the job used, with the change.

Depth changes keep the plan as written and raise one policy field by one. Merges and ``reshard_after_forward``
write the plan out as the buckets the trace saw, each as its list of modules (forward order): a module list is what
a bucket is, and it resolves against the same model to the same buckets, whatever patterns the original used.
Everything goes through ``load_config``, so what is written is a valid config or an error, never a guess.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from overlapcfg.config import OverlapConfig, load_config
from overlapcfg.diagnosis.propose import Candidate

__all__ = ["proposed_config"]

_DEFAULT_DEPTH = 1
"""FSDP2's own prefetch (its implicit backward prefetch, one group ahead), what a job without a config ran at."""


def _entries(order: Sequence[str], modules: dict[str, tuple[str, ...]], candidate: Candidate) -> list[Any]:
    groups: list[tuple[str, ...]] = list(candidate.groups) if candidate.change == "merge" else \
        [(b,) for b in order if b in modules]
    entries: list[Any] = []
    for group in groups:
        mods = [m for b in group for m in modules.get(b, ())]
        if candidate.change == "reshard" and group == (candidate.bucket,):
            entries.append({"modules": mods, "reshard_after_forward": False})
        else:
            entries.append(mods)
    return entries


def proposed_config(base: OverlapConfig | None, order: Sequence[str], modules: dict[str, tuple[str, ...]],
                    candidate: Candidate) -> OverlapConfig:
    """``base`` (or the buckets the trace saw) with ``candidate`` made."""
    data: dict[str, Any] = base.model_dump(mode="json", exclude_none=True) if base is not None else \
        {"strategy": "manual", "policy": {}}
    data["strategy"] = base.strategy if base is not None else "manual"
    if candidate.change == "depth" and candidate.field is not None:
        policy = dict(data.get("policy") or {})
        policy[candidate.field] = int(policy.get(candidate.field, _DEFAULT_DEPTH)) + 1
        data["policy"] = policy
        if base is None:
            data["plan"] = {"buckets": _entries(order, modules, candidate)}
    else:
        plan = dict(data.get("plan") or {})
        plan["buckets"] = _entries(order, modules, candidate)
        plan.pop("name", None)
        data["plan"] = plan
    return load_config(data)
