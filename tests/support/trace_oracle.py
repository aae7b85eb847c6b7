"""An independent reading of a CPU or GPU ``torch.profiler`` trace's exposed communication, for the diagnosis tests.

Shares no code with ``overlapcfg.diagnosis``: the whole file is loaded with ``json``, and time is rasterized into
0.1-microsecond cells with numpy, so unions and differences are boolean masks rather than sorted interval sweeps.
The definition is the diagnosis's (``overlapcfg.diagnosis.steps``): communication is gloo's events and NCCL's
kernels; compute is GPU kernels that are not NCCL's, or on a CPU the ops with no op inside them that are not a
collective's issue or wait (nor inside one), on threads without gloo events; exposed is communication no compute
covers, inside each ``ProfilerStep#N``.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
from pathlib import Path
from typing import Any

import numpy as np

CELL_US = 0.1
_COMM_OP = re.compile(r"^(c10d::|_c10d_functional::|record_param_comms$)")


def _load(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return json.loads(raw)


def _leaves(ops: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """Ops with no other op starting inside them, minus collective ops and anything inside one."""
    ops = sorted(ops, key=lambda e: (e["ts"], -e["dur"]))
    starts = [e["ts"] for e in ops]
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in ops if _COMM_OP.match(e["name"])]
    out = []
    comm_starts = [a for a, _ in comm]
    for i, e in enumerate(ops):
        a, b = e["ts"], e["ts"] + e["dur"]
        if (i + 1 < len(ops) and starts[i + 1] < b) or _COMM_OP.match(e["name"]):
            continue  # sorted by start: the next op starting before this one ends is inside it
        k = bisect.bisect_right(comm_starts, a) - 1
        if any(comm[j][0] <= a and b <= comm[j][1] for j in range(max(0, k - 3), k + 1)):
            continue
        out.append((a, b))
    return out


def exposed_per_step(path: Path) -> dict[int, float]:
    """``{N: exposed seconds}`` of each ``ProfilerStep#N`` of one rank's trace."""
    events = [e for e in _load(path)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    gloo_threads = {e["tid"] for e in events if e["name"].startswith("gloo:")}
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in events
            if e["name"].startswith("gloo:") or (e.get("cat") == "kernel" and e["name"].startswith("nccl"))]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if gpu:
        compute = [(e["ts"], e["ts"] + e["dur"]) for e in gpu if not e["name"].startswith("nccl")]
    else:
        by_thread: dict[object, list[dict[str, Any]]] = {}
        for e in events:
            if e.get("cat") == "cpu_op" and e["tid"] not in gloo_threads:
                by_thread.setdefault(e["tid"], []).append(e)
        compute = [span for ops in by_thread.values() for span in _leaves(ops)]
    out = {}
    for e in events:
        found = re.match(r"^ProfilerStep#(\d+)$", e["name"])
        if not found:
            continue
        a, b = e["ts"], e["ts"] + e["dur"]
        cells = int(np.ceil((b - a) / CELL_US))
        comm_mask = np.zeros(cells, dtype=bool)
        compute_mask = np.zeros(cells, dtype=bool)
        for mask, spans in ((comm_mask, comm), (compute_mask, compute)):
            for s, t in spans:
                lo, hi = max(s, a), min(t, b)
                if hi > lo:
                    mask[int((lo - a) // CELL_US):int(np.ceil((hi - a) / CELL_US))] = True
        out[int(found.group(1))] = float((comm_mask & ~compute_mask).sum() * CELL_US / 1e6)
    return out
