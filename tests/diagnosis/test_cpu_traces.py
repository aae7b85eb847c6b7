"""Real gloo traces written by each rank's own ``torch.profiler`` (``fixtures/README.md``): the numbers agree with an
independent reading of the same files, every collective is attributed, and the result has the surface every
overlapcfg result has."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import rich.console

from overlapcfg.config import load_config
from overlapcfg.diagnosis import DiagnoseResult, diagnose
from overlapcfg.module_paths import ModelFacts, with_parents
from overlapcfg.resolve import resolve_config
from tests.support.diagnose_jobs import CONFIGS
from tests.support.trace_oracle import exposed_per_step

ROUTES = {"cpu_fsdp2_poor": ("fsdp2", "poor"), "cpu_compiled_good": ("compiled", "good")}


@pytest.fixture(scope="module")
def diagnosed(cpu_fixtures: Path) -> dict[str, DiagnoseResult]:
    return {name: diagnose(cpu_fixtures / name, CONFIGS[key]) for name, key in ROUTES.items()}


@pytest.mark.parametrize("name", sorted(ROUTES))
def test_exposed_communication_agrees_with_an_independent_reading(cpu_fixtures: Path,
                                                                  diagnosed: dict[str, DiagnoseResult],
                                                                  name: str) -> None:
    r = diagnosed[name]
    for rank in (0, 1):
        oracle = exposed_per_step(cpu_fixtures / name / f"rank{rank}.json.gz")
        assert set(oracle) == set(r.steps)
        for step, seconds in oracle.items():
            assert r.exposed(rank, step) == pytest.approx(seconds, rel=0.15), (rank, step)
            assert seconds > 0


@pytest.mark.parametrize("name", sorted(ROUTES))
def test_every_collective_is_attributed_to_a_bucket(diagnosed: dict[str, DiagnoseResult], name: str) -> None:
    r = diagnosed[name]
    assert r.collectives > 0 and r.unattributed == 0 and r.other == 0
    sources = {b.source for b in r.buckets}
    assert sources == ({"fsdp2 label"} if "fsdp2" in name else {"overlapcfg record"})


def test_eager_fsdp2_on_gloo_is_found_blocking_and_deeper_prefetch_is_not_proposed(
        diagnosed: dict[str, DiagnoseResult]) -> None:
    r = diagnosed["cpu_fsdp2_poor"]
    assert r.blocking
    depth = [c for c in r.candidates if c.change == "depth"]
    assert depth and all(c.gain_s == 0 and c.reason for c in depth)
    assert r.proposal is None or r.proposal.change in ("merge", "reshard")
    assert any("deeper prefetch cannot hide" in n for n in r.notes)
    # the buckets are the plan's: one per parameter owner, named as a resolved plan names them
    assert {b.bucket for b in r.buckets} >= {"model.layers.0.self_attn.q_proj", "lm_head", "model.embed_tokens"}


def test_compiled_graphs_are_attributed_by_the_record_the_backend_left(diagnosed: dict[str, DiagnoseResult]) -> None:
    r = diagnosed["cpu_compiled_good"]
    assert not r.blocking
    assert [b.bucket for b in r.buckets] == ["model.embed_tokens", "model.layers.0", "model.norm+lm_head"]
    assert {b.kinds for b in r.buckets} >= {"AG fw, AG bw, RS"}


@pytest.mark.parametrize("name", sorted(ROUTES))
def test_a_proposal_is_a_config_that_loads_and_fits_the_model(diagnosed: dict[str, DiagnoseResult],
                                                              name: str) -> None:
    r = diagnosed[name]
    ranked = [c.gain_s for c in r.candidates]
    assert ranked == sorted(ranked, reverse=True)
    if r.proposal is None:
        assert "nothing to gain beyond the measured noise" in r.verdict and r.config is None
        assert r.to_yaml().startswith("# overlapcfg diagnose: nothing to gain")
        return
    cfg = load_config(r.to_yaml())
    seen = with_parents(m for b in r.buckets for m in b.modules)  # the job's modules, as its trace names them
    resolve_config(cfg, ModelFacts(seen), coverage=False)
    assert r.proposal.gain_s > r.noise_s


def test_the_result_prints_round_trips_and_draws(diagnosed: dict[str, DiagnoseResult], tmp_path: Path) -> None:
    r = diagnosed["cpu_compiled_good"]
    assert len(repr(r)) <= 2048 and repr(r).startswith("DiagnoseResult(")
    text = str(r)
    assert "per rank and step" in text and "per bucket" in text and "verdict:" in text
    console = rich.console.Console(record=True, width=120)
    console.print(r)
    assert "per bucket" in console.export_text()
    again = DiagnoseResult.from_json(r.to_json())
    assert again.model_dump() == r.model_dump() and json.loads(r.to_json())["schema"] == "overlapcfg.diagnose/1"
    png = r.timeline(tmp_path / "step.png")
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    trace = json.loads(r.timeline(tmp_path / "step.json").read_text())
    names = {e["name"] for e in trace["traceEvents"]}
    assert any(n.startswith("wait AG[") for n in names) and any("model.layers.0" in n for n in names)
