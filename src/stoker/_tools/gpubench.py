"""`stoker bench --gpu`: how well each loader keeps a GPU step fed.

The pipeline is `stoker bench`'s W7 (random 224x224 crops + flips of 3x256x256 uint8 images
as torch tensors, an int label, shuffled, batch 256, `prefetch_factor=4`), run end to end into
a fixed GPU step:

  uint8 -> bf16 on the GPU (/255) · 7x7 stride-2 stem convolution 3->64 · ReLU · 3x3 stride-2
  max pooling · global average pooling · a bf16 matrix-multiply head (64 -> HEAD_WIDTH, then
  HEAD_REPEATS products with one HEAD_WIDTH x HEAD_WIDTH matrix, then -> 1000 classes) ·
  cross-entropy against the labels

Its sizes are fixed, not calibrated: they were chosen to cost about 4 ms per 256 images on an
H100 (an estimate, not a measurement; the report gives the step's measured time).

For each number of workers, each loader (stoker.torch, torch.utils.data), `pin_memory`
False/True, and without/with `stoker.torch.to_device` ("without" is the usual
`.to(device, non_blocking=True)` of every tensor in the loop; "with" wraps the loader, torch's
too, in `to_device(loader, device)`), a fresh loader runs `warm` batches untimed, then
`measured` batches timed, the GPU synchronized before each clock reading. The ceiling is the
same step looped on one batch already on the GPU. Repetitions are interleaved (the repetition
loop is outermost); figures are medians with min-max, and the feed ratio is a configuration's
median over the ceiling's median.

Nothing here sets OMP_NUM_THREADS or the like, or calls torch.set_num_threads. Without a CUDA
GPU the run prints one line saying it skipped, and why, and succeeds.
"""

from __future__ import annotations

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
DEFAULT_WORKERS = (4, 8, 14)
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
    """What one `stoker bench --gpu` run measures."""

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
    to_device: bool
    images_per_s: list[float] = field(default_factory=list)
    median: float = 0.0
    min: float = 0.0
    max: float = 0.0
    feed_ratio: float = 0.0


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
        x = images.to(self.dtype).mul_(1 / 255)
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
    return torch.stack([image for image, _ in samples]), torch.tensor(
        [label for _, label in samples]
    )


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
    plan: Plan, step: Step, sources: Any, loader: str, workers: int, pin: bool, wrap: bool
) -> float:
    """Images/s of a fresh `loader` feeding the step, over `plan.measured` batches after
    `plan.warm`."""
    from stoker.torch import to_device

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
    source: Iterable[Any] = to_device(made, device, depth=DEPTH) if wrap else made
    iterator = iter(source)
    started = finished = 0.0
    try:
        for i, (images, labels) in enumerate(iterator):
            if not wrap:
                images = images.to(device, non_blocking=True)
                labels = labels.to(device, non_blocking=True)
            step(images, labels)
            if i + 1 == plan.warm:
                _synchronize(device)
                started = time.perf_counter()
            elif i + 1 == plan.warm + plan.measured:
                _synchronize(device)
                finished = time.perf_counter()
                break
    finally:
        close = getattr(iterator, "close", None)
        if callable(close):
            close()
        del iterator, source, made
        gc.collect()
    if not finished:
        raise RuntimeError(f"{loader} gave fewer than {plan.warm + plan.measured} batches")
    return plan.measured * plan.batch_size / (finished - started)


def configurations(plan: Plan) -> list[tuple[int, str, bool, bool]]:
    """(workers, loader, pin_memory, to_device) in the order each repetition runs them."""
    return list(itertools.product(plan.workers, LOADERS, plan.pins, (False, True)))


def run(plan: Plan, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every measurement of `plan`; the report `table` and `save_json` take."""
    import torch

    device = torch.device(plan.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if plan.sources > CLASSES:
        raise ValueError(
            f"sources should be at most {CLASSES} (labels are classes), got {plan.sources}"
        )
    sources = bench.w7_sources(plan.sources)
    step = Step(plan, device)
    batch = _one_batch(plan, sources)
    ceilings: list[float] = []
    rows = {key: Row(key[1], key[0], key[2], key[3]) for key in configurations(plan)}
    for rep in range(plan.reps):
        ceilings.append(ceiling(plan, step, batch))
        for row in rows.values():
            if progress is not None:
                progress(
                    f"rep {rep + 1}/{plan.reps}: {row.loader} w={row.workers} pin={row.pin_memory} "
                    f"to_device={row.to_device}"
                )
            row.images_per_s.append(
                feed(plan, step, sources, row.loader, row.workers, row.pin_memory, row.to_device)
            )
    top = statistics.median(ceilings)
    for row in rows.values():
        row.median = statistics.median(row.images_per_s)
        row.min, row.max = min(row.images_per_s), max(row.images_per_s)
        row.feed_ratio = row.median / top
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
        "",
        f"{'loader':<14}{'workers':>8}  {'pin_memory':<11}{'to_device':<10}{'images/s':>10}  {'min-max':<17}{'feed':>6}",
    ]
    for row in report["results"]:
        lines.append(
            f"{row['loader']:<14}{row['workers']:>8}  {row['pin_memory']!s:<11}{'yes' if row['to_device'] else 'no':<10}"
            f"{_rate(row['median']):>10}  {_rate(row['min']) + '-' + _rate(row['max']):<17}{row['feed_ratio']:>6.2f}"
        )
    lines.append("")
    lines.append(
        "feed = median images/s end to end over the ceiling's median (1.00: the loader never held the step up)"
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
        why = (
            "built without CUDA"
            if built is None
            else f"built with CUDA {built}, but it finds no usable GPU"
        )
        return f"no CUDA GPU (torch.cuda.is_available() is False: torch {torch.__version__} {why})"
    return None


def main(workers: list[int] | None, reps: int, quick: bool, json_path: str) -> int:
    """Run the GPU bench and print its table (`workers` None: the default list); 0 also when
    it skipped for want of a GPU."""
    why = unavailable()
    if why is not None:
        print(f"stoker bench --gpu: skipped: {why}", flush=True)
        return 0
    if quick:
        plan = Plan.quick(workers if workers is not None else QUICK_WORKERS)
    else:
        plan = Plan(workers=tuple(workers if workers is not None else DEFAULT_WORKERS), reps=reps)

    def progress(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    report = run(plan, progress)
    print(table(report))
    save_json(report, json_path)
    print(f"\nwrote {json_path}")
    return 0
