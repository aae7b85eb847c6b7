"""Running what a user runs (the command, their own Hydra app, a script) as a child held to the bounds bad input must
meet: bounded memory (an address-space limit, ``RLIMIT_AS``, of ``BOUND_BYTES``: a YAML bomb cannot take the
machine, it ends in ``MemoryError`` instead) and a bounded time (a subprocess timeout, never a timing assertion).

Issue 39 asks for a clear error within 5 s; Python, Hydra and pydantic alone take 2-4 s to start on 2 shared,
loaded cores, so the timeout is ``TIMEOUT_S``, and the seconds each bad input took are measured (not asserted) by
``benchmarks/bad_inputs.py``. What the bounds replace took 75-90 s or more (an alias bomb read by Hydra).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["BOUND_BYTES", "LIMITED", "TIMEOUT_S", "alias_bomb", "bad_yaml_files", "run_bounded", "script"]

BOUND_BYTES = 512 * 2**20
TIMEOUT_S = 30
LIMITED = [sys.executable, "-c", "import os, resource, sys; resource.setrlimit(resource.RLIMIT_AS, "
           f"({BOUND_BYTES}, {BOUND_BYTES})); os.execvp(sys.argv[1], sys.argv[1:])"]
"""A prefix running a command with at most ``BOUND_BYTES`` of address space (set, then the command exec'd in the
same process: no ``preexec_fn``, which is unsafe in a process with threads)."""


def run_bounded(args: Sequence[str], *, cwd: Path, env: Mapping[str, str] | None = None,
                timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """``args`` run in ``cwd`` with at most ``BOUND_BYTES`` of address space; ``subprocess.TimeoutExpired`` past
    ``timeout`` seconds. ``HYDRA_FULL_ERROR`` is dropped (users see Hydra's short reports)."""
    full = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    full.update(env or {})
    return subprocess.run([*LIMITED, *args], cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout,
                          check=False)


def script(path: Path, *args: str) -> list[str]:
    """The command line running the Python file ``path`` with this interpreter."""
    return [sys.executable, str(path), *args]


def alias_bomb(levels: int = 9) -> str:
    """A "billion laughs" YAML document: ``levels`` nested lists of 9 aliases (9**9 strings once expanded)."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 9)}]")
    return "\n".join(lines) + "\n"


def bad_yaml_files() -> dict[str, tuple[str, str]]:
    """``{kind: (YAML text, what the refusal says)}`` for the bad inputs of issue 39: an alias bomb, a 50 MB file
    (valid YAML: one mapping and a long comment), 3,000-deep nesting, an alias that contains itself."""
    return {
        "alias_bomb": (alias_bomb(), "values once aliases are expanded"),
        "fifty_megabytes": ("forward_prefetch: 1\n# " + "x" * (50 * 2**20) + "\n", "is more than 16,777,216 bytes"),
        "nested_3000_deep": ("a: " + "[" * 3000 + "]" * 3000 + "\n", "nesting"),
        "alias_to_itself": ("a: &a [1, *a]\n", "a value contains itself"),
    }
