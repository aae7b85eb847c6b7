"""The schedule fingerprint and the same-schedule check's exchange, without processes.

The fingerprint: what it compares (kinds, groups numbered by first appearance, sizes, reduce ops, buckets and their
packing order) and what it does not (node names, another group of the same role). The exchange: ranks simulated by
threads sharing one in-memory c10d store, as the ranks of a job share its TCPStore (``_Exchange`` is what each rank
runs once its groups are known), so the verdicts, the messages and the timeouts are checked in milliseconds. The same
on real gloo ranks, every route and every divergence source: ``tests/multiprocess/test_same_schedule.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch.distributed as dist

from overlapcfg import compat, load_config
from overlapcfg.errors import OverlapConfigError, SameScheduleError
from overlapcfg.graph.record import ScheduledCollective, ScheduleFingerprint, first_difference
from overlapcfg.graph.same_schedule import _Exchange, _GroupCheck, check_same_schedule
from overlapcfg.passes import apply
from tests.support.synthetic import backward_graph

GATHER = ScheduledCollective(kind="all_gather", op="_c10d_functional.all_gather_into_tensor_out", group="0",
                             group_size=4, tensors="(float32[64], 4, out=float32[256]) -> float32[256]",
                             bucket="layers.0", payload=("layers.0.wq.weight 512B", "layers.0.wk.weight 512B"),
                             node="all_gather_into_tensor_out")
SCATTER = ScheduledCollective(kind="reduce_scatter", op="_c10d_functional.reduce_scatter_tensor", group="0",
                              group_size=4, tensors="(float32[256], 4) -> float32[64]", reduce_op="sum",
                              bucket="layers.0", payload=("layers.0.wq.weight 512B",), node="reduce_scatter_tensor")
TP = ScheduledCollective(kind="all_reduce", op="_c10d_functional.all_reduce", group="tp_a", group_size=2,
                         tensors="(float32[8, 64]) -> float32[8, 64]", reduce_op="sum", node="all_reduce")


def _schedule(*collectives: ScheduledCollective, graph: str = "forward") -> ScheduleFingerprint:
    return ScheduleFingerprint(graph=graph, collectives=collectives)


def test_the_digest_ignores_node_names_and_which_group_of_a_role_a_rank_has() -> None:
    """Two data-parallel peers: the same collectives, traced under other node names, their tensor-parallel
    all-reduce on their own (different) tensor-parallel groups."""
    mine = _schedule(GATHER, TP, SCATTER)
    theirs = _schedule(GATHER.model_copy(update={"node": "all_gather_7"}),
                       TP.model_copy(update={"group": "tp_b", "node": "all_reduce_3"}), SCATTER)
    assert mine.digest() == theirs.digest() and first_difference(mine, theirs) is None


@pytest.mark.parametrize(("change", "position"), [
    ({"payload": ("layers.0.wk.weight 512B", "layers.0.wq.weight 512B")}, 0),  # packed in another order
    ({"tensors": "(float32[72], 4, out=float32[288]) -> float32[288]"}, 0),  # a parameter of another size
    ({"bucket": "layers.0-1"}, 0),
    ({"group_size": 2}, 0),
])
def test_the_digest_sees_every_difference_that_breaks_a_collective(change: dict[str, Any], position: int) -> None:
    mine = _schedule(GATHER, SCATTER)
    theirs = _schedule(GATHER.model_copy(update=change), SCATTER)
    assert mine.digest() != theirs.digest() and first_difference(mine, theirs) == position


def test_first_difference_of_another_order_a_prefix_and_another_graph() -> None:
    assert first_difference(_schedule(GATHER, SCATTER), _schedule(SCATTER, GATHER)) == 0
    assert first_difference(_schedule(GATHER, SCATTER), _schedule(GATHER)) == 1
    assert first_difference(_schedule(GATHER), _schedule(GATHER, graph="backward")) == -1
    # another group at the same place is a difference, though both are numbered g1 alone
    swapped = _schedule(GATHER, TP.model_copy(update={"group": "0", "group_size": 4}))
    assert first_difference(_schedule(GATHER, TP), swapped) == 1


def test_a_pass_records_its_graphs_schedule_with_buckets_and_parts_in_packing_order() -> None:
    syn = backward_graph([[2, 1], [1]], regather=True)
    # the packing order of a bucket's merged reduce-scatter: its gradients' reduce-scatters in graph order
    packed = [syn.owners[n.name] for n in syn.gm.graph.nodes
              if "reduce_scatter" in str(n.target) and syn.owners.get(n.name, "").startswith("layers.0.")]
    cfg = load_config({"plan": {"buckets": ["layers.*"]}})
    with compat.fake_process_group(2):
        gm = apply(syn.gm, cfg, graph_kind="backward", module_fqns=syn.module_fqns)
    schedule = gm.meta["overlapcfg"].schedule
    assert schedule.graph == "backward"
    kinds = [(c.kind, c.bucket, len(c.payload)) for c in schedule.collectives]
    assert sorted(kinds) == sorted([("all_gather", "layers.0", 2), ("all_gather", "layers.1", 1),
                                    ("reduce_scatter", "layers.0", 2), ("reduce_scatter", "layers.1", 1)])
    scatter = next(c for c in schedule.collectives if c.kind == "reduce_scatter" and c.bucket == "layers.0")
    assert scatter.reduce_op == "sum" and scatter.group == "0" and scatter.group_size == 2
    assert [p.split(" ")[0] for p in scatter.payload] == packed == ["layers.0.wk", "layers.0.wq"]
    assert all(p.endswith("B") for c in schedule.collectives for p in c.payload)  # each part's bytes
    head = f"schedule of the backward graph: 4 collectives, digest {schedule.digest()[:16]}"
    assert schedule.render().startswith(head)
    assert gm.meta["overlapcfg"].same_schedule == ""  # apply alone never checks: the routes do


@pytest.mark.parametrize(("enabled", "fake", "schedule", "outcome"), [
    (False, False, _schedule(GATHER), "off: check_same_schedule is false"),
    (True, False, _schedule(GATHER), "not checked: no process group"),
    (True, True, _schedule(GATHER), "not checked: fake process group (offline tracing: no other rank runs)"),
])
def test_where_no_other_rank_can_answer_the_check_says_why_and_waits_for_nobody(
        enabled: bool, fake: bool, schedule: ScheduleFingerprint, outcome: str) -> None:
    if fake:
        with compat.fake_process_group(4):
            assert check_same_schedule(schedule, enabled=enabled, timeout_s=1, where="test") == outcome
    else:
        assert check_same_schedule(schedule, enabled=enabled, timeout_s=1, where="test") == outcome


def test_the_timeout_is_validated_like_every_other_field() -> None:
    with pytest.raises(OverlapConfigError, match=r"overlap.same_schedule_timeout_s: expected seconds, a finite "
                                                 r"number from 1 to 86400"):
        load_config({"plan": "llama_layers", "same_schedule_timeout_s": 0})
    assert load_config({"plan": "llama_layers"}).same_schedule_timeout_s == 300


# --- the exchange, ranks as threads -------------------------------------------------------------------------------

def _exchange(schedules: dict[int, ScheduleFingerprint], members: Sequence[int],
              timeout_s: float = 10.0) -> dict[int, BaseException | None]:
    """Every rank of ``schedules`` runs check 0 on group '0' (``members``) at once; what each raised."""
    store = dist.HashStore()
    check = _GroupCheck("0", tuple(members), 0)
    raised: dict[int, BaseException | None] = {}

    def rank(r: int) -> None:
        try:
            _Exchange(store, r, schedules[r], timeout_s, "test").run([check])
            raised[r] = None
        except BaseException as err:  # handed to the test thread
            raised[r] = err

    threads = [threading.Thread(target=rank, args=(r,)) for r in schedules]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "the exchange hung"
    return raised


def test_equal_schedules_pass_on_every_rank() -> None:
    assert _exchange({r: _schedule(GATHER, SCATTER) for r in range(4)}, range(4)) == dict.fromkeys(range(4))


def test_a_difference_is_the_same_error_on_every_rank_naming_the_odd_rank_and_the_collective() -> None:
    """Rank 0 is the odd one: the message names it against the three that agree, not the other way round."""
    other = _schedule(GATHER, SCATTER.model_copy(update={"reduce_op": "avg"}))
    schedules = {r: (other if r == 0 else _schedule(GATHER, SCATTER)) for r in range(4)}
    raised = _exchange(schedules, range(4))
    messages = {str(e) for e in raised.values()}
    assert len(messages) == 1 and all(isinstance(e, SameScheduleError) for e in raised.values())
    assert all(e.ranks == (0,) and e.collective == 1 for e in raised.values())  # type: ignore[union-attr]
    (message,) = messages
    assert "check 0 on process group '0' of 4 ranks" in message
    assert "rank 0 differs from ranks 1, 2, 3:" in message
    assert "first difference at collective 1 (0-based; rank 1 issues 2, rank 0 issues 2)" in message
    assert "rank 1: reduce_scatter (_c10d_functional.reduce_scatter_tensor) on group '0' of 4" in message
    assert " avg bucket layers.0 [layers.0.wq.weight 512B]" in message


def test_ranks_that_compiled_other_graphs_meet_at_one_check_and_are_told_so() -> None:
    raised = _exchange({0: _schedule(GATHER), 1: _schedule(SCATTER, graph="backward")}, [0, 1])
    message = str(raised[0])
    assert str(raised[1]) == message
    assert "this check is rank 1's backward graph but rank 0's forward graph: the ranks compiled different graphs" \
        in message


@pytest.mark.parametrize("absent", [0, 2])
def test_a_rank_that_never_arrives_is_an_error_naming_it_after_the_timeout(absent: int) -> None:
    """The group's first rank missing: the others stop waiting for its digest; another rank missing: the first
    rank stops waiting and tells the others in its verdict."""
    raised = _exchange({r: _schedule(GATHER) for r in range(3) if r != absent}, range(3), timeout_s=0.5)
    for err in raised.values():
        assert isinstance(err, SameScheduleError) and err.ranks == (absent,)
        assert f"rank {absent} did not reach the check for its forward graph (its schedule was not published) " \
               "within 0.5 s (same_schedule_timeout_s)" in str(err)
