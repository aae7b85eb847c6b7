"""The pass runs with Python's cyclic garbage collector paused and leaves it as it found it.

Why it matters: collections that walk the whole heap of a compiling process landed inside the pass and made it 2 to
4 times slower, by chance and by heap size (``overlapcfg.passes.gc_paused.cyclic_gc_paused``)."""

from __future__ import annotations

import copy
import gc

import pytest

from overlapcfg import compat, load_config
from overlapcfg.errors import OverlapConfigError
from overlapcfg.passes import apply, pipeline
from tests.support.synthetic import forward_graph


def _seen_during_apply(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    seen: list[bool] = []
    real = pipeline.find_collectives

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(gc.isenabled())
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pipeline, "find_collectives", spy)
    return seen


def test_the_collector_is_paused_during_the_pass_and_resumed_after(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _seen_during_apply(monkeypatch)
    syn = forward_graph([[1, 2], [1, 2]])
    assert gc.isenabled()
    with compat.fake_process_group(2, 0):
        apply(copy.deepcopy(syn.gm), load_config({"plan": {"buckets": ["layers.*"]}}), module_fqns=syn.module_fqns,
              graph_kind="forward")
    assert seen and not any(seen)
    assert gc.isenabled()


def test_a_failing_pass_resumes_the_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _seen_during_apply(monkeypatch)
    syn = forward_graph([[1, 2], [1, 2]])
    with compat.fake_process_group(2, 0), pytest.raises(OverlapConfigError):
        apply(copy.deepcopy(syn.gm), load_config({"plan": {"buckets": ["layer.*"]}}), module_fqns=syn.module_fqns,
              graph_kind="forward")
    assert seen == [False]
    assert gc.isenabled()


def test_a_collector_the_caller_paused_stays_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    syn = forward_graph([[1, 2]])
    gc.disable()
    try:
        with compat.fake_process_group(2, 0):
            apply(copy.deepcopy(syn.gm), load_config({"plan": {"buckets": ["layers.*"]}}),
                  module_fqns=syn.module_fqns, graph_kind="forward")
        assert not gc.isenabled()
    finally:
        gc.enable()
