"""The same-schedule check: before the first step, the ranks of every process group a schedule uses compare the
collectives they will issue, and on a difference every rank raises ``SameScheduleError`` naming the ranks that
differ and the first differing collective and bucket, instead of the job hanging in that collective until the
backend's timeout (tens of minutes on a cluster, with no hint of why).

**Why it is needed.** The pass is deterministic: the same graph and config give the same schedule on every rank. But
what it is given can differ per rank: a config selected by the environment (``OVERLAPCFG_CONFIG``) or read from a
file each rank reads for itself, a tuned config or node costs produced per node, model code that branches on the
rank (one parameter of another size), a recompile or graph break on some ranks only. Nothing before this check
compared the *decisions*.

**Where it runs** (each route calls ``check_same_schedule`` where every rank is sure to arrive, whatever its
caches): ``overlapcfg.backend`` right after the pass on each of aot's graphs, before the graph is lowered (aot
compiles the backward lazily, at the first backward: its check runs there, on every rank alike; aot's own cache
does not serve custom compilers, so the pass runs on every rank on every compile); inductor's post-grad hook
(``overlapcfg.inductor_pass``) right after the pass too, with inductor's FX graph cache bypassed while the check
is on in a multi-rank job (a cache hit on some ranks and not others would skip the pass, and with it the check, on
those ranks only: upstream's hang); torchtitan's graph-trainer pipeline after the pass on the whole-step graph
(every rank traces); ``overlapcfg.fully_shard`` (and the Lightning, accelerate and torchtitan trainer integrations
built on it) once the layout is decided and before anything is sharded, so a mismatch leaves the model untouched.

**How ranks meet: the job's c10d store**, the store the default process group was built with (``TCPStore`` under
``torchrun``), not a collective. A collective on the job's group would be queued on its communication stream (NCCL:
a device tensor, a stream sync) and would wait under the group's own timeout, the very one this check must beat; a
gloo side group would need ``new_group``, itself a collective every rank must reach. The store carries any bytes,
touches no stream and waits under a timeout of our own (``same_schedule_timeout_s``): a rank that never arrives
ends in an error naming this check and that rank, not in a hang.

**What is exchanged, per process group ``G`` of the schedule (size > 1), check ``k`` on ``G`` in program order**::

    every rank r:      set  G/k/digest/r  = {graph, digest, count}
    every rank r > l:  wait G/k/digest/l  (l: G's first rank); if the digests differ, set G/k/schedule/r = the
                       rank's fingerprint (JSON, zlib)
    rank l:            wait every G/k/digest/r; group the ranks by digest; fetch one fingerprint per class that
                       differs from the largest class; set G/k/verdict = ok | the error text
    every rank r > l:  wait G/k/verdict; raise it if it is an error

Comparing costs one small key per rank and ``|G|`` reads on the group's first rank; a fingerprint travels only on
a mismatch. Keys are numbered per group in program order: ranks that compiled the same graphs number them alike,
and ranks that did not (a recompile on one rank) meet at the same ``k`` with fingerprints of different graphs,
which is itself reported. A graph with no collectives is not checked (a rank may compile one of its own: a metric
on rank 0); a group's ranks compare the whole sequence (other groups numbered by first appearance: two
data-parallel peers' tensor-parallel groups are different groups of one role), so the interleaving across groups is
compared too.

Not checked (recorded as ``not checked: <why>``): no process group, the fake process group of offline tracing,
one rank. ``check_same_schedule: false`` skips it (recorded as ``off``).
"""

from __future__ import annotations

import base64
import json
import logging
import time
import weakref
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from overlapcfg import compat
from overlapcfg.errors import SameScheduleError
from overlapcfg.graph.record import ScheduleFingerprint, first_difference

__all__ = ["KEY_PREFIX", "Counters", "check_same_schedule", "not_checked"]

logger = logging.getLogger(__name__)

KEY_PREFIX = "overlapcfg/same_schedule"
"""Where the check's keys live in the job's store."""

_CAUSES = ("Something the schedule is decided from differs between these ranks: the config (OVERLAPCFG_CONFIG or a "
           "config file each rank reads for itself), a tuned config or node costs produced per rank, or model code "
           "that branches on the rank (a parameter of another size). check_same_schedule: false skips this check.")


@dataclass(frozen=True, slots=True)
class _GroupCheck:
    """Check ``index`` on the process group ``name`` (whose global ranks are ``members``)."""

    name: str
    members: tuple[int, ...]
    index: int

    @property
    def leader(self) -> int:
        return self.members[0]

    def key(self, *parts: object) -> str:
        return "/".join((self.name, str(self.index), *(str(p) for p in parts)))

    def title(self, where: str) -> str:
        return f"overlapcfg's same-schedule check ({where}; check {self.index} on process group {self.name!r} of " \
               f"{len(self.members)} ranks)"


class Counters:
    """Exchanges so far per name (a group's, a decision's), for the default process group they were made under (a
    new default group starts again from 0; held by a weak reference, so an old group is not kept alive). Every rank
    counts in program order, so the n-th exchange of a name has one key on every rank that reached it."""

    def __init__(self) -> None:
        self.world: weakref.ref[Any] | None = None
        self.counts: dict[str, int] = {}

    def next(self, name: str) -> int:
        world = dist.group.WORLD
        if self.world is None or self.world() is not world:
            self.world = weakref.ref(world) if world is not None else None
            self.counts = {}
        index = self.counts.get(name, 0)
        self.counts[name] = index + 1
        return index


_COUNTERS = Counters()


def not_checked() -> str | None:
    """Why no check can run in this process now (no process group, the fake one, one rank), or None."""
    if not dist.is_available() or not dist.is_initialized():
        return "no process group"
    if dist.get_backend() == "fake":
        return "fake process group (offline tracing: no other rank runs)"
    if dist.get_world_size() == 1:
        return "one rank"
    return None


def check_same_schedule(schedule: ScheduleFingerprint, *, enabled: bool, timeout_s: float, where: str) -> str:
    """Compare ``schedule`` with the other ranks of each process group it uses (module docstring); return what the
    record says (``checked: ...``, ``not checked: <why>``, ``off: ...``). Raises ``SameScheduleError`` on every rank
    where the ranks differ or a rank did not arrive within ``timeout_s``. ``where``: the route, for messages."""
    if not enabled:
        return "off: check_same_schedule is false"
    why = not_checked()
    if why is not None:
        return f"not checked: {why}"
    if not schedule.collectives:
        return "not checked: no collectives"
    store = compat.default_store()
    if store is None:  # a bug check: not_checked saw a process group
        raise AssertionError("overlapcfg same-schedule check: the default process group has no store")
    started = time.perf_counter()
    checks = _group_checks(schedule)
    if not checks:
        return "not checked: every process group of this schedule has one rank"
    exchange = _Exchange(dist.PrefixStore(KEY_PREFIX, store), dist.get_rank(), schedule, timeout_s, where)
    exchange.run(checks)
    groups = ", ".join(f"{c.name!r} ({len(c.members)} ranks)" for c in checks)
    outcome = (f"checked: the same {len(schedule.collectives)} collectives on every rank of process group "
               f"{groups} ({(time.perf_counter() - started) * 1e3:.1f} ms)")
    logger.debug("overlapcfg: %s graph %s", schedule.graph, outcome)
    return outcome


def _group_checks(schedule: ScheduleFingerprint) -> list[_GroupCheck]:
    """One check per group of more than one rank that ``schedule`` uses (graph order of first use). A group this
    process cannot resolve (a compile-on-one-rank graph's group input) is checked as the default group."""
    world = dist.group.WORLD
    world_name = world.group_name if world is not None else "0"
    found: dict[str, tuple[int, ...]] = {}
    for stated in schedule.groups():
        members = compat.group_ranks(stated)
        name = stated if members is not None else world_name
        if members is None:
            members = tuple(range(dist.get_world_size()))
        if len(members) > 1 and dist.get_rank() in members:
            found.setdefault(name, members)
    return [_GroupCheck(name, members, _COUNTERS.next(name)) for name, members in found.items()]


class _Exchange:
    """One rank's side of the exchange for one schedule (module docstring): publish, compare, judge, hear."""

    def __init__(self, store: dist.Store, rank: int, schedule: ScheduleFingerprint, timeout_s: float,
                 where: str) -> None:
        self.store, self.rank, self.schedule, self.timeout_s, self.where = store, rank, schedule, timeout_s, where
        self.digest = schedule.digest()

    def run(self, checks: Sequence[_GroupCheck]) -> None:
        summary = json.dumps({"graph": self.schedule.graph, "digest": self.digest,
                              "count": len(self.schedule.collectives)})
        for c in checks:
            self.store.set(c.key("digest", self.rank), summary)
        led = [c for c in checks if c.leader == self.rank]
        joined = [c for c in checks if c.leader != self.rank]
        for c in joined:  # publish the whole fingerprint only where it differs from the first rank's
            theirs = json.loads(self._get(c, [c.leader], c.key("digest", c.leader), self.timeout_s))
            if theirs["digest"] != self.digest:
                packed = zlib.compress(self.schedule.model_dump_json().encode())
                self.store.set(c.key("schedule", self.rank), base64.b64encode(packed).decode())
        failures = []
        for c in led:  # every verdict is published before this rank raises: no one waits on it in vain
            verdict = self._judge(c)
            self.store.set(c.key("verdict"), json.dumps(verdict))
            if not verdict["ok"]:
                failures.append(verdict)
        for c in joined:
            if not failures:
                # The first rank may arrive up to one timeout after this one, then wait up to one for a fingerprint.
                verdict = json.loads(self._get(c, [c.leader], c.key("verdict"), 2 * self.timeout_s + 5, judging=True))
                if not verdict["ok"]:
                    failures.append(verdict)
        if failures:
            first = failures[0]
            raise SameScheduleError(first["message"], ranks=first["ranks"], collective=first["collective"])

    def _get(self, c: _GroupCheck, ranks: list[int], key: str, timeout_s: float, judging: bool = False) -> bytes:
        """The value of ``key`` once it is set, or ``SameScheduleError`` naming ``ranks`` after ``timeout_s``."""
        try:
            self.store.wait([key], timedelta(seconds=timeout_s))
            return bytes(self.store.get(key))
        except dist.DistError as err:  # a timeout, or the store's host gone
            raise SameScheduleError(_absent(c, ranks, timeout_s, self.where, self.schedule.graph, judging, err),
                                    ranks=ranks) from None

    def _judge(self, c: _GroupCheck) -> dict[str, Any]:
        """On the group's first rank: every rank's digest, and the verdict."""
        keys = [c.key("digest", r) for r in c.members]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout_s))
        except dist.DistError as err:
            missing = [r for r, k in zip(c.members, keys, strict=True) if not _has(self.store, k)]
            return {"ok": False, "ranks": missing, "collective": None,
                    "message": _absent(c, missing, self.timeout_s, self.where, self.schedule.graph, False, err)}
        summaries = {r: json.loads(self.store.get(k)) for r, k in zip(c.members, keys, strict=True)}
        classes: dict[str, list[int]] = {}
        for r in c.members:
            classes.setdefault(summaries[r]["digest"], []).append(r)
        if len(classes) == 1:
            return {"ok": True}
        # The reference is the largest class (the first rank's among equals): the few ranks that differ are named.
        reference = max(classes.values(), key=lambda ranks: (len(ranks), c.leader in ranks))
        try:
            schedules = {ranks[0]: self._schedule_of(c, ranks[0]) for ranks in classes.values()}
        except dist.DistError as err:  # a rank that published its digest died before its fingerprint arrived
            differing = sorted(r for ranks in classes.values() if c.leader not in ranks for r in ranks)
            return {"ok": False, "ranks": differing, "collective": None,
                    "message": f"{c.title(self.where)}: the ranks would issue different collectives for "
                               f"{_what(self.schedule.graph)} ({_differ(differing)} from rank {c.leader}), "
                               f"but a fingerprint to compare did not arrive within {self.timeout_s:g} s "
                               f"(store: {err}). {_CAUSES}"}
        others = [ranks for ranks in classes.values() if ranks is not reference]
        blocks, positions = [], []
        for ranks in others:
            block, position = _difference(reference, schedules[reference[0]], ranks, schedules[ranks[0]])
            blocks.append(block)
            positions.append(position)
        differing = sorted(r for ranks in others for r in ranks)
        graph = self.schedule.graph if c.leader in reference else schedules[reference[0]].graph
        message = "\n  ".join([
            f"{c.title(self.where)}: the ranks would issue different collectives for {_what(graph)}; left alone, "
            "the job would hang in (or exchange the wrong data through) the first differing collective until the "
            "backend's timeout.",
            f"{_differ(differing)} from {_ranks(reference)}:",
            *blocks, _CAUSES])
        return {"ok": False, "ranks": differing, "collective": positions[0] if positions[0] >= 0 else None,
                "message": message}

    def _schedule_of(self, c: _GroupCheck, rank: int) -> ScheduleFingerprint:
        if rank == self.rank:
            return self.schedule
        key = c.key("schedule", rank)
        self.store.wait([key], timedelta(seconds=self.timeout_s))
        return ScheduleFingerprint.model_validate_json(zlib.decompress(base64.b64decode(self.store.get(key))))


def _has(store: dist.Store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except dist.DistError:
        return False


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(str(r) for r in ranks)}"


def _differ(ranks: Sequence[int]) -> str:
    return f"{_ranks(ranks)} differ{'s' if len(ranks) == 1 else ''}"


def _what(graph: str, whose: str = "their") -> str:
    """What a fingerprint is of, in a sentence: ``their forward graph``, ``its fully_shard call``."""
    return f"{whose} fully_shard call" if graph == "fsdp2" else f"{whose} {graph} graph"


def _difference(reference: list[int], ref: ScheduleFingerprint, ranks: list[int],
                other: ScheduleFingerprint) -> tuple[str, int]:
    """The lines naming where ``other`` (ranks ``ranks``) departs from ``ref`` (ranks ``reference``), and where."""
    a, b = f"rank {reference[0]}", f"rank {ranks[0]}"
    position = first_difference(ref, other)
    if position is None:  # a bug check: the digests differ, so the lines do
        raise AssertionError("overlapcfg same-schedule check: different digests but the same lines")
    if position < 0:
        return (f"{_ranks(ranks)}: this check is {_what(other.graph, b + chr(39) + 's')} but "
                f"{_what(ref.graph, a + chr(39) + 's')}: the ranks compiled different graphs, or in another order (a "
                "recompile or graph break on some ranks only)",
                position)

    def at(schedule: ScheduleFingerprint) -> str:
        found = schedule.collectives
        return found[position].describe() if position < len(found) else "(no more collectives)"

    return ("\n    ".join([
        f"{_ranks(ranks)}: first difference at collective {position} (0-based; {a} issues "
        f"{len(ref.collectives)}, {b} issues {len(other.collectives)}):",
        f"{a}: {at(ref)}", f"{b}: {at(other)}"]), position)


def _absent(c: _GroupCheck, ranks: Sequence[int], timeout_s: float, where: str, graph: str, judging: bool,
            err: BaseException) -> str:
    shown = _ranks(list(ranks)) if ranks else "some rank"
    what = ("did not publish the verdict" if judging else
            f"did not reach the check for {_what(graph, 'its')} (its schedule was not published)")
    return (f"{c.title(where)}: {shown} {what} within {timeout_s:g} s (same_schedule_timeout_s). A rank that crashed "
            "or stopped before the check, one that compiles much longer than the others (raise "
            "same_schedule_timeout_s), or one running with check_same_schedule: false; without the check the job "
            f"would wait in its first collective until the backend's timeout. (store: {err})")
