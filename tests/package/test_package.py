"""The package surface: every advertised name resolves, and importing it stays cheap."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import overlapcfg


def test_every_exported_name_resolves_to_a_class_or_function():
    assert set(overlapcfg.__all__) - {"__version__"} == set(overlapcfg._EXPORTS)
    for name in overlapcfg._EXPORTS:
        value = getattr(overlapcfg, name)
        assert callable(value) and not isinstance(value, type(overlapcfg)), f"overlapcfg.{name} is {value!r}"


def test_exports_are_listed_once_and_the_type_checking_imports_match_them():
    """``_EXPORTS`` is the one table; ``__all__`` and the ``TYPE_CHECKING`` imports, which linters, type checkers
    and IDEs read instead, must say the same, or an editor shows one ``HardwareProfile`` and the package hands out
    another."""
    import ast

    tree = ast.parse(Path(overlapcfg.__file__).read_text())
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    typed = {alias.name: node.module for node in block.body if isinstance(node, ast.ImportFrom)
             for alias in node.names}
    assert typed == overlapcfg._EXPORTS
    assert sorted(overlapcfg.__all__) == sorted(["__version__", *overlapcfg._EXPORTS])
    assert len(overlapcfg.__all__) == len(set(overlapcfg.__all__))


def _modules() -> list[str]:
    import pathlib

    root = pathlib.Path(overlapcfg.__file__).parent
    names = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        if "_hydra_plugin" in rel.parts or rel.name == "__main__":
            continue
        names.append(".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts))
    return names


@pytest.mark.slow  # one process importing every module and torch: tens of seconds on 2 cores
def test_every_module_imports_on_its_own_in_a_fresh_interpreter(tmp_path):
    """Import order must not matter (no cycle hidden by whichever module happened to be imported first), and after
    importing every submodule the package's exports are still classes and functions, not same-named modules.

    One interpreter, but overlapcfg is dropped from ``sys.modules`` before each import: every module is imported
    first, without paying for torch's import each time. Bytecode is written (into ``tmp_path``, not the checkout)
    even where the environment says not to: each of the ~200 re-imports would otherwise compile the package's
    modules from source again."""
    code = (
        "import importlib, sys, torch, hydra\n"
        "failed = []\n"
        "for name in sys.argv[1:]:\n"
        "    for loaded in [m for m in sys.modules if m == 'overlapcfg' or m.startswith('overlapcfg.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as err:\n"
        "        failed.append(f'{name}: {type(err).__name__}: {err}')\n"
        "import overlapcfg\n"
        "bad = [n for n in overlapcfg._EXPORTS if type(getattr(overlapcfg, n)).__name__ == 'module']\n"
        "print('FAILED', failed, 'SHADOWED', bad) if failed or bad else print('OK')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code, *_modules()], capture_output=True, text=True, check=True,
                         env=env)
    assert out.stdout.strip().splitlines()[-1] == "OK", out.stdout


def test_unknown_attribute_raises_attribute_error():
    try:
        overlapcfg.no_such_thing  # noqa: B018
    except AttributeError as err:
        assert "no_such_thing" in str(err)
    else:  # pragma: no cover
        raise AssertionError("expected AttributeError")


NO_TORCH: dict[str, tuple[str, tuple[str, ...]]] = {
    "import overlapcfg": ("import overlapcfg", ("torch",)),
    "load_config": ("import overlapcfg; overlapcfg.load_config({'plan': 'llama_layers'})", ("torch",)),
    "patterns and resolution": (
        "from overlapcfg import load_config; from overlapcfg.config.patterns import compile_pattern; "
        "from overlapcfg.resolve import resolve_plan; compile_pattern('layers.0:2.**'); "
        "resolve_plan(load_config({'plan': {'buckets': ['layers.*']}}).plan, ['', 'layers', 'layers.0'])",
        ("torch",)),
    "hydra plugin": ("import hydra_plugins.overlapcfg_searchpath.overlapcfg_searchpath as m; m.overlapcfg_conf_dir()",
                     ("torch", "overlapcfg")),
}
"""What must stay torch-free, and the modules it must not import: the config layer and plan resolution (used
where torch is not installed or not wanted yet), and the Hydra plugin, which Hydra imports in every app."""


@pytest.mark.parametrize("case", list(NO_TORCH))
def test_torch_free_entry_points_import_no_torch(case: str) -> None:
    statement, forbidden = NO_TORCH[case]
    code = f"import sys\n{statement}\nprint(sorted(n for n in {forbidden!r} if n in sys.modules))"
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(overlapcfg.__file__).parents[1], env=env,
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", f"{case} imported {out.stdout.strip()}"
