"""Decisions every rank must share, made once: rank 0 decides, every other rank takes rank 0's result.

The same-schedule check (``overlapcfg.graph.same_schedule``) catches ranks that would issue different collectives;
this makes the decisions overlapcfg itself takes from per-rank inputs agree by construction, so there is nothing to
catch. ``overlapcfg.tune`` runs through it: in a job of several ranks, rank 0 searches (with its own hardware
profile, node costs and ties broken its way) and every rank returns rank 0's ``TuneResult``, whatever its own
inputs say; the other ranks spend no time searching.

The result travels through the job's c10d store (the one the default process group was built with), pickled, as
``torch.distributed.broadcast_object_list`` would send it, but without a collective: a search takes minutes, longer
than an NCCL group's timeout lets a collective wait, and the store waits under a timeout of its own (the store's,
which ``init_process_group(timeout=...)`` sets; 30 minutes by default). An error on rank 0 is raised on every rank.
Without a process group, in the fake one of offline tracing, or on one rank, ``decide`` simply runs here.
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from overlapcfg import compat
from overlapcfg.errors import OverlapStateError
from overlapcfg.graph.same_schedule import Counters, not_checked

__all__ = ["KEY_PREFIX", "decided_on_rank_zero"]

KEY_PREFIX = "overlapcfg/decided"
"""Where the decisions' keys live in the job's store."""

T = TypeVar("T")

_COUNTERS = Counters()


def decided_on_rank_zero(what: str, decide: Callable[[], T], *, timeout_s: float | None = None) -> T:
    """``decide()`` on rank 0 of the default process group, its result (or its error) returned (raised) on every
    rank; every rank must call it, in the same order for the same ``what``. ``timeout_s``: how long the other ranks
    wait for rank 0 (default: the store's own timeout). Runs ``decide()`` here where no other rank exists."""
    if not_checked() is not None:
        return decide()
    store = compat.default_store()
    if store is None:  # a bug check: not_checked saw a process group
        raise AssertionError("overlapcfg: the default process group has no store")
    prefixed = dist.PrefixStore(KEY_PREFIX, store)
    key = f"{what}/{_COUNTERS.next(what)}"
    if dist.get_rank() == 0:
        try:
            result = decide()
        except Exception as err:
            prefixed.set(key, _packed(("error", err)))
            raise
        prefixed.set(key, _packed(("ok", result)))
        return result
    wait = timedelta(seconds=timeout_s) if timeout_s is not None else compat.store_timeout(store)
    try:
        prefixed.wait([key], wait)
    except dist.DistError as err:
        raise OverlapStateError(f"overlapcfg: rank 0 did not publish its {what} within {wait.total_seconds():g} s "
                                f"(rank 0 decides it for every rank; store: {err})") from None
    status, value = pickle.loads(base64.b64decode(prefixed.get(key)))  # the job's own rank 0 wrote it
    if status == "error":
        raise value
    return value  # what rank 0's decide() returned: a T


def _packed(outcome: tuple[str, object]) -> str:
    """``outcome`` pickled for the store; an error that does not pickle travels as its text."""
    try:
        raw = pickle.dumps(outcome)
    except Exception:  # an unpicklable result is a bug; an unpicklable error is still an error
        if outcome[0] != "error":
            raise
        raw = pickle.dumps(("error", OverlapStateError(f"rank 0 failed: {outcome[1]}")))
    return base64.b64encode(raw).decode()
