"""The package surface: every advertised name resolves, and importing it stays cheap."""

from __future__ import annotations

import subprocess
import sys

import overlapcfg


def test_every_exported_name_resolves():
    assert set(overlapcfg.__all__) - {"__version__"} == set(overlapcfg._EXPORTS)
    for name in overlapcfg._EXPORTS:
        assert getattr(overlapcfg, name) is not None, name


def test_unknown_attribute_raises_attribute_error():
    try:
        overlapcfg.no_such_thing  # noqa: B018
    except AttributeError as err:
        assert "no_such_thing" in str(err)
    else:  # pragma: no cover
        raise AssertionError("expected AttributeError")


def test_private_torch_imports_live_in_compat_only():
    """A torch upgrade must touch one file: no other module imports torch._inductor/_dynamo/_functorch/testing."""
    import pathlib
    import re

    root = pathlib.Path(overlapcfg.__file__).parent
    private = re.compile(r"^\s*(from|import)\s+torch\.(_inductor|_dynamo|_functorch|testing\._internal|_guards)")
    offenders = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py") if p.name != "compat.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if private.match(line)]
    assert offenders == []


def test_import_does_not_pull_in_torch():
    code = "import sys, overlapcfg; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
