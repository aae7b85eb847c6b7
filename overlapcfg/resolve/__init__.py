"""Plan resolution (torch-free): a ``BucketPlan`` of patterns, matched against one model's module FQNs, becomes
concrete buckets with effective depths. Below it: ``overlapcfg.config``; above it: the graph layer."""

from overlapcfg.resolve.config import resolve_config
from overlapcfg.resolve.names import bucket_name
from overlapcfg.resolve.plan_resolution import entry_text, resolve_plan
from overlapcfg.resolve.resolved import ResolvedBucket, ResolvedPlan

__all__ = ["ResolvedBucket", "ResolvedPlan", "bucket_name", "entry_text", "resolve_config",
           "resolve_plan"]
