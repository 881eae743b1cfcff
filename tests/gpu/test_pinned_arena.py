"""The pinned arena on a CUDA device: batches born pinned, exact after many epochs of reused
slots, nothing registered once the loader is gone, and copies from the arena that overlap a
step. Skipped where torch finds no CUDA GPU."""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)

from stoker.torch import DataLoader, normalize, to_device  # noqa: E402


class Pictures:
    """96 samples of 3x64x64 uint8, sample i filled from i."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image = (torch.arange(3 * 64 * 64, dtype=torch.int64).reshape(3, 64, 64) + i) % 251
        return image.to(torch.uint8), i


def expected(index: torch.Tensor) -> torch.Tensor:
    base = torch.arange(3 * 64 * 64, dtype=torch.int64).reshape(1, 3, 64, 64)
    return ((base + index.view(-1, 1, 1, 1)) % 251).to(torch.uint8)


def test_batches_are_born_pinned_and_exact_over_many_epochs() -> None:
    loader = DataLoader(Pictures(), batch_size=8, shuffle=True, num_workers=2, pin_memory=True,
                        persistent_workers=True)
    for _ in range(6):  # slots are reused many times over
        for images, index in loader:
            assert images.is_pinned() and index.is_pinned()
            moved = images.to("cuda", non_blocking=True)
            del images  # the slot may be reused once its fence is done, not before
            assert torch.equal(moved.cpu(), expected(index))
    registry = loader._arena.registry
    assert registry is not None and len(registry) > 0
    del loader
    gc.collect()
    torch.cuda.synchronize()
    assert len(registry) == 0  # every slot unregistered when the loader went


def test_to_device_from_the_arena_with_a_normalise_on_the_gpu() -> None:
    loader = DataLoader(Pictures(), batch_size=8, num_workers=2, pin_memory=True)
    mean, std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
    for images, index in to_device(loader, "cuda", transform=normalize(mean, std, key=0)):
        assert images.is_cuda and images.dtype == torch.float32
        want = (expected(index.cpu()).float() / 255 - 0.5) / 0.25
        assert torch.allclose(images.cpu(), want, atol=1e-5)


def test_copies_from_the_arena_overlap_a_step() -> None:
    loader = DataLoader(Pictures(), batch_size=32, num_workers=2, pin_memory=True)
    big = torch.randn(8192, 8192, device="cuda")
    iterator = to_device(loader, "cuda", depth=2).__iter__()
    overlapped = 0
    for _images, _ in iterator:
        for _ in range(16):  # a step of tens of milliseconds on the current stream
            big = big @ big
            big = big / big.norm()
        end = torch.cuda.Event()
        end.record()
        pending = [entry for entry in iterator._pipeline.pending if hasattr(entry, "event")]
        if pending:
            while not pending[0].event.query():  # the next batch's copy, on the side stream
                pass
            overlapped += not end.query()  # finished while the step was still running
    torch.cuda.synchronize()
    assert overlapped >= 1
