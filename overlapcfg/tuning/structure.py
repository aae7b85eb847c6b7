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

Unless the space names them, the blocks and their parts are read off the model (``find_blocks``, ``find_parts``):
the blocks are the children of the container (``ModuleList``, ``Sequential``, a ``ModuleDict`` keyed ``0..n-1``) of
same-class modules holding the most parameter owners (``model.layers.*`` in a Hugging Face decoder, ``layers.*`` in
torchtitan and the demo, ``blocks.*`` in a timm ViT); a block's parts are its parameter-owning children in compute
order, a child too small to be worth a collective of its own (``SMALL_PART``: a norm) sharing the next one's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from overlapcfg.config import BucketPlan
from overlapcfg.errors import Fault, OverlapConfigError
from overlapcfg.resolve import ResolvedPlan, resolve_plan
from overlapcfg.resolve.matcher import show
from overlapcfg.tuning.space import TuneSpace

__all__ = ["SMALL_PART", "Grouping", "Structure", "UnitFacts", "find_blocks", "find_parts", "find_structure",
           "plan_for"]

SMALL_PART = 0.05
"""A block child holding less than this share of the block's parameter bytes (a norm next to an attention) is no
part of its own: alone its collectives cost their latency and hide nothing; it shares the part computing next.
A norm holds about 2d of a block's 12d² parameters (under 1 % from d = 17 on), an attention or a feed-forward a
quarter or more; 5 % sits well between them, also on the tiny models tests build."""

UnitFacts = Mapping[str, tuple[float, int]]
"""``parameter owner -> (position of its first forward all-gather wait, unsharded bytes)``: compute order and size,
read from the step (``overlapcfg.tuning.profile``)."""


@dataclass(frozen=True, slots=True)
class Grouping:
    """How units become buckets: the plan-shaping dimensions of the space."""

    layers_per_bucket: int
    split_blocks: bool
    merge_first: bool
    merge_last: bool
    unmerged: tuple[str, ...] = ()
    """Collective kinds left one per parameter in each bucket (``OverlapPolicy.unmerged``)."""

    @property
    def label(self) -> str:
        """``2 blocks/bucket, first merged, RS unmerged``: what tells groupings apart in a table."""
        k = self.layers_per_bucket
        text = "attn|ffn split" if self.split_blocks else f"{k} block{'s' if k > 1 else ''}/bucket"
        merged = [w for w, on in (("first", self.merge_first), ("last", self.merge_last)) if on]
        short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}
        unmerged = f", {'+'.join(short[k] for k in self.unmerged)} unmerged" if self.unmerged else ""
        return text + (f", {' and '.join(merged)} merged" if merged else "") + unmerged


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
    pattern: str = ""
    """The blocks pattern used (the space's, or the one found)."""
    found: str | None = None
    """What was read off the model where the space left it open, for the log and the result."""


def _inside(fqn: str, module: str) -> bool:
    return fqn == module or fqn.startswith(module + ".")


def _children(module_fqns: Sequence[str]) -> dict[str, dict[str, str]]:
    """``parent -> {child segment: child fqn}``, model order."""
    out: dict[str, dict[str, str]] = {}
    for fqn in module_fqns:
        parent, _, leaf = fqn.rpartition(".")
        out.setdefault(parent, {})[leaf] = fqn
    return out


def find_blocks(module_fqns: Sequence[str], owners: Sequence[str], module_types: Sequence[str] = (), *,
                path: str = "space.blocks") -> tuple[str, str]:
    """``(pattern, description)`` of the model's repeated blocks: the children ``P.0`` .. ``P.<n-1>`` (n >= 2) of one
    container, each owning parameters and, where the class names are known, all of one class; of containers nested
    in one another the one whose blocks hold the most parameter owners (the decoder layers, not the experts of one
    layer). ``OverlapConfigError`` at ``path`` when there is none, or when there are two stacks side by side (an
    encoder's and a decoder's): which to group is the user's call."""
    types = dict(zip(module_fqns, module_types, strict=True)) if module_types else {}
    children = _children(module_fqns)
    stacks: list[tuple[int, str, tuple[str, ...]]] = []
    for parent, named in children.items():
        numbered = [c for c in named if c.isdecimal()]
        if len(numbered) < 2 or sorted(int(c) for c in numbered) != list(range(len(numbered))):
            continue
        blocks = tuple(named[str(i)] for i in range(len(numbered)))
        if types and len({types.get(b, "") for b in blocks}) != 1:
            continue
        held = [sum(_inside(o, b) for o in owners) for b in blocks]
        if all(held):
            stacks.append((sum(held), parent, blocks))
    if not stacks:
        raise OverlapConfigError.single(
            path, "found no repeated blocks in the model (a ModuleList, Sequential or ModuleDict of two or more "
                  "same-class modules numbered 0..n-1, each owning parameters); name them, e.g. "
                  "space={'blocks': 'encoder.layer.*'}, or give the plan yourself")
    _, parent, blocks = max(stacks, key=lambda s: s[0])  # the first of equals: model order

    def pattern_of(parent: str, n: int) -> str:
        every = all(c.isdecimal() for c in children[parent])
        return (f"{parent}." if parent else "") + ("*" if every else f"0:{n}")

    pattern = pattern_of(parent, len(blocks))
    beside = [pattern_of(p, len(b)) for _, p, b in stacks
              if p != parent and not any(_inside(p, x) for x in blocks) and not any(_inside(parent, x) for x in b)]
    if beside:
        raise OverlapConfigError.single(
            path, f"the model has more than one stack of repeated blocks ({pattern!r}, "
                  f"{', '.join(map(repr, beside))}); the tuner groups one run of blocks: name it "
                  f"(space={{'blocks': {pattern!r}}}), or give the plan yourself")
    kind = f" {types[blocks[0]]}" if types else ""
    return pattern, f"{len(blocks)}{kind} blocks {pattern!r}"


def find_parts(blocks: Sequence[str], owners: Sequence[str],
               facts: UnitFacts | None = None) -> tuple[tuple[tuple[str, ...], ...] | None, str | None]:
    """``(parts, why none)``: each block's parameter-owning children (names relative to the block), one part each,
    in compute order (``facts``' positions; model order without them); a child under ``SMALL_PART`` of the block's
    bytes shares the part of the child computing after it (the last one, the part before). Every block must have
    the same children, and the block must own no parameter itself."""
    if not blocks:
        return None, "no blocks"
    per_block: list[dict[str, list[str]]] = []
    for block in blocks:
        children: dict[str, list[str]] = {}
        for o in owners:
            if o == block:
                return None, f"{block!r} owns parameters itself, outside any child"
            if _inside(o, block):
                children.setdefault(o[len(block) + 1:].split(".")[0], []).append(o)
        per_block.append(children)
    names = list(per_block[0])
    if any(set(c) != set(names) for c in per_block[1:]):
        return None, "the blocks do not all have the same parameter-owning children"
    if len(names) < 2:
        return None, f"a block has one parameter-owning child ({names[0]!r}): nothing to split"
    first = per_block[0]
    if facts is not None:
        names.sort(key=lambda n: min(facts[o][0] for o in first[n]) if all(o in facts for o in first[n]) else 0.0)
    size = {n: sum(facts[o][1] for o in first[n] if o in facts) if facts is not None else 1 for n in names}
    total = sum(size.values()) or 1
    parts: list[list[str]] = []
    pending: list[str] = []
    for n in names:
        pending.append(n)
        if size[n] >= SMALL_PART * total:
            parts.append(pending)
            pending = []
    if pending:
        if parts:
            parts[-1] += pending
        else:
            parts.append(pending)
    if len(parts) < 2:
        return None, "a block has one child worth a bucket of its own: nothing to split"
    return tuple(tuple(p) for p in parts), None


def find_structure(module_fqns: Sequence[str], owners: Sequence[str], space: TuneSpace, *,
                   root: str = "space", module_types: Sequence[str] = (),
                   facts: UnitFacts | None = None) -> Structure:
    """Match the blocks (``space.blocks``, or ``find_blocks``) against the model and place every parameter owner
    before, in or after a block; the parts are ``space.block_parts``, or ``find_parts``."""
    found: list[str] = []
    pattern = space.blocks
    if pattern is None:
        pattern, what = find_blocks(module_fqns, owners, module_types, path=f"{root}.blocks")
        found.append(what)
    try:
        matched = resolve_plan(BucketPlan(buckets=(pattern,)), module_fqns, path=f"{root}.blocks")
    except OverlapConfigError as err:
        raise OverlapConfigError(err.faults, header="tune: the blocks pattern does not fit the model") from None
    blocks = tuple(m for b in matched.buckets for m in b.modules)
    block_of = {o: next((i for i, b in enumerate(blocks) if _inside(o, b)), None) for o in owners}
    inside = [i for i, o in enumerate(owners) if block_of[o] is not None]
    if not inside:
        raise OverlapConfigError.single(f"{root}.blocks", f"{pattern!r} matches {show(blocks)}, which own no "
                                                          "parameters; name the model's repeated blocks")
    head = tuple(owners[:inside[0]])
    tail = tuple(owners[inside[-1] + 1:])
    strays = [o for o in owners[inside[0]:inside[-1] + 1] if block_of[o] is None]
    if strays:
        how = f" (found from the module tree: {found[0]})" if found else ""
        raise OverlapConfigError.single(f"{root}.blocks", f"parameter owners {show(strays)} sit between the blocks "
                                                          f"{pattern!r} matches{how}; the tuner groups a run of "
                                                          "blocks with owners only before and after it: name other "
                                                          "blocks, or give the plan yourself")
    if space.block_parts is None:
        parts, why = find_parts(blocks, owners, facts)
        if parts is not None:
            found.append("parts " + " | ".join("+".join(p) for p in parts))
    else:
        parts, why = _parts(blocks, owners, block_of, module_fqns, space.block_parts)
    prefix = blocks[0].rpartition(".")[0]
    numbered = all(b == f"{prefix}.{i}" for i, b in enumerate(blocks))
    return Structure(head=head, blocks=blocks, parts=parts, tail=tail, prefix=prefix if numbered else None,
                     why_no_split=why, pattern=pattern, found="; ".join(found) or None)


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
