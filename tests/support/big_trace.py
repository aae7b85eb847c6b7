"""Write a large CPU/gloo Chrome trace in the shape torch.profiler exports, streamed (constant memory), for the
bounded-memory test and the large-trace measurement of ``benchmarks/diagnose_routes.py``. SYNTHETIC: per step, on
the main thread, FSDP2-labelled all-gathers (``c10d::_allgather_base_`` issue ops) and reduce-scatters, runs of
``aten::linear`` ops each with an ``aten::mm`` inside, ``[memory]`` samples; on a gloo thread each collective's
``gloo:all_gather`` / ``gloo:all_reduce`` event.

``python -m tests.support.big_trace OUT.json SIZE_MB`` writes one rank's trace of about SIZE_MB.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import IO

OPS_PER_BUCKET = 40
BUCKETS = 4
PID, MAIN, GLOO = 100, 100, 101


def _x(f: IO[str], name: str, cat: str, tid: int, ts: float, dur: float, args: dict[str, object] | None = None) -> None:
    f.write(json.dumps({"ph": "X", "cat": cat, "name": name, "pid": PID, "tid": tid, "ts": round(ts, 3),
                        "dur": round(dur, 3), "args": args or {"External id": 1, "Record function id": 0}}))
    f.write(",\n")


def _step(f: IO[str], n: int, t0: float) -> float:
    """One step from ``t0``; returns its end."""
    t = t0 + 10
    for b in range(BUCKETS):
        label = f"FSDP::all_gather (layers.{b})"
        _x(f, label, "user_annotation", MAIN, t, 400)
        _x(f, "c10d::_allgather_base_", "cpu_op", MAIN, t + 10, 50,
           {"Input Dims": [[1048576], [524288]], "Input type": ["float", "float"]})
        _x(f, "gloo:all_gather", "user_annotation", GLOO, t + 70, 300, {"Input Dims": [[524288]],
                                                                      "Input type": ["float"]})
        t += 410
        for _ in range(OPS_PER_BUCKET):
            _x(f, "aten::linear", "cpu_op", MAIN, t, 30)
            _x(f, "aten::mm", "cpu_op", MAIN, t + 5, 20, {"Input Dims": [[64, 64], [64, 64]],
                                                          "Input type": ["float", "float"]})
            f.write(json.dumps({"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": PID,
                                "tid": MAIN, "ts": t + 6, "args": {"Total Allocated": 1000000 + n, "Bytes": 16384,
                                                                   "Device Id": -1, "Device Type": 0}}))
            f.write(",\n")
            t += 35
    for b in reversed(range(BUCKETS)):
        _x(f, f"FSDP::post_backward_reduce (layers.{b})", "user_annotation", MAIN, t, 400)
        _x(f, "c10d::_reduce_scatter_base_", "cpu_op", MAIN, t + 10, 50,
           {"Input Dims": [[524288], [1048576]], "Input type": ["float", "float"]})
        _x(f, "gloo:all_reduce", "user_annotation", GLOO, t + 70, 300, {"Input Dims": [[1048576]],
                                                                      "Input type": ["float"]})
        t += 410
    return t + 10


def write_big_trace(path: Path, size_mb: float, rank: int = 0) -> int:
    """Write about ``size_mb`` MB; returns the steps written."""
    with open(path, "w") as f:
        f.write(json.dumps({"schemaVersion": 1, "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": 2},
                            "baseTimeNanoseconds": 1_790_000_000_000_000_000})[:-1])
        f.write(', "traceEvents": [\n')
        t, n = 1_000_000.0, 0
        while f.tell() < size_mb * 1e6:
            start = t
            t = _step(f, n, t)
            _x(f, f"ProfilerStep#{n}", "user_annotation", MAIN, start, t - start)
            n += 1
        f.write(json.dumps({"ph": "M", "name": "thread_name", "pid": PID, "tid": GLOO,
                            "args": {"name": "thread 101 (pt_gloo_runloop)"}}))
        f.write("\n]}\n")
    return n


if __name__ == "__main__":
    print(write_big_trace(Path(sys.argv[1]), float(sys.argv[2])))
