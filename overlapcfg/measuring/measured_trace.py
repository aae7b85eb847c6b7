"""Read a ``torch.profiler`` trace of measured steps: exposed communication and each collective's duration.

The graphs ran inside ``overlapcfg::<graph>`` ranges (``overlapcfg.measuring.runner``) on the compute thread. Then:

- **CPU (gloo)**: a collective runs on a gloo thread (``gloo:all_gather``, ``gloo:all_reduce``, ... events) while
  the compute thread goes on until the collective's ``_c10d_functional::wait_tensor``, which blocks it until the
  collective is done. Exposed communication is the time the compute thread spent in those waits inside the graph
  ranges: collective time not covered by compute on the compute thread. Each collective's duration is its gloo
  event; in a range, gloo events are matched to the graph's collective starts in issue order (one queue per
  group), when the counts agree.
- **CUDA (NCCL)**: collectives are kernels on communication streams. Exposed communication is the time NCCL
  kernels ran while no other kernel did (the union of communication kernels minus the union of compute kernels),
  over the whole profiled window, per step; durations are the NCCL kernels' own, matched in launch order.
  Untested here (no GPU in this project's CI); the CPU path is what ``tests/measuring/test_measure.py`` runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from overlapcfg.errors import OverlapStateError
from overlapcfg.measuring.runner import REGION

__all__ = ["StepTrace", "read_trace", "uncovered_seconds"]

_WAIT = "_c10d_functional::wait_tensor"


@dataclass(frozen=True, slots=True)
class StepTrace:
    """Per profiled step: exposed seconds, the time inside the graphs (what the exposure is part of), and per graph
    the measured durations of its collectives in issue order."""

    exposed: tuple[float, ...]
    graph_seconds: tuple[float, ...]
    collectives: tuple[dict[str, tuple[float, ...]], ...]


def uncovered_seconds(spans: Iterable[tuple[float, float]], cover: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``spans`` outside the union of ``cover`` (same units)."""
    def union(items: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
        out: list[tuple[float, float]] = []
        for a, b in sorted(items):
            if out and a <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], b))
            elif b > a:
                out.append((a, b))
        return out

    total = 0.0
    covered = union(cover)
    for a, b in union(spans):
        total += b - a
        for c, d in covered:
            total -= max(0.0, min(b, d) - max(a, c))
    return total


def _span(event: Any) -> tuple[float, float]:
    tr = event.time_range
    return tr.start / 1e6, tr.end / 1e6


def read_trace(events: Sequence[Any], *, steps: int, cuda: bool) -> StepTrace:
    """(``events``: ``torch.profiler``'s ``FunctionEvent``s, whose attributes torch does not type.)"""
    """``events``: ``profiler.events()`` of ``steps`` profiled steps (graphs in ``overlapcfg::`` ranges)."""
    regions = sorted((e for e in events if e.name.startswith(REGION)),
                     key=lambda e: _span(e)[0])
    if not regions:
        raise OverlapStateError("measure: the profiler saw no overlapcfg graph ranges: did the step run the compiled "
                                "model built with the backend it was given?")
    per_step = max(1, len(regions) // steps)
    if cuda:
        return _read_cuda(events, regions, steps, per_step)
    thread = regions[0].thread
    waits = [_span(e) for e in events if e.name == _WAIT and e.thread == thread]
    comms = sorted((_span(e) for e in events if e.name.startswith("gloo:")), key=lambda s: s[0])
    exposed, inside, collectives = [], [], []
    for i in range(steps):
        mine = regions[i * per_step:(i + 1) * per_step]
        total, spans, durations = 0.0, 0.0, {}
        for region in mine:
            a, b = _span(region)
            spans += b - a
            total += sum(max(0.0, min(b, d) - max(a, c)) for c, d in waits)
            durations[region.name.removeprefix(REGION)] = tuple(d - c for c, d in comms if a <= c < b)
        exposed.append(total)
        inside.append(spans)
        collectives.append(durations)
    return StepTrace(tuple(exposed), tuple(inside), tuple(collectives))


def _read_cuda(events: Sequence[Any], regions: Sequence[Any], steps: int, per_step: int) -> StepTrace:
    device = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]
    comm = [_span(e) for e in device if "nccl" in e.name.lower()]
    compute = [_span(e) for e in device if "nccl" not in e.name.lower()]
    exposed = uncovered_seconds(comm, compute) / steps
    durations = tuple(d - c for c, d in sorted(comm))
    per = len(durations) // steps if steps else 0
    collectives = tuple({"step": durations[i * per:(i + 1) * per]} for i in range(steps))
    busy = uncovered_seconds([*comm, *compute], []) / steps  # device time the step kept either stream busy
    return StepTrace(tuple(exposed for _ in range(steps)), tuple(busy for _ in range(steps)), collectives)
