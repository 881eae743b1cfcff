"""An image-like pipeline: decode, random crop, flip, normalise, batch.

The dataset holds N synthetic "encoded images" (zlib-compressed uint8 arrays, made
deterministically when it is built) and does decode-like CPU work per sample, as a JPEG
pipeline would. Its augmentation draws from `stoker.sample_rng()`, so the same sample gets
the same crop and flip in the same epoch whatever the number or kind of workers.

    python examples/image_pipeline.py          # a short toy training loop
    stoker doctor examples/image_pipeline.py:make_loader --seconds 30 --step-ms 50
"""

from __future__ import annotations

import time
import zlib

import numpy as np

import stoker

# ImageNet's channel statistics, as most pipelines normalise with them
MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


class EncodedImages(stoker.Dataset):
    """`n` compressed `size`x`size`x3 uint8 images with labels in [0, classes); items are
    (float32 image of shape (3, crop, crop), int label)."""

    def __init__(self, n: int = 1024, size: int = 112, crop: int = 96, classes: int = 10, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        # Blocky content compresses like a photo does (pure noise would not); a little
        # texture, shifted per image, keeps the decoder busy.
        texture = rng.integers(0, 2, (size, size, 3), dtype=np.uint8)
        blobs = []
        for k in range(n):
            blocks = rng.integers(0, 256, (size // 8, size // 8, 3), dtype=np.uint8)
            image = np.repeat(np.repeat(blocks, 8, axis=0), 8, axis=1)
            image |= np.roll(texture, k, axis=1)
            blobs.append(zlib.compress(image.tobytes(), 1))
        # One flat byte array plus offsets rather than a list of bytes objects: worker
        # processes share it without copying (a big list of Python objects is copied page
        # by page into every forked worker as their reference counts are touched).
        self.data = np.frombuffer(b"".join(blobs), np.uint8)
        self.offsets = np.cumsum([0] + [len(b) for b in blobs])
        self.labels = rng.integers(0, classes, n)
        self.size = size
        self.crop = crop

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        encoded = self.data[self.offsets[i] : self.offsets[i + 1]]
        pixels = np.frombuffer(zlib.decompress(encoded), np.uint8).reshape(self.size, self.size, 3)
        rng = stoker.sample_rng()  # per-sample stream: same crop whichever worker fetches it
        top, left = rng.integers(0, self.size - self.crop + 1, 2)
        image = pixels[top : top + self.crop, left : left + self.crop]
        if rng.random() < 0.5:
            image = image[:, ::-1]
        image = (image.astype(np.float32) / 255 - MEAN) / STD
        # channels first, contiguous: what a convolutional model takes
        return np.ascontiguousarray(image.transpose(2, 0, 1)), int(self.labels[i])


def make_dataset() -> EncodedImages:
    return EncodedImages()


def make_loader() -> stoker.DataLoader:
    return stoker.DataLoader(make_dataset(), batch_size=64, shuffle=True, num_workers=1, generator=0)


def main() -> None:
    loader = make_loader()
    # A toy model: a linear classifier on per-channel means, updated by plain SGD.
    weights = np.zeros((3, 10), np.float32)
    for epoch in range(2):
        start = time.perf_counter()
        samples = 0
        for images, labels in loader:
            features = images.mean(axis=(2, 3))  # (batch, 3)
            logits = features @ weights
            probs = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)
            probs[np.arange(len(labels)), labels] -= 1
            weights -= 0.1 * features.T @ probs / len(labels)
            samples += len(labels)
        elapsed = time.perf_counter() - start
        print(f"epoch {epoch}: {samples} images in {elapsed:.2f} s, {samples / elapsed:,.0f} images/s")


if __name__ == "__main__":
    main()
