"""What a calibrated hardware profile holds besides the datasheet fields: measured collective fits and provenance.

``overlapcfg.calibrate`` (``overlapcfg.measuring.calibration``) times collectives on the live process groups and
kernels on the device, fits them, and writes a ``HardwareProfile`` whose ``collectives`` replace the ring model's
datasheet numbers per kind and whose ``calibration`` says where every number came from: when, on what, at which
sizes, and how well the fit matched (its residual). Nothing here runs anything; these are the schema.

The fits are the ring model's own terms (``overlapcfg.cost.price.collective_cost``): over ``p`` ranks an
all-gather or reduce-scatter of ``n`` full-size bytes takes ``(p - 1) * latency + (p - 1) / p * n / bandwidth``
and an all-reduce twice that (nccl-tests' bus bandwidth convention), so a fit made on 2 ranks extrapolates to
``p`` ranks the way the datasheet numbers do, and with the same caveats.
"""

from __future__ import annotations

from typing import Annotated

from overlapcfg.config.base import ConfigModel, measured
from overlapcfg.kinds import BucketKind

__all__ = ["ROUGH_FIT", "Calibration", "CollectiveFit", "CollectiveFits", "Contention",
           "ContentionSamples", "GroupSamples", "KernelSamples", "KindSamples", "LinkContention", "LinkFits",
           "SkewSamples"]

Seconds = Annotated[float, measured("seconds", 0.0, 1.0, example="up to 1 s")]
"""A fitted per-collective constant: 0 up to a second."""
Latency = Annotated[float, measured("seconds", 1e-9, 1.0, example="1 ns to 1 s")]
"""A ring step's latency: above 0 (a collective free of latency is a fit that could not resolve it, or a typo)
and below a second."""
BusBandwidth = Annotated[float, measured("bytes/s", 1e6, 1e15, example="1 MB/s to 1 PB/s")]
"""A fitted bandwidth: what no link reaches (or a fit whose slope vanished) is refused, not priced."""
IssueBandwidth = Annotated[float, measured("bytes/s", 1e6, 1e18, example="1 MB/s to 1 EB/s")]
"""How fast the calling thread works through a collective's bytes while issuing it: where issuing hardly depends
on the size, the fit's slope is near zero and this is very large (1e15 measured on gloo), but finite."""

Slowdown = Annotated[float, measured("extra seconds per second", 0.0, 100.0,
                                     example="0 to 100: at most 101 times as slow")]
"""A measured contention slowdown (0.1: 10 % slower): finite and below what is a broken measurement, not load."""

ROUGH_FIT = 0.25
"""A fit whose residual (RMS relative error at its own timings) is above this is rough: calibration lists it in
``Calibration.rough_fits`` and its notes and logs a warning, and every prediction made on the profile shows it.
Matmul rates included: one rate for every shape is off small shapes, and a large residual says the roofline will
be off the model's own kernels by as much."""


class CollectiveFit(ConfigModel):
    """One collective kind on one kind of link: fitted from timings (``overlapcfg.calibrate``), or the achievable
    rates a shipped profile publishes (nccl-tests bus bandwidths, each sourced in the file)."""

    latency: Latency
    """Seconds per ring step (the alpha): ``(p - 1)`` of them per all-gather or reduce-scatter, ``2 (p - 1)`` per
    all-reduce."""
    bandwidth: BusBandwidth
    """Bus bandwidth per direction (bytes/s): the ring moves ``(p - 1) / p`` of the full size at it (all-reduce:
    twice that). Across nodes: per NIC (a ring spanning whole nodes drives ``nics_per_node`` of them at once)."""
    tree: bool = False
    """All-reduce: NCCL may run a tree instead of the ring (``2 ceil(log2 p)`` latencies, the same bytes); the
    faster of the two is priced."""
    nvls_bandwidth: BusBandwidth | None = None
    """All-reduce inside a node: NVLink SHARP's algorithm bandwidth (the switch reduces; ``bytes / it``), where the
    fabric has it; null: none."""
    issue_latency: Seconds = 0.0
    """Seconds the calling (compute) thread spends issuing one, before it runs on its own stream or thread."""
    issue_bandwidth: IssueBandwidth | None = None
    """Bytes/s at which the calling thread works through the full size while issuing (gloo copies and reduces
    on the caller for some kinds); null: issuing costs ``issue_latency`` whatever the size."""


class LinkFits(ConfigModel):
    """The fitted kinds on one kind of link; a kind left out falls back to the datasheet ring model."""

    all_gather: CollectiveFit | None = None
    reduce_scatter: CollectiveFit | None = None
    all_reduce: CollectiveFit | None = None


class CollectiveFits(ConfigModel):
    """Fits for rings inside one node and across nodes; a group is placed as ``HardwareProfile`` says."""

    intra_node: LinkFits | None = None
    inter_node: LinkFits | None = None


class Contention(ConfigModel):
    """How compute and communication slow each other while they overlap, on one kind of link.

    The simulator's rates (``overlapcfg.cost.replay``): while a collective is in flight, compute runs at
    ``1 / (1 + compute_slowdown)`` of its speed; while compute runs, a collective moves at ``1 / (1 + comm_slowdown)``
    of its own. A collective alone (compute waiting on it, or idle) runs at full speed. On a CPU the two share
    cores (gloo's threads against the compute thread); on a GPU, SMs and memory bandwidth (NCCL's kernels against the
    model's). 0 and 0: no contention (the datasheet profiles)."""

    compute_slowdown: Slowdown
    """Extra compute time per second of compute under a collective that is all transfer (0.1: 10 % slower); the
    simulator scales it by the share of a collective's time spent moving bytes
    (``overlapcfg.cost.price.collective_cost``: its ``slowdown``)."""
    comm_slowdown: Slowdown
    """Extra collective time per second of collective under compute (all transfer; scaled the same way)."""
    start_delay: Seconds = 0.0
    """Seconds a collective that starts while compute runs (on a link with nothing else in flight) waits before it
    moves: on a CPU, the communication thread waits for the scheduler to give it a core the compute threads hold;
    the wait ends at once when compute blocks (``overlapcfg.cost.replay``). The expected wait: on a CPU it is next
    to nothing or a scheduler slice, by chance, and the mean over calibration's runs is what a step of many
    collectives pays on average. Measured with a small collective, so it is the wait alone, not a rate
    (``overlapcfg.measuring.contention.time_start_delay``). 0: none (a GPU's NCCL kernels start on their own
    stream; the datasheet profiles)."""


class LinkContention(ConfigModel):
    """Contention per kind of link a collective's ring crosses (inside one host, across hosts)."""

    intra_node: Contention | None = None
    inter_node: Contention | None = None


class ContentionSamples(ConfigModel):
    """The overlapped runs one group's contention was measured from (``overlapcfg.measuring.contention``)."""

    group: str
    """The group timed (``world``, ``dp_shard``...)."""
    inter_node: bool
    collective_bytes: int
    """Full size of the all-gather run under compute."""
    comm_seconds: float
    """The all-gather alone (issue to wait), median."""
    compute_seconds: tuple[float, ...]
    """Per run: the compute alone."""
    compute_under_comm: tuple[float, ...]
    """Per run: the same compute with the all-gather in flight throughout."""
    total_seconds: tuple[float, ...]
    """Per run: issue to the wait returning."""
    residual: float
    """RMS relative error of the fitted slowdowns at these runs (compute and total times)."""
    start_delay_bytes: int | None = None
    """Full size of the small all-gather the start delay was timed with (None: not timed, as on a GPU)."""
    start_delay_seconds: tuple[float, ...] = ()
    """Per run: that all-gather's time in flight under compute less its time alone (the slowest rank's runs)."""


class SkewSamples(ConfigModel):
    """How far apart the ranks of one group arrived after each length of compute (``overlapcfg.measuring.skew``)."""

    group: str
    ranks: int
    compute_seconds: tuple[float, ...]
    """The compute run before the collective, per length (median, slowest rank)."""
    sigma_seconds: tuple[float, ...]
    """Standard deviation of a rank's arrival per length, from the mean lateness of the last rank."""
    residual: float
    """RMS relative error of the fitted ``Skew`` at these lengths."""
    unit: str | None = None
    """The compute the ranks ran between synchronizations (``overlapcfg.measuring.skew.SkewUnit``); null in
    profiles calibrated before it was recorded."""


class KindSamples(ConfigModel):
    """The timings one fit of one group was made from."""

    kind: BucketKind
    sizes: tuple[int, ...]
    """Full-size bytes (an all-gather's output, a reduce-scatter's input, an all-reduce's buffer), ascending."""
    seconds: tuple[float, ...]
    """Median time per size on its own stream (issue excluded), of the slowest rank."""
    issue_seconds: tuple[float, ...]
    """Median time per size the calling thread spent issuing it, of the slowest rank."""
    residual: float
    """Root-mean-square relative error of the link's fit at these sizes (0.05: predictions within ~5 %)."""
    issue_residual: float
    """The same for the issue fit."""


class GroupSamples(ConfigModel):
    """One live process group that was timed."""

    name: str
    """What the group is: ``world``, or its mesh dimension (``dp_shard``, ``dp_replicate``, ``tp``)."""
    size: int
    inter_node: bool
    """Whether its ranks span more than one host (then its fits are the ``inter_node`` ones)."""
    collectives: tuple[KindSamples, ...]


class KernelSamples(ConfigModel):
    """Timed kernels and the line fitted through them: ``seconds = overhead + work / rate``."""

    what: str
    """``matmul <dtype>`` (work in FLOPs) or ``memory`` (work in bytes read + written)."""
    shapes: tuple[str, ...]
    """One entry per timed kernel: ``m x k x n`` (with ``b x`` for a batched matmul) and how many the model
    runs, or a buffer size."""
    work: tuple[float, ...]
    seconds: tuple[float, ...]
    """Median seconds per call, back to back."""
    rate: float
    """FLOP/s or bytes/s: total work over total time at the model's mix (matmuls), or the fit's slope (memory)."""
    overhead: float
    """The fit's intercept: seconds per kernel whatever its size (launch or dispatch); 0 for matmuls (their rate
    folds it in). Recorded, not priced: the roofline has no per-kernel constant."""
    residual: float


class Calibration(ConfigModel):
    """Provenance of a calibrated profile: the numbers above were measured here, then, like this."""

    date: str
    """ISO 8601, UTC."""
    torch_version: str
    overlapcfg_version: str
    backend: str
    """The process group's backend (``gloo``, ``nccl``)."""
    device: str
    """What computed: ``cpu (2 threads)``, ``NVIDIA H100 80GB HBM3``."""
    world_size: int
    hosts: int
    base: str
    """The datasheet profile every unmeasured number comes from (inter-node links when no group crossed hosts)."""
    budget_seconds: float
    seconds: float
    """Wall time the calibration took."""
    groups: tuple[GroupSamples, ...]
    kernels: tuple[KernelSamples, ...] = ()
    contention: tuple[ContentionSamples, ...] = ()
    """The overlapped runs behind ``HardwareProfile.contention``, per group."""
    skew: tuple[SkewSamples, ...] = ()
    """The arrival timings behind ``HardwareProfile.skew``, per group."""
    rough_fits: tuple[str, ...] = ()
    """Fits far from their own timings (residual above the calibration's threshold), or figures above the device's
    datasheet: ``matmul bfloat16 1657%``. Predictions on this profile inherit them (``mode=measure`` says so)."""
    notes: tuple[str, ...] = ()
    """What was not measured, and what stands in for it."""
