"""Tuning: search bucket plans and schedules with the cost model, under a budget on bytes in flight.

``tune(step, hardware=..., world_size=..., memory_budget=...)`` (``search``) returns a ``TuneResult``
(``result``): the tuned ``OverlapConfig``, ``tuned.yaml``, the top candidates, the Pareto front and the shipped
presets on the same trace. Underneath: ``profile`` (one real apply at the finest grouping, read into a compact
model), ``merged`` (its units merged by a grouping) and ``quick`` (the scheduler and simulator replayed on that,
about a millisecond a candidate), ``structure`` and ``candidates`` (groupings written as plans), ``baselines`` (the
shipped presets scored as baselines), ``competitors`` (``none`` and torch's ``auto``, applied and simulated; the
lower bound on every config), ``space`` (what is searched; the command's ``tune/space`` group), ``render_tune`` (tables
and the Pareto PNG). Sits above ``cost`` (whose model it replays) and ``report``; the demo uses it.
"""

from __future__ import annotations

from overlapcfg._lazy import lazy_exports

_EXPORTS = {
    "tune": "overlapcfg.tuning.search",
    "TuneProgress": "overlapcfg.tuning.search",
    "TuneResult": "overlapcfg.tuning.tune_result",
    "TuneSpace": "overlapcfg.tuning.space",
    "load_space": "overlapcfg.tuning.space",
}

__all__ = ["TuneProgress", "TuneResult", "TuneSpace", "load_space", "tune"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
