"""The pass and its integrations: ``apply`` (``gm -> gm``), the ``torch.compile`` backend, inductor's post-grad
hook. Above the strategies; below the report."""

from overlapcfg.graph.record import RECORD_KEY, BucketRecord, PassRecord
from overlapcfg.passes.pipeline import GraphKind, apply

__all__ = ["RECORD_KEY", "BucketRecord", "GraphKind", "PassRecord", "apply"]
