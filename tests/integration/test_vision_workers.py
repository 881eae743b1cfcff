"""The drop-in ImageNet transform in real workers: `ImageFolder(root, transform=DecodeCrop(...))`
through `stoker.torch.DataLoader` gives the same batches, pixel for pixel, for the same seed
whatever the workers (none, processes forked or spawned, threads), and resumes exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

from stoker.testing import assert_resumes_identically  # noqa: E402
from stoker.torch import DataLoader  # noqa: E402
from stoker.vision import DecodeCrop, ImageFolder  # noqa: E402

try:
    from stoker._vision.photos import make_jpegs, photo_paths

    photo_paths()
except FileNotFoundError as exc:  # pragma: no cover - scikit-image is a test dependency
    pytest.skip(str(exc), allow_module_level=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("imagefolder")
    make_jpegs(str(folder), 30, classes=3, seed=5)
    return folder


def loader(root: Path, num_workers: int = 0, seed: int = 41, **kwargs: Any) -> DataLoader:
    dataset = ImageFolder(root, transform=DecodeCrop(48))
    return DataLoader(
        dataset,
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        num_workers=num_workers,
        **kwargs,
    )


def epochs(made: DataLoader, count: int = 2) -> list[list[tuple[Any, Any]]]:
    return [[(images.clone(), labels.clone()) for images, labels in made] for _ in range(count)]


def same(a: list[list[tuple[Any, Any]]], b: list[list[tuple[Any, Any]]]) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(torch.equal(i, j) and torch.equal(k, m) for (i, k), (j, m) in zip(x, y))
        for x, y in zip(a, b)
    )


def test_the_same_crops_for_any_workers(root: Path) -> None:
    reference = epochs(loader(root))
    first = reference[0][0][0]
    assert first.dtype == torch.uint8 and first.shape == (4, 3, 48, 48)
    assert not same(reference[:1], reference[1:])  # another epoch, other crops
    for kwargs in [
        {"num_workers": 2, "multiprocessing_context": "fork"},
        {"num_workers": 2, "multiprocessing_context": "spawn"},
        {"num_workers": 2, "thread_pool": True},
    ]:
        assert same(epochs(loader(root, **kwargs)), reference), kwargs
    # persistent workers keep their first epoch's base seed (as torch's do): the same first
    # epoch, and later epochs the same for any persistent workers
    persistent = epochs(loader(root, 3, multiprocessing_context="fork", persistent_workers=True))
    assert same(persistent[:1], reference[:1])
    assert same(epochs(loader(root, 1, thread_pool=True, persistent_workers=True)), persistent)


def test_another_seed_gives_other_crops(root: Path) -> None:
    assert not same(epochs(loader(root, seed=42), 1), epochs(loader(root), 1))


@pytest.mark.parametrize("kind", ["fork", "spawn", "threads"])
def test_it_resumes_exactly(root: Path, kind: str) -> None:
    def make(num_workers: int = 2) -> DataLoader:
        if not num_workers:
            return loader(root)
        if kind == "threads":
            return loader(root, num_workers, thread_pool=True)
        return loader(root, num_workers, multiprocessing_context=kind)

    # 8 batches an epoch: inside the first, at its end, inside the second
    assert_resumes_identically(make, steps=[3, 8, 11], worker_counts=[0, 2], epochs=2)
