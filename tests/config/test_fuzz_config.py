"""Property tests (hypothesis, bounded to a few seconds): load_config never fails with anything but
OverlapConfigError, valid configs survive dump and load, and the pattern matcher agrees with a regex oracle.

Slow tier: a seeded sample of valid configs applied to the demo's traced graphs (``tests/support/fuzz.py``: plain FSDP,
reshard-after-forward with whole-step in-place updates, HSDP both orders, FSDP + TP) verifies without a false
alarm or a foreign exception; ``benchmarks/verify_fuzz.py`` runs the same fuzz longer."""

from __future__ import annotations

import random
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from overlapcfg import OverlapConfig, OverlapConfigError, load_config
from overlapcfg.config.patterns import AnySegment, AnySegments, IndexRange, compile_pattern
from overlapcfg.config.presets import preset_names
from overlapcfg.module_paths import WRAPPER_SEGMENTS

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

FIELDS = ["strategy", "plan", "policy", "overrides", "buckets", "modules", "per", "group_size", "name",
          "require_full_coverage", "forward_prefetch", "backward_prefetch", "reduce_scatter_delay", "match",
          "max_inflight_bytes", "overlap", "_target_", "strict", "verify"]
SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
           | st.sampled_from(["manual", "auto", "none", "torch_manual", "llama_layers", "layers.*", "4:8", "1GiB",
                              "${x}", "${oc.env:HOME}", "???", "**", "", "1e3"])
           | st.text(max_size=12))
KEYS = st.sampled_from(FIELDS) | st.text(max_size=8) | st.integers(-3, 3)
JSON_LIKE = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                         | st.dictionaries(KEYS, inner, max_size=4), max_leaves=25)


def _load_or_config_error(src: Any) -> None:
    try:
        result = load_config(src)
    except OverlapConfigError:
        return
    assert isinstance(result, OverlapConfig)


@FUZZ
@given(st.dictionaries(KEYS, JSON_LIKE, max_size=5))
def test_any_json_like_mapping_loads_or_is_a_config_error(data: dict[Any, Any]) -> None:
    _load_or_config_error(data)


YAML_TOKENS = st.sampled_from(["plan", "strategy", "policy", "buckets", ":", ": ", "- ", "-", "[", "]", "{", "}",
                               ",", "\n", "  ", "&a ", "*a", "${", "}", "!!str ", "!!python/object ", "'", '"',
                               "4:8", "1e3", "layers.*", "? ", "<<: ", "|", ">", "#", "---\n", "%YAML 1.1\n",
                               "\t", "\\", "~", "0x1F", "forward_prefetch", "${oc.env:HOME}", "${plan}"])


@FUZZ
@given(st.text(max_size=80) | st.lists(YAML_TOKENS, max_size=30).map("".join))
def test_any_yaml_text_loads_or_is_a_config_error(text: str) -> None:
    _load_or_config_error(text)


PATTERN_SEGMENTS = ["layers", "attention", "wq", "0", "3", "12", "*", "**", "0:4", "2:", ":3", "1:13", "a", "b#2"]
PATTERNS = st.lists(st.sampled_from(PATTERN_SEGMENTS), min_size=1, max_size=4).map(".".join)
NAMES = st.sampled_from(["1e3", "true", "null", "4:8", "${x}", "\\${x}", "yes", "~", "", "a: b", "- x", "#c"]) \
    | st.text(max_size=10)
DEPTH = st.integers(0, 8)


def _entry() -> st.SearchStrategy[Any]:
    mapping = st.fixed_dictionaries(
        {"modules": st.lists(PATTERNS, min_size=1, max_size=3)},
        optional={"per": PATTERNS, "group_size": st.integers(1, 4), "forward_prefetch": DEPTH,
                  "backward_prefetch": DEPTH, "reduce_scatter_delay": DEPTH})
    return PATTERNS | st.lists(PATTERNS, min_size=1, max_size=3) | mapping


VALID = st.fixed_dictionaries(
    {"strategy": st.sampled_from(["manual", "torch_manual", "auto", "none"])},
    optional={
        "plan": st.sampled_from(list(preset_names("plan")))
        | st.fixed_dictionaries({"buckets": st.lists(_entry(), max_size=4)},
                                optional={"name": NAMES, "require_full_coverage": st.booleans()}),
        "policy": st.fixed_dictionaries({}, optional={"forward_prefetch": DEPTH, "backward_prefetch": DEPTH,
                                                      "reduce_scatter_delay": DEPTH}),
        "overrides": st.lists(st.fixed_dictionaries({"match": PATTERNS, "forward_prefetch": DEPTH},
                                                    optional={"backward_prefetch": DEPTH}), max_size=3),
    })


@FUZZ
@given(VALID)
def test_valid_configs_round_trip_through_to_yaml(data: dict[str, Any]) -> None:
    try:
        cfg = load_config(data)
    except OverlapConfigError:  # e.g. a strategy's own checks (torch_manual's fixed depths)
        assume(False)
        return
    assert load_config(cfg.to_yaml()) == cfg


def _oracle(pattern: str) -> re.Pattern[str]:
    """The pattern as a regex over ``"." + fqn`` (each segment led by a dot, so ``**`` may be empty)."""
    out = ""
    for seg in compile_pattern(pattern).segments:
        if isinstance(seg, AnySegments):
            out += r"(?:\.[^.]+)*"
        elif isinstance(seg, AnySegment):
            out += r"\.[^.]+"
        elif isinstance(seg, IndexRange):
            stop = 100 if seg.stop is None else seg.stop
            numbers = "|".join(str(i) for i in range(seg.start, stop))
            tail = "|[1-9][0-9]{2,}" if seg.stop is None else ""
            out += rf"\.0*(?:{numbers}{tail})" if numbers else r"\.(?!)"
        else:
            out += r"\." + re.escape(str(seg))
    return re.compile(out)


FQN_SEGMENTS = ["layers", "attention", "wq", "a", "b#2", "0", "3", "12", "13", "007", "150", *WRAPPER_SEGMENTS]


@settings(max_examples=300, deadline=None)
@given(PATTERNS, st.lists(st.sampled_from(FQN_SEGMENTS), max_size=6))
def test_pattern_matching_agrees_with_a_regex_oracle(pattern: str, parts: list[str]) -> None:
    fqn = ".".join(parts)
    stripped = [p for p in parts if p not in WRAPPER_SEGMENTS]
    expected = _oracle(pattern).fullmatch("".join("." + p for p in stripped)) is not None
    assert compile_pattern(pattern).matches(fqn) == expected


# --- valid configs on the demo's traced graphs (slow) ---------------------------------------------------------

FUZZ_SEED = 19
FUZZ_PER_GRAPH = 3


@pytest.mark.slow
def test_valid_configs_on_the_demo_graphs_verify_with_no_false_alarm_or_foreign_error() -> None:
    """Every variant and graph gets ``FUZZ_PER_GRAPH`` seeded configs; each is applied with verification on. A
    refusal (our own error for a config that does not fit the graph) is allowed, but must stay the exception."""
    from tests.support.fuzz import GRAPHS, VARIANTS, run_case, sample_config, trace_variant

    rng = random.Random(FUZZ_SEED)
    outcomes = []
    for variant in VARIANTS:
        step = trace_variant(variant)
        for graph in GRAPHS:
            outcomes += [run_case(step, variant, graph, sample_config(rng)) for _ in range(FUZZ_PER_GRAPH)]
    bad = [o for o in outcomes if o.kind in ("false_alarm", "foreign")]
    assert not bad, "\n\n".join(f"{o.kind} on {o.variant} {o.graph} with {o.config}:\n{o.detail}" for o in bad)
    applied = sum(o.kind == "applied" for o in outcomes)
    assert applied >= 0.8 * len(outcomes), [o.detail for o in outcomes if o.kind == "refused"]


@pytest.mark.slow
def test_auto_collective_bucketing_on_an_hsdp_reduce_scatter_first_backward_applies_and_says_what_it_dropped() -> None:
    """torch's scheduler makes cyclic ordering hints on this graph and used to raise its own ``RuntimeError: detected
    2 cyclic extra dep(s)``: the hints are dropped, the result verified (``apply``'s default), the record says so."""
    import copy

    from overlapcfg import load_config
    from overlapcfg.passes import apply
    from tests.support.fuzz import trace_variant

    step = trace_variant("hsdp_reduce_scatter_first")
    gm = copy.deepcopy(step.backward)
    with step.process_groups():
        apply(gm, load_config({"strategy": "auto", "policy": {"collective_bucketing": True}}),
              module_fqn_fn=step.module_fqn_fn("backward"), module_fqns=step.module_fqns, graph_kind="backward")
    notes = gm.meta["overlapcfg"].notes
    assert any("ordering hints that form a cycle and they were dropped" in n and "cyclic extra dep" in n
               for n in notes), notes
