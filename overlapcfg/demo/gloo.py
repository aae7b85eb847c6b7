"""Run a function on several CPU processes joined by a real gloo process group, and collect what each returns.

For numerical checks that need real communication (sharded vs unsharded, transformed vs untransformed graphs).
Kept in the package, not in ``tests/``, so later issues' tests and users' own checks reuse one harness: spawned
processes, a rendezvous store this process holds on a port the OS assigns (concurrent runs never meet), one
timeout for the whole run, and a failing rank's traceback in the parent's error.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import logging
import multiprocessing.context
import os
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from overlapcfg.errors import RankFailedError

__all__ = ["RankFailedError", "run_on_gloo"]

log = logging.getLogger(__name__)

RankFn = Callable[..., Any]
"""``fn(rank, world_size, *args)``; must be importable by name (module level) since processes are spawned."""


@dataclass(frozen=True, slots=True)
class _RunSpec:
    """What every spawned rank needs (pickled to the children)."""

    port: int
    fn: RankFn
    args: tuple[Any, ...]
    num_threads: int
    timeout_s: float


def _worker(rank: int, world_size: int, spec: _RunSpec, results: Any) -> None:
    # A rank that dies in native code (a segfault, glibc's abort on a corrupted heap) reports nothing through the
    # queue; its Python stack on stderr at least says which op it was running. The process is the rank's own.
    # Without a usable stderr there is nothing to print to.
    with contextlib.suppress(AttributeError, OSError, RuntimeError, ValueError):
        faulthandler.enable()
    # A fixed intra-op thread count per rank: ranks share the machine's cores, and a fixed count keeps CPU
    # kernels' reduction order (and so bits) the same from run to run.
    torch.set_num_threads(spec.num_threads)
    try:
        timeout = timedelta(seconds=spec.timeout_s)
        store = dist.TCPStore("127.0.0.1", spec.port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        try:
            # Every rank's connections are made before any rank runs ``fn``: a rank whose ``init_process_group``
            # returned first and whose ``fn`` ends at once (no collective) would otherwise exit and close its
            # sockets while a slower peer is still connecting, failing that peer's init with gloo's "Connection
            # closed by peer" instead of running its ``fn``.
            dist.barrier()
            results.put((rank, True, _dumps(spec.fn(rank, world_size, *spec.args))))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _dumps(value: Any) -> bytes:
    """Serialize with ``torch.save``: tensors travel as bytes, not as shared-memory handles that die with the
    sending process before the parent reads them."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def run_on_gloo(fn: RankFn, *args: Any, world_size: int = 2, timeout_s: float = 180.0,
                num_threads: int = 1, preload: Sequence[str] = ()) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes sharing a gloo default group.

    Returns the per-rank results in rank order (they must be picklable; tensors are fine). The first rank to
    fail, or a run longer than ``timeout_s``, raises ``RankFailedError`` with the rank's traceback; the other
    processes are then terminated.

    ``preload``: modules (``fn``'s own, say) to import once in a fork server that then forks every rank (the
    ``forkserver`` start method) instead of spawning each from scratch: each rank then skips the seconds torch,
    dynamo and DTensor take to import, which is most of a 4-rank run's cost on a small machine. The server is
    single-threaded and clean (not this process), and is started once per process: if an earlier call started it,
    its preload stands and ranks import the rest themselves (slower, same results).
    """
    ctx: multiprocessing.context.BaseContext
    if preload:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))
    else:
        ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # The rendezvous store lives here, on a port the OS assigns while it is bound (port 0), for the whole run: a
    # port looked up free and bound later by a rank can be taken meanwhile by a concurrent run, whose ranks then
    # meet ours (gloo: "Connection closed by peer").
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    spec = _RunSpec(store.port, fn, args, num_threads, timeout_s)
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, spec, results),
                    daemon=True, name=f"overlapcfg-gloo-rank{rank}")
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        return _collect(results, procs, world_size, timeout_s)
    finally:
        _stop(procs)


def _collect(results: Any, procs: list[Any], world_size: int, timeout_s: float) -> list[Any]:
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    silent_since: float | None = None
    polled_after_exit = False
    while len(out) < world_size:
        try:
            # Poll in short steps: a rank that died without reporting (a crash in start-up) must fail the run
            # now, not after the whole timeout.
            rank, ok, value = results.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            missing = sorted(set(range(world_size)) - set(out))
            codes = {p.name: p.exitcode for p in procs}
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead and silent_since is None:
                silent_since = time.monotonic()  # give its own traceback a moment to arrive through the queue
            # Every rank still owing a result has exited: what it put in the queue reached the pipe before it
            # exited (the queue's feeder thread is joined at exit). One more poll reads anything that arrived
            # after the last one began; if that finds nothing, there is nothing left to wait for.
            all_gone = all(procs[r].exitcode is not None for r in missing)
            if all_gone and not polled_after_exit:
                polled_after_exit = True
                continue
            if time.monotonic() < deadline and not all_gone and not (
                    silent_since is not None and time.monotonic() - silent_since > 5):
                continue
            why = "exited without a result" if dead or all_gone else f"timed out after {timeout_s}s"
            raise RankFailedError(f"gloo run {why}; no result from ranks {missing} (exit codes {codes})") from None
        if not ok:
            raise RankFailedError(f"rank {rank} of {world_size} failed:\n{value}")
        out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    return [out[r] for r in range(world_size)]


def _stop(procs: list[Any]) -> None:
    """Join our processes; terminate (then kill) the ones still running, by their own handles only."""
    for proc in procs:
        proc.join(timeout=10)
    for proc in procs:
        if proc.is_alive():
            log.warning("terminating %s (pid %s)", proc.name, proc.pid)
            proc.terminate()
            proc.join(timeout=5)
        if proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, 9)
