"""The compat tier: the tests every supported torch release must pass, and how they are marked.

``.ci/run`` runs the whole suite on the pinned torch 2.13 CPU build, then ``.ci/compat_tier VERSION`` runs
``pytest -m compat`` in an environment holding another release with its default wheel (2.11.0, 2.12.1 and 2.14.1:
CUDA builds, on a machine that may have no GPU). ``TIER`` says which tests that is, one capability per entry, by node-id
prefix; ``conftest.py`` marks the matching tests ``compat`` (``mark_tier``) and checks that every entry still
names a test (a renamed test must not drop out of the tier unnoticed).

Entries marked ``torchtitan`` run where torchtitan's graph trainer can run (an optional, pinned install: torchtitan
0.3.0's models import from torch 2.12 on, its graph trainer runs from 2.13 on); where it cannot, the tier (``-m
compat``) skips their tests with the reason (the import error, or the torch APIs it lacks), and ``-ra`` lists each.

Nothing is excused: a failure in the tier is a failure on that release.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import pytest

__all__ = ["TIER", "Entry", "mark_tier"]


@dataclass(frozen=True, slots=True)
class Entry:
    """One capability of the tier and the tests that prove it (node-id prefixes, relative to the repository)."""

    capability: str
    tests: tuple[str, ...]
    torchtitan: bool = False


TIER: tuple[Entry, ...] = (
    Entry("torch features overlapcfg probes (compat), upstream schedulers without a GPU", (
        "tests/package/test_compat_probes.py",
        "tests/graph/test_properties.py::test_auto_strategy_runs_upstream_scheduler_on_cpu",
        "tests/graph/test_hsdp.py::test_torch_manual_says_whether_it_left_the_all_reduces_unbucketed",
    )),
    Entry("capture: the demo traced under a fake group, collectives attributed", (
        "tests/capture/test_tracing.py",
    )),
    Entry("apply and verify on the demo (both graphs, every strategy, the breakages the verifier must catch)", (
        "tests/passes/test_apply_step.py",
        "tests/graph/test_verify.py::test_verify_accepts_every_strategy_output",
        "tests/graph/test_properties.py::test_breakage_of_a_synthetic_graph_is_rejected_naming_the_culprit",
        "tests/graph/test_properties.py::test_every_bucket_mode_verifies_on_a_synthetic_graph",
    )),
    Entry("the merge emits torch 2.13's graph on this release (ops, arguments, order)", (
        "tests/graph/test_merge_across_releases.py",
        "tests/graph/test_merge_speed_invariants.py::test_fake_values_for_a_compiler_are_what_running_the_graph_gives",
        "tests/graph/test_repeated_waits.py",
    )),
    Entry("gloo parity on the demo: every config bit for bit against the untransformed step, depth 2 included", (
        "tests/multiprocess/test_parity.py::test_step_is_bitwise_identical_to_the_untransformed_step[reshard-",
        "tests/multiprocess/test_parity.py::test_the_harness_runs_the_graphs_it_selects[reshard]",
    )),
    Entry("a Hugging Face model with tied weights: gloo parity (torch 2.14 waits and saves its gather per use)", (
        "tests/conformance/test_conformance.py::test_one_training_step_on_gloo_is_bitwise_identical_to_the_"
        "untransformed_compile[hf_tied]",
    )),
    Entry("a Hugging Face model: capture, apply, explain, gloo parity (Llama)", (
        "tests/conformance/test_conformance.py::test_apply_on_captured_graphs_merges_every_fsdp_collective_and_"
        "leaves_the_rest[hf_llama]",
        "tests/conformance/test_conformance.py::test_explain_applies_to_a_copy_of_an_untransformed_graph[hf_llama]",
        "tests/conformance/test_conformance.py::test_one_training_step_on_gloo_is_bitwise_identical_to_the_"
        "untransformed_compile[hf_llama]",
    )),
    Entry("explain and the main job (the overlapcfg command on the demo)", (
        "tests/capture/test_capture.py::test_print_report_shows_the_tables_and_repr_is_one_line",
        "tests/demo/test_cli.py::test_default_run_writes_the_report_json_into_the_run_dir",
    )),
    Entry("tune", (
        "tests/tuning/test_tune.py::test_tune_respects_the_budget_and_the_yaml_loads_back",
        "tests/tuning/test_tune.py::test_quick_score_equals_the_full_simulation[",
    )),
    Entry("the FSDP2 driver: bit for bit against plain FSDP2, prefetches as configured (demo and HF Llama)", (
        "tests/fsdp2/test_fsdp2.py::test_demo_losses_and_gradient_shards_match_plain_fsdp2_bit_for_bit[depth 2]",
        "tests/fsdp2/test_fsdp2.py::test_hf_llama_losses_and_gradient_shards_match_plain_fsdp2_bit_for_bit[depth 2]",
        "tests/fsdp2/test_fsdp2.py::test_demo_buckets_start_with_exactly_the_requested_all_gathers_issued[",
    )),
    Entry("the torchtitan pipeline", (
        "tests/integrations/test_torchtitan_pipeline.py::test_registered_pipeline_buckets_every_fsdp_collective_at_"
        "the_depths_asked[",
        "tests/integrations/test_torchtitan_pipeline.py::test_unset_config_is_torchtitans_own_buckets_at_depth_one",
    ), torchtitan=True),
    Entry("the GPU check, on CPU", (
        "tests/benchmarks/test_gpu_check.py",
    )),
    Entry("measure's timed copy of a graph: its collective waits timed, wrapped waits refused", (
        "tests/measuring/test_timed_waits.py",
    )),
)
"""What the compat tier runs. Keep it to minutes per release: a capability once, on the demo and one third-party
model, not every parametrization (the full suite on 2.13 covers those)."""


def _torchtitan_import_error() -> str | None:
    """Why torchtitan's graph trainer cannot run with this torch, or None. Its package imports on every release;
    its models need newer torch APIs (0.3.0 on torch 2.11: ``DataParallelMeshDims`` from ``torch.distributed.fsdp``)
    and its graph trainer more (on 2.12: ``compat.graph_trainer_missing_apis``)."""
    from overlapcfg import compat
    from tests.thirdparty.models import torchtitan_stubs

    try:
        with torchtitan_stubs():
            importlib.import_module("torchtitan.models.llama3")
    except Exception as err:  # any import-time failure means "does not import on this torch"
        return f"{type(err).__name__}: {err}"
    missing = compat.graph_trainer_missing_apis()
    if missing:  # its models import (torch 2.12) but its graph trainer calls what this torch lacks
        return f"its graph trainer needs {', '.join(missing)}"
    return None


def mark_tier(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tier's tests ``compat``; raise if an entry names no test in a file that was collected whole
    (stale; not checked when the command line selects tests by node id)."""
    matched: dict[str, bool] = {}
    # Only the tier skips what torchtitan cannot run: in the full suite (torch 2.13) torchtitan must import, and a
    # broken install must fail there, not skip. The import is also paid only here.
    in_tier = "compat" in (config.option.markexpr or "")
    collected_files = {item.nodeid.split("::", 1)[0] for item in items}
    titan_error: str | None = None
    titan_checked = False
    for item in items:
        for entry in TIER:
            hits = [prefix for prefix in entry.tests if item.nodeid.startswith(prefix)]
            for prefix in hits:
                matched[prefix] = True
            if not hits:
                continue
            item.add_marker(pytest.mark.compat)
            if entry.torchtitan and in_tier:
                if not titan_checked:
                    titan_error, titan_checked = _torchtitan_import_error(), True
                if titan_error is not None:
                    item.add_marker(pytest.mark.skip(reason=f"torchtitan cannot run here: {titan_error}"))
    if any("::" in str(arg) for arg in config.args):
        return
    stale = [prefix for entry in TIER for prefix in entry.tests
             if not matched.get(prefix) and prefix.split("::", 1)[0] in collected_files and "::" in prefix]
    if stale:
        raise pytest.UsageError("tests/support/compat_tier.py names tests that no longer exist: " + ", ".join(stale))
