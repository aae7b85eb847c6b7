"""One rank's trace, step by step: compute, communication, exposed communication and idle time, and each
collective with when it was issued, ran and was needed, and the bucket its issuing context names.

Definitions (one rule for every route and device, the one Holistic Trace Analysis uses for GPUs):

- **compute** is the union of the time kernels run: on a GPU the compute kernels and copies of every stream; on a
  CPU the *leaf* ops of the threads that are not communication threads (an op with no op inside it, that is not a
  collective's issue or wait, nor inside one). Leaves, not the ops around them: eager FSDP2 on gloo blocks inside
  its labels and autograd's ops with no op running, and an outer op would count that as compute;
- **communication** is the union of the time collectives run: gloo's events on its worker threads, NCCL's kernels
  on their streams;
- **exposed** is communication no compute covers; **idle** is the step's time neither covers.

A collective's issue is the op that called it on a compute thread, matched to the collective first in, first out
(a process group runs them in issue order; gloo) or by the CUDA correlation id of its kernel's launch (NCCL). Its
bucket comes from what the issuing thread was inside: an FSDP2 label (``FSDP::all_gather (model.layers.0)``) or the
region of a graph ``overlapcfg.backend`` compiled (``overlapcfg.diagnosis.attribute`` reads the rest).

When the issuing thread **needed** a collective (where it first stalled on it; what a replay of the step moves):

- eager FSDP2 on gloo blocks in the issue itself: at its issue;
- on a CPU where the thread waits in ops (``_c10d_functional::wait_tensor``, ``c10d::wait``: compiled graphs, code
  with ``async_op=True``): where the first wait op on the issuing thread that had not returned when the collective
  ended started (a wait that returned earlier waited for something else). None that late in the step: the thread
  never waited for it while it ran. Not the gaps in compute: on a CPU the C++ kernels inductor generates are no
  profiler ops, so a compiled graph's compute is mostly unseen and a gap is no stall (measured on a 2-layer Llama
  at depth 2: 3.5 ms of ops and 9.5 ms in wait ops in a 51 ms step, while its collectives ran 34 ms);
- on a GPU (every kernel recorded): the start of the last gap in compute before the collective ended.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from overlapcfg.diagnosis.intervals import Cover
from overlapcfg.diagnosis.read import OP_COMPUTE, OP_WAIT, Comm, Issue, RankTrace, Span
from overlapcfg.diagnosis.trace_events import GRAPH_REGION, STEP_MARK, dtype_bytes, fsdp_label

__all__ = ["Collective", "RankAnalysis", "RankStep", "analyze_rank", "step_windows"]

_BACKWARD_LABELS = frozenset({"pre_backward", "backward_prefetch for", "post_backward_reduce", "post_backward_rs_wait",
                              "post_backward_reshard", "post_backward_accumulate"})
_FORWARD_LABELS = frozenset({"pre_forward", "forward_prefetch for", "post_forward"})
WAIT_RETURN_US = 20.0
"""A wait op that returned this many microseconds before a collective's recorded end may still have waited for it
(the worker closes its profiler range after it has marked the collective complete)."""
BLOCKING_OVERLAP = 0.1
"""A rank whose collectives had less than this share of their time covered by compute, with FSDP2's labels on a
CPU, is eager FSDP2 on gloo: the issuing thread blocks for the whole collective (NOTES, "Profiler traces on CPU")."""


@dataclass(slots=True)
class Collective:
    """One collective on one rank in one step. Times in microseconds on rank 0's clock."""

    rank: int
    step: int
    index: int
    """Issue order within the step on this rank."""
    kind: str
    numel: int | None
    dtype: str | None
    issued: float
    start: float
    end: float
    need: float
    """When the issuing thread first waited for it (``end`` where it never did)."""
    exposed: float
    overlapped: float
    direction: str = ""
    modules: tuple[str, ...] = ()
    """The bucket's modules, where an FSDP2 label names them."""
    region: str | None = None
    """The compiled graph's region it was issued in (``0/forward``), and its position there."""
    region_position: int | None = None
    group: str | None = None
    bucket: str | None = None
    source: str = ""
    """How the bucket was found: ``fsdp2 label``, ``overlapcfg record``, or empty (unattributed)."""
    peak_memory: int | None = None
    lane: str = ""
    """Where it ran: a gloo worker thread (``thread3``) or a GPU stream (``gpu0:13``)."""

    @property
    def nbytes(self) -> int | None:
        size = dtype_bytes(self.dtype) if self.dtype else None
        return self.numel * size if self.numel is not None and size is not None else None

    @property
    def seconds(self) -> float:
        return (self.end - self.start) / 1e6


@dataclass(slots=True)
class RankStep:
    """One step on one rank (seconds)."""

    rank: int
    step: int
    start: float
    end: float
    compute: float
    comm: float
    exposed: float
    idle: float
    collectives: list[Collective] = field(default_factory=list)
    compute_spans: list[tuple[float, float]] = field(default_factory=list)
    """Compute as a few segments (gaps under 1% of the step closed), for the picture."""
    hooks: dict[tuple[str, ...], float] = field(default_factory=dict)
    """Seconds the issuing thread spent in each FSDP2 group's own labels (``FSDP::pre_forward (...)``, outermost
    ones), less the communication inside them: the per-group cost of FSDP2's hooks, which a merged group pays once."""

    @property
    def seconds(self) -> float:
        return (self.end - self.start) / 1e6


@dataclass(slots=True)
class RankAnalysis:
    rank: int
    trace: RankTrace
    steps: list[RankStep]
    blocking: bool
    """Collectives block the issuing thread (eager FSDP2 on gloo): prefetch cannot overlap them."""
    cuda: bool


def _leaf_compute(trace: RankTrace, comm_threads: set[int]) -> np.ndarray:
    """Leaf ops that compute, on compute threads (see the module docstring), as ``(n, 2)`` start and end. Ops on
    one thread nest, so sorted by start (longest first), an op has an op inside it exactly when the next one starts
    before it ends; an op inside a collective's issue or wait starts within that op's span, after it."""
    ops = trace.ops
    start, end = np.frombuffer(ops.start, dtype=np.float64), np.frombuffer(ops.end, dtype=np.float64)
    thread = np.frombuffer(ops.thread, dtype=np.intc)
    code = np.frombuffer(ops.code, dtype=np.int8)
    out = [np.zeros((0, 2))]
    for t in np.unique(thread).tolist():
        if t in comm_threads:
            continue
        idx = np.flatnonzero(thread == t)
        order = idx[np.lexsort((-end[idx], start[idx]))]
        s, e, c = start[order], end[order], code[order]
        keep = c == OP_COMPUTE
        keep[:-1] &= ~(s[1:] < e[:-1])
        for j in np.flatnonzero(c != OP_COMPUTE).tolist():
            keep[j:int(np.searchsorted(s, e[j], "left"))] = False
        out.append(np.stack([s[keep], e[keep]], axis=1))
    return np.concatenate(out)


def _outer_issues(issues: Sequence[Issue]) -> list[Issue]:
    """Issues with those nested in another (a functional op and the ``c10d::`` op it calls) folded into the outer,
    which keeps the first known size, dtype and group."""
    out: list[Issue] = []
    last: dict[int, Issue] = {}
    for issue in sorted(issues, key=lambda i: (i.start, -i.end)):
        outer = last.get(issue.thread)
        if outer is not None and issue.start < outer.end and issue.end <= outer.end:
            outer.numel = outer.numel if outer.numel is not None else issue.numel
            outer.dtype = outer.dtype or issue.dtype
            outer.group = outer.group or issue.group
            continue
        last[issue.thread] = issue
        out.append(issue)
    return out


def _compatible(issue: str, running: str) -> bool:
    # gloo has no reduce-scatter of its own for FSDP2: it runs an all-reduce (NOTES)
    return issue == running or (issue == "reduce_scatter" and running == "all_reduce")


def _match_fifo(issues: list[Issue], comms: list[Comm]) -> dict[int, Issue]:
    """Comm index -> issue, first in first out, each issue started no later than its collective."""
    out: dict[int, Issue] = {}
    j = 0
    order = sorted(range(len(comms)), key=lambda k: comms[k].start)
    for k in order:
        c = comms[k]
        while j < len(issues) and not _compatible(issues[j].kind, c.kind) and issues[j].start <= c.start:
            j += 1
        if j < len(issues) and issues[j].start <= c.start + 1.0:
            out[k] = issues[j]
            j += 1
    return out


def _match_launch(trace: RankTrace, issues: list[Issue], comms: list[Comm]) -> dict[int, Issue]:
    """Comm index -> issue through the kernel's correlation id and the op around its launch."""
    launches = {trace.correlations[i]: i for i in range(len(trace.correlations))}
    by_thread: dict[int, list[Issue]] = {}
    for issue in issues:
        by_thread.setdefault(issue.thread, []).append(issue)
    starts = {t: [i.start for i in lst] for t, lst in by_thread.items()}
    out: dict[int, Issue] = {}
    for k, c in enumerate(comms):
        at = launches.get(c.correlation) if c.correlation is not None else None
        if at is None:
            continue
        t, thread = trace.launches.start[at], trace.launches.thread[at]
        lst = by_thread.get(thread, [])
        i = bisect_right(starts.get(thread, []), t) - 1
        if i >= 0 and lst[i].start <= t <= lst[i].end:
            out[k] = lst[i]
    return out


class _Labels:
    """Labels per thread, for "what was this thread inside at time t"."""

    def __init__(self, labels: Sequence[Span]) -> None:
        self.by_thread: dict[int, list[Span]] = {}
        for s in sorted(labels, key=lambda s: (s.start, -s.end)):
            self.by_thread.setdefault(s.thread, []).append(s)
        self.starts = {t: [s.start for s in lst] for t, lst in self.by_thread.items()}
        self.longest = {t: max((s.end - s.start for s in lst), default=0.0) for t, lst in self.by_thread.items()}

    def around(self, thread: int, t: float) -> list[Span]:
        """Labels containing ``t`` on ``thread``, outermost first (only those starting within the longest label's
        length before ``t`` can)."""
        lst = self.by_thread.get(thread, [])
        starts = self.starts.get(thread, [])
        lo = bisect_left(starts, t - self.longest.get(thread, 0.0))
        return [s for s in lst[lo:bisect_right(starts, t)] if s.end >= t]


class _Waits:
    """Wait ops per thread, by start, for "where did this thread first wait for a collective that ended at t"."""

    def __init__(self, trace: RankTrace) -> None:
        ops = trace.ops
        code = np.frombuffer(ops.code, dtype=np.int8)
        mine = np.flatnonzero(code == OP_WAIT)
        start = np.frombuffer(ops.start, dtype=np.float64)[mine]
        end = np.frombuffer(ops.end, dtype=np.float64)[mine]
        thread = np.frombuffer(ops.thread, dtype=np.intc)[mine]
        self.by_thread: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for t in np.unique(thread).tolist():
            sel = np.flatnonzero(thread == t)
            order = sel[np.argsort(start[sel], kind="stable")]
            self.by_thread[t] = (start[order], end[order])

    def need(self, thread: int, issued: float, ended: float, until: float) -> float | None:
        """Start of the first wait op on ``thread`` after ``issued`` (and before ``until``) still waiting when the
        collective ended at ``ended``; None where the thread has no wait ops (another rule applies)."""
        found = self.by_thread.get(thread)
        if found is None:
            return None
        starts, ends = found
        i = int(np.searchsorted(starts, issued, "left"))
        late = np.flatnonzero(ends[i:] >= ended - WAIT_RETURN_US)
        if len(late) and starts[i + int(late[0])] < until:
            return float(starts[i + int(late[0])])
        return max(ended, until)


def step_windows(trace: RankTrace) -> list[tuple[int, float, float]]:
    """``(N, start, end)`` of each ``ProfilerStep#N`` (the thread marking the most steps), in order."""
    counts: dict[int, int] = {}
    for s in trace.steps:
        counts[s.thread] = counts.get(s.thread, 0) + 1
    if not counts:
        return []
    main = max(counts, key=lambda t: counts[t])
    marks = sorted((s for s in trace.steps if s.thread == main), key=lambda s: s.start)
    out: list[tuple[int, float, float]] = []
    for s in marks:
        found = STEP_MARK.match(s.name)
        out.append((int(found.group(1)) if found else len(out), s.start, s.end))
    return out


def _hooks(labels: _Labels, comm: Cover, a: float, b: float) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = {}
    ends: dict[int, float] = {}
    spans = [s for thread, lst in labels.by_thread.items()
             for s in lst[bisect_left(labels.starts[thread], a):bisect_left(labels.starts[thread], b)]]
    for span in sorted(spans, key=lambda s: (s.thread, s.start, -s.end)):
        if span.start < ends.get(span.thread, float("-inf")):
            continue
        found = fsdp_label(span.name)
        if found is None or not found[1]:
            continue
        ends[span.thread] = span.end
        own = (span.end - span.start) - comm.covered(span.start, span.end)
        out[found[1]] = out.get(found[1], 0.0) + max(0.0, own) / 1e6
    return out


def _peak(memory: list[tuple[float, float]], times: list[float], a: float, b: float) -> int | None:
    i, j = bisect_right(times, a), bisect_right(times, b)
    if i == j:
        before = memory[i - 1][1] if i > 0 else None
        return int(before) if before is not None else None
    return int(max(m for _, m in memory[i:j]))


def _segments(spans: list[tuple[float, float]], a: float, b: float, close: float) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in spans:
        s, e = max(start, a), min(end, b)
        if e <= s:
            continue
        if out and s - out[-1][1] <= close:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def analyze_rank(trace: RankTrace, rank: int, offset: float = 0.0) -> RankAnalysis:
    """Steps and collectives of ``trace`` (rank ``rank``), times moved by ``offset`` microseconds onto the reference
    clock. A trace without ``ProfilerStep#N`` marks is one step, numbered 0."""
    cuda = trace.cuda
    comm_threads = {int(c.lane[len("thread"):]) for c in trace.comms if c.lane.startswith("thread")}
    comm_threads |= {t for t, name in trace.thread_names.items() if "gloo" in name.lower()}
    if cuda:
        compute_spans = np.stack([np.frombuffer(trace.kernels.start, dtype=np.float64),
                                  np.frombuffer(trace.kernels.end, dtype=np.float64)], axis=1)
    else:
        compute_spans = _leaf_compute(trace, comm_threads)
    compute = Cover(compute_spans)
    comm = Cover((c.start, c.end) for c in trace.comms)
    issues = _outer_issues(trace.issues)
    matched = _match_launch(trace, issues, trace.comms) if cuda else {}
    fifo = _match_fifo(issues, [c for k, c in enumerate(trace.comms) if k not in matched])
    rest = [k for k in range(len(trace.comms)) if k not in matched]
    matched.update({rest[i]: issue for i, issue in fifo.items()})
    labels = _Labels(trace.labels)
    waits = _Waits(trace) if not cuda else None
    memory = sorted(zip(trace.memory[0::2], trace.memory[1::2], strict=True))
    memory_times = [t for t, _ in memory]
    windows = step_windows(trace)
    if not windows:
        first = min([*compute.starts[:1].tolist(), *comm.starts[:1].tolist()], default=0.0)
        windows = [(0, first, max([*compute.ends[-1:].tolist(), *comm.ends[-1:].tolist()], default=first))]
    if cuda:  # device work of a step may run past its CPU span: up to the next step's start
        last = float(comm.ends[-1]) if len(comm.ends) else None
        windows = [(n, a, windows[i + 1][1] if i + 1 < len(windows) else max(b, last if last is not None else b))
                   for i, (n, a, b) in enumerate(windows)]
    overlapped_total = sum(compute.covered(c.start, c.end) for c in trace.comms)
    comm_total = sum(c.end - c.start for c in trace.comms)
    blocking = (not cuda and any(fsdp_label(s.name) for s in trace.labels) and comm_total > 0
                and overlapped_total / comm_total < BLOCKING_OVERLAP)
    steps = []
    order = sorted(range(len(trace.comms)), key=lambda k: (matched[k].start if k in matched else trace.comms[k].start))
    region_counts: dict[tuple[int, float], int] = {}
    for n, a, b in windows:
        compute_in, comm_in = compute.within(a, b), comm.within(a, b)
        both = Cover([*compute_in, *comm_in])
        exposed_total = sum(e - s for ca, cb in comm_in for s, e in compute.gaps(ca, cb))
        step = RankStep(rank=rank, step=n, start=a + offset, end=b + offset, compute=compute.covered(a, b) / 1e6,
                        comm=comm.covered(a, b) / 1e6, exposed=exposed_total / 1e6,
                        idle=max(0.0, (b - a) - both.total) / 1e6,
                        compute_spans=[(s + offset, e + offset) for s, e in
                                       _segments(compute_in, a, b, 0.01 * (b - a))],
                        hooks=_hooks(labels, comm, a, b))
        for k in order:
            c = trace.comms[k]
            issue = matched.get(k)
            issued = issue.start if issue is not None else c.start
            if not a <= issued < b:
                continue
            gaps = compute.gaps(c.start, c.end)
            exposed = sum(e - s for s, e in gaps)
            need = _need(c, issue, gaps, waits, b, blocking)
            col = Collective(rank=rank, step=n, index=len(step.collectives),
                             kind=issue.kind if issue is not None else c.kind,
                             numel=issue.numel if issue is not None and issue.numel is not None else c.numel,
                             dtype=(issue.dtype if issue is not None else None) or c.dtype,
                             issued=issued + offset, start=c.start + offset, end=c.end + offset, need=need + offset,
                             exposed=exposed / 1e6, overlapped=compute.covered(c.start, c.end) / 1e6,
                             group=issue.group if issue is not None else None, lane=c.lane,
                             peak_memory=_peak(memory, memory_times, issued, c.end) if memory else None)
            if issue is not None:
                _context(col, labels.around(issue.thread, issue.start), region_counts)
            step.collectives.append(col)
        steps.append(step)
    return RankAnalysis(rank=rank, trace=trace, steps=steps, blocking=blocking, cuda=cuda)


def _need(c: Comm, issue: Issue | None, gaps: list[tuple[float, float]], waits: _Waits | None, step_end: float,
          blocking: bool) -> float:
    """When the issuing thread first stalled on ``c`` (module docstring); its end where it never did."""
    if blocking:
        return issue.start if issue is not None else c.start
    found = waits.need(issue.thread, issue.end, c.end, step_end) if waits is not None and issue is not None else None
    if found is not None:
        return found
    return gaps[-1][0] if gaps and gaps[-1][1] >= c.end else c.end


def _context(col: Collective, around: list[Span], region_counts: dict[tuple[int, float], int]) -> None:
    """Direction, FSDP2 modules and compiled region of a collective, from the labels its issue was inside."""
    for span in around:
        if span.name.startswith(GRAPH_REGION):
            col.region = span.name[len(GRAPH_REGION):]
            key = (span.thread, span.start)
            col.region_position = region_counts.get(key, 0)
            region_counts[key] = col.region_position + 1
            col.direction = "backward" if col.region.endswith("backward") else "forward"
            continue
        found = fsdp_label(span.name)
        if found is None:
            continue
        what, modules = found
        if what in _BACKWARD_LABELS:
            col.direction = "backward"
        elif what in _FORWARD_LABELS and not col.direction:
            col.direction = "forward"
        if what in ("all_gather", "post_backward_reduce") and modules:
            col.modules = modules
    if not col.direction and col.kind in ("reduce_scatter", "all_reduce"):
        col.direction = "backward"
