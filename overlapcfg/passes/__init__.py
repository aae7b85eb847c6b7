"""Graph passes: finding collectives, merging buckets, scheduling, and ``apply`` which runs them in order.

Exports are lazy: the stage modules (``collectives``, ``merge``, ``schedule``) are imported by strategies and by
``overlapcfg.verification`` without pulling in ``apply``, which imports those in turn.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "GraphKind": "overlapcfg.passes.pipeline",
    "apply": "overlapcfg.passes.pipeline",
    "RECORD_KEY": "overlapcfg.passes.record",
    "BucketRecord": "overlapcfg.passes.record",
    "PassRecord": "overlapcfg.passes.record",
}

__all__ = ["RECORD_KEY", "BucketRecord", "GraphKind", "PassRecord", "apply"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'overlapcfg.passes' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from overlapcfg.passes.pipeline import GraphKind, apply
    from overlapcfg.passes.record import RECORD_KEY, BucketRecord, PassRecord
