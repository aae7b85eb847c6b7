"""``overlapcfg.tune``: the quick model against the full simulation, the search against the presets and the budget,
the issue-order knob in the scheduler, the space and its plans, the output files, determinism.

Fast tier: trace-free graphs (``tests/support/synthetic.py``) and torch-free plan checks. Slow tier: the traced demo
and the ``overlapcfg mode=tune`` command.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch import fx

import overlapcfg
from overlapcfg import compat
from overlapcfg.config.depths import SEARCHED_DEPTHS
from overlapcfg.config.presets import command_conf_dir
from overlapcfg.cost.node_costs import MEASURABLE_KINDS, NodeCosts, node_signature
from overlapcfg.cost.price import node_kind
from overlapcfg.errors import OverlapConfigError
from overlapcfg.graph.collectives import collective_kind, is_collective_start, started_by
from overlapcfg.passes import apply
from overlapcfg.passes.backend import CapturedStep
from overlapcfg.report.compare import compare
from overlapcfg.resolve import resolve_plan
from overlapcfg.tuning import TuneSpace, load_space, tune
from overlapcfg.tuning.candidates import TIE_TOLERANCE
from overlapcfg.tuning.merged import group
from overlapcfg.tuning.profile import build_profile
from overlapcfg.tuning.quick import score
from overlapcfg.tuning.structure import Grouping, find_structure, plan_for
from tests.support.synthetic import captured_step
from tests.support.warm_cli import SCRIPT, shared

LAYERS = [[2, 1], [1], [3, 2], [1, 1], [2], [1, 3]]
SYNTHETIC_SPACE = {"split_blocks": [False], "block_parts": [], "layers_per_bucket": [1, 2]}


def synthetic_step(layers: list[list[int]] = LAYERS) -> CapturedStep:
    """A two-graph step (forward, and backward re-gathering every weight) built without tracing."""
    return captured_step(layers)


@pytest.fixture(scope="module")
def step() -> CapturedStep:
    """One ``synthetic_step()`` for the file's tests, which only read it (``apply`` rewrites a copy; tuning leaves
    the step as it was, as ``test_tuning_leaves_the_step_as_it_was`` checks): each bucket merge is then traced once
    for the file, not once per test (traces are kept per capture, ``overlapcfg.graph.traces``), and the search's
    step-only derivations are made once (``overlapcfg.tuning.step_cache``)."""
    return synthetic_step()


def _random_config(rng: random.Random, n_layers: int) -> dict[str, Any]:
    plan = rng.choice([["layers.*"], [{"modules": ["layers.*"], "group_size": 2}], [["layers.0", "layers.1"],
                                                                                       "layers.2:6"], [["*"]]])
    overrides = [{"match": f"layers.{rng.randrange(n_layers)}.**",
                  rng.choice(["forward_prefetch", "backward_prefetch", "reduce_scatter_delay"]): rng.randint(0, 4)}
                 for _ in range(rng.randint(0, 2))]
    return {"plan": {"buckets": plan}, "overrides": overrides,
            "policy": {"forward_prefetch": rng.randint(0, 3), "backward_prefetch": rng.randint(0, 3),
                       "reduce_scatter_delay": rng.randint(0, 3), "max_inflight_bytes": rng.choice([None, 300]),
                       "issue_order": rng.choice(["gather_first", "reduce_scatter_first"])}}


def _quick(step: CapturedStep, profile: Any, cfg: overlapcfg.OverlapConfig) -> Any:
    plan = resolve_plan(cfg.plan, step.module_fqns, step.param_owners, overrides=cfg.overrides, policy=cfg.policy)
    grouped = group(profile, [plan.bucket_index(u) for u in profile.units], [b.name for b in plan.buckets])
    return score(grouped, {name: [getattr(b, name) for b in plan.buckets] for name in SEARCHED_DEPTHS},
                 max_inflight_bytes=cfg.policy.max_inflight_bytes, issue_order=cfg.policy.issue_order)


@pytest.mark.parametrize("hardware, seed", [("cpu_gloo", 7), ("h100_nvlink", 8)])
def test_quick_score_equals_the_full_simulation(step: CapturedStep, hardware: str, seed: int) -> None:
    """Grouping, depths, delays, caps, issue orders and per-bucket overrides: the profile replay gives the step
    time, exposed communication and both memory peaks of a real apply + simulate."""
    profile = build_profile(step, overlapcfg.load_hardware(hardware), world_size=8)
    rng = random.Random(seed)
    configs = [overlapcfg.load_config(_random_config(rng, len(LAYERS))) for _ in range(7)]
    rows = compare(step, configs, hardware=hardware, world_size=8).rows
    for cfg, row in zip(configs, rows, strict=True):
        quick, full = _quick(step, profile, cfg), row.simulation
        assert quick.step_seconds == pytest.approx(full.step_seconds, rel=1e-9), cfg
        assert quick.exposed_comm_seconds == pytest.approx(full.exposed_comm_seconds, rel=1e-9, abs=1e-15), cfg
        assert quick.compute_seconds == pytest.approx(full.compute_seconds, rel=1e-9), cfg
        assert (quick.peak_inflight_bytes, quick.peak_unsharded_param_bytes) == (
            full.peak_inflight_bytes, full.peak_unsharded_param_bytes), cfg


def _measured_costs(step: CapturedStep, seed: int) -> NodeCosts:
    """Made-up measured durations for every compute-stream node of the untransformed step (as ``measure`` takes
    them from the ``strategy: none`` config)."""
    rng = random.Random(seed)
    graphs = {name: {n.name: (node_signature(n), rng.uniform(1e-6, 1e-4)) for n in step.graph(name).graph.nodes
                     if n.op == "call_function" and node_kind(n) in MEASURABLE_KINDS}
              for name in ("forward", "backward")}
    return NodeCosts(source="made up", graphs=graphs)


def _calibrated(hardware: str) -> overlapcfg.HardwareProfile:
    """``hardware`` with measured-looking collective fits (issue times too)."""
    fit = {"latency": 3e-5, "bandwidth": 2e9, "issue_latency": 2e-5, "issue_bandwidth": 5e9}
    data = overlapcfg.load_hardware(hardware).model_dump()
    return overlapcfg.HardwareProfile.model_validate({
        **data, "name": f"{hardware}_calibrated",
        "collectives": {"intra_node": {"all_gather": fit, "reduce_scatter": {**fit, "issue_bandwidth": None}}}})


def test_quick_score_equals_the_full_simulation_with_measured_costs_and_fits(step: CapturedStep) -> None:
    """Profile-guided costs (measured node durations of the untransformed step) and a calibrated profile (fitted
    collectives with issue time): the tuner's quick score still equals a real apply + simulate, and the
    simulation says which nodes were measured."""
    costs, hw = _measured_costs(step, seed=4), _calibrated("cpu_gloo")
    profile = build_profile(step, hw, world_size=8, node_costs=costs)
    rng = random.Random(9)
    configs = [overlapcfg.load_config(_random_config(rng, len(LAYERS))) for _ in range(3)]
    rows = compare(step, configs, hardware=hw, world_size=8, node_costs=costs).rows
    for cfg, row in zip(configs, rows, strict=True):
        quick, full = _quick(step, profile, cfg), row.simulation
        assert quick.step_seconds == pytest.approx(full.step_seconds, rel=1e-9), cfg
        assert quick.exposed_comm_seconds == pytest.approx(full.exposed_comm_seconds, rel=1e-9, abs=1e-15), cfg
        assert quick.compute_seconds == pytest.approx(full.compute_seconds, rel=1e-9), cfg
        sources = {(s.part, s.source): s for s in full.cost_sources}
        assert {("compute", "measured"), ("issue", "fitted"), ("collectives", "fitted")} <= set(sources), cfg
        assert full.node_costs is not None and full.node_costs.startswith("made up")
    plain = compare(step, configs[:1], hardware=hw, world_size=8).rows[0].simulation
    assert plain.step_seconds != rows[0].simulation.step_seconds
    assert {s.source for s in plain.cost_sources if s.part == "compute"} == {"achievable"}  # cpu_gloo's rates


def _scheduled(step: CapturedStep, policy: dict[str, Any], graph: str = "backward") -> fx.GraphModule:
    """``step``'s graph (``forward_graph(LAYERS)`` or ``backward_graph(LAYERS, regather=True)``), scheduled on a
    copy: the file's one capture, so the bucket merges are the traces the other tests of the file made."""
    cfg = overlapcfg.load_config({"plan": {"buckets": ["layers.*"]}, "policy": policy})
    with compat.fake_process_group(2):
        return apply(copy.deepcopy(step.graph(graph)), cfg, graph_kind=graph,  # verified by default
                     module_fqns=step.module_fqns)


def _starts(gm: fx.GraphModule) -> list[tuple[str, int]]:
    """``(kind, position)`` of every collective start, graph order."""
    return [(collective_kind(n), i) for i, n in enumerate(gm.graph.nodes) if is_collective_start(n)]


def test_reduce_scatter_first_issues_far_prefetches_after_the_next_reduce_scatter(step: CapturedStep) -> None:
    """Backward prefetch 2: all-gather k is reached at the wait of bucket k - 2. ``gather_first`` issues it there,
    ahead of the reduce-scatter bucket k - 2 then issues; ``reduce_scatter_first`` issues it after that
    reduce-scatter, still before the wait of bucket k - 1."""
    for order in ("gather_first", "reduce_scatter_first"):
        gm = _scheduled(step, {"backward_prefetch": 2, "issue_order": order})
        pos = {n: i for i, n in enumerate(gm.graph.nodes)}
        waits = [pos[n] for n in gm.graph.nodes
                 if (s := started_by(n)) is not None and collective_kind(s) == "all_gather"]
        starts = _starts(gm)
        gathers = [i for kind, i in starts if kind == "all_gather"]
        scatters = [i for kind, i in starts if kind == "reduce_scatter"]
        for k in range(2, len(gathers)):
            between = [i for i in scatters if waits[k - 2] < i < gathers[k]]
            assert bool(between) == (order == "reduce_scatter_first"), (order, k)
            assert gathers[k] < waits[k - 1], (order, k)


@pytest.mark.parametrize("graph", ["forward", "backward"])
def test_issue_order_leaves_depth_one_graphs_unchanged(step: CapturedStep, graph: str) -> None:
    names = [[n.name for n in _scheduled(step, {"forward_prefetch": 1, "backward_prefetch": 1, "issue_order": order},
                                         graph).graph.nodes] for order in ("gather_first", "reduce_scatter_first")]
    assert names[0] == names[1]


def test_torch_manual_refuses_an_issue_order_it_cannot_honour() -> None:
    with pytest.raises(OverlapConfigError, match="torch_manual issues all-gathers where its depth of 1"):
        overlapcfg.load_config({"strategy": "torch_manual", "plan": "llama_layers",
                                "policy": {"issue_order": "reduce_scatter_first"}})


def test_tune_respects_the_budget_and_the_yaml_loads_back(step: CapturedStep, tmp_path: Path) -> None:
    free = tune(step, hardware="cpu_gloo", memory_budget=None, space=SYNTHETIC_SPACE, verify=False)  # sets the budget
    budget = (min(c.peak_inflight_bytes for c in free.candidates) + free.score.peak_inflight_bytes) // 2
    result = tune(step, hardware="cpu_gloo", memory_budget=budget, space=SYNTHETIC_SPACE)
    assert result.verification is not None
    assert result.verification.simulation.peak_inflight_bytes <= budget
    assert all(c.peak_inflight_bytes <= budget for c in result.top)
    assert result.verification.agreement <= 1e-9
    assert result.evaluated >= 200
    # The competitors ran (one for each of tune's), and their time is a part of the whole search's.
    assert result.competitors and 0 < result.competitor_seconds < result.seconds
    assert result.to_dict()["competitor_seconds"] == result.competitor_seconds
    path = tmp_path / "tuned.yaml"
    path.write_text(result.to_yaml())
    assert overlapcfg.load_config(path) == result.config
    text = path.read_text()
    for words in ("predicted step", "lower bound on every config", "unhidable first all-gather",
                  "what you could pick instead", "single_bucket / default", "auto (torch's scheduler)"):
        assert words in text, words


def test_a_budget_below_every_candidate_names_the_smallest_feasible_one(step: CapturedStep) -> None:
    with pytest.raises(OverlapConfigError) as err:
        tune(step, hardware="cpu_gloo", memory_budget=1, space=SYNTHETIC_SPACE, config_root="tune", verify=False)
    (fault,) = err.value.faults
    assert fault.path == "tune.memory_budget" and "smallest feasible budget" in fault.message
    smallest = int(fault.message.split(" bytes, ")[0].rsplit("(", 1)[1])
    result = tune(step, hardware="cpu_gloo", memory_budget=smallest, space=SYNTHETIC_SPACE, verify=False)
    assert result.score.peak_inflight_bytes <= smallest


@pytest.mark.parametrize("world_size", [-4, 0, 2.5, True, "8", 10**400])
def test_a_world_size_no_cluster_has_is_a_fault_at_its_path_in_tune_explain_and_compare(world_size: Any) -> None:
    """-4 used to tune "at -4 ranks" with no communication, 0 meant the traced size, 2.5 gave pydantic's raw
    error and 10**400 an OverflowError."""
    step = synthetic_step([[1], [2]])
    cfg = {"plan": {"buckets": ["layers.*"]}}
    calls = {
        "tune.world_size": lambda: tune(step, hardware="cpu_gloo", world_size=world_size, memory_budget=None,
                                        space=SYNTHETIC_SPACE, verify=False, config_root="tune"),
        "world_size": lambda: overlapcfg.explain(step, cfg, hardware="cpu_gloo", world_size=world_size),
    }
    calls["world_size "] = lambda: compare(step, [cfg], hardware="cpu_gloo", world_size=world_size)
    for path, call in calls.items():
        with pytest.raises(OverlapConfigError) as err:
            call()
        (fault,) = err.value.faults
        assert fault.path == path.strip() and "expected a number of ranks: an integer from 1" in fault.message
        assert len(str(err.value)) < 200


def test_the_tune_settings_refuse_world_size_0_instead_of_reading_it_as_the_traced_size() -> None:
    from overlapcfg.demo.tune_job import tune_settings

    with pytest.raises(OverlapConfigError, match=r"tune\.world_size: expected a number of ranks"):
        tune_settings(OmegaConf.create({"tune": {"world_size": 0}}))


def test_a_memory_budget_of_10_to_the_400_is_a_fault_not_an_overflow() -> None:
    with pytest.raises(OverlapConfigError, match=r"tune\.memory_budget: expected a positive byte count of at most "
                                                 r"2\*\*63-1 .* got an integer of 401 digits"):
        tune(synthetic_step([[1]]), hardware="cpu_gloo", memory_budget=10**400, space=SYNTHETIC_SPACE, verify=False,
             config_root="tune")


def test_the_search_is_deterministic(step: CapturedStep) -> None:
    """Two searches on one step give the same result (that a search reusing the step's cache equals one on a fresh
    step is ``test_step_cache``'s; another hash seed, the slow test below)."""
    runs = [tune(step, hardware="h100_nvlink", world_size=8, memory_budget=None, space=SYNTHETIC_SPACE,
                 verify=False) for _ in range(2)]
    assert runs[0].to_yaml() == runs[1].to_yaml()
    assert [c.name for c in runs[0].candidates] == [c.name for c in runs[1].candidates]


def test_space_faults_name_the_path_and_the_closest_field() -> None:
    with pytest.raises(OverlapConfigError) as err:
        load_space({"forward_prefetch": [], "blokcs": "layers.*", "issue_order": ["sooner"]}, root="tune.space")
    text = str(err.value)
    assert "tune.space.forward_prefetch" in text and "tune.space.issue_order[0]" in text
    assert "did you mean 'blocks'" in text


@pytest.mark.parametrize("option", sorted(p.stem for p in (command_conf_dir() / "tune" / "space").glob("*.yaml")))
def test_every_shipped_space_composes_and_validates(option: str) -> None:
    with initialize_config_dir(str(command_conf_dir()), version_base="1.3"):
        cfg = compose("overlapcfg", overrides=[f"tune/space={option}", "tune.space.seed=3"])
    space = load_space(OmegaConf.to_container(cfg.tune.space, resolve=True), root="tune.space")
    assert space.seed == 3 and space.blocks is None and space.block_parts is None  # read off the model


@pytest.mark.parametrize("option", sorted(p.stem for p in (command_conf_dir() / "tune" / "space").glob("*.yaml")))
def test_a_shipped_space_by_name_in_python_is_the_space_the_command_composes(option: str) -> None:
    """``tune(step, space="quick")``: the name reads the same files, with the same inheritance, as the command's
    ``tune/space=quick``."""
    with initialize_config_dir(str(command_conf_dir()), version_base="1.3"):
        cfg = compose("overlapcfg", overrides=[f"tune/space={option}"])
    assert load_space(option) == load_space(OmegaConf.to_container(cfg.tune.space, resolve=True))


def test_an_unknown_space_name_is_a_config_error_with_the_closest_shipped_names() -> None:
    with pytest.raises(OverlapConfigError) as err:
        load_space("quik", root="tune.space")
    text = str(err.value)
    assert "tune.space: no shipped tune space 'quik' (did you mean 'quick'?)" in text
    assert "choose one of quick," in text


# --- plans for groupings (torch-free) ---------------------------------------------------------------------------

def _llama(n: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Module FQNs and parameter owners of a Llama-shaped model with ``n`` blocks."""
    fqns = ["tok_embeddings", "layers"]
    owners = ["tok_embeddings"]
    for i in range(n):
        parts = ["attention_norm", "attention", "attention.wq", "attention.wo", "ffn_norm", "feed_forward",
                 "feed_forward.w1", "feed_forward.w2"]
        fqns += [f"layers.{i}", *(f"layers.{i}.{p}" for p in parts)]
        owners += [f"layers.{i}.{p}" for p in ("attention_norm", "attention.wq", "attention.wo", "ffn_norm",
                                               "feed_forward.w1", "feed_forward.w2")]
    return (*fqns, "norm", "output"), (*owners, "norm", "output")


GROUPINGS = [Grouping(k, split, first, last) for k, split in ((1, False), (2, False), (3, False), (1, True))
             for first in (False, True) for last in (False, True)]


@pytest.mark.parametrize("grouping", GROUPINGS, ids=lambda g: g.label)
def test_every_grouping_is_a_compact_plan_resolving_to_exactly_its_buckets(grouping: Grouping) -> None:
    fqns, owners = _llama(5)
    structure = find_structure(fqns, owners, TuneSpace())
    plan, resolved = plan_for(structure, grouping, fqns, owners)
    assert all(not isinstance(e, list) or len(e) <= 4 for e in plan["buckets"])  # ranges, not spelled out
    buckets = [set(b.modules) for b in resolved.buckets]
    head = next(b for b in buckets if "tok_embeddings" in b)
    tail = next(b for b in buckets if "output" in b)
    assert (head != {"tok_embeddings"}) == grouping.merge_first and (tail != {"norm", "output"}) == grouping.merge_last
    blocks = 5 * (2 if grouping.split_blocks else 1) // (1 if grouping.split_blocks else grouping.layers_per_bucket)
    assert len(buckets) >= blocks
    assert not resolved.uncovered


def test_blocks_without_numbers_fall_back_to_one_list_per_bucket() -> None:
    fqns = ("embed", "blocks", "blocks.first", "blocks.second", "blocks.third", "head")
    owners = ("embed", "blocks.first", "blocks.second", "blocks.third", "head")
    space = TuneSpace(blocks="blocks.*", block_parts=())
    structure = find_structure(fqns, owners, space)
    assert structure.prefix is None and structure.parts is None
    plan, resolved = plan_for(structure, Grouping(2, False, False, True), fqns, owners)
    assert plan["buckets"] == ["embed", ["blocks.first", "blocks.second"], ["blocks.third", "head"]]
    assert [set(b.modules) for b in resolved.buckets] == [{"embed"}, {"blocks.first", "blocks.second"},
                                                          {"blocks.third", "head"}]


def test_split_blocks_that_cannot_be_split_is_an_error_naming_why(step: CapturedStep) -> None:
    fqns, owners = _llama(2)
    with pytest.raises(OverlapConfigError, match=r"tune\.space\.split_blocks: blocks cannot be split"):
        tune(step, hardware="cpu_gloo", memory_budget=None, space={"split_blocks": [True]}, config_root="tune")
    assert find_structure(fqns, owners, TuneSpace(block_parts=(("attention",),))).parts is None


# --- the demo (slow) ---------------------------------------------------------------------------------------------

def _manual_presets(step: CapturedStep) -> list[tuple[str, overlapcfg.OverlapConfig]]:
    out = []
    for plan in overlapcfg.preset_names("plan"):
        for cfg in ([{"plan": plan, "policy": p} for p in overlapcfg.preset_names("policy") if p != "auto"]
                    + [{"strategy": "torch_manual", "plan": plan}]):
            try:
                config = overlapcfg.load_config(cfg)
                resolved = resolve_plan(config.plan, step.module_fqns, step.param_owners)
            except OverlapConfigError:
                continue
            if not resolved.uncovered:
                out.append((f"{cfg}", config))
    return out


@pytest.mark.slow
def test_tuned_demo_is_no_slower_than_any_preset_within_the_budget(traced_2l_reshard) -> None:
    """Full apply + simulate of every shipped plan x policy preset (and torch_manual) against the tuned config."""
    step = traced_2l_reshard
    presets = _manual_presets(step)
    rows = compare(step, [c for _, c in presets], hardware="h100_nvlink", world_size=64).rows
    inflight = sorted(r.simulation.peak_inflight_bytes for r in rows)
    budget = inflight[len(inflight) // 2]  # some presets fit, some do not
    result = tune(step, hardware="h100_nvlink", world_size=64, memory_budget=budget)
    assert result.verification is not None
    full = result.verification.simulation
    assert full.peak_inflight_bytes <= budget
    assert result.verification.agreement <= 1e-9
    fitting = [r for r in rows if r.simulation.peak_inflight_bytes <= budget]
    assert fitting and len(fitting) < len(rows)
    for row in fitting:  # never slower, but for a tie (within the tolerance) won by fewer bytes in flight
        if full.step_seconds > row.simulation.step_seconds * (1 + 1e-9):
            assert full.step_seconds <= row.simulation.step_seconds * (1 + TIE_TOLERANCE), row.name
            assert full.peak_inflight_bytes < row.simulation.peak_inflight_bytes, row.name


@pytest.mark.slow
def test_the_search_is_the_same_under_another_hash_seed() -> None:
    code = ("import hashlib; from tests.tuning.test_tune import synthetic_step, SYNTHETIC_SPACE; "
            "from overlapcfg.tuning import tune; r = tune(synthetic_step(), hardware='h100_nvlink', world_size=8, "
            "memory_budget=None, space=SYNTHETIC_SPACE, verify=False); "
            "print(hashlib.sha256(r.to_yaml().encode()).hexdigest())")
    here = tune(synthetic_step(), hardware="h100_nvlink", world_size=8, memory_budget=None, space=SYNTHETIC_SPACE,
                verify=False)
    # a process of an interpreter with another hash seed than this one's (forked: it keeps that seed)
    out = shared().run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == hashlib.sha256(here.to_yaml().encode()).hexdigest()


@pytest.mark.slow
def test_mode_tune_writes_a_loadable_tuned_yaml_and_the_front(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    run = tmp_path / "run"
    # the command in a process of its own, forked warm (tests/support/warm_cli.py)
    out = shared().run([str(SCRIPT), "mode=tune", "hardware=h100_nvlink", "model.n_layers=2", "tune/space=quick",
                        "tune.memory_budget=64MiB", f"hydra.run.dir={run}"], cwd=tmp_path, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    for words in ("Top candidates within the budget", "Pareto front", "Shipped presets on the same trace",
                  "lower bound"):
        assert words in out.stdout, words
    tuned = overlapcfg.load_config(run / "tuned.yaml")
    evidence = json.loads((run / "tune.json").read_text())
    assert tuned == overlapcfg.load_config(evidence["best"]["config"])
    assert evidence["verification"]["agreement"] <= 0.01
    assert (run / "tune_front.png").stat().st_size > 10_000


def test_tuning_leaves_the_step_as_it_was() -> None:
    step = synthetic_step([[1], [2]])
    before = {name: [n.name for n in step.graph(name).graph.nodes] for name in ("forward", "backward")}
    tune(step, hardware="cpu_gloo", memory_budget=None, space=SYNTHETIC_SPACE, verify=False)
    assert {name: [n.name for n in step.graph(name).graph.nodes] for name in before} == before


def test_overlapcfg_tune_is_the_search_function_after_the_package_is_imported() -> None:
    """The search lives in ``overlapcfg.tuning``: importing it never rebinds ``overlapcfg.tune``."""
    import overlapcfg.tuning.space

    assert overlapcfg.tune is overlapcfg.tuning.tune
    with pytest.raises(TypeError, match="hardware"):
        overlapcfg.tune(synthetic_step([[1]]))



@pytest.mark.parametrize("pricing", [
    {"activation_checkpointing": "selective", "optimizer": "adamw", "grad_clip": True},
    {"activation_checkpointing": "full", "fusion": "inductor"},
    {"activation_checkpointing": "none", "between_graphs_seconds": 0.05},  # the ranks drift across an eager loss
])
def test_quick_score_equals_the_full_simulation_with_checkpointing_the_optimizer_and_skew(
        step: CapturedStep, pricing: dict[str, Any]) -> None:
    """A chosen checkpointing mode, the optimizer phase, a fused route, the profile's rank skew and the ranks' drift
    between the graphs: the recompute is the model's forward whatever the grouping (bucket copies are not
    recomputed), so the profile replay still gives the full simulation's step, compute and exposed communication
    exactly."""
    hw = overlapcfg.load_hardware("h100_nvlink")
    profile = build_profile(step, hw, world_size=64, pricing=overlapcfg.cost.pricing.pricing_from(pricing))
    rng = random.Random(11)
    configs = [overlapcfg.load_config(_random_config(rng, len(LAYERS))) for _ in range(4)]
    rows = compare(step, configs, hardware=hw, world_size=64, pricing=pricing).rows
    for cfg, row in zip(configs, rows, strict=True):
        quick, full = _quick(step, profile, cfg), row.simulation
        assert full.recompute.startswith(pricing["activation_checkpointing"])
        assert quick.step_seconds == pytest.approx(full.step_seconds, rel=1e-8), cfg
        # a fused group's reads are deduplicated per group, and a merge can add a view between two readers of one
        # tensor: a few bytes in 10^8 (the step itself agrees exactly)
        assert quick.compute_seconds == pytest.approx(full.compute_seconds, rel=1e-6), cfg
        assert quick.exposed_comm_seconds == pytest.approx(full.exposed_comm_seconds, rel=1e-8, abs=1e-15), cfg
