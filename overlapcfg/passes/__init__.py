"""The pass and its integrations: ``apply`` (``gm -> gm``), the ``torch.compile`` backend, inductor's post-grad
hook. Above the strategies; below the report."""

from overlapcfg.graph.meta import pass_record
from overlapcfg.graph.record import BucketRecord, PassRecord
from overlapcfg.passes.pipeline import GraphKind, apply

__all__ = ["BucketRecord", "GraphKind", "PassRecord", "apply", "pass_record"]
