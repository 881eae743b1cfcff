"""Pinned memory on a CUDA device. Plain `pin_memory=True`: batches in torch's pinned memory,
intact under copies queued on a side stream from another thread while the workers go on
(the prefetchers of timm and NVIDIA's ImageNet example do this). `pin_memory="born"`: batches
born pinned in the arena, exact after many epochs of reused slots, nothing registered once
the loader is gone. `to_device`: born pinned under it, copied out again in a later plain
epoch; its copies overlap a step. Skipped where torch finds no CUDA GPU."""

from __future__ import annotations

import gc
import queue
import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)

from stoker.torch import DataLoader, normalize, to_device  # noqa: E402

# GPU cycles the side stream sleeps before each copy (milliseconds on any current GPU): the
# copy starts long after its host batch was dropped and its memory could have been reused
SIDE_SLEEP_CYCLES = 20_000_000
JOIN_S = 120.0


class Pictures:
    """`n` samples of 3x64x64 uint8, sample i filled from i."""

    def __init__(self, n: int = 96) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image = (torch.arange(3 * 64 * 64, dtype=torch.int64).reshape(3, 64, 64) + i) % 251
        return image.to(torch.uint8), i


def expected(index: torch.Tensor) -> torch.Tensor:
    base = torch.arange(3 * 64 * 64, dtype=torch.int64).reshape(1, 3, 64, 64)
    return ((base + index.view(-1, 1, 1, 1)) % 251).to(torch.uint8)


def in_registered_slot(loader: Any, tensor: torch.Tensor) -> bool:
    registry = loader._arena.registry
    return registry is not None and registry.holds(tensor.data_ptr())


def side_stream_copies(loader: Any, epochs: int) -> tuple[int, list[int]]:
    """Iterate `loader` here; copy each batch on a side stream of a second thread, after a
    GPU sleep on that stream, dropping the host batch as soon as the copy is queued. Returns
    (batches copied, positions of those whose device copy differs from what was loaded)."""
    side = torch.cuda.Stream()
    handed: queue.Queue[Any] = queue.Queue(maxsize=4)
    copied: list[tuple[torch.Tensor, torch.Tensor]] = []
    errors: list[BaseException] = []

    def copy_on_the_side() -> None:
        try:
            with torch.cuda.stream(side):
                while True:
                    item = handed.get()
                    if item is None:
                        return
                    images, index = item
                    del item
                    torch.cuda._sleep(SIDE_SLEEP_CYCLES)
                    moved = images.to("cuda", non_blocking=True)
                    copied.append((moved, index.clone()))
                    del images, index  # the host batch goes now; its copy has not started
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=copy_on_the_side, name="test-side-stream")
    thread.start()
    try:
        for _ in range(epochs):
            for images, index in loader:  # the workers keep filling slots meanwhile
                assert images.is_pinned()
                handed.put((images, index))
                del images, index
    finally:
        handed.put(None)
        thread.join(JOIN_S)
    assert not thread.is_alive() and not errors, errors
    side.synchronize()
    wrong = [at for at, (moved, index) in enumerate(copied) if not torch.equal(moved.cpu(), expected(index))]
    return len(copied), wrong


def test_side_stream_copies_from_another_thread_see_every_batch_as_loaded() -> None:
    loader = DataLoader(
        Pictures(256),
        batch_size=8,
        shuffle=True,
        num_workers=2,
        pin_memory=True,
        prefetch_factor=4,
        persistent_workers=True,
    )
    count, wrong = side_stream_copies(loader, epochs=2)
    assert count == 2 * 32
    assert wrong == []  # no batch was rewritten while its copy could still read it
    assert loader._arena.registry is None  # plain pin_memory=True registers no slot


def test_plain_pin_memory_gives_torchs_pinned_memory_after_a_to_device_pass() -> None:
    loader = DataLoader(Pictures(), batch_size=8, num_workers=2, pin_memory=True, persistent_workers=True)
    for images, index in to_device(loader, "cuda"):  # born pinned under to_device
        assert images.is_cuda and torch.equal(images.cpu(), expected(index.cpu()))
    registry = loader._arena.registry
    assert registry is not None and len(registry) > 0
    for images, _ in loader:  # a plain epoch: copied out of the registered slots
        assert images.is_pinned() and not in_registered_slot(loader, images)
    count, wrong = side_stream_copies(loader, epochs=1)
    assert count == 12 and wrong == []


def test_born_batches_are_born_pinned_and_exact_over_many_epochs() -> None:
    loader = DataLoader(
        Pictures(), batch_size=8, shuffle=True, num_workers=2, pin_memory="born", persistent_workers=True
    )
    for _ in range(6):  # slots are reused many times over
        for images, index in loader:
            assert images.is_pinned() and index.is_pinned()
            assert in_registered_slot(loader, images)
            moved = images.to("cuda", non_blocking=True)  # on the current stream: the rule
            del images  # the slot may be reused once its fence is done, not before
            assert torch.equal(moved.cpu(), expected(index))
    registry = loader._arena.registry
    assert registry is not None and len(registry) > 0
    del loader
    gc.collect()
    torch.cuda.synchronize()
    # the last batch's `index` still lies in its slot (a registered slot is leased whole):
    # that slot stays registered and mapped while the user holds it, and goes with it
    assert len(registry) == 1
    del index
    gc.collect()
    torch.cuda.synchronize()
    assert len(registry) == 0  # every slot unregistered once the loader and its batches went


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
