"""The step's kernels timed in turn (``overlapcfg.measuring.step_kernels``): which calls the census finds on a traced
graph, that a replay runs every call once a round on tensors of the traced layout, and the figures calibration takes
from the timings, each against a hand computation. Fast tier: a tiny make_fx graph and numbers."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from overlapcfg.measuring import calibration as cal
from overlapcfg.measuring import step_kernels
from overlapcfg.measuring.kernels import matmul_mix
from overlapcfg.measuring.step_kernels import (
    KernelCall,
    TensorSpec,
    in_turn_note,
    kernel_census,
    launch_beyond_bytes,
    matmul_layouts_in_turn,
    matmuls_in_turn,
    priced_in_turn,
    replayed,
    time_in_turn,
    views_in_turn,
)


def _step(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.mm(x, w.t())  # a transposed view, then a matmul reading it
    h = torch.nn.functional.silu(h)  # memory-bound
    h = h.view(4, 2, 8).sum(1)  # a view, then a reduction
    return torch.index_select(h, 0, idx), torch.mm(x, w.t())  # integer indices; the same matmul again


def _graph() -> torch.fx.GraphModule:
    return make_fx(_step)(torch.randn(4, 16), torch.randn(16, 16), torch.tensor([0, 3]))


def test_the_census_counts_each_distinct_call_in_the_order_the_graph_first_makes_it() -> None:
    calls, unreplayable = kernel_census([_graph()])
    assert unreplayable == 0
    ops = [(c.op, c.kind, n) for c, n in calls.items()]
    assert ops == [("aten.t.default", "view", 2), ("aten.mm.default", "compute", 2),
                   ("aten.silu.default", "memory", 1), ("aten.view.default", "view", 1),
                   ("aten.sum.dim_IntList", "memory", 1), ("aten.index_select.default", "memory", 1)]
    mm = next(c for c in calls if c.op == "aten.mm.default")
    assert mm.matmul == ((1, 4, 16, 16), "nt") and mm.dtype == torch.float32  # w.t() is read column-major
    assert mm.args[1] == TensorSpec((16, 16), (1, 16), 0, torch.float32)
    silu = next(c for c in calls if c.op == "aten.silu.default")
    assert silu.nbytes == 2 * 4 * 16 * 4  # reads and writes 4 x 16 floats
    assert matmul_mix([_graph()]).calls == calls  # the mix carries them to the ranks


def test_a_call_on_a_symbolic_size_is_counted_as_unreplayable() -> None:
    gm = make_fx(lambda x: torch.nn.functional.silu(x) * 2, tracing_mode="symbolic")(torch.randn(4, 8))
    calls, unreplayable = kernel_census([gm])
    assert unreplayable == 2 and not calls


def test_each_call_runs_once_a_round_in_order_and_a_refused_one_is_none() -> None:
    ran: list[str] = []
    lib = torch.library.Library("overlapcfg_test_turns", "DEF")  # the ops live as long as it does
    lib.define("first(Tensor x) -> Tensor")
    lib.define("second(Tensor x) -> Tensor")
    lib.define("refuses(Tensor x) -> Tensor")

    def recorded(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def impl(x: torch.Tensor) -> torch.Tensor:
            ran.append(name)
            return x.clone()

        return impl

    lib.impl("first", recorded("first"), "CPU")
    lib.impl("second", recorded("second"), "CPU")

    def refuse(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("made-up values")

    lib.impl("refuses", refuse, "CPU")
    arg = (TensorSpec((3,), (1,), 0, torch.float32),)
    calls = [KernelCall(f"overlapcfg_test_turns.{name}.default", arg, (), "memory", 24)
             for name in ("first", "refuses", "second")]
    seconds = time_in_turn(calls, torch.device("cpu"), rounds=4).seconds
    assert seconds[1] is None and seconds[0] is not None and seconds[2] is not None
    assert ran == ["first", "second"] + ["first", "second"] * 4  # a try each, then 4 rounds in turn


def test_integer_arguments_are_zero_so_every_index_is_in_range() -> None:
    calls, _ = kernel_census([_graph()])
    seconds = time_in_turn(list(calls), torch.device("cpu"), rounds=3).seconds
    assert all(s is not None and s > 0 for s in seconds)  # index_select ran on zero indices


def test_the_launch_cost_makes_the_memory_kernels_sum_to_their_time_in_turn() -> None:
    # 10 calls of 1 MB at 40 us each, 2 calls of 4 MB at 100 us, a view and a matmul ignored, one untimed call.
    # At 1e11 B/s the bytes take 10 and 40 us: (10 x 30 + 2 x 60) / 12 = 35 us beyond the bytes per kernel.
    calls = [KernelCall("a", (), (), "memory", 10**6), KernelCall("b", (), (), "memory", 4 * 10**6),
             KernelCall("v", (), (), "view", 0), KernelCall("m", (), (), "compute", 10**9),
             KernelCall("c", (), (), "memory", 10**6)]
    launch = launch_beyond_bytes(calls, [10, 2, 50, 3, 7], [40e-6, 100e-6, 1e-6, 1.0, None], bandwidth=1e11)
    assert launch == pytest.approx(35e-6)
    assert launch_beyond_bytes(calls[2:4], [1, 1], [1e-6, 1.0], bandwidth=1e11) is None
    assert launch_beyond_bytes(calls[:1], [1], [5e-6], bandwidth=1e11) == 0.0  # never below zero


def test_views_and_each_dtypes_matmuls_come_from_the_turns() -> None:
    mm_nt = KernelCall("aten.mm.default", (), (), "compute", 0, ((1, 8, 8, 8), "nt"), torch.float32)
    mm_nn = _mm(((1, 8, 8, 8), "nn"), torch.float32, "x")
    mm_bf16 = _mm(((1, 8, 8, 8), "nt"), torch.bfloat16, "y")
    view_a, view_b = KernelCall("aten.view.default", (), (), "view", 0), KernelCall("aten.t.default", (), (), "view", 0)
    shape, other = (1, 8, 8, 8), (1, 4, 4, 4)
    in_turn = ([mm_nt, mm_nn, mm_bf16, view_a, view_b], [3, 1, 2, 30, 10], [30e-6, 99e-6, 50e-6, 2e-6, 6e-6])
    matmuls, replaced = matmuls_in_turn(in_turn, [shape, other], {shape: "nt"},
                                        {torch.float32: [10e-6, 5e-6], torch.bfloat16: [20e-6, 7e-6]})
    # each dtype takes its own calls of the shape in the layout it was timed in (the nn call is another kernel);
    # the other shape keeps its back-to-back times
    assert matmuls == {torch.float32: [30e-6, 5e-6], torch.bfloat16: [50e-6, 7e-6]} and replaced == 2
    assert views_in_turn(in_turn) == pytest.approx((30 * 2e-6 + 10 * 6e-6) / 40)
    assert views_in_turn(((), (), ())) is None


def test_a_gpu_replays_nothing_and_counts_nothing_as_left_out() -> None:
    mix = matmul_mix([_graph()])
    gpu = SimpleNamespace(cuda=True)
    assert cal._in_turn(mix, gpu, 1.0) == (((), (), ()), 1.0)  # type: ignore[arg-type]
    assert cal._left_out(mix, ((), (), ()), gpu) == 0  # type: ignore[arg-type]
    assert Counter(c.kind for c in mix.calls) == Counter({"memory": 3, "view": 2, "compute": 1})


def _mm(matmul: tuple[tuple[int, int, int, int], str], dtype: torch.dtype, tag: str) -> KernelCall:
    """A matmul call told apart from others of its kernel by a made-up argument (another signature, one kernel)."""
    return KernelCall("aten.mm.default", (("value", "str", tag),), (), "compute", 0, matmul, dtype)


def _sized(name: str, elements: int) -> KernelCall:
    return KernelCall(name, (TensorSpec((elements,), (1,), 0, torch.float32),), (), "memory", 8 * elements)


def test_the_replay_keeps_the_most_frequent_calls_within_its_caps_in_the_steps_order() -> None:
    a, b, c, d = _sized("a", 100), _sized("b", 1000), _sized("c", 10), _sized("d", 50)
    assert b.input_bytes() == 4000  # one float32 argument of 1000 elements
    strided = KernelCall("t", (TensorSpec((4, 3), (1, 8), 2, torch.bfloat16),), (), "view", 0)
    assert strided.input_bytes() == (2 + 3 * 1 + 2 * 8 + 1) * 2  # offset + the last element reached, 2 bytes each
    calls = Counter({a: 5, b: 1, c: 9, d: 2})
    assert replayed(calls) == [a, b, c, d]
    assert replayed(calls, max_calls=2) == [a, c]  # the two most frequent, in the step's order
    # 400 + 40 + 200 bytes fit in 700; b's 4000 do not, and is left out, not the calls after it
    assert replayed(calls, max_bytes=700) == [a, c, d]


def test_the_profiles_note_says_what_was_replayed_and_counts_what_was_not() -> None:
    mm = KernelCall("aten.mm.default", (), (), "compute", 0, ((1, 8, 8, 8), "nn"))
    view, mem = KernelCall("aten.view.default", (), (), "view", 0), _sized("aten.silu.default", 4)
    in_turn = ([mm, view, mem], [2, 5, 3], [1e-5, 2e-6, None])
    note = in_turn_note(in_turn, left_out=4, views=2e-6, back_to_back_views=1e-6, launch=3e-5,
                        back_to_back_launch=1e-6, matmuls=1)
    assert note is not None and "(1 views, 1 matmul and other compute)" in note
    assert "view_seconds 2 us (back to back 1 us)" in note and "launch_seconds 30 us" in note
    assert "1 timed matmul shape(s) at their times in turn" in note
    assert "7 of the step's kernel calls were not replayed" in note  # the 3 silu calls refused, 4 left out
    no_matmul = in_turn_note(in_turn, left_out=0, views=None, back_to_back_views=0.0, launch=None,
                             back_to_back_launch=0.0, matmuls=0)
    assert no_matmul is not None and "matmul shape" not in no_matmul  # said only where one was replaced
    everything_left_out = in_turn_note(((), (), ()), left_out=12, views=None, back_to_back_views=0.0, launch=None,
                                       back_to_back_launch=0.0, matmuls=0)
    assert everything_left_out is not None and "12 of the step's kernel calls were not replayed" in everything_left_out
    assert in_turn_note(((), (), ()), left_out=0, views=None, back_to_back_views=0.0, launch=None,
                        back_to_back_launch=0.0, matmuls=0) is None
    assert "CPU time" not in note  # an idle core: no share to speak of
    shared = in_turn_note(in_turn, left_out=0, views=None, back_to_back_views=0.0, launch=None,
                          back_to_back_launch=0.0, matmuls=0, cpu_share=1.9)
    assert shared is not None and "each at its CPU time x 1.90 (the replay's wall over CPU time" in shared


def test_beside_another_job_each_call_is_priced_at_the_replays_share_of_the_core() -> None:
    # A 4 ms call absorbs a 4 ms slice another job took in one of its three rounds; a 10 us call, run as often,
    # never does: its wall median is its idle-core time. Summed: 12 + 0.03 ms of CPU in 16 + 0.03 ms of wall, a
    # share of 16.03 / 12.03; the short call is priced at 10 us x that share, the long one at 4 ms x it.
    walls = [[4e-3, 8e-3, 4e-3], [10e-6, 10e-6, 10e-6], []]
    cpus = [[4e-3, 4e-3, 4e-3], [10e-6, 10e-6, 10e-6], []]
    share = 16.03e-3 / 12.03e-3
    priced = priced_in_turn(walls, cpus, single_thread=True)
    assert priced.cpu_share == pytest.approx(share)
    assert priced.seconds[0] == pytest.approx(4e-3 * share) and priced.seconds[1] == pytest.approx(10e-6 * share)
    assert priced.seconds[2] is None  # not timed
    # with more intra-op threads the calling thread's CPU clock misses the others' work: the wall medians are kept
    threaded = priced_in_turn(walls, [[1e-3] * 3, [5e-6] * 3, []], single_thread=False)
    assert threaded.cpu_share == 1.0 and threaded.seconds[:2] == [4e-3, 10e-6]
    # an idle core: CPU and wall agree (the CPU clock's own rounding never makes the share drop below 1)
    idle = priced_in_turn([[1e-3]], [[1.00001e-3]], single_thread=True)
    assert idle.cpu_share == 1.0 and idle.seconds[0] == pytest.approx(1.00001e-3)


class _ScriptedClocks:
    """A wall clock and a CPU clock that move only when a test op says so: a replay's prices by hand."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0

    def perf_counter(self) -> float:
        return self.wall

    def thread_time(self) -> float:
        return self.cpu


@pytest.mark.parametrize("threads", [1, 2])
def test_the_replay_reads_the_cpu_clock_around_each_call_and_prices_it_at_the_share(
        threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # "busy" runs 1 ms on the core; "descheduled" is 3 ms of wall with no CPU (the core went to another job). Each
    # round is then 4 ms of wall for 1 ms of CPU: a share of 4, the busy call priced at 1 ms x 4 and the other at
    # its 0 ms of CPU. With two intra-op threads the wall medians stand (1 and 3 ms) at a share of 1.
    clocks = _ScriptedClocks()
    monkeypatch.setattr(step_kernels, "time", clocks)
    lib = torch.library.Library("overlapcfg_test_share", "DEF")  # the ops live as long as it does
    lib.define("busy(Tensor x) -> Tensor")
    lib.define("descheduled(Tensor x) -> Tensor")

    def busy(x: torch.Tensor) -> torch.Tensor:
        clocks.wall += 1e-3
        clocks.cpu += 1e-3
        return x.clone()

    def descheduled(x: torch.Tensor) -> torch.Tensor:
        clocks.wall += 3e-3
        return x.clone()

    lib.impl("busy", busy, "CPU")
    lib.impl("descheduled", descheduled, "CPU")
    arg = (TensorSpec((3,), (1,), 0, torch.float32),)
    calls = [KernelCall(f"overlapcfg_test_share.{name}.default", arg, (), "memory", 24)
             for name in ("busy", "descheduled")]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        turns = time_in_turn(calls, torch.device("cpu"), rounds=3)
    finally:
        torch.set_num_threads(before)
    if threads == 1:
        assert turns.cpu_share == pytest.approx(4.0)
        assert turns.seconds == [pytest.approx(4e-3), pytest.approx(0.0)]
    else:
        assert turns.cpu_share == 1.0
        assert turns.seconds == [pytest.approx(1e-3), pytest.approx(3e-3)]


def test_in_place_collective_and_random_ops_are_not_replayed() -> None:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        y.copy_(x)  # writes an argument
        return torch.nn.functional.dropout(x, 0.5, training=True) + y  # a random op

    gm = make_fx(step)(torch.randn(4), torch.randn(4))
    calls, unreplayable = kernel_census([gm])
    ops = {c.op for c in calls}
    assert "aten.copy_.default" not in ops and not any("bernoulli" in o or "dropout" in o for o in ops)
    assert unreplayable >= 2


def test_a_replay_leaves_the_random_state_as_it_was_and_a_later_failure_drops_the_call() -> None:
    lib = torch.library.Library("overlapcfg_test_later", "DEF")  # the ops live as long as it does
    lib.define("flaky(Tensor x) -> Tensor")
    calls_made = [0]

    def flaky(x: torch.Tensor) -> torch.Tensor:
        calls_made[0] += 1
        if calls_made[0] == 3:
            raise RuntimeError("fails on its third call")
        return x.clone()

    lib.impl("flaky", flaky, "CPU")
    arg = (TensorSpec((3,), (1,), 0, torch.float32),)
    good = _sized("aten.silu.default", 8)
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    seconds = time_in_turn([KernelCall("overlapcfg_test_later.flaky.default", arg, (), "memory", 24), good],
                           torch.device("cpu"), rounds=5).seconds
    assert torch.equal(torch.random.get_rng_state(), state)
    assert seconds[0] is None and seconds[1] is not None  # failed in round 2: dropped, its samples too
    assert calls_made[0] == 3


def test_the_replay_stops_at_its_budget_after_at_least_one_round() -> None:
    lib = torch.library.Library("overlapcfg_test_budget", "DEF")  # the ops live as long as it does
    lib.define("counted(Tensor x) -> Tensor")
    rounds = [0]
    lib.impl("counted", lambda x: rounds.__setitem__(0, rounds[0] + 1) or x.clone(), "CPU")
    arg = (TensorSpec((3,), (1,), 0, torch.float32),)
    seconds = time_in_turn([KernelCall("overlapcfg_test_budget.counted.default", arg, (), "memory", 24)],
                           torch.device("cpu"), rounds=10, budget_s=0.0).seconds
    assert seconds[0] is not None and rounds[0] == 2  # the first call (a try), then one round


def test_every_layout_the_step_runs_a_shape_in_is_its_own_timed_kernel() -> None:
    shape = (1, 8, 8, 8)
    nt_a = KernelCall("aten.mm.default", (), (), "compute", 0, (shape, "nt"), torch.float32)
    nt_b = _mm((shape, "nt"), torch.float32, "b")
    tn = _mm((shape, "tn"), torch.float32, "c")
    untimed = _mm(((1, 2, 2, 2), "nn"), torch.float32, "d")
    view = KernelCall("aten.view.default", (), (), "view", 0)
    found = matmul_layouts_in_turn(([nt_a, nt_b, tn, untimed, view], [1, 3, 2, 5, 9], [10e-6, 30e-6, 7e-6, None, 1e-6]))
    # two signatures of one (shape, layout): count-weighted, (1 x 10 + 3 x 30) / 4 = 25 us
    assert found == {torch.float32: {(shape, "nt"): pytest.approx(25e-6), (shape, "tn"): 7e-6}}
