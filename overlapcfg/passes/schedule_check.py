"""The same-schedule check where a compiled route runs the pass: the record's fingerprint compared across ranks
(``overlapcfg.graph.same_schedule``), the outcome written back to the record.

Called by ``overlapcfg.backend`` (after the pass on each of aot's graphs, before the graph is lowered), by
``inductor_pass`` (after the pass on inductor's post-grad graph) and by torchtitan's graph-trainer pipeline (after
the pass on the whole-step graph): the places every rank reaches whatever its caches (see the graph module's
docstring for why each one). ``apply`` itself never checks: it is a graph transformation, and a caller may apply
configs to copies of one graph (the tuner, ``compare``) that no other rank ever sees.
"""

from __future__ import annotations

from torch import fx

from overlapcfg.config import OverlapConfig
from overlapcfg.graph.meta import pass_record, record_pass
from overlapcfg.graph.same_schedule import check_same_schedule

__all__ = ["check_graph_schedule"]


def check_graph_schedule(gm: fx.GraphModule, cfg: OverlapConfig, *, where: str) -> str:
    """Compare the schedule the last pass recorded on ``gm`` across ranks (``SameScheduleError`` where they
    differ) and record the outcome on ``gm.meta["overlapcfg"]``; returns it. A graph no pass recorded is left
    alone (``not checked: no pass record``)."""
    record = pass_record(gm)
    if record is None or record.schedule is None:
        return "not checked: no pass record"
    outcome = check_same_schedule(record.schedule, enabled=cfg.check_same_schedule,
                                  timeout_s=cfg.same_schedule_timeout_s, where=where)
    record_pass(gm, record.model_copy(update={"same_schedule": outcome}))
    return outcome
