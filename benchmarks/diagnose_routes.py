"""``overlapcfg.diagnose`` on jobs traced by their own ``torch.profiler``, through the three routes (eager FSDP2
via ``overlapcfg.fully_shard``, the Lightning integration, ``torch.compile(backend=overlapcfg.backend(cfg))``), 2 gloo
ranks, a Hugging Face Llama, each with a deliberately poor config (every parameter its own bucket, depth 0) and a
good one (``tests/support/diagnose_jobs.py``: ``CONFIGS``). Per run: exposed communication per step from
``diagnose`` against an independent reading of the same files (``tests/support/trace_oracle.py``), unattributed
collectives, the proposal; then the proposed config is run and timed against the config it came from, in turns
(A B A B: the machine's load drifts), each step the slowest rank's wall time; spreads are half the interquartile
range of the steps.

Then the speed and memory of ``diagnose`` itself on a 2-rank trace of ``--steps`` profiled steps (a fresh process:
peak resident memory against the traces' size), and, with ``--large-mb``, on one generated trace of that size
(``tests/support/big_trace.py``).

    python benchmarks/diagnose_routes.py                       # all of it (minutes on 2 loaded cores)
    python benchmarks/diagnose_routes.py --routes fsdp2 --large-mb 2000
    python benchmarks/diagnose_routes.py --routes compiled --ab-best   # also time the best change where nothing
                                                                        # is proposed (is its small gain real?)

Prints tables and writes ``benchmarks/results/diagnose_routes.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from overlapcfg.demo.gloo import run_on_gloo
from overlapcfg.diagnosis import diagnose
from tests.support.big_trace import write_big_trace
from tests.support.diagnose_jobs import CONFIGS, route_job
from tests.support.trace_oracle import exposed_per_step

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = {"hidden": 128, "layers": 2, "profiled": 8, "timed": 8}
"""8 profiled steps: the least from which ``diagnose`` takes half the interquartile range as its noise."""
_MEASURE = """
import json, sys, time
from overlapcfg.diagnosis import diagnose
# everything diagnose imports:
import overlapcfg.diagnosis.diagnose_run, overlapcfg.diagnosis.render_diagnosis, overlapcfg.config


def status(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key))


with open("/proc/self/clear_refs", "w") as f:  # Linux: reset the peak (VmHWM) to the resident size now
    f.write("5")
before = status("VmRSS:")
start = time.perf_counter()
r = diagnose(sys.argv[1])
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "peak_growth_kb": status("VmHWM:") - before, "steps": len(r.steps),
                  "collectives": r.collectives}))
"""


def _measure(path: Path) -> dict[str, Any]:
    """Seconds ``diagnose`` takes, and the most resident memory it adds (the peak after imports, reset through
    ``/proc/self/clear_refs``, less the resident size then), in a fresh process."""
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(path)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _spread(times: list[float]) -> float:
    """Half the interquartile range: on a shared machine one step in ten can take several times the others, and
    half the range would be that step's."""
    if len(times) < 2:
        return 0.0
    q = statistics.quantiles(times, n=4)
    return (q[2] - q[0]) / 2


def _ms(s: float | None) -> str:
    return "—" if s is None else f"{s * 1e3:.1f}"


def _load() -> str:
    return os.getloadavg()[0].__format__(".1f") if hasattr(os, "getloadavg") else "?"


def _diagnose(path: Path, cfg: Any, best: bool) -> Any:
    """``diagnose``; with ``best``, a second diagnosis with no noise threshold gives the best change's config even
    where the first proposes nothing (to time it: is the small gain it predicts real?). Benchmark only: the
    threshold is patched for that one call and restored."""
    r = diagnose(path, cfg)
    if not best or r.config is not None:
        return r, r
    with mock.patch("overlapcfg.diagnosis.diagnose_run._spread", lambda times: (0.0, None)):
        return r, diagnose(path, cfg)


def routes(route_names: list[str], work: Path, ab_best: bool = False) -> list[dict[str, Any]]:
    runs = [(r, f"{r}_{q}", CONFIGS[(r, q)]) for r in route_names for q in ("poor", "good")]
    timed = run_on_gloo(route_job, runs, str(work), SIZES, timeout_s=3000, preload=("tests.support.diagnose_jobs",))[0]
    rows = []
    for route, name, cfg in runs:
        started = time.perf_counter()
        r, timed_r = _diagnose(work / name, cfg, ab_best)
        took = time.perf_counter() - started
        oracle = [statistics.median(exposed_per_step(work / name / f"rank{k}.json").values()) for k in (0, 1)]
        row: dict[str, Any] = {
            "run": name, "route": route, "diagnose_s": took, "exposed_ms": r.exposed_s * 1e3,
            "independent_ms": statistics.mean(oracle) * 1e3, "unattributed": r.unattributed, "other": r.other,
            "proposal": r.proposal.name if r.proposal else None, "verdict": r.verdict, "noise_ms": r.noise_s * 1e3,
            "predicted_gain_ms": r.proposal.gain_s * 1e3 if r.proposal else None,
            "measured_ms": statistics.median(timed[name]) * 1e3, "measured_spread_ms": _spread(timed[name]) * 1e3,
            "best_candidate": r.candidates[0].name if r.candidates else None,
            "best_gain_ms": r.candidates[0].gain_s * 1e3 if r.candidates else None, "load": _load(),
        }
        if timed_r.config is not None:  # run the proposal against what it came from, in turns
            row.update(timed_change=timed_r.proposal.name, predicted_gain_ms=timed_r.proposal.gain_s * 1e3)
            abab = [(route, f"{name}_a", cfg), (route, f"{name}_proposed_a", timed_r.config),
                    (route, f"{name}_b", cfg), (route, f"{name}_proposed_b", timed_r.config)]
            again = run_on_gloo(route_job, abab, str(work / "again"), SIZES, timeout_s=3000,
                                preload=("tests.support.diagnose_jobs",))[0]
            before = again[f"{name}_a"] + again[f"{name}_b"]
            after = again[f"{name}_proposed_a"] + again[f"{name}_proposed_b"]
            row.update(before_ms=statistics.median(before) * 1e3, before_spread_ms=_spread(before) * 1e3,
                       after_ms=statistics.median(after) * 1e3, after_spread_ms=_spread(after) * 1e3,
                       before_steps_ms=[t * 1e3 for t in before], after_steps_ms=[t * 1e3 for t in after])
            spread = max(row["before_spread_ms"], row["after_spread_ms"])
            row["measured_gain_ms"] = row["before_ms"] - row["after_ms"]
            row["faster_beyond_spread"] = row["measured_gain_ms"] > spread
            row["prediction_within_spread"] = abs(row["measured_gain_ms"] - row["predicted_gain_ms"]) <= spread
            row["load_after_ab"] = _load()
        rows.append(row)
        print(f"{name:18s} exposed {_ms(r.exposed_s)} ms (independent {row['independent_ms']:.1f}) "
              f"unattributed {r.unattributed} | {r.verdict} | load {_load()}", flush=True)
    return rows


def speed(work: Path, steps: int) -> dict[str, Any]:
    out = work / "speed"
    run_on_gloo(route_job, [("fsdp2", "speed", CONFIGS[("fsdp2", "poor")])], str(out), {**SIZES, "profiled": steps},
                timeout_s=3000, preload=("tests.support.diagnose_jobs",))
    traces = out / "speed"
    size = sum(p.stat().st_size for p in traces.iterdir())
    got = _measure(traces)
    return {"steps": steps, "trace_bytes": size, **got, "peak_over_size": got["peak_growth_kb"] * 1024 / size,
            "load": _load()}


def large(work: Path, size_mb: float) -> dict[str, Any]:
    path = work / "large" / "rank0.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    steps = write_big_trace(path, size_mb)
    size = path.stat().st_size
    got = _measure(path)
    path.unlink()
    return {"trace_bytes": size, "steps_written": steps, **got,
            "peak_over_size": got["peak_growth_kb"] * 1024 / size, "load": _load()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routes", default="fsdp2,lightning,compiled")
    parser.add_argument("--steps", type=int, default=20, help="profiled steps of the speed trace (0: skip)")
    parser.add_argument("--large-mb", type=float, default=0, help="size of the generated large trace (0: skip)")
    parser.add_argument("--skip-routes", action="store_true")
    parser.add_argument("--speed-traces", type=Path, help="measure on these traces instead of profiling a job")
    parser.add_argument("--ab-best", action="store_true",
                        help="time the best change also where nothing is proposed (the good configs)")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    name = "diagnose_routes.json" if not args.skip_routes else "diagnose_speed.json"
    report: dict[str, Any] = {"load_at_start": _load(), "sizes": SIZES}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if not args.skip_routes:
            report["routes"] = routes(args.routes.split(","), work, args.ab_best)
            (RESULTS / name).write_text(json.dumps(report, indent=2))  # kept if a later part fails
        if args.speed_traces is not None:
            size = sum(p.stat().st_size for p in args.speed_traces.iterdir())
            got = _measure(args.speed_traces)
            report["speed"] = {"traces": str(args.speed_traces), "trace_bytes": size, **got,
                               "peak_over_size": got["peak_growth_kb"] * 1024 / size, "load": _load()}
            print("speed:", report["speed"], flush=True)
        elif args.steps:
            report["speed"] = speed(work, args.steps)
            print("speed:", report["speed"], flush=True)
        if args.large_mb:
            report["large"] = large(work, args.large_mb)
            print("large:", report["large"], flush=True)
    print()
    print(f"{'run':14s} {'exposed':>8s} {'indep.':>7s} {'unattr':>6s} {'measured':>13s} {'best gain±noise':>16s} "
          f"{'before':>13s} {'after':>13s} {'gain':>6s} {'load':>5s}  proposal")
    for row in report.get("routes", []):
        before = f"{row['before_ms']:.1f}±{row['before_spread_ms']:.1f}" if "before_ms" in row else "—"
        after = f"{row['after_ms']:.1f}±{row['after_spread_ms']:.1f}" if "after_ms" in row else "—"
        gain = f"{row['measured_gain_ms']:.1f}" if "measured_gain_ms" in row else "—"
        best = f"{row['best_gain_ms'] or 0:.1f}±{row['noise_ms']:.1f}"
        print(f"{row['run']:14s} {row['exposed_ms']:8.1f} {row['independent_ms']:7.1f} {row['unattributed']:6d} "
              f"{row['measured_ms']:6.1f}±{row['measured_spread_ms']:<6.1f} {best:>16s} {before:>13s} {after:>13s} "
              f"{gain:>6s} {row['load']:>5s}  {row['proposal'] or 'nothing beyond noise'}"
              + (f" (timed: {row['timed_change']}, predicted {row['predicted_gain_ms']:.1f})"
                 if row.get("timed_change") and not row["proposal"] else ""))
    (RESULTS / name).write_text(json.dumps(report, indent=2))
    print(f"wrote {RESULTS / name}")


if __name__ == "__main__":
    main()
