"""What ``measure`` found: per config, the prediction next to the measured step, and how far apart they are.

Frozen pydantic models, so ``measure.json`` is the schema (``Measurement.to_json()`` / ``Measurement.from_json``,
versioned by ``MEASURE_SCHEMA``). The per-node durations travel separately (``node_costs.json``, see
``overlapcfg.cost.node_costs``): they are large and are an input to the simulator and the tuner.

Also what ``calibrate`` returns: a ``CalibratedProfile``, a ``HardwareProfile`` (usable wherever one is, equal to
the profile read back from its file) that prints as the command's calibration table and writes the command's YAML
(``to_yaml``). Both are ``overlapcfg.results.Result``s drawn by ``overlapcfg.measuring.render_measure``, which registers
them (it imports this module, so this module cannot import it).
"""

from __future__ import annotations

import json
import statistics
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, PrivateAttr

from overlapcfg.cost.hardware import HardwareProfile, hardware_yaml
from overlapcfg.cost.node_costs import NodeCosts
from overlapcfg.cost.prediction import CostSource
from overlapcfg.errors import OverlapConfigError, OverlapLookupError
from overlapcfg.report.labels import fmt_seconds
from overlapcfg.results import Result, counted

__all__ = ["MEASURE_SCHEMA", "UNEVEN_EXPOSED", "CalibratedProfile", "Measurement", "MeasuredCollective",
           "MeasuredConfig", "profile_header"]

PRESENTER = "overlapcfg.measuring.render_measure"

MEASURE_SCHEMA = "overlapcfg.measure/1"

UNEVEN_EXPOSED = 1.5
"""How many times longer one rank's exposed communication must be than another's for ``measure`` to say the ranks
waited unequally. Measured on 2 gloo ranks (2026-12-07), 6 profiled steps of the demo: every collective waited for at
once (``none``), the ranks waited 148 and 154 ms a step (159 and 184 beside another 2-rank job); with one layer of
prefetch (``d1``) 17 and 12 ms quiet, **44 and 25 ms** beside the other job, rank 1 issuing each collective 13 ms
after rank 0 on average."""


class _Data(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class MeasuredCollective(_Data):
    """One collective of a config's graphs: the model's duration for it and the measured one."""

    graph: str
    node: str
    kind: str
    bytes: int
    """Full size (an all-gather's output, a reduce-scatter's input)."""
    predicted_s: float
    measured_s: float | None
    """Median over profiled steps and ranks; None where the trace could not be matched to the graph."""


class MeasuredConfig(_Data):
    """One config of the sweep."""

    name: str
    overrides: dict[str, Any]
    """The config's keys as given (what makes it differ from the others)."""
    config: dict[str, Any]
    """The whole validated ``OverlapConfig``."""
    predicted_step_s: float
    """The simulator on the chosen profile (roofline and ring model, or its fits)."""
    predicted_exposed_s: float
    measured_step_s: float
    """Median over timed steps of the time inside the step's compiled graphs (the slowest rank's), which is what
    is predicted; the rest of the step (loss outside the graph, optimizer, data) is in ``measured_wall_s``."""
    measured_spread_s: float
    """Interquartile range of the timed steps' graph times: how much one step differs from the next."""
    measured_exposed_s: float
    """Median over steps of the communication the compute thread or stream waited for (mean of ranks): over the
    timed steps where their waits were timed (a CPU: ``overlapcfg.measuring.runner``), else over the profiled
    steps (``measured_exposed_in`` says which)."""
    measured_exposed_by_rank_s: tuple[float, ...] = ()
    """Per rank, the median over the same steps of what that rank waited for. Ranks that run at the same speed wait
    about as long; a rank that waits much longer than another is mostly waiting for a slower one to issue its
    collectives (``uneven_exposed``)."""
    measured_wall_s: float
    """Median wall time of the whole step function."""
    measured_profiled_step_s: float
    """Median graph time of the profiled steps (under ``torch.profiler``, which slows them a little)."""
    measured_exposed_in: Literal["timed steps", "profiled steps"] = "profiled steps"
    """Where ``measured_exposed_s`` was measured: ``timed steps`` (their waits timed, no profiler on) or
    ``profiled steps`` (the profiler's trace)."""
    measured_profiled_exposed_s: float | None = None
    """Median over the profiled steps of the exposed communication the profiler's trace shows (mean of ranks)."""
    step_seconds: tuple[float, ...]
    """Every timed step's graph time (the slowest rank's), in order."""
    predicted_profiled_step_s: float | None = None
    """The simulator with measured node durations (``node_costs``) where they match, the profile elsewhere."""
    predicted_profiled_exposed_s: float | None = None
    cost_sources: tuple[CostSource, ...] = ()
    """How ``predicted_step_s`` was priced."""
    profiled_cost_sources: tuple[CostSource, ...] = ()
    """How ``predicted_profiled_step_s`` was priced."""
    collectives: tuple[MeasuredCollective, ...] = ()
    predicted_skew_s: float = 0.0
    """Seconds the prediction's collectives waited for their last rank (the profile's skew)."""
    tokens_per_step: int | None = None
    """Tokens one rank processes per step (``overlapcfg.cost.throughput``)."""
    predicted_tokens_per_second: float | None = None
    """Predicted tokens per second per GPU (per rank), inside the graphs."""
    predicted_mfu: float | None = None
    """Predicted ``6 N tokens / (step x dense peak)`` on the profile's peak."""
    measured_tokens_per_second: float | None = None
    """``tokens_per_step / measured_step_s``."""
    measured_mfu: float | None = None
    """``6 N tokens / (measured step x dense peak)``, on the same peak as the prediction's."""

    def uneven_exposed(self) -> bool:
        """Whether one rank waited for communication at least ``UNEVEN_EXPOSED`` times as long as another, and at
        least a millisecond longer: the ranks ran at different speeds, and the faster waited for the slower."""
        by_rank = self.measured_exposed_by_rank_s
        if len(by_rank) < 2:
            return False
        most, least = max(by_rank), min(by_rank)
        return most - least >= 1e-3 and most >= UNEVEN_EXPOSED * least

    @property
    def error(self) -> float:
        """``(predicted - measured) / measured`` of the step time."""
        return (self.predicted_step_s - self.measured_step_s) / self.measured_step_s

    @property
    def profiled_error(self) -> float | None:
        if self.predicted_profiled_step_s is None:
            return None
        return (self.predicted_profiled_step_s - self.measured_step_s) / self.measured_step_s


class Measurement(Result, _Data):
    """A sweep measured on real ranks, with the prediction for each config on ``hardware``. ``print(measurement)``:
    the command's predicted-vs-measured table; ``to_json()``: ``measure.json``."""

    presented_by: ClassVar[str] = PRESENTER

    hardware: HardwareProfile
    """The profile the predictions were made on (whole, calibration record included)."""
    world_size: int
    backend: str
    device: str
    date: str
    torch_version: str
    warmup: int
    steps: int
    profiled_steps: int
    node_costs: str | None = None
    """What the measured node durations were taken from (``NodeCosts.source``); None: not measured."""
    between_graphs_s: float | None = None
    """Seconds each step ran between its forward and backward graphs, outside both (the median over the reference
    config's timed steps and ranks), and priced as ``Pricing.between_graphs_seconds`` unless the caller set it."""
    configs: tuple[MeasuredConfig, ...]

    _costs: NodeCosts | None = PrivateAttr(None)

    @property
    def measured_node_costs(self) -> NodeCosts | None:
        """The per-node durations measured on the reference config (not in ``measure.json``: write them with
        ``NodeCosts.to_json``); give them to ``simulate``, ``explain``, ``compare`` or ``tune`` as ``node_costs``."""
        return self._costs

    def attach(self, costs: NodeCosts | None) -> Measurement:
        self._costs = costs
        return self

    def config(self, name: str) -> MeasuredConfig:
        for c in self.configs:
            if c.name == name:
                return c
        raise OverlapLookupError(f"no config {name!r}; have {[c.name for c in self.configs]}")

    def median_abs_error(self, *, profiled: bool = False) -> float | None:
        """Median over configs of ``|predicted - measured| / measured``."""
        errors = [c.profiled_error if profiled else c.error for c in self.configs]
        kept = [abs(e) for e in errors if e is not None]
        return statistics.median(kept) if kept else None

    def ranking(self, key: str) -> tuple[str, ...]:
        """Config names, fastest first, by ``predicted_step_s``, ``predicted_profiled_step_s`` or
        ``measured_step_s``."""
        have = [c for c in self.configs if getattr(c, key) is not None]
        return tuple(c.name for c in sorted(have, key=lambda c: (getattr(c, key), c.name)))

    def to_dict(self) -> dict[str, Any]:
        data = self.model_dump(mode="json", exclude_none=False)
        ranks = {key: {n: i + 1 for i, n in enumerate(self.ranking(key))}
                 for key in ("predicted_step_s", "predicted_profiled_step_s", "measured_step_s")}
        for row, c in zip(data["configs"], self.configs, strict=True):
            row["error"] = c.error
            row["profiled_error"] = c.profiled_error
            row["predicted_rank"] = ranks["predicted_step_s"].get(c.name)
            row["predicted_profiled_rank"] = ranks["predicted_profiled_step_s"].get(c.name)
            row["measured_rank"] = ranks["measured_step_s"].get(c.name)
        summary = {"median_abs_error": self.median_abs_error(),
                   "median_abs_error_profiled": self.median_abs_error(profiled=True)}
        return {"schema": MEASURE_SCHEMA, **data, "summary": summary}

    def to_json(self, indent: int | None = 2) -> str:
        """``measure.json``."""
        return json.dumps(self.to_dict(), indent=indent)

    def summary(self) -> str:
        error = self.median_abs_error()
        err = f", median |error| {100 * error:.1f}%" if error is not None else ""
        names = ", ".join(repr(c.name) for c in self.configs)
        return (f"{counted(len(self.configs), 'config')} on {self.backend} x {self.world_size} ({self.device}), "
                f"predicted on {self.hardware.name}{err}: {names}")

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> Measurement:
        """Read ``measure.json`` back (the derived fields ``to_dict`` adds are dropped)."""
        data = json.loads(text) if isinstance(text, str) else dict(text)
        if data.pop("schema", None) != MEASURE_SCHEMA:
            raise OverlapConfigError(f"not an overlapcfg measurement of schema {MEASURE_SCHEMA!r}")
        data.pop("summary", None)
        derived = ("error", "profiled_error", "predicted_rank", "predicted_profiled_rank", "measured_rank")
        data["configs"] = [{k: v for k, v in row.items() if k not in derived} for row in data["configs"]]
        return cls.model_validate(data)


class CalibratedProfile(Result, HardwareProfile):
    """What ``calibrate`` returns: the calibrated ``HardwareProfile`` (equal to one read back from its file) that
    prints as the command's calibration table; ``to_yaml()`` is the file the command writes (``save_hardware`` with
    ``profile_header``)."""

    presented_by: ClassVar[str] = PRESENTER

    @classmethod
    def of(cls, profile: HardwareProfile) -> CalibratedProfile:
        """``profile`` as a ``CalibratedProfile`` (the same fields, validated again)."""
        return cls.model_validate(profile.model_dump())

    def to_yaml(self) -> str:
        """The profile file the command writes: ``profile_header`` as comments, then the profile."""
        return hardware_yaml(self, header=profile_header(self))

    def summary(self) -> str:
        cal = self.calibration
        where = f", {cal.backend} x {cal.world_size} on {cal.device}, {cal.date}" if cal is not None else ""
        rough = f", rough fits: {', '.join(cal.rough_fits)}" if cal is not None and cal.rough_fits else ""
        return f"name={self.name!r}, {self.device_kind}{where}, latency {fmt_seconds(self.latency)}{rough}"

    def __eq__(self, other: object) -> bool:  # a profile read back from its file is the same profile
        if isinstance(other, HardwareProfile):
            return self.model_dump() == other.model_dump()
        return NotImplemented

    __hash__ = HardwareProfile.__hash__


def profile_header(profile: HardwareProfile) -> str:
    """The comment a calibrated profile's YAML starts with: what the numbers are and where they came from."""
    cal = profile.calibration
    if cal is None:
        raise OverlapConfigError(f"profile {profile.name!r} holds no calibration record to describe")
    return (f"Calibrated by overlapcfg {cal.overlapcfg_version} (torch {cal.torch_version}) on {cal.date}: "
            f"{cal.device}, {cal.backend} x {cal.world_size}, {cal.seconds:.0f} s.\n"
            "collectives: per link and kind, the ring model's latency (per step) and bus bandwidth fitted by least "
            "squares\nto the timings under calibration.groups (residual: RMS relative error). mem_bandwidth: a + b "
            "at the step's kernel sizes;\npeak_flops: the best rate a timed matmul reached, per dtype; achievable: "
            "each matmul's share of it by shape,\nthe per-kernel and per-view costs. contention: how much compute "
            "and collectives slow each other while\nthey overlap. skew: how far apart the ranks arrive at a "
            "collective. "
            "calibration.rough_fits: what to distrust. Read by overlapcfg\nhardware=<name> / load_hardware.")
