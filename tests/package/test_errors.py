"""One error family: everything overlapcfg raises for a user to see derives from ``OverlapcfgError``, keeps the
builtin it was raised as before (so ``except ValueError`` still catches a bad value), and is exported at the top."""

from __future__ import annotations

import ast
import inspect

import pytest

import overlapcfg
from overlapcfg import errors
from tests.support.package_source import package_modules

BUILTINS = frozenset({"ValueError", "RuntimeError", "TypeError", "KeyError", "LookupError", "IndexError",
                      "FileNotFoundError", "OSError", "NotImplementedError", "Exception"})
"""Raised bare, these would be errors a user sees that are not ours."""
INTERNAL = {"YamlLimitError": "config/yaml_files.py turns it into an OverlapConfigError naming the file",
            "RelativeConfigError": "an OverlapConfigError with paths from the config node; the entry point's "
                                   "config/boundary.py user_paths raises it again at the user's paths",
            "AttributeError": "_lazy.py's module __getattr__: Python's protocol for a missing name",
            "HydraConfigError": "config/hydra_app.py hands our message to Hydra, which prints it without a traceback",
            "ImportError": "an optional integration without its package: Python's protocol for a failed import"}


def _raised(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", None)
            if name is not None:
                found.append((node.lineno, name))
    return found


def test_the_package_raises_only_its_own_errors_or_bug_checks() -> None:
    ours = {name for name, value in vars(errors).items() if isinstance(value, type)
            and issubclass(value, errors.OverlapcfgError)}
    offenders = []
    for module in package_modules():
        for line, name in _raised(module.tree):
            if name in BUILTINS or (name.endswith("Error") and name not in ours and name not in INTERNAL
                                    and name not in ("AssertionError", "PydanticCustomError")):
                offenders.append(f"{module.rel}:{line}: raise {name}")
    assert offenders == []


def test_the_scan_sees_what_it_claims() -> None:
    """The guard above is only worth something if it finds the forms a raise takes."""
    source = "raise ValueError('x')\nraise errors.OverlapConfigError('x')\nraise KeyError\nraise err from None\n"
    assert _raised(ast.parse(source)) == [(1, "ValueError"), (2, "OverlapConfigError"), (3, "KeyError"), (4, "err")]


FAMILY = {
    "OverlapConfigError": ValueError,
    "OverlapUsageError": TypeError,
    "OverlapStateError": RuntimeError,
    "OverlapLookupError": KeyError,
    "UnsupportedGraphError": RuntimeError,
    "UpstreamPassError": RuntimeError,
    "AttributionError": RuntimeError,
    "OverlapVerificationError": RuntimeError,
    "RankFailedError": RuntimeError,
    "SameScheduleError": RuntimeError,
}


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_each_error_is_ours_keeps_its_builtin_and_is_exported(name: str) -> None:
    """Exported at the top, all but the demo harness's (``overlapcfg.demo.gloo``)."""
    cls = getattr(errors, name)
    assert name == "RankFailedError" or (getattr(overlapcfg, name) is cls and name in overlapcfg.__all__)
    assert issubclass(cls, overlapcfg.OverlapcfgError) and issubclass(cls, FAMILY[name])


def test_the_family_is_complete_and_documented() -> None:
    ours = {name for name, value in vars(errors).items() if inspect.isclass(value)
            and issubclass(value, errors.OverlapcfgError) and value is not errors.OverlapcfgError}
    assert ours == set(FAMILY)
    assert all(f"``{name}``" in (errors.__doc__ or "") for name in ours)


def test_a_bad_argument_value_is_a_config_error_and_still_a_value_error() -> None:
    from overlapcfg.demo.dims import ParallelDims

    with pytest.raises(overlapcfg.OverlapConfigError, match=r"ParallelDims\.tp must be an integer >= 1") as info:
        ParallelDims(tp=0)
    assert isinstance(info.value, ValueError) and isinstance(info.value, overlapcfg.OverlapcfgError)
