"""What ``overlapcfg.tune`` shows people: tables that keep every value whole at 80, 100 and 120 columns, changes
that round to nothing printed without a sign, near-ties settled for less memory, and a Pareto PNG scaled to the
data (units, visible region, preset numbers that do not collide).

Built from hand-made ``TuneResult`` data (no trace, no search), except the tie rule, checked on a real search of a
synthetic step too.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from rich.console import Console

import overlapcfg
from overlapcfg.config.depths import Depths
from overlapcfg.report.labels import fmt_bytes, fmt_change, fmt_seconds
from overlapcfg.tuning import TuneSpace, tune
from overlapcfg.tuning.candidates import TIE_TOLERANCE, Candidate, Knobs, choose
from overlapcfg.tuning.front import front_view, place_labels, write_front_png
from overlapcfg.tuning.quick import Score
from overlapcfg.tuning.render_tune import tune_tables
from overlapcfg.tuning.tune_result import TuneResult
from tests.support.synthetic import captured_step
from tests.support.warm_cli import SCRIPT, shared

MIB = 2**20
CONFIG = overlapcfg.load_config({"plan": "llama_layers"})
BEST = "1 block/bucket fp4 bp1 rs1"


def _candidate(name: str, step: float, inflight: int, *, unsharded: int | None = None, arm: int = 0,
               exposed: float = 9.1e-6) -> Candidate:
    score = Score(step_seconds=step, exposed_comm_seconds=exposed, compute_seconds=120e-6, comm_seconds=100e-6,
                  peak_inflight_bytes=inflight, peak_unsharded_param_bytes=unsharded or 2 * inflight,
                  lower_bound_seconds=123.1e-6, unhidable_bound_seconds=130.5e-6)
    return Candidate(name, arm, Knobs(Depths(), "gather_first", None), score, CONFIG if name == BEST else None)


def _result(*, budget: int | None = 8 * MIB) -> TuneResult:
    """The shape of the trial's demo run (4 layers, h100_nvlink, 8 MiB budget): MiB and µs, a near-tie."""
    best = _candidate(BEST, 132.2e-6, int(2.6 * MIB))
    fastest = _candidate("1 block/bucket, first merged fp4 bp1 rs1", 132.19e-6, int(4.6 * MIB))
    wide = _candidate("attn|ffn split, first merged fp1 bp4 rs2 rs-first +3 per-bucket", 999.99e-3, 1023 * MIB,
                      unsharded=1023 * MIB + 900 * 1024, exposed=999.99e-3)
    presets = tuple(_candidate(name, step, int(mib * MIB), arm=-1) for name, step, mib in (
        ("two_layers_per_bucket / aggressive", 132.6e-6, 2.6), ("llama_layers / default", 133.3e-6, 2.2),
        ("torch_manual llama_layers", 133.3e-6, 2.2), ("llama_layers / aggressive", 133.2e-6, 2.3),
        ("per_block_split / aggressive", 133.6e-6, 2.2), ("per_block_split / default", 135.7e-6, 2.1),
        ("single_bucket / default", 139.1e-6, 4.6)))
    front = (_candidate("attn|ffn split fp1 bp4 rs2", 135.7e-6, int(2.1 * MIB)),
             _candidate("attn|ffn split fp2 bp2 rs1", 133.1e-6, int(2.2 * MIB)), best, fastest)
    grid = tuple(_candidate(f"grey {i}", (132.5 + 0.2 * i) * 1e-6, int((2.2 + 0.1 * (i % 5)) * MIB))
                 for i in range(15))
    rivals = tuple(_candidate(name, step, int(mib * MIB), arm=-2) for name, step, mib in (
        ("none (as traced)", 180.1e-6, 0.1), ("auto (torch's scheduler)", 134.4e-6, 3.1)))
    return TuneResult(config=CONFIG, best=best, fastest=fastest, tie_tolerance=TIE_TOLERANCE,
                      top=(fastest, best, presets[0], wide), pareto=front, presets=presets, competitors=rivals,
                      lower_bound_seconds=121.0e-6, skipped=(),
                      candidates=(*front, *grid, wide), verification=None, stalls=(), hardware="h100_nvlink",
                      world_size=2, memory_budget=budget, as_dtype=None, space=TuneSpace(), evaluated=2042,
                      profile_seconds=0.3, seconds=1.0, arms=12)


def _render(result: TuneResult, width: int) -> str:
    console = Console(width=width, record=True, force_terminal=False, color_system=None)
    console.print(tune_tables(result))
    return console.export_text()


@pytest.mark.parametrize("width", [80, 100, 120])
def test_tune_tables_keep_every_column_and_every_value_whole(width: int) -> None:
    """The trial at 100 columns (and piped, which the command lays out at 120): "peak unsharded" was gone and
    "peak in flight" read ``4.``. Now only the candidate names fold; numbers never wrap or get cut."""
    result = _result()
    text = _render(result, width)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    for header in ("step", "vs best", "exposed", "peak in", "unsharded", "fits"):
        assert header in text, header
    rows = [*result.top, *result.pareto, *result.presets, *result.competitors]
    for c in rows:
        for value in (fmt_seconds(c.step_seconds), fmt_seconds(c.score.exposed_comm_seconds),
                      fmt_bytes(c.peak_inflight_bytes), fmt_bytes(c.score.peak_unsharded_param_bytes)):
            assert re.search(rf"(^|\s){re.escape(value)}(\s|$)", text, re.M), (c.name, value)
    assert "1023.9 MiB" in text and "999.99 ms" in text


def test_a_change_that_rounds_to_nothing_has_no_sign() -> None:
    assert fmt_change(132.2e-6 * (1 - 1e-7), 132.2e-6) == "0.00%"
    assert fmt_change(132.2e-6 * (1 + 1e-7), 132.2e-6) == "0.00%"
    assert (fmt_change(0.9972, 1.0), fmt_change(1.0493, 1.0), fmt_change(1.0, 0.0)) == ("-0.28%", "+4.93%", "—")
    result = _result()
    tied = _candidate("a hair faster", 132.6e-6 * (1 - 1e-8), int(2.6 * MIB))
    text = _render(TuneResult(**{**{f: getattr(result, f) for f in TuneResult.__dataclass_fields__},
                                 "top": (tied, *result.top)}), 100)
    assert not re.search(r"[-+]0\.00%", text)
    assert re.search(r"a hair faster\s+132\.6 µs\s+0\.00%", text)


def test_a_near_tie_goes_to_the_candidate_with_fewer_bytes_in_flight() -> None:
    """The trial's winner was 0.007 % faster for 76 % more bytes in flight."""
    light = _candidate("light", 132.2e-6, int(2.6 * MIB))
    heavy = _candidate("heavy", 132.2e-6 * (1 - 7e-5), int(4.6 * MIB))
    clearly_faster = _candidate("clearly faster", 132.2e-6 * (1 - 2 * TIE_TOLERANCE), int(4.6 * MIB))
    assert choose([heavy, light]) is light
    assert choose([heavy, light, clearly_faster]) is clearly_faster
    assert choose([heavy, light], tolerance=0.0) is heavy


def test_tune_prefers_less_memory_within_the_tolerance_and_says_so() -> None:
    step = captured_step([[2, 1], [1], [3, 2], [1, 1], [2], [1, 3]])
    result = tune(step, hardware="h100_nvlink", world_size=8, memory_budget=None, verify=False,
                  space={"split_blocks": [False], "block_parts": [], "layers_per_bucket": [1, 2]})
    fastest = min(c.step_seconds for c in result.candidates)
    tied = [c for c in result.candidates if c.step_seconds <= fastest * (1 + TIE_TOLERANCE)]
    assert result.best.peak_inflight_bytes == min(c.peak_inflight_bytes for c in tied)
    assert result.fastest.step_seconds == fastest
    if result.fastest.peak_inflight_bytes != result.best.peak_inflight_bytes:
        assert "are a tie, won by the fewest bytes in flight" in result.to_yaml()
    assert result.to_dict()["tie_tolerance"] == TIE_TOLERANCE


def test_the_front_reads_in_the_units_of_the_data() -> None:
    """The trial's PNG: GiB axis from 0 to 0.008, every preset "0.1 ms, 0.00 GiB", 40 % of the canvas empty."""
    result = _result()
    view = front_view(result)
    assert (view.x.unit, view.y.unit) == ("MiB", "µs")
    data_x = [view.x(c.peak_inflight_bytes) for c in result.pareto]
    assert view.x.low > 1.5 and (max(data_x) - min(data_x)) / (view.x.high - view.x.low) > 0.8
    data_y = [view.y(c.step_seconds) for c in result.pareto]
    assert (max(data_y) - min(data_y)) / (view.y.high - view.y.low) > 0.6
    assert not view.budget_shown  # 8 MiB is far right of every point: said in the legend, not drawn
    assert view.unhidable_bound_shown and not view.lower_bound_shown
    lines = [p.line(40) for p in view.presets]
    assert any("132.6 µs" in line and "2.6 MiB" in line for line in lines)
    assert all("GiB" not in line and "0.1 ms" not in line for line in lines)
    slow = next(p for p in view.presets if p.names[0] == "single_bucket / default")
    assert not slow.shown and slow.line(40).endswith("^")
    alike = next(p for p in view.presets if "llama_layers / default" in p.names)
    assert alike.names == ("llama_layers / default", "torch_manual llama_layers")


def test_a_budget_near_the_data_is_drawn_and_over_budget_presets_are_marked() -> None:
    view = front_view(_result(budget=int(2.5 * MIB)))
    assert view.budget_shown and view.x.low <= 2.5 <= view.x.high
    over = {p.names[0] for p in view.presets if not p.fits}
    assert over == {"two_layers_per_bucket / aggressive", "single_bucket / default"}
    assert all(p.line(40).rstrip("^").endswith("!") for p in view.presets if not p.fits)


def test_preset_numbers_placed_around_a_cluster_never_overlap() -> None:
    points = [(100.0 + 3 * (i % 3), 200.0 + 2 * (i // 3)) for i in range(9)]
    sizes = [(12.0, 12.0)] * len(points)
    markers = [(x - 5, y - 5, x + 5, y + 5) for x, y in points]
    offsets = place_labels(points, sizes, markers)
    boxes = []
    for (x, y), (ox, oy), (w, h) in zip(points, offsets, sizes, strict=True):
        left = x + ox if ox > 0 else x + ox - w if ox < 0 else x - w / 2
        bottom = y + oy if oy > 0 else y + oy - h if oy < 0 else y - h / 2
        boxes.append((left, bottom, left + w, bottom + h))
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not (a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]), (a, b)


def test_the_front_png_is_written(tmp_path: Path) -> None:
    path = write_front_png(_result(), tmp_path / "tune_front.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000


@pytest.mark.slow
def test_the_trials_tune_command_reads_whole_when_piped_and_takes_the_lighter_of_a_near_tie(tmp_path: Path) -> None:
    """The trial's command as README gives it, piped (the command lays tables out at 120 columns then)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "COLUMNS")}
    run = tmp_path / "run"
    # the command in a process of its own, forked warm (tests/support/warm_cli.py), its output a pipe
    out = shared().run([str(SCRIPT), "mode=tune", "hardware=h100_nvlink", "tune.memory_budget=8MiB",
                        f"hydra.run.dir={run}"], cwd=tmp_path, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    table = out.stdout.split("Top candidates within the budget", 1)[1].split("tuned config:", 1)[0]
    assert "…" not in table and max(len(line) for line in table.splitlines()) <= 120
    assert "unsharded" in table and not re.search(r"[-+]0\.00%", out.stdout)
    evidence = json.loads((run / "tune.json").read_text())
    best, tolerance = evidence["best"]["score"], evidence["tie_tolerance"]
    fastest = min(c["score"]["step_seconds"] for c in evidence["top"])
    for c in evidence["top"]:
        s = c["score"]
        assert s["peak_inflight_bytes"] >= best["peak_inflight_bytes"] or \
            s["step_seconds"] > fastest * (1 + tolerance), c["name"]
        assert re.search(rf"{re.escape(fmt_bytes(s['peak_unsharded_param_bytes']))}\s+(yes|no)\s*$", table, re.M)
    assert (run / "tune_front.png").stat().st_size > 20_000
