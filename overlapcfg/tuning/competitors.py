"""What a user could pick instead of tuning, scored the slow way; and the lower bound every config respects.

The quick model (``overlapcfg.tuning.quick``) replays plan schedules: groupings, depths, delays, merged or not.
Strategies that decide for themselves cannot be replayed that way: ``none`` (the graph as traced) and torch's own
automatic scheduler (``strategy: auto``, with and without its ``collective_bucketing``). The tuner applies each for
real (``explain``) and simulates the result on the search's machine; they join the candidates, so the tuned config
is never predicted slower than one of them (where one is fastest, it *is* the tuned config). What a strategy does
to the graph does not depend on the machine it is predicted for, so each is applied once per traced step and
re-simulated per search.

``lower_bound`` is a bound on every config of the step, not only on one grouping: compute as traced (no copy into
or out of a bucket buffer, which every bucketing adds, no issue cost) against each stream's traffic sent as one
collective per graph and kind (the ring model is subadditive: one collective of all the bytes is never slower than
several of parts of them), whichever is larger, plus nothing for the optimizer phase after the backward beyond its
compute. Contention and rank skew only add to both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from overlapcfg.config import OverlapConfig, load_config
from overlapcfg.config.depths import Depths
from overlapcfg.cost.prediction import Simulation
from overlapcfg.cost.price import collective_cost
from overlapcfg.errors import UpstreamPassError
from overlapcfg.passes.backend import CapturedStep
from overlapcfg.report.compare import compare_reports
from overlapcfg.report.explain import explain
from overlapcfg.report.model import Report
from overlapcfg.tuning.candidates import Candidate, Knobs
from overlapcfg.tuning.profile import Profile
from overlapcfg.tuning.quick import Score
from overlapcfg.tuning.step_cache import cached

__all__ = ["COMPETITORS", "COMPETITOR_ARM", "competitors", "lower_bound"]

COMPETITORS: Mapping[str, Mapping[str, Any]] = {
    "none (as traced)": {"strategy": "none"},
    "auto (torch's scheduler)": {"strategy": "auto", "policy": "auto"},
    "auto + collective_bucketing": {"strategy": "auto", "policy": {"collective_bucketing": True}},
}
"""Strategies that schedule by their own rules, by the name the tuner's tables give them."""
COMPETITOR_ARM = -2
"""``Candidate.arm`` of a competitor (presets are -1, the search's own groupings 0 and up)."""
_NO_KNOBS = Knobs(Depths(forward_prefetch=0, backward_prefetch=0, reduce_scatter_delay=0), "gather_first", None)

def _explained(step: CapturedStep, name: str, cfg: OverlapConfig) -> Report:
    """``explain(step, cfg)``, once per step (``overlapcfg.tuning.step_cache``), or torch's pass failing on it:
    what a strategy does to a graph does not depend on the machine predicted."""
    found = cached(step, ("competitor", name, cfg.model_dump_json()), lambda: _applied(step, cfg))
    if isinstance(found, UpstreamPassError):
        raise found
    return found


def _applied(step: CapturedStep, cfg: OverlapConfig) -> Report | UpstreamPassError:
    try:
        return explain(step, cfg)
    except UpstreamPassError as err:
        return err


def _score(sim: Simulation) -> Score:
    return Score(step_seconds=sim.step_seconds, exposed_comm_seconds=sim.exposed_comm_seconds,
                 compute_seconds=sim.compute_seconds, comm_seconds=sim.comm_seconds,
                 peak_inflight_bytes=sim.peak_inflight_bytes,
                 peak_unsharded_param_bytes=sim.peak_unsharded_param_bytes,
                 lower_bound_seconds=sim.lower_bound_seconds, unhidable_bound_seconds=sim.lower_bound_seconds)


def competitors(step: CapturedStep, profile: Profile) -> tuple[list[Candidate], dict[str, Simulation], tuple[str, ...]]:
    """Each of ``COMPETITORS`` applied to ``step`` (once per step) and simulated as ``profile`` prices things: the
    candidates, their full simulations by name, and the competitors left out because torch's own pass failed on this
    graph (``UpstreamPassError``; torch 2.12's ``auto`` on a transposed gradient), each with torch's reason: a
    competitor nobody can run is no competitor, and any other error still fails the search."""
    out, sims, left_out = [], {}, []
    for name, given in COMPETITORS.items():
        cfg = load_config(dict(given))
        try:
            report = _explained(step, name, cfg)
        except UpstreamPassError as err:
            left_out.append(f"{name}: {err}")
            continue
        sim = compare_reports(step, [report], hardware=profile.hardware, names=[name], world_size=profile.world_size,
                              as_dtype=profile.as_dtype, node_costs=profile.node_costs,
                              pricing=profile.pricing).rows[0].simulation
        sims[name] = sim
        out.append(Candidate(name, COMPETITOR_ARM, _NO_KNOBS, _score(sim), cfg))
    return out, sims, tuple(left_out)


def lower_bound(profile: Profile) -> float:
    """max(compute as traced, busiest stream with one collective per graph and kind): see the module docstring."""
    compute = profile.optimizer_compute
    traffic: dict[tuple[str, str, str], int] = {}
    for g in profile.graphs:
        compute += g.prefix[-1] + sum(c.raw_issue_cost + c.raw_wait_cost for c in g.collectives)
        for c in g.collectives:
            key = (c.group, g.name, c.kind)
            traffic[key] = traffic.get(key, 0) + c.cost_bytes
    streams: dict[str, float] = {}
    for (group, _, kind), nbytes in traffic.items():
        streams[group] = streams.get(group, 0.0) + collective_cost(kind, nbytes, profile.hardware,
                                                                   profile.world_size).seconds
    return max(compute, max(streams.values(), default=0.0))
