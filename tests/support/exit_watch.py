"""Run a script as torchrun runs it, watched at its exit: ``exit_watch.py RUN_DIR SCRIPT [ARGS...]`` (or ``-m
MODULE [ARGS...]`` in place of ``SCRIPT``).

An ``atexit`` hook (atexit hooks run when Python starts finalizing) writes ``finalized_rank<N>.json`` into
``RUN_DIR`` with the threads still alive then (``/proc/self/task/*/comm``; gloo's are ``gloo_tcp_loop`` and
``pt_gloo_runloop``). A rank that ends without finalizing Python (``overlapcfg.exit_process``) writes nothing.
Finalizing under live gloo threads is what aborts a rank now and then after its last step ("terminate called
without an active exception"; ``overlapcfg.fsdp2.exit``): the watch turns that rare abort into a certain finding.
A rank still running after ``HANG_S`` prints its threads' stacks and exits, so a hang fails with where it hung.
Used by every torchrun the tests start: the recipe, README's blocks, the measure example and ``-m overlapcfg``.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import runpy
import sys
from pathlib import Path

GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")


def threads() -> list[str]:
    names = []
    for comm in sorted(Path("/proc/self/task").glob("*/comm")):
        try:
            names.append(comm.read_text().strip())
        except OSError:  # a thread that ended while we looked
            continue
    return names


def finalizing(run_dir: Path) -> None:
    (run_dir / f"finalized_rank{os.environ['RANK']}.json").write_text(json.dumps(threads()))


def finalized_under_gloo(run_dir: Path) -> dict[str, list[str]]:
    """Rank file -> threads alive, for the ranks that finalized Python with gloo threads still running."""
    found = {p.name: json.loads(p.read_text()) for p in run_dir.glob("finalized_rank*.json")}
    return {name: alive for name, alive in found.items() if any(t in GLOO_THREADS for t in alive)}


HANG_S = float(os.environ.get("OVERLAPCFG_TEST_HANG_S", "200"))
"""After this long a rank prints every thread's stack to stderr and exits (``faulthandler``): a rank that hangs
fails its test with where it hung, before the test's own timeout kills torchrun and its output with it."""


if __name__ == "__main__":
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    run_dir = Path(sys.argv[1])
    run_dir.mkdir(parents=True, exist_ok=True)
    atexit.register(finalizing, run_dir)
    if sys.argv[2] == "-m":
        module = sys.argv[3]
        sys.argv = [module, *sys.argv[4:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script = Path(sys.argv[2])
        sys.argv = [str(script), *sys.argv[3:]]
        sys.path.insert(0, str(script.parent))
        runpy.run_path(str(script), run_name="__main__")
