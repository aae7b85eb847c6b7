"""load_config against hostile or odd input: every bad input is an OverlapConfigError, with bounded work, no
file contents echoed, no resolvers run, and YAML that reads back what was dumped."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from overlapcfg import OverlapConfigError, load_config

BILLION_LAUGHS = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
"""


def fault_text(src: object, **kw: object) -> str:
    with pytest.raises(OverlapConfigError) as info:
        load_config(src, **kw)  # type: ignore[arg-type]
    return str(info.value)


@pytest.mark.parametrize("text", ["78", "1.5", "true", "1e3", "null", "", "~", "'text'", "- a\n- b\n"])
def test_yaml_scalars_and_lists_are_config_errors_not_crashes(text: str) -> None:
    assert "expected a mapping" in fault_text(text)


@pytest.mark.parametrize("depth", [110, 1_000, 10_000])
def test_deeply_nested_flow_list_is_refused_with_the_limit(depth: int) -> None:
    msg = fault_text("plan: " + "[" * depth + "]" * depth)
    assert "nesting deeper than" in msg or "maximum nesting depth" in msg  # ours, or libyaml's own (1,000)


def test_deeply_nested_dict_is_refused_with_the_limit() -> None:
    data: dict[str, object] = {}
    cur = data
    for _ in range(1_000):
        cur["policy"] = {}
        cur = cur["policy"]  # type: ignore[assignment]
    assert "nesting deeper than" in fault_text(data)


def test_self_referencing_dict_is_refused() -> None:
    data: dict[str, object] = {"plan": {}}
    data["plan"]["buckets"] = data  # type: ignore[index]
    assert "contains itself" in fault_text(data)


@pytest.mark.timeout(30)
def test_billion_laughs_is_refused_by_the_expanded_size_limit() -> None:
    assert len(BILLION_LAUGHS) < 400
    msg = fault_text(BILLION_LAUGHS)
    assert "once aliases are expanded" in msg


def test_recursive_alias_is_refused() -> None:
    assert "contains itself" in fault_text("plan: &p {buckets: [*p]}\n")


def test_duplicate_keys_are_refused() -> None:
    assert "duplicate key 'plan'" in fault_text("plan: llama_layers\nplan: single_bucket\n")


def test_a_str_naming_an_existing_file_is_not_read(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0:TOPSECRET-42:/root:/bin/bash\n")
    msg = fault_text(str(secret))
    assert "pass pathlib.Path(" in msg and "TOPSECRET" not in msg


def test_a_non_config_file_is_described_not_echoed(tmp_path: Path) -> None:
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0:TOPSECRET-42:/root:/bin/bash\ndaemon:x:1:1::/usr/sbin:/usr/sbin/nologin\n")
    msg = fault_text(secret)
    assert "TOPSECRET" not in msg and "expected a mapping" in msg and str(secret) in msg


def test_yaml_syntax_error_in_a_file_names_the_file_and_position_only(tmp_path: Path) -> None:
    bad = tmp_path / "overlap.yaml"
    bad.write_text("plan: llama_layers\npolicy: {forward_prefetch: 2\nTOPSECRET: [\n")
    msg = fault_text(bad)
    assert str(bad) in msg and "line " in msg and "TOPSECRET" not in msg


def test_binary_file_is_a_config_error(tmp_path: Path) -> None:
    blob = tmp_path / "weights.bin"
    blob.write_bytes(bytes(range(256)) * 4)
    assert "not UTF-8 text" in fault_text(blob)


def test_env_resolver_is_refused_and_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OVERLAPCFG_SECRET", "hunter2")
    msg = fault_text("plan: llama_layers\npolicy:\n  forward_prefetch: ${oc.env:OVERLAPCFG_SECRET}\n")
    assert "overlap.policy.forward_prefetch: interpolation '${oc.env:OVERLAPCFG_SECRET}' calls resolver" in msg
    assert "hunter2" not in msg


@pytest.mark.parametrize("body", ["oc.decode:'2'", "oc.env:HOME,x", "my_resolver:1", "now:%Y"])
def test_every_resolver_is_refused(body: str) -> None:
    msg = fault_text(f"plan: llama_layers\npolicy:\n  forward_prefetch: ${{{body}}}\n")
    assert "calls resolver" in msg and "overlap.policy.forward_prefetch" in msg


def test_key_references_are_resolved_in_yaml_text() -> None:
    cfg = load_config("overlap:\n  plan: llama_layers\n"
                      "  policy: {forward_prefetch: '${.backward_prefetch}', backward_prefetch: 3}\n")
    assert cfg.policy.forward_prefetch == 3
    cfg = load_config("plan: {buckets: ['${plan.name}.*'], name: layers}\n")
    assert cfg.plan is not None and cfg.plan.buckets == ("layers.*",)


def test_resolver_reached_through_a_reference_in_a_dictconfig_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OVERLAPCFG_SECRET", "7")
    overlap = {"plan": "llama_layers", "policy": {"forward_prefetch": "${depth}"}}
    root = OmegaConf.create({"depth": "${oc.env:OVERLAPCFG_SECRET}", "trainer": {"overlap": overlap}})
    from overlapcfg import from_hydra

    with pytest.raises(OverlapConfigError) as info:
        from_hydra(root.trainer.overlap)
    assert "depth: interpolation '${oc.env:OVERLAPCFG_SECRET}' calls resolver 'oc.env'" in str(info.value)


def test_dictconfig_references_across_the_composed_config_still_work() -> None:
    from overlapcfg import from_hydra

    root = OmegaConf.create({"depth": 2, "trainer": {"overlap": {"plan": "llama_layers",
                                                                 "policy": {"forward_prefetch": "${depth}"}}}})
    assert from_hydra(root.trainer.overlap).policy.forward_prefetch == 2


def test_exponential_string_interpolation_is_refused() -> None:
    lines = ["plan: llama_layers", "policy: {forward_prefetch: 1}", "overrides:",
             "  - {match: '${x40}', forward_prefetch: 1}", "x0: ab"]
    lines += [f"x{i}: '${{x{i - 1}}}${{x{i - 1}}}'" for i in range(1, 41)]
    msg = fault_text("\n".join(lines))
    assert "longer than" in msg


def test_sexagesimal_range_in_a_yaml_list_stays_a_string() -> None:
    cfg = load_config("plan:\n  buckets:\n    - [layers.0, 4:8]\n")
    assert cfg.plan is not None and cfg.plan.buckets == (("layers.0", "4:8"),)


def test_sexagesimal_integer_from_omegaconf_says_quote_the_range() -> None:
    node = OmegaConf.create("plan:\n  buckets:\n    - [layers.0, 4:8]\n")  # OmegaConf reads 4:8 as 248
    assert "quote the range '4:8'" in fault_text(node)


def test_integer_module_names_say_quote_it_without_a_false_length_fault() -> None:
    with pytest.raises(OverlapConfigError) as info:
        load_config({"plan": {"buckets": [[0, 2]]}})
    messages = [f.message for f in info.value.faults]
    assert messages[0] == "got an integer 0; module names are strings: quote it ('0')"
    assert not any("at least 1 item" in m for m in messages), messages


@pytest.mark.parametrize("name", ["1e3", "true", "null", "4:8", "${x}", "\\${x}", "yes", "0x1F", ".inf", "~"])
def test_dump_yaml_round_trips_strings_that_look_like_other_things(name: str) -> None:
    from overlapcfg.config.load import dump_yaml

    cfg = load_config({"plan": {"buckets": ["layers.*"], "name": name}})
    assert load_config(dump_yaml(cfg.model_dump(mode="json"))) == cfg


def test_long_bucket_list_round_trips() -> None:
    from overlapcfg.config.load import dump_yaml

    cfg = load_config({"plan": {"buckets": [[f"layers.{i}", f"extra.{i}"] for i in range(5_000)]}})
    assert load_config(dump_yaml(cfg.model_dump(mode="json"))) == cfg


def test_path_like_objects_are_read_as_files(tmp_path: Path) -> None:
    class Where(os.PathLike[str]):
        def __fspath__(self) -> str:
            return str(tmp_path / "o.yaml")

    (tmp_path / "o.yaml").write_text("plan: llama_layers\n")
    assert load_config(Where()).plan is not None


# --- work bounded by the input's size, never by waiting ------------------------------------------------------------


def test_yaml_text_over_the_byte_limit_is_refused_before_it_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    from overlapcfg.config import yaml_files as loader  # the one YAML reader

    def never(text: str) -> object:
        raise AssertionError("parsed")

    monkeypatch.setattr(loader, "load_yaml", never)
    msg = fault_text("plan: " + "x" * (loader.MAX_FILE_BYTES + 1))
    assert f"config text is at most {loader.MAX_FILE_BYTES:,} bytes" in msg and len(msg) < 300


def test_a_file_over_the_byte_limit_is_refused_after_reading_one_byte_past_it(tmp_path: Path) -> None:
    from overlapcfg.config.load import MAX_FILE_BYTES

    big = tmp_path / "big.yaml"
    big.write_bytes(b"plan: " + b"x" * MAX_FILE_BYTES)
    assert f"is more than {MAX_FILE_BYTES:,} bytes" in fault_text(big)


def test_values_are_counted_before_the_document_is_composed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A list of more values than the limit (under the byte limit) stops at value limit + 1 of the event stream: it
    is never composed (the old check composed all of it, then counted: ~56 s and 3.5 GB at 16 MB). The limit is
    lowered to 5,000 here, as for the pure-Python composer below: the rule is the same, and reading 500,000 events
    took seconds of the fast tier."""
    import yaml

    from overlapcfg.config import safe_yaml

    assert safe_yaml.MAX_NODES == 500_000  # the documented limit, which the lowered one stands for
    monkeypatch.setattr(safe_yaml, "MAX_NODES", 5_000)
    events = []
    parse = yaml.parse

    def counting_parse(*args: object, **kwargs: object) -> object:
        for event in parse(*args, **kwargs):
            events.append(1)
            yield event

    def never(self: object) -> object:
        raise AssertionError("composed")

    monkeypatch.setattr(yaml, "parse", counting_parse)
    for loader in (safe_yaml._Loader, getattr(safe_yaml, "_CLoader", safe_yaml._Loader)):
        monkeypatch.setattr(loader, "get_single_node", never)
    text = "plan:\n  buckets:\n" + "".join(f"  - l{i}\n" for i in range(6_000))
    assert "more than 5,000 values (line" in fault_text(text)
    assert len(events) < 5_010


def test_the_pure_python_composer_stops_at_the_value_limit_too(monkeypatch: pytest.MonkeyPatch) -> None:
    from overlapcfg.config import safe_yaml

    monkeypatch.setattr(safe_yaml, "MAX_NODES", 1_000)  # the pure-Python parser is slow; the rule is the same
    loader = safe_yaml._Loader("[" + "1, " * 1_000 + "]")
    with pytest.raises(safe_yaml.YamlLimitError, match=r"more than 1,000 values \(line 1, column 2999\)"):
        loader.get_single_node()
    loader.dispose()


@pytest.mark.skipif(not os.access("/proc/kmsg", os.R_OK), reason="/proc/kmsg is readable by root only")
def test_a_kernel_file_that_looks_regular_never_blocks() -> None:
    """procfs says ``/proc/kmsg`` is a regular file of size 0; reading it to the end waits for kernel messages
    forever. (Run in a child: a blocked read is not interruptible from here. As root, it consumes the kernel
    messages pending right now, as any reader of ``/proc/kmsg`` does.)"""
    import subprocess
    import sys

    code = ("from pathlib import Path\nfrom overlapcfg import load_config, OverlapConfigError\n"
            "try:\n    load_config(Path('/proc/kmsg'))\nexcept OverlapConfigError as e:\n    print('refused', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0 and "refused" in out.stdout, out.stderr[-2000:]
    assert "/proc/kmsg" in out.stdout


def test_a_fifo_with_a_writer_is_refused_without_reading_it(tmp_path: Path) -> None:
    fifo = tmp_path / "overlap.yaml"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # a writer that never writes: a read would wait forever
    try:
        assert "is not a file" in fault_text(fifo)
    finally:
        os.close(writer)


# --- text that is not Unicode, values that are huge ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dict", "DictConfig"])
def test_a_lone_surrogate_is_refused_at_load_with_its_path(kind: str) -> None:
    """``layers.\\udcff`` (what ``surrogateescape`` makes of a stray byte) used to load, then crash ``to_yaml``."""
    data = {"plan": {"buckets": ["layers.\udcff"]}}
    msg = fault_text(data if kind == "dict" else OmegaConf.create(data))
    assert "overlap.plan.buckets[0]: 'layers.\\udcff' holds a lone surrogate '\\udcff' at character 7" in msg


def test_yaml_holding_a_lone_surrogate_is_refused_with_its_position() -> None:
    msg = fault_text("plan: llama_layers\npolicy: {x\udcff: 1}\n")
    assert "YAML text holds a lone surrogate '\\udcff' (line 2, column 11)" in msg
    assert "invalid Unicode character escape" in fault_text('plan: {buckets: ["layers.\\udcff"]}\n')  # PyYAML's


def test_a_lone_surrogate_in_a_key_is_refused() -> None:
    assert "(a key): 'forward\\udcff' holds a lone surrogate" in fault_text({"policy": {"forward\udcff": 1}})


MEGABYTE = "x" * 2**20
HUGE_VALUES = {
    "unknown strategy": {"strategy": MEGABYTE},
    "unknown plan preset": {"plan": MEGABYTE},
    "unknown key": {MEGABYTE: 1},
    "unknown policy key": {"plan": "llama_layers", "policy": {MEGABYTE: 1}},
    "bad depth": {"plan": "llama_layers", "policy": {"forward_prefetch": MEGABYTE}},
    "bad literal": {"plan": "llama_layers", "policy": {"issue_order": MEGABYTE}},
    "a 5,000-digit depth": {"plan": "llama_layers", "policy": {"forward_prefetch": 10**5000}},
    "a 5,000-digit pattern": {"plan": {"buckets": [10**5000]}},
    "YAML text": f"strategy: {MEGABYTE}\n",
}


@pytest.mark.parametrize("case", list(HUGE_VALUES))
def test_errors_name_huge_values_without_echoing_them(case: str) -> None:
    msg = fault_text(HUGE_VALUES[case])
    assert len(msg) < 1500, msg[:300]
    assert "characters)" in msg or "digits" in msg
