"""Calibration tells the truth, checked without a GPU or a cluster: the device's facts (a mocked H200 and A100, this
CPU's caches), a base profile of the device's own kind, memory bandwidth fitted beyond the cache and never above the
datasheet without saying so, both matmul dtypes measured, every rough fit flagged, and the contention fit
recovering known slowdowns from synthetic runs.

Fast tier: numbers, mocks and files only.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from overlapcfg.cost.hardware import load_hardware
from overlapcfg.cost.measured_fits import ROUGH_FIT, Calibration
from overlapcfg.errors import OverlapConfigError
from overlapcfg.measuring import calibration as cal
from overlapcfg.measuring.clock import Clock
from overlapcfg.measuring.contention import ContentionTimings, contention_fit
from overlapcfg.measuring.device import DEFAULT_CPU_CACHE, DeviceFacts, _cpu_cache_bytes, device_facts
from overlapcfg.measuring.kernels import (
    BEYOND_CACHE,
    MEMORY_ATTEMPTS,
    beyond_cache,
    matmul_samples,
    memory_samples,
    memory_sizes,
    timed_until_growing,
)

MIB = 2**20


def _gpu(name: str, clock_khz: int, bus_bits: int, l2: int) -> SimpleNamespace:
    return SimpleNamespace(name=name, memory_clock_rate=clock_khz, memory_bus_width=bus_bits, L2_cache_size=l2)


@pytest.mark.parametrize("name, clock_khz, bus, bandwidth, base, bf16", [
    ("NVIDIA H200", 3_201_000, 6144, 4.92e12, "h100_nvlink", 989e12),
    ("NVIDIA H100 80GB HBM3", 2_619_000, 5120, 3.35e12, "h100_nvlink", 989e12),
    ("NVIDIA A100-SXM4-80GB", 1_593_000, 5120, 2.04e12, "a100_ib", 312e12),
    ("Some Future GPU", 0, 0, None, "h100_nvlink", None),
])
def test_a_gpu_is_measured_against_its_own_datasheet_and_based_on_a_gpu_profile(
        monkeypatch: pytest.MonkeyPatch, name: str, clock_khz: int, bus: int, bandwidth: float | None, base: str,
        bf16: float | None) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _gpu(name, clock_khz, bus, 50 * MIB))
    clock = Clock("cpu")
    clock.cuda, clock.device = True, torch.device("cuda", 0)  # the facts only ask torch.cuda for properties
    facts = device_facts(clock)
    assert facts.kind == "gpu" and facts.base == base and facts.cache_bytes == 50 * MIB
    if bandwidth is None:
        assert facts.mem_bandwidth is None and facts.peak_flops == {}
    else:
        assert facts.mem_bandwidth == pytest.approx(bandwidth, rel=0.01)
        assert facts.peak_for(torch.bfloat16) == bf16 and facts.peak_for(torch.float16) == bf16
    assert cal.base_profile(None, facts).device_kind == "gpu"


def test_a_cpu_profile_is_refused_as_the_base_of_a_gpu_and_the_other_way_round() -> None:
    gpu = DeviceFacts(name="NVIDIA H200", kind="gpu", cache_bytes=50 * MIB, mem_bandwidth=4.8e12,
                      base="h100_nvlink")
    with pytest.raises(OverlapConfigError) as err:
        cal.base_profile("cpu_gloo", gpu)
    (fault,) = err.value.faults
    assert fault.path == "calibrate.base" and "'cpu_gloo' is a CPU profile" in fault.message
    assert "h100_nvlink" in fault.message and "a100_ib" in fault.message
    cpu = DeviceFacts(name="cpu (2 threads)", kind="cpu", cache_bytes=DEFAULT_CPU_CACHE, mem_bandwidth=None)
    with pytest.raises(OverlapConfigError, match="'h100_nvlink' is a GPU profile"):
        cal.base_profile("h100_nvlink", cpu)
    assert cal.base_profile(None, cpu).name == "cpu_gloo"


def test_the_cpu_cache_is_read_from_sys(tmp_path: Path) -> None:
    for i, size in enumerate(("48K", "2048K", "480M")):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "size").write_text(f"{size}\n")
    assert _cpu_cache_bytes(tmp_path) == 480 * MIB
    assert _cpu_cache_bytes(tmp_path / "missing") == DEFAULT_CPU_CACHE


def _cache_timings(sizes: list[int], cache: int, *, cache_bw: float, memory_bw: float) -> list[float]:
    """A kernel faster while its buffers fit in the cache: what fooled the old fit on an H200 (8.8 TB/s)."""
    return [2e-6 + n / (cache_bw if n < cache else memory_bw) for n in sizes]


def test_memory_bandwidth_is_fitted_beyond_the_cache_not_through_it() -> None:
    cache = 50 * MIB
    sizes = memory_sizes(cache, 2**32)
    assert max(sizes) >= 2 * BEYOND_CACHE * cache * 0.9 and sizes == sorted(sizes)
    samples = memory_samples(sizes, _cache_timings(sizes, cache, cache_bw=9e12, memory_bw=4.3e12), cache)
    assert samples.rate == pytest.approx(4.3e12, rel=0.01)
    assert "beyond 4x the 50 MiB cache" in samples.what, samples.what
    capped = memory_sizes(cache, 64 * MIB)  # a cap below the cache: the largest sizes, said to maybe time the cache
    small = memory_samples(capped, _cache_timings(capped, cache, cache_bw=9e12, memory_bw=4.3e12), cache)
    assert "may time the cache" in small.what


def test_memory_timings_a_pause_spoiled_are_timed_again_and_a_busy_machine_is_named() -> None:
    """A rank paused inside one size's rounds times it several times too slow, and the line through the sizes
    beyond the cache stops rising (seen on a 2-core machine under load 4: "do not grow with size"). Calibration
    times those sizes again, only those, until the line rises; when it never does, the error blames the busy
    machine with the timings, not a size the user cannot set."""
    cache = 50 * MIB
    sizes = memory_sizes(cache, 2**32)
    good = _cache_timings(sizes, cache, cache_bw=9e12, memory_bw=4.3e12)
    big = beyond_cache(sizes, cache)
    paused = list(good)
    paused[big[0]], paused[big[1]] = 3 * good[big[-1]], 2 * good[big[-1]]  # both timed through long pauses
    calls: list[list[int]] = []

    def once_paused(asked: list[int]) -> list[float]:
        calls.append(list(asked))
        return paused if len(calls) == 1 else [good[sizes.index(n)] for n in asked]

    seconds, used = timed_until_growing(sizes, cache, once_paused)
    assert used == 2 and calls[1] == [sizes[i] for i in big]  # timed again: the fitted sizes only
    assert seconds == good
    assert memory_samples(sizes, seconds, cache).rate == pytest.approx(4.3e12, rel=0.01)

    calls.clear()
    seconds, used = timed_until_growing(sizes, cache, lambda asked: calls.append(asked) or [
        paused[sizes.index(n)] for n in asked])
    assert used == MEMORY_ATTEMPTS == len(calls)
    with pytest.raises(OverlapConfigError, match="too busy to time its memory") as err:
        memory_samples(sizes, seconds, cache)
    assert f"timed {MEMORY_ATTEMPTS} times" in str(err.value) and "raise the largest size" not in str(err.value)

    calls.clear()
    assert timed_until_growing(sizes, cache, lambda asked: calls.append(asked) or [
        good[sizes.index(n)] for n in asked]) == (good, 1) and len(calls) == 1  # a clean timing is taken once


def test_the_memory_rate_is_the_rate_at_the_steps_own_kernels() -> None:
    """Like the matmul rate: a model whose memory-bound kernels fit in the cache is priced at the cache's speed, one
    whose kernels stream from memory at the memory's (sizes beyond the largest timed follow the memory's line)."""
    from collections import Counter

    cache = 50 * MIB
    sizes = memory_sizes(cache, 2**32)
    seconds = [n / (9e12 if n < cache else 4.3e12) for n in sizes]  # no per-kernel overhead: rates are exact
    small = memory_samples(sizes, seconds, cache, Counter({MIB: 40, 4 * MIB: 10}))
    large = memory_samples(sizes, seconds, cache, Counter({2**30: 3, 2**33: 1}))
    assert small.rate == pytest.approx(9e12, rel=0.05) and "at the step's 50 memory-bound kernels" in small.what
    assert large.rate == pytest.approx(4.3e12, rel=0.02)
    assert "memory 4.3e+03 GB/s" in large.what  # the memory's own bandwidth is recorded either way


def _record(**kw: object) -> Calibration:
    return Calibration(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), torch_version="x",
                       overlapcfg_version="x", backend="nccl", device="NVIDIA H200", world_size=1, hosts=1,
                       base="h100_nvlink", budget_seconds=1.0, seconds=1.0, groups=(), **kw)  # type: ignore[arg-type]


def _matmuls(rate: dict[torch.dtype, float], noise: float = 0.0) -> dict[torch.dtype, object]:
    from collections import Counter

    shapes = Counter({(1, 4096, 4096, 4096): 3, (1, 1024, 4096, 4096): 2})
    chosen = list(shapes)
    out = {}
    for dtype, r in rate.items():
        seconds = [2 * m * k * n / r * (1 + (noise if i else -noise)) for i, (_, m, k, n) in enumerate(chosen)]
        out[dtype] = matmul_samples(shapes, chosen, seconds, dtype)[0]
    return out


def test_both_dtypes_are_measured_and_figures_above_the_datasheet_are_capped_and_said() -> None:
    facts = DeviceFacts(name="NVIDIA H200", kind="gpu", cache_bytes=50 * MIB, mem_bandwidth=4.8e12,
                        peak_flops={"bfloat16": 989e12, "float32": 67e12}, source="test", base="h100_nvlink")
    sizes = memory_sizes(facts.cache_bytes, 2**32)
    mem = memory_samples(sizes, [1e-6 + n / 8.8e12 for n in sizes], facts.cache_bytes)  # a timing error: 8.8 TB/s
    mms = _matmuls({torch.float32: 50e12, torch.bfloat16: 790e12})
    clock = Clock("cpu")
    profile = cal._profile("h200", load_hardware("h100_nvlink"), None, mem, mms, (), facts, clock, ["host"],
                           _record(kernels=(mem, *mms.values())))
    assert profile.device_kind == "gpu"
    assert profile.peak_flops.bf16 == pytest.approx(790e12) and profile.peak_flops.fp32 == pytest.approx(50e12)
    assert profile.mem_bandwidth == 4.8e12  # the datasheet's, not the 8.8 measured
    notes = " ".join(profile.calibration.notes)  # type: ignore[union-attr]
    assert "above NVIDIA H200's datasheet" in notes and "scaled by" not in notes  # nothing extrapolated
    assert any("mem_bandwidth" in r for r in profile.calibration.rough_fits)  # type: ignore[union-attr]


def test_every_fit_with_a_large_residual_is_flagged_matmuls_included(caplog: pytest.LogCaptureFixture) -> None:
    """The loaded-CPU run: 0.5 GFLOP/s with a 1,657 % residual, and no word about it. Now it is a rough fit."""
    facts = DeviceFacts(name="cpu (2 threads)", kind="cpu", cache_bytes=4 * MIB, mem_bandwidth=None)
    sizes = memory_sizes(facts.cache_bytes, 2**28)
    mem = memory_samples(sizes, [1e-6 + n / 1e10 for n in sizes], facts.cache_bytes)
    mms = _matmuls({torch.float32: 5e8, torch.bfloat16: 1e9}, noise=0.9)
    assert mms[torch.float32].residual > ROUGH_FIT  # type: ignore[attr-defined]
    with caplog.at_level("WARNING"):
        profile = cal._profile("loaded", load_hardware("cpu_gloo"), None, mem, mms, (), facts, Clock("cpu"),
                               ["host"], _record(kernels=(mem, *mms.values())))
    rough = profile.calibration.rough_fits  # type: ignore[union-attr]
    assert any(r.startswith("matmul float32") for r in rough) and any(r.startswith("matmul bfloat16") for r in rough)
    assert not any(r.startswith("memory") for r in rough)
    assert "matmul float32" in caplog.text


def test_attention_calls_calibration_could_not_time_are_counted_in_the_notes() -> None:
    facts = DeviceFacts(name="cpu (2 threads)", kind="cpu", cache_bytes=4 * MIB, mem_bandwidth=None)
    sizes = memory_sizes(facts.cache_bytes, 2**28)
    mem = memory_samples(sizes, [1e-6 + n / 1e10 for n in sizes], facts.cache_bytes)
    mms = _matmuls({torch.float32: 5e10, torch.bfloat16: 1e11})

    def notes(untimed: int) -> str:
        profile = cal._profile("cpu", load_hardware("cpu_gloo"), None, mem, mms, (), facts, Clock("cpu"), ["host"],
                               _record(kernels=(mem, *mms.values())), attention_untimed=untimed)
        return " ".join(profile.calibration.notes)  # type: ignore[union-attr]

    assert "attention: 2 forward call(s) of the step not timed" in notes(2)
    assert "priced at the matmul rate" in notes(2)  # no attention timed at all here
    assert "not timed" not in notes(0)


def _runs(a: float, b: float, comm: float, compute: float, runs: int = 5) -> ContentionTimings:
    under = compute * (1 + a)
    wait = comm - under / (1 + b)
    return ContentionTimings("world", False, 2**24, (comm,) * runs, (compute,) * runs, (under,) * runs,
                             (wait,) * runs)


@pytest.mark.parametrize("a, b", [(0.0, 0.0), (0.2, 0.5), (1.2, 2.4)])
def test_the_contention_fit_recovers_known_slowdowns(a: float, b: float) -> None:
    fitted, samples = contention_fit([_runs(a, b, comm=0.04, compute=0.01), _runs(a / 2, b / 2, 0.04, 0.01)])
    assert fitted.compute_slowdown == pytest.approx(a, abs=1e-9)  # the slowest rank's
    assert fitted.comm_slowdown == pytest.approx(b, abs=1e-9)
    assert samples.residual == pytest.approx(0.0, abs=1e-9) and samples.group == "world"


def test_runs_whose_collective_ended_under_the_compute_say_nothing_about_its_slowdown() -> None:
    ended = ContentionTimings("world", False, 2**24, (0.01,) * 3, (0.02,) * 3, (0.03,) * 3, (0.0,) * 3)
    fitted, _ = contention_fit([ended])
    assert fitted.compute_slowdown == pytest.approx(0.5) and fitted.comm_slowdown == 0.0
