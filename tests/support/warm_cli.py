"""The ``overlapcfg`` console script (or a user's Python script) run as its own process, forked from a server that
has already imported what every run imports (torch, dynamo, Hydra, the command; or only the config layer for runs
refused before anything runs): one server per test process (``shared``) or per test module runs many commands.

Why this is still the command as users run it: each command is a process of its own (its own exit status, its own
stdout and stderr, its own working directory, environment and address-space limit, nothing of one run seen by the
next), running the console script's ``main`` (or the script as ``__main__``) with ``sys.argv`` and ``sys.path[0]`` as
``python`` sets them, and leaving the way that interpreter leaves (``SystemExit``'s status, an uncaught exception's
traceback and status 1, exit handlers run). What it skips is the seconds each interpreter spends
importing torch and the command's modules before reading its arguments: imports bind names in each module's own
globals, so having them done first hides nothing a run does after. (Two things it cannot show: whether a run imports
torch at all, and what a run's environment does to settings torch reads once at import, such as ``TORCH_LOGS`` or
inductor's ``TORCHINDUCTOR_*`` defaults, which keep the server's values; a test about either starts a fresh
interpreter instead.) The server itself never runs a command, so no
memo (the per-process trace of ``overlapcfg.demo.job``) carries from one run into another.

Protocol (``python tests/support/warm_cli.py MODULE...``, the modules to import first, with its stdin and stdout as
pipes): one JSON request a line, ``{"argv", "mode", "cwd", "env", "limit_as", "stdout", "stderr"}``; the server
forks, answers ``{"pid": N}``, and once the child has ended ``{"rc": status}`` (negative: killed by that signal).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import resource
import runpy
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

SCRIPT = Path(sys.executable).with_name("overlapcfg")
"""The console script, whose path the command sees as ``sys.argv[0]``."""
TRACED = ("torch", "torch._dynamo", "overlapcfg.__main__", "overlapcfg.demo.cli", "overlapcfg.demo.job",
          "overlapcfg.demo.tracing", "overlapcfg.demo.eager", "overlapcfg.report", "overlapcfg.passes",
          "overlapcfg.compat", "torch._inductor.pattern_matcher")
"""What a traced run imports first (a warm-up only: the child imports whatever else it needs itself). The last is
what aot's partitioner imports on a process's first compile (``tests/support/rank_warmup.py``)."""
CONFIG_ONLY = ("hydra", "omegaconf", "pydantic", "yaml", "rich", "overlapcfg", "overlapcfg.__main__",
               "overlapcfg.config", "overlapcfg.demo.cli")
"""What a run that stops at the config imports (no torch): for commands and apps refused before anything runs."""


def _child(request: dict[str, Any]) -> None:
    """In the forked child: become the requested process (``overlapcfg ARGS`` or ``python SCRIPT ARGS``) in
    ``cwd``, with ``env`` and an address-space limit if asked, and leave as that interpreter would."""
    if request["limit_as"] is not None:
        resource.setrlimit(resource.RLIMIT_AS, (request["limit_as"], request["limit_as"]))
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the server's requests are not the command's input
    os.close(devnull)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (fd 0, owned by the process)
    sys.argv = list(request["argv"])
    # PYTHONPATH's entries follow sys.path[0], as ``python`` puts them (the server's were read at its start)
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = extra
    if request["mode"] == "code":  # ``python -c CODE ARGS``: sys.argv[0] is "-c", sys.path[0] the working directory
        code = sys.argv.pop(1)
        sys.path[0] = ""
        main_module = types.ModuleType("__main__")
        sys.modules["__main__"] = main_module
        exec(compile(code, "<string>", "exec"), main_module.__dict__)
        sys.exit(0)
    # sys.path[0] as ``python`` sets it: the script's directory (this server's own is not the child's)
    sys.path[0] = str(Path(sys.argv[0]).resolve().parent)
    if request["mode"] == "script":  # ``python SCRIPT``, run as ``__main__``
        runpy.run_path(sys.argv[0], run_name="__main__")
    else:
        from overlapcfg.__main__ import main

        main()
    sys.exit(0)


def serve(preload: list[str]) -> None:
    for name in preload:
        importlib.import_module(name)
    gc.freeze()  # the inherited objects: never collected, so the children's collections skip them
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)  # leaves the process through SystemExit or an uncaught exception, as ``python`` does
        sys.stdout.write(json.dumps({"pid": pid}) + "\n")
        sys.stdout.flush()
        _, status = os.waitpid(pid, 0)
        sys.stdout.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        sys.stdout.flush()


class WarmCli:
    """A running server that has imported ``preload``; ``run`` is ``subprocess.run(argv, cwd=cwd, env=env,
    capture_output=True, text=True, timeout=timeout)`` through it, where ``argv`` is the console script's command
    line (``[SCRIPT, ...]``) or a Python script's (``[sys.executable, path, ...]``). ``limit_as``: the child's
    address-space limit in bytes (``RLIMIT_AS``), as ``tests/support/bounded.py`` sets it. A context manager:
    leaving it ends the server."""

    def __init__(self, preload: tuple[str, ...] = TRACED, env: dict[str, str] | None = None) -> None:
        self.env = dict(os.environ if env is None else env)
        """The server's environment, and each child's unless a run gives its own."""
        self._pending: Running | None = None
        self._outputs = Path(tempfile.mkdtemp(prefix="warm_cli_"))  # not the command's cwd: tests list that
        self._proc = subprocess.Popen([sys.executable, __file__, *preload], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env=self.env)
        self._unread = b""
        """Replies read from the server's pipe and not yet returned (it may send two lines before we read one)."""

    def _reply(self, timeout: float | None) -> dict[str, int]:
        """The server's next reply line. Read from the pipe's descriptor with a buffer of our own: ``select`` on
        the text stream would miss a line its buffer already holds (the pid and the status of a run that ended
        before we asked, read in one chunk), and wait out the whole timeout for a reply that had arrived."""
        stdout = self._proc.stdout
        assert stdout is not None
        fd = stdout.fileno()
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._unread:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if left is not None and not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the warm CLI server died (status {self._proc.wait()})")
            self._unread += chunk
        line, _, self._unread = self._unread.partition(b"\n")
        reply: dict[str, int] = json.loads(line)
        return reply

    def run(self, argv: list[str], *, cwd: Path, env: Mapping[str, str] | None = None,
            limit_as: int | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return self.start(argv, cwd=cwd, env=env, limit_as=limit_as).result(timeout)

    def start(self, argv: list[str], *, cwd: Path, env: Mapping[str, str] | None = None,
              limit_as: int | None = None) -> Running:
        """Start ``argv`` (as ``run``) and return at once, even while the server is still importing;
        ``.result(timeout)`` waits for it. One at a time."""
        if argv[0] == str(SCRIPT):
            mode, child_argv = "command", argv
        elif argv[0] == sys.executable and len(argv) > 2 and argv[1] == "-c":
            mode, child_argv = "code", argv[1:]
        elif argv[0] == sys.executable and len(argv) > 1 and not argv[1].startswith("-"):
            mode, child_argv = "script", argv[1:]
        else:
            raise ValueError(f"the warm server runs the console script, python SCRIPT or python -c, not {argv}")
        if self._pending is not None:  # started by a test that failed before reading it: its replies come first
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._pending.result(timeout=600)
        stdin: IO[str] | None = self._proc.stdin
        assert stdin is not None
        out, err = self._outputs / "stdout", self._outputs / "stderr"
        request = {"argv": [str(a) for a in child_argv], "mode": mode, "cwd": str(cwd),
                   "env": dict(self.env if env is None else env), "limit_as": limit_as,
                   "stdout": str(out), "stderr": str(err)}
        stdin.write(json.dumps(request) + "\n")
        stdin.flush()
        self._pending = Running(self, [str(a) for a in argv], out, err)
        return self._pending

    def close(self) -> None:
        """End the server (it ends by itself too once this process's end closes its input)."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
            self._proc.wait(timeout=60)
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        shutil.rmtree(self._outputs, ignore_errors=True)

    def __enter__(self) -> WarmCli:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


@dataclass
class Running:
    """A command started by ``WarmCli.start`` (the server answers with its pid once it has forked it)."""

    server: WarmCli
    argv: list[str]
    stdout: Path
    stderr: Path
    _pid: int | None = None

    def pid(self, timeout: float = 180) -> int:
        """The command's process id, once the server has forked it (for a test that signals the run mid-way; its
        output so far is in the files ``stdout`` and ``stderr``)."""
        if self._pid is None:
            try:
                self._pid = self.server._reply(timeout)["pid"]
            except TimeoutError:  # the server never forked it: end the server
                self.server._proc.kill()
                raise subprocess.TimeoutExpired(self.argv, timeout) from None
        return self._pid

    def result(self, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        assert self.server._pending is self, "a run's result is read once, before the server's next run"
        deadline = time.monotonic() + timeout
        pid = self.pid(timeout)
        self.server._pending = None
        try:
            rc = self.server._reply(max(0.0, deadline - time.monotonic()))["rc"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self.server._reply(None)
            raise subprocess.TimeoutExpired(self.argv, timeout) from None
        try:
            return subprocess.CompletedProcess(self.argv, rc, self.stdout.read_text(), self.stderr.read_text())
        finally:
            self.stdout.unlink()
            self.stderr.unlink()


_SHARED: list[WarmCli] = []


def shared() -> WarmCli:
    """This process's server (started on first use, ended when this process ends) with torch and the command
    imported, for every test module that runs the command or a script: one interpreter's imports per test process.

    Its interpreter runs with another ``PYTHONHASHSEED`` than this one's ("1", or "2" where this process runs with
    "1"; an unset seed here is a random one), and a forked child keeps its interpreter's hash seed: the tests that
    check a result is the same under two hash seeds run their other process here. (Any other run does not care which
    seed it gets, as a fresh interpreter's is random.)"""
    if not _SHARED:
        seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
        server = WarmCli(env={**os.environ, "PYTHONHASHSEED": seed})
        atexit.register(server.close)
        _SHARED.append(server)
    return _SHARED[0]


_TORCHRUN = "import runpy; runpy.run_module('torch.distributed.run', run_name='__main__', alter_sys=True)"


def torchrun(*args: str) -> list[str]:
    """The command line of ``python -m torch.distributed.run ARGS`` as this server runs it (``python -c``; the server
    has imported torch, which the launcher would spend seconds of CPU on importing again). Only the launcher is
    forked warm: the ranks it starts are fresh interpreters, as under any torchrun."""
    return [sys.executable, "-c", _TORCHRUN, *args]


if __name__ == "__main__":
    serve(sys.argv[1:])
