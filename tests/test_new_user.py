"""What a new user trips over (issue 11): presets and policies by name, state that must not leak."""

from __future__ import annotations

import subprocess
import sys

import pytest

from overlapcfg import OverlapConfigError, OverlapPolicy, load_config


def test_a_policy_can_be_picked_by_name_like_a_plan() -> None:
    cfg = load_config({"plan": "llama_layers", "policy": "aggressive"})
    assert cfg.policy == OverlapPolicy(forward_prefetch=2, backward_prefetch=2, reduce_scatter_delay=2)
    assert load_config({"strategy": "auto", "policy": "auto"}).policy.max_in_flight_gb == 5.0


def test_an_unknown_policy_name_lists_the_presets_closest_first() -> None:
    with pytest.raises(OverlapConfigError) as info:
        load_config({"plan": "llama_layers", "policy": "agressive"})
    (fault,) = info.value.faults
    assert fault.path == "overlap.policy"
    assert "unknown policy preset 'agressive'" in fault.message and "did you mean 'aggressive'" in fault.message


def test_a_policy_preset_never_switches_the_strategy_silently() -> None:
    with pytest.raises(OverlapConfigError, match="is for strategy 'auto', but the strategy is 'manual'"):
        load_config({"plan": "llama_layers", "policy": "auto"})


def test_tracing_leaves_no_rank_prefix_on_later_uncaught_exceptions() -> None:
    """init_process_group installs a '[rank0]:' excepthook; our fake group must put the old one back."""
    code = ("import sys, overlapcfg.compat as c\nhook = sys.excepthook\n"
            "with c.fake_process_group(2):\n    pass\nprint(sys.excepthook is hook)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


@pytest.mark.slow
def test_the_auto_report_does_not_contradict_itself(traced_2l_reshard) -> None:
    """Issue: 39 -> 1 collectives, yet all 39 listed as uncovered; 0 B of unsharded parameters while 770 KiB
    were in flight; a warning about a plan the user never set."""
    from overlapcfg import explain

    report = explain(traced_2l_reshard, {"strategy": "auto", "policy": {"collective_bucketing": True}},
                     hardware="h100_nvlink")
    assert all(not g.uncovered for g in report.graphs)
    assert not any("plan is ignored" in w for w in report.warnings)  # a note at most, not a warning
    sim = report.simulation
    assert sim is not None and sim.peak_inflight_bytes > 0
    assert sim.peak_unsharded_param_bytes >= sim.peak_inflight_bytes
