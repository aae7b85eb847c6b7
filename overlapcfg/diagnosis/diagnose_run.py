"""``overlapcfg.diagnose(traces, cfg=None, model=None)``: read the profiler traces of a job's ranks, measure its
steps, attribute its collectives to buckets, and propose the change that removes the most exposed communication.

Stages, one module each: ``read`` (stream each file) → ``ranks`` (do the files belong together) → ``steps`` (per
rank and step) → ``attribute`` (buckets) → ``ranks`` again (divergence, arrival skew) → ``propose`` (replay
changes) → ``rewrite`` (the proposed config) → ``result``.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from overlapcfg.config import OverlapConfig, load_config
from overlapcfg.config.load import ConfigSource
from overlapcfg.diagnosis.attribute import OTHER, attribute, bucket_bytes
from overlapcfg.diagnosis.diagnosis_result import BucketRow, DiagnoseResult, Proposal, RankStepRow
from overlapcfg.diagnosis.propose import Candidate, fit_durations, predicted, program, step_candidates
from overlapcfg.diagnosis.ranks import arrivals, check_together, first_mismatch, offsets, peer_waits, rank_numbers
from overlapcfg.diagnosis.read import HEADER, RankTrace, read_trace, trace_error
from overlapcfg.diagnosis.rewrite import proposed_config
from overlapcfg.diagnosis.steps import RankAnalysis, analyze_rank
from overlapcfg.errors import Fault, OverlapConfigError
from overlapcfg.report.labels import KIND_LABELS, fmt_seconds

__all__ = ["diagnose", "read_all", "trace_files"]

log = logging.getLogger(__name__)

_SUFFIXES = (".json", ".json.gz")
SHOWN_SKEWS = 20
MIN_IQR_STEPS = 8
"""Profiled steps from which the spread is half their interquartile range; fewer, and a quartile is one step or an
interpolation between two, so half the range is used, and a note says so."""


def trace_files(traces: str | Path | Sequence[str | Path]) -> list[Path]:
    """The trace files ``traces`` names: files as given, a directory's ``*.json`` / ``*.json.gz`` files."""
    given = [traces] if isinstance(traces, (str, Path)) else list(traces)
    out: list[Path] = []
    for item in given:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(_SUFFIXES))
            if not found:
                raise trace_error(path, "a directory with no trace files (*.json, *.json.gz) in it")
            out += found
        elif path.is_file():
            out.append(path)
        else:
            raise trace_error(path, "no such file or directory")
    if not out:
        raise OverlapConfigError([Fault("trace", "no trace files given")], header=HEADER)
    return out


def read_all(files: Sequence[Path]) -> list[RankTrace]:
    """Every file read, one after the other. Reading in forked processes (one per file) was measured no faster on
    a shared 2-core machine (a 2-rank 20-step trace: 14.9 s forked, 8.8 s and 14.5 s in one process, load about 8),
    and it forks a process holding torch; one process it is."""
    return [read_trace(f) for f in files]


def diagnose(traces: str | Path | Sequence[str | Path], cfg: ConfigSource | None = None, model: Any = None, *,
             memory_budget: int | None = None) -> DiagnoseResult:
    """Diagnose one profiling window of one job from its ranks' ``torch.profiler`` Chrome traces (one file per
    rank, JSON or gzip'd; a directory of them).

    ``cfg``: the overlap config the job ran with (anything ``load_config`` reads), so the proposal is that config
    with one change; without it, the proposal is written over the buckets the trace shows. ``model``: the job's
    model (an ``nn.Module``), to check the proposed config against its modules. ``memory_budget``: the most bytes a
    change may add (one more bucket in flight, a larger bucket, a bucket held); None: no limit (the table shows
    what each change adds).
    """
    started = time.perf_counter()
    files = trace_files(traces)
    base = load_config(cfg) if cfg is not None else None
    read = read_all(files)
    ranks = rank_numbers(read)
    shifts = offsets(read)
    notes: list[str] = []
    steps = check_together(read, shifts)
    world = next((t.world_size for t in read if t.world_size is not None), None)
    if len(read) == 1:
        notes.append(f"one rank only ({files[0].name}): no arrival skew or divergence can be read from one trace")
    elif world is not None and len(read) < world:
        missing = sorted(set(range(world)) - set(ranks))
        notes.append(f"traces of {len(read)} of {world} ranks (missing {', '.join(map(str, missing[:8]))}): "
                     "skew and divergence are among these only")
    if not steps:
        notes.append("no ProfilerStep#N marks: the whole trace is read as one step (call prof.step() every step)")
    analyses = sorted((analyze_rank(t, r, s) for t, r, s in zip(read, ranks, shifts, strict=True)),
                      key=lambda a: a.rank)
    if not any(s.collectives for a in analyses for s in a.steps):
        raise OverlapConfigError([Fault(str(f), "no collectives in its profiled steps") for f in files],
                                 header=f"{HEADER}: nothing to diagnose (was the job distributed, and did the "
                                        "profiler record its steps?)")
    modules, attribution_notes = attribute(analyses)
    notes += attribution_notes
    result = _assemble(files, analyses, steps, modules, base, model, memory_budget, world, notes)
    log.info("diagnose: %d traces, %d steps, %.2fs", len(files), len(steps), time.perf_counter() - started)
    return result


def _bucket_rows(analyses: Sequence[RankAnalysis], order: Sequence[str], modules: dict[str, tuple[str, ...]],
                 sizes: dict[str, int]) -> tuple[BucketRow, ...]:
    count = sum(len(a.steps) for a in analyses) or 1
    rows: dict[str, dict[str, Any]] = {}
    first = next((s for a in analyses for s in a.steps if s.collectives), None)
    for a in analyses:
        for s in a.steps:
            for c in s.collectives:
                name = c.bucket or ("not FSDP" if c.source == OTHER else "unattributed")
                row = rows.setdefault(name, {"comm": 0.0, "exposed": 0.0, "overlapped": 0.0, "peak": None,
                                             "source": c.source or "—"})
                row["comm"] += c.seconds
                row["exposed"] += c.exposed
                row["overlapped"] += c.overlapped
                if c.peak_memory is not None:
                    row["peak"] = max(row["peak"] or 0, c.peak_memory)
    kinds: dict[str, list[str]] = {}
    for c in first.collectives if first is not None else ():
        short = KIND_LABELS.get(c.kind, c.kind)
        kinds.setdefault(c.bucket or ("not FSDP" if c.source == OTHER else "unattributed"), []).append(
            f"{short} {'fw' if c.direction == 'forward' else 'bw'}" if c.kind == "all_gather" else short)
    names = [*(b for b in order if b in rows), *(b for b in rows if b not in order)]
    return tuple(BucketRow(bucket=b, modules=modules.get(b, ()), kinds=", ".join(kinds.get(b, [])),
                           bytes=sizes.get(b), comm_s=rows[b]["comm"] / count, exposed_s=rows[b]["exposed"] / count,
                           overlapped_s=rows[b]["overlapped"] / count, peak_memory=rows[b]["peak"],
                           source=rows[b]["source"]) for b in names)


def _forward_order(analyses: Sequence[RankAnalysis]) -> list[str]:
    for a in analyses:
        for s in a.steps:
            seen = [c.bucket for c in s.collectives
                    if c.bucket and c.kind == "all_gather" and c.direction != "backward"]
            seen += [c.bucket for c in s.collectives if c.bucket]
            if seen:
                return list(dict.fromkeys(seen))
    return []


def _assemble(files: list[Path], analyses: list[RankAnalysis], steps: list[int], modules: dict[str, tuple[str, ...]],
              base: OverlapConfig | None, model: Any, memory_budget: int | None, world: int | None,
              notes: list[str]) -> DiagnoseResult:
    by_step: dict[int, list[float]] = {}
    for a in analyses:
        for s in a.steps:
            by_step.setdefault(s.step, []).append(s.seconds)
    slowest = [max(v) for _, v in sorted(by_step.items())]
    measured = statistics.median(slowest)
    noise, few = _spread(slowest)
    if few is not None:
        notes.append(few)
    divergence = tuple(first_mismatch(analyses)) if len(analyses) > 1 else ()
    found = sorted(arrivals(analyses), key=lambda x: -x.skew_s)
    late: dict[int, float] = {}
    for x in found:
        late[x.last_rank] = late.get(x.last_rank, 0.0) + x.skew_s
    slowest_rank = max(late, key=lambda r: late[r]) if late and max(late.values()) / max(len(steps), 1) > noise \
        else None
    order = _forward_order(analyses)
    sizes = bucket_bytes(analyses)
    collectives = [c for a in analyses for s in a.steps for c in s.collectives]
    labelled = any(c.source == "fsdp2 label" for c in collectives)
    waited = peer_waits(analyses) if not divergence else {}
    programs = [[program(s, waited) for s in a.steps] for a in analyses]
    fits = fit_durations([p for steps in programs for p in steps])
    replayed, _ = predicted(programs, None)
    proposals: list[tuple[Proposal, Candidate]] = []
    if not divergence:
        for cand in step_candidates(analyses, order, sizes, modules, fits, labelled_fsdp2=labelled):
            fits_budget = memory_budget is None or cand.extra_bytes <= memory_budget
            if cand.blocked is not None:
                proposals.append((Proposal(name=cand.name, change=cand.change, predicted_step_s=replayed, gain_s=0.0,
                                           extra_bytes=cand.extra_bytes, fits_budget=fits_budget,
                                           reason=cand.blocked), cand))
                continue
            step_s, gains = predicted(programs, cand)
            log.debug("%s: gains per rank and step %s", cand.name, [round(g * 1e3, 2) for g in gains])
            proposals.append((Proposal(name=cand.name, change=cand.change, predicted_step_s=step_s,
                                       gain_s=replayed - step_s, extra_bytes=cand.extra_bytes,
                                       fits_budget=fits_budget), cand))
    proposals.sort(key=lambda pc: (-pc[0].gain_s, pc[0].extra_bytes))
    usable = [pc for pc in proposals if pc[0].fits_budget and pc[0].reason is None]
    chosen, config = None, None
    if divergence:
        verdict = "the ranks issued different collectives: give every rank the same config first"
    elif len(slowest) < 2:
        top = usable[0][0] if usable else None
        verdict = ("one profiled step: no spread to judge a gain against, so nothing is proposed"
                   + (f" (the best change, {top.name}, would gain {fmt_seconds(max(top.gain_s, 0.0))})"
                      if top is not None else "")
                   + f"; profile {MIN_IQR_STEPS} or more steps (torch.profiler.schedule(active=...))")
    elif usable and usable[0][0].gain_s > max(noise, 0.0):
        chosen = usable[0][0]
        made = proposed_config(base, order, modules, usable[0][1])
        if model is not None:
            _check_against(made, model)
        config = made.model_dump(mode="json", exclude_none=True)
        verdict = (f"{chosen.name}: predicted step {fmt_seconds(chosen.predicted_step_s)} from "
                   f"{fmt_seconds(replayed)} replayed (gain {fmt_seconds(chosen.gain_s)}, measured spread "
                   f"±{fmt_seconds(noise)})")
    else:
        best = usable[0][0].gain_s if usable else 0.0
        verdict = (f"nothing to gain beyond the measured noise: the best change gains {fmt_seconds(max(best, 0.0))} "
                   f"against a spread of ±{fmt_seconds(noise)}")
    if any(a.blocking for a in analyses):
        notes.append("collectives block the thread that issues them (eager FSDP2 on gloo: the issuing thread waits "
                     "for the whole collective, and no compute runs beside it), so a collective issued earlier only "
                     "blocks earlier: deeper prefetch cannot hide anything here (on GPUs NCCL runs collectives on "
                     "their own streams). Fewer, larger collectives (merged buckets) and fewer all-gathers "
                     "(reshard_after_forward: false) can still save time")
    pictured = _pictured_step(analyses, by_step)
    return DiagnoseResult(
        files=tuple(str(f) for f in files), ranks=tuple(a.rank for a in analyses), world_size=world,
        device="cuda" if any(a.cuda for a in analyses) else "cpu", backend=analyses[0].trace.backend,
        steps=tuple(steps), divergence=divergence,
        rank_steps=tuple(RankStepRow(rank=s.rank, step=s.step, step_s=s.seconds, compute_s=s.compute, comm_s=s.comm,
                                     exposed_s=s.exposed, idle_s=s.idle, collectives=len(s.collectives))
                         for a in analyses for s in a.steps),
        buckets=_bucket_rows(analyses, order, modules, sizes), collectives=len(collectives),
        unattributed=sum(1 for c in collectives if c.bucket is None and c.source != OTHER),
        other=sum(1 for c in collectives if c.source == OTHER),
        skew=tuple(found[:SHOWN_SKEWS]),
        slowest_rank=slowest_rank, blocking=any(a.blocking for a in analyses), measured_step_s=measured,
        noise_s=noise, replayed_step_s=replayed, memory_budget=memory_budget, proposal=chosen, verdict=verdict,
        candidates=tuple(p for p, _ in proposals), config=config, notes=tuple(notes),
    ).with_picture(pictured)


def _spread(times: Sequence[float]) -> tuple[float, str | None]:
    """The noise a predicted gain must exceed, from the steps' times (slowest rank), and a note where the steps are
    too few for a sound one. From ``MIN_IQR_STEPS`` steps: half the interquartile range (on a shared machine one
    step in several can take a multiple of the others, and half the range would be that one step's); fewer: half
    the range, the larger and the safer; one step: none (nothing is proposed)."""
    n = len(times)
    if n < 2:
        return 0.0, (f"one profiled step: no spread to judge a gain against; profile {MIN_IQR_STEPS} or more steps")
    if n < MIN_IQR_STEPS:
        return (max(times) - min(times)) / 2, (f"{n} profiled steps: the spread is half their range (from "
                                               f"{MIN_IQR_STEPS} steps, half the interquartile range: profile "
                                               "more steps for a sounder one)")
    q = statistics.quantiles(times, n=4)
    return (q[2] - q[0]) / 2, None


def _pictured_step(analyses: Sequence[RankAnalysis], by_step: dict[int, list[float]]) -> tuple[Any, ...]:
    """Every rank's step whose slowest rank took the median time."""
    ranked = sorted(by_step, key=lambda n: max(by_step[n]))
    if not ranked:
        return ()
    n = ranked[len(ranked) // 2]
    return tuple(s for a in analyses for s in a.steps if s.step == n)


def _check_against(cfg: OverlapConfig, model: Any) -> None:
    """The proposed config's plan resolved against ``model``: a proposal that does not fit is a bug, said so."""
    from overlapcfg.module_paths import ModelFacts
    from overlapcfg.resolve import resolve_config

    resolve_config(cfg, ModelFacts.of(model), coverage=False)
