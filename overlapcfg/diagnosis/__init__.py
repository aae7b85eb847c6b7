"""From a real trace to a better config: read the ``torch.profiler`` traces of any training job (one Chrome trace per
rank, as torch.profiler, torchtitan, Lightning and accelerate write them, on GPU or CPU), say where its communication is
exposed and which bucket it belongs to, and propose the config change that removes the most of it.

``diagnose(traces, cfg=None, model=None)`` (``run``) returns a ``DiagnoseResult`` (``result``). Underneath, one module
per stage: ``read`` (stream one file with ``ijson``, bounded memory), ``names`` (what the trace's event names mean),
``intervals`` (the interval arithmetic every number is made of), ``steps`` (per rank and step: compute, communication,
exposed, idle; each collective's issue, run and need), ``attribute`` (buckets from FSDP2's labels or the record
``overlapcfg.backend`` leaves in a trace), ``ranks`` (traces that belong together, divergence, arrival skew),
``propose`` (changes replayed on the measured step with the simulator's streams), ``rewrite`` (the proposal as a
config), ``render_diagnosis`` (tables). Sits above ``measuring``, ``tuning``, ``cost`` and ``report`` (whose replay and
timeline it uses), below ``demo`` (``overlapcfg mode=diagnose trace=<dir>``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from overlapcfg._lazy import lazy_exports

_EXPORTS = {
    "diagnose": "overlapcfg.diagnosis.diagnose_run",
    "trace_files": "overlapcfg.diagnosis.diagnose_run",
    "DiagnoseResult": "overlapcfg.diagnosis.diagnosis_result",
}

__all__ = ["DiagnoseResult", "diagnose", "trace_files"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)

if TYPE_CHECKING:
    from overlapcfg.diagnosis.diagnose_run import diagnose, trace_files
    from overlapcfg.diagnosis.diagnosis_result import DiagnoseResult
