"""The search space of ``overlapcfg.tune``: a pydantic model, and the Hydra group ``tune/space`` of the command.

Torch-free, like every config model, so a typo in ``tune.space.*`` fails before anything is traced. Each list
field is a dimension of the grid; the grid is their product, less the combinations that mean nothing (a block split
in halves is one layer per bucket). ``per_bucket_rounds`` then refines the best few candidates bucket by bucket.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field

from overlapcfg.config.base import ByteCount, ConfigModel, Depth
from overlapcfg.config.depths import DepthGrid
from overlapcfg.config.load import config_data, validate_config
from overlapcfg.config.plan import PatternText
from overlapcfg.config.policy import IssueOrder
from overlapcfg.config.presets import command_conf_dir
from overlapcfg.errors import OverlapConfigError, closest_first, did_you_mean
from overlapcfg.kinds import BucketKind

__all__ = ["TuneSpace", "load_space", "shipped_space", "shipped_space_names"]


class _Groupings(ConfigModel):
    """How modules are grouped into buckets (``TuneSpace`` holds these fields first, then the depths to try)."""

    blocks: PatternText | None = None
    """The model's repeated blocks, one match per block in model order: what ``layers_per_bucket`` counts and
    ``split_blocks`` splits. Parameter owners before the first block (the embedding) form the first bucket, those
    after the last block (final norm and head) the last bucket. ``None``: found from the module tree (the
    ``ModuleList`` / ``Sequential`` / numbered ``ModuleDict`` of same-class blocks holding the most parameter owners:
    ``model.layers.*`` in Hugging Face decoders, ``layers.*`` in torchtitan). Set it where that is not the run to
    group (an encoder-decoder's two stacks: owners between the blocks are an error)."""

    block_parts: tuple[tuple[str, ...], ...] | None = None
    """Children of a block (names relative to it) that ``split_blocks`` gives buckets of their own, one tuple per
    bucket, in the order they compute; together they must hold every parameter of the block. ``None``: the
    block's parameter-owning children in compute order, a child under 5 % of the block's bytes (a norm) sharing
    the next one's bucket (the demo: ``[[attention_norm, attention], [ffn_norm, feed_forward]]``)."""

    layers_per_bucket: Annotated[tuple[Annotated[int, Field(ge=1)], ...], Field(min_length=1)] = (1, 2)
    """Blocks per bucket: fewer, larger collectives (less latency) against coarser overlap."""

    split_blocks: Annotated[tuple[bool, ...], Field(min_length=1)] = (False, True)
    """True: each block as ``block_parts`` buckets (attention and feed-forward apart); only with one block per
    bucket."""

    merge_first: Annotated[tuple[bool, ...], Field(min_length=1)] = (False, True)
    """True: the owners before the blocks share the first block's bucket instead of a bucket of their own."""

    merge_last: Annotated[tuple[bool, ...], Field(min_length=1)] = (False, True)
    """True: the owners after the blocks share the last block's bucket."""

    unmerged: Annotated[tuple[tuple[BucketKind, ...], ...], Field(min_length=1)] = (
        (), ("reduce_scatter",), ("all_gather",), ("all_gather", "reduce_scatter"))
    """Which kinds each bucket leaves one per parameter (``OverlapPolicy.unmerged``), each entry a choice: merging
    saves a latency per parameter and costs a copy into and out of a bucket buffer, and which wins depends on the
    machine (torch's ``auto`` merges nothing by default)."""


class TuneSpace(DepthGrid, _Groupings):
    """What ``overlapcfg.tune`` searches: groupings, the depths to try (``overlapcfg.config.depths.DepthGrid``), issue
    orders and caps. By default the grouping comes from the model (its repeated blocks and their parts,
    ``overlapcfg.tuning.structure``); narrow or widen any field (``tune.space.forward_prefetch=[1,2]`` on the
    command line)."""

    issue_order: Annotated[tuple[IssueOrder, ...], Field(min_length=1)] = ("gather_first", "reduce_scatter_first")
    """Issue orders to try (``OverlapPolicy.issue_order``)."""

    max_inflight_bytes: Annotated[tuple[ByteCount | None, ...], Field(min_length=1)] = (None,)
    """In-flight caps to try (traced bytes, as the policy counts them); null: no cap."""

    cap_at_budget: bool = True
    """Also try a cap at the memory budget (converted to traced bytes): each bucket prefetches as deep as the budget
    allows, instead of one depth for all."""

    per_bucket_rounds: int = Field(8, ge=0)
    """Rounds of per-bucket refinement of the best candidates: each round tries deeper prefetch for the buckets
    issuing an all-gather that stalled and a longer delay for a reduce-scatter that stalled, and keeps the best
    move. 0: global values only."""

    per_bucket_candidates: int = Field(3, ge=1)
    """How many of the best grid candidates (distinct groupings first) are refined."""

    max_depth: Depth = 6
    """Deepest per-bucket prefetch depth or delay the refinement may set."""

    max_candidates: int = Field(20000, ge=1)
    """Grid candidates scored at most; a larger grid is sampled (seeded, so the same every run)."""

    seed: int = 0
    """Seed of the grid sample; the search is otherwise deterministic."""


def load_space(space: TuneSpace | Mapping[str, Any] | str | None, *, root: str = "space") -> TuneSpace:
    """A ``TuneSpace`` from a model, a mapping (faults at ``root.<field>``), the name of a shipped space (the
    command's ``tune/space`` options: ``default``, ``quick``, ``wide``) or None (the defaults)."""
    if space is None:
        return TuneSpace()
    if isinstance(space, TuneSpace):
        return space
    data = shipped_space(space, root=root) if isinstance(space, str) else dict(space)
    return validate_config(TuneSpace, data, root=root, header="invalid tune space")


def shipped_space_names() -> list[str]:
    return sorted(p.stem for p in (command_conf_dir() / "tune" / "space").glob("*.yaml"))


def shipped_space(name: str, *, root: str = "space") -> dict[str, Any]:
    """The fields of the shipped space ``name`` as the command composes it: the options its ``defaults`` list
    names first, its own fields on top. Read with the library's config reader (its limits included); Hydra is not
    needed. An unknown name is a config error listing the shipped ones, closest first."""
    names = shipped_space_names()
    if name not in names:
        raise OverlapConfigError.single(root, f"no shipped tune space {name!r}{did_you_mean(name, names)}; choose "
                                              f"one of {', '.join(closest_first(name, names))}, or give a mapping "
                                              "of its fields")
    data = config_data(command_conf_dir() / "tune" / "space" / f"{name}.yaml", root, what="tune space") or {}
    fields: dict[str, Any] = {}
    for parent in data.pop("defaults", []):
        if parent != "_self_":
            fields.update(shipped_space(str(parent), root=root))
    fields.update(data)
    return fields
