"""Reading JSON a user hands over (``node_costs.json``) with the limits YAML files get (``yaml_files``).

``json.loads`` recurses once per nesting level (100,000 ``[`` end in a ``RecursionError``), builds every value of
a 16 MiB file before anyone looks at it, and keeps the last of two equal keys without a word. Here the text is
held to ``MAX_FILE_BYTES``, its nesting depth and value count are counted on a scan of its brackets and commas
(strings skipped whole) before ``json`` parses it (``safe_yaml.MAX_DEPTH``, ``MAX_NODES``: the limits of the YAML
reader), and a key given twice in one object is refused. Faults are ``OverlapConfigError``\\s naming the file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from overlapcfg.config.safe_yaml import MAX_DEPTH, MAX_NODES
from overlapcfg.config.yaml_files import check_text
from overlapcfg.errors import OverlapConfigError, show_value

__all__ = ["parse_json"]

_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{},]')
"""What the scan looks at: a whole string (brackets and commas inside it are text), or a bracket, or a comma."""


class _DuplicateKey(ValueError):
    pass


def parse_json(text: str, root: str, *, source: Path | str | None = None) -> Any:
    """The JSON value in ``text``; every refusal an ``OverlapConfigError`` under ``root`` naming ``source``."""
    where = f"JSON file {str(source)!r}" if source is not None else "JSON"
    check_text(text, root)
    _check_shape(text, root, where)
    try:
        return json.loads(text, object_pairs_hook=_unique)
    except _DuplicateKey as err:
        raise OverlapConfigError.single(root, f"{where} refused: {err}") from None
    except (ValueError, RecursionError) as err:
        raise OverlapConfigError.single(root, f"could not parse {where}: {_problem(err)}") from None


def _check_shape(text: str, root: str, where: str) -> None:
    depth = values = 0
    for match in _TOKENS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            values += 1
            if depth > MAX_DEPTH:
                raise OverlapConfigError.single(root, f"{where} refused: nesting deeper than {MAX_DEPTH} levels "
                                                      f"({_at(text, match.start())})")
        elif token in "]}":
            depth -= 1
        elif token == ",":
            values += 1
        if values > MAX_NODES:
            raise OverlapConfigError.single(root, f"{where} refused: more than {MAX_NODES:,} values "
                                                  f"({_at(text, match.start())})")


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"duplicate key {show_value(key)} in one object (JSON would keep the last without "
                                "a word)")
        out[key] = value
    return out


def _at(text: str, index: int) -> str:
    line = text.count("\n", 0, index) + 1
    return f"line {line}, column {index - (text.rfind(chr(10), 0, index) + 1) + 1}"


def _problem(err: Exception) -> str:
    if isinstance(err, json.JSONDecodeError):
        return f"{err.msg} (line {err.lineno}, column {err.colno})"
    return str(err).splitlines()[0] if str(err) else type(err).__name__
