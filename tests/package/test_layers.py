"""The layered core holds: imports only run downwards (import-linter), and private APIs live in compat only."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import overlapcfg
from tests.support.package_source import package_modules

PACKAGE = Path(overlapcfg.__file__).parent
REPO = PACKAGE.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

# OmegaConf and torch names that are private or undocumented although not underscore-prefixed in their module.
_PRIVATE_NAMES = frozenset({"_get_full_key", "_get_node", "_metadata", "_get_flag", "_set_flag",
                            "_invalidate_flags_cache", "flop_registry", "sdpa_backward_flop_count"})


def _private_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, what)`` for every private torch/OmegaConf import or attribute use in a module's syntax tree."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        else:
            modules = []
        for module in modules:
            parts = module.split(".")
            if (parts[0] in ("torch", "omegaconf") and any(p.startswith("_") and not p.startswith("__")
                                                        for p in parts[1:])) or parts[-1] in _PRIVATE_NAMES:
                found.append((node.lineno, module))
        if isinstance(node, ast.Attribute):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            chain.reverse()
            private = [c for c in chain if c.startswith("_") and not c.startswith("__")]
            public_op = chain[:2] in (["ops", "aten"], ["ops", "prims"])  # aten._to_copy is a public op name
            if isinstance(base, ast.Name) and base.id == "torch" and private and not public_op:
                found.append((node.lineno, "torch." + ".".join(chain)))
            elif node.attr in _PRIVATE_NAMES:
                found.append((node.lineno, node.attr))
    return found


def test_private_torch_and_omegaconf_uses_live_in_compat_only() -> None:
    offenders = []
    for module in package_modules():
        parts = module.rel.split("/")
        if parts[0] == "compat" or "_hydra_plugin" in parts:
            continue
        offenders += [f"{module.rel}:{line}: {what}" for line, what in _private_uses(module.tree)]
    assert offenders == []


@pytest.mark.parametrize("source, expected", [
    ("import torch._inductor.config", ["torch._inductor.config"]),
    ("from torch._ops import OpOverload", ["torch._ops", "torch._ops.OpOverload"]),
    ("x = torch.ops._c10d_functional.wait_tensor", ["torch.ops._c10d_functional.wait_tensor"]),
    ("from torch.utils.flop_counter import flop_registry", ["torch.utils.flop_counter.flop_registry"]),
    ("key = node._get_full_key(None)", ["_get_full_key"]),
    ("import torch.distributed as dist\ndist.all_gather_into_tensor", []),
    ("x = torch.ops.aten._to_copy.default", []),
])
def test_the_private_use_check_catches_what_it_claims(source: str, expected: list[str]) -> None:
    """The guard above is only worth something if it fails on the forms private uses take."""
    found = [what for _, what in _private_uses(ast.parse(source))]
    assert sorted(set(found)) == sorted(expected) or (expected and set(expected) <= set(found))
    assert bool(found) == bool(expected)


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is a dev dependency")
def test_import_contracts_hold() -> None:
    out = subprocess.run([str(LINT_IMPORTS)], cwd=REPO, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "0 broken" in out.stdout


@pytest.mark.slow
@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is a dev dependency")
def test_import_contracts_fail_when_a_lower_layer_imports_the_demo(tmp_path: Path) -> None:
    shutil.copytree(PACKAGE, tmp_path / "overlapcfg", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    victim = tmp_path / "overlapcfg" / "graph" / "collectives.py"
    victim.write_text(victim.read_text() + "\nfrom overlapcfg.demo import llama  # noqa\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([str(LINT_IMPORTS)], cwd=tmp_path, capture_output=True, text=True, env=env, check=False)
    assert out.returncode != 0
    assert "overlapcfg.graph.collectives -> overlapcfg.demo" in out.stdout.replace("\n", " ") or \
        "overlapcfg.graph.collectives" in out.stdout, out.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is a dev dependency")
@pytest.mark.parametrize("victim, line, cycle", [
    # the two cycles issue 21 found: one for annotations only, one hidden inside a function
    ("config/contracts.py", "if TYPE_CHECKING:\n    from overlapcfg.config.overlap import OverlapConfig\n",
     "overlapcfg.config"),
    ("demo/job.py", "def _tune():\n    from overlapcfg.demo import tune_job  # noqa\n", "overlapcfg.demo"),
])
def test_import_contracts_fail_on_an_import_cycle_between_modules(tmp_path: Path, victim: str, line: str,
                                                                  cycle: str) -> None:
    shutil.copytree(PACKAGE, tmp_path / "overlapcfg", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    path = tmp_path / "overlapcfg" / victim
    text = path.read_text()
    path.write_text(text.replace("from typing import ", "from typing import TYPE_CHECKING, ", 1) + "\n" + line
                    if "TYPE_CHECKING" in line and "TYPE_CHECKING" not in text else text + "\n" + line)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tmp_path, capture_output=True, text=True, env=env,
                         check=False)
    assert out.returncode != 0
    assert f"No cycles are allowed in {cycle}." in out.stdout, out.stdout[-3000:]


_SHARED_BY_DESIGN = frozenset({"__init__.py", "__main__.py"})
"""Names Python gives every package (and ``python -m``); every other module name says what that one module holds."""


def _repeated_basenames(modules: list[Path]) -> dict[str, list[str]]:
    """``{file name: [its packages]}`` for every module name used in more than one package."""
    where: dict[str, list[str]] = {}
    for path in modules:
        if path.name not in _SHARED_BY_DESIGN:
            where.setdefault(path.name, []).append(path.parent.name)
    return {name: sorted(packages) for name, packages in where.items() if len(packages) > 1}


def test_no_two_packages_share_a_module_name() -> None:
    """Issue 38: ``result.py`` in three packages, ``run.py`` in two ...: a traceback, a profile or a grep for one of
    them named a file without saying which. The check itself: a tree with a repeated name is reported."""
    assert _repeated_basenames(sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)) == {}
    assert _repeated_basenames([Path("a/run.py"), Path("b/run.py"), Path("a/__init__.py"), Path("b/__init__.py"),
                                Path("b/plan.py")]) == {"run.py": ["a", "b"]}
