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
0) the clock is the work: a collective ends ``seconds`` after it starts, exactly.

Rank skew (``HardwareProfile.skew``, ``overlapcfg.cost.achievable.Skew``): a collective cannot start before its
last rank has issued it. Ranks drift apart while they compute and come together when they block on a collective
(the rank that arrived first waits for the others at that wait), so each collective issued ``T`` seconds of
compute-stream time after the last synchronization starts no earlier than ``issue + Skew.wait(T, p)``: the
expected lateness of the last of its ``p`` ranks. A wait that blocks, and the end of a graph (every stream idle: the
step's results), synchronize. Overlapped collectives hide the wait in their slack; a collective issued right before
its wait pays it whole, which is why unoverlapped steps are the ones a skew-free model under-predicts. Work the step
runs between two graphs outside both (``between_graphs``: an eager loss between a compiled forward and its
backward) is not on the clock, but the ranks drift across it too: the next graph's first blocking collective is
where they meet again.

Wake-up (``Skew.wake``): a collective that starts on a stream idle for ``g`` seconds (since that stream's last
collective ended, or since the step began) takes ``Skew.wake_seconds(g)`` longer: on a CPU, the communication
threads sleep between collectives. A collective queued right behind another pays nothing. One that pays a start
delay (below) pays no wake-up on top: the delay was measured after idling, so it holds the wake-up; if compute
blocks before the delay is over, the collective still moves no earlier than its wake-up after its start (what
the calibration's blocking probe measures).

Start delay (``Contention.start_delay``, the third number of a collective's ``Slowdown``): a collective that
starts on an idle stream while compute runs does not move for that many seconds of compute. On a CPU the
compute threads hold every core and the communication thread waits for the scheduler to give it one (measured on
2 gloo ranks sharing 2 cores: 3-4 ms, whatever the size from 16 KB to 1 MB); the moment the compute stream
blocks, the core is free and the collective moves at once, so a delay not yet over when compute waits ends there.
A collective queued behind another pays it too when it starts while compute runs: the communication thread blocks
on its peers between collectives and waits for a core again (measured on 2 gloo ranks, 2026-12-07: collectives of
160 KB that started under compute took 1.4-3.4 ms against 0.4-0.5 ms priced without the delay; unoverlapped, as
priced).

The callers decide only what runs when and what it costs; how the streams answer is written here once, so the
quick score and the full simulation cannot drift apart.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable

from overlapcfg.cost.achievable import Skew, expected_max_normal

__all__ = ["NO_CONTENTION", "Memory", "Slowdown", "Streams"]

Slowdown = tuple[float, float, float]
"""``(compute_slowdown, comm_slowdown, start_delay)`` of one collective's link
(``overlapcfg.cost.measured_fits.Contention``)."""
NO_CONTENTION: Slowdown = (0.0, 0.0, 0.0)
_INF = float("inf")


class _Running:
    """A collective on its stream: its token, slowdowns, start, when it begins to move (after its start delay),
    and projected end at the current rate."""

    __slots__ = ("end", "issued", "moves", "seconds", "slowdown", "start", "token", "wake")

    def __init__(self, token: Hashable, seconds: float, slowdown: Slowdown, issued: float) -> None:
        self.token, self.seconds, self.slowdown, self.issued = token, seconds, slowdown, issued
        self.start = self.end = self.moves = 0.0
        self.wake = 0.0
        """The wake-up its start delay stands for (``Skew.wake``): if compute stops before the delay is over, it
        moves no earlier than ``start + wake``."""


class Streams:
    """The clock of one step: the compute stream's time ``t``, each communication stream's queue, the collectives
    issued and not yet waited, and when each collective ran (``spans``)."""

    __slots__ = ("_busy_until", "_compute_running", "_delays", "_heads", "_idle_from", "_inflight_of", "_max_of",
                 "_queues", "_skew", "_slowed", "_slowed_in", "_synced", "_tail", "_wakes", "busy", "comm", "compute",
                 "contended", "delayed", "exposed", "inflight", "peak_inflight", "skewed", "spans", "t", "woken")

    def __init__(self, skew: Skew | None = None) -> None:
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
        self._idle_from = 0.0
        """Since when a stream with no collective yet has been idle: the step's start (``between_graphs`` moves it
        back by the work before this graph)."""
        self._compute_running = True
        self._slowed = 0
        """Collectives queued or running with a nonzero slowdown: none, and the compute stream's clock is its
        work (collectives end where they were projected to whatever compute does)."""
        self._slowed_in: dict[str, int] = {}
        """Per stream, collectives queued or running that compute slows (a nonzero ``comm_slowdown``): where a
        stream's queue holds none, its tail is exact (``_tail``)."""
        self._tail: dict[str, float] = {}
        """Where each stream's last queued collective ends (valid while its queue holds no slowed collective)."""
        self._skew = skew
        self._synced = 0.0
        """When the ranks last synchronized (a blocking wait, the start of the graph)."""
        self.skewed = 0.0
        """Seconds collectives waited for their last rank to arrive (the skew), summed."""
        self._max_of: dict[int, float] = {}
        self._wakes = skew is not None and bool(skew.wake)
        self.woken = 0.0
        """Seconds collectives took to wake their idle streams (``Skew.wake``), summed."""
        self.delayed = 0.0
        """Seconds collectives started under compute waited before they moved (``Contention.start_delay``)."""
        self._delays = False
        """Whether any collective has had a start delay (without, compute's path is the one without delays)."""

    # -- rates ---------------------------------------------------------------------------------------------
    def _rate_factor(self, r: _Running) -> float:
        """Clock seconds per second of ``r``'s work at the moment."""
        return 1.0 + r.slowdown[1] if self._compute_running else 1.0

    def _set_compute(self, running: bool) -> None:
        """The compute stream starts or stops running: re-project the ends of collectives it slows; a collective
        still in its start delay when compute stops moves from now at full speed, once it has woken (``wake``
        seconds from its start)."""
        if running == self._compute_running:
            return
        for r in self._heads.values():
            if not running and r.moves > self.t and r.moves > r.start:  # still in its start delay
                now = max(r.start, self.t)
                moves = max(r.start + r.wake, now)
                self.delayed -= r.moves - now  # delayed while compute ran; then, what is left of its wake-up
                self.woken += moves - now
                r.moves = moves
                r.end = r.moves + r.seconds
            elif r.slowdown[1] > 0:
                before = 1.0 + r.slowdown[1] if self._compute_running else 1.0
                after = 1.0 + r.slowdown[1] if running else 1.0
                moving = r.moves if r.moves > self.t else self.t  # still waking: slowed only once it moves
                r.end = moving + (r.end - moving) / before * after
        self._compute_running = running

    def _finish(self, stream: str) -> None:
        """The head of ``stream`` ends at its projected end; the next in its queue starts."""
        r = self._queues[stream].popleft()
        self.spans[r.token] = (r.start, r.end)
        if r.slowdown != NO_CONTENTION:
            self._slowed -= 1
        if r.slowdown[1] > 0 or r.slowdown[2] > 0:
            self._slowed_in[stream] -= 1
            if not self._slowed_in[stream]:  # the tail projected while it was slowed is stale now
                self._tail[stream] = self._projected_tail(stream, r.end)
        self._busy_until[stream] = r.end
        queue = self._queues[stream]
        if not queue:  # the next starts when this one ends, or when its last rank arrives
            del self._heads[stream]  # ``r`` was its head
            return
        head = queue[0]
        head.start = r.end if r.end >= head.issued else head.issued
        delay = head.slowdown[2] if self._compute_running else 0.0  # compute holds the cores: it waits for one
        self._delays = self._delays or delay > 0
        self.delayed += delay
        head.moves = head.start + delay
        head.end = head.moves + head.seconds * (1.0 + head.slowdown[1] if self._compute_running else 1.0)
        self._heads[stream] = head

    def _next_end(self) -> tuple[float, str | None]:
        end, first = _INF, None
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
        if not self._slowed or not self._heads:  # nothing slows it (nothing running, or no contention)
            self.t += seconds
            return start
        work = seconds
        heads = self._heads
        while work > 0:
            stream: str | None
            if len(heads) == 1:  # one stream running (the tuner's case): max and _next_end over one head, inline
                only, r = next(iter(heads.items()))
                stream = only if r.end < _INF else None
                end = r.end
                if r.moves > self.t and r.moves > r.start:  # in its start delay: no slowing until it moves
                    slow, end, stream = 0.0, r.moves, None
                else:
                    slow = r.slowdown[0]
            elif not self._delays:
                slow = max((r.slowdown[0] for r in heads.values()), default=0.0)
                end, stream = self._next_end()
            else:
                slow = max((r.slowdown[0] for r in heads.values() if r.moves <= self.t or r.moves == r.start),
                           default=0.0)
                end, stream = self._next_end()
                moves = min((r.moves for r in heads.values() if self.t < r.moves and r.start < r.moves),
                            default=_INF)
                if moves < end:
                    end, stream = moves, None
            factor = 1.0 + slow
            done_at = self.t + work * factor
            if end >= done_at:
                self.contended += work * slow
                self.t = done_at
                break
            if end > self.t:
                elapsed = end - self.t
                work -= elapsed / factor
                self.contended += elapsed - elapsed / factor
                self.t = end
            if stream is not None:
                self._finish(stream)
        return start

    def _projected_tail(self, stream: str, at: float) -> float:
        """Where ``stream``'s queue ends at the current rates and start delays, its head running from ``at`` (or as
        projected)."""
        queue = self._queues[stream]
        if not queue:
            return at
        head = queue[0]
        end = head.end if head is self._heads.get(stream) else max(at, head.issued) + head.seconds
        delayed = self._compute_running  # a queued collective starting under compute waits for a core first
        for r in list(queue)[1:]:
            end = max(end, r.issued) + (r.slowdown[2] if delayed else 0.0) + r.seconds * self._rate_factor(r)
        return end

    def issue(self, token: Hashable, stream: str, seconds: float, *, issue_seconds: float = 0.0,
              inflight_bytes: int = 0, slowdown: Slowdown = NO_CONTENTION, ranks: int = 1) -> float:
        """A collective (``token``, for its wait) is issued: the compute stream first pays ``issue_seconds`` (its
        launch, as a calibrated fit measures it; the tuner adds the copy-in chain), then it takes ``seconds`` of
        work on ``stream`` after what that stream already holds and no earlier than its last of ``ranks`` ranks
        arrives (the skew), slowed by ``slowdown`` (its link's contention); ``inflight_bytes`` count as in flight
        until its wait. Returns when it starts on ``stream`` at the rates of the moment: exact without contention;
        with it, ``spans[token]`` once it has ended."""
        if issue_seconds:
            self.run(issue_seconds)
        arrive = self.t
        skew = self._skew
        if ranks > 1 and skew is not None:
            # ``Skew.wait(since the last synchronization, ranks)``, the expected maximum of ``ranks`` normals
            # looked up once per rank count.
            most = self._max_of.get(ranks)
            if most is None:
                most = self._max_of[ranks] = expected_max_normal(ranks)
            since = self.t - self._synced
            since = since if since > 0.0 else 0.0
            rel = skew.relative * since
            late = most * math.sqrt(skew.absolute * skew.absolute + skew.diffusion * since + rel * rel)
            self.skewed += late
            arrive += late
        queue = self._queues.get(stream)
        if queue is None:
            queue = self._queues[stream] = deque()
        if not queue:
            start = arrive
        elif not self._slowed_in.get(stream):  # no contention in the queue: its tail is exact
            start = max(self._tail[stream], arrive)
        else:
            start = max(self._projected_tail(stream, self.t), arrive)
        extra = 0.0
        if self._wakes and ranks > 1 and skew is not None:
            idle = start - (self._busy_until.get(stream, self._idle_from) if not queue else self._tail[stream])
            extra = skew.wake_seconds(idle if idle > 0.0 else 0.0)
        # on an idle stream under compute, the start delay stands for the wake-up (it was measured after idling)
        deferred = not queue and self._compute_running and slowdown[2] > 0
        if extra and not deferred:
            self.woken += extra
            seconds += extra
        r = _Running(token, seconds, slowdown, arrive)
        if deferred:
            r.wake = extra
        queue.append(r)
        if slowdown != NO_CONTENTION:
            self._slowed += 1
        # ``_rate_factor(r)``, inline: issue runs for every collective of every quick score.
        factor = 1.0 + slowdown[1] if self._compute_running else 1.0
        # only a collective compute slows or delays makes its stream's tail inexact
        if slowdown[1] > 0 or slowdown[2] > 0:
            self._slowed_in[stream] = self._slowed_in.get(stream, 0) + 1
        delay = 0.0
        if len(queue) == 1:  # it starts now, or when its last rank arrives; on an idle stream, after its delay
            delay = slowdown[2] if self._compute_running else 0.0
            self._delays = self._delays or delay > 0
            r.start = self.t if self.t >= arrive else arrive
            r.moves = r.start + delay
            r.end = r.moves + seconds * factor
            self._heads[stream] = r
            self.delayed += delay
        self._tail[stream] = start + delay + seconds * factor
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
        if stall > 0:
            self._synced = self.t  # blocked on it: the ranks leave this wait together
        return stall

    def end_graph(self) -> float:
        """The graph is done when every stream is idle: move the compute stream there and return the time."""
        self._set_compute(False)
        self._advance_idle(None)
        self._set_compute(True)
        if self._busy_until:
            self.t = max(self.t, *self._busy_until.values())
        self._synced = self.t
        return self.t

    def between_graphs(self, seconds: float) -> None:
        """The step runs ``seconds`` of work outside the graphs before the next one (after ``end_graph``): not on
        this clock, but the ranks drift apart across it and every stream idles through it, so the next graph's
        collectives are issued that much longer after the ranks last met, on links idle that much longer."""
        if seconds <= 0.0:
            return
        self._synced -= seconds
        self._idle_from -= seconds
        for stream, until in self._busy_until.items():
            self._busy_until[stream] = until - seconds


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
