"""Ragged JPEG batches (`DecodeOnDevice` + `collate_jpegs`) through real workers: the same
batches for every start method, thread workers and none, the same after a mid-epoch resume,
the arena carrying them, and a corrupt file named with its index; decoded on the CPU by
`to_device`'s transform."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("PIL")
torch = pytest.importorskip("torch")

from stoker._vision.photos import make_jpegs  # noqa: E402
from stoker.testing import assert_resumes_identically  # noqa: E402
from stoker.torch import DataLoader, normalize, to_device  # noqa: E402
from stoker.vision import (  # noqa: E402
    DecodeCrop,
    DecodeError,
    DecodeOnDevice,
    ImageFolder,
    JpegBatch,
    collate_jpegs,
    decode_jpegs,
)

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SIZE = 48


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        where = tmp_path_factory.mktemp("folder")
        make_jpegs(str(where), 30, classes=3)
    except FileNotFoundError as exc:  # pragma: no cover - scikit-image is a test dependency
        pytest.skip(str(exc))
    return where


def loader(root: Path, num_workers: int, **kwargs: Any) -> DataLoader:
    dataset = ImageFolder(root, loader=DecodeOnDevice(SIZE))
    return DataLoader(
        dataset, batch_size=4, shuffle=True, generator=7, num_workers=num_workers, collate_fn=collate_jpegs, **kwargs
    )


def epoch(made: DataLoader) -> list[tuple[JpegBatch, Any]]:
    batches = []
    for jpegs, labels in made:
        assert isinstance(jpegs, JpegBatch) and labels.dtype == torch.int64
        batches.append((jpegs, labels))
    return batches


def assert_same(got: list[tuple[JpegBatch, Any]], want: list[tuple[JpegBatch, Any]]) -> None:
    assert len(got) == len(want) == 8  # 30 samples, batches of 4
    for (jpegs, labels), (want_jpegs, want_labels) in zip(got, want):
        assert jpegs == want_jpegs and torch.equal(labels, want_labels)


def test_process_workers_give_the_batches_of_none(root: Path, start_method: str) -> None:
    want = epoch(loader(root, 0))
    assert all((b.indices >= 0).all() for b, _ in want)  # each sample's index came along
    got = epoch(loader(root, 2, multiprocessing_context=start_method))
    assert_same(got, want)
    assert not got[0][0].data.flags.owndata  # a view of the arena's slot, not an unpickled copy


def test_thread_workers_give_the_batches_of_none(root: Path) -> None:
    assert_same(epoch(loader(root, 2, thread_pool=True)), epoch(loader(root, 0)))


def test_a_resumed_epoch_gives_the_same_batches(root: Path) -> None:
    def make(num_workers: int = 2) -> DataLoader:
        return loader(root, num_workers)

    assert_resumes_identically(make, steps=[3, 11], worker_counts=[0, 2], epochs=2)


def test_decoded_on_the_cpu_they_are_decode_crops_batches(root: Path) -> None:
    fed = to_device(loader(root, 2), "cpu", transform=decode_jpegs(MEAN, STD))
    reference = DataLoader(ImageFolder(root, loader=DecodeCrop(SIZE)), batch_size=4, shuffle=True, generator=7)
    norm = normalize(MEAN, STD)
    count = 0
    for (images, labels), (want_images, want_labels) in zip(fed, reference):
        assert images.shape == (len(labels), 3, SIZE, SIZE) and images.dtype == torch.float32
        assert torch.equal(images, norm(want_images)) and torch.equal(labels, want_labels)
        count += 1
    assert count == 8


def test_a_corrupt_header_fails_in_the_worker_naming_file_and_index(root: Path, tmp_path: Path) -> None:
    copy = tmp_path / "images"
    shutil.copytree(root, copy)
    dataset = ImageFolder(copy, loader=DecodeOnDevice(SIZE))
    index = 13
    broken = Path(dataset.samples[index][0])
    broken.write_bytes(broken.read_bytes()[:200] + bytes(range(256)) * 40)
    made = DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=collate_jpegs)
    with pytest.raises(DecodeError, match=rf"{broken.name}' \(sample {index}\)"):
        list(made)


def test_a_corrupt_body_fails_at_decode_naming_file_and_index(root: Path, tmp_path: Path) -> None:
    copy = tmp_path / "images"
    shutil.copytree(root, copy)
    dataset = ImageFolder(copy, loader=DecodeOnDevice(SIZE))
    index = 21
    broken = Path(dataset.samples[index][0])
    data = broken.read_bytes()
    broken.write_bytes(data[: len(data) // 3])  # the header is whole: the worker ships it
    made = DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=collate_jpegs)
    delivered = []
    with pytest.raises(DecodeError, match=rf"{broken.name}' \(sample {index}, image 1 of the batch\)"):
        for images, _ in to_device(made, "cpu", transform=decode_jpegs(MEAN, STD)):
            delivered.append(images)
    assert len(delivered) == 5 and all(np.isfinite(d.numpy()).all() for d in delivered)
