"""Where overlapcfg keeps its data on fx objects: one namespace, written once at creation, read everywhere else, and
only through the accessors below, so each key has one spelling and one type.

On a node, ``node.meta[NAMESPACE]`` is a dict of:

- ``OWNER_KEY``: the ``CollectiveOwner`` the aot descriptors tie a collective to, on its start and wait
  (``overlapcfg.graph.attribution.annotate_owners``): ``owner`` / ``set_owner``;
- ``SAVED_VIEW_KEY``: on a backward placeholder that the forward saved as a view or cast of a parameter input, that
  input's aot descriptor (``overlapcfg.graph.parameters.mark_saved_parameter_views``): ``saved_view`` /
  ``set_saved_view``;
- on the start and waits of a merged collective (``overlapcfg.graph.merge``), a ``MergedMark``'s fields under
  ``BUCKET_KEY``, ``KIND_KEY``, ``DIRECTION_KEY``, ``PART_KEY`` and ``SOURCES_KEY``: ``merged_mark`` /
  ``mark_merged`` / ``is_merged``. ``PART_KEY`` says which node of the collective this is (``"start"`` or
  ``"wait"``); what a collective does for data parallelism is ``Collective.role``, another thing.

On a graph module, ``gm.meta[NAMESPACE]`` is the ``PassRecord`` of the last pass (``overlapcfg.graph.record``):
``pass_record`` / ``record_pass``.

FSDP collectives whose parameter inputs the graph cannot confirm are not marked on nodes: they are
``Collective.unattributed`` (``overlapcfg.graph.collectives``), and the pass record counts them as uncovered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeAlias, cast

from overlapcfg.graph.record import PassRecord
from overlapcfg.kinds import Direction

if TYPE_CHECKING:
    from torch import fx

    from overlapcfg.kinds import CollectiveKind

__all__ = [
    "BUCKET_KEY",
    "DIRECTION_KEY",
    "KIND_KEY",
    "NAMESPACE",
    "OWNER_KEY",
    "PART_KEY",
    "SAVED_VIEW_KEY",
    "SOURCES_KEY",
    "CollectiveOwner",
    "Evidence",
    "MergedMark",
    "MergedPart",
    "is_merged",
    "mark_merged",
    "merged_mark",
    "owner",
    "pass_record",
    "record_pass",
    "saved_view",
    "set_owner",
    "set_saved_view",
]

NAMESPACE = "overlapcfg"
OWNER_KEY = "owner"
SAVED_VIEW_KEY = "saved_parameter_view"
BUCKET_KEY = "bucket"
KIND_KEY = "kind"
DIRECTION_KEY = "direction"
PART_KEY = "part"
SOURCES_KEY = "sources"

MergedPart: TypeAlias = Literal["start", "wait"]
Evidence: TypeAlias = Literal["descriptor", "custom", "module_stack"]
"""How a ``CollectiveOwner`` was found: aot descriptors, a user's ``module_fqn`` function, or the module stack."""


def _ours(node: fx.Node) -> dict[str, object]:
    found = node.meta.get(NAMESPACE)
    return found if isinstance(found, dict) else {}


@dataclass(frozen=True, slots=True)
class CollectiveOwner:
    """Which parameter (and so which module) an FSDP collective belongs to, and how we know."""

    graph: str
    node: str
    """Name of the collective start node; unique within its graph only."""
    kind: str
    module_fqn: str
    """The module owning the parameter, as the user names it: ``layers.0.attention.wq``."""
    param_fqn: str
    """``layers.0.attention.wq.weight``."""
    wait: str
    """Name of the ``wait_tensor`` node consuming the start."""
    evidence: Evidence = "descriptor"


def owner(node: fx.Node) -> CollectiveOwner | None:
    """The ``CollectiveOwner`` the aot descriptors tie ``node`` (a collective start or wait) to, if any."""
    found = _ours(node).get(OWNER_KEY)  # what set_owner wrote, stored untyped on the node
    return found if isinstance(found, CollectiveOwner) else None


def set_owner(node: fx.Node, found: CollectiveOwner) -> None:
    node.meta.setdefault(NAMESPACE, {})[OWNER_KEY] = found


def saved_view(node: fx.Node) -> object | None:
    """On a backward placeholder the forward saved as a parameter's view: that parameter input's aot descriptor."""
    return _ours(node).get(SAVED_VIEW_KEY)


def set_saved_view(node: fx.Node, descriptor: object) -> None:
    node.meta.setdefault(NAMESPACE, {})[SAVED_VIEW_KEY] = descriptor


@dataclass(frozen=True, slots=True)
class MergedMark:
    """What ``overlapcfg.graph.merge`` writes on each node of a merged collective."""

    bucket: int
    """Index into ``ResolvedPlan.buckets``."""
    kind: CollectiveKind
    direction: Direction
    part: MergedPart
    """The collective's start, or one of its waits."""
    sources: tuple[str, ...]
    """Names of the collective starts it replaced, graph order."""


def mark_merged(node: fx.Node, mark: MergedMark) -> None:
    """Write ``mark`` on a node merging created (a fresh node: nothing else of ours is on it)."""
    node.meta[NAMESPACE] = {BUCKET_KEY: mark.bucket, KIND_KEY: mark.kind, DIRECTION_KEY: mark.direction,
                            PART_KEY: mark.part, SOURCES_KEY: mark.sources}


def is_merged(node: fx.Node) -> bool:
    """Whether ``node`` is a start or wait of a collective our bucketer merged."""
    return BUCKET_KEY in _ours(node)


def merged_mark(node: fx.Node) -> MergedMark | None:
    """The ``MergedMark`` on ``node``, or None if our bucketer did not make it."""
    ours = _ours(node)
    if BUCKET_KEY not in ours:
        return None
    # our namespace holds what mark_merged wrote, field by field, stored untyped on the node
    return MergedMark(cast(int, ours[BUCKET_KEY]), cast("CollectiveKind", ours[KIND_KEY]),
                      cast("Direction", ours[DIRECTION_KEY]), cast("MergedPart", ours[PART_KEY]),
                      cast("tuple[str, ...]", ours[SOURCES_KEY]))


def pass_record(gm: fx.GraphModule) -> PassRecord | None:
    """The ``PassRecord`` of the last pass over ``gm`` (None: no pass has run on it)."""
    found = gm.meta.get(NAMESPACE)
    return found if isinstance(found, PassRecord) else None


def record_pass(gm: fx.GraphModule, record: PassRecord) -> None:
    gm.meta[NAMESPACE] = record
