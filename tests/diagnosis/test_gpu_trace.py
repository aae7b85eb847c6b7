"""A trace in the format torch.profiler writes on CUDA (NCCL kernels on their own stream, launches correlated with
their kernels, FSDP2's labels) is read into the numbers its construction fixes (``fixtures/make_gpu_trace.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overlapcfg.diagnosis import diagnose


def test_exposed_communication_is_nccl_time_no_compute_kernel_covers(gpu_traces: Path) -> None:
    r = diagnose(gpu_traces)
    assert r.device == "cuda" and r.backend == "nccl" and r.steps == (5, 6)
    for rank, exposed in ((0, 1.5e-3), (1, 1.8e-3)):  # rank 1's late all-gather leaves 300 us more uncovered
        for step in (5, 6):
            assert r.exposed(rank, step) == pytest.approx(exposed, abs=1e-9)
    row = next(s for s in r.rank_steps if (s.rank, s.step) == (0, 5))
    assert row.compute_s == pytest.approx(7e-3) and row.comm_s == pytest.approx(4e-3) and row.collectives == 3


def test_nccl_kernels_are_attributed_through_their_launch_to_fsdp2_labels(gpu_traces: Path) -> None:
    r = diagnose(gpu_traces)
    assert r.unattributed == 0 and r.other == 0
    rows = {b.bucket: b for b in r.buckets}
    assert set(rows) == {"model.embed_tokens", "model.layers.0"}
    assert rows["model.layers.0"].kinds == "AG fw, RS"
    assert rows["model.layers.0"].bytes == 1_048_576 * 2  # record_param_comms: out nelems, BFloat16
    assert rows["model.embed_tokens"].exposed_s == pytest.approx(0.8e-3)
    assert rows["model.layers.0"].peak_memory == 6_000_000  # the [memory] sample inside its reduce-scatter


def test_arrival_skew_names_the_rank_that_issued_last(gpu_traces: Path) -> None:
    r = diagnose(gpu_traces)
    top = r.skew[0]
    assert (top.kind, top.bucket, top.last_rank) == ("all_gather", "model.layers.0", 1)
    assert top.skew_s == pytest.approx(0.3e-3)
    assert r.slowest_rank == 1


def test_without_launch_events_kernels_match_their_issues_in_order(gpu_traces: Path) -> None:
    path = gpu_traces / "rank1.json"
    data = json.loads(path.read_text())
    data["traceEvents"] = [e for e in data["traceEvents"] if e.get("name") != "cudaLaunchKernel"]
    path.write_text(json.dumps(data))
    r = diagnose(gpu_traces)
    assert r.collectives == 12 and r.unattributed == 0  # first in, first out: a process group's order
    assert r.exposed(1, 5) == pytest.approx(1.8e-3)


def test_kernels_nothing_issued_are_counted_and_unattributed(gpu_traces: Path) -> None:
    path = gpu_traces / "rank1.json"
    data = json.loads(path.read_text())
    data["traceEvents"] = [e for e in data["traceEvents"] if e.get("name") not in ("cudaLaunchKernel",
                                                                                   "record_param_comms")]
    path.write_text(json.dumps(data))
    r = diagnose(gpu_traces)
    assert r.collectives == 12 and r.unattributed == 6  # rank 1's six: no issue, so no label
    assert r.exposed(1, 5) == pytest.approx(1.8e-3)
    assert not r.divergence  # sizes unknown on one rank are not a disagreement
