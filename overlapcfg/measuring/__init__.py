"""Measured, not guessed: calibrate a hardware profile on the live cluster, and measure real steps against the
simulator's prediction.

``calibrate(groups, step=...)`` (``calibrate``) times collectives on the live process groups and kernels at the
model's shapes and writes a hardware profile (``overlapcfg.cost.hardware``) the cost model reads (it returns it as a
``CalibratedProfile``, which prints as the command's calibration table);
``measure(make_step, configs, hardware=...)`` (``run``) runs a training step under each config on real ranks and
returns a ``Measurement`` (``result``): per config the predicted and measured step, exposed communication and
collectives, and the per-node durations (``NodeCosts``) that the simulator and the tuner can use instead of the
roofline. Underneath: ``clock`` (host clock on CPU, CUDA events on GPU), ``device`` (the device's cache and
datasheet, and the base profile of its kind), ``fit`` (least squares in the cost model's terms), ``collectives``,
``kernels`` and ``contention`` (what calibration times), ``runner`` (the timed compiler),
``trace`` (reading ``torch.profiler``), ``render_measure`` (tables). Sits beside ``tuning``, above ``cost``, whose
simulator it checks; the demo's ``mode=calibrate`` and ``mode=measure`` use it.
"""

from __future__ import annotations

from overlapcfg._lazy import lazy_exports

_EXPORTS = {
    "calibrate": "overlapcfg.measuring.calibration",
    "CalibrationProgress": "overlapcfg.measuring.calibration",
    "measure": "overlapcfg.measuring.measure_run",
    "MeasureProgress": "overlapcfg.measuring.measure_run",
    "StepFactory": "overlapcfg.measuring.measure_run",
    "Measurement": "overlapcfg.measuring.measure_result",
    "CalibratedProfile": "overlapcfg.measuring.measure_result",
    "MeasuredConfig": "overlapcfg.measuring.measure_result",
    "MatmulMix": "overlapcfg.measuring.kernels",
    "matmul_mix": "overlapcfg.measuring.kernels",
}

__all__ = ["CalibratedProfile", "CalibrationProgress", "MatmulMix", "MeasureProgress", "MeasuredConfig", "Measurement",
           "StepFactory", "calibrate", "matmul_mix", "measure"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
