"""What calibration times to measure the skew, the wake-up and attention, pinned on hand computations: the skew's
compute unit is the step's own mix of kernels (its most frequent matmul and its typical memory-bound kernels); the
wake-up is the last rank's own mean wait after the shortest compute less its median with none before it; the probe is
the step's median all-gather, and short lengths repeat within a round; attention's
shares count FLOPs as the cost model does, from the step's call shapes, and the backend is the operator that ran.

Fast tier: made-up mixes and waits, a tiny SDPA call, a graph traced with make_fx.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from overlapcfg.cost.hardware import load_hardware
from overlapcfg.measuring.attention_timing import (
    attention_census,
    attention_rates,
    attention_shapes,
    attention_work,
    share_peak,
    time_attention,
)
from overlapcfg.measuring.clock import Clock
from overlapcfg.measuring.kernels import MatmulMix, matmul_mix
from overlapcfg.measuring.skew import (
    MAX_REPEATS,
    PROBE_BYTES,
    ROUND_SECONDS,
    UNIT_SHAPE,
    SkewTimings,
    SkewUnit,
    repeats,
    skew_fit,
    skew_unit,
    wake_points,
)


def test_the_skew_unit_is_the_steps_most_frequent_matmul_and_its_memory_kernels_per_matmul() -> None:
    mix = MatmulMix(Counter({(1, 1024, 64, 64): 32, (1, 64, 1024, 64): 16, (1, 8, 8, 8): 2}), torch.float32,
                    Counter({100: 20, 200: 70, 300: 10}))
    # 100 memory kernels over 50 matmuls: 2 a matmul; their median size by count: the 50th of 100 is a 200
    assert skew_unit(mix) == SkewUnit((1, 1024, 64, 64), 2, 200)


def test_a_tie_between_matmul_shapes_goes_to_the_smaller_and_few_memory_kernels_still_give_one() -> None:
    mix = MatmulMix(Counter({(1, 1024, 64, 64): 8, (1, 8, 8, 8): 8}), torch.float32, Counter({64: 1}))
    assert skew_unit(mix) == SkewUnit((1, 8, 8, 8), 1, 64)


def test_without_a_step_the_unit_is_the_default_matmul_and_one_addition_over_its_output() -> None:
    assert skew_unit(None) == SkewUnit(UNIT_SHAPE, 1, 0)
    assert skew_unit(MatmulMix(Counter(), None)) == SkewUnit()
    assert skew_unit(MatmulMix(Counter({(1, 4, 4, 4): 3}), None)) == SkewUnit((1, 4, 4, 4), 1, 0)


def test_the_skew_probe_is_an_all_gather_of_the_steps_median_all_gather_size() -> None:
    # the demo's unbucketed step: 18 of 128 B, 32 of 8 KB, 24 of 16 KB, 3 of 1 MB; the 39th of 77 is an 8 KB one
    gathers = Counter({128: 18, 8192: 32, 16384: 24, 1048576: 3})
    mix = MatmulMix(Counter({(1, 1024, 64, 64): 4}), torch.float32, Counter({100: 8}), gathers=gathers)
    assert skew_unit(mix) == SkewUnit((1, 1024, 64, 64), 2, 100, 8192)
    assert skew_unit(MatmulMix(Counter(), None, gathers=Counter({64: 1, 4096: 1}))).probe_bytes == 64  # lower median
    assert skew_unit(MatmulMix(Counter({(1, 4, 4, 4): 3}), None)).probe_bytes == PROBE_BYTES  # none known
    assert skew_unit(mix).describe() == ("matmul 1024x64x64 + 2 elementwise kernel(s) of 100 bytes, "
                                         "then a 8192-byte all-gather")


def test_short_lengths_repeat_within_a_round_up_to_the_cap() -> None:
    # a 0.25 ms unit: 0, 2, 8, 32 and 120 units; 10 ms of compute a round (ROUND_SECONDS) at most 16 times
    assert ROUND_SECONDS == 0.01 and MAX_REPEATS == 16
    # 0 units: the cap; 0.5 ms: 20, capped; 2 ms: 5; 8 ms: 1; 30 ms: still once
    assert repeats([0, 2, 8, 32, 120], 0.00025) == [16, 16, 5, 1, 1]


def test_the_wake_up_is_the_last_ranks_own_mean_wait_after_the_shortest_compute_less_the_median_without() -> None:
    # per length, trials of (rank 0, rank 1) waits: the shorter of each trial is the collective alone
    # The collective fits price the median alone: no compute, median 1e-4 of (1e-4, 1.3e-4, 1e-4), mean 1.1e-4.
    waits = (((1e-4, 3e-4), (1.3e-4, 2e-4), (1e-4, 1e-4)),  # the reference: no wake-up
             ((4e-4, 2e-4), (2e-3, 3e-3), (2.5e-4, 5e-4)),  # mean of 2e-4, 2e-3, 2.5e-4 = 8.167e-4 (the one slow
             # trial counts: a median, 2.5e-4, would drop it)
             ((3e-3, 9e-3), (2e-3, 7e-3), (2.2e-3, 2e-3)))  # 2.4e-3 after 8 ms: the skew's, not the wake-up's
    points = wake_points(SkewTimings("world", 2, (0.0, 0.002, 0.008), waits))
    assert [p.idle for p in points] == [0.0, 0.002]  # held beyond 2 ms (``Skew``: flat beyond the last point)
    assert [p.extra for p in points] == pytest.approx([0.0, 7.1667e-4], rel=1e-4)
    assert skew_fit(SkewTimings("world", 2, (0.0, 0.002, 0.008), waits))[0].wake == points
    faster = (waits[0], ((5e-5, 9e-5),) * 3, waits[2])  # quicker than back to back: no negative wake-up
    assert [p.extra for p in wake_points(SkewTimings("world", 2, (0.0, 0.002, 0.008), faster))] == [0.0, 0.0]


def test_a_repeated_length_keeps_one_point() -> None:
    waits = (((1e-4, 1e-4),), ((3e-4, 3e-4),), ((4e-4, 4e-4),))
    points = wake_points(SkewTimings("world", 2, (0.0, 0.0, 0.01), waits))
    assert [p.idle for p in points] == [0.0, 0.01]
    assert [p.extra for p in points] == pytest.approx([0.0, 3e-4])


def test_attention_work_counts_flops_as_the_cost_model_does() -> None:
    # 4 x batch_heads x seq^2 x head_dim forward; the backward 2.5x; a causal call half
    assert attention_work((2, 128, 16, False), backward=False) == 4 * 2 * 128 * 128 * 16
    assert attention_work((2, 128, 16, False), backward=True) == 2.5 * 4 * 2 * 128 * 128 * 16
    assert attention_work((2, 128, 16, True), backward=False) == 2 * 2 * 128 * 128 * 16


def test_attention_shares_of_the_peak_per_length_and_head_dimension() -> None:
    rates = attention_rates("flash", [(2, 128, 16, False), (2, 128, 16, True)],
                            [(1e-3, 4e-3), (1e-3, 4e-3)], peak=1e10)
    assert rates is not None and rates.backend == "flash"
    (point,) = rates.backends["flash"]
    assert (point.seq_len, point.head_dim) == (128, 16)
    assert point.forward == pytest.approx(2_097_152 / 1e7) and point.backward == pytest.approx(5_242_880 / 4e7)
    assert point.forward_causal == pytest.approx(point.forward / 2)
    assert point.backward_causal == pytest.approx(point.backward / 2)
    assert attention_rates("flash", [], [], peak=1e10) is None
    held = attention_rates("flash", [(2, 128, 16, False)], [(1e-9, 1e-9)], peak=1e10)
    assert held is not None and held.backends["flash"][0].forward == 1.0  # faster than the peak: held at 1


def test_a_fused_sdpa_call_is_found_by_its_operator_and_timed_on_the_backend_that_ran() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    q = torch.randn(2, 3, 32, 8)
    gm = make_fx(call)(q, q, q)
    assert attention_shapes([gm]) == Counter({(6, 32, 8, True): 1})
    backend, timings = time_attention([(6, 32, 8, True)], torch.float32, Clock("cpu"))
    assert backend == "flash"  # a CPU's SDPA dispatches to its flash kernel for these inputs
    assert len(timings) == 1 and all(t > 0 for t in timings[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_share_is_taken_of_the_peak_pricing_multiplies_it_by(dtype: torch.dtype) -> None:
    hw = load_hardware("h100_nvlink")  # bf16 and fp32 peaks 15x apart: a wrong pick is no rounding error
    assert share_peak(hw.peak_flops, dtype) == hw.flops_for(str(dtype).removeprefix("torch.")) / hw.compute_efficiency


def test_a_call_whose_queries_and_keys_differ_in_length_is_counted_as_untimed_not_dropped() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    # 1 x 3 heads, 8 queries against 12 keys: 4 x 3 x 8 x 12 x 8 FLOPs are 4.5 calls of 8 x 8 -- no one shape
    q, kv = torch.randn(1, 3, 8, 8), torch.randn(1, 3, 12, 8)
    gm = make_fx(call)(q, kv, kv)
    assert attention_census([gm]) == (Counter(), 1)
    same = make_fx(call)(q, q, q)
    assert attention_census([gm, same]) == (Counter({(3, 8, 8, False): 1}), 1)
    assert matmul_mix([gm, same]).attention_untimed == 1
