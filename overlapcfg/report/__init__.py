"""What a pass did and what a plan will cost, presented: ``explain`` (per-bucket report), ``compare`` (several
configs on one trace, with a timeline), their tables. The prediction itself is ``overlapcfg.cost``'s.

Layout: ``model`` (report and comparison data, JSON schema), ``explain`` (building a report), ``compare``,
``render`` (rich tables; registers how ``print(report)`` draws), ``bucket_table``, ``labels`` (one vocabulary for
numbers and kinds), ``timeline`` (Chrome trace + PNG), ``fsdp2`` (a report read off an eagerly sharded model),
``sweep``.
"""

from __future__ import annotations

from overlapcfg.report import render as _render  # registers print(report) / print(comparison)
from overlapcfg.report.compare import compare
from overlapcfg.report.explain import explain
from overlapcfg.report.model import SCHEMA, Comparison, ComparisonRow, GraphReport, Report

__all__ = [
    "SCHEMA",
    "Comparison",
    "ComparisonRow",
    "GraphReport",
    "Report",
    "compare",
    "explain",
]

del _render
