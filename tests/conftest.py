"""Shared fixtures: demo train steps and torchtitan whole steps traced once per session, and ``applied`` to run the
pass on a copy (the objects are made in ``tests.support.traces``; tests get them here, as fixtures).

Tracing costs seconds, so each configuration (layers, reshard-after-forward) is traced once per test session and
shared read-only; tests that rewrite a graph go through ``applied`` which deep-copies it first.
"""

from __future__ import annotations

import os

# Inductor compiles in a pool of worker processes by default, one per core, each importing torch: on a 2-core
# machine already running two pytest workers (and their gloo ranks) the pool costs more than it saves
# (tests/passes/test_compile.py: 50 -> 36 CPU seconds with one thread). Set before torch is imported, here and so
# in every process a test starts (the environment is inherited); a value the caller set is kept.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Bytecode is written for this run, whatever PYTHONDONTWRITEBYTECODE says: hundreds of processes the suite starts
# (gloo ranks, the command, torchrun jobs) would each compile overlapcfg, the tests and their support modules from
# source again (~0.7 s of each, measured on 2 cores), and pytest would re-rewrite every test module's asserts in
# every worker. The .pyc files go where Python puts them (__pycache__/, ignored by git).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

import atexit
import gc
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.support.compat_tier import mark_tier

if TYPE_CHECKING:  # tracing imports dynamo and DTensor: seconds, which only the tests that trace should pay
    from overlapcfg.demo.tracing import TracedStep
    from tests.support.traces import ApplyFn

sys.dont_write_bytecode = False  # this process too (see PYTHONDONTWRITEBYTECODE above)
# The collector's youngest generation is collected every 10,000 net allocations instead of 700, in this process only
# (from here on: collecting the tests, then running them): importing torch and the test modules, and the tests'
# graphs, fake tensors and pydantic models, allocate by the hundred thousand, most of it dead before a collection
# with the larger threshold runs, and each younger collection counts towards a full one (which walks everything
# alive since the last freeze, see pytest_collection_finish). Measured on 2 cores: collecting the fast tier 5.0 ->
# 4.1 CPU s; running tests/graph, tests/tuning and tests/config (-m "not slow") in one process, 4.8 -> 2.9 CPU s in
# the collector (full collections 23 -> 4). When garbage is freed changes, never whether.
gc.set_threshold(10_000, 20, 10)


def _share_the_cores_between_workers() -> None:
    """Under pytest-xdist (``-n N``) each worker gets its share of the cores for torch's intra-op threads: N
    workers each running as many threads as there are cores oversubscribe the machine and run slower together than
    one alone. Spawned ranks set their own count (``run_on_gloo(num_threads=)``). Without workers, torch is not
    imported here: a run of torch-free files (``pytest -n 0 tests/config``) starts without it."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


_share_the_cores_between_workers()

_RUN_FIRST = ("multiprocess/", "conformance/", "passes/test_compile.py", "graph/test_mixed_precision.py",
              "demo/test_cli.py", "docs/", "package/", "tuning/test_tune.py",
              "graph/test_properties.py", "config/test_hydra.py", "config/test_catalog_without_torch.py",
              "config/test_preset_by_name.py", "config/test_fuzz_config.py", "tuning/", "graph/test_hsdp.py")
"""Files (and folders) that take tens of seconds each: they start processes (gloo ranks, torchrun, the CLI) or
compile with inductor. ``--dist loadfile`` hands a worker one file at a time in collection order, so these go
first and the small files fill in at the end, when the workers finish together; otherwise the last file handed out
can be a minute-long one that one worker runs while the other idles. The entries after ``tuning/test_tune.py`` are
the fast tier's longest files (3-10 CPU seconds of not-slow tests each), for the same reason in ``-m "not slow"``.
Order only: a stale entry costs time, never a result."""
_TESTS = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist sorts files by their number of tests before handing them out unless told not to; the number of
    # tests says little about the time (a 3-test file of torchrun jobs outlasts a 70-test file of synthetic graphs).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects: ``-m compat`` must see the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the compat tier (``tests/support/compat_tier.py``); puts ``_RUN_FIRST``'s files first (in that order),
    everything else after, each in its collected order."""
    mark_tier(config, items)
    _leave_out_the_docs_runs(config, items)

    def rank(item: pytest.Item) -> int:
        where = item.path.relative_to(_TESTS).as_posix() if item.path.is_relative_to(_TESTS) else ""
        return next((i for i, prefix in enumerate(_RUN_FIRST) if where.startswith(prefix)), len(_RUN_FIRST))

    items.sort(key=rank)  # stable: the order within a file and among equals is pytest's


def pytest_collection_finish(session: pytest.Session) -> None:
    """Everything alive once the tests are collected (torch, dynamo, the test modules: millions of objects) lives to
    the end of the run: freezing it keeps the garbage collector's full passes, which run every few thousand
    allocations of a test, from walking all of it again each time (``gc.freeze``; about 2 % of a worker's CPU).
    Objects the tests make are collected as always, less often (the thresholds set at the top of this file)."""
    _keep_pytests_log_handlers_off_torchs_structured_trace()
    gc.collect()
    gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """An xdist worker whose session ended ends without finalizing Python (``_end_after_the_exit_handlers``)."""
    if hasattr(config, "workerinput"):
        atexit.register(_end_after_the_exit_handlers)  # registered last: runs first


def _end_after_the_exit_handlers() -> None:
    """Run every other exit handler (logging's flush, multiprocessing's reaping of its children, the warm command
    servers' shutdown), flush, and end the process without finalizing the interpreter.

    By the time a worker's exit handlers run it has sent every report to the controller and closed its channel;
    what finalization would still do is free the worker's heap (torch, the test modules, every graph the tests kept)
    object by object, which took 0.8-1.2 s of each worker at the end of the fast tier on 2 cores (measured from the
    exit handlers to the process's exit) while the controller waits for both. The status is 0: the run's outcome is
    in the reports the controller already has. ``atexit._run_exitfuncs`` is the standard library's own runner of
    the handlers (undocumented, in every CPython 3 release); calling it here, with this handler taken off first, is
    what runs the others exactly once before the process ends."""
    atexit.unregister(_end_after_the_exit_handlers)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _keep_pytests_log_handlers_off_torchs_structured_trace()  # torch may be imported by a test, not at collection


def _keep_pytests_log_handlers_off_torchs_structured_trace() -> None:
    """pytest's logging plugin attaches its handlers (the session's and each test phase's) to every logger that
    does not propagate, and torch's structured-trace logger (``torch.__trace``, read by ``tlparse`` when
    ``TORCH_TRACE`` is set) is one. torch decides whether to build a structured-trace record by whether that logger
    has handlers (``trace_structured``), so under pytest it built every one nobody reads: graph dumps and stacks at
    each dynamo, aot and inductor compile, and the per-node FLOP table of every run of torch's overlap schedulers
    (``compat.upstream_scheduler_scope`` skips that table only while the trace has no reader). Here pytest's
    handlers are kept off that one logger; any other handler (a test's own reader) is attached as usual. No test
    reads torch's structured-trace records from ``caplog`` (``tests/package/test_compat_probes.py`` checks the
    handlers stay off)."""
    trace = sys.modules.get("torch._logging._internal")
    log = getattr(trace, "trace_log", None)
    if log is None or "addHandler" in vars(log):
        return
    add = log.addHandler

    def add_unless_pytests(handler: Any) -> None:
        if type(handler).__module__ != "_pytest.logging":
            add(handler)

    log.addHandler = add_unless_pytests
    for handler in [h for h in log.handlers if type(h).__module__ == "_pytest.logging"]:
        log.removeHandler(handler)


def _leave_out_the_docs_runs(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``docs`` run the documentation's blocks (minutes of commands and scripts): ``.ci/run`` runs them
    as a step of their own (``pytest -m docs tests/docs``), and every run whose ``-m`` does not name ``docs`` leaves
    them out, as deselected (counted in pytest's summary, never silently)."""
    if "docs" in (config.option.markexpr or ""):
        return
    kept = [item for item in items if item.get_closest_marker("docs") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("docs") is not None])
        items[:] = kept


@pytest.fixture(scope="session")
def traced_2l() -> TracedStep:
    from tests.support.traces import traced_step

    return traced_step(2, False)


@pytest.fixture(scope="session")
def traced_2l_reshard() -> TracedStep:
    from tests.support.traces import traced_step

    return traced_step(2, True)


@pytest.fixture(scope="session")
def traced_4l() -> TracedStep:
    from tests.support.traces import traced_step

    return traced_step(4, False)


@pytest.fixture(scope="session")
def traced_4l_reshard() -> TracedStep:
    from tests.support.traces import traced_step

    return traced_step(4, True)


@pytest.fixture(scope="session")
def applied() -> ApplyFn:
    """``applied(step, graph_name, cfg) -> GraphModule``: the pass on a fresh copy, verified (see ``apply_to``)."""
    from tests.support.traces import apply_to

    return apply_to


@pytest.fixture(scope="session")
def whole_step() -> Callable[..., Any]:
    """``whole_step(model="llama3", reshard="always", optimizer=False, loss="cross_entropy") -> WholeStep`` (see
    ``tests.support.traces.whole_step_capture``)."""
    from tests.support.traces import whole_step_capture

    return whole_step_capture


@pytest.fixture
def clean_registry() -> Iterator[None]:
    """Puts the strategy catalog back after the test (``contracts._CONTRACTS``, the one catalog: contracts and their
    graph calls; and the entry-points-loaded flag), so no test leaks a registered strategy into another."""
    from overlapcfg.config import contracts

    saved_contracts = dict(contracts._CONTRACTS)
    saved_flag = contracts._entry_points_loaded
    try:
        yield
    finally:
        contracts._CONTRACTS.clear()
        contracts._CONTRACTS.update(saved_contracts)
        contracts._entry_points_loaded = saved_flag
