"""overlapcfg's own modules, read and parsed once per process, for the tests that scan the source (private uses in
``tests/package/test_layers.py``, raises in ``test_errors.py``, writes in ``test_writers.py``, mount paths in
``test_provenance.py``). Parsing the whole package takes about a third of a second on a quiet machine, and those
files parsed it six times per run. The trees are shared: callers read them (``ast.walk``) and never change them.
"""

from __future__ import annotations

import ast
import functools
import gc
from dataclasses import dataclass
from pathlib import Path

import overlapcfg

PACKAGE = Path(overlapcfg.__file__).resolve().parent


@dataclass(frozen=True, slots=True)
class SourceModule:
    path: Path
    rel: str
    """The path below ``PACKAGE``, with ``/`` (``config/load.py``)."""
    tree: ast.Module


@functools.cache
def package_modules() -> tuple[SourceModule, ...]:
    """Every ``*.py`` under the package, in sorted path order, with its syntax tree.

    The trees are about a third of a million objects the garbage collector tracks, alive from the first scan to the
    end of the run; every full collection after it walked all of them again (about 0.25 s each on 2 cores, some
    twenty times in a fast-tier worker). They are frozen (``gc.freeze``, as ``tests/conftest.py`` freezes what
    collection leaves) once made: after a collection, so that no garbage alive now is frozen with them."""
    gc.collect()
    modules = tuple(SourceModule(p, p.relative_to(PACKAGE).as_posix(), ast.parse(p.read_text(), str(p)))
                    for p in sorted(PACKAGE.rglob("*.py")))
    gc.freeze()
    return modules


def modules_under(*packages: str) -> list[SourceModule]:
    """The modules of the given subpackages (``"graph"``, ``"passes"``), in that order, each sorted by path; every
    module when none is given."""
    if not packages:
        return list(package_modules())
    return [m for package in packages for m in package_modules() if m.rel.startswith(f"{package}/")]
