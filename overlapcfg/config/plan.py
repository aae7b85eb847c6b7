"""Bucket plans: *which* modules' collectives are merged into one. How far ahead they run lives in ``policy.py``.

Patterns are checked for syntax here, so a typo fails at load time; whether they match a real module is
checked when the plan is resolved against a model (``overlapcfg.resolve``).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from overlapcfg.config.base import ConfigModel
from overlapcfg.config.depths import DEPTH_FIELDS, DepthChanges
from overlapcfg.errors import OverlapConfigError

__all__ = ["DEPTH_FIELDS", "Bucket", "BucketEntry", "BucketPlan", "ModuleOverride", "PatternText", "check_pattern"]


def check_pattern(text: Any) -> str:
    """Validate pattern syntax, turning the grammar's error into a located pydantic error."""
    from overlapcfg.config.patterns import compile_pattern

    if not isinstance(text, str):
        raise PydanticCustomError("pattern_type", "expected a module pattern string, got {got}",
                                  {"got": type(text).__name__})
    try:
        compile_pattern(text)
    except OverlapConfigError as err:
        raise PydanticCustomError("pattern", "{msg}", {"msg": "; ".join(f.message for f in err.faults)}) from None
    return text


PatternText = Annotated[str, AfterValidator(check_pattern)]
"""A module-FQN pattern (see ``overlapcfg.config.patterns``), syntax-checked on load."""


def _check_reshard(value: Any) -> bool | int | None:
    # FSDP2's own type: a bool, or an int number of ranks. 0 is not false here, and "true" is not true.
    if value is None or isinstance(value, bool) or (isinstance(value, int) and value >= 1):
        return value
    raise PydanticCustomError("reshard_after_forward",
                              "expected true, false or an integer >= 1 (ranks to reshard to), got {got}",
                              {"got": repr(value)})


ReshardAfterForward = Annotated[bool | int | None, BeforeValidator(_check_reshard)]
"""FSDP2's ``reshard_after_forward``: a bool, or an integer number of ranks (>= 1); None means not set."""


class _Members(ConfigModel):
    """A plan entry's modules and how they are split (``Bucket`` holds these fields first, then its depths)."""

    modules: tuple[PatternText, ...] = Field(min_length=1)
    """Patterns of the modules this entry holds."""
    per: PatternText | None = None
    """One bucket for each module matching this pattern, holding the matches of ``modules`` inside it."""
    group_size: int | None = Field(None, ge=1)
    """Chunk the matches into consecutive groups of this many modules; None puts them all in one bucket."""


class Bucket(DepthChanges, _Members):
    """A plan entry written as a mapping: the patterns it holds, how they are split into buckets, and the depths
    of those buckets in place of the policy's (``overlapcfg.config.depths.DepthChanges``).

    ``{modules: [layers.*.attention_norm, layers.*.attention], per: layers.*}`` gives one bucket per layer holding
    that layer's attention and its norm.
    """

    reshard_after_forward: ReshardAfterForward = None
    """FSDP2's own meaning: true frees these buckets' unsharded parameters after forward (all-gathered again in
    backward), false keeps them until backward, an integer N reshards them to groups of N ranks (a divisor of the
    shard world size). None keeps the value given to ``fully_shard`` (FSDP2's default: true), or on a graph what
    was traced. ``overlapcfg.fully_shard`` passes it to FSDP2. On a whole-step graph traced with resharding,
    false makes the backward read the forward's gathered parameters instead of re-gathering them
    (``overlapcfg.passes.keep_unsharded``); true and integers cannot add all-gathers to a graph and are noted as
    ignored there, as is any value on aot's separate forward and backward graphs."""



def _entry_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "<pattern>"
    if isinstance(value, (list, tuple)):
        return "<list>"
    if isinstance(value, (dict, Bucket)):
        return "<mapping>"
    return None


BucketEntry = Annotated[
    Annotated[PatternText, Tag("<pattern>")]
    | Annotated[tuple[PatternText, ...], Field(min_length=1), Tag("<list>")]
    | Annotated[Bucket, Tag("<mapping>")],
    Discriminator(
        _entry_kind,
        custom_error_type="bucket_entry",
        custom_error_message=(
            "expected a pattern (one bucket per matched module), a list of patterns (one bucket), "
            "or a mapping with 'modules'"
        ),
    ),
]
"""One plan entry. Tags in angle brackets never collide with field names; error paths drop them."""


class BucketPlan(ConfigModel):
    """An ordered list of entries; each entry becomes one or more buckets when resolved against a model."""

    buckets: tuple[BucketEntry, ...] = ()
    """Entries, in any order (buckets are scheduled in graph order). Forms: ``layers.*`` (one bucket per match),
    ``[norm, output]`` (one bucket for all), or a mapping (see ``Bucket``). Empty: nothing is bucketed."""
    require_full_coverage: bool = False
    """Make it an error for a module owning FSDP parameters to fall outside every bucket."""
    name: str | None = None
    """A label for reports; a preset sets it to its own name."""



class _Match(ConfigModel):
    """What an override reaches (``ModuleOverride`` holds this field first, then its depths)."""

    match: PatternText
    """A module pattern, e.g. ``layers.0`` or ``layers.28:32``."""


class ModuleOverride(DepthChanges, _Match):
    """Per-module depths (``overlapcfg.config.depths.DepthChanges``), applied to every bucket holding a module
    that ``match`` matches (later ones win)."""

    @model_validator(mode="after")
    def _sets_something(self) -> ModuleOverride:
        if not self.changes():
            raise PydanticCustomError("empty_override", "an override must set at least one of {keys}",
                                      {"keys": ", ".join(DEPTH_FIELDS)})
        return self
