"""The shape the tuner groups: the model's blocks, what comes before and after them, and plans for a grouping.

A grouping (``Grouping``) is written as an ordinary bucket plan, compact where the block names allow it::

    layers_per_bucket=2, split_blocks=False, merge_first=True, merge_last=False
    buckets:
      - [tok_embeddings, layers.0:2]                 # the embedding shares the first pair of blocks
      - {modules: [layers.2:32], group_size: 2}      # then pairs
      - [norm, output]

    layers_per_bucket=1, split_blocks=True, merge_first=False, merge_last=False
      - tok_embeddings
      - {modules: [layers.*.attention_norm, layers.*.attention], per: layers.*}
      - {modules: [layers.*.ffn_norm, layers.*.feed_forward], per: layers.*}
      - [norm, output]

and checked by resolving it: if the compact form does not give exactly the intended buckets (blocks not named
``<prefix>.<0..n-1>``), every bucket is written out as a list instead. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from overlapcfg.config import BucketPlan
from overlapcfg.errors import Fault, OverlapConfigError
from overlapcfg.resolve import ResolvedPlan, resolve_plan
from overlapcfg.resolve.matcher import show
from overlapcfg.tuning.space import TuneSpace

__all__ = ["Grouping", "Structure", "find_structure", "plan_for"]


@dataclass(frozen=True, slots=True)
class Grouping:
    """How units become buckets: the plan-shaping dimensions of the space."""

    layers_per_bucket: int
    split_blocks: bool
    merge_first: bool
    merge_last: bool

    @property
    def label(self) -> str:
        """``2 blocks/bucket, first merged``: what tells groupings apart in a table."""
        k = self.layers_per_bucket
        text = "attn|ffn split" if self.split_blocks else f"{k} block{'s' if k > 1 else ''}/bucket"
        merged = [w for w, on in (("first", self.merge_first), ("last", self.merge_last)) if on]
        return text + (f", {' and '.join(merged)} merged" if merged else "")


@dataclass(frozen=True, slots=True)
class Structure:
    """What the blocks pattern found in the model."""

    head: tuple[str, ...]
    """Parameter owners before the first block, model order."""
    blocks: tuple[str, ...]
    """Block modules, model order."""
    parts: tuple[tuple[str, ...], ...] | None
    """``block_parts`` when every block holds them and they cover its parameters; None otherwise."""
    tail: tuple[str, ...]
    """Parameter owners after the last block."""
    prefix: str | None
    """``layers`` when the blocks are ``layers.0`` .. ``layers.<n-1>`` (so ranges can name them)."""
    why_no_split: str | None = None
    """Why ``parts`` is None."""


def _inside(fqn: str, module: str) -> bool:
    return fqn == module or fqn.startswith(module + ".")


def find_structure(module_fqns: Sequence[str], owners: Sequence[str], space: TuneSpace, *,
                   root: str = "space") -> Structure:
    """Match ``space.blocks`` against the model and place every parameter owner before, in or after a block."""
    try:
        found = resolve_plan(BucketPlan(buckets=(space.blocks,)), module_fqns, path=f"{root}.blocks")
    except OverlapConfigError as err:
        raise OverlapConfigError(err.faults, header="tune: the blocks pattern does not fit the model") from None
    blocks = tuple(m for b in found.buckets for m in b.modules)
    block_of = {o: next((i for i, b in enumerate(blocks) if _inside(o, b)), None) for o in owners}
    inside = [i for i, o in enumerate(owners) if block_of[o] is not None]
    if not inside:
        raise OverlapConfigError.single(f"{root}.blocks", f"{space.blocks!r} matches {show(blocks)}, which own no "
                                                          "parameters; name the model's repeated blocks")
    head = tuple(owners[:inside[0]])
    tail = tuple(owners[inside[-1] + 1:])
    strays = [o for o in owners[inside[0]:inside[-1] + 1] if block_of[o] is None]
    if strays:
        raise OverlapConfigError.single(f"{root}.blocks", f"parameter owners {show(strays)} sit between the blocks "
                                                          f"{space.blocks!r} matches; the tuner groups a run of "
                                                          "blocks with owners only before and after it")
    parts, why = _parts(blocks, owners, block_of, module_fqns, space.block_parts)
    prefix = blocks[0].rpartition(".")[0]
    numbered = all(b == f"{prefix}.{i}" for i, b in enumerate(blocks))
    return Structure(head=head, blocks=blocks, parts=parts, tail=tail, prefix=prefix if numbered else None,
                     why_no_split=why)


def _parts(blocks: Sequence[str], owners: Sequence[str], block_of: dict[str, int | None], module_fqns: Sequence[str],
           parts: tuple[tuple[str, ...], ...]) -> tuple[tuple[tuple[str, ...], ...] | None, str | None]:
    if not parts:
        return None, "block_parts is empty"
    known = set(module_fqns)
    missing = [f"{b}.{m}" for b in blocks for part in parts for m in part if f"{b}.{m}" not in known]
    if missing:
        return None, f"no module {show(missing)}"
    loose = [o for o in owners if (i := block_of[o]) is not None
             and not any(_inside(o, f"{blocks[i]}.{m}") for part in parts for m in part)]
    if loose:
        return None, f"parameter owners {show(loose)} are in no block part"
    return parts, None


def _buckets(s: Structure, g: Grouping) -> list[tuple[str, ...]]:
    """The intended buckets, as module lists, in compute order."""
    if g.split_blocks:
        assert s.parts is not None
        out = [tuple(f"{b}.{m}" for m in part) for b in s.blocks for part in s.parts]
    else:
        n, k = len(s.blocks), g.layers_per_bucket
        out = [tuple(s.blocks[i:i + k]) for i in range(0, n, k)]
    if s.head:
        out = [(*s.head, *out[0]), *out[1:]] if g.merge_first else [s.head, *out]
    if s.tail:
        out = [*out[:-1], (*out[-1], *s.tail)] if g.merge_last else [*out, s.tail]
    return out


def _entry(modules: Sequence[str]) -> Any:
    return modules[0] if len(modules) == 1 else list(modules)


def _compact(s: Structure, g: Grouping) -> list[Any] | None:
    """Pattern entries for the grouping (ranges of numbered blocks), or None where only lists can say it."""
    if s.prefix is None:
        return None
    n, p = len(s.blocks), s.prefix

    def span(a: int, b: int) -> str:
        return f"{p}.{a}" if b - a == 1 else f"{p}.*" if (a, b) == (0, n) else f"{p}.{a}:{b}"

    mf, ml = g.merge_first and bool(s.head), g.merge_last and bool(s.tail)
    entries: list[Any] = [_entry(s.head)] if s.head and not mf else []
    if g.split_blocks:
        assert s.parts is not None
        if mf:
            entries.append([*s.head, *(f"{s.blocks[0]}.{m}" for m in s.parts[0])])
        for i, part in enumerate(s.parts):
            a = 1 if mf and i == 0 else 0
            b = n - 1 if ml and i == len(s.parts) - 1 else n
            if b > a:
                entries.append({"modules": [f"{span(a, b)}.{m}" for m in part], "per": span(a, b)})
        if ml:
            entries.append([*(f"{s.blocks[-1]}.{m}" for m in s.parts[-1]), *s.tail])
    else:
        k = g.layers_per_bucket
        last = ((n - 1) // k) * k
        a = min(k, n) if mf else 0
        b = last if ml else n
        if mf:
            entries.append([*s.head, span(0, min(k, n)), *(s.tail if ml and last == 0 else ())])
        if b > a:
            entries.append(span(a, b) if k == 1 else {"modules": [span(a, b)], "group_size": k})
        if ml and not (mf and last == 0):
            entries.append([span(last, n), *s.tail])
    if s.tail and not ml:
        entries.append(_entry(s.tail))
    return entries


def plan_for(s: Structure, g: Grouping, module_fqns: Sequence[str], owners: Sequence[str]) -> tuple[dict[str, Any],
                                                                                                     ResolvedPlan]:
    """The plan (as a config mapping) and its resolution for grouping ``g``; compact when that resolves exactly
    to the intended buckets, else one list per bucket."""
    intended = {frozenset(b) for b in _buckets(s, g)}
    compact = _compact(s, g)
    for entries in ((compact,) if compact is not None else ()) + ([_entry(b) for b in _buckets(s, g)],):
        plan = {"buckets": entries, "require_full_coverage": True, "name": "tuned"}
        try:
            resolved = resolve_plan(BucketPlan.model_validate(plan), module_fqns, owners)
        except OverlapConfigError:
            continue
        if {frozenset(b.modules) for b in resolved.buckets} == intended:
            return plan, resolved
    raise OverlapConfigError([Fault("space", f"tune: no plan expresses the grouping {g.label!r} on this model")])
