"""``overlapcfg mode=calibrate`` then ``mode=measure hardware=<that profile>``, under torchrun as users run them:
the first writes a profile the second finds by name; the second prints the predicted-vs-measured table and writes
``measure.json`` into the run directory. Small sizes and budgets: this checks the commands, not the machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.exit_watch import finalized_under_gloo
from tests.support.warm_cli import shared, torchrun

EXIT_WATCH = Path(__file__).resolve().parents[1] / "support" / "exit_watch.py"
SMALL = ["model.n_layers=1", "model.vocab_size=256", "batch=2", "seq_len=16"]
"""One layer: what is checked (the commands, their files and tables) does not depend on the depth, and every
measured config compiles the model on every rank (dynamo's and aot's time grows with the layers)."""
FEWER = ["~measure.configs.d0", "~measure.configs.d2", "~measure.configs.split_d1", "~measure.configs.torch_manual"]


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "OVERLAPCFG_SEARCHPATH")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU even on a GPU machine
    env["OVERLAPCFG_HOME"] = str(home)
    return env


def _torchrun(tmp_path: Path, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``torchrun -m overlapcfg *args``, watched at its exit: a rank that finalized Python under gloo's threads is
    a failure, certain here where the abort it risks is rare (``tests/support/exit_watch.py``). torchrun's launcher
    is forked warm (``tests/support/warm_cli.py``: it skips importing torch); the ranks are fresh interpreters."""
    watch = tmp_path / "exit"
    shutil.rmtree(watch, ignore_errors=True)
    cmd = torchrun("--nproc-per-node", "2", "--standalone", str(EXIT_WATCH), str(watch), "-m", "overlapcfg", *args)
    done = shared().run(cmd, cwd=tmp_path, env=_env(home), timeout=280)
    if done.returncode == 0:
        assert finalized_under_gloo(watch) == {}, args
    return done


@pytest.mark.slow
def test_calibrate_writes_a_profile_that_measure_finds_by_name(tmp_path: Path) -> None:
    # Sizes up to 16 MiB: their transfer time stands above a busy machine's noise (up to 1 MiB a loaded run could
    # time no growth with size, which calibrate rightly refuses to fit).
    home = tmp_path / "home"
    out = _torchrun(tmp_path, home, "mode=calibrate", *SMALL, "calibrate.name=ci_box", "calibrate.budget_s=3",
                    "calibrate.max_bytes=16MiB", "calibrate.cache_bytes=4MiB", f"hydra.run.dir={tmp_path / 'cal'}")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "calibrated profile 'ci_box'" in out.stdout and "hardware=ci_box" in out.stdout
    assert (home / "hardware" / "ci_box.yaml").read_text() == (tmp_path / "cal" / "ci_box.yaml").read_text()
    assert "cache as given (calibrate.cache_bytes)" in (home / "hardware" / "ci_box.yaml").read_text()

    out = _torchrun(tmp_path, home, "mode=measure", "hardware=ci_box", *SMALL, *FEWER, "measure.warmup=1",
                    "measure.steps=2", "measure.profiled_steps=1", f"hydra.run.dir={tmp_path / 'meas'}")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "predicted (ci_box) vs measured: gloo x 2" in out.stdout and "median |error|" in out.stdout
    data = json.loads((tmp_path / "meas" / "measure.json").read_text())
    assert data["hardware"]["name"] == "ci_box" and data["hardware"]["calibration"]["world_size"] == 2
    assert [c["name"] for c in data["configs"]] == ["none", "d1", "split_d2"]
    for c in data["configs"]:
        for key in ("predicted_step_s", "measured_step_s", "measured_spread_s", "predicted_exposed_s",
                    "measured_exposed_s"):
            assert isinstance(c[key], float) and c[key] >= 0, (c["name"], key)
    assert data["configs"][0]["overrides"] == {"strategy": "none"}
    assert (tmp_path / "meas" / "node_costs.json").is_file()


@pytest.mark.slow  # spawns a process (no torch: about a second)
@pytest.mark.parametrize("mode", ["calibrate", "measure"])
def test_outside_torchrun_says_how_to_launch_it_before_torch_is_imported(tmp_path: Path, mode: str) -> None:
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('TORCH', 'torch' in sys.modules))\n"
        f"sys.argv = ['overlapcfg', 'mode={mode}', *{SMALL!r}, 'hydra.run.dir={tmp_path / 'run'}']\n"
        "from overlapcfg.demo.cli import main\n"
        "main()\n"
    )
    env = {k: v for k, v in _env(tmp_path / "home").items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    out = subprocess.run([sys.executable, "-c", code], check=False, cwd=tmp_path, capture_output=True, text=True,
                         env=env, timeout=180)
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "Traceback" not in text, text
    assert f"torchrun --nproc-per-node 2 -m overlapcfg mode={mode}" in text
    assert "TORCH False" in out.stdout  # said before torch is imported and the demo traced


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "measure_steps" / "measure_steps.py"


def test_the_docs_show_the_measure_example_as_it_is() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "calibrate-measure.md").read_text()
    assert f"```python\n{EXAMPLE.read_text()}```" in page


EXAMPLE_SMALL = ["--layers", "1", "--budget-s", "2", "--steps", "2"]
"""The example's own options at their smallest useful values: what is checked (it calibrates, measures its three
configs and writes its files) does not depend on the depth, the calibration budget (each kind still times the ends
of its size range) or the number of timed steps, and each config compiles the model on every rank (dynamo's and
aot's time grows with the layers); its defaults are a user's first run, not this check's."""


@pytest.mark.slow
def test_the_measure_example_runs_under_torchrun(tmp_path: Path) -> None:
    cmd = torchrun("--nproc-per-node", "2", "--standalone", str(EXIT_WATCH), str(tmp_path / "exit"), str(EXAMPLE),
                   *EXAMPLE_SMALL)
    out = shared().run(cmd, cwd=tmp_path, env=_env(tmp_path / "home"), timeout=280)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert finalized_under_gloo(tmp_path / "exit") == {}  # it ends with overlapcfg.exit_process
    assert "predicted (my_cluster) vs measured" in out.stdout
    data = json.loads((tmp_path / "measure.json").read_text())
    assert [c["name"] for c in data["configs"]] == ["none", "depth 1", "depth 2"]
    assert data["steps"] == 2 and data["hardware"]["calibration"]["budget_seconds"] == 2  # the options were read
    assert (tmp_path / "home" / "hardware" / "my_cluster.yaml").is_file()
