r"""``${key}`` references between a config's own keys, resolved without running any OmegaConf resolver.

Hydra users write ``forward_prefetch: ${depth}``, so references to other keys are honoured, with OmegaConf's
meaning: ``${a.b}`` / ``${a[0]}`` from the root of the document (for a Hydra node: the composed config),
``${.x}`` from the mapping holding the value, one more leading dot per level up. A string that is exactly one
reference takes the referenced value (any type); otherwise each reference is inserted as text.

Resolvers (``${oc.env:SECRET}``, ``${oc.decode:...}``, ``${now:}``, any ``${name:...}``) are refused, also when
reached through a reference elsewhere in the Hydra config: a config file must not be able to read the
environment or run registered code. Nested references (``${a.${b}}``) are refused as unsupported.

``\${`` is a literal ``${`` (and ``\\${`` a backslash followed by a reference), as in OmegaConf.

Work is bounded: each referenced key is resolved once (memoised), a cycle is an error, and a resolved string
longer than ``MAX_STRING`` is refused, so ``a: ${b}${b}``, ``b: ${c}${c}`` ... cannot grow exponentially.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from overlapcfg.errors import Fault

__all__ = ["MAX_CHAIN", "MAX_STRING", "KeyPath", "format_path", "has_references", "parse_key_path",
           "resolve_references"]

MAX_STRING = 65_536
"""Longest string a chain of ``${...}`` references may build."""
MAX_CHAIN = 100
"""Most references (plus enclosing containers) followed from one value: ``a: ${b}``, ``b: ${c}`` ..."""

KeyPath: TypeAlias = tuple[str | int, ...]

_START = re.compile(r"(\\*)\$\{")
_KEY = re.compile(r"(\.*)((?:[^.\[\]\s${}:\\'\"]+|\[[0-9]+\])(?:\.[^.\[\]\s${}:\\'\"]+|\[[0-9]+\])*)?")
_RESOLVER = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*:")
_PART = re.compile(r"\[([0-9]+)\]|([^.\[\]]+)")


class _Missing:
    pass


_MISSING = _Missing()


def parse_key_path(text: str) -> KeyPath:
    """``trainer.overlap`` -> ``("trainer", "overlap")``; ``a[0].b`` -> ``("a", 0, "b")``."""
    return tuple(int(m.group(1)) if m.group(1) is not None else m.group(2) for m in _PART.finditer(text))


def format_path(path: KeyPath) -> str:
    """The inverse of ``parse_key_path``: dotted keys, ``[i]`` for list positions."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _split(text: str) -> list[str | tuple[str]] | str:
    """Literal pieces (``str``) and reference bodies (``(body,)``), or the reason ``text`` is refused."""
    pieces: list[str | tuple[str]] = []
    pos = 0
    while (m := _START.search(text, pos)) is not None:
        slashes = len(m.group(1))
        pieces.append(text[pos : m.start()] + "\\" * (slashes // 2))
        if slashes % 2:  # escaped: a literal '${'
            pieces.append("${")
            pos = m.end()
            continue
        end = text.find("}", m.end())
        nested = text.find("${", m.end())
        if end < 0:
            return "an unterminated '${'"
        if 0 <= nested < end:
            return "a nested interpolation (${a.${b}}), which is not supported"
        pieces.append((text[m.end() : end],))
        pos = end + 1
    pieces.append(text[pos:])
    return [p for p in pieces if p != ""]


@dataclass
class _Resolver:
    root: Any
    faults: list[Fault]
    show: Any
    memo: dict[KeyPath, Any] = field(default_factory=dict)
    active: set[KeyPath] = field(default_factory=set)

    def value(self, value: Any, path: KeyPath) -> Any:
        if isinstance(value, str):
            return self.string(value, path) if "${" in value else value
        if isinstance(value, Mapping):
            return {k: self.at((*path, k), v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.at((*path, i), v) for i, v in enumerate(value)]
        return value

    def at(self, path: KeyPath, raw: Any) -> Any:
        """The resolved value at ``path`` (memoised, so each key is resolved once however often referenced)."""
        if path in self.memo:
            return self.memo[path]
        if path in self.active:
            self.faults.append(Fault(self.show(path), "interpolation cycle: this value refers back to itself"))
            return _MISSING
        if len(self.active) >= MAX_CHAIN:
            self.faults.append(Fault(self.show(path), f"references nested more than {MAX_CHAIN} deep"))
            return _MISSING
        self.active.add(path)
        try:
            out = self.value(raw, path)
        finally:
            self.active.discard(path)
        self.memo[path] = out
        return out

    def string(self, text: str, path: KeyPath) -> Any:
        pieces = _split(text)
        if isinstance(pieces, str):
            self.faults.append(Fault(self.show(path), f"interpolation in this value: {pieces}"))
            return _MISSING
        values = [p if isinstance(p, str) else self.reference(p[0], path) for p in pieces]
        if any(v is _MISSING for v in values):
            return _MISSING
        if len(pieces) == 1 and isinstance(pieces[0], tuple):
            return values[0]
        if any(isinstance(v, (Mapping, list, tuple)) for v in values):
            self.faults.append(Fault(self.show(path), "a list or mapping cannot be interpolated into a string"))
            return _MISSING
        out = "".join(str(v) for v in values)
        if len(out) > MAX_STRING:
            self.faults.append(Fault(self.show(path), f"interpolations build a string longer than {MAX_STRING:,} "
                                     "characters (references repeated exponentially are refused)"))
            return _MISSING
        return out

    def reference(self, body: str, path: KeyPath) -> Any:
        where = self.show(path)
        if m := _RESOLVER.match(body):
            self.faults.append(Fault(where, f"interpolation '${{{body}}}' calls resolver {m.group(1)!r}; resolvers "
                                     "(oc.env, oc.decode, custom ones) are not run for overlap configs, only "
                                     "${key} references to other keys of the config"))
            return _MISSING
        key = _KEY.fullmatch(body.strip())
        if key is None or not key.group(0):
            self.faults.append(Fault(where, f"interpolation '${{{body}}}' is not a key reference such as ${{a.b}}"))
            return _MISSING
        dots, rest = key.group(1), parse_key_path(key.group(2) or "")
        base: KeyPath = () if not dots else path[: max(len(path) - len(dots), 0)]
        target = (*base, *rest)
        raw = _lookup(self.root, target)
        if raw is _MISSING:
            self.faults.append(Fault(where, f"interpolation '${{{body}}}': the config has no key "
                                     f"{format_path(target) or '<root>'!r}"))
            return _MISSING
        return self.at(target, raw)


def _lookup(root: Any, path: KeyPath) -> Any:
    node = root
    for part in path:
        if isinstance(node, Mapping):
            if part in node:
                node = node[part]
            elif isinstance(part, int) and str(part) in node:
                node = node[str(part)]
            else:
                return _MISSING
        elif isinstance(node, (list, tuple)):
            try:
                node = node[int(part)]
            except (ValueError, IndexError):
                return _MISSING
        else:
            return _MISSING
    return node


def resolve_references(root: Any, at: KeyPath, show: Any) -> tuple[Any, list[Fault]]:
    """The value at ``at`` inside ``root`` with every ``${key}`` reference replaced, and the faults met.

    ``show(path)`` turns a key path of ``root`` into the fault path the user sees. Values are shared, not
    copied, where a reference points at a list or mapping (callers measure the result as a tree).
    """
    faults: list[Fault] = []
    resolver = _Resolver(root, faults, show)
    raw = _lookup(root, at)
    out = resolver.at(at, raw)
    return out, faults


def has_references(data: Any) -> bool:
    """Whether any string in ``data`` contains ``${`` (iteratively: ``data`` has been measured already)."""
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            if "${" in value:
                return True
        elif isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return False
