"""Graph passes: finding collectives, merging buckets, scheduling, and ``apply`` which runs them in order."""

from overlapcfg.passes.apply import GraphKind, apply
from overlapcfg.passes.record import RECORD_KEY, BucketRecord, PassRecord

__all__ = ["RECORD_KEY", "BucketRecord", "GraphKind", "PassRecord", "apply"]
