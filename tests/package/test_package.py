"""The package surface: every advertised name resolves, and importing it stays cheap."""

from __future__ import annotations

import json
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


_FRESH_IMPORTS = Path(__file__).parents[1] / "support" / "fresh_imports.py"
_THIRD_PARTY = ("torch", "torch._dynamo", "hydra", "omegaconf", "pydantic")
"""What the package's modules import most, for the check's root process to import once (speed only: the script
finds and imports the rest itself)."""


def _import_each(package: str, modules: list[str], preload: tuple[str, ...] = (),
                 pythonpath: Path | None = None) -> dict[str, object]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), *filter(None, [env.get("PYTHONPATH")])])
    first = [f"--preload={name}" for name in preload]
    out = subprocess.run([sys.executable, str(_FRESH_IMPORTS), package, *modules, *first], capture_output=True,
                         text=True, check=False, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow  # ~190 module imports in forked processes and torch's import: tens of seconds on 2 cores
def test_every_module_imports_on_its_own_in_a_fresh_interpreter():
    """Import order must not matter (no cycle hidden by whichever module happened to be imported first, no module
    relying on what another one set up), and after importing every submodule the package's exports are still
    classes and functions, not same-named modules.

    Each module is imported as the first of overlapcfg's modules, as in a new interpreter, by
    ``tests/support/fresh_imports.py``: one process imports the third-party libraries (never overlapcfg: it checks),
    then each module is imported in a process forked from the one that imported its parent package and nothing
    else of overlapcfg. That is the same sequence a new interpreter runs (``import a.b.c`` imports ``a``, then
    ``a.b``, fully, then ``c``), so the check is the one a fresh interpreter per module makes, without importing
    torch and the packages' ``__init__`` modules ~190 times. torch being imported first hides nothing a module
    forgot to import: names bind in the module's own globals (the next test shows the check failing)."""
    result = _import_each("overlapcfg", _modules(), preload=_THIRD_PARTY)
    assert result["failed_alone"] == {}, "\n\n".join(f"{k}:\n{v}" for k, v in result["failed_alone"].items())
    assert result["failed_together"] == [] and result["shadowed"] == [], result


_ORDER_DEPENDENT = {
    "__init__.py": "",
    "fine.py": "import json\nVALUE = json.dumps(1)\n",
    "setup.py": "import orderpkg\norderpkg.shared = {}\n",
    "user.py": "import orderpkg\norderpkg.shared['user'] = 1\n",
    "cycle_a.py": "A = 1\nfrom orderpkg.cycle_b import B\n",
    "cycle_b.py": "from orderpkg.cycle_a import A\nB = A\n",
    "sub/__init__.py": "",
    "sub/early.py": "import orderpkg.sub\norderpkg.sub.flag = True\n",
    "sub/late.py": "import orderpkg.sub\nassert orderpkg.sub.flag\n",
}
"""A package whose modules all import when imported in file order, and three of which fail when imported first:
``user`` uses what ``setup`` sets up, ``cycle_b`` enters a cycle from the side that needs the other half done, and
``sub.late`` (one package down) uses what ``sub.early`` sets."""


@pytest.mark.slow  # guards the check above; starts a process tree
def test_the_fresh_import_check_finds_modules_that_need_another_imported_first(tmp_path):
    for rel, text in _ORDER_DEPENDENT.items():
        (tmp_path / "orderpkg" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "orderpkg" / rel).write_text(text)
    modules = ["orderpkg", "orderpkg.cycle_a", "orderpkg.cycle_b", "orderpkg.fine", "orderpkg.setup",
               "orderpkg.user", "orderpkg.sub", "orderpkg.sub.early", "orderpkg.sub.late"]
    result = _import_each("orderpkg", modules, pythonpath=tmp_path)
    assert result["failed_together"] == []
    failed = result["failed_alone"]
    assert isinstance(failed, dict) and sorted(failed) == ["orderpkg.cycle_b", "orderpkg.sub.late", "orderpkg.user"]
    assert "cannot import name 'B' from partially initialized module 'orderpkg.cycle_b'" in failed["orderpkg.cycle_b"]
    assert "has no attribute 'shared'" in failed["orderpkg.user"]
    assert "has no attribute 'flag'" in failed["orderpkg.sub.late"]


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
