"""What the events of a ``torch.profiler`` Chrome trace mean to a diagnosis: which names are collectives (and of
which kind), which block a thread waiting for one, which label a bucket, and how many bytes an element of a
profiler dtype takes. Torch-free: the vocabulary is the trace's, read from torch 2.13's exporter and gloo/NCCL's
naming, so a trace is read without torch installed.

Where each collective shows up:

- **CPU issue ops** on the thread that calls the collective: ``c10d::_allgather_base_``,
  ``c10d::_reduce_scatter_base_``, ``c10d::allreduce_`` (eager, FSDP2 and ``torch.distributed``) and the functional
  ones ``_c10d_functional::all_gather_into_tensor(_out)``, ``reduce_scatter_tensor``, ``all_reduce`` (compiled
  graphs; the ``c10d::`` op they call is nested inside). ``record_param_comms`` (NCCL's process group) carries the
  collective's name in its ``Collective name`` argument.
- **gloo** runs a collective on its worker threads as ``gloo:all_gather``, ``gloo:all_reduce`` (FSDP2's
  reduce-scatter is an all-reduce on gloo), ... user annotations.
- **NCCL** runs it as a kernel on a communication stream: ``ncclDevKernel_AllGather_RING_LL(...)`` (NCCL 2.19 and
  later) or ``ncclKernel_AllGather_RING_LL_Sum_int8_t(...)`` (earlier), ``cat: "kernel"``.

Waits: ``_c10d_functional::wait_tensor`` (compiled graphs) and ``c10d::wait`` block the calling thread until the
collective is done. Eager FSDP2 on gloo blocks inside its ``FSDP::all_gather (...)`` label with no op running
(``/work/shared/NOTES.md``, "Profiler traces on CPU"): nothing to name, which is why compute is counted from the
ops that run (``overlapcfg.diagnosis.steps``), not from the labels around them.
"""

from __future__ import annotations

import re

from overlapcfg.kinds import GRAPH_REGION

__all__ = ["DTYPE_BYTES", "FSDP_LABEL", "GRAPH_REGION", "STEP_MARK", "WAIT_OPS", "canonical_dtype", "collective_kind",
           "dtype_bytes", "fsdp_label", "is_comm_op", "kernel_kind"]

STEP_MARK = re.compile(r"^ProfilerStep#(\d+)$")
"""``torch.profiler.profile.step()`` wraps each step in ``ProfilerStep#N`` (N counts every step since the profiler
was created, warm-up and waiting steps included)."""
FSDP_LABEL = re.compile(r"^FSDP::(all_gather|post_backward_reduce|post_backward_rs_wait|all_gather_copy_out|"
                        r"forward_prefetch for|backward_prefetch for|pre_forward|pre_backward|post_forward|"
                        r"post_backward_reshard|post_backward_accumulate)\s*\(?(.*?)\)?$")
"""FSDP2's ``record_function`` labels (torch 2.13: ``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``):
``FSDP::all_gather (model.layers.0)``, ``FSDP::post_backward_reduce (model.norm, lm_head)``; the group's modules
in parentheses, comma separated."""
WAIT_OPS = frozenset({"_c10d_functional::wait_tensor", "c10d::wait", "c10d_functional::wait_tensor"})

_KINDS = (
    ("all_gather", re.compile(r"all_?gather|allgather", re.IGNORECASE)),
    ("reduce_scatter", re.compile(r"reduce_?scatter", re.IGNORECASE)),
    ("all_reduce", re.compile(r"all_?reduce", re.IGNORECASE)),
    ("all_to_all", re.compile(r"all_?to_?all", re.IGNORECASE)),
    ("broadcast", re.compile(r"broadcast", re.IGNORECASE)),
    ("send_recv", re.compile(r"send|recv", re.IGNORECASE)),
    ("barrier", re.compile(r"barrier", re.IGNORECASE)),
)
_COMM_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::")
_NCCL_KERNEL = re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)")


def collective_kind(name: str) -> str:
    """The kind of a collective named ``name`` (an issue op, a gloo event, ``Collective name``): ``all_gather``,
    ``reduce_scatter``, ``all_reduce``, ``all_to_all``, ``broadcast``, ``send_recv``, ``barrier`` or ``other``."""
    for kind, pattern in _KINDS:
        if pattern.search(name):
            return kind
    return "other"


def is_comm_op(name: str) -> bool:
    """An op on a compute thread that issues a collective (not a wait, not compute)."""
    return name.startswith(_COMM_PREFIXES) and name not in WAIT_OPS


def kernel_kind(name: str) -> str | None:
    """The collective kind of a GPU kernel, or None for a compute kernel: ``ncclDevKernel_AllGather_RING_LL(...)``
    and ``ncclKernel_ReduceScatter_RING_LL_Sum_float(...)`` are NCCL's."""
    found = _NCCL_KERNEL.match(name)
    if found is None:
        return None
    return collective_kind(found.group(1))


def fsdp_label(name: str) -> tuple[str, tuple[str, ...]] | None:
    """``(what, modules)`` of an FSDP2 label: ``FSDP::all_gather (model.norm, lm_head)`` ->
    ``("all_gather", ("model.norm", "lm_head"))``; None for any other name."""
    found = FSDP_LABEL.match(name)
    if found is None:
        return None
    modules = tuple(m.strip() for m in found.group(2).split(",") if m.strip())
    return found.group(1), modules


DTYPE_BYTES = {
    # record_shapes' ``Input type`` (C++ type names)
    "float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4, "short int": 2,
    "signed char": 1, "unsigned char": 1, "bool": 1, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1,
    "c10::complex<float>": 8, "c10::complex<double>": 16,
    # overlapcfg's own record (torch dtype names)
    "float32": 4, "float64": 8, "bfloat16": 2, "float16": 2,
    # record_param_comms' ``dtype`` (ScalarType names)
    "Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1, "Byte": 1,
    "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1,
}


_CANONICAL = {"float": "float32", "double": "float64", "half": "float16", "long int": "int64", "int": "int32",
              "short int": "int16", "signed char": "int8", "unsigned char": "uint8", "long": "int64", "short": "int16",
              "char": "int8", "byte": "uint8"}


def canonical_dtype(name: str | None) -> str | None:
    """One spelling for a dtype, whoever wrote it: ``float`` (record_shapes), ``Float`` (record_param_comms) and
    ``float32`` (overlapcfg's record) are ``float32``; ``c10::BFloat16`` and ``BFloat16`` are ``bfloat16``."""
    if name is None:
        return None
    text = name.removeprefix("c10::").lower()
    return _CANONICAL.get(text, text)


def dtype_bytes(name: str) -> int | None:
    """Bytes per element of a profiler dtype name, None where unknown."""
    return DTYPE_BYTES.get(name)
