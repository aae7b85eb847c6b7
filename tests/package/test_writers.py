"""Every file overlapcfg writes for a user goes through ``overlapcfg.files.write_atomic``: written whole or not at
all, whatever interrupts the writer (``tests/demo/test_outputs.py`` proves the write itself under SIGINT)."""

from __future__ import annotations

import ast
from pathlib import Path

import overlapcfg
from tests.support.package_source import package_modules

PACKAGE = Path(overlapcfg.__file__).resolve().parent
THE_WRITER = PACKAGE / "files.py"
WRITING_METHODS = {"write_text", "write_bytes", "savefig", "dump", "to_csv", "touch"}
"""Calls that write a file when called on a path, a figure or a stream (``json.dump(obj, f)``)."""
WRITING_CALLS = {"NamedTemporaryFile", "mkstemp"}
SHUTIL_WRITERS = {"copyfile", "copy", "copy2", "copytree", "move"}
WRITE_MODES = ("w", "a", "x", "+")


def _writes(node: ast.Call) -> str | None:
    """What ``node`` writes with, if it writes a file other than through ``write_atomic``."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name in WRITING_METHODS:
        if name == "dump" and not any(isinstance(a, ast.Name | ast.Attribute) for a in node.args[1:2]):
            return None  # yaml.dump(data) / json.dumps return text; json.dump(obj, f) writes f
        return name
    if name in WRITING_CALLS:
        return name
    if name in SHUTIL_WRITERS and isinstance(func, ast.Attribute) and ast.unparse(func.value) == "shutil":
        return f"shutil.{name}"
    if name == "open":
        mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
        if isinstance(mode, ast.Constant) and isinstance(mode.value, str) and any(m in mode.value for m in WRITE_MODES):
            return f"open(..., {mode.value!r})"
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "os":
            flags = ast.unparse(node.args[1]) if len(node.args) > 1 else ""
            return "os.open(O_WRONLY)" if "WRONLY" in flags or "RDWR" in flags or "CREAT" in flags else None
    return None


def test_every_writer_in_the_package_uses_the_atomic_write() -> None:
    found = []
    for module in package_modules():
        if module.path == THE_WRITER:
            continue
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Call) and (what := _writes(node)) is not None:
                found.append(f"{module.path.relative_to(PACKAGE.parent)}:{node.lineno}: {what}")
    assert found == [], "write these through overlapcfg.files.write_atomic:\n" + "\n".join(found)


def test_the_scan_sees_a_plain_write() -> None:
    """The scan above must be able to fail: each way of writing it knows is found in a sample."""
    sample = ast.parse("p.write_text(s)\nopen(p, 'w')\njson.dump(d, f)\nos.open(p, os.O_WRONLY | os.O_CREAT)\n"
                       "tempfile.NamedTemporaryFile('w')\nfig.savefig(p)\nyaml.dump(d)\nopen(p)\n"
                       "shutil.copy(a, b)\nt.copy_(u)\n")
    hits = [_writes(n) for n in ast.walk(sample) if isinstance(n, ast.Call)]
    assert [h for h in hits if h] == ["write_text", "open(..., 'w')", "dump", "os.open(O_WRONLY)",
                                     "NamedTemporaryFile", "savefig", "shutil.copy"]
