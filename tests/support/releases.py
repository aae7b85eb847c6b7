"""Which torch release the tests run on, for the few tests whose reference is torch's own pass.

``overlapcfg.graph`` merges buckets with its own functions, which emit torch 2.13's graph on every release
(``tests/graph/test_merge_across_releases.py``). torch's ``manual_overlap_bucketing`` differs between releases
(2.11 copies in with ``_foreach_copy_``; 2.14 orders the depth-1 backward otherwise and puts an ``alias`` in the
all-gather's copy-out), so "at depth 1 the result is upstream's graph, node for node" is a statement about torch
2.13, and the tests that compare with upstream node for node run there (CI's full suite); elsewhere they are
skipped with that reason, and the release-independent golden test holds the graph instead."""

from __future__ import annotations

import pytest
import torch

__all__ = ["TORCH_RELEASE", "upstream_is_the_reference"]

TORCH_RELEASE = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])

upstream_is_the_reference = pytest.mark.skipif(
    TORCH_RELEASE != (2, 13),
    reason=f"compares with torch's manual_overlap_bucketing node for node, which emits torch 2.13's graph on 2.13 "
           f"only (this is {torch.__version__}); tests/graph/test_merge_across_releases.py holds the graph here")
