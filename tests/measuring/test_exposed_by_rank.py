"""Exposed communication per rank in ``measure``: when one rank waits much longer than another, the ranks ran at
different speeds and the faster waited for the slower; the table says so (``MeasuredConfig.uneven_exposed``),
naming the configs and each rank's number, and ``measure.json`` keeps them.

Fast tier: made-up measurements, with the numbers profiled on 2 gloo ranks (``UNEVEN_EXPOSED``).
"""

from __future__ import annotations

from typing import Any

import pytest

import overlapcfg
from overlapcfg.measuring.measure_result import UNEVEN_EXPOSED, MeasuredConfig, Measurement


def _config(name: str, by_rank: tuple[float, ...]) -> MeasuredConfig:
    row: dict[str, Any] = {"overrides": {}, "config": {}, "predicted_step_s": 0.2, "predicted_exposed_s": 0.013,
                           "measured_step_s": 0.24, "measured_spread_s": 0.01, "measured_wall_s": 0.25,
                           "measured_profiled_step_s": 0.25, "step_seconds": (0.24,)}
    mean = sum(by_rank) / len(by_rank) if by_rank else 0.0
    return MeasuredConfig(name=name, measured_exposed_s=mean, measured_exposed_by_rank_s=by_rank, **row)


def _measurement(*configs: MeasuredConfig) -> Measurement:
    return Measurement(hardware=overlapcfg.load_hardware("cpu_gloo"), world_size=2, backend="gloo", device="cpu",
                       date="2026-12-07", torch_version="2.13.0", warmup=1, steps=1, profiled_steps=6,
                       configs=configs)


@pytest.mark.parametrize(("by_rank", "uneven"), [
    ((0.0444, 0.0249), True),   # d1 beside another job: 1.78x, 19.5 ms apart
    ((0.0174, 0.0124), False),  # d1 quiet: 1.40x
    ((0.1593, 0.1842), False),  # none beside another job: 1.16x
    ((0.0009, 0.0001), False),  # 9x, but 0.8 ms apart: noise
    ((0.003, 0.0015), True),    # exactly 2x and 1.5 ms apart
    ((0.003, 0.002), True),     # exactly UNEVEN_EXPOSED times, 1 ms apart
    ((0.0444,), False),         # one rank: nothing to compare
    ((), False),                # a measurement written before the field existed
])
def test_a_rank_waiting_much_longer_than_another_is_uneven(by_rank: tuple[float, ...], uneven: bool) -> None:
    assert UNEVEN_EXPOSED == 1.5
    assert _config("d1", by_rank).uneven_exposed() is uneven


def test_the_table_names_the_uneven_configs_with_each_ranks_exposed_communication() -> None:
    text = " ".join(str(_measurement(_config("none", (0.1593, 0.1842)), _config("d1", (0.0444, 0.0249)))).split())
    assert "the ranks waited unequally (exposed communication of rank 0 / rank 1 / ...): d1 44.4 / 24.9 ms." in text
    assert "none 159.3" not in text  # even: not named
    assert "waiting for a slower one" in text and "mean of the ranks" in text


def test_even_ranks_print_no_such_line_and_the_json_keeps_each_rank() -> None:
    m = _measurement(_config("d1", (0.0174, 0.0124)))
    assert "waited unequally" not in str(m)
    back = Measurement.from_json(m.to_json())
    assert back.configs[0].measured_exposed_by_rank_s == (0.0174, 0.0124)


def test_the_table_says_where_each_configs_exposed_communication_was_measured() -> None:
    timed = _config("d1", (0.0174, 0.0124)).model_copy(update={"measured_exposed_in": "timed steps"})
    wrapped = _config("deps", (0.0174, 0.0124))  # waits wrapped by insert_overlap_deps: the profiler's figure
    one = " ".join(str(_measurement(timed)).split())
    assert "exposed: collective time the compute thread or stream waited for, in the timed steps." in one
    both = " ".join(str(_measurement(timed, wrapped)).split())
    assert "waited for, in the timed steps for d1; in the profiled steps for deps." in both
    with pytest.raises(ValueError, match="measured_exposed_in"):  # only the two places it can come from
        MeasuredConfig.model_validate({**timed.model_dump(), "measured_exposed_in": "somewhere"})
