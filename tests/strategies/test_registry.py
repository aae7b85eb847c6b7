"""The strategy registry: duplicates, unknown names, third-party policies, lazily loaded entry points.

Every test that registers something runs under ``clean_registry`` (``tests/conftest.py``), which restores the one
catalog (``contracts._CONTRACTS``) and the entry-point flag afterwards, so no test leaks a strategy into another.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest

from overlapcfg.config import OverlapConfig, contracts, load_config
from overlapcfg.config.policy import OverlapPolicy, PolicyBase
from overlapcfg.errors import OverlapConfigError
from overlapcfg.strategies.registry import ENTRY_POINT_GROUP, available_strategies, get_strategy, register_strategy
from tests.support.policies import LookaheadPolicy


def _factory(gm: Any, ctx: Any) -> Any:
    return ("ran", gm, ctx)


# --- built-ins, duplicates, unknown names ------------------------------------------------------------------

def test_builtins_are_registered_with_their_contracts() -> None:
    assert {"manual", "torch_manual", "auto", "none"} <= set(available_strategies())
    assert get_strategy("manual").contract.origin == "builtin"
    assert get_strategy("torch_manual").policy.__name__ == "TorchManualPolicy"


def test_duplicate_registration_raises_naming_both_registrants(clean_registry: None) -> None:
    register_strategy("dup_sched")(_factory)

    def other(plan: Any, policy: Any) -> Any:
        return None

    other.__module__ = "thirdparty.plugin"
    with pytest.raises(ValueError, match="dup_sched") as info:
        register_strategy("dup_sched")(other)
    message = str(info.value)
    assert __name__ in message and "thirdparty.plugin" in message
    assert get_strategy("dup_sched").run is _factory  # the first registration stands


def test_registering_over_a_builtin_names_builtin(clean_registry: None) -> None:
    with pytest.raises(ValueError, match=r"'manual' is already registered \(by builtin\)"):
        register_strategy("manual")(_factory)
    assert get_strategy("manual").contract.origin == "builtin"


def test_policy_must_be_a_policy_base_subclass() -> None:
    with pytest.raises(TypeError, match="PolicyBase subclass"):
        register_strategy("bad_policy", policy=dict)  # type: ignore[arg-type]


def test_unknown_strategy_lists_available_names_and_closest_first(clean_registry: None) -> None:
    with pytest.raises(OverlapConfigError) as info:
        get_strategy("torch_manul")
    (fault,) = info.value.faults
    assert fault.path == "strategy"
    for name in ("manual", "torch_manual", "auto", "none"):
        assert name in fault.message
    hint = fault.message.split("did you mean", 1)[1]
    assert hint.index("'torch_manual'") < hint.index("'manual'")


def test_unknown_strategy_in_a_config_reports_the_config_path() -> None:
    with pytest.raises(OverlapConfigError) as info:
        load_config({"strategy": "manul", "plan": "llama_layers"})
    paths = [f.path for f in info.value.faults]
    assert paths == ["overlap.strategy"], paths
    assert "did you mean 'manual'" in str(info.value)


# --- third-party strategies --------------------------------------------------------------------------------

def test_third_party_policy_is_validated_through_load_config(clean_registry: None) -> None:
    register_strategy("lookahead", policy=LookaheadPolicy)(_factory)
    cfg = load_config({"strategy": "lookahead", "plan": "llama_layers", "policy": {"lookahead": 5}})
    assert isinstance(cfg.policy, LookaheadPolicy)
    assert cfg.policy.lookahead == 5
    dumped = cfg.model_dump()
    assert dumped["policy"] == {"lookahead": 5, "label": "x"}  # subclass fields survive serialization
    assert load_config(dumped) == cfg
    assert isinstance(OverlapConfig.model_validate(dumped).policy, LookaheadPolicy)


def test_third_party_policy_errors_keep_clean_paths_and_reject_other_strategies_knobs(
        clean_registry: None) -> None:
    register_strategy("lookahead", policy=LookaheadPolicy)(_factory)
    with pytest.raises(OverlapConfigError) as info:
        load_config({"strategy": "lookahead", "plan": "llama_layers", "policy": {"lookahead": "far"}})
    assert [(f.path, f.message) for f in info.value.faults] == [
        ("overlap.policy.lookahead", "expected an integer, got 'far'")]
    with pytest.raises(OverlapConfigError) as info:  # manual's knob is not this strategy's
        load_config({"strategy": "lookahead", "plan": "llama_layers", "policy": {"forward_prefetch": 2}})
    (fault,) = info.value.faults
    assert fault.path == "overlap.policy.forward_prefetch"
    assert fault.message == "unknown field; valid fields: label, lookahead"


def test_third_party_strategy_is_one_object_with_its_contract_and_graph_call(clean_registry: None) -> None:
    @register_strategy("recorder", policy=LookaheadPolicy, uses_plan=False)
    def run(gm: Any, ctx: Any) -> Any:
        return ("ran", gm, ctx)

    cfg = load_config({"strategy": "recorder", "policy": {"lookahead": 1}})
    strategy = get_strategy("recorder")
    assert strategy.run is run and strategy.policy is LookaheadPolicy and not strategy.uses_plan
    assert strategy.contract.origin == __name__
    assert cfg.policy == LookaheadPolicy(lookahead=1)


# --- entry points ------------------------------------------------------------------------------------------

def _write_plugin(root: Path, dist: str, module: str, body: str, eps: dict[str, str]) -> None:
    (root / f"{module}.py").write_text(textwrap.dedent(body))
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "\n".join(f"{name} = {value}" for name, value in eps.items())
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{lines}\n")


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_registry: None) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    contracts._entry_points_loaded = False
    importlib.invalidate_caches()
    yield tmp_path
    for mod in [m for m in sys.modules if m.startswith("ocfg_test_plugin")]:
        del sys.modules[mod]


def test_entry_point_strategy_is_loaded_lazily_on_first_lookup(plugin_dir: Path) -> None:
    _write_plugin(plugin_dir, "ocfg_test_dist", "ocfg_test_plugin", """
        from overlapcfg.strategies.registry import register_strategy
        from overlapcfg.config.policy import PolicyBase

        class PluginPolicy(PolicyBase):
            depth: int = 4

        @register_strategy("plugged", policy=PluginPolicy)
        def make(gm, ctx):
            return ("plugged", ctx)
    """, {"plugged": "ocfg_test_plugin:make"})
    assert get_strategy("manual").contract.origin == "builtin"  # a known name does not scan entry points
    assert "ocfg_test_plugin" not in sys.modules
    spec = get_strategy("plugged")
    assert "ocfg_test_plugin" in sys.modules
    assert spec.contract.origin == "ocfg_test_plugin" and spec.policy.__name__ == "PluginPolicy"
    cfg = load_config({"strategy": "plugged", "plan": "llama_layers", "policy": {"depth": 7}})
    assert cfg.model_dump()["policy"] == {"depth": 7}
    assert "plugged" in available_strategies()


def test_entry_point_bare_factory_is_registered_with_the_default_policy(plugin_dir: Path) -> None:
    _write_plugin(plugin_dir, "ocfg_test_dist2", "ocfg_test_plugin2", """
        def make(gm, ctx):
            return ("bare", ctx)
    """, {"bare_plug": "ocfg_test_plugin2:make"})
    spec = get_strategy("bare_plug")
    assert spec.policy is OverlapPolicy
    assert "ocfg_test_dist2" in spec.contract.origin
    assert spec.run(None, None) == ("bare", None)


def test_entry_points_are_scanned_once(plugin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = contracts.entry_points

    def counting(**kwargs: Any) -> Any:
        calls.append(kwargs["group"])
        return real(**kwargs)

    monkeypatch.setattr(contracts, "entry_points", counting)
    for _ in range(3):
        with pytest.raises(OverlapConfigError):
            get_strategy("nowhere")
        available_strategies()
    assert calls == [ENTRY_POINT_GROUP]


def test_broken_entry_point_is_logged_and_does_not_break_other_strategies(
        plugin_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    _write_plugin(plugin_dir, "ocfg_test_dist3", "ocfg_test_plugin3", "raise ImportError('boom')\n",
                  {"broken_plug": "ocfg_test_plugin3:make"})
    with pytest.raises(OverlapConfigError):
        get_strategy("broken_plug")
    assert get_strategy("manual").contract.origin == "builtin"
    assert any("broken_plug" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_third_party_strategy_with_its_own_policy_runs_through_apply(clean_registry: None, traced_2l) -> None:
    """A policy without depth fields must not break plan resolution; the strategy gets the resolved plan."""
    import copy

    from overlapcfg import compat
    from overlapcfg.graph.merge import merge_buckets
    from overlapcfg.passes import apply
    from overlapcfg.strategies import StrategyResult

    made: list[Any] = []

    @register_strategy("merge_only", policy=LookaheadPolicy)
    def run(gm: Any, ctx: Any) -> StrategyResult:
        made.append((ctx.plan, ctx.policy))
        return StrategyResult(tuple(merge_buckets(gm, ctx.covered, ctx.plan, "custom_ops")))

    cfg = load_config({"strategy": "merge_only", "plan": "llama_layers", "policy": {"lookahead": 5}})
    with compat.fake_process_group(traced_2l.world_size, traced_2l.rank):
        gm = apply(copy.deepcopy(traced_2l.forward), cfg, module_fqn_fn=traced_2l.module_fqn_fn("forward"),
                   module_fqns=traced_2l.module_fqns, graph_kind="forward")
    (plan, policy), = made
    assert isinstance(policy, LookaheadPolicy) and policy.lookahead == 5
    assert [b.name for b in plan.buckets] == ["tok_embeddings", "layers.0", "layers.1", "norm+output"]
    assert gm.meta["overlapcfg"].after.fsdp == (("forward", "all_gather", 4),)


@pytest.mark.slow
def test_settings_a_strategy_does_not_read_are_reported(traced_2l) -> None:
    import copy

    from overlapcfg import compat
    from overlapcfg.passes import apply

    cfg = load_config({"strategy": "none", "plan": "llama_layers", "policy": {"forward_prefetch": 3},
           "overrides": [{"match": "layers.0", "forward_prefetch": 0}]})
    with compat.fake_process_group(traced_2l.world_size, traced_2l.rank):
        gm = apply(copy.deepcopy(traced_2l.forward), cfg, module_fqn_fn=traced_2l.module_fqn_fn("forward"),
                   graph_kind="forward")
    assert gm.meta["overlapcfg"].notes == (
        "overlap.plan is ignored: strategy 'none' does not bucket by plan",
        "overlap.overrides are ignored: strategy 'none' does not bucket by plan",
        "overlap.policy is ignored: strategy 'none' reads no policy",
    )


def test_torch_manual_rejects_per_bucket_and_override_depths_it_would_ignore() -> None:
    with pytest.raises(OverlapConfigError) as info:
        load_config({"strategy": "torch_manual",
                     "plan": {"buckets": ["tok_embeddings", {"modules": ["layers.*"], "forward_prefetch": 3}]},
                     "overrides": [{"match": "layers.0", "backward_prefetch": 0}, {"match": "norm",
                                                                                 "forward_prefetch": 1}]})
    assert [f.path for f in info.value.faults] == ["overlap.plan.buckets[1].forward_prefetch",
                                                   "overlap.overrides[0].backward_prefetch"]
    assert all("torch_manual has a fixed depth of 1" in f.message for f in info.value.faults)


# --- a strategy's rules live in its policy model only ------------------------------------------------------------

class ShallowPolicy(PolicyBase):
    """A third party that prefetches at most one bucket ahead and has no reduce-scatter knob."""

    forward_prefetch: Literal[0, 1] = 1
    """Depth 0 or 1 only."""


def test_a_policy_field_rule_holds_in_every_plan_entry_and_override(clean_registry: None) -> None:
    register_strategy("shallow", policy=ShallowPolicy)(_factory)
    with pytest.raises(OverlapConfigError) as info:
        load_config({"strategy": "shallow",
                     "plan": {"buckets": [{"modules": ["layers.*"], "forward_prefetch": 2, "reduce_scatter_delay": 3},
                                          "norm"]},
                     "overrides": [{"match": "layers.0", "forward_prefetch": 0}, {"match": "norm",
                                                                                 "forward_prefetch": 4}]})
    assert [(f.path, f.message) for f in info.value.faults] == [
        ("overlap.plan.buckets[0].forward_prefetch", "expected 0 or 1, got 2"),
        ("overlap.overrides[1].forward_prefetch", "expected 0 or 1, got 4")]  # no policy field: as written


def test_torch_manual_depth_rule_reads_the_same_in_its_policy_and_its_plan() -> None:
    messages = {}
    for where, cfg in (("policy", {"policy": {"backward_prefetch": 2}}),
                       ("plan", {"plan": {"buckets": [{"modules": ["layers.*"], "backward_prefetch": 2}]}}),
                       ("overrides", {"overrides": [{"match": "layers.0", "backward_prefetch": 2}]})):
        with pytest.raises(OverlapConfigError) as info:
            load_config({"strategy": "torch_manual", "plan": "llama_layers", **cfg})
        (fault,) = info.value.faults
        messages[where] = fault.message
    assert len(set(messages.values())) == 1, messages
    assert messages["plan"].startswith("torch_manual has a fixed depth of 1")


def test_a_strategy_is_declared_with_its_graph_call_or_not_at_all(clean_registry: None) -> None:
    """No half-declared strategy: a declaration without a graph call (or, for a built-in, the module holding it) is
    refused, so every name in the catalog runs; ``defined_in`` is for overlapcfg's own strategies only."""
    with pytest.raises(TypeError, match="'declared_only': give its graph call"):
        contracts.StrategyContract("declared_only", OverlapPolicy, origin="tests")
    with pytest.raises(TypeError, match="exactly one of the two"):
        contracts.StrategyContract("both", OverlapPolicy, run=_factory, defined_in="overlapcfg.strategies.manual")
    with pytest.raises(TypeError, match=r"defined_in names modules of overlapcfg\.strategies\. only"):
        contracts.StrategyContract("elsewhere", OverlapPolicy, defined_in="os.path")
    assert "declared_only" not in available_strategies()
