"""Which bucket each collective of a trace belongs to, from what the trace itself says about it:

- **eager FSDP2** names the group in the label around the issue: ``FSDP::all_gather (model.layers.0)``,
  ``FSDP::post_backward_reduce (model.norm, lm_head)``; the bucket is those modules, named as a resolved plan names
  a bucket of those modules (``overlapcfg.resolve.names.bucket_name``), so with ``overlapcfg.fully_shard`` the
  names are the plan's and without overlapcfg they are the groups the job actually used;
- **graphs compiled by** ``overlapcfg.backend`` run in a range ``overlapcfg.graph::<id>/<graph>`` and leave their
  collectives, in graph order, at the trace's top level (``overlapcfg.passes.trace_label``): the n-th collective
  issued in a call of that graph is the record's n-th, when kind and size agree (else it stays unattributed, and
  a note says where the two disagree).

Anything else issued outside both is unattributed and counted, except kinds FSDP never issues there (barriers,
broadcasts, a user's all-reduce: a trainer's own collectives), which are listed as not FSDP's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from overlapcfg.diagnosis.steps import Collective, RankAnalysis
from overlapcfg.diagnosis.trace_events import dtype_bytes
from overlapcfg.resolve.names import bucket_name

__all__ = ["FSDP_KINDS", "OTHER", "BucketModules", "attribute", "bucket_bytes"]

BucketModules = dict[str, tuple[str, ...]]
FSDP_KINDS = frozenset({"all_gather", "reduce_scatter"})
"""What FSDP issues for a bucket (an HSDP all-reduce comes inside FSDP2's labels or a compiled region)."""
OTHER = "not FSDP"
"""The source of a collective no bucket could hold: a kind FSDP never issues, outside every FSDP label and graph."""
"""Bucket name -> its modules, as far as the trace tells."""


def _same(col: Collective, planned: Mapping[str, object]) -> bool:
    kind = planned.get("kind")
    numel = planned.get("numel")
    kinds_agree = kind == col.kind or (kind == "reduce_scatter" and col.kind == "all_reduce")
    sizes_agree = col.numel is None or numel is None or numel == col.numel
    return kinds_agree and sizes_agree


def attribute(ranks: Sequence[RankAnalysis]) -> tuple[BucketModules, list[str]]:
    """Set ``bucket``, ``source`` (and a missing direction or dtype) on every collective the trace attributes;
    returns each bucket's modules and notes on what could not be matched."""
    modules: BucketModules = {}
    notes: list[str] = []
    for analysis in ranks:
        regions = analysis.trace.metadata
        for record in regions.values():
            for name, mods in (record.get("buckets") or {}).items():
                if isinstance(mods, list):
                    modules.setdefault(str(name), tuple(str(m) for m in mods))
        mismatched = 0
        for step in analysis.steps:
            for col in step.collectives:
                if col.modules:
                    col.bucket, col.source = bucket_name(col.modules), "fsdp2 label"
                    modules.setdefault(col.bucket, col.modules)
                elif col.region is not None and col.region in regions and col.region_position is not None:
                    planned_list = regions[col.region].get("collectives") or []
                    if col.region_position < len(planned_list) and _same(col, planned_list[col.region_position]):
                        planned = planned_list[col.region_position]
                        bucket = planned.get("bucket")
                        if isinstance(bucket, str):
                            col.bucket, col.source = bucket, "overlapcfg record"
                        if col.dtype is None and isinstance(planned.get("dtype"), str):
                            col.dtype = str(planned["dtype"])
                        if col.numel is None and isinstance(planned.get("numel"), int):
                            col.numel = int(planned["numel"])
                    else:
                        mismatched += 1
        for step in analysis.steps:
            gathered: set[str] = set()
            for col in step.collectives:
                if col.kind == "all_gather" and col.bucket is not None and not col.direction:
                    # no FSDP2 hook label around it: a bucket's first all-gather of a step is its forward one
                    col.direction = "backward" if col.bucket in gathered else "forward"
                if col.kind == "all_gather" and col.bucket is not None:
                    gathered.add(col.bucket)
                if col.bucket is None and col.kind not in FSDP_KINDS and not col.modules and col.region is None:
                    col.source = OTHER  # a barrier, a broadcast, a user's all-reduce: no bucket's
        if mismatched:
            notes.append(f"{analysis.trace.name}: {mismatched} collectives issued inside a compiled graph's range do "
                         "not match that graph's record by position, kind and size (left unattributed)")
    return modules, notes


def bucket_bytes(ranks: Sequence[RankAnalysis]) -> dict[str, int]:
    """Per bucket, the largest full-size bytes of one of its all-gathers (or of any of its collectives)."""
    out: dict[str, int] = {}
    for analysis in ranks:
        for step in analysis.steps:
            for col in step.collectives:
                size = col.nbytes if col.nbytes is not None else (
                    col.numel * (dtype_bytes(col.dtype) or 4) if col.numel is not None and col.dtype else None)
                if col.bucket is None or size is None:
                    continue
                if col.kind == "all_gather" or col.bucket not in out:
                    out[col.bucket] = max(out.get(col.bucket, 0), size) if col.kind == "all_gather" else size
    return out
