"""The per-bucket table of a report, readable at 100 columns.

One column per collective kind the report holds (``fw AG``, ``bw AG``, ``bw RS``, ``bw AR``), each cell the
merge and the depth together (``9→1 d1→0``: nine collectives merged into one, depth 1 asked for, placed at 0),
and a ``why`` cell for every depth that was lowered, the end of the graph included. The plan entry is shown by
index, its text once under the table. Buckets that differ only in their layer index (same entry, sizes,
collectives, depths and reasons) are one row named by the range (``layers.1`` to ``layers.31`` with an en dash
between 1 and 31) with ``(31 buckets, identical)`` under it, so a 32-layer model is a handful of rows;
``report.json`` keeps every bucket. A ``held`` column appears where a bucket keeps its gathered parameters from
forward to backward (``reshard_after_forward: false`` on a whole-step graph): the memory that costs.

Rendering only: every value comes from the report's ``BucketRecord``s.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from rich import box
from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from overlapcfg.config.depths import DEPTH_OF, depth_field
from overlapcfg.graph.record import BucketRecord
from overlapcfg.report.labels import KIND_LABELS, fmt_bytes

__all__ = ["BucketRow", "bucket_rows", "bucket_table", "plan_entries"]

_DIR = {"forward": "fw", "backward": "bw"}
_ORDER: tuple[tuple[str, str], ...] = tuple(DEPTH_OF)
"""Columns in schedule order: each (direction, kind) a depth schedules (``overlapcfg.config.depths.DEPTH_OF``)."""
_INDEX = re.compile(r"(?<![^.+])(\d+)(?![^.+])")
"""A whole-segment integer of a bucket name (``layers.12``, ``layers.3.attention+layers.3.ffn``)."""
_WRAP_AT = 28
"""Bucket names longer than this are shown one ``+`` part per line."""
_ENTRIES_ON_ONE_LINE = 90
"""Plan entries are listed on one line up to this length, else one per line."""


@dataclass(frozen=True, slots=True)
class BucketRow:
    """One table row: a bucket, or several that differ only in their layer index (``label`` names the range)."""

    label: str
    buckets: tuple[BucketRecord, ...]

    @property
    def bucket(self) -> BucketRecord:
        return self.buckets[0]


def _kinds(buckets: Sequence[BucketRecord]) -> list[tuple[str, str]]:
    """(direction, kind) pairs present in any bucket: the known ones in schedule order, then the rest."""
    present: dict[tuple[str, str], None] = dict.fromkeys((c.direction, c.kind) for b in buckets for c in b.collectives)
    return [k for k in _ORDER if k in present] + [k for k in present if k not in _ORDER]


def _header(direction: str, kind: str) -> str:
    return f"{_DIR.get(direction, direction)} {KIND_LABELS.get(kind, kind)}"


def _cell(b: BucketRecord, direction: str, kind: str) -> str:
    """``9→1 d1`` / ``9→1 d1→0`` (merge, then depth requested→placed); ``""`` where the bucket has none."""
    change = b.changes(direction, kind)
    if change is None:
        return ""
    text = f"{change.before}→{change.after}"
    if depth_field(direction, kind) is None:
        return text
    requested = b.depth(direction, kind)
    placed = [d.effective for d in b.decisions if (d.direction, d.kind) == (direction, kind)]
    return f"{text} d{requested}" if not placed or placed[0] == requested else f"{text} d{requested}→{placed[0]}"


def _why(b: BucketRecord) -> str:
    """Each lowered depth with its reason, the end of the graph included: ``bw AG: end of graph``."""
    reasons = (f"{_header(d.direction, d.kind)}: {d.reason}" for d in b.decisions if d.reason)
    return "; ".join(dict.fromkeys(reasons))


def _signature(b: BucketRecord, kinds: Sequence[tuple[str, str]]) -> tuple[object, ...]:
    """Everything a row shows except the name: rows with equal signatures say the same thing."""
    return (b.entry_index, b.param_count, b.numel, b.unsharded_bytes, b.sharded_bytes, b.held_bytes,
            tuple(_cell(b, *k) for k in kinds), _why(b))


def _template(name: str) -> tuple[str, int] | None:
    """``layers.3.attention+layers.3.ffn`` -> (``layers.\\0.attention+layers.\\0.ffn``, 3); None unless exactly one
    layer index appears in the name."""
    indices = set(_INDEX.findall(name))
    if len(indices) != 1:
        return None
    (index,) = indices
    return _INDEX.sub("\0", name), int(index)


def _ranges(indices: Sequence[int]) -> str:
    """Runs of consecutive indices joined by an en dash, others by commas (``0``, en dash, ``3, 5``): bucket names
    already use ``-`` for one bucket spanning layers."""
    out: list[str] = []
    start: int | None = indices[0]
    for prev, cur in zip(indices, [*indices[1:], None], strict=True):
        if cur != prev + 1:
            out.append(str(start) if start == prev else f"{start}–{prev}")
            start = cur
    return ", ".join(out)


def bucket_rows(buckets: Sequence[BucketRecord]) -> tuple[BucketRow, ...]:
    """The rows of the table, in bucket order: buckets with one layer index and equal signatures are one row,
    placed where its first bucket is and named by the index range; a lone bucket keeps its name."""
    kinds = _kinds(buckets)
    groups: dict[tuple[object, ...], list[tuple[int, BucketRecord]]] = {}
    order: list[tuple[object, ...]] = []
    for i, b in enumerate(buckets):
        found = _template(b.name)
        key: tuple[object, ...] = (found[0], _signature(b, kinds)) if found else ("", i)
        if key not in groups:
            order.append(key)
        groups.setdefault(key, []).append((found[1] if found else -1, b))
    rows = []
    for key in order:
        members = groups[key]
        if len(members) == 1:
            rows.append(BucketRow(members[0][1].name, (members[0][1],)))
            continue
        template = str(key[0])
        rows.append(BucketRow(template.replace("\0", _ranges(sorted(i for i, _ in members))),
                              tuple(b for _, b in members)))
    return tuple(rows)


def _bucket_cell(row: BucketRow) -> Text:
    label = row.label
    if len(label) > _WRAP_AT and "+" in label:
        label = "+\n".join(label.split("+"))
    text = Text(label, style="bold")
    if len(row.buckets) > 1:
        text.append(f"\n({len(row.buckets)} buckets, identical)", style="dim")
    elif "..." in row.bucket.name:
        text.append(f"\n({len(row.bucket.modules)} modules)", style="dim")
    return text


def plan_entries(buckets: Sequence[BucketRecord]) -> list[str]:
    """``[i] <entry as written>`` for every plan entry that produced a bucket, in plan order."""
    entries = dict(sorted({b.entry_index: b.entry_text for b in buckets}.items()))
    return [f"[{i}] {text}" for i, text in entries.items()]


def bucket_table(title: str, buckets: Sequence[BucketRecord], *, world_size: int, source: str = "traced") -> Group:
    """The per-bucket table (see the module docstring) and the plan entries it refers to by index.

    Every number in it is for the world size the buckets were made at (``world_size``, as ``source`` says:
    ``traced``, or ``sharded`` for eager FSDP2), and the title says so: a prediction printed below it may be for
    another. What each rank keeps of a bucket is read off the records (``sharded_bytes``: its shard of the group
    that gathers it, which is the world only for plain FSDP; HSDP and tensor parallel shard over fewer ranks)."""
    kinds = _kinds(buckets)
    rows = bucket_rows(buckets)
    title = f"{title}, {source} at world size {world_size}"
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    # Only `why` wraps: rich shrinks every wrappable column to fit, and a bucket name must never be cut (long
    # names are already one `+` part per line).
    table.add_column("bucket", no_wrap=True)
    table.add_column("entry", justify="right", no_wrap=True)
    table.add_column("params", justify="right", no_wrap=True)
    table.add_column("unsharded", justify="right", no_wrap=True)
    held = any(b.held_bytes for b in buckets)
    if held:
        table.add_column("held", justify="right", no_wrap=True)
    for direction, kind in kinds:
        table.add_column(_header(direction, kind), no_wrap=True)
    table.add_column("why (depth lowered)", style="yellow", min_width=12)
    for row in rows:
        b = row.bucket
        held_cell = [fmt_bytes(b.held_bytes) if b.held_bytes else ""] if held else []
        table.add_row(_bucket_cell(row), f"[{b.entry_index}]", str(b.param_count), fmt_bytes(b.unsharded_bytes),
                      *held_cell, *(_cell(b, *k) for k in kinds), escape(_why(b)))
    entries = plan_entries(buckets)
    one_line = "plan entries: " + " · ".join(entries)
    text = one_line if len(one_line) <= _ENTRIES_ON_ONE_LINE else "\n  ".join(["plan entries:", *entries])
    sharded = "unsharded: bytes one all-gather brings in (at any world size); " + _kept(buckets, world_size, source)
    if held:
        sharded += ("\nheld: unsharded bytes kept from the forward gather to the backward instead of gathered again "
                    "(reshard_after_forward: false)")
    return Group(table, Text("\n".join([text, sharded]) if entries else sharded, style="dim"))


def _kept(buckets: Sequence[BucketRecord], world_size: int, source: str) -> str:
    """What each rank keeps of a bucket at the world size the table is for, from the records' own sizes."""
    shards = {round(b.unsharded_bytes / b.sharded_bytes) for b in buckets if b.sharded_bytes and b.unsharded_bytes}
    if len(shards) != 1:
        return f"each rank keeps its shard of it ({source} at world size {world_size}; sharded_bytes in report.json)"
    (group,) = shards
    if group == world_size:
        return f"each of the {world_size} {source} ranks keeps 1/{group} of it"
    return (f"each rank keeps 1/{group} of it, its shard of the {group}-rank group that gathers it ({source} at world "
            f"size {world_size})")
