"""Bucket names: unique, deterministic, readable, and a function of the bucket's modules only.

A single module is its FQN (the root is ``<root>``); several are joined by ``+``, with runs of consecutive
integer siblings written as a range (``layers.0-1``; ``norm+output``). Names with more than four parts keep the
first and last (``a+...+z``). A name that would repeat gets ``#2``, ``#3`` ... in plan order, skipping any
suffix that is itself a name (a module may be called ``b#2``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

__all__ = ["bucket_name", "unique_names"]


def bucket_name(modules: Sequence[str]) -> str:
    """The readable name of a bucket holding ``modules`` (see the module docstring for the scheme)."""
    parts = list(_compress(modules))
    if len(parts) > 4:
        parts = [parts[0], "...", parts[-1]]
    return "+".join(parts)


def unique_names(names: Sequence[str]) -> list[str]:
    """``names`` with repeats suffixed ``#k``; the result has no duplicates, whatever the input.

    Every name as given is reserved first, so a generated ``a+b#2`` never takes the name of a later bucket
    that is literally ``a+b#2`` (``['a+b', 'a+b', 'a+b#2']`` -> ``['a+b', 'a+b#3', 'a+b#2']``).
    """
    reserved = set(names)
    used: set[str] = set()
    next_suffix: dict[str, int] = {}
    out = []
    for name in names:
        if name not in used:
            used.add(name)
            out.append(name)
            continue
        k = next_suffix.get(name, 2)
        while f"{name}#{k}" in used or f"{name}#{k}" in reserved:
            k += 1
        next_suffix[name] = k + 1
        used.add(f"{name}#{k}")
        out.append(f"{name}#{k}")
    return out


def _compress(modules: Sequence[str]) -> Iterator[str]:
    """Yield name parts, writing runs of consecutive integer siblings as ``parent.first-last``."""
    i = 0
    while i < len(modules):
        j = i
        while j + 1 < len(modules) and _next_sibling(modules[j], modules[j + 1]):
            j += 1
        if j == i:
            yield modules[i] or "<root>"
        else:
            parent, _, first = modules[i].rpartition(".")
            last = modules[j].rpartition(".")[2]
            yield f"{parent}.{first}-{last}" if parent else f"{first}-{last}"
        i = j + 1


def _next_sibling(a: str, b: str) -> bool:
    pa, _, la = a.rpartition(".")
    pb, _, lb = b.rpartition(".")
    return bool(a) and pa == pb and _is_index(la) and _is_index(lb) and int(lb) == int(la) + 1


def _is_index(text: str) -> bool:
    return text.isascii() and text.isdigit()
