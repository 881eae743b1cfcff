"""W9 of `stoker-bench`: real JPEGs from disk through an ImageNet training pipeline.

The files: `FILES` distinct JPEGs (quality 90) at ImageNet's common sizes, made once from the
photographs scikit-image ships (`_vision/photos.py`; nothing downloaded) and kept in the
system's temporary folder between runs. Each row reads `images` of them (shuffled, batch 64)
through one pipeline:

- "standard": what a torchvision training pipeline does per image, written with Pillow and
  torch (torchvision does not install beside this CPU torch build): decode in full,
  `RandomResizedCrop(224)` (the same box rule), random horizontal flip, to float in [0, 1],
  normalise with ImageNet's mean and std; float32 batches.
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
import tempfile
import time
from typing import Any

import numpy as np

FILES = 2000
QUICK_FILES = 200
IMAGES = 1024
BATCH = 64
SIZE = 224
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
ROWS = (("torch", "standard"), ("stoker.torch", "standard"), ("stoker.torch", "fused"))


class Standard:
    """The torchvision-style pipeline, float32 normalised CHW out."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch
        from PIL import Image

        from stoker._vision.crop import crop_box

        rng = np.random.default_rng()
        with open(self.paths[i], "rb") as file:
            image = Image.open(file).convert("RGB")
        top, left, h, w = crop_box(image.height, image.width, rng)
        image = image.resize((SIZE, SIZE), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
        if rng.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        x = torch.from_numpy(np.array(image)).permute(2, 0, 1).float().div_(255)  # a copy, as ToTensor
        mean = torch.tensor(MEAN).view(3, 1, 1)
        std = torch.tensor(STD).view(3, 1, 1)
        return x.sub_(mean).div_(std), i % 1000


class Fused:
    """`DecodeCrop(224)`: uint8 CHW out."""

    def __init__(self, paths: list[str]) -> None:
        from stoker.vision import DecodeCrop

        self.paths = paths
        self.decode = DecodeCrop(SIZE)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        return self.decode(self.paths[i]), i % 1000


def files(count: int) -> list[str]:
    """The W9 JPEGs, made on first use in the temporary folder."""
    from stoker._vision.photos import make_jpegs

    root = os.path.join(tempfile.gettempdir(), f"stoker-w9-{count}")
    return make_jpegs(root, count)


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def epoch(loader_name: str, pipeline: str, paths: list[str], workers: int) -> tuple[float, float, float]:
    """(images/s, CPU ms per image over all processes, MB per batch) of one epoch."""
    module = importlib.import_module("stoker.torch" if loader_name == "stoker.torch" else "torch.utils.data")
    dataset = Standard(paths) if pipeline == "standard" else Fused(paths)
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
    chosen = [paths[i] for i in rng.permutation(len(paths))[: min(IMAGES if not quick else 256, len(paths))]]
    measured: dict[tuple[str, str, int], list[tuple[float, float, float]]] = {}
    for _ in range(reps):
        for count in workers:
            for loader_name, pipeline in ROWS:
                measured.setdefault((loader_name, pipeline, count), []).append(epoch(loader_name, pipeline, chosen, count))
    rows = []
    for (loader_name, pipeline, count), values in measured.items():
        rows.append({
            "loader": loader_name, "pipeline": pipeline, "workers": count,
            "images_per_s": statistics.median(v[0] for v in values),
            "cpu_ms_per_image": statistics.median(v[1] for v in values),
            "mb_per_batch": values[0][2],
            "all": values,
        })
    return {
        "files": len(paths), "images": len(chosen), "batch": BATCH, "reps": reps,
        "decoder": decoder_name(),
        "cpus": os.cpu_count(), "rows": rows,
    }


def decoder_name() -> str:
    """Which decoder the fused rows used."""
    from stoker._vision import crop

    if crop._simplejpeg() is None:
        return "Pillow"
    if crop._cv2() is not None and crop._turbojpeg() is not None:
        return "simplejpeg (libjpeg-turbo), crop regions by TurboJPEG 3"
    return "simplejpeg (libjpeg-turbo)"


def table(report: dict[str, Any]) -> str:
    """The report as text, with each row's ratios to torch's standard row at its worker count."""
    lines = [
        f"W9: {report['images']} of {report['files']} real JPEGs from disk, RandomResizedCrop(224) + flip, "
        f"batch {report['batch']}, {report['reps']} repetition(s) interleaved, medians; fused decoder: "
        f"{report['decoder']}; {report['cpus']} CPUs",
        f"{'loader':<14}{'pipeline':<10}{'workers':>8}{'images/s':>10}{'vs torch':>10}{'CPU ms/image':>14}"
        f"{'vs torch':>10}{'MB/batch':>10}",
    ]
    base = {r["workers"]: r for r in report["rows"] if r["loader"] == "torch"}
    for row in sorted(report["rows"], key=lambda r: (r["workers"], ROWS.index((r["loader"], r["pipeline"])))):
        torch_row = base[row["workers"]]
        lines.append(
            f"{row['loader']:<14}{row['pipeline']:<10}{row['workers']:>8}{row['images_per_s']:>10,.0f}"
            f"{row['images_per_s'] / torch_row['images_per_s']:>9.2f}x{row['cpu_ms_per_image']:>14.2f}"
            f"{row['cpu_ms_per_image'] / torch_row['cpu_ms_per_image']:>9.2f}x{row['mb_per_batch']:>10.1f}"
        )
    lines.append(
        "standard: full decode, crop, resize, flip, float, normalise on the CPU (float32 out); fused: "
        "stoker.vision.DecodeCrop (uint8 out, normalise on the GPU); CPU ms/image: all processes"
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
