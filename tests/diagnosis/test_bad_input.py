"""Every way a set of traces can be wrong is one clear error naming the file (or a note), never a parser's
traceback; big traces are streamed in bounded memory."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from overlapcfg.diagnosis import diagnose
from overlapcfg.errors import OverlapConfigError


def _only(err: pytest.ExceptionInfo[OverlapConfigError]) -> str:
    text = str(err.value)
    assert "Traceback" not in text
    return text


def test_a_truncated_trace_is_named_and_said_to_be_cut_short(gpu_traces: Path) -> None:
    path = gpu_traces / "rank1.json"
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(OverlapConfigError) as err:
        diagnose(gpu_traces)
    text = _only(err)
    assert "rank1.json" in text and "cut short" in text


def test_json_that_is_not_a_trace_says_what_it_holds(tmp_path: Path, gpu_traces: Path) -> None:
    (gpu_traces / "rank1.json").write_text(json.dumps({"loss": [1.0, 0.5], "step": 3}))
    with pytest.raises(OverlapConfigError) as err:
        diagnose(gpu_traces)
    text = _only(err)
    assert "rank1.json" in text and "not a Chrome trace" in text and "loss, step" in text


def test_text_that_is_not_json_and_a_broken_gzip_are_named(gpu_traces: Path) -> None:
    (gpu_traces / "rank1.json").write_text("step,loss\n1,0.5\n")
    with pytest.raises(OverlapConfigError, match=r"rank1\.json"):
        diagnose(gpu_traces)
    (gpu_traces / "rank1.json").write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(OverlapConfigError, match=r"rank1\.json"):
        diagnose(gpu_traces)


def test_gzip_traces_read_as_the_json_they_hold(gpu_traces: Path) -> None:
    plain = diagnose(gpu_traces)
    for path in list(gpu_traces.iterdir()):
        path.with_name(path.name + ".gz").write_bytes(gzip.compress(path.read_bytes()))
        path.unlink()
    zipped = diagnose(gpu_traces)
    assert zipped.rank_steps == plain.rank_steps and zipped.buckets == plain.buckets


def test_one_rank_only_is_diagnosed_with_a_note(gpu_traces: Path) -> None:
    r = diagnose(gpu_traces / "rank0.json")
    assert r.ranks == (0,) and not r.skew and not r.divergence
    assert any("1 of 2 ranks" in n or "one rank only" in n for n in r.notes)


def test_a_trace_without_collectives_is_an_error_naming_it(gpu_traces: Path) -> None:
    for path in gpu_traces.iterdir():
        data = json.loads(path.read_text())
        data["traceEvents"] = [e for e in data["traceEvents"] if not str(e.get("name", "")).startswith("nccl")
                               and e.get("name") != "record_param_comms"]
        path.write_text(json.dumps(data))
    with pytest.raises(OverlapConfigError) as err:
        diagnose(gpu_traces)
    text = _only(err)
    assert "no collectives" in text and "rank0.json" in text


def test_traces_of_different_steps_are_refused(gpu_traces: Path) -> None:
    path = gpu_traces / "rank1.json"
    path.write_text(path.read_text().replace("ProfilerStep#5", "ProfilerStep#9"))
    with pytest.raises(OverlapConfigError) as err:
        diagnose(gpu_traces)
    assert "different steps" in _only(err)


def test_traces_of_different_jobs_are_refused(gpu_traces: Path) -> None:
    path = gpu_traces / "rank1.json"
    data = json.loads(path.read_text())
    data["baseTimeNanoseconds"] += 3_600 * 10**9  # the same steps, an hour later
    path.write_text(json.dumps(data))
    with pytest.raises(OverlapConfigError) as err:
        diagnose(gpu_traces)
    assert "different jobs" in _only(err)


def test_two_traces_of_one_rank_are_refused(gpu_traces: Path) -> None:
    shutil.copy(gpu_traces / "rank0.json", gpu_traces / "again.json")
    with pytest.raises(OverlapConfigError) as err:
        diagnose(gpu_traces)
    assert "rank 0 again" in _only(err)


def test_a_missing_path_and_an_empty_directory_are_named(tmp_path: Path) -> None:
    with pytest.raises(OverlapConfigError, match="no such file"):
        diagnose(tmp_path / "nope")
    with pytest.raises(OverlapConfigError, match="no trace files"):
        diagnose(tmp_path)
