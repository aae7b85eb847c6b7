"""``torch_manual``: upstream ``manual_overlap_bucketing`` on the resolved plan, the reference we compare with.

Upstream finds a bucket's nodes through a module stack; we hand it ours (``module_fqn_fn``), so it sees the same
attribution as ``manual``. On a CPU-only torch its scheduler set-up needs triton; the workaround is scoped to
the call (``compat.upstream_scheduler_scope``). torch 2.11's upstream pass has no ``bucket_mode`` (it always
buckets as ``custom_ops``): another mode is a config error there, not ignored.
"""

from __future__ import annotations

from torch import fx, nn

from overlapcfg import compat
from overlapcfg.config.policy import TorchManualPolicy
from overlapcfg.errors import OverlapUsageError
from overlapcfg.strategies.interface import PassContext, StrategyResult, this_torch_supports, torch_pass_failures

__all__ = ["run"]


def run(gm: fx.GraphModule, ctx: PassContext) -> StrategyResult:
    policy = ctx.policy
    if not isinstance(policy, TorchManualPolicy):
        raise OverlapUsageError(f"torch_manual: expected a TorchManualPolicy, got {type(policy).__name__}")

    def module_stack(node: fx.Node) -> list[tuple[str, type]]:
        fqn = ctx.module_fqn_fn(node)
        return [(fqn, nn.Module)] if fqn else []

    with compat.upstream_scheduler_scope(), this_torch_supports(), torch_pass_failures("torch_manual"):
        compat.manual_overlap_bucketing(gm, ctx.plan.module_lists(), insert_overlap_deps=policy.insert_overlap_deps,
                                        module_stack_fn=module_stack, bucket_mode=policy.bucket_mode)
    return StrategyResult()
