"""Reading and writing config YAML with bounded work, and the same scalar rules in both directions.

Why not ``OmegaConf.create``/``yaml.safe_load``: a 300-byte document of nested anchors and aliases ("billion
laughs") expands to hundreds of megabytes once anything walks it as a tree, and deep nesting ends in a
``RecursionError``. Here the composed node graph is measured (nesting depth, and node count *as a tree*, i.e.
counting every alias use in full) before anything is constructed, and refused with the limit that was hit.

Scalar rules (``CONFIG_RESOLVERS``) are OmegaConf's YAML 1.1 rules (``1e3`` is a float, no timestamps) minus
YAML 1.1's base-60 numbers: ``4:8`` is the string ``'4:8'`` (an index range), not the integer 248. The dumper
uses the same table, so every string that would read back as something else (``'1e3'``, ``'true'``, ``'null'``)
is quoted, and ``${`` is escaped (``\\${``) so it is not taken for an interpolation: ``dump_yaml`` then
``load_yaml`` is the identity on JSON-like data.

Deliberately not supported: tags other than the YAML core ones (``!!python/...`` is rejected by the safe
constructor), duplicate keys (YAML keeps the last silently; a config with two ``policy:`` keys is a mistake).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

__all__ = [
    "MAX_DEPTH",
    "MAX_NODES",
    "YamlLimitError",
    "dump_yaml",
    "escape_interpolation",
    "load_yaml",
    "measure",
]

MAX_DEPTH = 64
"""Deepest nesting of lists/mappings accepted. A real overlap config nests about six levels."""
MAX_NODES = 500_000
"""Most values (scalars, lists, mappings) a config may hold once aliases are expanded. A plan listing 100k
modules is about 100k nodes; a "billion laughs" document is 10**9."""


class YamlLimitError(ValueError):
    """A document exceeds ``MAX_DEPTH`` or ``MAX_NODES`` (or refers to itself); ``str`` says which."""

    def __init__(self, message: str, line: int | None = None, column: int | None = None) -> None:
        where = f" (line {line}, column {column})" if line is not None else ""
        super().__init__(message + where)


def _resolvers() -> dict[str | None, list[tuple[str, re.Pattern[str]]]]:
    int_re = re.compile(
        r"""^(?:[-+]?0b[0-1_]+
        |[-+]?0[0-7_]+
        |[-+]?(?:0|[1-9][0-9_]*)
        |[-+]?0x[0-9a-fA-F_]+)$""",
        re.X,
    )
    float_re = re.compile(
        r"""^(?:[-+]?[0-9]+(?:_[0-9]+)*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9]+(?:_[0-9]+)*(?:[eE][-+]?[0-9]+)
        |\.[0-9]+(?:_[0-9]+)*(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    )
    table: dict[str | None, list[tuple[str, re.Pattern[str]]]] = {}
    for first, entries in yaml.SafeLoader.yaml_implicit_resolvers.items():
        kept = [(tag, rx) for tag, rx in entries if not tag.endswith((":int", ":float", ":timestamp"))]
        table[first] = kept
    for tag, rx, firsts in (("tag:yaml.org,2002:int", int_re, "-+0123456789"),
                            ("tag:yaml.org,2002:float", float_re, "-+0123456789.")):
        for first in firsts:
            table.setdefault(first, []).append((tag, rx))
    return table


CONFIG_RESOLVERS = _resolvers()
"""Implicit scalar tags shared by the loader and the dumper (see the module docstring)."""


class _NoDuplicateKeys:
    """Constructor mixin: a mapping with the same key twice is an error (YAML would keep the last silently)."""

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[str] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, ScalarNode) and key_node.tag == "tag:yaml.org,2002:str":
                if key_node.value in seen:
                    mark = key_node.start_mark
                    raise YamlLimitError(f"duplicate key {key_node.value!r}", mark.line + 1, mark.column + 1)
                seen.add(key_node.value)
        # A mixin: the constructor is the loader's it is mixed into, which mypy cannot see from here.
        return super().construct_mapping(node, deep=deep)  # type: ignore[misc]


class _Loader(_NoDuplicateKeys, yaml.SafeLoader):
    """A SafeLoader that refuses duplicate keys and nests at most ``MAX_DEPTH`` deep while composing."""

    yaml_implicit_resolvers = CONFIG_RESOLVERS

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        # Counted here, before the recursion, so a 10,000-deep flow list fails fast instead of blowing the stack,
        # and a document of a million values stops at the 500,001st instead of being composed whole.
        self._depth += 1
        self._nodes += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise YamlLimitError(f"nesting deeper than {MAX_DEPTH} levels", mark.line + 1, mark.column + 1)
            if self._nodes > MAX_NODES:
                mark = self.peek_event().start_mark
                raise YamlLimitError(_too_many(), mark.line + 1, mark.column + 1)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


if yaml.__with_libyaml__:

    class _CLoader(_NoDuplicateKeys, yaml.CSafeLoader):
        """libyaml's parser and composer (about 5x faster), with our resolvers and duplicate-key check.

        Its composer recurses in C, so nesting is checked first on the (flat) event stream.
        """

        yaml_implicit_resolvers = CONFIG_RESOLVERS


def _where(mark: Any) -> tuple[int | None, int | None]:
    """``(line, column)``, 1-based, of a parser mark (events may carry none)."""
    return (mark.line + 1, mark.column + 1) if mark is not None else (None, None)


def _too_many() -> str:
    return f"more than {MAX_NODES:,} values"


_OPEN = (yaml.SequenceStartEvent, yaml.MappingStartEvent)
_CLOSE = (yaml.SequenceEndEvent, yaml.MappingEndEvent)
_NODE = (yaml.ScalarEvent, yaml.AliasEvent, *_OPEN)


def _check_events(text: str) -> None:
    """Nesting depth and value count on the (flat) event stream, before libyaml composes anything: the work is
    bounded by the limits, not by the document (a 16 MiB list of a million values stops at value 500,001)."""
    depth = nodes = 0
    for event in yaml.parse(text, Loader=_CLoader):
        if isinstance(event, _NODE):
            nodes += 1
            if nodes > MAX_NODES:
                raise YamlLimitError(_too_many(), *_where(event.start_mark))
        if isinstance(event, _OPEN):
            depth += 1
            if depth > MAX_DEPTH:
                raise YamlLimitError(f"nesting deeper than {MAX_DEPTH} levels", *_where(event.start_mark))
        elif isinstance(event, _CLOSE):
            depth -= 1


def load_yaml(text: str) -> Any:
    """The one document in ``text`` as plain Python data; ``YamlLimitError`` or ``yaml.YAMLError`` if refused.

    An empty document is ``None``; several documents are a ``yaml.YAMLError``. Callers bound ``text``'s size
    first (``overlapcfg.config.yaml_files.MAX_FILE_BYTES``); here the values are counted before anything is built.
    """
    if yaml.__with_libyaml__:
        _check_events(text)
        loader: yaml.SafeLoader | yaml.CSafeLoader = _CLoader(text)
    else:
        loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _measure_nodes(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _measure_nodes(root: Node) -> None:
    """Tree size and height of a composed (alias-sharing) node graph, without expanding it."""
    _measure(root, _children, lambda n: (n.start_mark.line + 1, n.start_mark.column + 1))


def measure(data: Any) -> None:
    """Check plain Python data (dicts, lists, tuples; shared or self-referencing) against the same limits."""

    def children(value: Any) -> list[Any]:
        if isinstance(value, Mapping):
            return [*value.keys(), *value.values()]
        if isinstance(value, (list, tuple)):
            return list(value)
        return []

    _measure(data, children, lambda _: None)


def _measure(root: Any, children: Any, mark: Any) -> None:
    """Iterative post-order over a DAG, memoised by identity: linear in the graph, whatever the tree size.

    ``size`` counts a shared child once per use (what a tree walk downstream would visit); ``height`` likewise.
    A child reachable from itself is a cycle, which no tree walk survives.
    """
    size: dict[int, int] = {}
    height: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[tuple[Any, Iterator[Any] | None]] = [(root, None)]
    keep: list[Any] = []  # keeps measured objects alive so their ids stay unique during the walk
    while stack:
        value, it = stack[-1]
        key = id(value)
        if it is None:
            kids = children(value)
            if not kids:
                size[key], height[key] = 1, 1
                keep.append(value)
                stack.pop()
                continue
            on_stack.add(key)
            if len(on_stack) > MAX_DEPTH:
                raise YamlLimitError(f"nesting deeper than {MAX_DEPTH} levels", *(mark(value) or (None, None)))
            it = iter(kids)
            stack[-1] = (value, it)
        child = next(it, _DONE)
        if child is _DONE:
            kids = children(value)
            total = 1 + sum(size[id(k)] for k in kids)
            tall = 1 + max(height[id(k)] for k in kids)
            if total > MAX_NODES:
                raise YamlLimitError(
                    f"more than {MAX_NODES:,} values once aliases are expanded (anchors/aliases nested to "
                    "repeat data exponentially are refused)", *(mark(value) or (None, None)))
            if tall > MAX_DEPTH:
                raise YamlLimitError(f"nesting deeper than {MAX_DEPTH} levels once aliases are expanded",
                                     *(mark(value) or (None, None)))
            size[key], height[key] = total, tall
            on_stack.discard(key)
            keep.append(value)
            stack.pop()
        elif id(child) in on_stack:
            raise YamlLimitError("a value contains itself (a recursive alias or reference)",
                                 *(mark(child) or (None, None)))
        elif id(child) not in size:
            stack.append((child, None))


_DONE = object()


_BaseDumper = yaml.CSafeDumper if yaml.__with_libyaml__ else yaml.SafeDumper


# the base is chosen at import (libyaml's dumper or the Python one), which mypy cannot follow
class _Dumper(_BaseDumper):  # type: ignore[misc, valid-type]
    yaml_implicit_resolvers = CONFIG_RESOLVERS


def _represent_str(dumper: yaml.SafeDumper, value: str) -> ScalarNode:
    # The emitter quotes any plain scalar that ``CONFIG_RESOLVERS`` would read as something else.
    return dumper.represent_scalar("tag:yaml.org,2002:str", escape_interpolation(value))


_Dumper.add_representer(str, _represent_str)


def dump_yaml(data: Any, *, width: int | None = None) -> str:
    """Block-style YAML of JSON-like ``data`` that ``load_config`` reads back to the same values, key order kept;
    ``width``: where long lines fold (PyYAML's default, 80 columns, if None)."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=width)


_BACKSLASHES_THEN_INTERP = re.compile(r"(\\*)\$\{")


def escape_interpolation(text: str) -> str:
    r"""``a${b}`` -> ``a\${b}``: the text, read back, is the literal string (see ``config.interpolate``).

    Backslashes right before ``${`` are doubled first, so ``\${`` written literally survives too.
    """
    if "${" not in text:
        return text
    return _BACKSLASHES_THEN_INTERP.sub(lambda m: m.group(1) * 2 + "\\${", text)
