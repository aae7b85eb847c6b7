"""Timing work on the device it runs on: the host clock on CPU, CUDA events on the current stream on GPU.

On CPU every kernel, and every collective wait, returns when its work is done, so ``time.perf_counter`` around it
is its duration. On a GPU the host only enqueues: a duration is the distance between two CUDA events recorded on
the current (compute) stream, read after a synchronize, so it covers the kernels and the waits the stream made on
communication streams, not the launch calls. One ``Clock`` hides the difference; nothing else in the package
branches on the device for timing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TypeAlias, cast

import torch

from overlapcfg.errors import OverlapConfigError

__all__ = ["Clock", "Mark", "default_device"]

Mark: TypeAlias = "float | torch.cuda.Event"


def default_device() -> torch.device:
    """Where this rank computes: its current CUDA device under NCCL, else the CPU."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Clock:
    """Marks on one device's timeline and the seconds between them."""

    def __init__(self, device: torch.device | str, *, effort: float = 1.0) -> None:
        """``effort``: the share of each timing round's asked-for length that ``per_call`` runs (1: all of it). A
        calibration on a short budget lowers it (``overlapcfg.measuring.calibration.timing_effort``): each kernel's
        time less precise, the budget the user gave kept."""
        if not 0.0 < effort <= 1.0:
            raise OverlapConfigError(f"Clock: effort: expected a share in (0, 1], got {effort}")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.effort = effort

    def sync(self) -> None:
        """Wait until the device has done everything enqueued so far (nothing to wait for on CPU)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def mark(self) -> Mark:
        """Now, on the device's timeline: a host timestamp, or an event recorded on the current stream."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Mark, end: Mark) -> float:
        """Seconds from ``start`` to ``end`` (synchronizes on GPU first)."""
        if isinstance(start, float) and isinstance(end, float):
            return end - start
        self.sync()
        return cast(torch.cuda.Event, start).elapsed_time(cast(torch.cuda.Event, end)) / 1e3  # both: GPU marks

    def per_call(self, fn: Callable[[], object], *, min_seconds: float = 0.02, min_reps: int = 3,
                 max_reps: int = 10_000, rounds: int = 3) -> float:
        """Mean seconds per call of ``fn`` run back to back (as a training step runs kernels) over ``rounds`` rounds,
        each at least ``min_reps`` calls and about ``min_seconds`` (times the clock's ``effort``) long; one call first,
        untimed, to warm caches and allocators. The mean, not the median of the rounds: on a shared machine a short
        round can fall inside one time slice the scheduler gave this process and time the machine as if it were idle,
        while a step lasting far longer than a slice runs at its average share, which the mean over every round
        measures."""
        fn()
        self.sync()
        start = self.mark()
        fn()
        once = max(self.seconds(start, self.mark()), 1e-7)
        reps = int(min(max_reps, max(min_reps, self.effort * min_seconds / once)))
        means = []
        for _ in range(rounds):
            self.sync()
            start = self.mark()
            for _ in range(reps):
                fn()
            means.append(self.seconds(start, self.mark()) / reps)
        return statistics.fmean(means)

    def describe(self) -> str:
        """``cpu (2 threads)`` or the GPU's name."""
        if self.cuda:
            return torch.cuda.get_device_name(self.device)
        return f"cpu ({torch.get_num_threads()} thread{'s' if torch.get_num_threads() != 1 else ''})"
