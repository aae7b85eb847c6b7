"""The simulator's event semantics: one implementation for ``overlapcfg.cost.simulator`` (node by node over a
scheduled graph) and the tuner's quick score (``overlapcfg.tuning.quick``, event by event over a profile).

One compute stream and one stream per process group. Compute runs in order. A collective issued when the compute
stream reaches it runs on its group's stream after whatever that stream already holds. A wait blocks the compute
stream until its collective is done; the time it blocks is exposed communication. A graph ends when every stream
is idle (its outputs are the step's results), so the next graph starts from there. Alongside: the parameter
all-gather bytes in flight (issued, not yet waited), and the bytes alive by category (``Memory``).

The callers decide only what runs when and what it costs; how the streams answer is written here once, so the
quick score and the full simulation cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Hashable

__all__ = ["Memory", "Streams"]


class Streams:
    """The clock of one step: the compute stream's time ``t``, each communication stream's busy time and where it
    ends, the collectives issued and not yet waited."""

    __slots__ = ("_end", "_pending", "busy", "comm", "compute", "exposed", "inflight", "peak_inflight", "t")

    def __init__(self) -> None:
        self.t = 0.0
        """Where the compute stream is."""
        self.compute = 0.0
        """Seconds the compute stream ran (not counting waits)."""
        self.comm = 0.0
        """Seconds of every collective issued, all streams."""
        self.exposed = 0.0
        """Seconds the compute stream waited on a collective."""
        self.busy: dict[str, float] = {}
        """Seconds of collectives per stream, in order of first use."""
        self.inflight = self.peak_inflight = 0
        self._end: dict[str, float] = {}
        self._pending: dict[Hashable, tuple[float, int]] = {}

    def run(self, seconds: float) -> float:
        """The compute stream runs for ``seconds`` (a kernel, a copy, a collective's issue cost); returns its start."""
        start = self.t
        self.t += seconds
        self.compute += seconds
        return start

    def issue(self, token: Hashable, stream: str, seconds: float, *, issue_seconds: float = 0.0,
              inflight_bytes: int = 0) -> float:
        """A collective (``token``, for its wait) is issued: the compute stream first pays ``issue_seconds`` (its
        launch, as a calibrated fit measures it; the tuner adds the copy-in chain), then it takes ``seconds`` on
        ``stream`` after what that stream already holds; ``inflight_bytes`` count as in flight until its wait.
        Returns when it starts on ``stream``."""
        self.t += issue_seconds
        self.compute += issue_seconds
        start = max(self.t, self._end.get(stream, 0.0))
        end = start + seconds
        self._end[stream] = end
        self.busy[stream] = self.busy.get(stream, 0.0) + seconds
        self.comm += seconds
        self._pending[token] = (end, inflight_bytes)
        if inflight_bytes:
            self.inflight += inflight_bytes
            self.peak_inflight = max(self.peak_inflight, self.inflight)
        return start

    def wait(self, token: Hashable) -> float:
        """The compute stream waits for ``token``'s collective; returns how long it was blocked (0 when the
        collective is already done, or was never issued here)."""
        pending = self._pending.pop(token, None)
        if pending is None:
            return 0.0
        end, nbytes = pending
        self.inflight -= nbytes
        if end <= self.t:
            return 0.0
        stall = end - self.t
        self.exposed += stall
        self.t = end
        return stall

    def end_graph(self) -> float:
        """The graph is done when every stream is idle: move the compute stream there and return the time."""
        if self._end:
            self.t = max(self.t, *self._end.values())
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
