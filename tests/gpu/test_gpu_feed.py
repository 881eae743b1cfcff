"""`to_device` on a CUDA device: values after several epochs, the consumer's stream waiting for
the copy, and an early break. Skipped where torch finds no CUDA GPU."""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)

from stoker.torch import DataLoader, to_device  # noqa: E402


class Pictures:
    """64 samples of 3x64x64 uint8, sample i filled from i, and a dict label."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, dict[str, int]]:
        image = (torch.arange(3 * 64 * 64, dtype=torch.int64).reshape(3, 64, 64) + i) % 251
        return image.to(torch.uint8), {"label": i}


@pytest.mark.parametrize("pin_memory", [False, True])
def test_values_after_several_epochs(pin_memory: bool) -> None:
    loader = DataLoader(Pictures(), batch_size=8, num_workers=2, pin_memory=pin_memory, persistent_workers=True)
    fed = to_device(loader, "cuda", depth=2)
    for _ in range(3):
        want = list(loader)
        got = list(fed)
        assert len(got) == len(want) == 8
        for (image, label), (host_image, host_label) in zip(got, want):
            assert image.is_cuda and label["label"].is_cuda
            assert torch.equal(image.cpu(), host_image)
            assert torch.equal(label["label"].cpu(), host_label["label"])


def test_the_consumer_stream_waits_for_the_copy() -> None:
    # A heavy op queued on the current stream just before each hand-over: without the wait on
    # the batch's event the sum could read memory the side stream has not written yet.
    big = torch.randn(4096, 4096, device="cuda")
    batches = [torch.full((1 << 20,), float(i)).pin_memory() for i in range(12)]
    for i, batch in enumerate(to_device(batches, torch.device("cuda"), depth=3)):
        for _ in range(4):
            big = big @ big
            big = big / big.norm()
        assert float(batch.sum()) == float(i) * (1 << 20)
        assert torch.equal(batch.cpu(), batches[i])


def test_early_break_raises_nothing() -> None:
    loader = DataLoader(Pictures(), batch_size=4, num_workers=2, pin_memory=True)
    for i, (image, _) in enumerate(to_device(loader, 0, depth=4)):
        image.float().mean()
        if i == 2:
            break
    gc.collect()
    torch.cuda.synchronize()
