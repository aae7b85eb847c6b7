"""What a search returns: the tuned config and the evidence for it (``TuneResult``), and ``tuned.yaml``.

``tuned.yaml`` is the winner's ``OverlapConfig`` (``load_config`` reads it back; in a Hydra app it is a complete
option of the ``overlap`` group) under a header of comments: predicted step time, exposed communication, peak
in-flight and unsharded bytes, the two lower bounds, and the shipped presets on the same trace.

A ``TuneResult`` is an ``overlapcfg.results.Result``: ``print(result)`` shows the command's tables, ``repr`` one
line, ``result.plot("tune_front.png")`` the command's Pareto picture and ``result.timeline(path)`` the winner's
predicted step; all drawn by ``overlapcfg.tuning.render_tune``, which registers them (it imports this module, so this
module cannot import it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from overlapcfg.config import OverlapConfig
from overlapcfg.config.load import dump_yaml
from overlapcfg.cost.prediction import Simulation
from overlapcfg.cost.throughput import StepFacts, Throughput, throughput
from overlapcfg.report.labels import fmt_bytes, fmt_change, fmt_seconds
from overlapcfg.report.model import TIMELINE_SUFFIXES, Report
from overlapcfg.report.render import cost_sources_line, rate_text
from overlapcfg.results import Result
from overlapcfg.tuning.candidates import Candidate
from overlapcfg.tuning.quick import Score, Stall
from overlapcfg.tuning.space import TuneSpace

__all__ = ["AGREEMENT", "TUNE_SCHEMA", "TuneResult", "Verification"]

TUNE_SCHEMA = "overlapcfg.tune/3"
AGREEMENT = 0.01
"""Largest relative difference between the quick score and the full simulation of the winner."""


@dataclass(frozen=True, slots=True)
class Verification:
    """The winner applied for real (the verifier on), and simulated."""

    simulation: Simulation
    agreement: float
    """``|quick - full| / full`` of the step time."""
    seconds: float
    report: Report


@dataclass(frozen=True, slots=True, repr=False)
class TuneResult(Result):
    """What ``tune`` found, and the evidence. ``print(result)``: the command's tables; ``result.to_yaml()``:
    ``tuned.yaml``; ``result.to_json()``: ``tune.json``; ``result.plot(path)``: ``tune_front.png``."""

    presented_by = "overlapcfg.tuning.render_tune"  # not annotated: a ClassVar would be listed in __dataclass_fields__

    config: OverlapConfig
    """The tuned config: pass it to ``apply`` / ``backend``, or write it with ``to_yaml``."""
    best: Candidate
    """The winner: of the candidates within ``tie_tolerance`` of the fastest, the fewest bytes in flight."""
    fastest: Candidate
    """The fastest candidate within the budget (``best`` itself unless a tie went to a lighter one)."""
    tie_tolerance: float
    """Steps within this fraction of the fastest count as equal (``overlapcfg.tuning.candidates.TIE_TOLERANCE``)."""
    top: tuple[Candidate, ...]
    """The fastest candidates within the budget (at most 10), best first."""
    pareto: tuple[Candidate, ...]
    """Step time against peak in-flight bytes: no candidate beats one of these on both; lightest first."""
    presets: tuple[Candidate, ...]
    """Every shipped plan x policy preset and ``torch_manual`` that fits the model, quick-scored."""
    competitors: tuple[Candidate, ...]
    """Strategies that schedule by their own rules (``none``, torch's ``auto`` with and without its bucketing),
    applied and simulated for real (``overlapcfg.tuning.competitors``)."""
    lower_bound_seconds: float
    """No config of this step can be faster (``overlapcfg.tuning.competitors.lower_bound``): compute as traced
    against the busiest stream sending its traffic as one collective per graph and kind."""
    skipped: tuple[str, ...]
    """Presets and competitors left out, and why (a competitor only where torch's own pass failed on the graph)."""
    candidates: tuple[Candidate, ...]
    """Every distinct candidate scored, fastest first."""
    verification: Verification | None
    stalls: tuple[Stall, ...]
    """Where the winner's compute still waits on communication (quick model)."""
    hardware: str
    world_size: int
    memory_budget: int | None
    as_dtype: torch.dtype | None
    space: TuneSpace
    evaluated: int
    """Candidates scored (grid, presets and per-bucket trials)."""
    profile_seconds: float
    seconds: float
    """The whole search, profile and verification included."""
    arms: int
    """Distinct groupings searched."""
    facts: StepFacts = field(default_factory=StepFacts)
    """Tokens a rank processes per step and the model's parameters (``overlapcfg.cost.throughput``)."""
    peak_flops: float = 0.0
    """The device's dense datasheet peak for the costed dtype (MFU's denominator)."""
    competitor_seconds: float = 0.0
    """Of ``seconds``, what the competitors took (``overlapcfg.tuning.competitors``): mostly torch's own ``auto``
    pass applied to the step, once per step (cached: a second search of the same step takes a fraction of it)."""
    pricing: dict[str, Any] | None = None
    """What the search assumed besides the hardware (``overlapcfg.cost.pricing.Pricing``, fusion resolved)."""

    @property
    def score(self) -> Score:
        return self.best.score

    def rate(self, step_seconds: float) -> Throughput:
        """Tokens/s per GPU and MFU of a step of ``step_seconds`` (``overlapcfg.cost.throughput``)."""
        return throughput(self.facts, step_seconds, 0.0, self.peak_flops)

    def rate_text(self, step_seconds: float) -> str:
        """``14.8k tok/s/GPU, MFU 38.2 %``, or empty where unknown."""
        return rate_text(self.rate(step_seconds))

    def fits(self, c: Candidate) -> bool:
        return self.memory_budget is None or c.peak_inflight_bytes <= self.memory_budget

    @property
    def best_competitor(self) -> Candidate | None:
        """The fastest preset or competitor within the budget: what the user would pick without tuning."""
        fitting = [c for c in (*self.presets, *self.competitors) if self.fits(c)]
        return min(fitting, key=lambda c: c.step_seconds) if fitting else None

    @property
    def best_preset(self) -> Candidate | None:
        """The fastest shipped preset within the budget."""
        fitting = [c for c in self.presets if self.fits(c)]
        return min(fitting, key=lambda c: c.step_seconds) if fitting else None

    def header(self) -> list[str]:
        """The comment lines above the config in ``tuned.yaml``."""
        s = self.score
        cost = f", costed as {str(self.as_dtype).removeprefix('torch.')}" if self.as_dtype is not None else ""
        budget = f"peak all-gathers in flight <= {fmt_bytes(self.memory_budget)}" if self.memory_budget else \
            "no memory budget"
        lines = [f"overlapcfg tune: the best of {self.evaluated} candidates on {self.hardware} at {self.world_size} "
                 f"ranks{cost}, {budget} (steps within {100 * self.tie_tolerance:g}% of the fastest are a tie, won "
                 "by fewer bytes in flight)",
                 f"candidate: {self.best.name}"]
        tie = self.tie_note()
        if tie:
            lines.append(f"fastest found: {tie}")
        full = ""
        if self.verification is not None:
            full = (f" (full apply + verify + simulate: {fmt_seconds(self.verification.simulation.step_seconds)}, "
                    f"{100 * self.verification.agreement:.3f}% apart)")
        rate = self.rate_text(s.step_seconds)
        lines += [f"predicted step {fmt_seconds(s.step_seconds)}{full}" + (f"; {rate}" if rate else ""),
                  f"exposed communication {fmt_seconds(s.exposed_comm_seconds)}; peak all-gathers in flight "
                  f"{fmt_bytes(s.peak_inflight_bytes)}; peak unsharded parameters "
                  f"{fmt_bytes(s.peak_unsharded_param_bytes)}",
                  f"lower bound on every config, max(compute as traced, communication as few collectives as can "
                  f"be): {fmt_seconds(self.lower_bound_seconds)} (this config "
                  f"{fmt_change(s.step_seconds, self.lower_bound_seconds)})",
                  f"bound of this config's grouping, with its copies and the unhidable first all-gather and last "
                  f"reduce-scatter: {fmt_seconds(s.unhidable_bound_seconds)} (this config "
                  f"{fmt_change(s.step_seconds, s.unhidable_bound_seconds)})"]
        sim = self.verification.simulation if self.verification is not None else None
        if sim is not None and any(c.source in ("measured", "fitted") for c in sim.cost_sources):
            lines.append(f"priced by {cost_sources_line(sim.cost_sources, sim.node_costs)}")
        lines.append("what you could pick instead, on the same trace (presets: quick model; strategies: applied and "
                     "simulated):")
        for p in sorted((*self.presets, *self.competitors), key=lambda c: c.step_seconds):
            over = "" if self.fits(p) else " (over budget)"
            rate = self.rate_text(p.step_seconds)
            lines.append(f"  {p.name}: {fmt_seconds(p.step_seconds)}" + (f" ({rate})" if rate else "") +
                         f", in flight {fmt_bytes(p.peak_inflight_bytes)}{over}")
        lines.append("load it: overlapcfg.load_config(pathlib.Path('tuned.yaml')), or as an option of your Hydra "
                     "app's overlap group")
        return lines

    def tie_note(self) -> str | None:
        """Why the winner is not the fastest candidate (a tie went to fewer bytes in flight), or None."""
        fast, best = self.fastest, self.best
        if fast is best or (fast.step_seconds, fast.peak_inflight_bytes) == (best.step_seconds,
                                                                             best.peak_inflight_bytes):
            return None
        return (f"{fast.name}: {fmt_change(fast.step_seconds, best.step_seconds, 3)} step for "
                f"{fmt_change(fast.peak_inflight_bytes, best.peak_inflight_bytes, 0)} bytes in flight; steps within "
                f"{100 * self.tie_tolerance:g}% of the fastest are a tie, won by the fewest bytes in flight")

    def to_yaml(self) -> str:
        """``tuned.yaml``: the header as comments, then the config (``load_config`` reads it back)."""
        body = dump_yaml({"strategy": self.config.strategy, **self.config.model_dump(mode="json", exclude_none=True)})
        return "".join(f"# {line}\n" for line in self.header()) + body

    def to_dict(self) -> dict[str, Any]:
        def row(c: Candidate) -> dict[str, Any]:
            rate = self.rate(c.step_seconds)
            return {"name": c.name, "score": _score(c.score), "tokens_per_second": rate.tokens_per_second,
                    "mfu": rate.mfu, "config": c.config.model_dump(mode="json") if c.config is not None else None}

        v = self.verification
        return {
            "schema": TUNE_SCHEMA, "hardware": self.hardware, "world_size": self.world_size,
            "memory_budget": self.memory_budget,
            "as_dtype": str(self.as_dtype).removeprefix("torch.") if self.as_dtype is not None else None,
            "best": row(self.best), "fastest": row(self.fastest), "tie_tolerance": self.tie_tolerance,
            "verification": None if v is None else {"simulation": v.simulation.model_dump(mode="json"),
                                                    "agreement": v.agreement, "seconds": v.seconds},
            "stalls": [{"graph": x.graph, "bucket": x.bucket, "kind": x.kind, "at": x.at, "seconds": x.seconds}
                       for x in self.stalls],
            "top": [row(c) for c in self.top], "pareto": [row(c) for c in self.pareto],
            "presets": [row(c) for c in self.presets], "competitors": [row(c) for c in self.competitors],
            "lower_bound_seconds": self.lower_bound_seconds, "skipped": list(self.skipped),
            "space": self.space.model_dump(mode="json"), "evaluated": self.evaluated, "arms": self.arms,
            "profile_seconds": self.profile_seconds, "seconds": self.seconds,
            "competitor_seconds": self.competitor_seconds,
            "tokens_per_step": self.facts.tokens, "model_params": self.facts.params, "peak_flops": self.peak_flops,
            "pricing": self.pricing,
        }

    def to_json(self, indent: int | None = 2) -> str:
        """``tune.json``: the winner, the top candidates, the Pareto front, the presets and the full check."""
        return json.dumps(self.to_dict(), indent=indent)

    def plot(self, path: str | Path) -> Path:
        """Write the command's ``tune_front.png`` to ``path`` (``.png``): step time against peak all-gathered bytes
        in flight, every candidate, the Pareto front, the presets and the winner (``overlapcfg.tuning.front``)."""
        return self._write("plot", path, (".png",))

    def timeline(self, path: str | Path) -> Path:
        """Write the winner's predicted step (applied for real and simulated: ``verification``) to ``path``: a Gantt
        chart (``.png``) or a Chrome trace (``.json``). Needs ``tune(..., verify=True)``, the default."""
        return self._write("timeline", path, TIMELINE_SUFFIXES)

    def summary(self) -> str:
        budget = f"memory budget {fmt_bytes(self.memory_budget)}" if self.memory_budget else "no memory budget"
        return (f"best={self.best.name!r}, predicted step {fmt_seconds(self.score.step_seconds)} on {self.hardware} "
                f"at {self.world_size} ranks, {budget}, {self.evaluated} candidates")


def _score(s: Score) -> dict[str, Any]:
    return {"step_seconds": s.step_seconds, "exposed_comm_seconds": s.exposed_comm_seconds,
            "compute_seconds": s.compute_seconds, "comm_seconds": s.comm_seconds,
            "peak_inflight_bytes": s.peak_inflight_bytes, "peak_unsharded_param_bytes": s.peak_unsharded_param_bytes,
            "lower_bound_seconds": s.lower_bound_seconds, "unhidable_bound_seconds": s.unhidable_bound_seconds}
