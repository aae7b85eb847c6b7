"""The FQN pattern grammar: what each form matches, what is rejected and which hint the user gets."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from overlapcfg.config.module_index import ModuleIndex, suggest_fixes
from overlapcfg.config.patterns import (
    AnySegment,
    AnySegments,
    IndexRange,
    Literal,
    Pattern,
    compile_pattern,
)
from overlapcfg.errors import OverlapConfigError
from overlapcfg.module_paths import is_inside, normalize_fqns, strip_wrappers


def _is_literal(pattern: Pattern) -> bool:
    """The pattern names one FQN exactly (no wildcard, no range)."""
    return all(isinstance(s, Literal) for s in pattern.segments)


# (pattern, fqn, expected)
MATCH_TABLE = [
    # literals
    ("layers", "layers", True),
    ("layers", "layers.0", False),
    ("layers.0", "layers.0", True),
    ("layers.0", "layers.01", False),
    ("layers.1", "layers.10", False),
    ("norm", "", False),
    # '*' is exactly one segment
    ("layers.*", "layers.0", True),
    ("layers.*", "layers.12", True),
    ("layers.*", "layers", False),
    ("layers.*", "layers.0.attention", False),
    ("*", "", False),
    ("*", "norm", True),
    ("*.attention", "layers.0.attention", False),
    ("*.*.attention", "layers.0.attention", True),
    # '**' at the start
    ("**", "", True),
    ("**", "layers.0.attention.wq", True),
    ("**.wq", "wq", True),
    ("**.wq", "layers.0.attention.wq", True),
    ("**.wq", "layers.0.attention.wqx", False),
    ("**.attention", "layers.0.attention.wq", False),
    # '**' in the middle
    ("layers.**.wq", "layers.wq", True),
    ("layers.**.wq", "layers.0.attention.wq", True),
    ("layers.**.wq", "output.wq", False),
    ("layers.*.**.w1", "layers.0.feed_forward.w1", True),
    ("layers.*.**.w1", "layers.w1", False),
    # '**' at the end
    ("layers.**", "layers", True),
    ("layers.**", "layers.3.feed_forward.w2", True),
    ("layers.**", "layersx", False),
    ("layers.0.**", "layers.10.attention", False),
    # repeated '**' collapses and still matches
    ("**.**.wq", "layers.0.attention.wq", True),
    ("**.0.**", "layers.0.attention", True),
    ("**.0.**", "layers.10.attention", False),
    # ranges are half-open and integer-valued
    ("layers.0:16", "layers.0", True),
    ("layers.0:16", "layers.15", True),
    ("layers.0:16", "layers.16", False),
    ("layers.2:4", "layers.1", False),
    ("layers.2:4", "layers.3", True),
    ("layers.:2", "layers.1", True),
    ("layers.:2", "layers.2", False),
    ("layers.8:", "layers.8", True),
    ("layers.8:", "layers.100", True),
    ("layers.8:", "layers.7", False),
    ("layers.0:16", "layers.attention", False),
    ("layers.0:4.attention", "layers.3.attention", True),
    ("**.0:2", "layers.1", True),
    # wrappers on the module side are ignored
    ("layers.0.attention", "_orig_mod.layers.0._checkpoint_wrapped_module.attention", True),
    ("layers.*", "_fsdp_wrapped_module.layers._fsdp_wrapped_module.3", True),
    ("**", "_orig_mod", True),
    ("norm", "_orig_mod.norm", True),
]


@pytest.mark.parametrize(("pattern", "fqn", "expected"), MATCH_TABLE)
def test_pattern_matches_whole_fqn_segment_wise(pattern: str, fqn: str, expected: bool) -> None:
    assert compile_pattern(pattern).matches(fqn) is expected


# (pattern, substrings the message must contain)
REJECT_TABLE = [
    ("layers.[0-15]", ["'layers.[0-15]'", "character class", "use layers.0:16"]),
    ("layers.[2-3].attention", ["use layers.2:4.attention"]),
    ("layers.[3]", ["use layers.3"]),
    ("layers.[0-3,5]", ["'[...]' is not supported", "start:stop"]),
    ("layer*", ["'*' matches a whole segment", "layer.* for the children"]),
    ("layers.*.attention*", ["'*' matches a whole segment", "write layers.*.*", "or list the exact names"]),
    ("lay?rs", ["'?' is not supported", "'*' matches a whole segment"]),
    ("*norm", ["'*' matches a whole segment", "list the exact names"]),
    ("layers..0", ["empty segment", "write layers.0"]),
    (".layers", ["empty segment", "leading or trailing", "write layers"]),
    ("layers.", ["empty segment", "write layers"]),
    (".", ["empty segment"]),
    ("", ["at least one segment", "'**'"]),
    ("***", ["not a wildcard", "'**' for any number"]),
    ("layers.3:3", ["empty", "start < stop"]),
    ("layers.5:2", ["empty", "start < stop"]),
    ("layers.:", ["bare ':'", "'0:'"]),
    ("layers.-2:", ["non-negative"]),
    ("layers.a:b", ["':' is only allowed in an index range"]),
    ("_orig_mod.layers.0", ["wrapper segment '_orig_mod'", "write layers.0"]),
    ("layers.{0,1}", ["alternatives are not supported"]),
    ("layers. 0", ["whitespace"]),
]


@pytest.mark.parametrize(("pattern", "needles"), REJECT_TABLE)
def test_bad_syntax_is_rejected_with_hint(pattern: str, needles: list[str]) -> None:
    with pytest.raises(OverlapConfigError) as info:
        compile_pattern(pattern, path="plan.buckets[0]")
    message = str(info.value)
    assert message.startswith("plan.buckets[0]: bad pattern ")
    for needle in needles:
        assert needle in message
    assert len(info.value.faults) == 1


def test_non_string_pattern_is_api_misuse() -> None:
    with pytest.raises(TypeError, match="expects a str"):
        compile_pattern(3)  # type: ignore[arg-type]


def test_compiled_segments_are_typed() -> None:
    pattern = compile_pattern("**.**.layers.*.0:4.8:")
    assert pattern.segments == (
        AnySegments(),
        Literal("layers"),
        AnySegment(),
        IndexRange(0, 4),
        IndexRange(8, None),
    )
    assert str(pattern) == "**.**.layers.*.0:4.8:"
    assert not _is_literal(pattern)
    assert _is_literal(compile_pattern("layers.0.attention"))


def test_strip_wrappers_drops_only_wrapper_segments() -> None:
    assert strip_wrappers("_orig_mod.layers.0._checkpoint_wrapped_module.attention") == "layers.0.attention"
    assert strip_wrappers("_orig_mod") == ""
    assert strip_wrappers("layers.0._orig_mode") == "layers.0._orig_mode"


def test_normalize_fqns_merges_wrapped_duplicates_in_first_seen_order() -> None:
    fqns = ["", "_orig_mod", "_orig_mod.norm", "norm", "_orig_mod.output"]
    assert normalize_fqns(fqns) == ("", "norm", "output")


def test_module_index_match_keeps_model_order_and_strips_wrappers() -> None:
    fqns = ["", "_orig_mod", "_orig_mod.layers", "_orig_mod.layers.10", "_orig_mod.layers.2", "_orig_mod.norm"]
    assert ModuleIndex(fqns).match("layers.*") == ["layers.10", "layers.2"]
    assert ModuleIndex(fqns).match(compile_pattern("**")) == ["", "layers", "layers.10", "layers.2", "norm"]


@pytest.mark.parametrize(
    ("fqn", "ancestor", "expected"),
    [
        ("layers.1", "layers.1", True),
        ("layers.1.attention", "layers.1", True),
        ("layers.10", "layers.1", False),
        ("layers.10.attention", "layers.1", False),
        ("norm", "", True),
        ("", "norm", False),
    ],
)
def test_is_inside_compares_whole_segments(fqn: str, ancestor: str, expected: bool) -> None:
    assert is_inside(fqn, ancestor) is expected


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("layer.*", ["layers.*"]),
        ("*.wq", ["**.wq"]),
        ("layer.*.atention", ["layers.*.attention"]),
        ("zzzz", []),
    ],
)
def test_suggest_fixes_finds_patterns_that_match(pattern: str, expected: list[str]) -> None:
    fqns = ["", "layers", "layers.0", "layers.0.attention", "layers.0.attention.wq", "norm"]
    assert suggest_fixes(compile_pattern(pattern), fqns) == expected


@pytest.mark.timeout(120)  # a hang guard, not a speed bound: backtracking over 30 '**' on 200 segments never ends
def test_deep_wildcards_do_not_blow_up() -> None:
    pattern = compile_pattern(".".join(["**", "*"] * 30) + ".never")
    fqn = ".".join(["x"] * 200)
    assert not pattern.matches(fqn)


_segment = st.from_regex(r"[a-z_][a-z0-9_]{0,6}|[0-9]{1,3}", fullmatch=True).filter(
    lambda s: s not in ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
)
_fqn = st.lists(_segment, min_size=1, max_size=6).map(".".join)


@given(_fqn, _fqn)
def test_literal_pattern_matches_exactly_itself(text: str, other: str) -> None:
    pattern = compile_pattern(text)
    assert _is_literal(pattern)
    assert pattern.matches(text)
    assert pattern.matches(other) is (other == text)


@given(st.one_of(st.just(""), _fqn))
def test_double_star_matches_everything(fqn: str) -> None:
    assert compile_pattern("**").matches(fqn)


@given(_fqn)
def test_star_per_segment_matches_exactly_that_depth(fqn: str) -> None:
    depth = fqn.count(".") + 1
    assert compile_pattern(".".join(["*"] * depth)).matches(fqn)
    assert not compile_pattern(".".join(["*"] * (depth + 1))).matches(fqn)


@given(st.integers(0, 50), st.integers(1, 50), st.integers(0, 120))
def test_range_is_half_open(start: int, width: int, index: int) -> None:
    pattern = compile_pattern(f"layers.{start}:{start + width}")
    assert pattern.matches(f"layers.{index}") is (start <= index < start + width)
