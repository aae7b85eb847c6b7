"""What one merged bucket computes, for each bucket mode (copy-in, one collective, its wait, copy-out).

CLEAN-ROOM REWRITE PENDING: see the task prompt. The public names below are the interface merge.py uses.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.config.policy import BucketMode

if TYPE_CHECKING:
    from overlapcfg.kinds import CollectiveKind

__all__ = ["MergeFn", "bucket_dtype", "foreach_groups", "group_key", "group_name_of", "merge_fn"]

MergeFn: TypeAlias = Callable[..., list[torch.Tensor]]



def group_name_of(arg: object) -> str:
    """A collective's process-group argument as a name: a string, or (compile-on-one-rank graphs) a node whose
    fake value is the process group."""
    raise NotImplementedError('clean-room rewrite pending')


def group_key(node: fx.Node, kind: CollectiveKind, mode: BucketMode) -> tuple[object, ...]:
    """Collectives of one bucket with equal keys merge into one: all-gathers by group (and dtype, except in
    ``custom_ops_multidtype``), reduce-scatters and all-reduces by group, reduce op and dtype."""
    raise NotImplementedError('clean-room rewrite pending')


def bucket_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """The flat buffer's dtype: the narrowest of the bucket's (a mixed bucket is sent as bytes of that width)."""
    raise NotImplementedError('clean-room rewrite pending')


def foreach_groups(ins: Sequence[torch.Tensor], out_dtypes: Sequence[torch.dtype]) -> list[int] | None:
    """Indices of copy-in inputs with equal (source dtype, destination dtype, shape), flat with ``-1`` between
    groups (``[0, 2, -1, 1]`` is ``[[0, 2], [1]]``), or None where there is one group: ``_foreach_copy_`` falls
    back to its slow path on mixed groups."""
    raise NotImplementedError('clean-room rewrite pending')


# --- the traced functions (argument lists as upstream's, so the traces are its traces) --------------------------
















def merge_fn(kind: CollectiveKind, mode: BucketMode) -> MergeFn:
    """The function a bucket of ``kind`` collectives is merged with in ``mode`` (all-gathers have no coalesced form:
    ``coalesced`` gathers as ``default``, as upstream does; all-reduces have one form)."""
    raise NotImplementedError('clean-room rewrite pending')
