"""``overlapcfg mode=diagnose trace=<dir>``: the tables, ``diagnose.json`` and the timeline in the run directory; a
missing ``trace`` or a bad file is one line, no traceback."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support.warm_cli import SCRIPT, shared

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``overlapcfg mode=diagnose ARGS`` in a process of its own, forked warm (``tests/support/warm_cli.py``: the
    interpreter has imported the command already; the diagnosis it runs is the run's own)."""
    return shared().run([str(SCRIPT), "mode=diagnose", f"hydra.run.dir={tmp_path}", *args], cwd=tmp_path,
                        timeout=240)


@pytest.mark.slow
def test_the_command_prints_the_diagnosis_and_writes_it_beside_one_steps_timeline(tmp_path: Path) -> None:
    out = _run(tmp_path, f"trace={FIXTURES / 'gpu_fsdp2'}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "per bucket" in out.stdout and "verdict:" in out.stdout
    data = json.loads((tmp_path / "diagnose.json").read_text())
    assert data["schema"] == "overlapcfg.diagnose/1" and data["unattributed"] == 0
    assert (tmp_path / "diagnose_timeline.png").stat().st_size > 10_000
    (tmp_path / "again").mkdir()
    missing = _run(tmp_path / "again")
    assert missing.returncode == 1 and "trace: mode=diagnose reads" in missing.stderr
    assert "Traceback" not in missing.stderr
