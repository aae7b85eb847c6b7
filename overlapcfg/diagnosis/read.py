"""Read one rank's ``torch.profiler`` Chrome trace (JSON, or gzip'd JSON) into what a diagnosis needs, streamed.

A trace is streamed event by event with ``ijson`` (its C backend where installed), never loaded whole: a 20-step
trace of a small model is tens of MB of JSON, hundreds of MB as Python objects. What is kept is compact: ops as
four numbers in ``array``s, and as objects only the few events a diagnosis names (steps, labels, collectives,
memory samples). Memory therefore grows with the number of events at about 30 bytes each, a tenth of the JSON
they were read from; past ``MAX_EVENTS`` kept events the trace is refused with that reason.

Two passes over the file: the first reads the top-level keys before ``traceEvents`` (torch writes its metadata
there: ``distributedInfo``, ``baseTimeNanoseconds``, and ``overlapcfg`` where the backend left its record) and
stops at the events; the second streams ``traceEvents``. A bare array of events (the other form Chrome accepts)
is read too, without metadata.

Every way a file can be wrong (not there, not JSON, cut short, JSON that is not a trace, a gzip that is not one)
is an ``OverlapConfigError`` naming the file and what was found, never a parser's traceback.
"""

from __future__ import annotations

import gzip
import json
import re
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

import ijson

from overlapcfg.diagnosis.trace_events import (
    FSDP_LABEL,
    GRAPH_REGION,
    STEP_MARK,
    WAIT_OPS,
    collective_kind,
    is_comm_op,
    kernel_kind,
)
from overlapcfg.errors import Fault, OverlapConfigError

__all__ = ["MAX_EVENTS", "Comm", "Issue", "OpArrays", "RankTrace", "Span", "read_trace", "trace_error"]

MAX_EVENTS = 40_000_000
"""Events kept from one trace at most (about 1.2 GB of arrays); a larger trace is refused, saying so: profile
fewer steps (``schedule(active=...)``)."""
HEADER = "cannot diagnose these traces"
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
_COMPUTE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
_OP_CATS = frozenset({"cpu_op", "user_annotation"})
_NOT_COMPUTE = ("c10d", "_c10d", "record_param_comms")
"""Prefixes of every cpu_op that is not compute (collectives' issues and waits): one test sorts out most ops."""

OP_COMPUTE, OP_ISSUE, OP_WAIT = 0, 1, 2
"""What an op on a compute thread does: runs compute, issues a collective, waits for one."""


def trace_error(path: Path | str, message: str) -> OverlapConfigError:
    return OverlapConfigError([Fault(str(path), message)], header=HEADER)


@dataclass(slots=True)
class Span:
    """A named interval on a thread: a ``ProfilerStep#N``, an FSDP2 label, a compiled graph's region."""

    name: str
    start: float
    end: float
    thread: int


@dataclass(slots=True)
class Issue:
    """A collective as the issuing thread saw it (a ``c10d::`` / ``_c10d_functional::`` op or
    ``record_param_comms``): kind, full-size elements and dtype where the trace has shapes."""

    name: str
    kind: str
    start: float
    end: float
    thread: int
    numel: int | None = None
    dtype: str | None = None
    group: str | None = None


@dataclass(slots=True)
class Comm:
    """A collective running: a gloo event on a worker thread, or an NCCL kernel on a stream (``lane``)."""

    kind: str
    start: float
    end: float
    lane: str
    numel: int | None = None
    dtype: str | None = None
    correlation: int | None = None


@dataclass(slots=True)
class OpArrays:
    """Intervals (microseconds) with a thread and a code each, in read order."""

    start: array[float] = field(default_factory=lambda: array("d"))
    end: array[float] = field(default_factory=lambda: array("d"))
    thread: array[int] = field(default_factory=lambda: array("i"))
    code: array[int] = field(default_factory=lambda: array("b"))

    def add(self, start: float, end: float, thread: int, code: int) -> None:
        self.start.append(start)
        self.end.append(end)
        self.thread.append(thread)
        self.code.append(code)

    def __len__(self) -> int:
        return len(self.start)


@dataclass(slots=True)
class RankTrace:
    """What one rank's trace holds, for a diagnosis. Times are the trace's microseconds (``ts``); ``base_ns``
    (``baseTimeNanoseconds``) aligns ranks whose traces count from different bases."""

    path: Path
    rank: int | None
    world_size: int | None
    backend: str | None
    base_ns: int
    metadata: dict[str, Any]
    """Per compiled region (``3/forward``), the collectives ``overlapcfg.backend`` recorded in graph order
    (``overlapcfg.passes.trace_label``); empty for other traces."""
    threads: dict[tuple[object, object], int] = field(default_factory=dict)
    """``(pid, tid)`` -> thread index (a GPU stream's pid is ``gpu<device>``)."""
    thread_names: dict[int, str] = field(default_factory=dict)
    steps: list[Span] = field(default_factory=list)
    labels: list[Span] = field(default_factory=list)
    issues: list[Issue] = field(default_factory=list)
    comms: list[Comm] = field(default_factory=list)
    ops: OpArrays = field(default_factory=OpArrays)
    """CPU ops (codes ``OP_COMPUTE``, ``OP_ISSUE``, ``OP_WAIT``)."""
    kernels: OpArrays = field(default_factory=OpArrays)
    """GPU compute kernels and copies (thread: the stream's index)."""
    launches: OpArrays = field(default_factory=OpArrays)
    """CUDA runtime launch calls: start, end, thread, and (``correlations``) their correlation ids."""
    correlations: array[int] = field(default_factory=lambda: array("q"))
    memory: array[float] = field(default_factory=lambda: array("d"))
    """``ts, total allocated bytes`` pairs of the trace's ``[memory]`` events, flattened."""
    events: int = 0
    """Events read (all phases)."""

    @property
    def cuda(self) -> bool:
        return bool(self.kernels) or any(c.lane.startswith("gpu") for c in self.comms)

    @property
    def name(self) -> str:
        return self.path.name

    def thread(self, pid: object, tid: object) -> int:
        key = (pid, tid)
        index = self.threads.get(key)
        if index is None:
            index = self.threads[key] = len(self.threads)
        return index


def _open(path: Path) -> IO[bytes]:
    """The file's bytes, gunzipped where it starts with gzip's magic number (whatever its name)."""
    f = open(path, "rb")  # noqa: SIM115 - handed to the caller, which closes it
    magic = f.read(2)
    f.seek(0)
    if magic == b"\x1f\x8b":
        return cast(IO[bytes], gzip.GzipFile(fileobj=f, mode="rb"))
    return f


def _header(path: Path) -> tuple[dict[str, Any], str]:
    """The top-level keys before the events, and the ijson prefix of the events (``traceEvents.item`` or ``item``
    for a bare array)."""
    out: dict[str, Any] = {}
    with _open(path) as f:
        parser = ijson.parse(f, use_float=True)
        builder: ijson.ObjectBuilder | None = None
        key: str | None = None
        for prefix, event, value in parser:
            if prefix == "" and event == "start_array":
                return out, "item"
            if prefix == "" and event == "start_map":
                continue
            if prefix == "" and event == "map_key":
                if value == "traceEvents":
                    return out, "traceEvents.item"
                key, builder = value, ijson.ObjectBuilder()
                continue
            if prefix == "" and event == "end_map":
                break
            if builder is not None and key is not None:
                builder.event(event, value)
                if prefix == key and event in ("string", "number", "boolean", "null", "end_map", "end_array"):
                    out[key] = builder.value
                    builder = None
    raise trace_error(path, f"JSON that is not a Chrome trace: no 'traceEvents' array (top-level keys: "
                            f"{', '.join(list(out)[:8]) or 'none'})")


def _rank_of(path: Path, meta: dict[str, Any]) -> tuple[int | None, int | None, str | None]:
    info = meta.get("distributedInfo")
    if isinstance(info, str):  # some writers keep it as a JSON string
        try:
            info = json.loads(info)
        except ValueError:
            info = None
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        size = info.get("world_size")
        return info["rank"], size if isinstance(size, int) else None, info.get("backend")
    found = _RANK_IN_NAME.search(path.name)
    return (int(found.group(1)) if found else None), None, None


def _metadata(meta: dict[str, Any]) -> dict[str, Any]:
    """``{region: {"graph": ..., "collectives": [...]}}`` of the graphs ``overlapcfg.backend`` compiled."""
    out = {}
    for key, raw in meta.items():
        if not key.startswith(GRAPH_REGION):
            continue
        value = raw
        if isinstance(raw, str):
            try:
                value = json.loads(raw)
            except ValueError:
                continue
        if isinstance(value, dict) and isinstance(value.get("collectives"), list):
            out[key[len(GRAPH_REGION):]] = value
    return out


def _largest(args: dict[str, Any]) -> tuple[int | None, str | None]:
    """Elements and dtype of the largest tensor input of an op recorded with shapes (an all-gather's output, a
    reduce-scatter's input: the collective's full size)."""
    dims, types = args.get("Input Dims"), args.get("Input type")
    if not isinstance(dims, list):
        return None, None
    best, dtype = None, None
    for i, shape in enumerate(dims):
        if not isinstance(shape, list) or not shape or not all(isinstance(d, (int, float)) for d in shape):
            continue
        numel = 1
        for d in shape:
            numel *= int(d)
        if best is None or numel > best:
            best = numel
            dtype = types[i] if isinstance(types, list) and i < len(types) and isinstance(types[i], str) else None
    return best, dtype


def _param_comms(args: dict[str, Any]) -> tuple[str, int | None, str | None, str | None]:
    """``record_param_comms``' collective name, full-size elements, dtype and process group."""
    name = str(args.get("Collective name", "other"))
    sizes = [args.get(k) for k in ("In msg nelems", "Out msg nelems")]
    numel = max((int(s) for s in sizes if isinstance(s, (int, float))), default=None)
    dtype = args.get("dtype")
    group = args.get("Process Group Name", args.get("pg_name"))
    return name, numel, dtype if isinstance(dtype, str) else None, None if group is None else str(group)


def _events(path: Path, prefix: str) -> Iterator[dict[str, Any]]:
    with _open(path) as f:
        for event in ijson.items(f, prefix, use_float=True):
            if isinstance(event, dict):
                yield event


def read_trace(path: str | Path) -> RankTrace:
    """Stream ``path`` into a ``RankTrace``; ``OverlapConfigError`` naming the file where it is not a readable
    trace."""
    path = Path(path)
    if not path.is_file():
        raise trace_error(path, "no such file")
    try:
        meta, prefix = _header(path)
        rank, world, backend = _rank_of(path, meta)
        base = meta.get("baseTimeNanoseconds")
        trace = RankTrace(path=path, rank=rank, world_size=world, backend=backend,
                          base_ns=int(base) if isinstance(base, (int, float)) else 0, metadata=_metadata(meta))
        for event in _events(path, prefix):
            _take(trace, event)
            if trace.events > MAX_EVENTS:
                raise trace_error(path, f"more than {MAX_EVENTS:,} events: too large to diagnose within bounded "
                                        "memory; profile fewer steps (torch.profiler.schedule(active=...))")
    except OverlapConfigError:
        raise
    except ijson.IncompleteJSONError as err:
        raise trace_error(path, f"cut short or not JSON ({_first_line(err)}): was the trace still being written?"
                          ) from None
    except ijson.JSONError as err:
        raise trace_error(path, f"not valid JSON ({_first_line(err)})") from None
    except (OSError, EOFError, UnicodeDecodeError, ValueError) as err:
        raise trace_error(path, f"unreadable ({type(err).__name__}: {_first_line(err)})") from None
    return trace


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else type(err).__name__


def _take(trace: RankTrace, e: dict[str, Any]) -> None:
    """One event into ``trace``: the few kinds a diagnosis reads; everything else is counted and dropped."""
    trace.events += 1
    ph = e.get("ph")
    if ph == "X":
        _take_complete(trace, e)
    elif ph == "i" and e.get("name") == "[memory]":
        args = e.get("args") or {}
        total = args.get("Total Allocated")
        ts = e.get("ts")
        if isinstance(total, (int, float)) and isinstance(ts, (int, float)):
            trace.memory.append(float(ts))
            trace.memory.append(float(total))
    elif ph == "M" and e.get("name") == "thread_name":
        name = (e.get("args") or {}).get("name")
        if isinstance(name, str):
            trace.thread_names[trace.thread(e.get("pid"), e.get("tid"))] = name


def _take_complete(trace: RankTrace, e: dict[str, Any]) -> None:
    name, cat, ts, dur = e.get("name"), e.get("cat"), e.get("ts"), e.get("dur")
    if not isinstance(name, str) or not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)):
        return
    start, end = float(ts), float(ts) + float(dur)
    if cat == "cpu_op":  # most events: ops, told apart by cheap string tests first
        thread = trace.thread(e.get("pid"), e.get("tid"))
        if not name.startswith(_NOT_COMPUTE):
            trace.ops.add(start, end, thread, OP_COMPUTE)
        elif name in WAIT_OPS:
            trace.ops.add(start, end, thread, OP_WAIT)
        elif name == "record_param_comms" or is_comm_op(name):
            args = e.get("args") or {}
            if name == "record_param_comms":
                kind_name, numel, dtype, group = _param_comms(args)
            else:
                (numel, dtype), kind_name, group = _largest(args), name, None
            trace.issues.append(Issue(name, collective_kind(kind_name), start, end, thread, numel, dtype, group))
            trace.ops.add(start, end, thread, OP_ISSUE)
        else:
            trace.ops.add(start, end, thread, OP_COMPUTE)
    elif cat in _OP_CATS:  # user annotations: gloo's collectives, steps, labels
        thread = trace.thread(e.get("pid"), e.get("tid"))
        if name.startswith("gloo:"):
            numel, dtype = _largest(e.get("args") or {})
            trace.comms.append(Comm(collective_kind(name), start, end, f"thread{thread}", numel, dtype))
        elif STEP_MARK.match(name):
            trace.steps.append(Span(name, start, end, thread))
        elif name.startswith(GRAPH_REGION) or FSDP_LABEL.match(name):
            trace.labels.append(Span(name, start, end, thread))
    elif cat in _COMPUTE_CATS:
        stream = trace.thread(f"gpu{e.get('pid')}", e.get("tid"))
        kind = kernel_kind(name) if cat == "kernel" else None
        if kind is None:
            trace.kernels.add(start, end, stream, OP_COMPUTE)
        else:
            correlation = (e.get("args") or {}).get("correlation")
            trace.comms.append(Comm(kind, start, end, f"gpu{e.get('pid')}:{e.get('tid')}",
                                    correlation=int(correlation) if isinstance(correlation, (int, float)) else None))
    elif cat in ("cuda_runtime", "cuda_driver"):
        correlation = (e.get("args") or {}).get("correlation")
        if isinstance(correlation, (int, float)) and "aunch" in name:
            trace.launches.add(start, end, trace.thread(e.get("pid"), e.get("tid")), OP_ISSUE)
            trace.correlations.append(int(correlation))
