"""Test files that must run in an interpreter of their own, each run here in a fresh one.

``tensor_parallel_isolated.py`` compiles torchtitan's FSDP + tensor-parallel Llama (sequence parallel, a 2 x 2
mesh). Once the demo's FSDP + TP model has been compiled in the same process (several test files do; any backend,
``torch._dynamo.reset()`` after), torch 2.13 mis-shapes torchtitan's sequence-parallel activations at trace time
(``add`` of ``[2, 8, 64]`` and ``[2, 16, 64]``, both ``Shard(1)``). No config, dynamo reset or DTensor cache clear we
found undoes it, and which worker ran what before decides it: a test that fails by the order of the suite is a
flaky test. Its file is named so that pytest does not collect it with the others; here it runs alone, and each of
its tests must pass (none skipped).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
FILES = ("tensor_parallel_isolated.py",)


@pytest.mark.slow
@pytest.mark.parametrize("name", FILES)
def test_a_file_that_needs_a_fresh_interpreter_passes_in_one(name: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / name)],
                          cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=900, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert re.search(r"\b\d+ passed\b", summary) and not re.search(r"skipped|error|failed", summary), summary


def test_no_file_meant_for_its_own_interpreter_is_collected_with_the_others() -> None:
    """pytest collects ``test_*.py``: an isolated file named so would run twice, once in the shared process."""
    assert all(not name.startswith("test_") and (HERE / name).is_file() for name in FILES)
