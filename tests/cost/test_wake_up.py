"""A collective that starts on a link idle for a while pays the calibrated wake-up (``Skew.wake``), pinned on hand
computations: the points are interpolated linearly, flat beyond the last; the replay charges a collective by the
time its own stream sat idle, and nothing to one queued right behind another; a profile whose points are out of
order names the file and the field.

Fast tier: the replay's streams and YAML files in a temporary directory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from overlapcfg.cost.achievable import Skew, WakePoint
from overlapcfg.cost.hardware import load_hardware
from overlapcfg.cost.replay import Streams
from overlapcfg.errors import OverlapConfigError

WAKE = (WakePoint(idle=0.0, extra=0.0), WakePoint(idle=0.002, extra=1e-4), WakePoint(idle=0.01, extra=3e-4))


@pytest.mark.parametrize("idle, extra", [(0.0, 0.0), (0.001, 5e-5), (0.002, 1e-4), (0.006, 2e-4), (0.01, 3e-4),
                                         (5.0, 3e-4)])
def test_the_wake_up_is_linear_between_measured_points_and_flat_beyond_the_last(idle: float, extra: float) -> None:
    assert Skew(relative=0.0, wake=WAKE).wake_seconds(idle) == pytest.approx(extra, abs=1e-12)


def test_without_points_nothing_is_charged() -> None:
    assert Skew(relative=0.0).wake_seconds(1.0) == 0.0


def test_a_collective_pays_for_the_time_its_own_stream_sat_idle_and_not_when_queued_behind_another() -> None:
    s = Streams(Skew(relative=0.0, wake=WAKE))
    s.run(0.006)  # the stream has been idle since the step began: 6 ms -> 0.2 ms more
    assert s.issue("a", "comm:0", 0.001, ranks=2) == pytest.approx(0.006)
    s.issue("b", "comm:0", 0.001, ranks=2)  # queued behind "a": starts as it ends, no wake-up
    s.wait("b")
    assert s.spans["a"] == pytest.approx((0.006, 0.0072))
    assert s.spans["b"] == pytest.approx((0.0072, 0.0082))
    s.run(0.001)  # 1 ms idle since "b" ended -> 0.05 ms more
    s.issue("c", "comm:0", 0.001, ranks=2)
    s.wait("c")
    assert s.spans["c"] == pytest.approx((0.0092, 0.0092 + 0.001 + 5e-5))
    assert s.woken == pytest.approx(2e-4 + 5e-5)
    one = Streams(Skew(relative=0.0, wake=WAKE))
    one.run(0.006)
    one.issue("a", "comm:0", 0.001, ranks=1)  # one rank: no group to wake
    one.wait("a")
    assert one.spans["a"] == pytest.approx((0.006, 0.007)) and one.woken == 0.0


def test_wake_points_out_of_order_name_the_file_and_the_field(tmp_path: Path) -> None:
    data = load_hardware("cpu_gloo").model_dump(mode="json", exclude_none=True)
    data["skew"] = {"relative": 0.1, "wake": [{"idle": 0.01, "extra": 1e-4}, {"idle": 0.002, "extra": 2e-4}]}
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(OverlapConfigError) as err:
        load_hardware(path)
    message = str(err.value)
    assert str(path) in message and "skew.wake" in message
    assert "strictly increasing idle seconds, got 0.01, 0.002" in message


DELAY = (0.0, 0.0, 3e-3)
"""No slowdowns, a 3 ms start delay."""


def _after_idle(compute_after_issue: float) -> Streams:
    """6 ms of compute (the link idle since the step began: a 0.2 ms wake-up), then a 1 ms collective issued under
    compute with a 3 ms start delay, ``compute_after_issue`` more compute, and its wait."""
    s = Streams(Skew(relative=0.0, wake=WAKE))
    s.run(0.006)
    s.issue("a", "comm:0", 0.001, slowdown=DELAY, ranks=2)
    s.run(compute_after_issue)
    s.wait("a")
    return s


def test_a_start_delay_stands_for_the_wake_up_and_a_blocking_wait_still_pays_the_wake_up() -> None:
    """The start delay was measured after idling, so it already holds the wake-up: under long compute the
    collective sits 3 ms and runs 1 ms (no 0.2 ms more); blocked on at once, the delay ends but the wake-up does
    not: it moves at 6.2 ms; blocked on 0.1 ms after its start, at 6.2 ms still; 1 ms after, at once (its 0.2 ms
    woke while compute ran)."""
    long = _after_idle(0.010)
    assert long.spans["a"] == pytest.approx((0.006, 0.010)) and long.woken == 0.0
    assert long.delayed == pytest.approx(0.003)
    at_once = _after_idle(0.0)
    assert at_once.spans["a"] == pytest.approx((0.006, 0.0072))
    assert at_once.woken == pytest.approx(2e-4) and at_once.delayed == pytest.approx(0.0)
    soon = _after_idle(0.0001)
    assert soon.spans["a"] == pytest.approx((0.006, 0.0072))
    assert soon.woken == pytest.approx(1e-4) and soon.delayed == pytest.approx(1e-4)
    later = _after_idle(0.001)
    assert later.spans["a"] == pytest.approx((0.006, 0.008))
    assert later.woken == pytest.approx(0.0) and later.delayed == pytest.approx(0.001)


def test_compute_resuming_while_a_collective_still_wakes_slows_it_only_once_it_moves() -> None:
    """A 1 ms collective that compute slows 2x (``comm_slowdown`` 1) is issued after 6 ms idle, then compute blocks
    at once on a 0.1 ms collective of another stream: "a"'s delay ends and its wake-up runs to 6.2 ms; compute
    resumes at 6.1 ms, so "a" moves at 6.2 ms and its 1 ms of work takes 2 ms of clock: it ends at 8.2 ms."""
    s = Streams(Skew(relative=0.0, wake=WAKE))
    s.run(0.006)
    s.issue("a", "comm:0", 0.001, slowdown=(0.0, 1.0, 3e-3), ranks=2)
    s.issue("b", "comm:1", 0.0001, ranks=1)  # one rank: no wake-up, no delay; ends at 6.1 ms
    s.wait("b")  # compute stops at 6 ms: "a"'s delay ends, its wake-up runs until 6.2 ms
    assert s.t == pytest.approx(0.0061)
    s.run(0.01)  # compute resumes at 6.1 ms: "a" moves at 6.2 ms, at half speed, 2 ms of clock for 1 ms of work
    s.wait("a")
    assert s.spans["a"] == pytest.approx((0.006, 0.0082))
