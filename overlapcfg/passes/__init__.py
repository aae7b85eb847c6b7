"""The pass and its integrations: ``apply`` (``gm -> gm``), ``apply_step`` (a config applied to copies of a captured
step: what explain, compare and tune look at), the ``torch.compile`` backend (whose graphs leave their range and
collectives in a profiler trace: ``trace_label``), inductor's post-grad hook. Above the strategies; below the
report."""

from overlapcfg.graph.meta import pass_record
from overlapcfg.graph.record import BucketRecord, PassRecord
from overlapcfg.passes.applied import AppliedGraph, AppliedStep, apply_step
from overlapcfg.passes.pipeline import GraphKind, PassOptions, apply

__all__ = ["AppliedGraph", "AppliedStep", "BucketRecord", "GraphKind", "PassOptions", "PassRecord", "apply",
           "apply_step", "pass_record"]
