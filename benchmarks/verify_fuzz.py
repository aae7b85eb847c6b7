"""Verifier fuzz: random valid configs applied to the demo's traced graphs, each result verified; counts of false
alarms (``OverlapVerificationError`` on a valid config) and foreign exceptions (anything not ours), by variant and
strategy. torch's own passes run in the same fuzz (``torch_manual``: upstream ``manual_overlap_bucketing``;
``auto``: ``schedule_overlap_bucketing``) and are held to the same proof.

Variants, configs and outcome kinds are ``tests/support/fuzz.py``'s (plain FSDP with and without reshard-after-forward,
reshard with whole-step in-place parameter updates, HSDP in both chain orders, FSDP + TP with sequence parallel;
plans, depths 0-3, byte caps, overrides, every bucket mode, issue orders, ``insert_overlap_deps``).

    python benchmarks/verify_fuzz.py [--configs 300] [--seed 0] [--quick] [--out PATH]

Exit status 1 if any false alarm or foreign exception was seen (each is printed with its config).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root: ``tests`` is a package

from tests.support.fuzz import GRAPHS, OUTCOMES, VARIANTS, Outcome, run_case, sample_config, trace_variant  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def fuzz(n: int, seed: int, console: Console) -> list[Outcome]:
    """``n`` cases, variants and graphs round-robin (every variant gets its share), configs drawn from ``seed``."""
    rng = random.Random(seed)
    cases = [(variant, graph) for variant in VARIANTS for graph in GRAPHS]
    outcomes: list[Outcome] = []
    for i in range(n):
        variant, graph = cases[i % len(cases)]
        started = time.perf_counter()
        step = trace_variant(variant)
        if time.perf_counter() - started > 1:
            console.log(f"traced {variant} in {time.perf_counter() - started:.1f}s")
        outcome = run_case(step, variant, graph, sample_config(rng))
        outcomes.append(outcome)
        if outcome.kind in ("false_alarm", "foreign"):
            console.print(f"[red]{outcome.kind}[/red] on {variant} {graph} with {outcome.config}:\n{outcome.detail}")
    return outcomes


def table(outcomes: list[Outcome]) -> tuple[Table, list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    keys = sorted({(o.variant, o.config.get("strategy", "manual")) for o in outcomes},
                  key=lambda k: (list(VARIANTS).index(k[0]), k[1]))
    for variant, strategy in keys:
        counts = Counter(o.kind for o in outcomes if o.variant == variant and o.config.get("strategy") == strategy)
        rows.append({"variant": variant, "strategy": strategy, "configs": sum(counts.values()),
                     **{kind: counts[kind] for kind in OUTCOMES}})
    out = Table(title="verifier fuzz: valid configs on the demo's traced graphs")
    for col in ("variant", "strategy", "configs", *OUTCOMES):
        out.add_column(col.replace("_", " "), justify="left" if col in ("variant", "strategy") else "right")
    for r in rows:
        out.add_row(r["variant"], r["strategy"], str(r["configs"]), *(str(r[k]) for k in OUTCOMES))
    total = Counter(o.kind for o in outcomes)
    out.add_row("all", "", str(len(outcomes)), *(str(total[k]) for k in OUTCOMES))
    return out, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="36 configs (three per variant and graph)")
    parser.add_argument("--out", type=Path, default=RESULTS / "verify_fuzz.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the pass's own warnings (e.g. unbucketed HSDP all-reduces) are noise
    logging.getLogger("torch").setLevel(logging.ERROR)  # and torch's notes on bucket modes it substitutes
    console = Console(width=max(Console().width, 110))  # the table's names stay whole when piped
    n = 36 if args.quick else args.configs
    started = time.perf_counter()
    outcomes = fuzz(n, args.seed, console)
    rendered, rows = table(outcomes)
    console.print(rendered)
    refused = Counter(o.detail.split(":", 1)[0] for o in outcomes if o.kind == "refused")
    if refused:
        console.print(f"refused (our own errors for configs that do not fit the graph): {dict(refused)}")
    bad = [o for o in outcomes if o.kind in ("false_alarm", "foreign")]
    result = {"configs": n, "seed": args.seed, "seconds": time.perf_counter() - started, "rows": rows,
              "failures": [{"variant": o.variant, "graph": o.graph, "config": o.config, "kind": o.kind,
                            "detail": o.detail} for o in bad]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"{n} configs, {len(bad)} false alarms or foreign exceptions; wrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
