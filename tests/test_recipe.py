"""The ``examples/train_llama`` recipe under torchrun: 2 ranks on gloo, 3 steps, and the pass changes no loss."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from overlapcfg.demo.gloo import free_port

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "train_llama" / "train.py"


def train(tmp_path: Path, name: str, *overrides: str) -> list[float]:
    losses = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU even on a GPU machine: the test compares bits, not speed
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(RECIPE), "steps=3", f"losses_file={losses}", f"hydra.run.dir={tmp_path / name}", *overrides]
    out = subprocess.run(cmd, check=False, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "step 2 loss" in out.stdout + out.stderr
    return json.loads(losses.read_text())


@pytest.mark.slow
def test_recipe_losses_equal_the_unoverlapped_run(tmp_path):
    overlapped = train(tmp_path, "manual", "overlap/policy=aggressive", "overlap.verify=true")
    baseline = train(tmp_path, "none", "overlap.strategy=none")
    assert len(overlapped) == 3 and all(loss == loss for loss in overlapped) and len(set(overlapped)) > 1
    assert overlapped == baseline
    # ... and not because the pass did nothing: rank 0 logged the merge of forward and backward collectives.
    log = (tmp_path / "manual" / "rank0.log").read_text()
    assert "overlapcfg[manual]: 21 -> 4 FSDP collectives" in log, log[-2000:]
    assert "overlapcfg[manual]: 41 -> 7 FSDP collectives" in log, log[-2000:]
