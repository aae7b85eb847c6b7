"""How numbers and collective kinds are written in every report, table and timeline (one vocabulary)."""

from __future__ import annotations

__all__ = ["KIND_LABELS", "fmt_bytes", "fmt_count", "fmt_seconds"]

KIND_LABELS = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "all_to_all": "A2A", "wait": "W"}
"""Short names of collective kinds (and of a wait) in compact orders, tables and timeline labels."""


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "—"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "—"
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


def fmt_count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


