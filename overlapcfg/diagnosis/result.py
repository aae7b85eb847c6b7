"""What ``diagnose`` returns: ``DiagnoseResult``, frozen data with the surface every overlapcfg result has.

``print(result)`` / ``rich.print(result)`` show the tables the command prints (``overlapcfg.diagnosis.render``),
``repr(result)`` is one short line, ``result.to_json()`` is ``diagnose.json`` (``DiagnoseResult.from_json`` reads it
back), ``result.to_yaml()`` is the proposed config (``proposed.yaml``: ``overlapcfg.load_config`` reads it), and
``result.timeline(path)`` (also ``result.plot(path)``) draws one step of every rank with the existing timeline
renderer (``overlapcfg.report.timeline``): compute, each collective labelled with its bucket, and exposed
communication hatched in the colour of the collective the thread waited for.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from pydantic import PrivateAttr

from overlapcfg.config.load import dump_yaml
from overlapcfg.cost.prediction import Event, Simulation
from overlapcfg.diagnosis.steps import RankStep
from overlapcfg.errors import OverlapConfigError, OverlapStateError
from overlapcfg.report.labels import fmt_seconds
from overlapcfg.resolve.resolved import RecordModel

__all__ = ["DIAGNOSE_SCHEMA", "BucketRow", "DiagnoseResult", "Divergence", "Proposal", "RankStepRow", "SkewRow",
           "as_renderable", "as_text"]

DIAGNOSE_SCHEMA = "overlapcfg.diagnose/1"


@functools.singledispatch
def as_text(data: object) -> str:
    """``str(result)``: the tables ``overlapcfg.diagnosis.render`` draws (registered there)."""
    return repr(data)


@functools.singledispatch
def as_renderable(data: object) -> object:
    """``rich.print(result)``: the same tables in colour (registered there)."""
    return repr(data)


class RankStepRow(RecordModel):
    """One step on one rank, seconds."""

    rank: int
    step: int
    step_s: float
    compute_s: float
    comm_s: float
    """Time some collective ran (union over the communication threads or streams)."""
    exposed_s: float
    """Communication no compute covered."""
    idle_s: float
    """Neither compute nor communication (Python, the data loader, launch gaps)."""
    collectives: int


class BucketRow(RecordModel):
    """One bucket over the profiled steps and ranks (per step: the mean over steps and ranks)."""

    bucket: str
    modules: tuple[str, ...]
    kinds: str
    """Its collectives per step, e.g. ``AG fw, AG bw, RS``."""
    bytes: int | None
    """Full size of its all-gather (or of its largest collective)."""
    comm_s: float
    exposed_s: float
    overlapped_s: float
    """Compute that ran while its collectives did."""
    peak_memory: int | None
    """Peak allocated bytes while its collectives were in flight (traces with memory events)."""
    source: str


class SkewRow(RecordModel):
    step: int
    index: int
    kind: str
    bucket: str | None
    skew_s: float
    last_rank: int


class Divergence(RecordModel):
    """The first collective ``rank`` issued differently from ``reference`` (same position in their sequences)."""

    rank: int
    reference: int
    position: int
    step: int | None
    expected: str
    found: str
    file: str


class Proposal(RecordModel):
    """A change with its predicted gain (the replay of the measured step, ``overlapcfg.diagnosis.propose``)."""

    name: str
    change: str
    predicted_step_s: float
    gain_s: float
    extra_bytes: int
    fits_budget: bool
    reason: str | None = None
    """Why it cannot help or was not taken."""


class DiagnoseResult(RecordModel):
    """A diagnosis of one profiling window of one job (see the module docstring)."""

    files: tuple[str, ...]
    ranks: tuple[int, ...]
    world_size: int | None
    device: str
    backend: str | None
    steps: tuple[int, ...]
    divergence: tuple[Divergence, ...] = ()
    rank_steps: tuple[RankStepRow, ...] = ()
    buckets: tuple[BucketRow, ...] = ()
    collectives: int = 0
    unattributed: int = 0
    """Collectives of kinds FSDP issues that no label or compiled graph's record ties to a bucket."""
    other: int = 0
    """Collectives that are not FSDP's (barriers, broadcasts, a trainer's own all-reduces)."""
    skew: tuple[SkewRow, ...] = ()
    """The largest arrival skews (first rank's issue to the last one's), largest first."""
    slowest_rank: int | None = None
    """The rank that arrived last the most time in total, where ranks disagree by more than the noise."""
    blocking: bool = False
    """Collectives block the thread that issues them (eager FSDP2 on gloo)."""
    measured_step_s: float = 0.0
    """Median over steps of the slowest rank's step."""
    noise_s: float = 0.0
    """Half the interquartile range of the steps' times (slowest rank; half the range below 4 steps): a gain below
    it cannot be told from noise."""
    replayed_step_s: float = 0.0
    """The replay of the measured steps unchanged (what every proposal's gain is taken from)."""
    memory_budget: int | None = None
    proposal: Proposal | None = None
    """The change to make; None: nothing to gain beyond the noise."""
    verdict: str = ""
    candidates: tuple[Proposal, ...] = ()
    config: dict[str, Any] | None = None
    """The proposed config (``to_yaml``)."""
    notes: tuple[str, ...] = ()

    _pictured: tuple[RankStep, ...] = PrivateAttr(())

    def with_picture(self, steps: tuple[RankStep, ...]) -> DiagnoseResult:
        self._pictured = steps
        return self

    # -- the surface every result has ------------------------------------------------------------------------------
    def __repr__(self) -> str:
        change = self.proposal.name if self.proposal is not None else "nothing beyond noise"
        diverge = f", DIVERGING at {len(self.divergence)} ranks" if self.divergence else ""
        return (f"DiagnoseResult(ranks={len(self.ranks)}, steps={len(self.steps)}, device={self.device!r}, "
                f"step={fmt_seconds(self.measured_step_s)}, exposed={fmt_seconds(self.exposed_s)}, "
                f"unattributed={self.unattributed}{diverge}, proposal={change!r})")

    def __str__(self) -> str:
        return as_text(self)

    def __rich__(self) -> object:
        return as_renderable(self)

    @property
    def exposed_s(self) -> float:
        """Median over steps of the mean over ranks of exposed communication per step."""
        per_step: dict[int, list[float]] = {}
        for r in self.rank_steps:
            per_step.setdefault(r.step, []).append(r.exposed_s)
        means = sorted(sum(v) / len(v) for v in per_step.values())
        return means[len(means) // 2] if means else 0.0

    def exposed(self, rank: int, step: int) -> float:
        for r in self.rank_steps:
            if (r.rank, r.step) == (rank, step):
                return r.exposed_s
        have = sorted({(r.rank, r.step) for r in self.rank_steps})
        raise OverlapStateError(f"no step {step} of rank {rank}; have (rank, step) {have}")

    def to_dict(self) -> dict[str, Any]:
        return {"schema": DIAGNOSE_SCHEMA, **self.model_dump(mode="json")}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> DiagnoseResult:
        data = json.loads(text) if isinstance(text, str) else dict(text)
        if data.pop("schema", None) != DIAGNOSE_SCHEMA:
            raise OverlapConfigError(f"not an overlapcfg diagnosis of schema {DIAGNOSE_SCHEMA!r}")
        return cls.model_validate(data)

    def to_yaml(self) -> str:
        """The proposed config, with what it changes and why as comments (``load_config`` reads it back); where
        there is nothing to gain, the reason alone, as comments."""
        lines = [f"overlapcfg diagnose: {self.verdict}"]
        if self.proposal is None or self.config is None:
            return "".join(f"# {line}\n" for line in lines)
        lines.append(f"measured step {fmt_seconds(self.measured_step_s)} (spread ±{fmt_seconds(self.noise_s)}), "
                     f"replayed {fmt_seconds(self.replayed_step_s)}; with this change "
                     f"{fmt_seconds(self.proposal.predicted_step_s)}")
        return "".join(f"# {line}\n" for line in lines) + dump_yaml(self.config)

    def simulations(self) -> list[tuple[str, Simulation]]:
        """The pictured step of every rank as timeline runs (``overlapcfg.report.timeline``)."""
        if not self._pictured:
            raise OverlapStateError("this DiagnoseResult has no step to draw (read back from JSON): draw it where "
                                    "diagnose ran")
        return [(f"rank {s.rank} · step {s.step}", _simulation(s, self.world_size or len(self.ranks)))
                for s in self._pictured]

    def timeline(self, path: str | Path) -> Path:
        """A PNG of the pictured step (``.png``), or its Chrome trace (``.json``: open in Perfetto)."""
        from overlapcfg.report.timeline import write_chrome_trace, write_gantt_png

        path = Path(path)
        runs = self.simulations()
        if path.suffix == ".json":
            return write_chrome_trace(runs, path)
        step = self._pictured[0].step
        return write_gantt_png(runs, path, title=f"measured step {step}: {len(runs)} ranks, exposed communication "
                                                 "hatched, collectives labelled with their bucket")

    def plot(self, path: str | Path) -> Path:
        """The same as ``timeline``."""
        return self.timeline(path)


def _simulation(step: RankStep, world_size: int) -> Simulation:
    """A measured step in the simulator's event vocabulary (times from the step's start)."""
    a = step.start
    events: list[Event] = [Event("step", "compute", "compute", "compute", (s - a) / 1e6, (e - a) / 1e6)
                           for s, e in step.compute_spans]
    for c in step.collectives:
        label = c.bucket or "unattributed"
        events.append(Event("step", f"{c.kind}#{c.index}", f"comm:{c.group or 0}", c.kind, (c.start - a) / 1e6,
                            (c.end - a) / 1e6, label, c.nbytes or 0))
        if c.end > c.need:
            events.append(Event("step", f"wait#{c.index}", "compute", "wait", (max(c.need, c.start) - a) / 1e6,
                                (c.end - a) / 1e6, label, waits_on=c.kind))
    return Simulation(hardware="measured", world_size=world_size, step_seconds=step.seconds,
                      compute_seconds=step.compute, comm_seconds=step.comm, exposed_comm_seconds=step.exposed,
                      overlap_ratio=max(0.0, 1 - step.exposed / step.comm) if step.comm else None,
                      lower_bound_seconds=max(step.compute, step.comm), peak_inflight_bytes=0,
                      peak_unsharded_param_bytes=0, peak_activation_bytes=None).with_events(tuple(events))
