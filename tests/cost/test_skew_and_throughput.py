"""Rank skew and the numbers people compare, pinned on hand computations: a collective issued after ``T`` seconds
of compute starts ``E[max of p normals] x sqrt(a^2 + (r T)^2)`` later; a blocking wait resynchronizes; the skew fit
recovers known arrival spreads; tokens/s and MFU of a known step; the optimizer over the shard.

Fast tier: the replay's streams, made-up waits, a two-layer synthetic step.
"""

from __future__ import annotations

import math

import pytest

from overlapcfg.cost.achievable import Skew, expected_max_normal
from overlapcfg.cost.hardware import hardware_from, load_hardware
from overlapcfg.cost.replay import Streams
from overlapcfg.measuring.skew import SkewTimings, skew_fit
from overlapcfg.report.compare import compare
from tests.support.synthetic import captured_step


def test_the_expected_last_of_two_normals_is_one_over_root_pi() -> None:
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-6)
    assert expected_max_normal(8) == pytest.approx(1.42360, abs=1e-5)  # tables of normal order statistics
    assert expected_max_normal(1) == 0.0


def test_a_collective_waits_for_its_last_rank_and_a_blocking_wait_resynchronizes() -> None:
    skew = Skew(relative=0.1, absolute=1e-3)
    s = Streams(skew)
    s.run(0.02)  # 20 ms of compute since the start
    start = s.issue("a", "comm:0", 0.005, ranks=8)
    late = 1.4236 * math.hypot(1e-3, 0.1 * 0.02)
    assert start == pytest.approx(0.02 + late, rel=1e-4)
    assert s.wait("a") == pytest.approx(late + 0.005, rel=1e-4)  # blocked: arrival skew plus the transfer
    s.run(0.01)  # 10 ms after the resynchronization, not 30 ms after the start
    second = s.issue("b", "comm:0", 0.001, ranks=8)
    assert second - s.t == pytest.approx(1.4236 * math.hypot(1e-3, 0.1 * 0.01), rel=1e-4)


def test_work_between_graphs_is_off_the_clock_but_the_ranks_drift_across_it() -> None:
    """An eager loss of 50 ms between the forward and the backward: the backward's first collective, issued after
    10 ms of its compute, waits for ranks 60 ms apart from their last meeting, not 10 ms; the clock does not move."""
    skew = Skew(relative=0.1, absolute=1e-3)
    s = Streams(skew)
    s.run(0.02)
    s.end_graph()  # the forward ends: every stream idle, the ranks together
    s.between_graphs(0.05)
    assert s.t == pytest.approx(0.02)
    s.run(0.01)
    late = expected_max_normal(2) * math.hypot(1e-3, 0.1 * 0.06)  # 60 ms since the ranks met: 3.4 ms
    assert s.issue("a", "comm:0", 0.005, ranks=2) == pytest.approx(0.03 + late, rel=1e-9)
    assert s.wait("a") == pytest.approx(late + 0.005, rel=1e-9)
    s.end_graph()
    s.between_graphs(0.0)  # nothing between: the next graph starts from the meeting
    s.run(0.01)
    assert s.issue("b", "comm:0", 0.001, ranks=2) - s.t == pytest.approx(
        expected_max_normal(2) * math.hypot(1e-3, 0.1 * 0.01), rel=1e-9)


def test_the_work_between_graphs_moves_only_what_waits_for_skew() -> None:
    """``Pricing.between_graphs_seconds`` prices no time of its own (the prediction is the graphs' time): without
    skew the step is the same to the last bit; with it the backward's collectives wait longer. A negative value is
    refused at its path, and so is an infinite one."""
    from overlapcfg.errors import OverlapConfigError

    step = captured_step([[2, 1], [1]])
    plain = hardware_from({**load_hardware("cpu_gloo").model_dump(), "skew": None})
    skewed = hardware_from({**load_hardware("cpu_gloo").model_dump(),
                            "skew": {"relative": 0.1, "absolute": 1e-4}})

    def predict(hw, between):
        return compare(step, [{"strategy": "none"}], hardware=hw, world_size=2,
                       pricing={"between_graphs_seconds": between}).rows[0].simulation

    assert predict(plain, 0.05).step_seconds == predict(plain, None).step_seconds
    before, after = predict(skewed, None), predict(skewed, 0.05)
    assert after.skew_seconds > before.skew_seconds and after.step_seconds > before.step_seconds
    for bad in (-1.0, float("inf")):  # no drift is negative, none is endless: refused at the setting's path
        with pytest.raises(OverlapConfigError, match=r"pricing\.between_graphs_seconds: expected seconds, a finite"):
            predict(plain, bad)


def test_the_skew_fit_recovers_known_spreads() -> None:
    """Two ranks, the later one ``d`` behind: the earlier waits ``d`` longer. With ``|d|`` at its mean
    ``sigma x 2 / sqrt(pi)`` for two normals of deviation sigma, the mean lateness over both ranks is
    ``sigma / sqrt(pi)``, so the fit reads sigma back; sigma = sqrt(a^2 + D T + (r T)^2)."""
    a, diffusion, r = 2e-4, 1e-5, 0.05
    compute = (0.0, 0.002, 0.008, 0.03, 0.1)
    waits = []
    for t in compute:
        d = math.sqrt(a * a + diffusion * t + (r * t) ** 2) * 2 / math.sqrt(math.pi)
        waits.append(tuple((1e-5 + d, 1e-5) for _ in range(6)))  # the collective's own 10 us cancels
    fitted, samples = skew_fit(SkewTimings("world", 2, compute, tuple(waits)))
    assert fitted.absolute == pytest.approx(a, rel=1e-6) and fitted.relative == pytest.approx(r, rel=1e-6)
    assert fitted.diffusion == pytest.approx(diffusion, rel=1e-6)
    assert samples.residual == pytest.approx(0.0, abs=1e-9)


def test_tokens_per_second_and_mfu_beside_the_predicted_step() -> None:
    """The synthetic step's forward gathers every weight once (its parameters) and reads one integer input of
    ``tokens`` ids: tokens/s = tokens / step, MFU = 6 N tokens / (step x the bf16 peak when costed as bf16)."""
    import torch

    step = captured_step([[2, 1], [1]])
    hw = load_hardware("h100_nvlink")
    sim = compare(step, [{"strategy": "none"}], hardware=hw, world_size=8, as_dtype=torch.bfloat16,
                  pricing={"tokens": 4096}).rows[0].simulation
    params = sim.model_params
    assert params == (2 + 1 + 1) * 2 * 4  # shard rows x the traced world size 2 x DIM 4 (tests/support/synthetic.py)
    assert sim.tokens_per_second == pytest.approx(4096 / sim.step_seconds)
    assert sim.mfu == pytest.approx(6 * params * 4096 / (sim.step_seconds * 989e12))
    assert sim.peak_flops == 989e12


def test_the_optimizer_reads_and_writes_the_shard_once_after_the_backward() -> None:
    """AdamW: 28 bytes a parameter of this rank's shard at the achievable bandwidth, one launch, after every
    stream is idle; with clipping, 12 bytes more, two more passes and an all-reduce of the norm."""
    import torch

    step = captured_step([[2, 1], [1]])
    hw = hardware_from({**load_hardware("h100_nvlink").model_dump(), "skew": None})
    base = compare(step, [{"strategy": "none"}], hardware=hw, world_size=8, as_dtype=torch.bfloat16,
                   pricing={"tokens": 8}).rows[0].simulation
    adam = compare(step, [{"strategy": "none"}], hardware=hw, world_size=8, as_dtype=torch.bfloat16,
                   pricing={"tokens": 8, "optimizer": "adamw"}).rows[0].simulation
    shard = (2 + 1 + 1) * 2 * 4 // 8  # the model's 32 parameters over the 8 ranks predicted: what one rank updates
    assert adam.step_seconds - base.step_seconds == pytest.approx(28 * shard / (3.35e12 * 0.90) + 1e-6, rel=1e-9)
    clipped = compare(step, [{"strategy": "none"}], hardware=hw, world_size=8, as_dtype=torch.bfloat16,
                      pricing={"tokens": 8, "optimizer": "adamw", "grad_clip": True}).rows[0].simulation
    norm = 2e-6 + 4 / 275e9  # one fp32 all-reduced inside the node through NVLink SHARP
    assert clipped.step_seconds - base.step_seconds == pytest.approx(
        40 * shard / (3.35e12 * 0.90) + 3e-6 + norm, rel=1e-9)
