"""The strategy catalog is complete from the first import of the config layer, and stays torch-free until a graph
call is asked for: no import order leaves a built-in without its graph call."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from overlapcfg.config import contracts

_PROBE = textwrap.dedent("""
    import sys
    from overlapcfg.config import contracts
    names = contracts.strategy_names()
    declared = {n: contracts.contract_of(n) for n in names}
    assert {"manual", "torch_manual", "auto", "none"} <= set(names), names
    assert "torch" not in sys.modules, "declaring the catalog imported torch"
    calls = {n: c.graph_call() for n, c in declared.items()}
    import overlapcfg.strategies.manual as manual
    assert calls["manual"] is manual.run
    assert all(callable(call) for call in calls.values())
    print("ok", sorted(names))
""")


@pytest.mark.slow  # a fresh interpreter that imports torch, dynamo and the strategies: 3-4 CPU seconds
def test_every_builtin_strategy_is_runnable_after_importing_only_the_config_layer() -> None:
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok ['auto', 'manual', 'none', 'torch_manual'")


def test_each_builtin_names_the_module_of_its_graph_call() -> None:
    for name in ("manual", "torch_manual", "auto", "none"):
        contract = contracts.contract_of(name)
        assert contract.run is None and contract.defined_in is not None
        assert contract.defined_in.startswith("overlapcfg.strategies.")
