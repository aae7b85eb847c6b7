"""Where a config came from is said in one layer (``overlapcfg.config.boundary``; issue 38): below the public entry
points nothing takes a config's mount path as an argument, holds it, or reads it off the config."""

from __future__ import annotations

import ast

from tests.support.package_source import modules_under

CORE = ("resolve", "graph", "strategies", "passes", "fsdp2", "report", "capture")
"""Packages that work on an overlap config as a value (their entry points excepted below). Not ``cost``: its
``root=`` keywords name where a hardware profile's or node-costs file's own path was given, read by its loaders."""

ENTRY_READS = {("passes/pipeline.py", "apply"), ("passes/compile.py", "check_plan_fits"),
               ("fsdp2/shard.py", "fully_shard")}
"""Public entry points in those packages, each reading the config's ``mount`` to name its faults and notes."""

ENTRY_KEYWORDS = {("fsdp2/shard.py", "fully_shard"), ("passes/compile.py", "backend"),
                  ("integrations/accelerate.py", "fully_shard"), ("integrations/lightning.py", "parallelize"),
                  ("measuring/measure_run.py", "measure"), ("tuning/search.py", "tune")}
"""Public entry points whose ``config_root=`` keyword tells the loader where the user's settings sit."""


def _modules(*packages: str) -> list[tuple[str, ast.Module]]:
    return [(m.rel, m.tree) for m in modules_under(*packages)]


def _functions(tree: ast.Module) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function with the name of the top-level definition it is in (methods by their class's name)."""
    out = []
    for top in tree.body:
        for node in ast.walk(top):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((getattr(top, "name", ""), node))
    return out


def test_below_the_entry_points_no_function_takes_or_holds_a_mount_path() -> None:
    offenders = []
    for name, tree in _modules(*CORE):
        for top, fn in _functions(tree):
            for arg in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs):
                annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if arg.arg in ("root", "config_root") and "str" in annotation and (name, top) not in ENTRY_KEYWORDS:
                    offenders.append(f"{name}: {fn.name}({arg.arg}: {annotation})")
        for node in ast.walk(tree):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                    node.target.id in ("root", "config_root") and "str" in ast.unparse(node.annotation):
                offenders.append(f"{name}:{node.lineno}: field {node.target.id}")
    assert offenders == []


def test_below_the_entry_points_nothing_reads_where_a_config_was_mounted() -> None:
    readers = set()
    for name, tree in _modules(*CORE):
        for top, fn in _functions(tree):
            if any(isinstance(n, ast.Attribute) and n.attr in ("mount", "config_root") for n in ast.walk(fn)):
                readers.add((name, top))
    assert readers <= ENTRY_READS, sorted(readers - ENTRY_READS)


def test_config_root_keywords_are_the_public_entry_points_only() -> None:
    found = {(name, top) for name, tree in _modules() for top, fn in _functions(tree)
             if any(a.arg == "config_root" for a in (*fn.args.args, *fn.args.kwonlyargs))}
    assert found == ENTRY_KEYWORDS
