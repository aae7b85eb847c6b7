"""Import each module of a package as the first of that package's modules, in one process tree (a script: run it as
``python tests/support/fresh_imports.py PACKAGE MODULE...``; it prints one JSON object and imports nothing of
PACKAGE in its own process).

Why a process tree and not a fresh interpreter per module: a fresh ``import pkg.sub.mod`` runs exactly this sequence
-- import ``pkg`` (all of its ``__init__``), then ``pkg.sub``, then ``pkg.sub.mod`` -- because Python imports a
module's parent packages, fully, before the module. So a process that has imported ``pkg.sub`` and nothing else of
``pkg`` is exactly where every fresh ``import pkg.sub.<x>`` stands after its first two steps: forking it once per
member of ``pkg.sub`` gives each member the same start a new interpreter would, without repeating the packages'
imports. Third-party libraries (torch, pydantic, Hydra, ...) are imported once in the root process first; that
cannot hide a missing ``import`` in a module of ``pkg``, since a module's names bind in its own globals. (It can hide
one thing: a module reaching ``torch.x.y`` through attributes without importing ``torch.x.y``, where nothing it
imports does either; the one-interpreter loop this replaced hid that as well.)

Steps: (0) the root imports the ``--preload`` modules; (1) a first child imports every module, one after the other,
and reports the third-party modules this loaded and which names of ``PACKAGE._EXPORTS`` (if it has that table) are
modules afterwards (a submodule named like an export replaces it as the package's attribute); (2) the root imports
those third-party modules too (for speed only: one that fails is skipped) and checks that no module of PACKAGE came
with them; (3) the tree: each module is imported in a child forked from the process that imported its parent package,
which writes ``ok`` or the traceback to a file.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import inspect
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path


def _ours(package: str) -> list[str]:
    return [m for m in sys.modules if m == package or m.startswith(package + ".")]


def _in_child(work: Callable[..., None], *args: object) -> int:
    """Fork; the child runs ``work(*args)`` and ends without running exit handlers (they belong to the parent)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            work(*args)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _import_all(package: str, names: list[str], out: Path) -> None:
    third_party_before = set(sys.modules)
    failed = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as err:
            failed.append(f"{name}: {type(err).__name__}: {err}")
    exports = getattr(sys.modules.get(package), "_EXPORTS", {})
    shadowed = [n for n in exports if type(getattr(sys.modules[package], n)).__name__ == "module"]
    third_party = [m for m in sys.modules if m not in third_party_before and m not in set(_ours(package))]
    out.write_text(json.dumps({"failed": failed, "shadowed": shadowed, "third_party": third_party}))


def _visit(name: str, members: dict[str, list[str]], out: Path) -> None:
    """Import ``name`` here (its parent package is imported, nothing else of the package is), record the outcome,
    then do the same for each of its members in a fork of this process."""
    try:
        importlib.import_module(name)
    except BaseException:
        (out / name).write_text(traceback.format_exc())
        return
    (out / name).write_text("ok")
    gc.freeze()
    for member in members.get(name, []):
        _in_child(_visit, member, members, out)


def _preload(names: list[str]) -> None:
    """Import third-party modules here, once, for every child to inherit (a warm-up: one that fails to import is
    left to the children)."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:
            continue


def main(package: str, names: list[str], preload: list[str]) -> dict[str, object]:
    assert not _ours(package), f"{package} is imported before the check starts: {_ours(package)}"
    _preload(preload)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        _in_child(_import_all, package, names, out / "all.json")
        together = json.loads((out / "all.json").read_text())
        _preload(together["third_party"])
        preloaded = _ours(package)
        assert not preloaded, f"importing the third-party libraries imported {preloaded}"
        # Each child would otherwise redo these per process: inspect's module-by-file map (pydantic looks a class's
        # module up by frame for its attribute docstrings, which maps every loaded module's file once), and the
        # garbage collector's walks over the inherited objects (frozen: never collected, so never touched).
        inspect.getmodule(sys._getframe())
        gc.freeze()

        listed = set(names)
        members: dict[str, list[str]] = {}
        roots: list[str] = []
        for name in names:
            parent = name.rpartition(".")[0]
            while parent and parent not in listed:
                parent = parent.rpartition(".")[0]
            (members.setdefault(parent, []) if parent else roots).append(name)
        (out / "each").mkdir()
        for root in roots:
            _in_child(_visit, root, members, out / "each")
        results = {p.name: p.read_text() for p in (out / "each").iterdir()}
    missing = "no result: its package failed to import, or the process importing it died"
    failed = {n: results.get(n, missing) for n in names if results.get(n) != "ok"}
    return {"failed_together": together["failed"], "shadowed": together["shadowed"], "failed_alone": failed,
            "third_party": len(together["third_party"])}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("package")
    parser.add_argument("modules", nargs="+", help="the modules to import, parent packages before their members")
    parser.add_argument("--preload", action="append", default=[],
                        help="a third-party module to import first (speed only; repeatable)")
    args = parser.parse_args()
    print(json.dumps(main(args.package, args.modules, args.preload)))
