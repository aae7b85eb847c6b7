"""``exit_process``: end a ``torchrun`` rank on gloo without finalizing Python (and ``INTERRUPTED``: after Ctrl-C).

``destroy_process_group`` calls each group's ``shutdown``, which leaves gloo's worker threads (``pt_gloo_runloop``,
``gloo_tcp_loop``) running until the group's last reference goes, and references outlive it: FSDP2's state
(reachable from C++ objects the garbage collector does not see) holds the group through its ``DeviceMesh``, and
DTensor's caches hold the mesh; a graph traced with the group (``capture_step``, ``torch.compile``) keeps it in a
fake script object that torch's tracing state holds. ``del model`` and ``gc.collect()`` free none of them (checked
on torch 2.13 by the threads alive when ``atexit`` runs). So gloo's threads run while Python finalizes, and a worker
that has just finished a collective releases its tensors a moment later: releasing a tensor's Python object takes
the GIL, a finalizing interpreter ends the thread there, and the C++ unwinding through a ``noexcept`` destructor
aborts the process ("terminate called without an active exception", exit -6, after the last step, at random; seen
in a core dump; rare on an idle machine, common enough on a loaded one to fail a test suite).

``os._exit`` ends the process without finalizing: once the script has written its outputs and destroyed the group,
flushing the logs and the standard streams first loses nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import NoReturn

__all__ = ["INTERRUPTED", "exit_process"]

INTERRUPTED = 130
"""Exit status after Ctrl-C: 128 + SIGINT, what shells report for a command the signal ended."""


def exit_process(code: int = 0) -> NoReturn:
    """End this process now with status ``code``, flushing logging and the standard streams, without finalizing
    Python (so gloo threads still alive cannot abort it; see the module docstring). Call it last in a ``torchrun``
    script on gloo, after ``dist.destroy_process_group()``; ``atexit`` handlers do not run."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken stream has nothing left to lose
            stream.flush()
    os._exit(code)
