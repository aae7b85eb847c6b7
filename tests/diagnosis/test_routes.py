"""Jobs traced by each rank's own ``torch.profiler`` through the three routes (eager FSDP2 via
``overlapcfg.fully_shard``, the Lightning integration, ``torch.compile(backend=overlapcfg.backend(cfg))``), on a
Hugging Face Llama and 2 gloo ranks, each with a deliberately poor config (every parameter its own bucket, depth 0)
and a good one (``tests.support.diagnose_jobs.CONFIGS``), diagnosed from their trace files alone. Timings are the
benchmark's (``benchmarks/diagnose_routes.py``); these tests hold what does not depend on the machine's load."""

from __future__ import annotations

from pathlib import Path

import pytest

from overlapcfg.config import load_config
from overlapcfg.demo.gloo import run_on_gloo
from overlapcfg.diagnosis import DiagnoseResult, diagnose
from overlapcfg.module_paths import ModelFacts
from overlapcfg.resolve import resolve_config
from tests.support.diagnose_jobs import CONFIGS, GOOD_EAGER, POOR, diverging_job, llama, route_job
from tests.support.rank_warmup import preloaded
from tests.support.trace_oracle import exposed_per_step

ROUTES = ("fsdp2", "lightning", "compiled")
RUNS = [f"{route}_{quality}" for route in ROUTES for quality in ("poor", "good")]
SIZES = {"layers": 1, "profiled": 2, "timed": 0}
"""One decoder layer and two profiled steps: what is checked here (attribution, exposed time against interval
arithmetic, proposals) is per collective and per step, not per layer. No timed steps: their timings are the
benchmark's, never asserted here."""


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("routes")
    runs = [(name.split("_")[0], name, CONFIGS[tuple(name.split("_"))]) for name in RUNS]  # type: ignore[index]
    run_on_gloo(route_job, runs, str(out), SIZES, timeout_s=280, preload=preloaded("tests.support.diagnose_jobs"))
    run_on_gloo(diverging_job, [GOOD_EAGER, POOR], str(out / "diverging"), world_size=4, timeout_s=200,
                preload=preloaded("tests.support.diagnose_jobs"))
    return out


@pytest.fixture(scope="module")
def diagnosed(traces: Path) -> dict[str, DiagnoseResult]:
    return {name: diagnose(traces / name, CONFIGS[tuple(name.split("_"))]) for name in RUNS}  # type: ignore[index]


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_exposed_communication_per_step_is_within_15_percent_of_interval_arithmetic(
        traces: Path, diagnosed: dict[str, DiagnoseResult], name: str) -> None:
    r = diagnosed[name]
    for rank in (0, 1):
        for step, seconds in exposed_per_step(traces / name / f"rank{rank}.json").items():
            assert r.exposed(rank, step) == pytest.approx(seconds, rel=0.15), (rank, step)


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_every_fsdp_collective_is_attributed_to_a_bucket(diagnosed: dict[str, DiagnoseResult], name: str) -> None:
    r = diagnosed[name]
    assert r.collectives > 0 and r.unattributed == 0
    if not name.startswith("lightning"):  # Lightning broadcasts a flag of its own each step: listed as not FSDP's
        assert r.other == 0


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES)
def test_the_poor_config_gains_from_fewer_collectives_and_what_is_proposed_fits_the_model(
        diagnosed: dict[str, DiagnoseResult], route: str) -> None:
    r = diagnosed[f"{route}_poor"]
    merges = [c for c in r.candidates if c.change == "merge"]
    assert merges and max(c.gain_s for c in merges) > 0
    if route != "compiled":
        assert r.blocking and all(c.gain_s == 0 for c in r.candidates if c.change == "depth")
    if r.proposal is not None:
        resolve_config(load_config(r.to_yaml()), ModelFacts.of(llama({"layers": 1})), coverage=False)


@pytest.mark.slow
def test_ranks_given_different_configs_are_reported_with_their_first_differing_collective(traces: Path) -> None:
    r = diagnose(traces / "diverging")  # ranks 0-1: one bucket; ranks 2-3: every parameter its own
    assert [d.rank for d in r.divergence] == [2, 3] and r.proposal is None
    for d in r.divergence:
        # rank 0 gathers the whole model as one bucket, ranks 2-3 the embedding alone: the first all-gather differs
        assert d.reference == 0 and d.position == 0 and d.file == f"rank{d.rank}.json"
        assert "model+lm_head" in d.expected and "model.embed_tokens" in d.found
    assert str(r).startswith("RANKS DISAGREE")
