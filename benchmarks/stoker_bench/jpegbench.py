"""W9 of `stoker-bench`: real JPEGs from disk through an ImageNet training pipeline.

The files: `FILES` distinct JPEGs (quality 90) at ImageNet's common sizes, made once from the
photographs scikit-image ships (`_vision/photos.py`; nothing downloaded) and kept under the
clone's build/ between runs. An epoch is `max(1024, 64 x 8 x workers)` images, so
that every worker delivers at least 8 batches (1,024 up to 2 workers, 7,168 at 14): the first
that many of the files in a seeded shuffle, sample i reading file `i % files` once the epoch
is longer than the files (`--quick`: 256 images). Each row reads them (shuffled, batch 64)
through one pipeline:

- "standard": what a torchvision training pipeline does per image, written with Pillow and
  torch (`standard_transform`, shared with W12: torchvision does not install beside this CPU
  torch build): decode in full, `RandomResizedCrop(224)` (the same box rule, drawn from torch's
  generator), random horizontal flip, to float in [0, 1], normalise with ImageNet's mean and
  std; float32 batches.
- "fused": `stoker.vision.DecodeCrop(224)`: the box drawn from the header, the JPEG decoded at
  the smallest scale that covers the crop at 224 (libjpeg-turbo through simplejpeg when
  installed), cropped and resized in one pass, flipped; uint8 batches, a quarter of the bytes,
  to be normalised on the GPU (`stoker.torch.normalize`).

Rows: torch.utils.data with "standard", stoker.torch with "standard", stoker.torch with
"fused", at each worker count; repetitions interleaved, medians. Each row gives images/s, the
CPU milliseconds per image summed over every process (the main one and its workers, from
getrusage), and the megabytes a batch carries.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

FILES = 2000
QUICK_FILES = 200
IMAGES = 1024
BATCH = 64
BATCHES_PER_WORKER = 8  # an epoch gives every worker at least this many batches (not in --quick)
SIZE = 224
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
ROWS = (("torch", "standard"), ("stoker.torch", "standard"), ("stoker.torch", "fused"))


class TorchRandom:
    """`crop_box`'s random source drawn from torch's global generator, as torchvision's
    transforms draw theirs (so that each loader's worker seeding is what makes them differ)."""

    def uniform(self, low: float, high: float) -> float:
        import torch

        return float(torch.empty(1).uniform_(low, high).item())

    def integers(self, low: int, high: int) -> int:
        import torch

        return int(torch.randint(low, high, (1,)).item())


class RandomResizedCrop:
    """torchvision's `RandomResizedCrop(size)` on a PIL image, written with Pillow: the box
    drawn by the same rule (`stoker._vision.crop.crop_box`), cropped and resized bilinearly
    with Pillow's antialiasing in one call."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, image: Any) -> Any:
        from PIL import Image

        from stoker._vision.crop import crop_box

        top, left, h, w = crop_box(image.height, image.width, TorchRandom())
        return image.resize((self.size, self.size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))


class RandomHorizontalFlip:
    """torchvision's `RandomHorizontalFlip()` on a PIL image: mirrored with probability 1/2."""

    def __call__(self, image: Any) -> Any:
        import torch
        from PIL import Image

        return image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if torch.rand(1).item() < 0.5 else image


class PILToTensor:
    """torchvision's `PILToTensor()`: a uint8 CHW tensor (a transposed view of a copy of the pixels)."""

    def __call__(self, image: Any) -> Any:
        import torch

        return torch.from_numpy(np.array(image)).permute(2, 0, 1)


class ToTensor:
    """torchvision's `ToTensor()` on an RGB PIL image: contiguous CHW float32 in [0, 1]."""

    def __call__(self, image: Any) -> Any:
        return PILToTensor()(image).contiguous().float().div(255)


class Normalize:
    """torchvision's `Normalize(mean, std)`: a new tensor, (x - mean) / std per channel."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        import torch

        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x: Any) -> Any:
        return (x - self.mean).div_(self.std)


class Compose:
    """torchvision's `Compose`: each transform in turn."""

    def __init__(self, transforms: list[Callable[[Any], Any]]) -> None:
        self.transforms = transforms

    def __call__(self, x: Any) -> Any:
        for transform in self.transforms:
            x = transform(x)
        return x


def standard_transform(size: int = SIZE, uint8: bool = False) -> Compose:
    """The ImageNet training transform written with Pillow and torch: `RandomResizedCrop(size)`,
    `RandomHorizontalFlip()`, then `ToTensor()` and `Normalize(MEAN, STD)` (float32 out) or,
    with `uint8`, `PILToTensor()` (uint8 out)."""
    tail: list[Callable[[Any], Any]] = [PILToTensor()] if uint8 else [ToTensor(), Normalize(MEAN, STD)]
    return Compose([RandomResizedCrop(size), RandomHorizontalFlip(), *tail])


def pil_rgb(path: str) -> Any:
    """The image at `path` decoded in full, in RGB (torchvision's default loader)."""
    from PIL import Image

    with open(path, "rb") as file:
        return Image.open(file).convert("RGB")


class Standard:
    """The torchvision-style pipeline (`standard_transform()`), float32 normalised CHW out;
    sample i is file `i % len(paths)`."""

    def __init__(self, paths: list[str], images: int | None = None) -> None:
        self.paths = paths
        self.images = len(paths) if images is None else images
        self.transform = standard_transform()

    def __len__(self) -> int:
        return self.images

    def __getitem__(self, i: int) -> tuple[Any, int]:
        return self.transform(pil_rgb(self.paths[i % len(self.paths)])), i % 1000


class Fused:
    """`DecodeCrop(224)`: uint8 CHW out; sample i is file `i % len(paths)`."""

    def __init__(self, paths: list[str], images: int | None = None) -> None:
        from stoker.vision import DecodeCrop

        self.paths = paths
        self.images = len(paths) if images is None else images
        self.decode = DecodeCrop(SIZE)

    def __len__(self) -> int:
        return self.images

    def __getitem__(self, i: int) -> tuple[Any, int]:
        return self.decode(self.paths[i % len(self.paths)]), i % 1000


def files(count: int) -> list[str]:
    """The W9 JPEGs, made on first use under the clone's build/ (kept for the next run)."""
    from stoker._vision.photos import make_jpegs

    from . import REPO

    root = os.path.join(REPO, "build", f"w9-jpegs-{count}")
    return make_jpegs(root, count)


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def epoch_images(workers: int, quick: bool, files: int) -> int:
    """The images of an epoch at `workers` over `files` files: IMAGES (256 with `quick`) or
    `files` if fewer, and at least BATCHES_PER_WORKER batches for every worker (not with `quick`)."""
    if quick:
        return min(256, files)
    return max(min(IMAGES, files), BATCH * BATCHES_PER_WORKER * workers)


def epoch(
    loader_name: str, pipeline: str, paths: list[str], workers: int, images_wanted: int | None = None
) -> tuple[float, float, float]:
    """(images/s, CPU ms per image over all processes, MB per batch) of one epoch of
    `images_wanted` images (default: one per path) over `paths`, file `i % len(paths)` for sample i."""
    module = importlib.import_module("stoker.torch" if loader_name == "stoker.torch" else "torch.utils.data")
    dataset = Standard(paths, images_wanted) if pipeline == "standard" else Fused(paths, images_wanted)
    loader = module.DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=workers, drop_last=True)
    gc.collect()
    cpu, started = _cpu_s(), time.perf_counter()
    images, batch_bytes = 0, 0
    iterator = iter(loader)
    for x, y in iterator:
        images += len(y)
        batch_bytes = x.numel() * x.element_size() + y.numel() * y.element_size()
    elapsed = time.perf_counter() - started
    del iterator, loader  # both loaders join their workers here (torch's too, from __del__)
    own = _cpu_s()
    # a full collection of a process holding torch costs ~60 ms of the harness's own CPU, not
    # the loader's: outside the measure, but any worker it still joins is counted
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    gc.collect()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = own - cpu + (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime)
    return images / elapsed, 1000 * cpu / images, batch_bytes / 1e6


def run(workers: list[int], reps: int, quick: bool) -> dict[str, Any]:
    """Every row at every worker count, repetitions interleaved."""
    paths = files(QUICK_FILES if quick else FILES)
    rng = np.random.default_rng(0)
    shuffled = [paths[i] for i in rng.permutation(len(paths))]
    measured: dict[tuple[str, str, int], list[tuple[float, float, float]]] = {}
    sizes = {count: epoch_images(count, quick, len(paths)) for count in workers}
    for _ in range(reps):
        for count in workers:
            chosen = shuffled[: min(sizes[count], len(shuffled))]
            for loader_name, pipeline in ROWS:
                figures = epoch(loader_name, pipeline, chosen, count, sizes[count])
                measured.setdefault((loader_name, pipeline, count), []).append(figures)
    rows = []
    for (loader_name, pipeline, count), values in measured.items():
        rows.append(
            {
                "loader": loader_name,
                "pipeline": pipeline,
                "workers": count,
                "images": sizes[count],
                "images_per_s": statistics.median(v[0] for v in values),
                "cpu_ms_per_image": statistics.median(v[1] for v in values),
                "mb_per_batch": values[0][2],
                "all": values,
            }
        )
    return {
        "files": len(paths),
        "images": max(sizes.values()),
        "batch": BATCH,
        "reps": reps,
        "decoder": decoder_name(),
        "cpus": os.cpu_count(),
        "rows": rows,
    }


def decoder_name() -> str:
    """Which decoder the fused rows used."""
    from stoker._vision import crop

    if crop.find_simplejpeg() is None:
        return "Pillow"
    if crop._cv2() is not None and crop._turbojpeg() is not None:
        return "simplejpeg (libjpeg-turbo), crop regions by TurboJPEG 3"
    return "simplejpeg (libjpeg-turbo)"


def table(report: dict[str, Any]) -> str:
    """The report as text, with each row's ratios to torch's standard row at its worker count."""
    lines = [
        f"W9: real JPEGs from disk ({report['files']} files), RandomResizedCrop(224) + flip, "
        f"batch {report['batch']}, {report['reps']} repetition(s) interleaved, medians; fused decoder: "
        f"{report['decoder']}; {report['cpus']} CPUs",
        f"{'loader':<14}{'pipeline':<10}{'workers':>8}{'images':>8}{'images/s':>10}{'vs torch':>10}{'CPU ms/image':>14}"
        f"{'vs torch':>10}{'MB/batch':>10}",
    ]
    base = {r["workers"]: r for r in report["rows"] if r["loader"] == "torch"}
    for row in sorted(report["rows"], key=lambda r: (r["workers"], ROWS.index((r["loader"], r["pipeline"])))):
        torch_row = base[row["workers"]]
        lines.append(
            f"{row['loader']:<14}{row['pipeline']:<10}{row['workers']:>8}{row['images']:>8}{row['images_per_s']:>10,.0f}"
            f"{row['images_per_s'] / torch_row['images_per_s']:>9.2f}x{row['cpu_ms_per_image']:>14.2f}"
            f"{row['cpu_ms_per_image'] / torch_row['cpu_ms_per_image']:>9.2f}x{row['mb_per_batch']:>10.1f}"
        )
    lines.append(
        "standard: full decode, crop, resize, flip, float, normalise on the CPU (float32 out); fused: "
        "stoker.vision.DecodeCrop (uint8 out, normalise on the GPU); CPU ms/image: all processes; "
        f"images: an epoch (at least {BATCHES_PER_WORKER} batches per worker, files reused past {report['files']})"
    )
    return "\n".join(lines)


def main(workers: list[int], reps: int, quick: bool, json_path: str) -> int:
    """Run W9 and print its table; a line saying why when it cannot run."""
    try:
        import PIL  # noqa: F401
        import torch  # noqa: F401

        from stoker._vision.photos import photo_paths

        photo_paths()
    except (ImportError, FileNotFoundError) as exc:
        print(f"stoker-bench: W9 skipped: {exc} (pip install stoker[bench,torch])", flush=True)
        return 0
    report = run(workers, 1 if quick else reps, quick)
    print(table(report))
    folder = os.path.dirname(json_path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(json_path, "w", encoding="utf-8") as out:
        json.dump(report, out, indent=2)
    print(f"\nwrote {json_path}", file=sys.stderr)
    return 0
