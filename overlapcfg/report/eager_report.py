"""A report for a model sharded eagerly by ``overlapcfg.fully_shard``: the same ``Report`` as for graphs, read from
the record the FSDP2 driver left on the model (there is no graph to replay, so no prediction)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from overlapcfg.config import OverlapConfig
from overlapcfg.fsdp2 import RECORD_ATTR, Fsdp2Record, read_record
from overlapcfg.report.model import GraphReport, Report

__all__ = ["fsdp2_report", "is_fsdp2_model"]


def is_fsdp2_model(step: object) -> bool:
    """A module ``overlapcfg.fully_shard`` sharded (its record is on the root)."""
    return isinstance(step, nn.Module) and isinstance(vars(step).get(RECORD_ATTR), Fsdp2Record)


def _lists(pairs: Sequence[tuple[str, Sequence[str]]]) -> str:
    return " ".join(f"{group}->[{','.join(targets)}]" for group, targets in pairs if targets) or "none"


def fsdp2_report(model: nn.Module, config: OverlapConfig) -> Report:
    """Buckets, modules, parameters, unsharded bytes, effective depths and why, and the prefetch lists set."""
    rec = read_record(model)
    r = rec.record
    graph = GraphReport(
        name="fsdp2", strategy=r.strategy, nodes=0, collectives_before=r.before.total_fsdp,
        collectives_after=r.after.total_fsdp, non_fsdp=r.non_fsdp, uncovered=r.uncovered,
        order=f"forward prefetch: {_lists(rec.forward_prefetch)} | backward prefetch: {_lists(rec.backward_prefetch)}",
        pass_seconds=r.seconds, notes=r.notes)
    return Report(strategy=r.strategy, plan_name=config.plan.name if config.plan else None,
                  config=config.model_dump(mode="json"), world_size=rec.world_size or 1, buckets=r.buckets,
                  graphs=(graph,))
