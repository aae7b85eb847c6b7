"""The simulator's event semantics: one implementation for ``overlapcfg.cost.simulator`` (node by node over a
scheduled graph) and the tuner's quick score (``overlapcfg.tuning.quick``, event by event over a profile).

One compute stream and one stream per process group. Compute runs in order. A collective issued when the compute
stream reaches it runs on its group's stream after whatever that stream already holds. A wait blocks the compute
stream until its collective is done; the time it blocks is exposed communication. A graph ends when every stream
is idle (its outputs are the step's results), so the next graph starts from there. Alongside: the parameter
all-gather bytes in flight (issued, not yet waited), and the bytes alive by category (``Memory``).

Contention (``HardwareProfile.contention``, measured by calibration): each collective carries its link's
``(compute_slowdown, comm_slowdown)``. While a collective runs on its stream, compute runs at
``1 / (1 + compute_slowdown)`` (the largest of the running collectives'); while compute runs, a collective moves at
``1 / (1 + comm_slowdown)``; while the compute stream waits (or the graph drains), collectives move at full speed.
Work is what a kernel or a collective costs alone; the clock is what they take together. Without contention (both
0, the datasheet profiles) the clock is the work: a collective ends ``seconds`` after it starts, exactly.

The callers decide only what runs when and what it costs; how the streams answer is written here once, so the
quick score and the full simulation cannot drift apart.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

__all__ = ["NO_CONTENTION", "Memory", "Slowdown", "Streams"]

Slowdown = tuple[float, float]
"""``(compute_slowdown, comm_slowdown)`` of one collective's link (``overlapcfg.cost.calibration.Contention``)."""
NO_CONTENTION: Slowdown = (0.0, 0.0)


class _Running:
    """A collective on its stream: its token, slowdowns, start, and projected end at the current rate."""

    __slots__ = ("end", "issued", "seconds", "slowdown", "start", "token")

    def __init__(self, token: Hashable, seconds: float, slowdown: Slowdown, issued: float) -> None:
        self.token, self.seconds, self.slowdown, self.issued = token, seconds, slowdown, issued
        self.start = self.end = 0.0


class Streams:
    """The clock of one step: the compute stream's time ``t``, each communication stream's queue, the collectives
    issued and not yet waited, and when each collective ran (``spans``)."""

    __slots__ = ("_busy_until", "_compute_running", "_heads", "_inflight_of", "_queues", "_slowed", "busy", "comm",
                 "compute", "contended", "exposed", "inflight", "peak_inflight", "spans", "t")

    def __init__(self) -> None:
        self.t = 0.0
        """Where the compute stream is."""
        self.compute = 0.0
        """Seconds of compute work run (each kernel's cost alone; not counting waits or contention)."""
        self.contended = 0.0
        """Seconds the compute stream lost to contention (ran slower with collectives in flight)."""
        self.comm = 0.0
        """Seconds of every collective issued, all streams, as costed alone."""
        self.exposed = 0.0
        """Seconds the compute stream waited on a collective."""
        self.busy: dict[str, float] = {}
        """Seconds of collectives per stream (as costed alone), in order of first use."""
        self.inflight = self.peak_inflight = 0
        self.spans: dict[Hashable, tuple[float, float]] = {}
        """When each collective (by token) ran on its stream: start and end, once it has ended."""
        self._queues: dict[str, deque[_Running]] = {}
        self._heads: dict[str, _Running] = {}
        """The collective running on each stream (the head of its queue)."""
        self._inflight_of: dict[Hashable, int] = {}
        self._busy_until: dict[str, float] = {}
        """Where each stream's last collective ended (a graph ends when every stream is idle)."""
        self._compute_running = True
        self._slowed = 0
        """Collectives queued or running with a nonzero slowdown: none, and the compute stream's clock is its
        work (collectives end where they were projected to whatever compute does)."""

    # -- rates ---------------------------------------------------------------------------------------------
    def _rate_factor(self, r: _Running) -> float:
        """Clock seconds per second of ``r``'s work at the moment."""
        return 1.0 + r.slowdown[1] if self._compute_running else 1.0

    def _set_compute(self, running: bool) -> None:
        """The compute stream starts or stops running: re-project the ends of collectives it slows."""
        if running == self._compute_running:
            return
        for r in self._heads.values():
            if r.slowdown[1] > 0:
                before = 1.0 + r.slowdown[1] if self._compute_running else 1.0
                after = 1.0 + r.slowdown[1] if running else 1.0
                r.end = self.t + (r.end - self.t) / before * after
        self._compute_running = running

    def _start_head(self, stream: str, at: float) -> None:
        queue = self._queues[stream]
        if not queue:
            self._heads.pop(stream, None)
            return
        r = queue[0]
        r.start = max(at, r.issued)
        r.end = r.start + r.seconds * self._rate_factor(r)
        self._heads[stream] = r

    def _finish(self, stream: str) -> None:
        """The head of ``stream`` ends at its projected end; the next in its queue starts."""
        r = self._queues[stream].popleft()
        self.spans[r.token] = (r.start, r.end)
        if r.slowdown != NO_CONTENTION:
            self._slowed -= 1
        self._busy_until[stream] = r.end
        self._start_head(stream, r.end)

    def _next_end(self) -> tuple[float, str | None]:
        end, first = float("inf"), None
        for stream, r in self._heads.items():
            if r.end < end:
                end, first = r.end, stream
        return end, first

    def _advance_idle(self, until: float | None, token: Hashable | None = None) -> None:
        """With the compute stream not running: move the clock to ``until`` (or until ``token``'s collective has
        ended, or every stream is idle when both are None), ending collectives on the way."""
        while True:
            end, stream = self._next_end()
            if stream is None or (until is not None and end > until):
                break
            self.t = max(self.t, end)
            self._finish(stream)
            if token is not None and token in self.spans:
                return
        if until is not None:
            self.t = max(self.t, until)

    # -- the compute stream ------------------------------------------------------------------------------------
    def run(self, seconds: float) -> float:
        """The compute stream runs ``seconds`` of work (a kernel, a copy, a collective's issue cost), slowed while
        collectives run; returns its start."""
        start = self.t
        self.compute += seconds
        if not self._slowed:  # nothing slows anything: collectives end as projected, in any order of popping
            self.t += seconds
            return start
        work = seconds
        while work > 0:
            slow = max((r.slowdown[0] for r in self._heads.values()), default=0.0)
            factor = 1.0 + slow
            done_at = self.t + work * factor
            end, stream = self._next_end()
            if stream is None or end >= done_at:
                self.contended += work * slow
                self.t = done_at
                break
            if end > self.t:
                elapsed = end - self.t
                work -= elapsed / factor
                self.contended += elapsed - elapsed / factor
                self.t = end
            self._finish(stream)
        return start

    def issue(self, token: Hashable, stream: str, seconds: float, *, issue_seconds: float = 0.0,
              inflight_bytes: int = 0, slowdown: Slowdown = NO_CONTENTION) -> float:
        """A collective (``token``, for its wait) is issued: the compute stream first pays ``issue_seconds`` (its
        launch, as a calibrated fit measures it; the tuner adds the copy-in chain), then it takes ``seconds`` of
        work on ``stream`` after what that stream already holds, slowed by ``slowdown`` (its link's contention);
        ``inflight_bytes`` count as in flight until its wait. Returns when it starts on ``stream`` at the rates of
        the moment: exact without contention; with it, ``spans[token]`` once it has ended."""
        if issue_seconds:
            self.run(issue_seconds)
        queue = self._queues.setdefault(stream, deque())
        start = self.t
        if queue:  # behind what the stream holds: where that ends at the current rates
            start = queue[0].end
            for r in list(queue)[1:]:
                start = max(start, r.issued) + r.seconds * self._rate_factor(r)
            start = max(start, self.t)
        queue.append(_Running(token, seconds, slowdown, self.t))
        if slowdown != NO_CONTENTION:
            self._slowed += 1
        if len(queue) == 1:
            self._start_head(stream, self.t)
        self.busy[stream] = self.busy.get(stream, 0.0) + seconds
        self.comm += seconds
        self._inflight_of[token] = inflight_bytes
        if inflight_bytes:
            self.inflight += inflight_bytes
            self.peak_inflight = max(self.peak_inflight, self.inflight)
        return start

    def wait(self, token: Hashable) -> float:
        """The compute stream waits for ``token``'s collective; returns how long it was blocked (0 when the
        collective is already done, or was never issued here)."""
        if token not in self._inflight_of:
            return 0.0
        self.inflight -= self._inflight_of.pop(token)
        if token in self.spans:
            return 0.0
        before = self.t
        self._set_compute(False)
        self._advance_idle(None, token)
        self._set_compute(True)
        stall = self.t - before
        self.exposed += stall
        return stall

    def end_graph(self) -> float:
        """The graph is done when every stream is idle: move the compute stream there and return the time."""
        self._set_compute(False)
        self._advance_idle(None)
        self._set_compute(True)
        if self._busy_until:
            self.t = max(self.t, *self._busy_until.values())
        return self.t


class Memory:
    """Bytes alive in one graph, as unsharded parameters or as the rest (activations), and their peaks."""

    __slots__ = ("act", "param", "peak_act", "peak_param")

    def __init__(self) -> None:
        self.param = self.act = self.peak_param = self.peak_act = 0

    def alloc(self, nbytes: int, is_param: bool) -> None:
        if is_param:
            self.param += nbytes
            self.peak_param = max(self.peak_param, self.param)
        else:
            self.act += nbytes
            self.peak_act = max(self.peak_act, self.act)

    def free(self, nbytes: int, is_param: bool) -> None:
        if is_param:
            self.param -= nbytes
        else:
            self.act -= nbytes
