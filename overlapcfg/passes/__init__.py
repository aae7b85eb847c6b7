"""Graph passes: finding collectives, merging buckets, scheduling, and ``apply`` which runs them in order.

Exports are lazy: the stage modules (``collectives``, ``merge``, ``schedule``) are imported by strategies and by
``overlapcfg.graph.verify`` without pulling in ``apply``, which imports those in turn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from overlapcfg._lazy import lazy_exports

_EXPORTS = {
    "GraphKind": "overlapcfg.passes.pipeline",
    "apply": "overlapcfg.passes.pipeline",
    "RECORD_KEY": "overlapcfg.graph.record",
    "BucketRecord": "overlapcfg.graph.record",
    "PassRecord": "overlapcfg.graph.record",
}

__all__ = ["RECORD_KEY", "BucketRecord", "GraphKind", "PassRecord", "apply"]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)


if TYPE_CHECKING:
    from overlapcfg.passes.pipeline import GraphKind, apply
    from overlapcfg.graph.record import RECORD_KEY, BucketRecord, PassRecord
