"""The pass is a function of the graph: the same traced model gives the same code in every process, whatever
``PYTHONHASHSEED`` and whichever graph is rewritten first.

A process of an interpreter started with a ``PYTHONHASHSEED`` other than this process's (forked from
``tests/support/warm_cli.shared``, which has imported torch, and keeps its hash seed) traces a 2-layer
reshard-after-forward model, applies ``manual`` with k = d = 2 to backward then forward, and prints a hash of each
``gm.code`` and the digest of each graph's schedule fingerprint (what the same-schedule check compares across
ranks); this process applies the same config to forward then backward of its own trace of the same model, and both
must agree. One other process is enough for both properties: two hash seeds (its and this process's, chosen to
differ) and two graph orders; a second one with a third seed would trace again to check nothing more.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.traces import ApplyFn, traced_step
from tests.support.warm_cli import Running, shared

pytestmark = pytest.mark.slow

CFG = {"plan": "llama_layers", "policy": {"forward_prefetch": 2, "backward_prefetch": 2,
                                          "reduce_scatter_delay": 2}}

SCRIPT = textwrap.dedent("""
    import copy, hashlib, json, sys
    from overlapcfg.compat import fake_process_group
    from overlapcfg.demo import LlamaConfig
    from overlapcfg.passes import apply
    from overlapcfg.demo.tracing import trace_train_step

    from overlapcfg import load_config

    cfg = load_config(json.loads(sys.argv[1]))
    step = trace_train_step(LlamaConfig(n_layers=2), world_size=2, rank=0, reshard_after_forward=True)
    out = {}
    for name in sys.argv[2:]:
        gm = copy.deepcopy(step.graph(name))
        with fake_process_group(step.world_size, step.rank):
            apply(gm, cfg, module_fqn_fn=step.module_fqn_fn(name), module_fqns=step.module_fqns,
                  graph_kind=name)
        out[name] = hashlib.sha256(gm.code.encode()).hexdigest()
        out[name + " schedule"] = gm.meta["overlapcfg"].schedule.digest()
    print("RESULT " + json.dumps(out, sort_keys=True))
""")


def _digest(code: str) -> str:
    return hashlib.sha256(code.encode()).hexdigest()


def _spawn(order: list[str]) -> Running:
    """``python -c SCRIPT`` under another hash seed than this process's, started (``tests/support/warm_cli.shared``)."""
    return shared().start([sys.executable, "-c", SCRIPT, json.dumps(CFG), *order], cwd=Path.cwd())


def _result(proc: Running) -> dict[str, str]:
    done: subprocess.CompletedProcess[str] = proc.result(timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_same_code_under_two_hash_seeds_and_graph_orders(applied: ApplyFn) -> None:
    # Another seed than this process's (an unset PYTHONHASHSEED here is a random one, or 0 = no randomization).
    proc = _spawn(["backward", "forward"])
    step = traced_step(2, True)  # this process (its own hash seed, a session-shared trace), while the other runs
    here = {}
    for name in ("forward", "backward"):
        gm = applied(step, name, CFG)
        here[name], here[f"{name} schedule"] = _digest(gm.code), gm.meta["overlapcfg"].schedule.digest()
    there = _result(proc)
    assert set(there) == set(here) == {"forward", "forward schedule", "backward", "backward schedule"}
    assert here == there


def test_applying_twice_in_one_process_gives_identical_code(applied: ApplyFn) -> None:
    step = traced_step(2, True)
    for name in ("forward", "backward"):
        assert applied(step, name, CFG).code == applied(step, name, CFG).code
