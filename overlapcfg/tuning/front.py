"""``tune_front.png``: step time against peak all-gathered bytes in flight, every candidate, the Pareto front, the
shipped presets (numbered, listed beside the plot) and the winner, with the budget and the lower bounds.

Two parts: ``front_view`` decides what the picture shows (units, the visible region, which presets and bounds fall
inside it, the listing) from the result alone, and ``write_front_png`` draws it. The view is sized to the data, not
to zero: a model of a few MiB reads in MiB and µs, and the axes span the front, the presets near it and the winner
with a small margin. Anything outside (a preset far slower than the winner, a budget far to the right, a bound far
below) is still said, in the listing or the legend, instead of stretching the axes until the front is a dot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from overlapcfg.files import write_atomic
from overlapcfg.report.labels import byte_unit, fmt_bytes, fmt_seconds, time_unit
from overlapcfg.tuning.candidates import Candidate
from overlapcfg.tuning.tune_result import TuneResult

if TYPE_CHECKING:  # drawing imports matplotlib only when it draws
    from matplotlib.axes import Axes

__all__ = ["Axis", "FrontView", "PresetPoint", "front_view", "place_labels", "write_front_png"]

SLOWER_SHOWN = 0.03
"""Points up to this fraction slower than the winner are drawn (and at least the fastest preset); slower presets
are listed as off the view, and the front runs off the top: a single bucket 5 % slower would otherwise squash the
region where the candidates differ into a few rows of pixels."""
MARGIN = 0.06
"""Blank space around the data, as a fraction of each axis' span."""
BELOW_SHOWN = 0.5
"""A lower bound further below the data than this fraction of the step span is named in the legend, not drawn."""
LISTING_HEADER = "shipped presets: step, bytes in flight\n(^ slower than the view shows, ! over the budget)"
_DPI = 110
_FONT_PT = 8


@dataclass(frozen=True, slots=True)
class Axis:
    """One axis in display units: ``value / scale`` is what is plotted, between ``low`` and ``high``."""

    unit: str
    scale: float
    low: float
    high: float

    def __call__(self, raw: float) -> float:
        return raw / self.scale

    def inside(self, raw: float) -> bool:
        return self.low <= raw / self.scale <= self.high


@dataclass(frozen=True, slots=True)
class PresetPoint:
    """Presets at one (bytes, step) point share a marker: ``torch_manual`` and ``default`` of a plan often do."""

    number: int
    names: tuple[str, ...]
    inflight_bytes: int
    step_seconds: float
    fits: bool
    shown: bool

    @property
    def name(self) -> str:
        return self.names[0] + (f" (+{len(self.names) - 1} alike)" if len(self.names) > 1 else "")

    def line(self, width: int) -> str:
        """``" 3. llama_layers / default (+2 alike)   133.3 µs   2.2 MiB ^!"``, the name padded to ``width``;
        ``^``: slower than the view shows, ``!``: over the budget (``LISTING_HEADER`` says so)."""
        flags = ("" if self.shown else "^") + ("" if self.fits else "!")
        return (f"{self.number:>2}. {self.name:<{width}} {fmt_seconds(self.step_seconds):>9} "
                f"{fmt_bytes(self.inflight_bytes):>9} {flags}").rstrip()


@dataclass(frozen=True, slots=True)
class FrontView:
    x: Axis
    """Peak all-gathered bytes in flight."""
    y: Axis
    """Predicted step time."""
    presets: tuple[PresetPoint, ...]
    budget_shown: bool
    lower_bound_shown: bool
    unhidable_bound_shown: bool


def _span(low: float, high: float) -> tuple[float, float]:
    """``(low, high)`` widened by ``MARGIN``; a degenerate span (one point) gets 5 % of its value each side."""
    width = high - low or abs(high) * 0.1 or 1.0
    return low - MARGIN * width, high + MARGIN * width


def _preset_points(result: TuneResult, shown_until: float) -> list[PresetPoint]:
    points: dict[tuple[int, float], list[Candidate]] = {}
    for p in sorted(result.presets, key=lambda c: (c.step_seconds, c.name)):
        points.setdefault((p.peak_inflight_bytes, round(p.step_seconds, 12)), []).append(p)
    return [PresetPoint(k, tuple(c.name for c in group), group[0].peak_inflight_bytes, group[0].step_seconds,
                        result.fits(group[0]), group[0].step_seconds <= shown_until)
            for k, group in enumerate(points.values(), start=1)]


def front_view(result: TuneResult) -> FrontView:
    """What the picture shows; see the module docstring."""
    s, best = result.score, result.best
    cap = best.step_seconds * (1 + SLOWER_SHOWN)
    if result.presets:  # at least the fastest preset, so "tuned vs presets" is always in the picture
        cap = max(cap, min(p.step_seconds for p in result.presets))
    points: list[Candidate] = [best, result.fastest, *(c for c in result.pareto if c.step_seconds <= cap)]
    presets = _preset_points(result, cap)
    steps = [c.step_seconds for c in points] + [p.step_seconds for p in presets if p.shown]
    sizes = [c.peak_inflight_bytes for c in points] + [p.inflight_bytes for p in presets if p.shown]
    low_y, high_y = min(steps), max(steps)
    reach = BELOW_SHOWN * max(high_y - low_y, 0.01 * high_y)
    unhidable = s.unhidable_bound_seconds >= low_y - reach
    lower = result.lower_bound_seconds >= low_y - reach
    for bound, drawn in ((s.unhidable_bound_seconds, unhidable), (result.lower_bound_seconds, lower)):
        if drawn:
            low_y = min(low_y, bound)
    budget = result.memory_budget
    low_x, high_x = min(sizes), max(sizes)
    budget_shown = budget is not None and budget <= high_x + 0.5 * max(high_x - low_x, 0.1 * high_x)
    if budget_shown:
        low_x, high_x = min(low_x, cast(int, budget)), max(high_x, cast(int, budget))  # shown: not None
    x_unit, x_scale = byte_unit(high_x)
    y_unit, y_scale = time_unit(high_y)
    x_low, x_high = _span(low_x / x_scale, high_x / x_scale)
    y_low, y_high = _span(low_y / y_scale, high_y / y_scale)
    return FrontView(Axis(x_unit, x_scale, max(0.0, x_low), x_high), Axis(y_unit, y_scale, y_low, y_high),
                     tuple(presets), budget_shown, lower, unhidable)


Box = tuple[float, float, float, float]
"""``(left, bottom, right, top)`` in pixels."""
_RINGS = (7.0, 16.0, 28.0)
_DIRECTIONS = ((1, 1), (1, -1), (-1, 1), (-1, -1), (1, 0), (-1, 0), (0, 1), (0, -1))


def _overlaps(a: Box, b: Box) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def place_labels(points: Sequence[tuple[float, float]], sizes: Sequence[tuple[float, float]],
                 obstacles: Sequence[Box] = (), frame: Box | None = None) -> list[tuple[float, float]]:
    """Offsets (pixels, from each point to its label's nearest corner) so that no two labels overlap each other
    or an obstacle (the markers), tried ring by ring around each point, nearest first; within ``frame`` if given.
    Greedy, in the order given; a label with no free place takes its last try (a leader line shows whose it is).
    A library would do (adjustText), but it pulls in scipy for a dozen labels."""
    placed: list[Box] = []
    offsets: list[tuple[float, float]] = []
    for (x, y), (w, h) in zip(points, sizes, strict=True):
        choice: tuple[tuple[float, float], Box] | None = None
        for r in _RINGS:
            for dx, dy in _DIRECTIONS:
                ox, oy = dx * r, dy * r
                left = x + ox if dx > 0 else x + ox - w if dx < 0 else x - w / 2
                bottom = y + oy if dy > 0 else y + oy - h if dy < 0 else y - h / 2
                box = (left, bottom, left + w, bottom + h)
                choice = ((ox, oy), box)
                inside = frame is None or (box[0] >= frame[0] and box[1] >= frame[1] and box[2] <= frame[2]
                                           and box[3] <= frame[3])
                if inside and not any(_overlaps(box, o) for o in (*placed, *obstacles)):
                    break
            else:
                continue
            break
        assert choice is not None
        offsets.append(choice[0])
        placed.append(choice[1])
    return offsets


def write_front_png(result: TuneResult, path: Path) -> Path:
    """Draw ``front_view(result)`` into ``path`` (matplotlib, Agg); see the module docstring."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    view = front_view(result)
    x, y = view.x, view.y
    s, best = result.score, result.best
    fig = plt.figure(figsize=(13.5, 6.2), dpi=_DPI)
    grid = fig.add_gridspec(1, 2, width_ratios=(1.5, 1), left=0.065, right=0.99, top=0.92, bottom=0.1, wspace=0.05)
    ax, side = fig.add_subplot(grid[0]), fig.add_subplot(grid[1])
    side.axis("off")
    ax.set_xlim(x.low, x.high)
    ax.set_ylim(y.low, y.high)
    ax.scatter([x(c.peak_inflight_bytes) for c in result.candidates], [y(c.step_seconds) for c in result.candidates],
               s=7, color="#BBBBBB", zorder=1)
    front = result.pareto
    ax.plot([x(c.peak_inflight_bytes) for c in front], [y(c.step_seconds) for c in front], "-o", color="#1f77b4",
            markersize=4, zorder=2)
    handles = [Line2D([], [], marker="o", ls="", color="#BBBBBB", markersize=4, label="candidates"),
               Line2D([], [], marker="o", color="#1f77b4", markersize=4, label="Pareto front")]
    shown = [p for p in view.presets if p.shown]
    ax.scatter([x(p.inflight_bytes) for p in shown], [y(p.step_seconds) for p in shown], marker="s", s=30,
               color="#FF7F0E", zorder=4)
    handles.append(Line2D([], [], marker="s", ls="", color="#FF7F0E", label="shipped presets (numbered, listed below)"))
    ax.scatter([x(best.peak_inflight_bytes)], [y(best.step_seconds)], marker="*", s=260, color="#2CA02C", zorder=5)
    handles.append(Line2D([], [], marker="*", ls="", color="#2CA02C", markersize=13,
                          label=f"tuned: {fmt_seconds(best.step_seconds)}, {fmt_bytes(best.peak_inflight_bytes)}"))
    fast = result.fastest
    if result.tie_note() is not None:
        ax.scatter([x(fast.peak_inflight_bytes)], [y(fast.step_seconds)], marker="o", s=110, facecolors="none",
                   edgecolors="#2CA02C", linewidths=1.5, zorder=5)
        handles.append(Line2D([], [], marker="o", ls="", markerfacecolor="none", markeredgecolor="#2CA02C",
                              markersize=9, label=f"fastest: {fmt_seconds(fast.step_seconds)}, "
                                                  f"{fmt_bytes(fast.peak_inflight_bytes)} (a tie: within "
                                                  f"{100 * result.tie_tolerance:g}%, more memory)"))
    for value, drawn, style, what in ((s.unhidable_bound_seconds, view.unhidable_bound_shown, ":",
                                       "bound of the tuned grouping (its copies, unhidable first AG / last RS)"),
                                      (result.lower_bound_seconds, view.lower_bound_shown, "--",
                                       "lower bound on every config")):
        label = f"{what}: {fmt_seconds(value)}" + ("" if drawn else " (below the view)")
        if drawn:
            ax.axhline(y(value), ls=style, color="#555555", lw=1, zorder=0)
        handles.append(Line2D([], [], ls=style, color="#555555", lw=1, label=label))
    if result.memory_budget:
        budget = result.memory_budget
        where = "" if view.budget_shown else " (right of the view: every point drawn fits)"
        if view.budget_shown:
            ax.axvline(x(budget), color="#D62728", lw=1)
            ax.axvspan(x(budget), x.high, color="#D62728", alpha=0.06, lw=0)
        handles.append(Line2D([], [], color="#D62728", lw=1, label=f"budget {fmt_bytes(budget)}{where}"))
    _number_presets(fig, ax, view, shown, best)
    ax.set_xlabel(f"peak all-gathered bytes in flight ({x.unit})")
    ax.set_ylabel(f"predicted step ({y.unit})")
    ax.grid(alpha=0.3)
    budget_text = f", budget {fmt_bytes(result.memory_budget)}" if result.memory_budget else ""
    fig.suptitle(f"overlapcfg tune: {result.hardware}, {result.world_size} ranks, {result.evaluated} candidates"
                 f"{budget_text}", fontsize=11)
    legend = side.legend(handles=handles, loc="upper left", fontsize=8, frameon=False, borderaxespad=0)
    fig.canvas.draw()
    bottom = side.transAxes.inverted().transform(legend.get_window_extent().p0)[1]
    width = max((len(p.name) for p in view.presets), default=0)
    side.text(0, bottom - 0.04, LISTING_HEADER + "\n" +
              "\n".join(p.line(width) for p in view.presets), transform=side.transAxes, va="top", ha="left",
              fontsize=7, family="monospace")
    try:
        return write_atomic(path, fig.savefig)
    finally:
        plt.close(fig)


def _number_presets(fig: object, ax: Axes, view: FrontView, shown: list[PresetPoint], best: Candidate) -> None:
    """Each drawn preset's number beside it, placed where it overlaps no other number and no marker."""
    to_px = ax.transData.transform
    pts = [tuple(to_px((view.x(p.inflight_bytes), view.y(p.step_seconds)))) for p in shown]
    star = to_px((view.x(best.peak_inflight_bytes), view.y(best.step_seconds)))
    char_w, char_h = 0.62 * _FONT_PT * _DPI / 72, _FONT_PT * _DPI / 72
    sizes = [(char_w * len(str(p.number)) + 2, char_h + 2) for p in shown]
    obstacles = [(px - 5, py - 5, px + 5, py + 5) for px, py in pts] + [(star[0] - 9, star[1] - 9, star[0] + 9,
                                                                         star[1] + 9)]
    x0, y0, x1, y1 = (float(v) for v in ax.get_window_extent().extents)
    frame = (x0, y0, x1, y1)
    offsets = place_labels(pts, sizes, obstacles, frame)
    px_to_pt = 72 / _DPI
    for p, (ox, oy) in zip(shown, offsets, strict=True):
        far = abs(ox) > min(_RINGS) or abs(oy) > min(_RINGS)
        ax.annotate(str(p.number), (view.x(p.inflight_bytes), view.y(p.step_seconds)),
                    xytext=(ox * px_to_pt, oy * px_to_pt), textcoords="offset points", fontsize=_FONT_PT,
                    ha="left" if ox > 0 else "right" if ox < 0 else "center",
                    va="bottom" if oy > 0 else "top" if oy < 0 else "center", zorder=6,
                    arrowprops={"arrowstyle": "-", "color": "#999999", "lw": 0.6} if far else None)
