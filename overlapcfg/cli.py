"""The main job: trace the demo model, resolve the plan, apply the strategy, print what happened.

A plain-argument stand-in until the Hydra app lands; it prints with rich and writes nothing.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

from rich.console import Console
from rich.table import Table

from overlapcfg.errors import OverlapConfigError


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="overlapcfg", description=__doc__)
    parser.add_argument("--plan", default="llama_layers", help="plan preset name")
    parser.add_argument("--strategy", default="manual")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reshard", action="store_true", help="reshard after forward (backward re-gathers)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    console = Console()
    from overlapcfg import compat
    from overlapcfg.models.llama import LlamaConfig
    from overlapcfg.passes import apply
    from overlapcfg.schema import load_config
    from overlapcfg.tracing import trace_train_step

    try:
        cfg = load_config({"strategy": args.strategy, "plan": args.plan})
    except OverlapConfigError as err:
        console.print(f"[red]{err}[/red]")
        return 1
    start = time.perf_counter()
    with console.status("tracing the demo model"):
        step = trace_train_step(LlamaConfig(n_layers=args.layers), reshard_after_forward=args.reshard)
    console.print(f"traced {args.layers}-layer demo model in {time.perf_counter() - start:.1f}s")
    for name in ("forward", "backward"):
        gm = copy.deepcopy(step.graph(name))
        with compat.fake_process_group(step.world_size, step.rank):
            try:
                gm = apply(gm, cfg, module_fqn_fn=step.module_fqn_fn(name), module_fqns=step.module_fqns,
                           graph_kind=name, debug=True)
            except OverlapConfigError as err:
                console.print(f"[red]{err}[/red]")
                return 1
        record = gm.meta["overlapcfg"]
        table = Table(title=f"{name} graph: {cfg.strategy} on plan {cfg.plan.name if cfg.plan else '-'}")
        for col in ("bucket", "modules", "before", "after", "fwd k", "bwd k", "rs d"):
            table.add_column(col)
        for b in record.buckets:
            table.add_row(b.name, ", ".join(b.modules), str(sum(n for *_, n in b.before)),
                          str(sum(n for *_, n in b.after)), str(b.forward_prefetch), str(b.backward_prefetch),
                          str(b.reduce_scatter_delay))
        console.print(table)
        console.print(f"  FSDP collectives {record.before.total_fsdp} -> {record.after.total_fsdp}, "
                      f"pass {record.seconds * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
