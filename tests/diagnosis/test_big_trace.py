"""A large trace is streamed: reading it holds a fraction of its size (about a sixth: the compact arrays of its
events), never the JSON or its Python objects (the bound a diagnosis promises is 4x the trace; a generated trace
stands in for a real one, scaled down from gigabytes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.big_trace import write_big_trace

_MEASURE = """
import json, resource, sys
from overlapcfg.diagnosis.read import read_trace
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
trace = read_trace(sys.argv[1])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"growth_kb": after - before, "events": trace.events, "steps": len(trace.steps)}))
"""


def _growth(path: Path) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(path)], capture_output=True, text=True, timeout=280,
                         check=True)
    return json.loads(out.stdout)


@pytest.mark.slow
def test_reading_a_trace_grows_memory_by_a_fraction_of_its_size(tmp_path: Path) -> None:
    small, large = tmp_path / "small.json", tmp_path / "large.json"
    write_big_trace(small, 4)
    write_big_trace(large, 32)
    grew = {p: _growth(p) for p in (small, large)}
    size = large.stat().st_size
    assert grew[large]["steps"] > grew[small]["steps"] * 6
    assert grew[large]["growth_kb"] * 1024 < 0.5 * size  # the bound is 4x; what is kept is compact
    # what the larger file adds is a fraction of the bytes it adds (nothing is held per byte of JSON)
    added = (grew[large]["growth_kb"] - grew[small]["growth_kb"]) * 1024
    assert added < 0.5 * (size - small.stat().st_size)
