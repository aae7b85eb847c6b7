"""The originality check (``.ci/originality.py``, run by ``.ci/run``) finds copied code, and passes our own."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
from pathlib import Path

import pytest

CHECKER = Path(__file__).resolve().parents[2] / ".ci" / "originality.py"
REFERENCE = "torch/_dynamo/graph_deduplication.py"


@pytest.fixture(scope="module")
def originality():
    spec = importlib.util.spec_from_file_location("originality_check", CHECKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def _longest_reference_function() -> str:
    """The source of the longest function in the reference file, as torch ships it."""
    import torch._dynamo.graph_deduplication as reference

    source = inspect.getsource(reference)
    tree = ast.parse(source)
    longest = max((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)),
                  key=lambda n: (n.end_lineno or 0) - n.lineno)
    return ast.get_source_segment(source, longest) or ""


def _package(tmp_path: Path, body: str) -> Path:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "module.py").write_text(body)
    return package


def test_a_copied_function_under_another_name_is_found(originality, tmp_path, capsys):
    copied = _longest_reference_function().replace("def ", "def renamed_", 1)
    status = originality.main(["--package", str(_package(tmp_path, copied)), "--reference", REFERENCE])
    out = capsys.readouterr().out
    assert status == 1
    assert "pkg/module.py" in out and "graph_deduplication.py" in out


def test_our_own_function_passes(originality, tmp_path, capsys):
    own = ("def widest_bucket(sizes: list[int], limit: int) -> int:\n"
           "    '''The largest size under the limit, or zero.'''\n"
           "    fitting = [size for size in sizes if size <= limit]\n"
           "    best = max(fitting, default=0)\n"
           "    return best if best * 2 > limit else 0\n")
    status = originality.main(["--package", str(_package(tmp_path, own)), "--reference", REFERENCE])
    assert status == 0, capsys.readouterr().out


def test_storing_arguments_and_imports_are_not_counted_as_shared(originality, tmp_path):
    text = ("def setup(self, param_dtype, reduce_dtype):\n"
            "    import torch.distributed as dist\n"
            "    self.reduce_dtype_of_the_bucket = reduce_dtype\n"
            "    self.param_dtype = param_dtype\n"
            "    self.reduce_dtype = reduce_dtype\n")
    (function,) = originality.functions_of(_package(tmp_path, text) / "module.py", "module.py")
    assert function.statements == {"self.reduce_dtype_of_the_bucket = reduce_dtype"}
