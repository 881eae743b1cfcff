"""Real photographs for benchmarks and tests, made from the sample images scikit-image ships
(nothing is downloaded): distinct JPEG files at ImageNet's sizes, in class folders."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import numpy as np

# scikit-image's bundled photographs (its other samples are drawings, scans or textures)
PHOTOS = (
    "astronaut.png",
    "chelsea.png",
    "coffee.png",
    "motorcycle_left.png",
    "motorcycle_right.png",
    "rocket.jpg",
    "hubble_deep_field.jpg",
    "retina.jpg",
    "immunohistochemistry.png",
    "ihc.png",
)
# ImageNet's common sizes (width, height): most are 500 wide or high, some larger
SIZES = ((500, 375), (375, 500), (500, 333), (500, 400), (640, 480), (800, 600))
QUALITY = 90


def photo_paths() -> list[str]:
    """The paths of scikit-image's bundled photographs (FileNotFoundError without it)."""
    spec = importlib.util.find_spec("skimage")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the W9 photographs come from scikit-image: pip install stoker[bench]")
    folder = os.path.join(os.path.dirname(spec.origin), "data")
    found = [os.path.join(folder, name) for name in PHOTOS if os.path.exists(os.path.join(folder, name))]
    if not found:
        raise FileNotFoundError(f"no photograph found in {folder}")
    return found


def make_jpegs(root: str, count: int, classes: int = 10, seed: int = 0) -> list[str]:
    """Write `count` distinct JPEGs (quality 90) into `root/class_k/`, each a random crop of a
    photograph, resized to one of ImageNet's common sizes, maybe mirrored, its brightness
    and colour balance nudged; returns their paths. Files already there are kept."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    sources = [Image.open(path).convert("RGB") for path in photo_paths()]
    paths = []
    for i in range(count):
        folder = os.path.join(root, f"class_{i % classes:02d}")
        path = os.path.join(folder, f"img_{i:05d}.jpg")
        paths.append(path)
        if os.path.exists(path):
            continue
        os.makedirs(folder, exist_ok=True)
        source: Any = sources[int(rng.integers(len(sources)))]
        width, height = SIZES[int(rng.integers(len(SIZES)))]
        frac = rng.uniform(0.6, 1.0)
        w, h = max(16, int(source.width * frac)), max(16, int(source.height * frac))
        left, top = int(rng.integers(0, source.width - w + 1)), int(rng.integers(0, source.height - h + 1))
        image = source.resize((width, height), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
        if rng.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        pixels = np.asarray(image, dtype=np.float32) * rng.uniform(0.8, 1.2, size=3) + rng.uniform(-10, 10)
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path, "JPEG", quality=QUALITY)
    return paths
