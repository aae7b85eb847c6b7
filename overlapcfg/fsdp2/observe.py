"""Checking, on the first forward, that the buckets run in the order their prefetch lists were planned for.

``overlapcfg.fsdp2.layout`` plans from registration order, because FSDP2 takes its lists before anything has run.
A model whose ``forward`` calls its modules in another order (a norm registered before the blocks it follows)
would then prefetch the wrong buckets, silently. So the driver watches the first forward: a pre-hook on every
bucket module numbers its calls, and when the root's forward returns, each bucket's first and last call are
known. If that order differs from the planned one, the lists are re-planned for it (``layout.reordered``) and
set again before the first backward runs, and the record says so; either way the hooks are removed. Only the
first step's forward prefetch follows the registration order.

Not measured: a bucket the first forward does not call (a head called per chunk after the root's forward); then
nothing is re-planned and the record notes it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from overlapcfg.fsdp2.layout import ShardLayout, reordered

__all__ = ["watch_first_forward"]

logger = logging.getLogger(__name__)


def watch_first_forward(model: nn.Module, layout: ShardLayout, replan: Callable[[ShardLayout], None]) -> None:
    """Hook ``model`` so that its first forward measures the bucket order and calls ``replan`` with the layout
    to use from then on (``layout`` itself, with a note, when the order was as planned)."""
    calls: list[int] = []
    handles: list[Any] = []

    def seen(index: int) -> Callable[..., None]:
        @torch.compiler.disable
        def hook(*_: object) -> None:
            calls.append(index)
        return hook

    @torch.compiler.disable
    def done(*_: object) -> None:
        for handle in handles:
            handle.remove()
        replan(measured(layout, calls))

    for i, bucket in enumerate(layout.buckets):
        for module in bucket.modules:
            handles.append(module.register_forward_pre_hook(seen(i)))
    handles.append(model.register_forward_hook(done, always_call=True))


def measured(layout: ShardLayout, calls: list[int]) -> ShardLayout:
    """The layout for the bucket order ``calls`` shows (bucket indices, one per module call, in call order)."""
    names = [b.name for b in layout.buckets]
    starts: dict[int, int] = {}
    ends: dict[int, int] = {}
    for position, i in enumerate(calls):
        starts.setdefault(i, position)
        ends[i] = position
    unseen = [names[i] for i in layout.chain if i not in starts]
    if unseen:
        return _noted(layout, f"bucket order not measured: the first forward did not call {', '.join(unseen[:3])}"
                              f"{' ...' if len(unseen) > 3 else ''}; prefetch follows registration order")
    every = range(len(names))  # buckets without parameters are never in a chain: any position does
    new = reordered(layout, [starts.get(i, -1) for i in every], [ends.get(i, -1) for i in every])
    if (new.chain, new.backward_chain) == (layout.chain, layout.backward_chain):
        return _noted(layout, "bucket order checked on the first forward: as planned")
    note = (f"bucket order measured on the first forward differs from registration order, prefetch re-planned: "
            f"forward {' -> '.join(names[i] for i in new.chain)}; "
            f"backward {' -> '.join(names[i] for i in new.backward_chain)} (the first forward used the old lists)")
    logger.warning("overlapcfg.fully_shard: %s", note)
    return _noted(new, note)


def _noted(layout: ShardLayout, note: str) -> ShardLayout:
    return dataclasses.replace(layout, order_notes=(*layout.order_notes, note))
