"""Time to error and peak memory for each bad input of issue 39, on the routes users take.

Each case runs as a child process with at most 512 MiB of address space (``RLIMIT_AS``) and a timeout, from a
scratch directory outside the repository: the ``overlapcfg`` command (a hardware profile in ``$OVERLAPCFG_HOME``, a
preset under ``--config-dir``, a node-costs file), a user's own app (``overlapcfg.hydra_main``), the compose API
(``hydra_overrides``) and Python (``load_hardware``). Prints a table (seconds to exit, peak resident memory, exit
status, the first line of the message) and writes JSON.

    python benchmarks/bad_inputs.py [--out bad_inputs.json] [--timeout 90] [--pythonpath /tmp/main-checkout]

``--pythonpath`` runs another checkout's ``overlapcfg`` (put first on ``PYTHONPATH``), for before/after numbers;
a route that checkout lacks fails at once and says so. The user's app and the memory bound are the tests' own
(``tests.support.user_app``, ``tests.support.bounded``): the benchmark times what tests/config/test_hydra_files.py
checks. Timings depend on the machine's
load: report ``uptime`` with them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' support modules, from any directory

from tests.support.bounded import LIMITED, alias_bomb
from tests.support.user_app import user_app

COMMAND = str(Path(sys.executable).with_name("overlapcfg"))
H100 = Path(__file__).resolve().parents[1] / "conf" / "hardware" / "h100_nvlink.yaml"
PYTHON = """
import sys
from pathlib import Path
import overlapcfg

try:
    print("RESULT", overlapcfg.load_hardware(Path(sys.argv[1])).name)
except overlapcfg.OverlapcfgError as err:
    sys.exit(str(err))
"""


def _fifty_megabytes(path: Path) -> None:
    with path.open("w") as f:  # in chunks: a child started later counts this process's peak memory as its own
        f.write("forward_prefetch: 1\n# ")
        for _ in range(50):
            f.write("x" * 2**20)
        f.write("\n")


YAML = {
    "alias bomb": lambda path: path.write_text(alias_bomb()),
    "50 MB file": _fifty_megabytes,
    "3,000-deep nesting": lambda path: path.write_text("a: " + "[" * 3000 + "]" * 3000 + "\n"),
    "alias to itself": lambda path: path.write_text("a: &a [1, *a]\n"),
}
"""Each bad file's writer. Nothing large is ever held here: Linux counts a parent's peak resident memory in the
peak of every child it starts afterwards (the high-water mark survives ``fork`` and ``exec``), which would make
every row read 100 MB."""


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> dict[str, object]:
    """Run one case: seconds to exit, the child's peak resident memory (``wait4``), exit status, what it said."""
    with tempfile.TemporaryFile("w+") as out:
        start = time.perf_counter()
        child = subprocess.Popen([*LIMITED, *args], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - start > timeout:
                child.kill()
                os.wait4(child.pid, 0)
                return {"seconds": None, "max_rss_mb": None, "status": "timed out",
                        "says": f"no answer in {timeout:g} s"}
            time.sleep(0.02)
        seconds = time.perf_counter() - start
        out.seek(0)
        text = out.read()
    code = os.waitstatus_to_exitcode(status)
    lines = [line.strip() for line in text.splitlines()
             if line.strip() and not line.startswith(("Error executing job", "Set the environment"))]
    trace = next((line for line in lines if line.startswith("Traceback")), None)
    says = f"{trace} ... {lines[-1]}" if trace else " / ".join(lines[:2])
    return {"seconds": round(seconds, 2), "max_rss_mb": round(usage.ru_maxrss / 1024), "status": code,
            "says": says[:160]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bad_inputs.json"))
    parser.add_argument("--timeout", type=float, default=90.0)
    parser.add_argument("--pythonpath", default=None)
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    if args.pythonpath:
        env["PYTHONPATH"] = args.pythonpath
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        home, extra, app = root / "home", root / "extra", root / "app"
        for d in (home / "hardware", extra / "overlap" / "policy"):
            d.mkdir(parents=True)
        user_app(app, {})
        (root / "python.py").write_text(PYTHON)
        run = [f"hydra.run.dir={root / 'run'}"]
        cases: list[tuple[str, str, list[str], Path, dict[str, str]]] = []
        for i, (kind, make) in enumerate(YAML.items()):
            name = f"bad{i}"
            for d in (home / "hardware", extra / "overlap" / "policy", app / "conf" / "overlap" / "policy"):
                make(d / f"{name}.yaml")
            homed = {**env, "OVERLAPCFG_HOME": str(home)}
            cases += [
                (kind, "command: hardware=<file>", [COMMAND, f"hardware={name}", *run], root, homed),
                (kind, "command: preset under --config-dir", [COMMAND, "--config-dir", str(extra),
                                                              f"overlap.policy={name}", *run], root, env),
                (kind, "user app (hydra_main)", [sys.executable, "app.py", "main", f"trainer.overlap.policy={name}",
                                                 *run], app, env),
                (kind, "compose API (hydra_overrides)", [sys.executable, "compose.py", str(app / "conf"),
                                                         f"trainer.overlap.policy={name}"], app, env),
                (kind, "Python (load_hardware)", [sys.executable, str(root / "python.py"),
                                                  str(home / "hardware" / f"{name}.yaml")], root, env),
            ]
        shutil.copy(H100, home / "hardware" / "nan.yaml")
        (home / "hardware" / "quoted.yaml").write_text(H100.read_text().replace("mem_bandwidth: 3.35e12",
                                                                                "mem_bandwidth: '1e12'"))
        (root / "deep.json").write_text('{"schema": "overlapcfg.node_costs/1", "graphs": ' + "[" * 100_000
                                        + "]" * 100_000 + "}")  # 200 kB: the parent's memory barely moves
        (root / "dup.json").write_text('{"schema": "overlapcfg.node_costs/1", "graphs": {}, "graphs": {}}')
        homed = {**env, "OVERLAPCFG_HOME": str(home)}
        cases += [
            ("profile named nan", "command: hardware=nan --cfg job", [COMMAND, "--cfg", "job", "hardware=nan"], root,
             homed),
            ("mem_bandwidth: '1e12'", "command: hardware=quoted", [COMMAND, "hardware=quoted", "model.n_layers=1",
                                                                   *run], root, homed),
            ("overlap.policy=null", "command", [COMMAND, "overlap.policy=null", "model.n_layers=1", *run], root, env),
            ("100,000-deep node costs", "command: mode=tune", [COMMAND, "mode=tune", "hardware=h100_nvlink",
                                                               f"tune.node_costs={root / 'deep.json'}", *run], root,
             env),
            ("duplicate key in node costs", "command: mode=run", [COMMAND, "model.n_layers=1",
                                                                  f"tune.node_costs={root / 'dup.json'}", *run],
             root, env),
        ]
        for kind, route, argv, cwd, case_env in cases:
            result = _run(argv, cwd, case_env, args.timeout)
            rows.append({"input": kind, "route": route, **result})
            print(f"{kind:28} {route:36} {result['seconds'] or '-':>7} s {result['max_rss_mb'] or '-':>5} MB "
                  f"exit {result['status']!s:>9}  {result['says']}", flush=True)
    load = os.getloadavg()
    args.out.write_text(json.dumps({"load_average": load, "pythonpath": args.pythonpath, "rows": rows}, indent=1))
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; wrote {args.out}")


if __name__ == "__main__":
    main()
