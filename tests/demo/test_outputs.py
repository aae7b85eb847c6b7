"""Output files are written whole or not at all, and a run directory never mixes two runs' outputs."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
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


WRITER = """
import signal, sys, time
from pathlib import Path

from overlapcfg.files import write_atomic

signal.signal(signal.SIGINT, signal.default_int_handler)  # whatever the parent left SIGINT as
target, how = Path(sys.argv[1]), sys.argv[2]


def half_then_wait(path):
    with open(path, "w") as f:
        f.write("overlap:\\n  plan: llama_")  # a valid YAML prefix: loads as another config, without a word
        f.flush()
        print("half written", flush=True)
        time.sleep(120)
        f.write("layers\\n")


if how == "atomic":
    write_atomic(target, half_then_wait)
else:  # what a plain write does, to show the check below would see a half file
    half_then_wait(target)
"""


@pytest.mark.parametrize("how", ["atomic", "plain"])
def test_sigint_in_the_middle_of_a_write_leaves_the_previous_file_whole(tmp_path: Path, how: str) -> None:
    """A real SIGINT (Ctrl-C on ``mode=tune``) while the output is half written: the target still holds the previous
    run's file and no temporary is left (a plain write, the control, leaves the half file)."""
    import signal
    import subprocess
    import sys

    target = tmp_path / TUNED_FILE
    previous = "overlap:\n  plan: llama_layers\n"
    target.write_text(previous)
    (tmp_path / "writer.py").write_text(WRITER)
    child = subprocess.Popen([sys.executable, str(tmp_path / "writer.py"), str(target), how], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "half written\n"
        child.send_signal(signal.SIGINT)
        child.wait(timeout=60)
    finally:
        child.kill()
    assert child.returncode != 0
    if how == "atomic":
        assert target.read_text() == previous
        assert sorted(p.name for p in tmp_path.iterdir()) == [TUNED_FILE, "writer.py"]
    else:
        assert target.read_text() == "overlap:\n  plan: llama_"


def test_saving_a_profile_that_fails_half_way_keeps_the_previous_one(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``save_hardware`` (``mode=calibrate``) writes through the same atomic write: no half profile, no temporary."""
    import overlapcfg
    from overlapcfg.cost import hardware

    path = tmp_path / "mine.yaml"
    profile = overlapcfg.load_hardware("cpu_gloo").model_copy(update={"name": "mine"})
    overlapcfg.save_hardware(profile, path)
    before = path.read_bytes()

    def interrupted(target: Path, data: object) -> Path:
        from overlapcfg import files

        def half(tmp: Path) -> None:
            tmp.write_text(str(data)[:40])
            raise KeyboardInterrupt

        return files.write_atomic(target, half)

    monkeypatch.setattr(hardware, "write_atomic", interrupted)
    with pytest.raises(KeyboardInterrupt):
        overlapcfg.save_hardware(profile.model_copy(update={"latency": 1e-3}), path)
    assert path.read_bytes() == before and overlapcfg.load_hardware(path) == profile
    assert [p.name for p in tmp_path.iterdir()] == ["mine.yaml"]


CLI_INTERRUPTED = """
import signal, sys, time
from pathlib import Path

from overlapcfg import files
from overlapcfg.demo import job

signal.signal(signal.SIGINT, signal.default_int_handler)  # whatever the parent left SIGINT as
write = files.write_atomic


def report_written_slowly(path, data):
    if Path(path).name != "report.json":
        return write(path, data)

    def half_then_wait(tmp):
        tmp.write_text(str(data)[:100])  # the report's first bytes, then Ctrl-C arrives
        print("half written", flush=True)
        time.sleep(120)

    return write(path, half_then_wait)


job.write_atomic = report_written_slowly
sys.argv = ["overlapcfg", *sys.argv[1:]]
from overlapcfg.demo.cli import main

main()
"""


@pytest.mark.slow  # the command traces a 1-layer demo step before it writes
def test_ctrl_c_during_a_command_write_exits_130_with_one_line_and_leaves_no_half_file(tmp_path: Path) -> None:
    """Issue 39: Ctrl-C while the command wrote an output removed the temporary file but printed a Python
    traceback and ended with status -2 (killed by SIGINT). A real SIGINT to the command mid-write: status 130,
    one line, the run's earlier outputs (its ``.hydra`` config) whole, no half report, no temporary.

    The command is a process of its own forked warm (``tests/support/warm_cli.py``: torch and the command already
    imported, which the interrupt, arriving mid-write, does not depend on); its output is a file, read as it
    grows."""
    import signal
    import time

    from tests.support.warm_cli import shared

    run = tmp_path / "run"
    (tmp_path / "cli.py").write_text(CLI_INTERRUPTED)
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    running = shared().start([sys.executable, str(tmp_path / "cli.py"), "model.n_layers=1", f"hydra.run.dir={run}"],
                             cwd=tmp_path, env=env)
    pid, deadline, alive = running.pid(), time.monotonic() + 180, True
    try:
        while "half written\n" not in (running.stdout.read_text() if running.stdout.exists() else ""):
            try:
                os.kill(pid, 0)  # still running (the server reaps it as soon as it ends)
            except ProcessLookupError:
                alive = False
                pytest.fail(f"the command ended before writing its report: {running.result(timeout=60)}")
            assert time.monotonic() < deadline, "the command wrote no report within 180 s"
            time.sleep(0.05)
        config = (run / ".hydra" / "config.yaml").read_text()
        os.kill(pid, signal.SIGINT)
        alive = False  # from here its end is waited for (and a run past the timeout killed) by ``result``
        done = running.result(timeout=60)
    finally:
        if alive:  # a failed wait for the half-written report: end the run, which the server then reaps
            os.kill(pid, signal.SIGKILL)
    err = done.stderr
    assert done.returncode == 130, err
    assert [line for line in err.splitlines() if line.strip()] == [
        "overlapcfg: interrupted (Ctrl-C); every file written so far is whole"]
    assert (run / ".hydra" / "config.yaml").read_text() == config
    assert not (run / "report.json").exists()
    assert not list(run.glob(".*.tmp*"))


def test_ctrl_c_while_the_command_is_still_importing_exits_130_with_one_line(tmp_path: Path) -> None:
    """Found by a review: Ctrl-C in the command's first half second (Python importing Hydra, rich and the config
    layer) printed the import machinery's ``KeyboardInterrupt`` traceback and ended with status -2. The console
    script's entry point imports the command itself; here the import is made to raise ``KeyboardInterrupt`` as a
    real Ctrl-C at that moment would, deterministically (no race with the interpreter's start)."""
    script = tmp_path / "interrupted_import.py"
    script.write_text(
        "import sys\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'overlapcfg.demo.cli':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Interrupt())\n"
        "from overlapcfg.__main__ import main\n"
        "main()\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 130, out.stderr
    assert out.stderr.splitlines() == ["overlapcfg: interrupted (Ctrl-C) while starting; nothing was written"]
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_the_console_script_enters_through_the_guarded_entry_point() -> None:
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "overlapcfg"]
    assert script.value == "overlapcfg.__main__:main"
