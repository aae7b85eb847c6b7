"""``overlapcfg mode=calibrate`` and ``overlapcfg mode=measure``: the demo on real ranks, under ``torchrun``.

- ``mode=calibrate``: trace the demo step on the meta device (its matmul shapes and dtype), join torchrun's group
  (NCCL on GPUs, else gloo), build the demo mesh (the FSDP group; HSDP's replicate and the TP group when
  ``parallel.*`` asks for them), and ``overlapcfg.calibrate`` on those groups with a progress bar, unmeasured
  numbers from ``calibrate.base`` (null: the device's own kind of profile); rank 0 writes the profile into the
  user's profile directory (``hardware=<calibrate.name>`` then finds it) and a copy into the run directory, and
  prints the fits.
- ``mode=measure``: every ``measure.configs`` entry (label -> overlap keys replacing those of ``overlap``, as
  ``compare`` entries do) runs the demo's training step on real ranks (``overlapcfg.measure``); rank 0 prints the
  predicted-vs-measured table on ``hardware`` and writes ``measure.json`` and ``node_costs.json``.

Nothing here runs without a process group: outside ``torchrun`` both modes say how to launch them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf
from pydantic import Field
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from overlapcfg.config.base import ByteCount, ConfigModel
from overlapcfg.config.load import validate_config
from overlapcfg.demo.job import Progress as Stages
from overlapcfg.demo.job import check_plan, compare_configs, demo_spec, pricing_of, replay_hardware
from overlapcfg.demo.outputs import MEASURE_FILE, NODE_COSTS_FILE
from overlapcfg.errors import Fault, OverlapConfigError
from overlapcfg.files import write_atomic

if TYPE_CHECKING:
    import torch

    from overlapcfg.cost.hardware import HardwareProfile
    from overlapcfg.demo.dims import ParallelDims
    from overlapcfg.demo.parallel import DemoMesh
    from overlapcfg.demo.settings import DemoSettings
    from overlapcfg.passes.backend import GraphBackend

__all__ = ["CalibrateSettings", "MeasureSettings", "demo_step", "run_calibrate", "run_measure"]

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class CalibrateSettings(ConfigModel):
    """The command's ``calibrate`` node."""

    name: str = Field("calibrated", pattern=r"^[A-Za-z0-9_.-]+$")
    """Profile name: the file ``<name>.yaml`` in your profile directory, selected later by ``hardware=<name>``."""
    budget_s: float = Field(60.0, gt=0)
    """Wall seconds to aim for (each collective kind still times a few sizes)."""
    max_bytes: ByteCount | None = None
    """Largest collective timed; null: 64 MiB on CPU, 1 GiB on GPU."""
    base: str | None = None
    """The profile unmeasured numbers (links across hosts) come from, of the device's own kind; null: chosen by the
    device (``cpu_gloo`` on CPU, the shipped GPU profile closest to the GPU). Not the ``hardware`` group, whose
    default is the CPU profile: on a GPU its 50 us latency and 5 GB/s links would stand in for what is not
    measured."""
    cache_bytes: ByteCount | None = None
    """The last-level cache the memory bandwidth is timed beyond; null: the size the device reports. Give it where
    a virtual machine reports a cache it does not have (``overlapcfg.calibrate``'s ``cache_bytes``)."""


class MeasureSettings(ConfigModel):
    """The command's ``measure`` node (``configs`` is read like ``compare``)."""

    warmup: int = Field(3, ge=1)
    """Untimed steps first (the first compiles)."""
    steps: int = Field(10, ge=1)
    """Timed steps per config: the median and the spread come from them."""
    profiled_steps: int = Field(2, ge=1)
    """Steps under torch.profiler per config: exposed communication and each collective's duration."""
    interleave: bool = True
    """Compile every config first and take the timed steps in turns (fair under drifting load; one model per
    config in memory); false: one config after the other."""
    node_costs: bool | str = True
    """Time every node of the reference config (the first with strategy none; or a config's label) for the
    profile-guided prediction; false: do not."""
    configs: dict[str, Any] = Field(default_factory=dict)
    """label -> overlap keys replacing those of ``overlap`` (as ``compare`` entries)."""


def _settings(cfg: DictConfig, key: str, model: type[ConfigModel]) -> Any:
    node = cfg.get(key)
    data = OmegaConf.to_container(node, resolve=True) if node is not None else {}
    return validate_config(model, data or {}, root=key, header=f"invalid {key} settings")


def _validated(cfg: DictConfig, mode: str, model: type[ConfigModel]) -> tuple[DemoSettings, Any, HardwareProfile]:
    """What both commands check before any process group exists: the demo, the mode's own settings (``cfg[mode]``)
    and the hardware profile predictions are for."""
    spec = demo_spec(cfg)
    return spec, _settings(cfg, mode, model), replay_hardware(cfg, spec, mode)


def _launch_hint(mode: str) -> str:
    return (f"mode={mode} runs on real ranks: launch it with torchrun, e.g. "
            f"`torchrun --nproc-per-node 2 -m overlapcfg mode={mode}`")


def _check_launched(mode: str) -> None:
    """Outside torchrun (and with no group of the caller's), say how to launch ``mode``. The commands call it while
    validating, before torch is imported and the demo traced (half a second, not the five a trace took), and
    ``_joined`` again. A group exists only where torch is already imported, so looking for it costs nothing
    otherwise."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return
    if not all(k in os.environ for k in _TORCHRUN_ENV):
        raise OverlapConfigError.single("mode", _launch_hint(mode))


@contextmanager
def _joined(mode: str) -> Iterator[tuple[int, int, str]]:
    """torchrun's group (NCCL where there are GPUs, else gloo), left again at the end; or an existing one."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        yield dist.get_rank(), dist.get_world_size(), str(dist.get_backend())
        return
    _check_launched(mode)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        yield dist.get_rank(), dist.get_world_size(), str(dist.get_backend())
    finally:
        dist.destroy_process_group()


def _dims(spec: DemoSettings, world_size: int) -> ParallelDims:
    """The mesh on torchrun's ranks: plain FSDP over all of them unless ``parallel.*`` says otherwise (then the
    sizes must multiply to torchrun's world size)."""
    from overlapcfg.demo.dims import ParallelDims

    dims = spec.dims
    if dims.is_1d:
        return ParallelDims(dp_shard=world_size)
    if dims.world_size != world_size:
        raise OverlapConfigError.single("parallel", f"{dims.describe()} needs {dims.world_size} ranks; torchrun "
                                                    f"started {world_size}")
    return dims


def _groups(mesh: DemoMesh) -> dict[str, Any]:
    import torch.distributed as dist

    if mesh.mesh is None:
        return {"dp_shard": dist.group.WORLD}
    return {name: mesh.mesh.get_group(name) for name in ("dp_replicate", "dp_shard", "tp")
            if getattr(mesh.dims, name) > 1}


def _bar(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True)


def run_calibrate(cfg: DictConfig, output_dir: Path, console: Console) -> Path:
    """``mode=calibrate``; returns the profile's path in the run directory."""
    stages = Stages(console)
    with stages.stage("validating config", done="validated config"):
        spec = demo_spec(cfg)
        settings = _settings(cfg, "calibrate", CalibrateSettings)
        if settings.base is not None:
            from overlapcfg.cost.hardware import load_hardware

            try:
                load_hardware(settings.base)  # an unknown name is a fault now, not after the trace
            except OverlapConfigError as err:
                raise OverlapConfigError([Fault("calibrate.base", f.message) for f in err.faults]) from None
        _check_launched("calibrate")
        from overlapcfg.cost.hardware import shipped_hardware_names

        if settings.name in shipped_hardware_names():
            raise OverlapConfigError.single("calibrate.name", f"{settings.name!r} is a shipped profile's name, which "
                                                              "would always be found first; choose another")
    import torch.distributed as dist

    from overlapcfg.cost.hardware import hardware_home, save_hardware
    from overlapcfg.demo.parallel import build_mesh
    from overlapcfg.demo.tracing import trace_train_step
    from overlapcfg.measuring import CalibrationProgress, calibrate
    from overlapcfg.measuring.clock import default_device

    what = f"the {spec.model.n_layers}-layer demo step on meta (its matmul shapes)"
    with stages.stage(f"tracing {what}", done=f"traced {what}"):
        step = trace_train_step(spec.llama_config(), parallel=spec.dims, device="meta",
                                reshard_after_forward=spec.reshard_after_forward, batch=spec.batch,
                                seq_len=spec.seq_len)
    with _joined("calibrate") as (rank, world_size, backend):
        console.quiet = console.quiet or rank != 0
        dims = _dims(spec, world_size)
        groups = _groups(build_mesh(dims, device_type=default_device().type))
        bar = _bar(console)

        def show(p: CalibrationProgress) -> None:
            bar.update(task, description=f"calibrate: {p.phase}", completed=p.done, total=max(p.total, 1))

        with bar:
            task = bar.add_task("calibrate", total=1)
            profile = calibrate(groups, step=step, name=settings.name, base=settings.base, budget_s=settings.budget_s,
                                max_bytes=settings.max_bytes, device=default_device(), save=False, progress=show,
                                cache_bytes=settings.cache_bytes)
        measured = ", ".join(f"{n} ({dist.get_world_size(g)} ranks)" for n, g in groups.items())
        seconds = profile.calibration.seconds if profile.calibration is not None else 0.0
        console.print(f"[green]✓[/green] calibrated {measured} on {backend} x {world_size} in {seconds:.0f} s")
        path = output_dir / f"{settings.name}.yaml"
        if rank == 0:
            from overlapcfg.measuring.calibration import profile_header

            home = save_hardware(profile, root="calibrate.name", header=profile_header(profile))
            save_hardware(profile, path, header=profile_header(profile))
            console.print(profile)
            console.print(f"profile: {home} (and {path}); predict with it: "
                          f"[bold]overlapcfg hardware={settings.name}[/bold]; check it: [bold]torchrun "
                          f"--nproc-per-node {world_size} -m overlapcfg mode=measure hardware={settings.name}[/bold]"
                          f"  [dim](profiles live in {hardware_home()})[/dim]", soft_wrap=True)
    return path


def demo_step(spec: DemoSettings, dims: ParallelDims | None = None, *,
              device: torch.device | str = "cpu") -> Callable[[GraphBackend], Callable[[], object]]:
    """The demo's ``make_step`` for ``overlapcfg.measure``, on the current default group: a fresh seeded model
    sharded on the mesh ``dims`` (default: plain FSDP over every rank), compiled with the backend it is handed;
    one step is zeroed gradients, forward, loss, backward (no optimizer: the predicted graphs end at the
    gradients). Each data-parallel rank reads its own seeded batch."""
    import torch
    import torch.distributed as dist

    from overlapcfg.demo.dims import ParallelDims
    from overlapcfg.demo.llama import Llama, cross_entropy_loss
    from overlapcfg.demo.parallel import build_mesh, parallelize
    from overlapcfg.demo.tracing import demo_batch

    device = torch.device(device)
    mesh = build_mesh(dims or ParallelDims(dp_shard=dist.get_world_size()), device_type=device.type)
    tokens, targets = demo_batch(spec.model.vocab_size, batch=spec.batch, seq_len=spec.seq_len,
                                 seed=100 + mesh.dp_rank, device=device)

    def make_step(backend: GraphBackend) -> Callable[[], object]:
        model = parallelize(Llama(spec.llama_config(), device=device, seed=0), mesh,
                            reshard_after_forward=spec.reshard_after_forward)
        compiled = torch.compile(model, backend=backend, fullgraph=True)

        def step() -> None:
            for p in model.parameters():
                p.grad = None
            cross_entropy_loss(compiled(tokens), targets).backward()

        return step

    return make_step


def run_measure(cfg: DictConfig, output_dir: Path, console: Console) -> Path:
    """``mode=measure``; returns the path of ``measure.json``."""
    stages = Stages(console)
    with stages.stage("validating config", done="validated config"):
        spec, settings, hardware = _validated(cfg, "measure", MeasureSettings)
        names, configs = compare_configs(cfg, key="measure.configs")
        _check_launched("measure")
        for overlap in configs:
            check_plan(overlap, spec)
    from overlapcfg.measuring import MeasureProgress, measure
    from overlapcfg.measuring.clock import default_device

    entries: Mapping[str, Any] = settings.configs
    with _joined("measure") as (rank, world_size, backend):
        console.quiet = console.quiet or rank != 0
        dims = _dims(spec, world_size)
        bar = _bar(console)

        def show(p: MeasureProgress) -> None:
            bar.update(task, description=f"measure: {p.config} {p.phase}".replace("all ", ""), completed=p.index,
                       total=p.total)

        with bar:
            task = bar.add_task("measure", total=len(configs))
            result = measure(demo_step(spec, dims, device=default_device()), dict(zip(names, configs, strict=True)),
                             hardware=hardware, warmup=settings.warmup, steps=settings.steps,
                             profiled_steps=settings.profiled_steps, node_costs=settings.node_costs,
                             interleave=settings.interleave, pricing=pricing_of(cfg),
                             device=default_device(), config_root="measure.configs", progress=show)
        result = result.model_copy(update={"configs": tuple(
            c.model_copy(update={"overrides": dict(entries.get(c.name) or {})}) for c in result.configs)}
        ).attach(result.measured_node_costs)
        console.print(f"[green]✓[/green] measured {len(configs)} configs on {backend} x {world_size}")
        path = output_dir / MEASURE_FILE
        if rank == 0:
            console.print(result)
            write_atomic(path, result.to_json())
            written = [str(path)]
            if result.measured_node_costs is not None:
                write_atomic(output_dir / NODE_COSTS_FILE, result.measured_node_costs.to_json())
                written.append(str(output_dir / NODE_COSTS_FILE))
            console.print(f"measurement: {', '.join(written)}  [dim](total {stages.total():.1f} s)[/dim]",
                          soft_wrap=True)
    return path
