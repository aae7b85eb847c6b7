"""Output files are written whole or not at all, and a run directory never mixes two runs' outputs."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from overlapcfg.demo.outputs import OUTPUT_FILES, TUNED_FILE, clear_outputs
from overlapcfg.files import write_atomic


def test_a_write_that_fails_half_way_leaves_the_previous_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / TUNED_FILE
    write_atomic(target, "overlap:\n  plan: llama_layers\noverrides:\n- {match: layers.0, forward_prefetch: 0}\n")
    before = target.read_bytes()

    def killed(path: Path) -> None:
        path.write_text("overlap:\n  plan: llama_")  # a valid YAML prefix: a plain write would leave this
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomic(target, killed)
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [TUNED_FILE]


def test_an_atomic_write_replaces_the_file_with_the_usual_permissions(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "report.json"
    write_atomic(target, b"{}")
    write_atomic(target, "{\"a\": 1}")
    assert target.read_text() == "{\"a\": 1}"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask  # not mkstemp's 0600
    assert [p.name for p in target.parent.iterdir()] == ["report.json"]


def test_clearing_a_run_directory_removes_every_mode_s_outputs_and_stale_temporaries_only(tmp_path: Path) -> None:
    for name in (*OUTPUT_FILES, f".{TUNED_FILE}.123.abcd.tmp.yaml", "notes.txt"):
        (tmp_path / name).write_text("x")
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text("- mode=tune\n")
    removed = clear_outputs(tmp_path)
    assert sorted(removed) == sorted([*OUTPUT_FILES, f".{TUNED_FILE}.123.abcd.tmp.yaml"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hydra", "notes.txt"]
