#!/usr/bin/env python3
"""Every line ours: no function of the package may share text with the upstream code we read to learn facts.

Compares every function and method under ``overlapcfg/`` with every function in the reference sources (by default
torch's ``_inductor/fx_passes/``, ``_dynamo/graph_deduplication.py`` and FSDP2's ``distributed/fsdp/_fully_shard/``,
plus torchtitan's ``experiments/graph_trainer/`` when it is installed), from the torch and torchtitan installed in
the running interpreter. A pair is a finding when either holds:

- **shared statements**: the two functions have 2 or more statements in common, each at least 25 characters long
  after ``ast.unparse`` (which drops comments and normalizes spelling); docstrings are left out, and a statement is
  any statement node at any depth, a compound one (``if``, ``for``, ...) compared whole with its body;
- **similar token sequences**: ``difflib.SequenceMatcher`` ratio of the two bodies' token sequences (Python tokens
  of the unparsed body, docstring left out) is 0.8 or more. Bodies under ``--min-tokens`` tokens (default 40) are
  not compared this way: a two-line accessor is similar to hundreds of others and says nothing about copying.
  Imports, and a constructor storing an argument under its own name (``self.x = x``), are not counted as shared
  statements either: every author writes them the same way.

Exit status 1 when anything is found (the finding, each function's place and the measure are printed), 0 otherwise.
``--report PATH`` writes every pair scored (the top matches per function) as JSON, for a closing note's evidence.

Why these thresholds: they are the ones issue 38 set when it measured the copied merge functions (10 of 12
statements shared, token ratio 0.76 to 0.92) against the rest of the package (median ratio 0.33).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import io
import json
import keyword
import sys
import time
import tokenize
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

MIN_STATEMENT_CHARS = 25
SHARED_STATEMENTS_LIMIT = 2
RATIO_LIMIT = 0.8
_SKIPPED_TOKENS = {tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT,
                   tokenize.ENDMARKER, tokenize.ENCODING}


@dataclass
class Function:
    """One function's comparable text: where it is, its long statements and its body's tokens."""

    where: str
    statements: frozenset[str]
    tokens: tuple[str, ...]


def _body(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.stmt]:
    body = list(node.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return body


def _without_docstrings(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = _body(node) if not isinstance(node, ast.ClassDef) else node.body
            if isinstance(node, ast.ClassDef) and body and isinstance(body[0], ast.Expr) \
                    and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                body = body[1:]
            node.body = body or [ast.Pass()]


def _says_nothing(stmt: ast.stmt) -> bool:
    """Statements any author writes the same way, whoever they read: imports, and a constructor storing an argument
    under its own name (``self.param_dtype = param_dtype``). Left out of the shared-statement count."""
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return True
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.value, ast.Name):
        target = stmt.targets[0]
        return isinstance(target, ast.Attribute) and target.attr == stmt.value.id
    return False


def _tokens(text: str) -> tuple[str, ...]:
    try:
        return tuple(t.string for t in tokenize.generate_tokens(io.StringIO(text).readline)
                     if t.type not in _SKIPPED_TOKENS)
    except (tokenize.TokenError, IndentationError):
        return tuple(text.split())


def functions_of(path: Path, label: str) -> list[Function]:
    """Every function (methods and nested functions included) of one source file."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    _without_docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        statements = frozenset(
            text for stmt in node.body for sub in ast.walk(stmt) if isinstance(sub, ast.stmt)
            if not _says_nothing(sub) and len(text := ast.unparse(sub)) >= MIN_STATEMENT_CHARS)
        body = "\n".join(ast.unparse(stmt) for stmt in node.body)
        tokens = _tokens(body)
        found.append(Function(f"{label}:{node.lineno} {node.name}", statements, tokens))
    return found


_GRAM = 6


def _grams(tokens: tuple[str, ...]) -> set[tuple[str, ...]]:
    """The body's token 6-grams with every name blanked (keywords kept): the same code under other names."""
    shape = tuple("N" if t.isidentifier() and not keyword.iskeyword(t) else t for t in tokens)
    return {shape[i:i + _GRAM] for i in range(len(shape) - _GRAM + 1)}


def reference_files(roots: list[str]) -> list[tuple[Path, str]]:
    """The reference sources: ``package/relative/path`` specs resolved against the installed packages."""
    import importlib.util
    files = []
    for spec in roots:
        package, _, rest = spec.partition("/")
        found = importlib.util.find_spec(package)
        if found is None or found.origin is None:
            print(f"originality: {package} is not installed; {spec} not compared", file=sys.stderr)
            continue
        base = Path(found.origin).parent
        target = base / rest
        if target.is_file():
            files.append((target, f"{package}/{rest}"))
        elif target.is_dir():
            files += [(p, f"{package}/{p.relative_to(base)}") for p in sorted(target.rglob("*.py"))]
        else:
            print(f"originality: {spec} does not exist in the installed {package}; not compared", file=sys.stderr)
    return files


DEFAULT_REFERENCES = [
    "torch/_inductor/fx_passes",
    "torch/_dynamo/graph_deduplication.py",
    "torch/distributed/fsdp/_fully_shard",
    "torchtitan/experiments/graph_trainer",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", default=str(Path(__file__).resolve().parent.parent / "overlapcfg"))
    parser.add_argument("--reference", action="append", help="package/path to compare with (repeatable); "
                        f"default: {' '.join(DEFAULT_REFERENCES)}")
    parser.add_argument("--min-tokens", type=int, default=40)
    parser.add_argument("--candidates", type=int, default=8,
                        help="reference functions scored exactly per function (those sharing most 6-grams)")
    parser.add_argument("--report", type=Path, help="write the best-scoring pairs per function as JSON here")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    package = Path(args.package)
    ours = [f for p in sorted(package.rglob("*.py")) for f in functions_of(p, str(p.relative_to(package.parent)))]
    theirs = [f for p, label in reference_files(args.reference or DEFAULT_REFERENCES) for f in functions_of(p, label)]
    by_statement: dict[str, list[int]] = {}
    for index, fn in enumerate(theirs):
        for stmt in fn.statements:
            by_statement.setdefault(stmt, []).append(index)

    # Candidates for the token ratio: the reference functions sharing the most normalized token 6-grams (names
    # blanked, so renamed locals still meet), scored exactly; comparing every pair with difflib would take hours.
    gram_index: dict[tuple[str, ...], list[int]] = {}
    for index, other in enumerate(theirs):
        if len(other.tokens) >= args.min_tokens:
            for gram in _grams(other.tokens):
                gram_index.setdefault(gram, []).append(index)

    findings: list[str] = []
    report: list[dict[str, object]] = []
    for fn in ours:
        shared: Counter[int] = Counter(i for stmt in fn.statements for i in by_statement.get(stmt, ()))
        best: tuple[float, int] | None = None
        if len(fn.tokens) >= args.min_tokens:
            meets: Counter[int] = Counter(i for gram in _grams(fn.tokens) for i in set(gram_index.get(gram, ())))
            for index, _ in meets.most_common(args.candidates):
                ratio = difflib.SequenceMatcher(None, fn.tokens, theirs[index].tokens, autojunk=False).ratio()
                if best is None or ratio > best[0]:
                    best = (ratio, index)
        most_shared = shared.most_common(1)
        entry: dict[str, object] = {"function": fn.where, "tokens": len(fn.tokens)}
        if most_shared:
            index, count = most_shared[0]
            entry["most_shared_statements"] = {"with": theirs[index].where, "count": count}
            if count >= SHARED_STATEMENTS_LIMIT:
                findings.append(f"{fn.where}: shares {count} statements (>= {MIN_STATEMENT_CHARS} chars) with "
                                f"{theirs[index].where}")
        if best is not None:
            entry["most_similar"] = {"with": theirs[best[1]].where, "ratio": round(best[0], 3)}
            if best[0] >= RATIO_LIMIT:
                findings.append(f"{fn.where}: token-sequence similarity {best[0]:.2f} to {theirs[best[1]].where}")
        report.append(entry)

    seconds = time.perf_counter() - started
    if args.report:
        args.report.write_text(json.dumps({"references": args.reference or DEFAULT_REFERENCES,
                                           "ours": len(ours), "theirs": len(theirs), "findings": findings,
                                           "functions": report}, indent=1))
    ratios = sorted(e["most_similar"]["ratio"] for e in report if "most_similar" in e)  # type: ignore[index]
    median = ratios[len(ratios) // 2] if ratios else 0.0
    print(f"originality: {len(ours)} functions of the package against {len(theirs)} upstream functions in "
          f"{seconds:.1f} s; median best ratio {median:.2f}; {len(findings)} finding(s)")
    for line in findings:
        print(f"  {line}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
