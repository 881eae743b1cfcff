"""`stoker-bench --gpu`: how well each loader keeps a GPU step fed.

The pipeline is `stoker-bench`'s W7 (random 224x224 crops + flips of 3x256x256 uint8 images
as torch tensors, an int label, shuffled, batch 256, `prefetch_factor=4`), run end to end into
a fixed GPU step:

  uint8 -> bf16 on the GPU (/255) · 7x7 stride-2 stem convolution 3->64 · ReLU · 3x3 stride-2
  max pooling · global average pooling · a bf16 matrix-multiply head (64 -> HEAD_WIDTH, then
  HEAD_REPEATS products with one HEAD_WIDTH x HEAD_WIDTH matrix, then -> 1000 classes) ·
  cross-entropy against the labels

Its sizes are fixed, not calibrated: they were chosen to cost about 4 ms per 256 images on an
H100 (an estimate, not a measurement; the report gives the step's measured time).

For each number of workers, each loader (stoker.torch, torch.utils.data), `pin_memory`
False/True (stoker's True: copied into torch's pinned memory on the pin thread in the loop,
born pinned in its arena slots registered with CUDA under `to_device`), and
each way of feeding ("loop": the usual `.to(device, non_blocking=True)` of every tensor in the
loop; "to_device": the loader, torch's too, wrapped in `to_device(loader, device)`;
"normalize": `to_device(..., transform=normalize(mean, std))`, uint8 turned into normalised
floats on the GPU, on the copy stream), a fresh loader runs `warm` batches untimed, then
`measured` batches timed, the GPU synchronized before each clock reading. The ceiling is the
same step looped on one batch already on the GPU. Repetitions are interleaved (the repetition
loop is outermost); figures are medians with min-max, and the feed ratio is a configuration's
median over the ceiling's median. Each row also gives the host-to-device rate it achieved
(the batches' bytes over the timed window) and the main process's CPU time per batch (all
its threads: the pin thread's copies count); beside them, the copy rates this machine allows
(`copy_rates`: from ordinary memory, from `pin_memory()` memory, from a shared-memory mapping
registered in place, and the `pin_memory()` copy itself).

A second part, "W12 on the GPU path" (`gpu_path`), runs W12's ImageFolder of real JPEGs
(`w12`) with the JPEGs decoded on the GPU: `ImageFolder(root, loader=DecodeOnDevice(224))`,
`collate_jpegs`, stoker.torch's DataLoader with `pin_memory=True` and at most
`GPU_PATH_MAX_WORKERS` workers, and `to_device(loader, device, transform=decode_jpegs(mean,
std))` (nvJPEG through torchvision where it imports). It reports, in the same run:

- W12's figures for that pipeline (`w12.epoch`; each batch counted when it is decoded: the
  consumer's stream is synchronised before the clock reads it), beside torch.utils.data's W12
  "float" row at every worker count of `w12.WORKERS` the machine has CPUs for, and the ratio
  to torch's best of them;
- the GPU time per image: CUDA events around `decode_jpegs` on ready host batches of the same
  files (nvJPEG's host-side work included, since the events wait for it), and the wall time;
- the feed ratio against a fixed step calibrated to `FEED_TARGET_IMAGES_PER_S` (about
  ResNet-50's pace on an H100): the step above with its head's repeats chosen from two timed
  settings, then the GPU-path loader feeding it, over the step alone on one resident batch.

Nothing here sets OMP_NUM_THREADS or the like, or calls torch.set_num_threads. Without a CUDA
GPU the run prints one line saying it skipped, and why, and succeeds.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from . import bench

LOADERS = ("stoker.torch", "torch")
DEFAULT_WORKERS = (8, 14)
FEEDS = ("loop", "to_device", "normalize")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
COPY_BYTES = 38 << 20  # about one W7 batch of 256 (3 x 224 x 224 uint8 = 147 KiB each)
QUICK_WORKERS = (2,)
BATCH_SIZE = 256
STEM_CHANNELS = 64
CLASSES = 1000
HEAD_WIDTH = 16384  # with HEAD_REPEATS: about 2.5 ms of the step on an H100 (estimated)
HEAD_REPEATS = 8
PREFETCH = bench.W7_PREFETCH
DEPTH = 2  # to_device's depth


@dataclass(frozen=True)
class Plan:
    """What one `stoker-bench --gpu` run measures."""

    workers: tuple[int, ...] = DEFAULT_WORKERS
    reps: int = 3
    batch_size: int = BATCH_SIZE
    warm: int = 5  # batches run before the clock starts
    measured: int = 60  # batches timed
    sources: int = 1000  # distinct source images (W7's)
    head_width: int = HEAD_WIDTH
    head_repeats: int = HEAD_REPEATS
    pins: tuple[bool, ...] = (False, True)
    device: str = "cuda"

    @classmethod
    def quick(cls, workers: Iterable[int] = QUICK_WORKERS, device: str = "cuda") -> Plan:
        """A smoke test: one repetition of a few batches, fewer source images."""
        return cls(workers=tuple(workers), reps=1, warm=2, measured=8, sources=200, device=device)


@dataclass
class Row:
    """One configuration's images/s over the repetitions."""

    loader: str
    workers: int
    pin_memory: bool
    feed: str  # one of FEEDS
    images_per_s: list[float] = field(default_factory=list)
    cpu_ms_per_batch: list[float] = field(default_factory=list)
    gb_per_s: list[float] = field(default_factory=list)
    median: float = 0.0
    min: float = 0.0
    max: float = 0.0
    feed_ratio: float = 0.0
    median_cpu_ms: float = 0.0
    median_gb_per_s: float = 0.0


# ------------------------------------------------------------------------ the step
class Step:
    """The fixed GPU step (see the module's docstring); `step(images, labels)` queues it."""

    def __init__(self, plan: Plan, device: Any) -> None:
        import torch

        self._torch = torch
        self._functional = torch.nn.functional
        self.device = device
        # bf16 on the GPU; float32 elsewhere (CPUs without bf16 kernels crawl), for tests only
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        generator = torch.Generator().manual_seed(0)

        def weight(*shape: int, fan_in: int) -> Any:
            w = torch.randn(*shape, generator=generator) / fan_in**0.5
            return w.to(device=device, dtype=self.dtype)

        self.stem = weight(STEM_CHANNELS, 3, 7, 7, fan_in=3 * 49)
        self.project = weight(STEM_CHANNELS, plan.head_width, fan_in=STEM_CHANNELS)
        self.square = weight(plan.head_width, plan.head_width, fan_in=plan.head_width)
        self.classify = weight(plan.head_width, CLASSES, fan_in=plan.head_width)
        self.repeats = plan.head_repeats

    def __call__(self, images: Any, labels: Any) -> Any:
        """The loss of one batch (queued; not read)."""
        functional = self._functional
        # uint8 from the loader is scaled here; a batch normalised on the way (to_device's
        # transform) arrives as floats already
        x = images.to(self.dtype).mul_(1 / 255) if images.dtype == self._torch.uint8 else images.to(self.dtype)
        x = functional.conv2d(x, self.stem, stride=2, padding=3)
        x = functional.max_pool2d(functional.relu_(x), kernel_size=3, stride=2, padding=1)
        h = x.mean(dim=(2, 3)) @ self.project
        for _ in range(self.repeats):
            h = h @ self.square
        logits = h @ self.classify
        return functional.cross_entropy(logits.float(), labels)


# -------------------------------------------------------------------- measurements
def _synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loader_module(name: str) -> Any:
    import importlib

    return importlib.import_module("stoker.torch" if name == "stoker.torch" else "torch.utils.data")


def _one_batch(plan: Plan, sources: Any) -> tuple[Any, Any]:
    import torch

    crops = bench.ImageNetCrops(sources, plan.batch_size)
    samples = [crops[i] for i in range(plan.batch_size)]
    return torch.stack([image for image, _ in samples]), torch.tensor([label for _, label in samples])


def ceiling(plan: Plan, step: Step, batch: tuple[Any, Any]) -> float:
    """Images/s of the step looped on one batch already on the device."""
    images, labels = (t.to(step.device) for t in batch)
    for _ in range(plan.warm):
        step(images, labels)
    _synchronize(step.device)
    started = time.perf_counter()
    for _ in range(plan.measured):
        step(images, labels)
    _synchronize(step.device)
    return plan.measured * plan.batch_size / (time.perf_counter() - started)


def feed(
    plan: Plan, step: Step, sources: Any, loader: str, workers: int, pin: bool, how: str
) -> tuple[float, float, float]:
    """(images/s, main-process CPU ms per batch, host-to-device GB/s) of a fresh `loader`
    feeding the step `how` (one of FEEDS), over `plan.measured` batches after `plan.warm`."""
    from stoker.torch import normalize, to_device

    module = _loader_module(loader)
    batches = plan.warm + plan.measured + DEPTH + 1  # the epoch outlasts the timed window
    crops = bench.ImageNetCrops(sources, batches * plan.batch_size)
    extra = {"prefetch_factor": PREFETCH} if workers > 0 else {}
    made = module.DataLoader(
        crops,
        batch_size=plan.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        pin_memory=pin,
        **extra,
    )
    device = step.device
    wrap = how != "loop"
    transform = normalize(IMAGENET_MEAN, IMAGENET_STD, key=0) if how == "normalize" else None
    source: Iterable[Any] = to_device(made, device, depth=DEPTH, transform=transform) if wrap else made
    iterator = iter(source)
    started = finished = cpu_started = cpu_finished = 0.0
    try:
        for i, (images, labels) in enumerate(iterator):
            if not wrap:
                images = images.to(device, non_blocking=True)
                labels = labels.to(device, non_blocking=True)
            step(images, labels)
            if i + 1 == plan.warm:
                _synchronize(device)
                started, cpu_started = time.perf_counter(), time.process_time()
            elif i + 1 == plan.warm + plan.measured:
                _synchronize(device)
                finished, cpu_finished = time.perf_counter(), time.process_time()
                break
    finally:
        close = getattr(iterator, "close", None)
        if callable(close):
            close()
        del iterator, source, made
        gc.collect()
    if not finished:
        raise RuntimeError(f"{loader} gave fewer than {plan.warm + plan.measured} batches")
    seconds = finished - started
    batch_bytes = plan.batch_size * (3 * bench.W7_CROP * bench.W7_CROP + 8)  # uint8 images, int64 labels
    return (
        plan.measured * plan.batch_size / seconds,
        1000 * (cpu_finished - cpu_started) / plan.measured,
        plan.measured * batch_bytes / seconds / 1e9,
    )


def configurations(plan: Plan) -> list[tuple[int, str, bool, str]]:
    """(workers, loader, pin_memory, feed) in the order each repetition runs them."""
    return list(itertools.product(plan.workers, LOADERS, plan.pins, FEEDS))


def copy_rates(device: Any, nbytes: int = COPY_BYTES, repeats: int = 20) -> dict[str, float]:
    """GB/s of host-to-device copies of `nbytes` on this machine: from ordinary memory, from
    `pin_memory()` memory, from a shared-memory mapping registered in place with CUDA (as
    stoker's pinned arena is), and of the `pin_memory()` copy itself (host to host)."""
    import torch

    from stoker._core.arena import _create_slot_memory
    from stoker._core.hostpin import CudaRegistrar

    def rate(source: Any) -> float:
        target = torch.empty(nbytes, dtype=torch.uint8, device=device)
        target.copy_(source, non_blocking=True)
        _synchronize(device)
        started = time.perf_counter()
        for _ in range(repeats):
            target.copy_(source, non_blocking=True)
        _synchronize(device)
        return repeats * nbytes / (time.perf_counter() - started) / 1e9

    ordinary = torch.ones(nbytes, dtype=torch.uint8)
    rates = {"ordinary": rate(ordinary)}
    started = time.perf_counter()
    for _ in range(repeats // 4):
        pinned = ordinary.pin_memory()
    rates["pin_memory_copy"] = (repeats // 4) * nbytes / (time.perf_counter() - started) / 1e9
    rates["pin_memory"] = rate(pinned)
    fd, buffer = _create_slot_memory(nbytes)
    os.close(fd)
    registrar = CudaRegistrar(torch)
    address = ctypes.addressof(buffer)
    registrar.register(address, nbytes)
    try:
        rates["registered_mapping"] = rate(torch.frombuffer(buffer, dtype=torch.uint8))
    finally:
        registrar.unregister(address)
    return rates


def run(plan: Plan, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every measurement of `plan`; the report `table` and `save_json` take."""
    import torch

    device = torch.device(plan.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if plan.sources > CLASSES:
        raise ValueError(f"sources should be at most {CLASSES} (labels are classes), got {plan.sources}")
    sources = bench.w7_sources(plan.sources)
    step = Step(plan, device)
    batch = _one_batch(plan, sources)
    ceilings: list[float] = []
    rows = {key: Row(key[1], key[0], key[2], key[3]) for key in configurations(plan)}
    copies = copy_rates(device) if device.type == "cuda" else {}
    for rep in range(plan.reps):
        ceilings.append(ceiling(plan, step, batch))
        for row in rows.values():
            if progress is not None:
                progress(
                    f"rep {rep + 1}/{plan.reps}: {row.loader} w={row.workers} pin={row.pin_memory} feed={row.feed}"
                )
            rate, cpu_ms, gb_per_s = feed(plan, step, sources, row.loader, row.workers, row.pin_memory, row.feed)
            row.images_per_s.append(rate)
            row.cpu_ms_per_batch.append(cpu_ms)
            row.gb_per_s.append(gb_per_s)
    top = statistics.median(ceilings)
    for row in rows.values():
        row.median = statistics.median(row.images_per_s)
        row.min, row.max = min(row.images_per_s), max(row.images_per_s)
        row.feed_ratio = row.median / top
        row.median_cpu_ms = statistics.median(row.cpu_ms_per_batch)
        row.median_gb_per_s = statistics.median(row.gb_per_s)
    return {
        "plan": asdict(plan),
        "machine": {**bench.environment(), **device_info(device)},
        "ceiling": {
            "images_per_s": ceilings,
            "median": top,
            "min": min(ceilings),
            "max": max(ceilings),
            "step_ms": 1000 * plan.batch_size / top,
        },
        "copy_rates_gb_per_s": copies,
        "results": [asdict(row) for row in rows.values()],
    }


def device_info(device: Any) -> dict[str, Any]:
    """The device's name and torch's CUDA version."""
    import torch

    info: dict[str, Any] = {"device": str(device), "torch_cuda": torch.version.cuda}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


# ------------------------------------------------------------------------- output
def _rate(x: float) -> str:
    return f"{x:,.0f}"


def table(report: dict[str, Any]) -> str:
    """The report as text."""
    plan, machine, top = report["plan"], report["machine"], report["ceiling"]
    lines = [
        f"GPU feed: W7's crops, batch {plan['batch_size']}, into a fixed step (stem conv 7x7/2 3->64, "
        f"max pool, global pool, {plan['head_repeats']} x {plan['head_width']}-wide matmul head); "
        f"{plan['measured']} batches timed after {plan['warm']}, {plan['reps']} repetition(s) interleaved",
        f"device: {machine.get('gpu', machine['device'])}, torch CUDA {machine.get('torch_cuda')}",
        bench.environment_line(machine),
        f"ceiling (the step on a batch already on the device): {_rate(top['median'])} images/s "
        f"({_rate(top['min'])}-{_rate(top['max'])}), {top['step_ms']:.2f} ms per batch",
    ]
    copies = report.get("copy_rates_gb_per_s") or {}
    if copies:
        lines.append(
            "host-to-device copies here (GB/s): ordinary memory {ordinary:.1f}, pin_memory() memory "
            "{pin_memory:.1f}, a shared-memory mapping registered in place {registered_mapping:.1f}; "
            "the pin_memory() copy itself {pin_memory_copy:.1f}".format(**copies)
        )
    lines += [
        "",
        f"{'loader':<14}{'workers':>8}  {'pin_memory':<11}{'feed':<11}{'images/s':>10}  {'min-max':<17}"
        f"{'ratio':>6}{'GB/s':>7}{'CPU ms/batch':>14}",
    ]
    for row in report["results"]:
        lines.append(
            f"{row['loader']:<14}{row['workers']:>8}  {row['pin_memory']!s:<11}{row['feed']:<11}"
            f"{_rate(row['median']):>10}  {_rate(row['min']) + '-' + _rate(row['max']):<17}{row['feed_ratio']:>6.2f}"
            f"{row['median_gb_per_s']:>7.1f}{row['median_cpu_ms']:>14.2f}"
        )
    lines.append("")
    lines.append(
        "ratio = median images/s end to end over the ceiling's median (1.00: the loader never held "
        "the step up); GB/s = the batches' bytes moved to the device per second; CPU ms/batch = the "
        "main process's CPU time (all its threads) per batch; feed: loop = .to(device) in the loop, "
        "to_device = stoker.torch.to_device, normalize = to_device with normalize() on the GPU"
    )
    return "\n".join(lines)


# ------------------------------------------------------------- W12 on the GPU path
GPU_PATH_MAX_WORKERS = 4
GPU_PATH_WORKERS = (2, 4)
FEED_TARGET_IMAGES_PER_S = 3000.0
CALIBRATION_REPEATS = (8, 64)  # the head's repeats timed to fit the step to the target


@dataclass(frozen=True)
class GpuPathPlan:
    """What the "W12 on the GPU path" part measures."""

    gpu_workers: tuple[int, ...] = GPU_PATH_WORKERS
    torch_workers: tuple[int, ...] = (2, 4, 8, 14)  # w12.WORKERS
    reps: int = 3
    quick: bool = False
    warm: int = 5
    measured: int = 30
    decode_batches: int = 8  # host batches timed for the GPU time per image
    target: float = FEED_TARGET_IMAGES_PER_S
    decoder: str = "auto"
    device: str = "cuda"
    head_width: int = HEAD_WIDTH
    step_warm: int = 3  # steps run before the step's clock starts, in the calibration
    step_measured: int = 10  # steps timed per calibration figure

    @classmethod
    def quick_plan(cls, device: str = "cuda") -> GpuPathPlan:
        """A smoke test: W12's quick files and batch, one repetition, two workers."""
        return cls(
            gpu_workers=(2,),
            torch_workers=(2,),
            reps=1,
            quick=True,
            warm=2,
            measured=4,
            decode_batches=2,
            device=device,
        )


def _w12() -> Any:
    from . import w12

    return w12


def gpu_pipeline(device: Any, decoder: str = "auto") -> Any:
    """W12's row for the GPU path (a `w12.Pipeline`): each batch yielded once it is decoded."""
    w12 = _w12()
    from stoker.torch import to_device
    from stoker.vision import DecodeOnDevice, ImageFolder, collate_jpegs, decode_jpegs

    def decoded(loader: Any) -> Iterable[Any]:
        for batch in to_device(loader, device, transform=decode_jpegs(w12.MEAN, w12.STD, decoder=decoder)):
            _synchronize_current(device)
            yield batch

    return w12.Pipeline(
        "gpu",
        "ImageFolder(loader=DecodeOnDevice(224)) + collate_jpegs, pin_memory=True; to_device(transform="
        "decode_jpegs(mean, std)): JPEG bytes to the GPU, nvJPEG, crop-resize-flip-normalise there: float32",
        lambda root, samples: w12.Repeat(ImageFolder(root, loader=DecodeOnDevice(w12.SIZE)), samples),
        loaders=("stoker.torch",),
        baseline="float",
        options={"collate_fn": collate_jpegs, "pin_memory": True},
        wrap=decoded,
    )


def _synchronize_current(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _host_batches(paths: list[str], batch: int, count: int) -> list[Any]:
    """`count` JpegBatches of `batch` of the files, drawn as the workers draw them."""
    from stoker.vision import DecodeOnDevice, collate_jpegs

    make = DecodeOnDevice(_w12().SIZE, generator=0)
    return [collate_jpegs([make(paths[(k * batch + i) % len(paths)]) for i in range(batch)]) for k in range(count)]


def decode_times(batches: list[Any], device: Any, decoder: str = "auto") -> dict[str, float]:
    """ms per image of `decode_jpegs(mean, std)` on ready host batches: the device's time (CUDA
    events on the current stream, around the call; on the CPU, none) and the wall time, the
    first batch untimed (the decoder's start)."""
    import torch

    from stoker.vision import decode_jpegs

    w12 = _w12()
    transform = decode_jpegs(w12.MEAN, w12.STD, device=device, decoder=decoder)
    transform(batches[0])
    _synchronize(device)
    images = sum(len(b) for b in batches[1:])
    gpu_ms = 0.0
    started = time.perf_counter()
    for batch in batches[1:]:
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            transform(batch)
            end.record()
            end.synchronize()
            gpu_ms += begin.elapsed_time(end)
        else:
            transform(batch)
    _synchronize(device)
    wall_ms = 1000 * (time.perf_counter() - started)
    return {
        "device_ms_per_image": gpu_ms / images if device.type == "cuda" else float("nan"),
        "wall_ms_per_image": wall_ms / images,
        "images_per_s": 1000 * images / wall_ms,
    }


def calibrated_step(
    device: Any,
    target: float,
    batch: tuple[Any, Any],
    head_width: int = HEAD_WIDTH,
    reps: int = 3,
    warm: int = 3,
    measured: int = 10,
) -> tuple[Step, float]:
    """The fixed step with its head's repeats chosen so that it runs at about `target`
    images/s on a resident batch (the time is linear in the repeats); and its images/s (each
    figure the median of `reps` runs of `measured` steps after `warm`)."""

    def plan(repeats: int) -> Plan:
        return Plan(warm=warm, measured=measured, head_width=head_width, head_repeats=repeats, device=str(device))

    low, high = CALIBRATION_REPEATS
    seconds = []
    for repeats in (low, high):
        seconds.append(
            1 / statistics.median(ceiling(plan(repeats), Step(plan(repeats), device), batch) for _ in range(reps))
        )
    per_repeat = (seconds[1] - seconds[0]) / (high - low)
    fixed = seconds[0] - low * per_repeat
    repeats = max(0, round((1 / target - fixed) / per_repeat)) if per_repeat > 0 else low
    step = Step(plan(repeats), device)
    return step, statistics.median(ceiling(plan(repeats), step, batch) for _ in range(reps))


def gpu_feed(step: Step, root: str, workers: int, batch: int, warm: int, measured: int, decoder: str) -> float:
    """Images/s of the GPU-path loader feeding `step`, over `measured` batches after `warm`."""
    from stoker.torch import DataLoader, to_device
    from stoker.vision import decode_jpegs

    w12 = _w12()
    pipeline = gpu_pipeline(step.device, decoder)
    samples = (warm + measured + DEPTH + 2) * batch
    loader = DataLoader(
        pipeline.dataset(root, samples),
        batch_size=batch,
        shuffle=True,
        num_workers=workers,
        prefetch_factor=w12.PREFETCH,
        **pipeline.options,
    )
    # the step overlaps the decoding: no synchronisation per batch, unlike the W12 rows
    iterator = iter(to_device(loader, step.device, transform=decode_jpegs(w12.MEAN, w12.STD, decoder=decoder)))
    started = finished = 0.0
    try:
        for i, (images, labels) in enumerate(iterator):
            step(images, labels)
            if i + 1 == warm:
                _synchronize(step.device)
                started = time.perf_counter()
            elif i + 1 == warm + measured:
                _synchronize(step.device)
                finished = time.perf_counter()
                break
    finally:
        iterator.close()
        del iterator, loader
        gc.collect()
    return measured * batch / (finished - started)


def gpu_path(plan: GpuPathPlan, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every measurement of the "W12 on the GPU path" part (see the module's docstring)."""
    import torch

    from . import jpegbench

    w12 = _w12()
    if any(count > GPU_PATH_MAX_WORKERS for count in plan.gpu_workers):
        raise ValueError(f"gpu_workers should be at most {GPU_PATH_MAX_WORKERS}, but got {plan.gpu_workers}")
    device = torch.device(plan.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    paths = jpegbench.files(w12.QUICK_FILES if plan.quick else w12.FILES)
    root = os.path.dirname(os.path.dirname(paths[0]))
    batch = w12.QUICK_BATCH if plan.quick else w12.BATCH
    w12.warm(paths)
    cpus = w12.usable_cpus()
    torch_counts = [c for c in plan.torch_workers if c <= cpus] or [min(plan.torch_workers)]
    ours = gpu_pipeline(device, plan.decoder)
    rows: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for rep in range(plan.reps):
        for pipeline, loader_name, counts in (
            (w12.PIPELINES["float"], "torch", torch_counts),
            (ours, "stoker.torch", list(plan.gpu_workers)),
        ):
            for count in counts:
                samples = w12.epoch_samples(count, len(paths), batch)
                figures = w12.epoch(pipeline, loader_name, root, count, samples, batch)
                rows.setdefault((pipeline.name, count), []).append(figures)
                if progress is not None:
                    progress(
                        f"GPU path rep {rep + 1}/{plan.reps}: {pipeline.name} {loader_name} w={count}: "
                        f"{figures['epoch_images_per_s']:,.0f} images/s"
                    )
    table_rows = []
    for (name, count), values in rows.items():
        row: dict[str, Any] = {
            "pipeline": name,
            "workers": count,
            "reps": len(values),
            "loader": "torch" if name == "float" else "stoker.torch",
        }
        row.update({key: w12._median([v[key] for v in values]) for key in w12.FIGURES})
        table_rows.append(row)
    torch_best = max(r["epoch_images_per_s"] for r in table_rows if r["pipeline"] == "float")
    for row in table_rows:
        row["ratio_to_torch_best"] = row["epoch_images_per_s"] / torch_best
    host = _host_batches(paths, batch, plan.decode_batches + 1)
    times = decode_times(host, device, plan.decoder)
    resident = tuple(t.to(device) for t in _resident_batch(host[0], device, plan.decoder))
    step, step_rate = calibrated_step(
        device, plan.target, resident, plan.head_width, plan.reps, plan.step_warm, plan.step_measured
    )
    feeds = []
    for count in plan.gpu_workers:
        rates = [gpu_feed(step, root, count, batch, plan.warm, plan.measured, plan.decoder) for _ in range(plan.reps)]
        feeds.append(
            {
                "workers": count,
                "images_per_s": rates,
                "median": statistics.median(rates),
                "feed_ratio": statistics.median(rates) / step_rate,
            }
        )
    from stoker._vision.device_decode import _DecodeJpegs

    backend = _DecodeJpegs(device, plan.decoder, lambda crops: crops)._backend(device)[0]
    return {
        "files": len(paths),
        "batch": batch,
        "decoder": backend,
        "transforms": w12.transforms_name(),
        "rows": table_rows,
        "torch_best_images_per_s": torch_best,
        "decode": times,
        "step": {"target_images_per_s": plan.target, "head_repeats": step.repeats, "images_per_s": step_rate},
        "feeds": feeds,
        "plan": asdict(plan),
    }


def _resident_batch(host: Any, device: Any, decoder: str) -> tuple[Any, Any]:
    """A decoded batch and its labels, for the step's calibration."""
    import torch

    from stoker.vision import decode_jpegs

    w12 = _w12()
    images = decode_jpegs(w12.MEAN, w12.STD, device=device, decoder=decoder)(host)
    return images, torch.arange(len(host)) % CLASSES


def gpu_path_table(report: dict[str, Any]) -> str:
    """The "W12 on the GPU path" part as text."""
    decode, step = report["decode"], report["step"]
    lines = [
        f"W12 on the GPU path: ImageFolder of {report['files']} real JPEGs, batch {report['batch']}, decoder "
        f"{report['decoder']}; torch's rows: W12 'float' ({report['transforms']})",
        f"{'pipeline':<9}{'loader':<14}{'workers':>8}{'reps':>5}{'epoch/s':>10}{'middle/s':>10}{'1st s':>7}"
        f"{'x torch best':>14}{'main ms':>9}",
    ]
    for row in sorted(report["rows"], key=lambda r: (r["pipeline"] != "float", r["workers"])):
        middle = "-" if row["middle_images_per_s"] is None else f"{row['middle_images_per_s']:,.0f}"
        lines.append(
            f"{row['pipeline']:<9}{row['loader']:<14}{row['workers']:>8}{row['reps']:>5}"
            f"{row['epoch_images_per_s']:>10,.0f}{middle:>10}{row['first_batch_s']:>7.2f}"
            f"{row['ratio_to_torch_best']:>13.2f}x{row['main_cpu_ms_per_image']:>9.2f}"
        )
    lines.append(
        f"decode_jpegs on ready host batches: {decode['device_ms_per_image']:.3f} ms of GPU time per image (CUDA "
        f"events), {decode['wall_ms_per_image']:.3f} ms wall per image ({decode['images_per_s']:,.0f} images/s)"
    )
    lines.append(
        f"fixed step calibrated to {step['target_images_per_s']:,.0f} images/s: {step['head_repeats']} head "
        f"repeats, {step['images_per_s']:,.0f} images/s on a resident batch"
    )
    for feed_row in report["feeds"]:
        lines.append(
            f"  fed by the GPU path at {feed_row['workers']} workers: {feed_row['median']:,.0f} images/s, "
            f"feed ratio {feed_row['feed_ratio']:.2f}"
        )
    return "\n".join(lines)


def save_json(report: dict[str, Any], path: str) -> None:
    """Write `report` to `path`, making its folder."""
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as out:
        json.dump(report, out, indent=2)


def unavailable() -> str | None:
    """Why this machine cannot run the GPU bench, or None when it can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (pip install stoker[torch])"
    if not torch.cuda.is_available():
        built = torch.version.cuda
        why = "built without CUDA" if built is None else f"built with CUDA {built}, but it finds no usable GPU"
        return f"no CUDA GPU (torch.cuda.is_available() is False: torch {torch.__version__} {why})"
    return None


def main(workers: list[int] | None, reps: int, quick: bool, json_path: str) -> int:
    """Run the GPU bench and print its table (`workers` None: the default list); 0 also when
    it skipped for want of a GPU."""
    why = unavailable()
    if why is not None:
        print(f"stoker-bench --gpu: skipped: {why}", flush=True)
        return 0
    if quick:
        plan = Plan.quick(workers if workers is not None else QUICK_WORKERS)
    else:
        plan = Plan(workers=tuple(workers if workers is not None else DEFAULT_WORKERS), reps=reps)

    def progress(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    report = run(plan, progress)
    print(table(report))
    gpu_plan = GpuPathPlan.quick_plan() if quick else GpuPathPlan(reps=reps)
    report["gpu_path"] = gpu_path(gpu_plan, progress)
    print()
    print(gpu_path_table(report["gpu_path"]))
    save_json(report, json_path)
    print(f"\nwrote {json_path}")
    return 0
