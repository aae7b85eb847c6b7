"""Ranks against each other: whether the traces belong together, whether the ranks issued the same collectives,
and how long each collective waited for its last rank.

- **Together**: each file one rank, no rank twice, one world size, the same ``ProfilerStep`` numbers, and each
  step run at about the same time on every rank (``JOB_GAP_US``; two jobs' traces are not). Anything else is an
  ``OverlapConfigError`` naming the files, before any number is computed from them.
- **Divergence**: ranks of a job must issue the same collectives in the same order with the same sizes and
  dtypes; the first position where a rank's sequence differs from the lowest rank's is reported, per rank. Such a
  job hangs (or, on gloo, fails) on a real cluster, so it is said first.
- **Arrival skew**: the n-th collective of a step is issued on every rank; the time from the first rank's issue to
  the last one's is how long the first waited for the last (collectives complete together). Same host: one clock;
  other hosts: the traces' ``baseTimeNanoseconds`` align them, as well as the hosts' clocks agree.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from overlapcfg.diagnosis.diagnosis_result import Divergence, SkewRow
from overlapcfg.diagnosis.read import RankTrace, trace_error
from overlapcfg.diagnosis.steps import Collective, RankAnalysis, step_windows
from overlapcfg.diagnosis.trace_events import canonical_dtype
from overlapcfg.errors import Fault, OverlapConfigError

__all__ = ["arrivals", "check_together", "first_mismatch", "peer_waits", "rank_numbers"]


def rank_numbers(traces: Sequence[RankTrace]) -> list[int]:
    """Each trace's rank (its ``distributedInfo``, else a ``rank<N>`` in its file name, else its position), with
    the faults of duplicated ranks or disagreeing world sizes raised at once."""
    faults: list[Fault] = []
    ranks: list[int] = []
    seen: dict[int, str] = {}
    for i, t in enumerate(traces):
        rank = t.rank if t.rank is not None else i
        if rank in seen:
            faults.append(Fault(str(t.path), f"rank {rank} again (also {seen[rank]}): one trace per rank, of one job"))
        seen[rank] = t.name
        ranks.append(rank)
    sizes = {t.world_size for t in traces if t.world_size is not None}
    if len(sizes) > 1:
        faults.append(Fault(", ".join(t.name for t in traces),
                            f"world sizes differ ({', '.join(map(str, sorted(sizes)))}): traces of different jobs"))
    if faults:
        raise OverlapConfigError(faults, header="cannot diagnose these traces")
    return ranks


def offsets(traces: Sequence[RankTrace]) -> list[float]:
    """Microseconds to add to each trace's times to put them on the first trace's clock."""
    base = traces[0].base_ns
    return [(t.base_ns - base) / 1e3 if t.base_ns and base else 0.0 for t in traces]


def check_together(traces: Sequence[RankTrace], shifts: Sequence[float]) -> list[int]:
    """The step numbers every trace profiled; an error where they differ or do not overlap in time."""
    numbered = [{n: (a + s, b + s) for n, a, b in step_windows(t)} for t, s in zip(traces, shifts, strict=True)]
    sets = [set(w) for w in numbered]
    if any(s != sets[0] for s in sets[1:]):
        shown = "; ".join(f"{t.name}: {_steps_text(s)}" for t, s in zip(traces, sets, strict=True))
        raise trace_error(", ".join(t.name for t in traces),
                          f"the traces profiled different steps ({shown}): traces of different steps or jobs mixed; "
                          "give the files of one profiling window of one job")
    for n in sorted(sets[0]):
        windows = [w[n] for w in numbered]
        apart = max(a for a, _ in windows) - min(b for _, b in windows)
        if apart > max(JOB_GAP_US, 2 * max(b - a for a, b in windows)):
            raise trace_error(", ".join(t.name for t in traces),
                              f"step {n} does not overlap in time across the traces ({apart / 1e6:.1f} s apart): "
                              "traces of different jobs (or runs) mixed")
    return sorted(sets[0])


JOB_GAP_US = 1e6
"""Ranks of one job run a step within its skew of each other; a step this far apart (or twice its length, whichever
is more) on two traces is two jobs' (or runs')."""


def _steps_text(steps: set[int]) -> str:
    return ", ".join(map(str, sorted(steps))) if steps else "no ProfilerStep marks"


def _describe(c: Collective) -> str:
    size = f"{c.numel:,} x {c.dtype}" if c.numel is not None else "size unknown"
    where = f" ({c.bucket})" if c.bucket else ""
    return f"{c.kind} of {size}{where}, step {c.step}"


def _same(a: Collective, b: Collective) -> bool:
    """Same kind, and the same size and dtype where both traces know them."""
    da, db = canonical_dtype(a.dtype), canonical_dtype(b.dtype)
    return a.kind == b.kind and (a.numel is None or b.numel is None or a.numel == b.numel) and \
        (da is None or db is None or da == db)


def first_mismatch(analyses: Sequence[RankAnalysis]) -> list[Divergence]:
    """Per rank that disagrees with the lowest rank: the first collective that differs (kind, size, dtype), or the
    first one past the shorter of the two sequences."""
    ordered = sorted(analyses, key=lambda a: a.rank)
    ref = ordered[0]
    ref_seq = [c for s in ref.steps for c in s.collectives]
    out = []
    for other in ordered[1:]:
        seq = [c for s in other.steps for c in s.collectives]
        for i in range(max(len(seq), len(ref_seq))):
            a = ref_seq[i] if i < len(ref_seq) else None
            b = seq[i] if i < len(seq) else None
            if a is not None and b is not None and _same(a, b):
                continue
            either = b if b is not None else a
            out.append(Divergence(rank=other.rank, reference=ref.rank, position=i, file=other.trace.name,
                                step=either.step if either is not None else None,
                                expected=_describe(a) if a is not None else "nothing (its sequence ended)",
                                found=_describe(b) if b is not None else "nothing (its sequence ended)"))
            break
    return out


def _common(analyses: Sequence[RankAnalysis]) -> Iterator[tuple[int, int, list[Collective]]]:
    """``(step, index, the n-th collective of every rank)`` of every common step, while the ranks' sequences
    agree."""
    steps = [{s.step: s for s in a.steps} for a in analyses]
    for n in sorted(set.intersection(*(set(s) for s in steps))):
        lists = [s[n].collectives for s in steps]
        for i in range(min(len(c) for c in lists)):
            row = [c[i] for c in lists]
            if not all(_same(row[0], c) for c in row[1:]):
                break
            yield n, i, row


def arrivals(analyses: Sequence[RankAnalysis]) -> list[SkewRow]:
    """Arrival skew of every collective of every common step, while the ranks' sequences agree."""
    if len(analyses) < 2:
        return []
    out = []
    for n, i, row in _common(analyses):
        times = [c.issued for c in row]
        last = max(range(len(row)), key=lambda r: times[r])
        out.append(SkewRow(step=n, index=i, kind=row[0].kind, bucket=row[0].bucket,
                           skew_s=(max(times) - min(times)) / 1e6, last_rank=analyses[last].rank))
    return out


def peer_waits(analyses: Sequence[RankAnalysis]) -> dict[tuple[int, int, int], float]:
    """``(rank, step, index) -> seconds`` a collective ran on that rank before the last rank's started too: time
    spent waiting for a peer, not moving bytes (a collective moves nothing until every rank is in it). The rest of
    its time is its transfer. Empty for one rank (no peer to tell the two apart)."""
    out: dict[tuple[int, int, int], float] = {}
    if len(analyses) < 2:
        return out
    for n, i, row in _common(analyses):
        last = max(c.start for c in row)
        for c in row:
            out[(c.rank, n, i)] = max(0.0, min(last, c.end) - c.start) / 1e6
    return out
