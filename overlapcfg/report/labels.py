"""How numbers and collective kinds are written in every report, table and timeline (one vocabulary)."""

from __future__ import annotations

__all__ = ["KIND_LABELS", "LEGEND", "ROLE_LABELS", "SHOWN_ORDER", "byte_unit", "fmt_bytes", "fmt_change",
           "fmt_order", "fmt_pct", "fmt_rate", "fmt_seconds", "time_unit"]

KIND_LABELS = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "all_to_all": "A2A", "wait": "W"}
"""Short names of collective kinds (and of a wait) in compact orders, tables and timeline labels."""
ROLE_LABELS = {
    "fsdp_all_gather": "FSDP parameter all-gather (bucketable)",
    "fsdp_reduce_scatter": "FSDP gradient reduce-scatter (bucketable)",
    "hsdp_all_reduce": "HSDP gradient all-reduce (bucketable)",
    "other": "other: TP / EP / user (left alone)",
}
"""How the report names each ``overlapcfg.graph.collectives.CollectiveRole``."""


def byte_unit(n: float) -> tuple[str, int]:
    """The unit ``n`` bytes read in, and its size: ``(MiB, 2**20)`` for 4.6 MiB. Axes pick one for all values."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return unit, size
    return "B", 1


def time_unit(s: float) -> tuple[str, float]:
    """The unit ``s`` seconds read in, and seconds per unit: ``(µs, 1e-6)`` for 132 µs."""
    if abs(s) >= 1:
        return "s", 1.0
    if abs(s) >= 1e-3:
        return "ms", 1e-3
    return "µs", 1e-6


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "—"
    unit, size = byte_unit(n)
    return f"{n} B" if size == 1 else f"{n / size:.1f} {unit}"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "—"
    unit, scale = time_unit(s)
    digits = {"s": 3, "ms": 2}.get(unit, 1)
    return f"{s / scale:.{digits}f} {unit}"


def fmt_rate(tokens_per_second: float | None) -> str:
    """Tokens per second per GPU: ``14.8k tok/s``, ``523 tok/s``."""
    if tokens_per_second is None:
        return "—"
    if tokens_per_second >= 1e4:
        return f"{tokens_per_second / 1e3:.1f}k tok/s"
    return f"{tokens_per_second:.0f} tok/s"


def fmt_pct(share: float | None, digits: int = 1) -> str:
    """A share as a percentage (``38.2%``), or a dash where unknown."""
    return "—" if share is None else f"{100 * share:.{digits}f}%"


def fmt_change(value: float, base: float, digits: int = 2) -> str:
    """``value`` against ``base`` as a signed percentage (``+4.93%``, ``-0.28%``); a change that rounds to zero at
    ``digits`` reads ``0.00%``, never ``-0.00%`` or ``+0.00%`` (a sign would claim a direction nobody can see)."""
    if base <= 0:
        return "—"
    text = f"{100 * (value / base - 1):+.{digits}f}%"
    return text[1:] if float(text[:-1]) == 0 else text


LEGEND = (
    "legend: AG all-gather · RS reduce-scatter · AR all-reduce · fw / bw: forward / backward graph",
    "  9→1: nine collectives merged into one · d2: depth 2 (an all-gather issued 2 buckets ahead; a",
    "  reduce-scatter or all-reduce waited 2 buckets later) · d2→1: asked for 2, placed at 1 (see why)",
    "  order: AG[b] / RS[b] issued for bucket b · W[b] its wait · C×8 eight compute kernels in a row",
)
"""The abbreviations of every report, printed under it (README "Reading a report" says the same at length)."""
SHOWN_ORDER = (40, 12)
"""Order-line items shown before and after the elided middle of a long order (``report.json`` has all of it)."""


def fmt_order(order: str, head: int = SHOWN_ORDER[0], tail: int = SHOWN_ORDER[1]) -> str:
    """A compact order line, its middle elided past ``head + tail`` items (``report.json`` keeps it whole)."""
    items = order.split()
    if len(items) <= head + tail:
        return order
    return " ".join([*items[:head], f"… ({len(items) - head - tail} more, all in report.json) …", *items[-tail:]])
