"""What ``overlapcfg.compat`` probes about the installed torch, held against torch itself, and what it does where a
release lacks a feature: every supported release (2.11 to 2.14) runs these in the compat tier.

Where a test needs another release's behaviour than the installed one (torch 2.11's upstream schedulers take fewer
settings), the upstream function is replaced by a recording stand-in with that release's signature: the mapping is
compat's, and it is tested whatever torch is installed.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

import overlapcfg
from overlapcfg import compat
from overlapcfg.compat import _schedulers
from overlapcfg.errors import OverlapConfigError
from overlapcfg.passes import apply
from tests.support.synthetic import forward_graph

LAYERS = [[1, 1], [2], [1, 3]]


def test_the_functional_all_gather_traces_to_the_ops_the_pass_recognizes_without_a_deprecation() -> None:
    """SimpleFSDP's gather (``compat.functional_all_gather``: ``all_gather_single``, or ``all_gather_tensor`` on
    2.11) must trace to ``all_gather_into_tensor`` + ``wait_tensor``, and run eagerly without torch's deprecation
    warning (2.13 deprecated ``all_gather_tensor``)."""
    with compat.fake_process_group(2, 0), warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        group = dist.group.WORLD
        eager = compat.functional_all_gather(torch.ones(3, 4), 0, group) + 0  # waits
        gm = make_fx(lambda shard: compat.functional_all_gather(shard, 0, group) * 2)(torch.ones(3, 4))
    assert eager.shape == (6, 4)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert compat.ALL_GATHER_INTO_TENSOR in targets
    assert compat.WAIT_TENSOR in targets


def test_the_eager_all_gather_is_the_torch_distributed_function_fsdp2_calls() -> None:
    """The FSDP2 probe in ``tests/support/fsdp2_ranks.py`` patches ``torch.distributed.<C10D_ALL_GATHER_NAME>``:
    it must be the function FSDP2's all-gather calls on this release, and it gathers into the output given."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    assert f"dist.{compat.C10D_ALL_GATHER_NAME}(" in inspect.getsource(_fsdp_collectives)
    assert compat.c10d_all_gather is getattr(dist, compat.C10D_ALL_GATHER_NAME)
    with compat.fake_process_group(2, 0):
        out = torch.zeros(6, 4)
        compat.c10d_all_gather(out, torch.ones(3, 4))
    assert out.shape == (6, 4)


def test_roofline_estimates_are_not_attempted_without_a_gpu() -> None:
    """On a CPU build and on a CUDA build without a GPU alike, upstream's roofline estimates cannot run (no triton,
    or triton without a driver): the probe says so and the schedulers get stand-in figures."""
    if not torch.cuda.is_available():
        assert compat.roofline_estimates_work() is False
    import torch._inductor.utils as inductor_utils

    with compat.upstream_scheduler_scope():
        if not compat.roofline_estimates_work():
            assert inductor_utils.get_gpu_dram_gbps() == 3000
    if not compat.roofline_estimates_work():
        assert inductor_utils.get_gpu_dram_gbps is not None  # restored (the real one), whatever it does here


def test_the_upstream_scheduler_scope_nests_and_puts_torch_back_on_an_error() -> None:
    """The one scope that changes torch around its schedulers: nested scopes in one thread work (the lock is
    reentrant), and an error inside leaves torch's functions, its FSDP logger and its config as they were."""
    import logging

    import torch._inductor.utils as inductor_utils
    from torch._inductor import config as inductor_config

    real = inductor_utils.get_gpu_dram_gbps
    fsdp = logging.getLogger("torch._inductor.fx_passes.fsdp")
    options = inductor_config.aten_distributed_optimizations

    def autofix() -> object:  # torch 2.11 has no such setting
        return getattr(options, "overlap_scheduling_autofix_cycles", None)

    before = (list(fsdp.filters), autofix())
    with pytest.raises(RuntimeError, match="inside"), compat.upstream_scheduler_scope(), \
            compat.upstream_scheduler_scope(drop_cyclic_hints=True) as run:
        assert run.dropped_cyclic_hints == []
        raise RuntimeError("inside")
    assert inductor_utils.get_gpu_dram_gbps is real
    after = (list(fsdp.filters), autofix())
    assert after == before


def test_pytests_log_handlers_stay_off_torchs_structured_trace() -> None:
    """pytest attaches its log handlers to every logger that does not propagate; on torch's structured-trace logger
    they made torch build every structured-trace record, and ``compat.upstream_scheduler_scope`` build its
    per-node estimate table, for nobody (``tests/conftest.py`` keeps them off). A test's own reader still
    attaches."""
    import logging

    from torch._logging._internal import trace_log

    assert not [h for h in trace_log.handlers if type(h).__module__ == "_pytest.logging"], trace_log.handlers
    trace_log.addHandler(reader := logging.NullHandler())
    try:
        assert reader in trace_log.handlers
    finally:
        trace_log.removeHandler(reader)


def test_the_estimate_logs_are_skipped_only_while_nobody_reads_torchs_structured_trace() -> None:
    """torch's schedulers build two estimate tables (a FLOP count of every compute node; both estimates of every
    collective) that only torch's structured trace can receive. Inside the scope, while that trace has no handler,
    neither is built; with one open both are built as torch wrote them; on exit torch's functions are back either
    way. The schedule is the same with and without them: ``auto`` applied both ways gives the same graph."""
    import logging

    from torch._inductor.fx_passes import node_runtime_estimation as estimation
    from torch._logging._internal import trace_log

    names = ("_log_compute_estimations", "_log_collective_benchmarks")
    real = {name: getattr(estimation, name) for name in names}
    syn = forward_graph(LAYERS)
    cfg = overlapcfg.load_config({"strategy": "auto", "policy": {"collective_bucketing": True}})
    built: dict[str, list[int]] = {name: [] for name in names}

    def recording(name: str) -> Any:
        def record(nodes: list[torch.fx.Node], *rest: object, **named: object) -> None:
            built[name].append(len(nodes))
            real[name](nodes, *rest, **named)
        return record

    recorders = {name: recording(name) for name in names}
    listening = list(trace_log.handlers)  # what this process has attached (pytest's capture may be among them)
    for handler in listening:
        trace_log.removeHandler(handler)
    for name in names:
        setattr(estimation, name, recorders[name])
    try:
        with compat.upstream_scheduler_scope():
            assert all(getattr(estimation, name) is not recorders[name] for name in names)
        assert all(getattr(estimation, name) is recorders[name] for name in names)
        with compat.fake_process_group(2, 0):
            skipped = apply(syn.gm, cfg, module_fqns=syn.module_fqns, graph_kind="forward")
        assert built == {name: [] for name in names}
        trace_log.addHandler(reader := logging.NullHandler())
        try:
            with compat.fake_process_group(2, 0):
                logged = apply(syn.gm, cfg, module_fqns=syn.module_fqns, graph_kind="forward")
        finally:
            trace_log.removeHandler(reader)
        # built for the reader, once per estimate pass, each over a non-empty set of nodes
        assert all(built[name] and all(built[name]) for name in names), built
    finally:
        for name in names:
            setattr(estimation, name, real[name])
        for handler in listening:
            trace_log.addHandler(handler)
    assert skipped.code == logged.code


def test_torch_manual_runs_upstream_without_a_gpu_and_buckets() -> None:
    syn = forward_graph(LAYERS)
    cfg = overlapcfg.load_config({"strategy": "torch_manual", "plan": {"buckets": ["layers.*"]}})
    with compat.fake_process_group(2, 0):
        gm = apply(syn.gm, cfg, module_fqns=syn.module_fqns, graph_kind="forward")
    record = gm.meta["overlapcfg"]
    assert record.after.total_fsdp == len(LAYERS) < record.before.total_fsdp


# --- settings a release's upstream pass does not take --------------------------------------------------------------

class _Recorder:
    """Stands in for an upstream pass with a given signature and records what it was called with."""

    def __init__(self, parameters: tuple[str, ...]) -> None:
        self.parameters = frozenset(parameters)
        self.calls: list[dict[str, Any]] = []

    def __call__(self, gm: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> torch.fx.GraphModule:
        self.calls.append(kwargs)
        return gm


_MANUAL_211 = ("gm", "module_bucket_plans", "insert_overlap_deps", "module_stack_fn")
_AUTO_211 = ("gm", "max_in_flight_gb", "max_compute_pre_fetch", "collective_bucketing", "insert_overlap_deps",
             "compute_overlap_multipler", "max_coll_distance", "custom_runtime_estimation", "collective_estimator",
             "max_memory_increase_gb", "max_memory_increase_ratio")


def _as_torch_211(monkeypatch: pytest.MonkeyPatch, name: str, parameters: tuple[str, ...]) -> _Recorder:
    recorder = _Recorder(parameters)
    monkeypatch.setattr(_schedulers, name, lambda: (recorder, recorder.parameters))
    return recorder


def test_a_bucket_mode_torch_manual_cannot_honour_is_a_config_error_at_its_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11's ``manual_overlap_bucketing`` has no ``bucket_mode`` (it always buckets as ``custom_ops``):
    that mode runs, another is refused at the user's path, and nothing is applied."""
    recorder = _as_torch_211(monkeypatch, "_manual_overlap_bucketing", _MANUAL_211)
    syn = forward_graph(LAYERS)
    before = [n.name for n in syn.gm.graph.nodes]
    with compat.fake_process_group(2, 0):
        apply(syn.gm, overlapcfg.load_config({"strategy": "torch_manual", "plan": {"buckets": ["layers.*"]}}),
              module_fqns=syn.module_fqns, graph_kind="forward")
        assert "bucket_mode" not in recorder.calls[-1]
        cfg = overlapcfg.load_config({"strategy": "torch_manual", "plan": {"buckets": ["layers.*"]},
                                      "policy": {"bucket_mode": "coalesced"}})
        with pytest.raises(OverlapConfigError, match=r"^trainer\.overlap\.policy\.bucket_mode: bucket_mode "
                                                     r"'coalesced' needs torch >= 2\.12"):
            apply(syn.gm, cfg.mounted_at("trainer.overlap"), module_fqns=syn.module_fqns, graph_kind="forward")
    assert [n.name for n in syn.gm.graph.nodes] == before
    assert len(recorder.calls) == 1


def test_auto_knobs_are_mapped_onto_a_release_without_them_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11's ``schedule_overlap_bucketing`` has no ``compute_estimator`` (it benchmarks compute unless a
    custom estimate answers) and no ``bucket_mode``: "analytical" becomes a custom estimate that prices compute
    nodes by the roofline and leaves the rest to upstream; an unset ``bucket_mode`` is dropped, a set one refused."""
    recorder = _as_torch_211(monkeypatch, "_schedule_overlap_bucketing", _AUTO_211)
    syn = forward_graph(LAYERS)
    with compat.fake_process_group(2, 0):
        apply(syn.gm, overlapcfg.load_config({"strategy": "auto"}), module_fqns=syn.module_fqns,
              graph_kind="forward")
        (call,) = recorder.calls
        assert set(call) <= recorder.parameters
        estimate = call["custom_runtime_estimation"]
        mm = next(n for n in syn.gm.graph.nodes if n.target is torch.ops.aten.mm.default)
        wait = next(n for n in syn.gm.graph.nodes if n.target is compat.WAIT_TENSOR)
        with compat.upstream_scheduler_scope():
            assert estimate(mm, None) > 0
            assert estimate(wait, None) is None
        with pytest.raises(OverlapConfigError, match=r"^overlap\.policy\.bucket_mode: bucket_mode='custom_ops' "
                                                     r"needs a newer torch"):
            apply(syn.gm, overlapcfg.load_config({"strategy": "auto", "policy": {"bucket_mode": "custom_ops"}}),
                  module_fqns=syn.module_fqns, graph_kind="forward")
        recorder.calls.clear()
        apply(syn.gm, overlapcfg.load_config({"strategy": "auto", "policy": {"compute_estimator": "benchmark"}}),
              module_fqns=syn.module_fqns, graph_kind="forward")
        assert "custom_runtime_estimation" not in recorder.calls[-1]
