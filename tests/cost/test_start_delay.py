"""A collective that starts on an idle link while compute runs sits for the calibrated start delay
(``Contention.start_delay``) before it moves, pinned on hand computations: the delay elapses only while compute
runs and ends the moment the compute stream blocks; a collective queued behind another pays it again if it starts
while compute runs, and none if it starts while compute waits; compute is not
slowed by a collective that has not moved yet; pricing carries the link's delay whole, whatever the size; the
calibration keeps the mean of the rank whose runs sat longest; a delay above a second names the file and field.

Fast tier: the replay's streams, made-up timings and YAML files in a temporary directory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from overlapcfg.cost.hardware import HardwareProfile, load_hardware
from overlapcfg.cost.price import collective_cost
from overlapcfg.cost.replay import Streams
from overlapcfg.errors import OverlapConfigError
from overlapcfg.measuring.contention import ContentionTimings, contention_fit

MS = 1e-3
DELAY = (0.0, 0.0, 3 * MS)
"""No slowdowns, a 3 ms start delay."""


def test_a_collective_started_under_compute_moves_after_the_delay_and_hides_under_long_compute() -> None:
    s = Streams()
    s.issue("a", "comm:0", 1 * MS, slowdown=DELAY, ranks=2)
    s.run(10 * MS)
    assert s.wait("a") == 0.0
    assert s.spans["a"] == pytest.approx((0.0, 4 * MS))  # started at 0, moved at 3 ms, 1 ms of work
    assert s.delayed == pytest.approx(3 * MS) and s.t == pytest.approx(10 * MS)


def test_the_delay_ends_when_compute_blocks_on_the_collective() -> None:
    s = Streams()
    s.issue("a", "comm:0", 1 * MS, slowdown=DELAY, ranks=2)
    s.run(2 * MS)
    assert s.wait("a") == pytest.approx(1 * MS)  # moves at 2 ms, when the wait frees the core, at full speed
    assert s.spans["a"] == pytest.approx((0.0, 3 * MS))
    assert s.delayed == pytest.approx(2 * MS)  # only the part that elapsed is charged


def test_a_collective_queued_behind_another_waits_for_a_core_again_when_it_starts_under_compute() -> None:
    """``b`` starts at 4 ms, when ``a`` ends, with compute running: its delay runs until compute blocks at 4.5 ms
    (half a millisecond of it), then it moves at full speed and ends at 5.5 ms."""
    s = Streams()
    s.issue("a", "comm:0", 1 * MS, slowdown=DELAY, ranks=2)
    s.issue("b", "comm:0", 1 * MS, slowdown=DELAY, ranks=2)
    s.run(4.5 * MS)
    assert s.wait("a") == 0.0
    assert s.wait("b") == pytest.approx(1 * MS)
    assert s.spans["a"] == pytest.approx((0.0, 4 * MS)) and s.spans["b"] == pytest.approx((4 * MS, 5.5 * MS))
    assert s.delayed == pytest.approx(3.5 * MS)
    s.run(1 * MS)  # the link is idle again: the next collective waits anew
    s.issue("c", "comm:0", 1 * MS, slowdown=DELAY, ranks=2)
    s.run(5 * MS)
    s.wait("c")
    assert s.spans["c"] == pytest.approx((6.5 * MS, 10.5 * MS)) and s.delayed == pytest.approx(6.5 * MS)


def test_where_a_queued_collective_starts_is_projected_with_the_delays_of_those_ahead() -> None:
    """Under compute: ``a`` moves at 3 ms and ends at 4; ``b`` starts at 4, waits 3 ms, ends at 8; ``c`` is issued
    to start at 8, and does (then waits 3 ms and ends at 12)."""
    s = Streams()
    s.issue("a", "comm:0", 1 * MS, slowdown=DELAY, ranks=2)
    s.issue("b", "comm:0", 1 * MS, slowdown=DELAY, ranks=2)
    assert s.issue("c", "comm:0", 1 * MS, slowdown=DELAY, ranks=2) == pytest.approx(8 * MS)
    s.run(20 * MS)
    assert [s.wait(t) for t in "abc"] == [0.0, 0.0, 0.0]
    assert s.spans["b"] == pytest.approx((4 * MS, 8 * MS)) and s.spans["c"] == pytest.approx((8 * MS, 12 * MS))
    assert s.delayed == pytest.approx(9 * MS)


def test_a_collective_queued_behind_another_that_starts_while_compute_waits_pays_no_delay() -> None:
    """Compute blocks on ``a`` at 2 ms (``a`` moves then, ends at 3 ms); ``b`` starts at 3 ms, inside that wait, with
    the cores free: it moves at once."""
    s = Streams()
    s.issue("a", "comm:0", 1 * MS, slowdown=DELAY, ranks=2)
    s.issue("b", "comm:0", 1 * MS, slowdown=DELAY, ranks=2)
    s.run(2 * MS)
    assert s.wait("a") == pytest.approx(1 * MS)
    assert s.wait("b") == pytest.approx(1 * MS)
    assert s.spans["b"] == pytest.approx((3 * MS, 4 * MS)) and s.delayed == pytest.approx(2 * MS)


def test_compute_is_slowed_only_once_the_collective_moves() -> None:
    s = Streams()
    s.issue("a", "comm:0", 1 * MS, slowdown=(1.0, 0.0, 3 * MS), ranks=2)
    s.run(5 * MS)
    # 0-3 ms: full speed (3 ms of work); 3-4 ms: half speed (0.5 ms); the last 1.5 ms alone
    assert s.t == pytest.approx(5.5 * MS) and s.contended == pytest.approx(0.5 * MS)
    assert s.spans["a"] == pytest.approx((0.0, 4 * MS))


def test_a_delayed_collective_that_compute_slows_moves_at_its_slowed_rate_then_full_speed_when_waited() -> None:
    slowed = (0.0, 1.0, 3 * MS)
    s = Streams()
    s.issue("a", "comm:0", 1 * MS, slowdown=slowed, ranks=2)
    s.run(10 * MS)
    s.wait("a")
    assert s.spans["a"] == pytest.approx((0.0, 5 * MS))  # moves at 3 ms at half speed: 2 ms
    cut = Streams()
    cut.issue("a", "comm:0", 1 * MS, slowdown=slowed, ranks=2)
    cut.run(2 * MS)
    assert cut.wait("a") == pytest.approx(1 * MS)  # never moved under compute: all of it after the wait


def test_pricing_carries_the_links_delay_whole_at_every_size() -> None:
    data = load_hardware("cpu_gloo").model_dump(mode="json", exclude_none=True)
    data["contention"] = {"intra_node": {"compute_slowdown": 0.5, "comm_slowdown": 1.0, "start_delay": 0.002}}
    hw = HardwareProfile.model_validate(data)
    small, large = (collective_cost("all_gather", n, hw, 2) for n in (4096, 64 * 2**20))
    assert small.slowdown[2] == large.slowdown[2] == 0.002
    assert small.slowdown[1] < large.slowdown[1] <= 1.0  # the rates scale with the share spent moving bytes
    assert collective_cost("all_gather", 4096, load_hardware("cpu_gloo"), 2).slowdown == (0.0, 0.0, 0.0)


def _timings(delays: tuple[float, ...]) -> ContentionTimings:
    return ContentionTimings(group="world", inter_node=False, nbytes=2**20, comm=(0.04,) * 3, compute=(0.01,) * 3,
                             compute_under=(0.015,) * 3, blocked=(0.02,) * 3, delay_bytes=65536, delays=delays)


def test_calibration_keeps_the_mean_of_the_rank_whose_runs_sat_longest() -> None:
    fitted, samples = contention_fit([_timings((0.0, 0.004, 0.002)), _timings((0.003, 0.003, 0.006))])
    assert fitted.start_delay == pytest.approx(0.004)  # means 2 ms and 4 ms; not a median (3 ms)
    assert samples.start_delay_bytes == 65536 and samples.start_delay_seconds == (0.003, 0.003, 0.006)
    untimed, record = contention_fit([_timings(())])  # as on CUDA: nothing timed, no delay
    assert untimed.start_delay == 0.0 and record.start_delay_seconds == ()


def test_a_delay_above_a_second_names_the_file_and_the_field(tmp_path: Path) -> None:
    data = load_hardware("cpu_gloo").model_dump(mode="json", exclude_none=True)
    data["contention"] = {"intra_node": {"compute_slowdown": 0.5, "comm_slowdown": 1.0, "start_delay": 3.0}}
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(OverlapConfigError) as err:
        load_hardware(path)
    assert str(path) in str(err.value) and "contention.intra_node.start_delay" in str(err.value)
