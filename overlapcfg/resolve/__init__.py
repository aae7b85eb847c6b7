"""Plan resolution (torch-free): a ``BucketPlan`` of patterns, matched against one model's module FQNs, becomes
concrete buckets with effective depths. Below it: ``overlapcfg.config``; above it: the graph layer."""

from overlapcfg.resolve.plan import (
    DEPTH_FIELDS,
    DepthSource,
    ResolvedBucket,
    ResolvedPlan,
    bucket_name,
    entry_text,
    resolve_plan,
)

__all__ = ["DEPTH_FIELDS", "DepthSource", "ResolvedBucket", "ResolvedPlan", "bucket_name", "entry_text",
           "resolve_plan"]
