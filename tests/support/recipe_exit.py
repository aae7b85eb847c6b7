"""Run under torchrun by ``tests/multiprocess/test_recipe.py``: the recipe script as torchrun runs it, watched at
its exit.

An ``atexit`` hook (atexit hooks run when Python starts finalizing) writes ``finalized_rank<N>.json`` into the
run directory with the threads still alive then (``/proc/self/task/*/comm``; gloo's are ``gloo_tcp_loop`` and
``pt_gloo_runloop``). A rank that ends without finalizing Python writes nothing. ``argv[1]``: the run directory;
the rest: the recipe's overrides.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "train_llama" / "train.py"


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


if __name__ == "__main__":
    run_dir = Path(sys.argv[1])
    atexit.register(finalizing, run_dir)
    sys.argv = [str(RECIPE), f"hydra.run.dir={run_dir}", *sys.argv[2:]]
    sys.path.insert(0, str(RECIPE.parent))
    runpy.run_path(str(RECIPE), run_name="__main__")
