"""The pass rewrites and proves a graph with Python's cyclic garbage collector paused, and leaves it as it found it:
on success, on failure, nested, and from several threads at once.

Why it matters: full collections that walk the whole heap of a compiling process landed inside the rewrite and made
the pass 2 to 4 times slower, by chance and by heap size (``overlapcfg.passes.gc_paused``)."""

from __future__ import annotations

import copy
import gc
import threading
from collections.abc import Iterator

import pytest

from overlapcfg import compat, load_config
from overlapcfg.errors import OverlapConfigError
from overlapcfg.passes import apply, pipeline
from overlapcfg.passes.gc_paused import cyclic_gc_paused
from tests.support.synthetic import forward_graph


def _spy(monkeypatch: pytest.MonkeyPatch, name: str, *, fail: bool = False) -> list[bool]:
    """Record ``gc.isenabled()`` each time ``pipeline.<name>`` is called (and raise after, with ``fail``)."""
    seen: list[bool] = []
    real = getattr(pipeline, name)

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(gc.isenabled())
        if fail:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, name, spy)
    return seen


@pytest.fixture
def collector_running() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def _apply(plan: str = "layers.*") -> None:
    syn = forward_graph([[1, 2], [1, 2]])
    with compat.fake_process_group(2, 0):
        apply(copy.deepcopy(syn.gm), load_config({"plan": {"buckets": [plan]}}), module_fqns=syn.module_fqns,
              graph_kind="forward")


def test_the_collector_is_paused_while_the_graph_is_rewritten_and_proved(monkeypatch: pytest.MonkeyPatch,
                                                                          collector_running: None) -> None:
    before = _spy(monkeypatch, "find_collectives")
    proving = _spy(monkeypatch, "verify")
    _apply()
    assert before[0] is True  # finding collectives comes before the pause
    assert proving == [False]
    assert gc.isenabled()


def test_a_failing_rewrite_resumes_the_collector(monkeypatch: pytest.MonkeyPatch, collector_running: None) -> None:
    proving = _spy(monkeypatch, "verify", fail=True)
    with pytest.raises(RuntimeError, match="injected"):
        _apply()
    assert proving == [False]
    assert gc.isenabled()


def test_a_config_error_never_pauses_the_collector(monkeypatch: pytest.MonkeyPatch, collector_running: None) -> None:
    proving = _spy(monkeypatch, "verify")
    with pytest.raises(OverlapConfigError):
        _apply("layer.*")
    assert proving == []
    assert gc.isenabled()


def test_a_collector_the_caller_paused_stays_paused() -> None:
    gc.disable()
    try:
        _apply()
        with cyclic_gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_nested_pauses_resume_only_when_the_outermost_closes(collector_running: None) -> None:
    with cyclic_gc_paused():
        with cyclic_gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_pauses_in_two_threads_resume_when_the_last_one_closes(collector_running: None) -> None:
    """Thread A pauses, B pauses, A resumes first: the collector stays paused until B is done too."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def first() -> None:
        with cyclic_gc_paused():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def second() -> None:
        a_in.wait(10)
        with cyclic_gc_paused():
            b_in.set()
            a_out.wait(10)
            seen["after A left"] = gc.isenabled()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"after A left": False}
    assert gc.isenabled()
