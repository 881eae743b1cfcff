"""W12 of `stoker-bench`: the image pipeline most PyTorch users run, torchvision's ImageNet
training transform over an `ImageFolder` of JPEGs, through torch.utils.data and stoker.torch.

The files: W9's, an ImageFolder tree (`class_00/img_00000.jpg`, ...) of `FILES` distinct real
JPEGs (quality 90) at ImageNet's common sizes (500x375, 375x500, 500x333, 500x400, 640x480,
800x600), made once from scikit-image's photographs (`stoker._vision.photos`) and kept under
the clone's build/ between runs. The dataset: torchvision's `ImageFolder` with
`Compose([RandomResizedCrop(224), RandomHorizontalFlip(), ToTensor(), Normalize(mean, std)])`
where torchvision imports; else `Folder` (the same layout, a Python list of (path, class) as
torchvision keeps it, Pillow's RGB decode) with the same operations written with Pillow and
torch (`jpegbench.standard_transform`, which W9 runs too). The table says which ran.

The rows (`PIPELINES`, a table of named pipelines that later rows join): "float" is the
transform above (float32 batches, 154 MB at batch 256); "uint8" ends with `PILToTensor()`
instead of `ToTensor()` and `Normalize` (uint8 batches, a quarter of the bytes). Each runs with
`torch.utils.data.DataLoader` and `stoker.torch.DataLoader`, the same dataset and transform:
`DataLoader(dataset, batch_size=256, shuffle=True, num_workers=N, prefetch_factor=4)`.

An epoch gives every worker at least 8 batches: `256 x max(8 x N, ceil(files / 256))` samples
(4,096 at 2 workers, 28,672 at 14), sample i reading file `i % files` (`Repeat`): at many
workers each file is read several times an epoch, from the page cache (the files are read once
before the first row). Per row, medians of the repetitions (interleaved: torch, stoker, torch,
stoker, ...; one repetition at worker counts above the usable CPUs, where an epoch is long and
the rate is bound by the cores):

- epoch images/s: the samples over the time from `iter()` to the last batch;
- middle images/s: the batches after the first quarter of the epoch's batches, up to three
  quarters, over the time between those arrivals;
- first batch: seconds from `iter()` to the first batch;
- worker CPU per image (user and sys, ms) and worker page faults per image (minor + major):
  read from `/proc/<pid>/stat` of each process that is a child of the main process and was not
  one before `iter()` (the loader's workers), at every batch's arrival, each worker's last
  reading kept: for a plain loader that is at the last batch, before the iterator ends (the
  workers still alive, every batch made); a child process's counters start at its fork, so
  this is each worker's whole life, its start included (Linux only: elsewhere these are left
  out);
- main CPU per image: the main process's user + sys (getrusage) over the same span.

Ratios are stoker.torch / torch.utils.data at the same worker count (a pipeline that names a
`baseline` is compared with that pipeline's torch row).
"""

from __future__ import annotations

import gc
import importlib
import json
import math
import os
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import jpegbench

FILES = jpegbench.FILES
QUICK_FILES = jpegbench.QUICK_FILES
BATCH = 256
QUICK_BATCH = 16
PREFETCH = 4
BATCHES_PER_WORKER = 8
WORKERS = (2, 4, 8, 14)
QUICK_WORKERS = (2,)
SIZE = jpegbench.SIZE
MEAN, STD = jpegbench.MEAN, jpegbench.STD
LOADERS = {"torch": "torch.utils.data", "stoker.torch": "stoker.torch"}


class Repeat:
    """`samples` samples over `dataset`: sample i is `dataset[i % len(dataset)]`."""

    def __init__(self, dataset: Any, samples: int) -> None:
        self.dataset = dataset
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> Any:
        return self.dataset[i % len(self.dataset)]


class Folder:
    """torchvision's `ImageFolder` where torchvision does not import: `root/<class>/<file>`,
    classes and files sorted, `samples` a list of (path, class index), Pillow's RGB decode."""

    def __init__(self, root: str, transform: Callable[[Any], Any]) -> None:
        from stoker._vision.folder import IMG_EXTENSIONS, find_classes

        self.classes, self.class_to_idx = find_classes(root)
        self.samples = [
            (os.path.join(root, name, file), index)
            for name, index in self.class_to_idx.items()
            for file in sorted(os.listdir(os.path.join(root, name)))
            if file.lower().endswith(IMG_EXTENSIONS)
        ]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        path, target = self.samples[i]
        return self.transform(jpegbench.pil_rgb(path)), target


def torchvision() -> Any:
    """torchvision's module where it imports beside this torch, else None."""
    try:
        module = importlib.import_module("torchvision")
        importlib.import_module("torchvision.transforms")
        importlib.import_module("torchvision.datasets")
    except Exception:  # an ImportError, or a build that does not match this torch's
        return None
    return module


def transforms_name() -> str:
    """Which transforms the rows ran."""
    module = torchvision()
    if module is not None:
        return f"torchvision {module.__version__} (ImageFolder, transforms)"
    return "Pillow + torch (torchvision does not import here: jpegbench.standard_transform, w12.Folder)"


def imagenet_folder(root: str, uint8: bool) -> Any:
    """The ImageFolder at `root` with the ImageNet training transform (float32 normalised, or uint8)."""
    module = torchvision()
    if module is None:
        return Folder(root, jpegbench.standard_transform(SIZE, uint8=uint8))
    t = module.transforms
    tail = [t.PILToTensor()] if uint8 else [t.ToTensor(), t.Normalize(MEAN, STD)]
    transform = t.Compose([t.RandomResizedCrop(SIZE), t.RandomHorizontalFlip(), *tail])
    return module.datasets.ImageFolder(root, transform=transform)


@dataclass(frozen=True)
class Pipeline:
    """One family of W12's rows.

    Args:
        name: The row's name in the table and the JSON.
        describe: One line for the table's legend.
        dataset: `(root, samples) -> dataset` of `samples` (image, label) samples over the
            ImageFolder at `root`.
        loaders: Which of `LOADERS` run it.
        baseline: The pipeline whose torch.utils.data row its ratios are against; "" means its own.
        options: More DataLoader arguments, the same for every loader.
        wrap: What the loop iterates instead of the loader itself (e.g. `stoker.torch.to_device`);
            None means the loader. It must yield (images, labels) batches.
    """

    name: str
    describe: str
    dataset: Callable[[str, int], Any]
    loaders: tuple[str, ...] = tuple(LOADERS)
    baseline: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)
    wrap: Callable[[Any], Iterable[Any]] | None = None


def drop_in_folder(root: str) -> Any:
    """stoker.vision's drop-in for the transform, `ImageFolder(root, transform=DecodeCrop(224))`:
    the workers decode only what each crop needs and send uint8."""
    from stoker.vision import DecodeCrop, ImageFolder

    return ImageFolder(root, transform=DecodeCrop(SIZE))


def normalized_on_device(loader: Any) -> Any:
    """The drop-in's other line, `to_device(loader, device, transform=normalize(mean, std))`: on
    CUDA where present, else on this CPU, in the main process."""
    import torch

    from stoker.torch import normalize, to_device

    return to_device(loader, "cuda" if torch.cuda.is_available() else "cpu", transform=normalize(MEAN, STD))


PIPELINES: dict[str, Pipeline] = {
    "float": Pipeline(
        "float",
        "ImageFolder + RandomResizedCrop(224), RandomHorizontalFlip(), ToTensor(), Normalize(mean, std): float32",
        lambda root, samples: Repeat(imagenet_folder(root, uint8=False), samples),
    ),
    "uint8": Pipeline(
        "uint8",
        "ImageFolder + RandomResizedCrop(224), RandomHorizontalFlip(), PILToTensor(): uint8",
        lambda root, samples: Repeat(imagenet_folder(root, uint8=True), samples),
    ),
    "drop-in": Pipeline(
        "drop-in",
        "stoker.vision.ImageFolder(root, transform=DecodeCrop(224)): uint8 out of the workers, to be "
        "normalised on the GPU by to_device(loader, device, transform=normalize(mean, std)) (not in this row)",
        lambda root, samples: Repeat(drop_in_folder(root), samples),
        baseline="float",
    ),
    "drop-norm": Pipeline(
        "drop-norm",
        "the drop-in with its other line, to_device(loader, device, transform=normalize(mean, std)): float32, "
        "normalised on CUDA where present, else on this CPU in the main process",
        lambda root, samples: Repeat(drop_in_folder(root), samples),
        baseline="float",
        wrap=normalized_on_device,
    ),
}


def epoch_samples(workers: int, files: int, batch: int) -> int:
    """An epoch's samples: whole batches, at least BATCHES_PER_WORKER of them per worker, and
    at least every file once."""
    return batch * max(BATCHES_PER_WORKER * max(workers, 1), math.ceil(files / batch))


def _stat(pid: int) -> tuple[int, int, int, int, int] | None:
    """(parent pid, minor faults, major faults, user ticks, sys ticks) of a process, or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as file:
            text = file.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after the command's name, which may hold spaces
    return int(fields[1]), int(fields[7]), int(fields[9]), int(fields[11]), int(fields[12])


def children() -> dict[int, tuple[int, int, int, int, int]] | None:
    """The /proc/<pid>/stat figures of this process's children, by pid; None without /proc."""
    if not os.path.isdir("/proc/self"):
        return None
    me, found = os.getpid(), {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None and stat[0] == me:
                found[int(name)] = stat
    return found


def track(seen: dict[int, tuple[int, int, int, int, int]], before: Mapping[int, Any], workers: int) -> None:
    """Updates `seen`, the /proc/<pid>/stat figures of the loader's worker processes (children of
    this process that are not in `before`), with their figures now: a scan of /proc until
    `workers` of them are found, then a read of each one's own file (a worker gone keeps its
    last figures)."""
    if len(seen) < workers:
        for pid, stat in (children() or {}).items():
            if pid not in before:
                seen[pid] = stat
        return
    me = os.getpid()
    for pid in seen:
        now = _stat(pid)
        if now is not None and now[0] == me:
            seen[pid] = now


def _cpu_self() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def epoch(pipeline: Pipeline, loader_name: str, root: str, workers: int, samples: int, batch: int) -> dict[str, Any]:
    """One epoch of a fresh loader; its figures (see the module's docstring)."""
    module = importlib.import_module(LOADERS[loader_name])
    options: dict[str, Any] = {"prefetch_factor": PREFETCH} if workers else {}
    with warnings.catch_warnings():  # more workers than cores is on purpose here
        warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
        loader = module.DataLoader(
            pipeline.dataset(root, samples),
            batch_size=batch,
            shuffle=True,
            num_workers=workers,
            **options,
            **pipeline.options,
        )
    gc.collect()
    before = children()
    arrivals: list[float] = []
    sizes: list[int] = []
    batch_mb = 0.0
    expected = len(loader)
    workers_seen: dict[int, tuple[int, int, int, int, int]] | None = {} if before is not None else None
    main_cpu = 0.0
    cpu, started = _cpu_self(), time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
        iterator = iter(pipeline.wrap(loader) if pipeline.wrap is not None else loader)
    for batch_data in iterator:
        arrivals.append(time.perf_counter())
        sizes.append(len(batch_data[1]))
        if len(sizes) == 1:
            batch_mb = sum(t.numel() * t.element_size() for t in batch_data[:2]) / 1e6
        del batch_data
        if workers and workers_seen is not None and before is not None:
            # at every arrival, so that a worker that ends before the loop's last batch (a `wrap`
            # that reads ahead) still counts, with its figures as last read
            track(workers_seen, before, workers)
        if len(arrivals) == expected:
            main_cpu = _cpu_self() - cpu
    del iterator, loader
    gc.collect()
    images = sum(sizes)
    first, last = len(sizes) // 4, (3 * len(sizes)) // 4
    row: dict[str, Any] = {
        "images": images,
        "batches": len(sizes),
        "epoch_images_per_s": images / (arrivals[-1] - started),
        "middle_images_per_s": (sum(sizes[first + 1 : last + 1]) / (arrivals[last] - arrivals[first]))
        if last > first
        else None,
        "first_batch_s": arrivals[0] - started,
        "batch_mb": batch_mb,
        "main_cpu_ms_per_image": 1000 * main_cpu / images,
        "worker_processes": None,
        "worker_user_ms_per_image": None,
        "worker_sys_ms_per_image": None,
        "worker_faults_per_image": None,
    }
    if workers_seen and workers:  # None or {}: no /proc, or no worker process found
        tick = os.sysconf("SC_CLK_TCK")
        row["worker_processes"] = len(workers_seen)
        row["worker_user_ms_per_image"] = 1000 * sum(s[3] for s in workers_seen.values()) / tick / images
        row["worker_sys_ms_per_image"] = 1000 * sum(s[4] for s in workers_seen.values()) / tick / images
        row["worker_faults_per_image"] = sum(s[1] + s[2] for s in workers_seen.values()) / images
    return row


FIGURES = (
    "epoch_images_per_s",
    "middle_images_per_s",
    "first_batch_s",
    "worker_user_ms_per_image",
    "worker_sys_ms_per_image",
    "worker_faults_per_image",
    "main_cpu_ms_per_image",
)


def _median(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def reps_at(workers: int, reps: int, cpus: int) -> int:
    """The repetitions run at `workers`: all of them within the usable CPUs, one above."""
    return reps if workers <= cpus else 1


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def warm(paths: list[str]) -> None:
    """Reads every file once, so that no row pays for the disk."""
    for path in paths:
        with open(path, "rb") as file:
            file.read()


def run(
    workers: list[int], reps: int, quick: bool, pipelines: list[str] | None = None, progress: bool = False
) -> dict[str, Any]:
    """Every pipeline with each of its loaders at every worker count; repetitions interleaved
    (`pipelines`: names in PIPELINES, default all; `progress`: a line on stderr per epoch)."""
    paths = jpegbench.files(QUICK_FILES if quick else FILES)
    root = os.path.dirname(os.path.dirname(paths[0]))
    batch = QUICK_BATCH if quick else BATCH
    chosen = [PIPELINES[name] for name in (pipelines or list(PIPELINES))]
    cpus = usable_cpus()
    warm(paths)
    measured: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    samples = {count: epoch_samples(count, len(paths), batch) for count in workers}
    for rep in range(max(reps_at(count, reps, cpus) for count in workers)):
        for count in workers:
            if rep >= reps_at(count, reps, cpus):
                continue
            for pipeline in chosen:
                for loader_name in pipeline.loaders:
                    figures = epoch(pipeline, loader_name, root, count, samples[count], batch)
                    measured.setdefault((pipeline.name, loader_name, count), []).append(figures)
                    if progress:
                        print(
                            f"W12 {pipeline.name} {loader_name} workers={count} repetition {rep + 1}: "
                            f"{figures['epoch_images_per_s']:,.0f} images/s",
                            file=sys.stderr,
                            flush=True,
                        )
    rows = []
    for (name, loader_name, count), values in measured.items():
        row: dict[str, Any] = {
            "pipeline": name,
            "loader": loader_name,
            "workers": count,
            "samples": samples[count],
            "reps": len(values),
        }
        row.update({key: _median([v[key] for v in values]) for key in FIGURES})
        row["worker_processes"] = values[0]["worker_processes"]
        row["batch_mb"] = values[0]["batch_mb"]
        row["all"] = values
        rows.append(row)
    return {
        "workload": "W12",
        "files": len(paths),
        "root": root,
        "batch": batch,
        "prefetch_factor": PREFETCH,
        "reps": reps,
        "cpus": cpus,
        "transforms": transforms_name(),
        "pipelines": {
            p.name: {"describe": p.describe, "loaders": list(p.loaders), "baseline": p.baseline or p.name}
            for p in chosen
        },
        "rows": rows,
    }


def _ratio(value: Any, base: Any) -> str:
    if value is None or not base:
        return ""
    return f"{value / base:.2f}x"


def _num(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(report: dict[str, Any]) -> str:
    """The report as text: a line per row, each figure with its ratio to torch's row."""
    order = list(report["pipelines"])
    loaders = list(LOADERS)
    lines = [
        f"W12: ImageFolder of {report['files']} real JPEGs (ImageNet sizes), batch {report['batch']}, shuffle, "
        f"prefetch_factor={report['prefetch_factor']}, epochs of >= {BATCHES_PER_WORKER} batches per worker; "
        f"transforms: {report['transforms']}; repetitions interleaved, medians; {report['cpus']} CPUs",
        f"{'pipeline':<9}{'workers':>7}  {'loader':<13}{'samples':>8}{'reps':>5}{'epoch/s':>9}{'x':>7}"
        f"{'middle/s':>10}{'x':>7}{'1st s':>7}{'x':>7}{'wk user':>9}{'wk sys':>8}{'x':>7}{'faults':>8}{'x':>7}"
        f"{'main ms':>9}",
    ]
    keyed = {(r["pipeline"], r["loader"], r["workers"]): r for r in report["rows"]}
    for row in sorted(
        report["rows"], key=lambda r: (r["workers"], order.index(r["pipeline"]), loaders.index(r["loader"]))
    ):
        base = keyed.get((report["pipelines"][row["pipeline"]]["baseline"], "torch", row["workers"]), {})
        cpu = (
            None
            if row["worker_user_ms_per_image"] is None
            else row["worker_user_ms_per_image"] + row["worker_sys_ms_per_image"]
        )
        base_cpu = (
            None
            if base.get("worker_user_ms_per_image") is None
            else base["worker_user_ms_per_image"] + base["worker_sys_ms_per_image"]
        )
        lines.append(
            f"{row['pipeline']:<9}{row['workers']:>7}  {row['loader']:<13}{row['samples']:>8}{row['reps']:>5}"
            f"{row['epoch_images_per_s']:>9,.0f}{_ratio(row['epoch_images_per_s'], base.get('epoch_images_per_s')):>7}"
            f"{_num(row['middle_images_per_s'], '9,.0f'):>10}"
            f"{_ratio(row['middle_images_per_s'], base.get('middle_images_per_s')):>7}"
            f"{row['first_batch_s']:>7.2f}{_ratio(row['first_batch_s'], base.get('first_batch_s')):>7}"
            f"{_num(row['worker_user_ms_per_image'], '.2f'):>9}{_num(row['worker_sys_ms_per_image'], '.2f'):>8}"
            f"{_ratio(cpu, base_cpu):>7}{_num(row['worker_faults_per_image'], '.1f'):>8}"
            f"{_ratio(row['worker_faults_per_image'], base.get('worker_faults_per_image')):>7}"
            f"{row['main_cpu_ms_per_image']:>9.2f}"
        )
    lines.append(
        "epoch/s: images from iter() to the last batch; middle/s: batches between 1/4 and 3/4 of the epoch; "
        "1st s: iter() to the first batch; wk user/sys: the workers' CPU ms per image and faults: their page "
        "faults (minor + major) per image, from /proc/<pid>/stat at the last batch; main ms: the main "
        "process's CPU ms per image; x: ratio to torch.utils.data's row (CPU: user + sys)"
    )
    lines += [f"{name}: {p['describe']}" for name, p in report["pipelines"].items()]
    return "\n".join(lines)


def main(workers: list[int] | None, reps: int, quick: bool, json_path: str) -> int:
    """Run W12 (at `workers`, default WORKERS, or QUICK_WORKERS with `quick`) and print its
    table; a line saying why when it cannot run."""
    try:
        import PIL  # noqa: F401
        import torch  # noqa: F401

        from stoker._vision.photos import photo_paths

        photo_paths()
    except (ImportError, FileNotFoundError) as exc:
        print(f"stoker-bench: W12 skipped: {exc} (pip install stoker[bench,torch])", flush=True)
        return 0
    chosen = list(workers) if workers is not None else list(QUICK_WORKERS if quick else WORKERS)
    report = run(chosen, 1 if quick else reps, quick, progress=True)
    print(table(report), flush=True)
    folder = os.path.dirname(json_path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(json_path, "w", encoding="utf-8") as out:
        json.dump(report, out, indent=2)
    print(f"\nwrote {json_path}", file=sys.stderr)
    return 0
