"""The smallest config change that removes the most exposed communication, predicted by replaying the step the
trace measured with that change made.

**The replay** (``overlapcfg.cost.replay.Streams``, the simulator's and the tuner's event semantics): each rank's
step becomes what its issuing thread did, in the trace's own time: compute work between points, a collective
issued at the time its issue op started, and waited for where the thread first stalled on it (``need``; at its end
where it never stalled), each collective taking the seconds it took. Work between two points is the time between
them less the stalls in it, so replaying the step unchanged gives back its measured time (the report shows both).
A change moves or merges collectives in that program; the same replay prices it:

- **depth +1** (``forward_prefetch``, ``backward_prefetch``, ``reduce_scatter_delay``): every all-gather of the
  direction is issued where the one before it was; every reduce-scatter is waited where the next one was;
- **merge** buckets (pairs in forward order, or every bucket under one parent module): the collectives of one
  direction and kind of a merged bucket become one, issued at the first issue, waited at the first wait, taking
  ``latency + bytes / bandwidth`` of a line fitted through the trace's own collectives of that kind; with eager
  FSDP2 a merged group also runs its hooks once (the time its ``FSDP::`` labels took, less the communication in
  them, saved for all members but the costliest);
- **reshard_after_forward: false** for one bucket (eager FSDP2): its backward all-gather is gone, its unsharded
  bytes are held from forward to backward.

Where collectives block the thread that issues them (eager FSDP2 on gloo: ``overlapcfg.diagnosis.steps``), a deeper
prefetch moves the block, never removes it: depth changes are listed with no gain and that reason, and only fewer
collectives (merges) or fewer all-gathers (``reshard_after_forward``) can help. Not proposed: splitting a bucket (a
trace does not say how a bucket's bytes divide among its modules).

**The choice**: the change with the largest predicted gain whose extra memory (one more bucket in flight, a larger
merged bucket, a bucket held) fits ``memory_budget``; if that gain is within the measured spread of the step time,
"nothing to gain beyond the measured noise".
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from overlapcfg.cost.replay import Streams
from overlapcfg.diagnosis.intervals import Cover
from overlapcfg.diagnosis.steps import RankAnalysis, RankStep
from overlapcfg.resolve.names import bucket_name

__all__ = ["Candidate", "Unit", "fit_durations", "program", "replay", "step_candidates"]


@dataclass(frozen=True, slots=True)
class Unit:
    """One collective of a step as the replay sees it (seconds from the step's start)."""

    token: int
    kind: str
    direction: str
    bucket: str | None
    nbytes: int
    seconds: float
    issue: float
    need: float
    lane: str = "comm"
    """The stream it runs on: the gloo worker thread or GPU stream it ran on (gloo runs two at once)."""
    waiting: float = 0.0
    """Of ``seconds``, the time it moved no bytes: from when it could have started (issued, and its lane free) to
    when it started, and then until the last rank had joined it (``ranks.peer_waits``). The rest is transfer."""


@dataclass(frozen=True, slots=True)
class Program:
    """One rank's step: its collectives, the stalls the trace measured (for the work between points), and what
    each FSDP2 group's hooks cost (by bucket)."""

    length: float
    units: tuple[Unit, ...]
    stalls: Cover
    hooks: dict[str, float]


def program(step: RankStep, peer_waits: dict[tuple[int, int, int], float] | None = None) -> Program:
    """``step`` as the replay sees it; ``peer_waits``: ``ranks.peer_waits`` of the job (how long each collective
    waited for the last rank to join it).

    A collective's seconds run from when it could have started (issued, and the one before it on its lane done) to
    its end, so that replaying the step unchanged gives back when each collective ended: a gloo worker that starts
    a collective late (its thread not scheduled on a busy machine) is part of what that collective costs."""
    a = step.start
    units = []
    stalls = []
    waited = peer_waits or {}
    free: dict[str, float] = {}
    ready: dict[int, float] = {}
    for i in sorted(range(len(step.collectives)), key=lambda i: step.collectives[i].start):
        c = step.collectives[i]
        ready[i] = min(c.start, max(c.issued, free.get(c.lane, a)))
        free[c.lane] = max(free.get(c.lane, a), c.end)
    for i, c in enumerate(step.collectives):
        nbytes = c.nbytes or 0
        peer = min(waited.get((c.rank, c.step, c.index), 0.0), (c.end - c.start) / 1e6)
        units.append(Unit(token=i, kind=c.kind, direction=c.direction, bucket=c.bucket, nbytes=nbytes,
                          seconds=(c.end - ready[i]) / 1e6, issue=(c.issued - a) / 1e6, need=(c.need - a) / 1e6,
                          lane=c.lane or "comm", waiting=(c.start - ready[i]) / 1e6 + peer))
        if c.end > c.need:
            stalls.append(((c.need - a) / 1e6, (c.end - a) / 1e6))
    hooks = {bucket_name(m): seconds for m, seconds in step.hooks.items()}
    return Program(length=(step.end - step.start) / 1e6, units=tuple(units), stalls=Cover(stalls), hooks=hooks)


def replay(prog: Program, units: Sequence[Unit] | None = None, saved: float = 0.0) -> float:
    """The step's seconds with ``units`` (default: as measured) on the measured work, less ``saved`` seconds of
    work (hooks a merged FSDP2 group no longer runs)."""
    units = prog.units if units is None else units
    points = sorted([(u.issue, 0, u.token) for u in units] + [(u.need, 1, u.token) for u in units])
    by_token = {u.token: u for u in units}
    streams = Streams()
    t = 0.0
    for when, what, token in points:
        at = min(max(when, 0.0), prog.length)
        if at > t:
            streams.run((at - t) - prog.stalls.covered(t, at))
            t = at
        if what == 0:
            streams.issue(token, by_token[token].lane, by_token[token].seconds)
        else:
            streams.wait(token)
    if prog.length > t:
        streams.run(max(0.0, (prog.length - t) - prog.stalls.covered(t, prog.length) - saved))
    return streams.end_graph()


def fit_durations(programs: Sequence[Program]) -> dict[str, tuple[float, float]]:
    """Per kind, ``(latency s, s per byte)`` of the **transfer**: a line through the median transfer time (a
    collective's time less the time it moved no bytes, ``Unit.waiting``) of each size the trace's own collectives
    of that kind have. Without the split, the waits for a late rank (milliseconds on a loaded machine, whatever the
    size) fit as a latency, and a merge seems to save one such latency per collective merged away: the peers arrive
    no earlier for it. Sizes less than 2x apart cannot tell latency from bandwidth: then no latency, the median
    rate."""
    out: dict[str, tuple[float, float]] = {}
    for kind in sorted({u.kind for p in programs for u in p.units}):
        by_size: dict[int, list[float]] = {}
        for p in programs:
            for u in p.units:
                if u.kind == kind and u.nbytes > 0:
                    by_size.setdefault(u.nbytes, []).append(u.seconds - u.waiting)
        if not by_size:
            continue
        sizes = sorted(by_size)
        x = np.array(sizes, dtype=float)
        y = np.array([statistics.median(by_size[n]) for n in sizes], dtype=float)
        rate = float(np.median(y / x))
        if x[-1] < 2 * x[0]:
            out[kind] = (0.0, rate)
            continue
        slope, intercept = np.polyfit(x, y, 1)
        if slope <= 0:
            out[kind] = (float(np.median(y)), 0.0)
        elif intercept < 0:
            out[kind] = (0.0, float((x * y).sum() / (x * x).sum()))
        else:
            out[kind] = (float(intercept), float(slope))
    return out


Transform = Callable[[Program], list[Unit]]
Saving = Callable[[Program], float]


@dataclass(frozen=True, slots=True)
class Candidate:
    """One change: what it is (its config key), the units it makes of a step, the memory it adds."""

    name: str
    """``forward_prefetch +1``, ``merge pairs``, ``reshard_after_forward false for model.layers.0``."""
    change: str
    """``depth``, ``merge`` or ``reshard``."""
    transform: Transform
    extra_bytes: int
    saving: Saving | None = None
    """Work the change removes from the step (the hooks of FSDP2 groups merged away)."""
    field: str | None = None
    """The depth field (``depth``)."""
    groups: tuple[tuple[str, ...], ...] = ()
    """The buckets merged into each new bucket, forward order (``merge``)."""
    bucket: str | None = None
    """The bucket (``reshard``)."""
    blocked: str | None = None
    """Why the change cannot help here (it is then not replayed)."""


def _earlier_issue(kind: str, direction: str) -> Transform:
    def run(prog: Program) -> list[Unit]:
        mine = sorted((u for u in prog.units if u.kind == kind and u.direction == direction), key=lambda u: u.issue)
        moved = {b.token: replace(b, issue=min(b.issue, a.issue)) for a, b in itertools.pairwise(mine)}
        return [moved.get(u.token, u) for u in prog.units]
    return run


def _later_wait(kinds: tuple[str, ...]) -> Transform:
    def run(prog: Program) -> list[Unit]:
        mine = sorted((u for u in prog.units if u.kind in kinds and u.direction == "backward"), key=lambda u: u.need)
        moved = {a.token: replace(a, need=max(a.need, b.need)) for a, b in itertools.pairwise(mine)}
        return [moved.get(u.token, u) for u in prog.units]
    return run


def _merged(groups: dict[str, str], fits: dict[str, tuple[float, float]], blocking: bool) -> Transform:
    def run(prog: Program) -> list[Unit]:
        out: list[Unit] = []
        merged: dict[tuple[str, str, str], list[Unit]] = {}
        for u in prog.units:
            group = groups.get(u.bucket) if u.bucket is not None else None
            if group is None:
                out.append(u)
            else:
                merged.setdefault((u.direction, u.kind, group), []).append(u)
        for (_, kind, _), members in merged.items():
            if len(members) == 1:
                out.append(members[0])
                continue
            first = min(members, key=lambda u: u.issue)
            nbytes = sum(u.nbytes for u in members)
            latency, per_byte = fits.get(kind, (0.0, 0.0))
            # the merged collective is joined when the first member was: the same wait for the last rank
            seconds = first.waiting + latency + per_byte * nbytes if kind in fits \
                else sum(u.seconds for u in members)
            need = first.issue if blocking else min(u.need for u in members)
            out.append(replace(first, nbytes=nbytes, seconds=seconds, need=need,
                               waiting=first.waiting if kind in fits else sum(u.waiting for u in members)))
        return out
    return run


def _hooks_saved(groups: Sequence[Sequence[str]]) -> Saving:
    """A merged FSDP2 group runs its hooks once: the step saves all but the costliest member's."""
    def run(prog: Program) -> float:
        saved = 0.0
        for group in groups:
            costs = [prog.hooks.get(b, 0.0) for b in group]
            saved += sum(costs) - max(costs, default=0.0)
        return saved
    return run


def _without_backward_gather(bucket: str) -> Transform:
    def run(prog: Program) -> list[Unit]:
        return [u for u in prog.units if not (u.bucket == bucket and u.kind == "all_gather"
                                              and u.direction == "backward")]
    return run


RESHARD_CANDIDATES = 3
"""``reshard_after_forward: false`` is replayed for the buckets whose backward all-gathers were exposed longest."""


def _parent(module: str, levels: int) -> str:
    parts = module.split(".")
    return ".".join(parts[:max(1, len(parts) - levels)])


def step_candidates(analyses: Sequence[RankAnalysis], order: Sequence[str], sizes: dict[str, int],
                    modules: dict[str, tuple[str, ...]], fits: dict[str, tuple[float, float]], *,
                    labelled_fsdp2: bool) -> list[Candidate]:
    """Every change worth replaying for this trace. ``order``: buckets in forward order; ``sizes``: their
    all-gather bytes; ``labelled_fsdp2``: the buckets come from FSDP2's labels (``reshard_after_forward`` is an
    FSDP2 setting; on compiled aot graphs it is ignored)."""
    blocking = any(a.blocking for a in analyses)
    kinds = {(c.kind, c.direction) for a in analyses for s in a.steps for c in s.collectives if c.bucket}
    largest = max(sizes.values(), default=0)
    why = "no gain: collectives block their thread (see note)" if blocking else None
    out = []
    for field, kind, direction in (("forward_prefetch", "all_gather", "forward"),
                                   ("backward_prefetch", "all_gather", "backward")):
        if (kind, direction) in kinds:
            out.append(Candidate(f"{field} +1", "depth", _earlier_issue(kind, direction), largest, field=field,
                                 blocked=why))
    if ("reduce_scatter", "backward") in kinds or ("all_reduce", "backward") in kinds:
        out.append(Candidate("reduce_scatter_delay +1", "depth", _later_wait(("reduce_scatter", "all_reduce")),
                             largest, field="reduce_scatter_delay", blocked=why))
    named = [b for b in order if b in modules]
    groupings: list[tuple[str, list[list[str]]]] = [
        ("merge pairs of buckets", [named[i:i + 2] for i in range(0, len(named), 2)])]
    for levels in (1, 2):
        parents: dict[str, list[str]] = {}
        for b in named:
            key = ",".join(sorted({_parent(m, levels) for m in modules[b]}))
            parents.setdefault(key, []).append(b)
        groupings.append((f"merge the buckets under each {'parent' if levels == 1 else 'grandparent'} module",
                          list(parents.values())))
    seen: set[tuple[tuple[str, ...], ...]] = set()
    for name, groups in groupings:
        grouping = tuple(tuple(g) for g in groups)
        if all(len(g) == 1 for g in groups) or grouping in seen:
            continue
        seen.add(grouping)
        mapping = {b: g[0] for g in groups for b in g}
        extra = max(sum(sizes.get(b, 0) for b in g) for g in groups) - largest
        out.append(Candidate(name, "merge", _merged(mapping, fits, blocking), max(0, extra), groups=grouping,
                             saving=_hooks_saved(grouping) if labelled_fsdp2 else None))
    if labelled_fsdp2 and ("all_gather", "backward") in kinds:
        exposed: dict[str, float] = {}
        for a in analyses:
            for s in a.steps:
                for c in s.collectives:
                    if c.bucket and c.kind == "all_gather" and c.direction == "backward":
                        exposed[c.bucket] = exposed.get(c.bucket, 0.0) + c.exposed
        for b in sorted(exposed, key=lambda b: -exposed[b])[:RESHARD_CANDIDATES]:
            out.append(Candidate(f"reshard_after_forward false for {b}", "reshard", _without_backward_gather(b),
                                 sizes.get(b, 0), bucket=b))
    return out


def predicted(programs: Sequence[Sequence[Program]], candidate: Candidate | None) -> tuple[float, list[float]]:
    """The job's predicted step (per rank the median over steps of the replay, the slowest rank), and the gain of
    ``candidate`` on every rank and step (against the unchanged replay). ``programs``: per rank, its steps'."""
    per_rank = []
    gains = []
    for steps in programs:
        times = []
        for prog in steps:
            base = replay(prog)
            if candidate is None:
                times.append(base)
                continue
            saved = candidate.saving(prog) if candidate.saving is not None else 0.0
            times.append(replay(prog, candidate.transform(prog), saved))
            gains.append(base - times[-1])
        if times:
            per_rank.append(statistics.median(times))
    return max(per_rank, default=0.0), gains
