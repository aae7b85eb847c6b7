"""The same-schedule check on real gloo ranks (2 and 4): every way a real job gives its ranks different schedules ends
in ``SameScheduleError`` on every rank, naming the ranks that differ and the first differing collective, instead of a
hang; identical configs pass silently; the tuner in a job decides once for every rank; a rank that never arrives is
an error naming it within ``same_schedule_timeout_s``.

One gloo job per world size runs every case in turn (``tests/support/schedule_ranks.py``), each under a hard limit
that ends the job (and fails these tests) if a case hangs. Bitwise parity with the check on is the parity tests'
(``tests/multiprocess``, ``tests/conformance``, ``tests/integrations``): the check changes no graph.
"""

from __future__ import annotations

from typing import Any

import pytest

from overlapcfg.demo.gloo import run_on_gloo
from tests.support.rank_warmup import preloaded
from tests.support.schedule_ranks import MISSING_TIMEOUT_S, schedule_ranks

pytestmark = pytest.mark.slow

DIVERGENT = ("node_costs", "tuner_tie", "environment", "model_branch")
"""Cases whose odd ranks get another schedule than the even ones."""


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """The 2-rank job also compiles the environment case end to end through ``overlapcfg.backend``; the 4-rank job
    checks it on the graphs it captured (a second trace on 4 ranks would double its time)."""
    return run_on_gloo(schedule_ranks, request.param == 2, world_size=request.param, timeout_s=900,
                       preload=preloaded("tests.support.schedule_ranks"))


def _odd(results: list[dict[str, Any]]) -> list[int]:
    return [r for r in range(len(results)) if r % 2]


@pytest.mark.parametrize("case", ["identical", "inductor_hook", "fully_shard"])
def test_identical_schedules_pass_silently_on_every_rank(ranks: list[dict[str, Any]], case: str) -> None:
    n = len(ranks)
    for rank, res in enumerate(ranks):
        outcome = res[case]
        assert "error" not in outcome, (rank, outcome.get("message"))
        checks = outcome["outcome"] if isinstance(outcome["outcome"], list) else [outcome["outcome"]]
        assert checks and all(c.startswith("checked: the same ") and f"({n} ranks)" in c for c in checks), checks


@pytest.mark.parametrize("case", DIVERGENT)
def test_each_divergence_is_an_error_on_every_rank_naming_the_ranks_and_the_first_differing_collective(
        ranks: list[dict[str, Any]], case: str) -> None:
    odd = _odd(ranks)
    if "config" in ranks[0][case]:  # the per-rank decisions really differ (else this case would test nothing)
        assert ranks[0][case]["config"] != ranks[1][case]["config"]
        assert all(ranks[r][case]["config"] == ranks[r % 2][case]["config"] for r in range(len(ranks)))
    messages = set()
    for rank, res in enumerate(ranks):
        found = res[case]
        assert found.get("error") == "SameScheduleError", (rank, found)
        assert list(found["ranks"]) == odd, (rank, found)
        assert found["collective"] is not None and found["collective"] >= 0, (rank, found)
        messages.add(found["message"])
    (message,) = messages  # every rank raises the same error
    differ = f"rank {odd[0]} differs" if len(odd) == 1 else f"ranks {', '.join(map(str, odd))} differ"
    assert differ in message and "first difference at collective" in message, message
    assert f"on process group '0' of {len(ranks)} ranks" in message and "check_same_schedule: false" in message
    if case == "environment" and len(ranks) == 2:  # compiled end to end: the backward graphs differ
        assert "overlapcfg.backend, backward graph" in message


def test_the_tuner_in_a_job_decides_once_for_every_rank(ranks: list[dict[str, Any]]) -> None:
    """Node costs and tie-breaking differ per rank, as in the divergent cases: ``overlapcfg.tune`` in the job
    searches on rank 0 only and every rank gets its config, so the check passes."""
    results = [res["tuned_in_the_job"] for res in ranks]
    assert all("error" not in r for r in results), results
    assert all(r["outcome"]["config"] == results[0]["outcome"]["config"] for r in results)
    assert results[0]["outcome"]["searched"] >= 1 and all(r["outcome"]["searched"] == 0 for r in results[1:])
    assert all(c.startswith("checked: ") for r in results for c in r["outcome"]["checked"])


def test_a_rank_that_never_reaches_the_check_is_an_error_naming_it_after_the_timeout(
        ranks: list[dict[str, Any]]) -> None:
    absent = 0 if len(ranks) > 2 else len(ranks) - 1
    for rank, res in enumerate(ranks):
        found = res["missing_rank"]
        if rank == absent:
            assert found["outcome"] == "skipped"
            continue
        assert found.get("error") == "SameScheduleError" and list(found["ranks"]) == [absent], (rank, found)
        assert f"rank {absent} did not reach the check" in found["message"], found["message"]
        assert f"within {MISSING_TIMEOUT_S:g} s (same_schedule_timeout_s)" in found["message"]
        assert found["seconds"] >= MISSING_TIMEOUT_S  # it waited for the absent rank, as long as it was told to
