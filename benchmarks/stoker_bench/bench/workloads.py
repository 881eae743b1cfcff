"""`stoker-bench`'s workloads: the datasets of W1-W8, the sizes of their epochs (`Sizes`), W3's
busy-work calibration, and the loaders compared (`loader_modules`)."""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

import stoker

IMAGE_SHAPE = (3, 224, 224)
IMAGE_BYTES = int(np.prod(IMAGE_SHAPE))


# ------------------------------------------------------------------ datasets
class TinyDicts:
    """W1: many tiny samples; per-sample and per-batch overhead dominate."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.x = np.random.default_rng(0).random((1024, 4), dtype=np.float32)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"id": i, "x": self.x[i % 1024]}


DISTINCT_IMAGES = 256


class Images:
    """W2/W6: 3x224x224 uint8 images; bandwidth dominates."""

    def __init__(self, n: int, images: np.ndarray | None = None) -> None:
        self.n = n
        # 256 distinct images (38 MB) so that reads come from memory, not from the CPU's
        # caches, as they do for the memcpy ceiling they are compared against.
        if images is None:
            images = np.random.default_rng(0).integers(0, 255, (DISTINCT_IMAGES, *IMAGE_SHAPE), dtype=np.uint8)
        self.images = images

    def resized(self, n: int) -> Images:
        """The same images, `n` samples long."""
        return Images(n, self.images)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return self.images[i % DISTINCT_IMAGES]


class LargeImages:
    """W8: W2's images, every sample its own memory: sample i is image `i % len(images)`, so an
    epoch of `len(images)` samples reads each image once, in order, and the whole set (1.05 GB
    at 7,000 images) is far larger than any cache."""

    def __init__(self, images: np.ndarray, n: int | None = None) -> None:
        self.images = images
        self.n = len(images) if n is None else n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return self.images[i % len(self.images)]


def w8_images(n: int) -> np.ndarray:
    """W8's `n` distinct 3x224x224 uint8 images, made once per run: 256 images from a seeded RNG,
    repeated with 1 added (mod 256) to every byte at each repetition, so that no two images are
    equal and each is its own memory, written at memory speed rather than at the RNG's."""
    base = np.random.default_rng(8).integers(0, 256, (DISTINCT_IMAGES, *IMAGE_SHAPE), dtype=np.uint8)
    images = np.empty((n, *IMAGE_SHAPE), np.uint8)
    for k, start in enumerate(range(0, n, DISTINCT_IMAGES)):
        stop = min(n, start + DISTINCT_IMAGES)
        np.add(base[: stop - start], np.uint8(k % 256), out=images[start:stop])
    return images


def w8_samples(sizes: Sizes, workers: int) -> int:
    """W8's epoch: every image once, and more (W2's rule, `w2_samples`) only when many workers
    need a longer epoch for a steady-state window (more than 12 at the default size)."""
    return max(sizes.w8_images, 64 * (32 + 16 * workers))


def w2_samples(sizes: Sizes, workers: int) -> int:
    """W2's epoch: at least `sizes.w2` images, and long enough for a steady-state window at
    many workers (the same rule in batches as W7's, `w7_batches`, with the default prefetch)."""
    return max(sizes.w2, 64 * (32 + 16 * workers))


def _busy(rounds: int) -> int:
    total = 0
    for i in range(rounds):
        total += i * i % 7
    return total


def calibrate_busy(target_s: float = 0.002) -> int:
    """Rounds of `_busy` that take about `target_s` on this machine."""
    rounds = 10_000
    while True:
        start = time.perf_counter()
        _busy(rounds)
        took = time.perf_counter() - start
        if took > 0.02:
            return max(1, int(rounds * target_s / took))
        rounds *= 2


class CpuHeavy:
    """W3: each sample costs ~2 ms of Python work; workers should scale with cores."""

    def __init__(self, n: int, rounds: int) -> None:
        self.n, self.rounds = n, rounds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(8, _busy(self.rounds), np.int64)


class HoldsArray:
    """W5: a dataset holding one large array; what start-up costs under spawn."""

    def __init__(self, nbytes: int) -> None:
        self.data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)

    def __len__(self) -> int:
        return 1024

    def __getitem__(self, i: int) -> np.ndarray:
        return self.data[i * 64 : i * 64 + 64]


W7_SOURCE_SHAPE = (3, 256, 256)
W7_CROP = 224
W7_CROP_BYTES = 3 * W7_CROP * W7_CROP
W7_PREFETCH = 4
W7_BATCH_SIZES = (256, 64)
W7_LOADERS = ("stoker.torch", "torch")  # plain stoker would produce the same tensors


def w7_sources(n: int) -> np.ndarray:
    """W7's source images: `n` distinct 3x256x256 uint8 images from a seeded RNG (196 MB at
    n=1000). Made once per bench run and shared by every loader and configuration."""
    return np.random.default_rng(7).integers(0, 256, (n, *W7_SOURCE_SHAPE), dtype=np.uint8)


class ImageNetCrops:
    """W7: an ImageNet-sized tensor pipeline without the decoding.

    Sample `i` is a random 224x224 crop of source image `i % len(sources)`, flipped
    horizontally with probability 1/2, as a torch tensor (`torch.from_numpy` of the crop, a
    non-contiguous view; the flip copies), and its label, a Python int. The randomness comes
    from torch's global RNG, which the loaders seed in each worker, so a sample is
    deterministic given `torch.manual_seed` (in the process that fetches it).
    """

    def __init__(self, sources: np.ndarray, n: int) -> None:
        self.sources, self.n = sources, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch

        sources = self.sources
        label = i % len(sources)
        height, width = sources.shape[2:]
        top = int(torch.randint(0, height - W7_CROP + 1, (1,)))
        left = int(torch.randint(0, width - W7_CROP + 1, (1,)))
        image = torch.from_numpy(sources[label, :, top : top + W7_CROP, left : left + W7_CROP])
        if int(torch.randint(0, 2, (1,))):
            image = image.flip(-1)
        return image, label


def w7_batches(sizes: Sizes, workers: int) -> int:
    """Batches in one W7 epoch: enough that, after `W7_PREFETCH * workers + 1` batches are left
    out at each end (see `steady_window`), the steady-state window still spans several rounds
    of batches of every worker."""
    return max(sizes.w7_min_batches, sizes.w7_base_batches + sizes.w7_batches_per_worker * workers)


def _worker_info() -> Any:
    info: Any = stoker.get_worker_info()  # stoker's WorkerInfo, else torch's
    if info is None and "torch" in sys.modules:
        import torch.utils.data

        info = torch.utils.data.get_worker_info()
    return info


class _StreamBody:
    """W4: an iterable of 128-float32 rows, sharded across workers."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.rows = np.random.default_rng(0).random((256, 128), dtype=np.float32)

    def __iter__(self) -> Iterator[np.ndarray]:
        info = _worker_info()
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        rows = self.rows
        for i in range(start, self.n, step):
            yield rows[i & 255]

    def __len__(self) -> int:
        return self.n


class StokerStream(_StreamBody, stoker.IterableDataset):
    pass


def _torch_stream_class() -> type:
    import torch.utils.data

    return type("TorchStream", (_StreamBody, torch.utils.data.IterableDataset), {"__module__": __name__})


def __getattr__(name: str) -> Any:
    """`TorchStream` (W4's dataset for torch.utils.data), made on first use: a module-level
    name, so that spawn can pickle it, but made lazily, so that importing this module does not
    import torch (W5's spawn and forkserver workers of plain stoker import it to rebuild
    `HoldsArray`)."""
    if name == "TorchStream":
        made = globals().get(name)
        if made is None:
            made = globals()[name] = _torch_stream_class()
        return made
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------- loaders
def loader_modules(with_torch: bool) -> dict[str, Any]:
    """The loaders to compare: name -> module with a DataLoader."""
    mods: dict[str, Any] = {"stoker": stoker}
    if with_torch:
        try:
            import torch
            import torch.utils.data
        except ImportError:
            return mods
        mods["stoker.torch"] = importlib.import_module("stoker.torch")
        mods["torch"] = torch.utils.data
    return mods


def _iterable_for(name: str, n: int) -> Any:
    if name == "torch":  # the "torch" loader is there only when torch imports
        return __getattr__("TorchStream")(n)
    return StokerStream(n)


@dataclass
class Sizes:
    w1: int = 200_000
    w2: int = 4096
    w3: int = 512
    w4: int = 200_000
    w5_mb: tuple[int, ...] = (10, 200)
    w6_images: int = 1024
    w6_epochs: int = 16
    # W7: distinct source images; batches per epoch = max(min, base + per_worker * workers),
    # at either batch size (see w7_batches and benchmarks/README.md)
    w7_sources: int = 1000
    w7_min_batches: int = 40
    w7_base_batches: int = 32
    w7_batches_per_worker: int = 16
    # W1 with stats=True against stats=False: at least this many interleaved pairs of epochs per
    # number of workers (spread evenly over the repetitions, see `pairs_per_rep`)
    stats_pairs: int = 15
    # W8: distinct images, each read once per epoch (7,000 x 150,528 bytes = 1.05 GB)
    w8_images: int = 7000

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            w1=20_000,
            w2=1024,
            w3=256,
            w4=20_000,
            w5_mb=(10, 50),
            w6_images=256,
            w6_epochs=3,
            w7_sources=200,
            w7_min_batches=6,
            w7_base_batches=4,
            w7_batches_per_worker=4,
            stats_pairs=2,
            w8_images=448,  # 67 MB
        )
