"""Every public result prints as the command's tables, has a short ``repr``, and writes the command's pictures.

``explain``'s ``Report``, ``compare``'s ``Comparison`` and ``tune``'s ``TuneResult`` come from the public calls on a
synthetic two-layer step (no tracing: ``tests/support/synthetic.py``); ``measure``'s ``Measurement`` and
``calibrate``'s ``CalibratedProfile`` need real ranks, so they are built here from small data (their own slow tests
run the calls: ``tests/measuring``); ``diagnose``'s ``DiagnoseResult`` reads the committed two-rank GPU-format
traces (``tests/diagnosis/fixtures/gpu_fsdp2``, 14 kB each). Found by trying the library as a new user:
``print(tune_result)`` printed a 4.8 MB one-line dataclass repr, the tables and pictures the command writes needed
undocumented functions, and ``tune()`` without ``memory_budget`` was a ``TypeError``.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

import overlapcfg
from overlapcfg.cost.measured_fits import Calibration, CollectiveFit, CollectiveFits, LinkFits
from overlapcfg.errors import OverlapStateError, OverlapUsageError
from overlapcfg.measuring.measure_result import CalibratedProfile, MeasuredConfig, Measurement
from overlapcfg.results import MAX_REPR, Result, presentation
from tests.support.synthetic import captured_step
from tests.support.warm_cli import shared

ROOT = Path(overlapcfg.__file__).resolve().parent.parent
GPU_TRACES = ROOT / "tests" / "diagnosis" / "fixtures" / "gpu_fsdp2"
PNG = b"\x89PNG\r\n\x1a\n"
TINY_SPACE = {"split_blocks": [False], "block_parts": [], "layers_per_bucket": [1], "forward_prefetch": [1, 2],
              "backward_prefetch": [1], "reduce_scatter_delay": [1]}
"""A search of a few dozen candidates: enough for every table, well under a second."""


@pytest.fixture(scope="module")
def results() -> dict[str, Result]:
    step = captured_step([[1], [2, 1]])
    report = overlapcfg.explain(step, {"plan": {"buckets": ["layers.*"]}}, hardware="h100_nvlink", world_size=8)
    comparison = overlapcfg.compare(step, [{"strategy": "none"}, {"plan": {"buckets": ["layers.*"]}}],
                                    hardware="h100_nvlink", world_size=8)
    tuned = overlapcfg.tune(step, hardware="h100_nvlink", world_size=8, space=TINY_SPACE)  # no memory_budget
    diagnosed = overlapcfg.diagnose(GPU_TRACES)
    return {"explain": report, "compare": comparison, "tune": tuned, "measure": _measurement(),
            "calibrate": _calibrated(), "diagnose": diagnosed}


def _measurement() -> Measurement:
    row: dict[str, Any] = {"overrides": {}, "config": {}, "predicted_exposed_s": 0.002, "measured_spread_s": 0.001,
                           "measured_exposed_s": 0.003, "measured_profiled_step_s": 0.021,
                           "step_seconds": (0.02, 0.021)}
    configs = tuple(MeasuredConfig(name=name, predicted_step_s=p, measured_step_s=m, measured_wall_s=m + 0.01, **row)
                    for name, p, m in (("depth 1", 0.018, 0.02), ("depth 2", 0.017, 0.021)))
    return Measurement(hardware=overlapcfg.load_hardware("cpu_gloo"), world_size=2, backend="gloo", device="cpu",
                       date="2026-12-06", torch_version="2.13.0", warmup=1, steps=2, profiled_steps=1,
                       configs=configs)


def _calibrated() -> CalibratedProfile:
    fit = CollectiveFit(latency=40e-6, bandwidth=3e9)
    record = Calibration(date="2026-12-06", torch_version="2.13.0", overlapcfg_version=overlapcfg.__version__,
                         backend="gloo", device="cpu", world_size=2, hosts=1, base="cpu_gloo", budget_seconds=3.0,
                         seconds=2.5, groups=())
    base = overlapcfg.load_hardware("cpu_gloo").model_dump()
    return CalibratedProfile.model_validate({**base, "name": "my_cluster", "calibration": record.model_dump(),
                                             "collectives": CollectiveFits(intra_node=LinkFits(all_gather=fit))})


# result -> what the command's tables say (titles and column headers), as the command prints them
HEADERS = {
    "explain": ("overlapcfg: strategy manual, traced at world size 2", "bucket", "fw AG",
                "graphs, traced at world size 2", "FSDP collectives",
                "Prediction: h100_nvlink, world size 8 (traced at 2)", "exposed communication"),
    "compare": ("compare: h100_nvlink, world size 8 (traced at 2)", "config", "strategy", "exposed", "overlap"),
    "tune": ("Tuned for h100_nvlink at 8 ranks", "Top candidates within the budget", "Pareto front",
             "Shipped presets on the same trace", "no memory budget"),
    "measure": ("predicted (cpu_gloo) vs measured: gloo x 2 on cpu", "predicted", "measured", "median |error|"),
    "calibrate": ("calibrated profile 'my_cluster'", "all_gather", "latency", "bandwidth"),
    "diagnose": ("2 traces, ranks 0, 1 of 2 (cuda", "per rank and step (ms)", "exposed", "per bucket, per step",
                 "verdict:"),
}


@pytest.mark.parametrize("name", list(HEADERS))
def test_print_shows_the_commands_tables_as_plain_text(results: dict[str, Result], name: str) -> None:
    result = results[name]
    text = str(result)
    for header in HEADERS[name]:
        assert header in text, (name, header)
    assert "\x1b" not in text  # no colour codes into a file or a pipe
    assert text == overlapcfg.results.plain_text(presentation(result).draw(result))  # the command's renderable


@pytest.mark.parametrize("name", list(HEADERS))
def test_rich_print_draws_the_same_tables(results: dict[str, Result], name: str) -> None:
    console = Console(width=120, record=True, force_terminal=True, color_system="truecolor")
    console.print(results[name])
    assert HEADERS[name][0] in console.export_text()


@pytest.mark.parametrize("name", list(HEADERS))
def test_repr_is_one_short_line_naming_the_result(results: dict[str, Result], name: str) -> None:
    text = repr(results[name])
    assert len(text) <= MAX_REPR and "\n" not in text
    assert text.startswith(f"{type(results[name]).__name__}(")


def test_the_repr_of_a_search_of_thousands_of_candidates_stays_short(results: dict[str, Result]) -> None:
    """The trial's ``print(tune_result)``: 4.8 MB on one line. A summary does not grow with the data."""
    tuned = results["tune"]
    assert isinstance(tuned, overlapcfg.TuneResult)
    big = dataclasses.replace(tuned, candidates=tuned.candidates * 200, top=tuned.top * 50)
    assert len(repr(big)) <= 300
    assert "no memory budget" in repr(big) and tuned.best.name in repr(big)


def test_tune_without_a_memory_budget_searches_unbounded_and_says_so(results: dict[str, Result]) -> None:
    tuned = results["tune"]
    assert isinstance(tuned, overlapcfg.TuneResult)
    assert tuned.memory_budget is None and all(tuned.fits(c) for c in tuned.candidates)
    assert "no memory budget" in tuned.to_yaml().splitlines()[0]
    assert inspect.signature(overlapcfg.tune).parameters["memory_budget"].default is None


def test_tune_plot_writes_the_commands_front_png(results: dict[str, Result], tmp_path: Path) -> None:
    tuned = results["tune"]
    assert isinstance(tuned, overlapcfg.TuneResult)
    path = tuned.plot(tmp_path / "tune_front.png")
    assert path == tmp_path / "tune_front.png" and path.read_bytes().startswith(PNG)
    with pytest.raises(OverlapUsageError, match=r"must end in \.png"):
        tuned.plot(tmp_path / "tune_front.svg")


@pytest.mark.parametrize("name", ["explain", "compare", "tune", "diagnose"])
def test_timeline_writes_a_gantt_png_or_a_chrome_trace(results: dict[str, Any], name: str, tmp_path: Path) -> None:
    result = results[name]
    if name == "compare":  # one picture is enough here (a second each on a busy machine); the slow test draws all
        assert result.timeline(tmp_path / "timeline.png").read_bytes().startswith(PNG)
    trace = json.loads(result.timeline(tmp_path / "timeline.json").read_text())
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    rows = [r.name for r in result.rows] if name == "compare" else [None] * (len(result.ranks) if name == "diagnose"
                                                                              else 1)
    assert len(names) == len(rows) and (name != "compare" or names == rows)
    with pytest.raises(OverlapUsageError, match=r"must end in \.png or \.json"):
        result.timeline(tmp_path / "timeline.txt")


def test_a_timeline_without_a_prediction_says_how_to_get_one(tmp_path: Path) -> None:
    report = overlapcfg.explain(captured_step([[1], [1]]), {"plan": {"buckets": ["layers.*"]}})
    with pytest.raises(OverlapStateError, match="explain it with a hardware profile"):
        report.timeline(tmp_path / "timeline.png")


def test_a_diagnosis_read_back_from_json_says_it_has_no_step_to_draw(results: dict[str, Any],
                                                                      tmp_path: Path) -> None:
    again = overlapcfg.DiagnoseResult.from_json(results["diagnose"].to_json())
    assert again == results["diagnose"] and str(again) == str(results["diagnose"])
    with pytest.raises(OverlapStateError, match="read back from JSON"):
        again.timeline(tmp_path / "timeline.png")


def test_the_files_the_command_writes_are_methods(results: dict[str, Any], tmp_path: Path) -> None:
    assert json.loads(results["diagnose"].to_json())["schema"] == "overlapcfg.diagnose/1"
    assert results["diagnose"].to_yaml().startswith("# overlapcfg diagnose: ")
    assert json.loads(results["explain"].to_json())["schema"] == "overlapcfg.report/5"
    assert json.loads(results["compare"].to_json())["rows"]
    assert overlapcfg.load_config(results["tune"].to_yaml()) == results["tune"].config
    assert json.loads(results["measure"].to_json())["summary"]["median_abs_error"] is not None
    calibrated = results["calibrate"]
    text = calibrated.to_yaml()
    assert text.startswith("# Calibrated by overlapcfg ")
    (tmp_path / "my_cluster.yaml").write_text(text)
    assert overlapcfg.load_hardware(tmp_path / "my_cluster.yaml") == calibrated


def test_a_calibrated_profile_is_a_hardware_profile_equal_to_its_file(tmp_path: Path) -> None:
    calibrated = _calibrated()
    plain = overlapcfg.HardwareProfile.model_validate(calibrated.model_dump())
    assert isinstance(calibrated, overlapcfg.HardwareProfile) and calibrated == plain and plain == calibrated
    assert hash(calibrated) == hash(CalibratedProfile.of(plain))


# --- the presenting module is imported by name: check the edge import-linter cannot see ---------------------------

LAYERS = ("config", "resolve", "graph", "strategies|fsdp2", "passes", "cost", "report|capture", "tuning|measuring",
          "diagnosis", "demo|integrations")


def _layer(module: str) -> int:
    top = module.split(".")[1]
    return next(i for i, names in enumerate(LAYERS) if top in names.split("|"))


def _all_results() -> list[type[Result]]:
    for name in ("overlapcfg.report", "overlapcfg.tuning.tune_result", "overlapcfg.measuring.measure_result",
                 "overlapcfg.diagnosis.diagnosis_result"):
        importlib.import_module(name)
    found, todo = [], list(Result.__subclasses__())
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted({c for c in found if c.__module__.startswith("overlapcfg.")}, key=lambda c: c.__qualname__)


def test_the_public_results_are_results() -> None:
    names = {c.__name__ for c in _all_results()}
    assert {"Report", "Comparison", "TuneResult", "Measurement", "CalibratedProfile", "DiagnoseResult"} <= names


@pytest.mark.parametrize("cls", _all_results(), ids=lambda c: c.__name__)
def test_each_result_is_presented_by_a_module_that_imports_it_from_its_own_layer_or_above(cls: type) -> None:
    presenter = cls.presented_by
    assert presenter.startswith("overlapcfg."), cls
    assert _layer(presenter) >= _layer(cls.__module__)
    tree = ast.parse(Path(importlib.import_module(presenter).__file__ or "").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert cls.__module__ in imported, f"{presenter} does not import {cls.__module__}"
    source = Path(importlib.import_module(cls.__module__).__file__ or "").read_text()
    assert not re.search(rf"^\s*(from|import) {re.escape(presenter)}\b", source, re.M)  # data never imports it
    assert re.search(rf"^present\({cls.__name__},", Path(importlib.import_module(presenter).__file__ or "")
                     .read_text(), re.M)


# --- docs/results.md: the signatures as the code has them, and its example run as written --------------------------

DOCS = ROOT / "docs" / "results.md"


def _plain_signature(fn: Any) -> str:
    """``tune(step, *, hardware, world_size=None, ...)``: names and defaults, no annotations."""
    parts, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        star = star or p.kind is p.VAR_POSITIONAL
        prefix = "*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else ""
        parts.append(prefix + p.name + ("" if p.default is p.empty else f"={p.default!r}"))
    return f"{fn.__name__}({', '.join(parts)})"


@pytest.mark.parametrize("name", ["explain", "compare", "tune", "measure", "calibrate", "diagnose"])
def test_the_results_page_gives_each_calls_signature_as_the_code_has_it(name: str) -> None:
    page = " ".join(DOCS.read_text().split())
    assert f"`{_plain_signature(getattr(overlapcfg, name))}`" in page


@pytest.mark.slow  # traces the demo step and tunes it (a minute under load)
def test_the_results_page_example_writes_the_front_png_and_timelines_with_one_call_each(tmp_path: Path) -> None:
    code = re.search(r"## One call each\n\n(?:<!--.*?-->\n)?```python\n(.*?)```", DOCS.read_text(), re.S)
    assert code is not None
    (tmp_path / "example.py").write_text(code.group(1))
    # ``python example.py`` in a process of its own, forked warm (tests/support/warm_cli.py)
    out = shared().run([sys.executable, "example.py"], cwd=tmp_path, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    for name in ("tune_front.png", "tuned_step.png", "timeline.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG), name
    assert overlapcfg.load_config(tmp_path / "tuned.yaml").strategy
    for header in ("Tuned for h100_nvlink at 64 ranks", "no memory budget", "compare: h100_nvlink, world size 64",
                   "as traced", "Prediction: h100_nvlink, world size 64"):
        assert header in out.stdout, header


def test_a_summary_counts_in_the_singular_for_one() -> None:
    """The trial: ``Report(strategy='manual', plan='tuned', 1 buckets, ...)``."""
    report = overlapcfg.explain(captured_step([[1], [1]]), {"plan": {"buckets": [["layers.*"]]}})
    assert len(report.buckets) == 1 and ", 1 bucket, " in repr(report)
    assert overlapcfg.results.counted(2, "row") == "2 rows"
