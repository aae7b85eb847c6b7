"""The placement rule and the simulator's streams, on abstract positions: what the scheduler and the tuner's quick
model share (``overlapcfg.graph.placement``, ``overlapcfg.cost.replay``). Torch-free and fast."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import get_args

import pytest

from overlapcfg.config.policy import IssueOrder
from overlapcfg.cost.replay import Memory, Streams
from overlapcfg.graph.placement import (
    Delay,
    DelayedStep,
    GatherStep,
    Placement,
    in_schedule_order,
    place_all_gathers,
    place_delayed,
)
from overlapcfg.graph.schedule import schedule_manual
from overlapcfg.tuning.quick import score


def _emit(nodes: Sequence[str], moved: dict[str, Placement] | dict[str, Delay]) -> list[str]:
    """``nodes`` (at positions 0, 1, ...) sorted by their keys: a moved node's placement key, else its position."""
    def key(item: tuple[int, str]) -> tuple[float, int, int]:
        position, name = item
        placed = moved.get(name)
        return (position, 0, 0) if placed is None or placed.key is None else placed.key
    return [name for _, name in sorted(enumerate(nodes), key=key)]


def _forward(depth: int) -> list[str]:
    """``ag_i w_i c_i`` per bucket, three buckets, every bucket asking for ``depth``."""
    nodes = [f"{kind}{i}" for i in range(3) for kind in ("ag", "w", "c")]
    steps = [GatherStep(i, f"b{i}", 1, start=nodes.index(f"ag{i}"), wait=nodes.index(f"w{i}")) for i in range(3)]
    placed = place_all_gathers(steps, [depth] * 3, None, first_compute=nodes.index("c0"))
    return _emit(nodes, {f"ag{i}": p for i, p in enumerate(placed)})


@pytest.mark.parametrize("depth, expected", [
    (0, "ag0 w0 c0 ag1 w1 c1 ag2 w2 c2"),
    (1, "ag0 ag1 w0 c0 ag2 w1 c1 w2 c2"),
    (2, "ag0 ag1 ag2 w0 c0 w1 c1 w2 c2"),
])
def test_all_gathers_are_placed_before_the_wait_of_the_bucket_whose_reach_covers_them(depth: int,
                                                                                       expected: str) -> None:
    assert " ".join(_forward(depth)) == expected


def test_a_prefetched_all_gather_depends_on_nothing_after_its_issuers_wait() -> None:
    nodes = ["ag0", "w0", "c0", "ag1", "w1", "c1"]
    steps = [GatherStep(0, "b0", 1, 0, 1), GatherStep(1, "b1", 1, 3, 4)]
    first, second = place_all_gathers(steps, [1, 1], None, first_compute=nodes.index("c0"))
    assert first.key is None  # issued by the graph before the first compute already: left there
    assert second == Placement((1, -1, 1), before=1)  # w0 must run after it


def test_the_first_all_gather_is_hoisted_before_the_first_compute_when_the_graph_issues_it_later() -> None:
    steps = [GatherStep(0, "b0", 1, start=5, wait=6)]
    (placed,) = place_all_gathers(steps, [1], None, first_compute=2)
    assert placed.key == (2, -1, 0)


def test_a_cap_lowers_the_reach() -> None:
    steps = [GatherStep(i, f"b{i}", 10, 3 * i, 3 * i + 1) for i in range(3)]
    uncapped = place_all_gathers(steps, [2] * 3, None, first_compute=2)
    capped = place_all_gathers(steps, [2] * 3, 20, first_compute=2)
    assert uncapped[2].key == (1, -1, 2)  # before w0
    assert capped[2].key == (4, -1, 2)  # two buckets fit: before w1


def _backward(order: IssueOrder) -> list[str]:
    """``ag_i w_i c_i rs_i`` per bucket, six buckets, backward prefetch 2 (as ``overlapcfg.graph.placement``)."""
    nodes = [f"{kind}{i}" for i in range(6) for kind in ("ag", "w", "c", "rs")]
    steps = [GatherStep(i, f"b{i}", 1, nodes.index(f"ag{i}"), nodes.index(f"w{i}")) for i in range(6)]
    scatters = [nodes.index(f"rs{i}") for i in range(6)]
    placed = place_all_gathers(steps, [2] * 6, None, first_compute=nodes.index("c0"), issue_order=order,
                               scatters=scatters)
    return _emit(nodes, {f"ag{i}": p for i, p in enumerate(placed)})


def test_reduce_scatter_first_issues_a_far_prefetch_after_the_next_reduce_scatter() -> None:
    gather_first, scatter_first = " ".join(_backward("gather_first")), " ".join(_backward("reduce_scatter_first"))
    assert "ag3 w1 c1 rs1 ag4 w2 c2 rs2" in gather_first
    assert "w1 c1 rs1 ag3 w2 c2 rs2 ag4" in scatter_first


def test_reduce_scatter_waits_are_placed_after_the_start_of_the_bucket_d_later() -> None:
    nodes = [f"{kind}{i}" for i in (2, 1, 0) for kind in ("c", "rs", "w")]
    steps = [DelayedStep(i, f"b{i}", nodes.index(f"rs{i}"), nodes.index(f"rs{i}"), None) for i in (2, 1, 0)]
    placed = place_delayed(steps, [1, 1, 1])
    assert " ".join(_emit(nodes, {f"w{i}": p for i, p in zip((2, 1, 0), placed, strict=True)})) == \
        "c2 rs2 c1 rs1 w2 c0 rs0 w1 w0"
    assert [(p.effective, p.reason) for p in placed] == [(1, None), (1, None), (0, "end of graph")]
    assert [p.after for p in placed] == [4, 7, None]  # each moved wait runs after that start


def test_a_reader_of_the_gradient_cuts_the_delay_short() -> None:
    steps = [DelayedStep(0, "b0", 1, 1, consumer=5), DelayedStep(1, "b1", 4, 4, None),
             DelayedStep(2, "b2", 7, 7, None)]
    first = place_delayed(steps, [2, 0, 0])[0]
    assert (first.key, first.effective, first.reason) == ((4, 1, 0), 1, "a consumer of the result needs it earlier")


def test_steps_are_numbered_by_first_wait_or_first_start() -> None:
    gathers = [(GatherStep(0, "a", 1, start=0, wait=9), "a"), (GatherStep(1, "b", 1, start=1, wait=4), "b")]
    delayed = [(DelayedStep(0, "a", 6, 6, None), "a"), (DelayedStep(1, "b", 2, 8, None), "b")]
    assert [x for _, x in in_schedule_order(gathers)] == ["b", "a"]
    assert [x for _, x in in_schedule_order(delayed)] == ["b", "a"]


def test_collectives_queue_on_their_stream_and_waits_block_compute() -> None:
    streams = Streams()
    assert streams.issue("a", "comm:0", 3.0, inflight_bytes=10) == 0.0
    assert streams.issue("b", "comm:0", 2.0, issue_seconds=1.0, inflight_bytes=5) == 3.0  # behind a
    assert streams.issue("c", "comm:1", 2.0) == 1.0  # its own stream is free
    assert streams.peak_inflight == 15
    streams.run(1.0)
    assert streams.wait("a") == 1.0  # compute at 2, a done at 3
    assert streams.wait("never issued") == 0.0
    assert streams.wait("c") == 0.0  # done at 3 already
    assert (streams.t, streams.exposed, streams.compute, streams.inflight) == (3.0, 1.0, 2.0, 5)
    assert streams.end_graph() == 5.0  # b ends at 5
    assert streams.busy == {"comm:0": 5.0, "comm:1": 2.0}


def test_memory_keeps_the_peak_of_each_category() -> None:
    memory = Memory()
    memory.alloc(4, True)
    memory.alloc(3, False)
    memory.free(4, True)
    memory.alloc(2, True)
    assert (memory.param, memory.peak_param, memory.act, memory.peak_act) == (2, 4, 3, 3)


def test_the_quick_score_defaults_to_the_schedulers_issue_order() -> None:
    """It defaulted to ``"as_reached"``, which is not an ``IssueOrder``."""
    default = inspect.signature(score).parameters["issue_order"].default
    assert default in get_args(IssueOrder)
    assert default == inspect.signature(schedule_manual).parameters["issue_order"].default
