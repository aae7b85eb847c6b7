"""What ``diagnose`` returns: ``DiagnoseResult``, frozen data and an ``overlapcfg.results.Result`` like every
other public result (drawn by ``overlapcfg.diagnosis.render_diagnosis``, which registers its tables and timeline).

``print(result)`` / ``rich.print(result)`` show the tables the command prints, ``repr(result)`` is one short line
(``summary``), ``result.to_json()`` is ``diagnose.json`` (``DiagnoseResult.from_json`` reads it back),
``result.to_yaml()`` is the proposed config (``proposed.yaml``: ``overlapcfg.load_config`` reads it), and
``result.timeline(path)`` draws one step of every rank with the existing timeline renderer
(``overlapcfg.report.timeline``): compute, each collective labelled with its bucket, and exposed communication
hatched in the colour of the collective the thread waited for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

from pydantic import PrivateAttr

from overlapcfg.config.load import dump_yaml
from overlapcfg.diagnosis.steps import RankStep
from overlapcfg.errors import OverlapConfigError, OverlapStateError
from overlapcfg.report.labels import fmt_seconds
from overlapcfg.report.model import TIMELINE_SUFFIXES
from overlapcfg.resolve.resolved import RecordModel
from overlapcfg.results import Result, counted

__all__ = ["DIAGNOSE_SCHEMA", "BucketRow", "DiagnoseResult", "Divergence", "Proposal", "RankStepRow", "SkewRow"]

DIAGNOSE_SCHEMA = "overlapcfg.diagnose/1"


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


class DiagnoseResult(Result, RecordModel):
    """A diagnosis of one profiling window of one job (see the module docstring)."""

    presented_by: ClassVar[str] = "overlapcfg.diagnosis.render_diagnosis"

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
    """Half the interquartile range of the steps' times (slowest rank), from 8 profiled steps; half their range
    below 8 (a note says so); 0 for one step (nothing is then proposed): a gain below it cannot be told from
    noise."""
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

    def __eq__(self, other: object) -> bool:  # the pictured steps are an attachment, not data (JSON drops them)
        return isinstance(other, DiagnoseResult) and self.model_dump() == other.model_dump()

    # compared by value, not hashable (``config`` is a dict)
    __hash__ = None  # type: ignore[assignment]

    @property
    def pictured(self) -> tuple[RankStep, ...]:
        """Every rank's step that ``timeline`` draws (the one whose slowest rank took the median time); empty for a
        result read back from JSON."""
        return self._pictured

    def summary(self) -> str:
        change = self.proposal.name if self.proposal is not None else "nothing beyond noise"
        diverge = f", DIVERGING at {counted(len(self.divergence), 'rank')}" if self.divergence else ""
        return (f"{counted(len(self.ranks), 'rank')}, {counted(len(self.steps), 'step')}, {self.device}, step "
                f"{fmt_seconds(self.measured_step_s)} ± {fmt_seconds(self.noise_s)}, exposed "
                f"{fmt_seconds(self.exposed_s)}, {self.unattributed} unattributed{diverge}, proposal {change!r}")

    def timeline(self, path: str | Path) -> Path:
        """Write the pictured step of every rank to ``path``: a Gantt chart (``.png``) or a Chrome trace
        (``.json``, open it in https://ui.perfetto.dev), as ``overlapcfg mode=diagnose`` writes it. Needs the
        measured steps (a result read back from JSON has none)."""
        return self._write("timeline", path, TIMELINE_SUFFIXES)

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
