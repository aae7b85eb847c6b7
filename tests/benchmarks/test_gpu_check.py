"""``benchmarks/gpu_check.py`` on CPU at its small sizes, as a user runs it (a subprocess): the GPU check must not be
the one script that first runs on the day a GPU is lent. Gloo at world size 1 and the backend's eager compiler for
part 1, inductor for CPU for part 2's fake-group step (compiled, not run), calibration at a short budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


KERNELS = Path(tempfile.gettempdir()) / "overlapcfg-tests-gpu-check-inductor"
"""Inductor's cache for the script (it compiles cold in a fresh one unless told): the C++ compiler's kernels, keyed by
their source, are reused from an earlier run on this machine, which is most of part 2's time on a small CPU (62 ->
11 s lowering its graphs). Its FX graph cache is off, so inductor lowers both graphs on every run all the same."""


def test_the_gpu_check_runs_on_cpu_and_the_configs_are_bitwise_equal(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(KERNELS), "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}
    # --cache-mib 4: calibration's memory kernels stop at a few times 4 MiB instead of this VM's 300 MiB cache (what
    # the check asserts is that calibration runs and yields a profile, not the memory's bandwidth)
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--small", "--calibrate-s", "2",
                           "--cache-mib", "4", "--out", str(out)], check=False, capture_output=True, text=True,
                          timeout=600, cwd=tmp_path, env=env)
    result = json.loads(out.read_text()) if out.exists() else {}
    errors = [row["error"] for row in result.get("one_rank", {}).get("configs", []) if "error" in row]
    errors += [part["error"] for part in (result.get("fake_group", {}), result.get("one_rank", {}).get("calibration")
                                          or {}) if "error" in part]
    assert done.returncode == 0, "\n".join([*errors, done.stdout[-4000:], done.stderr[-4000:]])
    assert result["ok"] is True
    assert result["device"] == "cpu" and result["compiler"] == "eager"
    rows = {row["config"]: row for row in result["one_rank"]["configs"]}
    assert list(rows) == ["none", "none again", "depth 1", "depth 2"]
    assert result["one_rank"]["backend"] == "gloo"
    for label in ("none again", "depth 1", "depth 2"):
        row = rows[label]
        assert row["losses_equal"] and row["grads_equal"] and row["max_grad_abs_diff"] == 0.0, label
        assert len(row["losses"]) == result["steps"] and row["losses"] == rows["none"]["losses"]
    for label in ("depth 1", "depth 2"):
        for before, after in rows[label]["collectives"].values():  # the pass did rewrite what ran
            assert after < before, label
    for label in ("none", "none again"):
        assert all(before == after for before, after in rows[label]["collectives"].values())
    fake = result["fake_group"]
    assert fake["world_size"] == 8
    assert [g["graph"] for g in fake["graphs"]] == ["forward", "backward"]
    for graph in fake["graphs"]:
        assert graph["fsdp_after"] < graph["fsdp_before"] and graph["compiled"], graph
    profile = result["one_rank"]["calibration"]["profile"]
    assert profile["mem_bandwidth"] > 0 and profile["calibration"]["world_size"] == 1
    for title in ("1. one rank, gloo", "2. 8 fake ranks", "calibrated profile 'gpu_check'"):
        assert title in done.stdout
