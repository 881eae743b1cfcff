"""`to_device(loader, "cpu", transform=normalize(...))` writes each batch's floats into an output
pool of the pass and reuses a buffer once nothing but the pool references it: the values are
`normalize`'s, a batch (or a view of one) the consumer keeps is never written again, the pool
keeps at most depth + 2 buffers per output, and nothing once the pass is closed, broken out of,
or has delivered an exception. Real torch and a real stoker loader with 2 process workers."""

from __future__ import annotations

import gc
import pickle
import resource
import weakref
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from stoker._core.torch_place import OutputPool, takes_allocate  # noqa: E402
from stoker.torch import DataLoader, normalize, to_device  # noqa: E402

pytestmark = pytest.mark.timeout(90)

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
DEPTH = 2
BOUND = DEPTH + 2  # buffers per output of a batch the pool keeps at most
SIDE = 32
BATCH = 4


class Images:
    """`n` samples ({"image": uint8 (3, side, side), "label": i}), each image a function of i;
    sample `fail_at` raises."""

    def __init__(self, n: int, side: int = SIDE, fail_at: int | None = None) -> None:
        self.n, self.side, self.fail_at = n, side, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == self.fail_at:
            raise KeyError(f"sample {i} is missing")
        image = np.random.default_rng(i).integers(0, 256, (3, self.side, self.side), dtype=np.uint8)
        return {"image": image, "label": i}


def image_of(i: int, side: int = SIDE) -> Any:
    return torch.from_numpy(Images(i + 1, side)[i]["image"])


def uint8_batch(index: int, side: int = SIDE, batch: int = BATCH) -> Any:
    return torch.stack([image_of(i, side) for i in range(index * batch, (index + 1) * batch)])


def torchs(index: int) -> Any:
    """torch's (x / 255 - mean) / std for batch `index`, float32."""
    x = uint8_batch(index)
    return (x.float() / 255 - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)


def want_batch(index: int) -> Any:
    """Batch `index` as `normalize(MEAN, STD)` called alone makes it (bitwise)."""
    return normalize(MEAN, STD)(uint8_batch(index))


def loader(n_batches: int, **kwargs: Any) -> Any:
    side = kwargs.pop("side", SIDE)
    batch = kwargs.pop("batch", BATCH)
    fail_at = kwargs.pop("fail_at", None)
    return DataLoader(Images(n_batches * batch, side, fail_at), batch_size=batch, num_workers=2, **kwargs)


def pool_of(iterator: Any) -> OutputPool:
    pool = iterator._pipeline.copier.pool
    assert isinstance(pool, OutputPool)
    return pool


def watch(pool: OutputPool, refs: dict[int, weakref.ref]) -> None:
    """Note a weak reference to every buffer the pool tracks now."""
    for buffer in pool._buffers:
        refs.setdefault(id(buffer), weakref.ref(buffer))


def alive(refs: dict[int, weakref.ref]) -> int:
    gc.collect()
    return sum(ref() is not None for ref in refs.values())


# --------------------------------------------------------------------------- values
@pytest.mark.parametrize("dtype", [None, torch.float16, torch.bfloat16])
def test_values_are_torchs_and_those_of_normalize_called_alone(dtype: Any) -> None:
    norm = normalize(MEAN, STD, dtype=dtype)
    target = torch.float32 if dtype is None else dtype
    seen = 0
    for index, batch in enumerate(to_device(loader(8), "cpu", depth=DEPTH, transform=norm)):
        image = batch["image"]
        assert image.dtype == target and image.shape == (BATCH, 3, SIDE, SIDE) and image.is_contiguous()
        alone = norm({"image": uint8_batch(index)})
        assert torch.equal(image, alone["image"])  # bitwise: the same operations in the same order
        tolerance = 1e-6 if dtype is None else 2e-2
        assert torch.allclose(image.float(), torchs(index), atol=tolerance, rtol=tolerance)
        assert batch["label"].tolist() == list(range(index * BATCH, (index + 1) * BATCH))
        seen += 1
    assert seen == 8


def test_key_selects_the_item_and_the_pool_serves_it() -> None:
    norm = normalize(MEAN, STD, key="image")
    ptrs: set[int] = set()
    for index, batch in enumerate(to_device(loader(12), "cpu", depth=DEPTH, transform=norm)):
        assert torch.equal(batch["image"], want_batch(index))
        assert torch.allclose(batch["image"], torchs(index), atol=1e-6)
        ptrs.add(batch["image"].data_ptr())
        del batch
    assert len(ptrs) <= BOUND


# ------------------------------------------------------------------ kept batches
def test_a_batch_kept_across_ten_later_batches_is_unchanged() -> None:
    kept = None
    iterator = iter(to_device(loader(12), "cpu", depth=DEPTH, transform=normalize(MEAN, STD)))
    for index, batch in enumerate(iterator):
        if index == 1:
            kept, copy = batch["image"], batch["image"].clone()
        del batch
    assert kept is not None and torch.equal(kept, copy) and torch.equal(kept, want_batch(1))


def test_views_kept_are_unchanged_and_keep_their_buffer_from_reuse() -> None:
    views: dict[str, Any] = {}
    copies: dict[str, Any] = {}
    ptrs: list[int] = []
    for index, batch in enumerate(to_device(loader(16), "cpu", depth=DEPTH, transform=normalize(MEAN, STD))):
        image = batch["image"]
        ptrs.append(image.data_ptr())
        if index == 1:
            views["row"] = image[0]
        elif index == 2:
            views["numpy"] = image.numpy()
        elif index == 3:
            views["channel"] = image[:, 0]
        elif index == 4:
            views["memoryview"] = memoryview(image.numpy()[1:])
        elif index == 5:
            views["shared"] = image.share_memory_()  # moved to new memory: the buffer is free again
        for name, view in views.items():
            copies.setdefault(name, torch.tensor(np.array(view)) if not torch.is_tensor(view) else view.clone())
        del batch, image
    for name, view in views.items():
        now = view.clone() if torch.is_tensor(view) else torch.tensor(np.array(view))
        assert torch.equal(now, copies[name]), name
    assert torch.equal(views["row"], want_batch(1)[0])
    assert torch.equal(torch.from_numpy(views["numpy"]), want_batch(2))
    assert torch.equal(views["channel"], want_batch(3)[:, 0])
    assert torch.equal(views["shared"], want_batch(5))
    # a buffer behind a kept view is never handed out again, however many batches follow
    for index in (1, 2, 3, 4):
        assert ptrs[index] not in ptrs[index + 1 :], index


def test_batches_appended_to_a_list_are_all_unchanged_and_the_pool_stays_bounded() -> None:
    kept: list[Any] = []
    iterator = iter(to_device(loader(12), "cpu", depth=DEPTH, transform=normalize(MEAN, STD)))
    for batch in iterator:
        kept.append(batch["image"])
        assert pool_of(iterator).buffers <= BOUND
        del batch
    assert len({image.data_ptr() for image in kept}) == 12  # every one its own memory
    for index, image in enumerate(kept):
        assert torch.equal(image, want_batch(index)), index


def test_pickled_and_unpickled_batches_are_copies() -> None:
    pickled = None
    for index, batch in enumerate(to_device(loader(10), "cpu", depth=DEPTH, transform=normalize(MEAN, STD))):
        if index == 0:
            pickled = pickle.dumps(batch["image"])
        del batch
    assert pickled is not None and torch.equal(pickle.loads(pickled), want_batch(0))


# -------------------------------------------------------------------------- reuse
def test_buffers_are_reused_when_the_consumer_drops_each_batch() -> None:
    """At most depth + 2 distinct buffers over 20 batches, and the main process faults in
    fewer pages over 10 steady batches than one batch's floats occupy (9.6 MB each here:
    without reuse each batch's floats are fresh memory, faulted in again every batch)."""
    batch, side = 16, 224
    ptrs: set[int] = set()
    faults = 0
    iterator = iter(to_device(loader(20, batch=batch, side=side), "cpu", depth=DEPTH, transform=normalize(MEAN, STD)))
    for index, out in enumerate(iterator):
        if index == 5:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        if index == 15:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        ptrs.add(out["image"].data_ptr())
        assert pool_of(iterator).buffers <= BOUND
        del out
    assert len(ptrs) <= BOUND
    pages = batch * 3 * side * side * 4 // resource.getpagesize()
    assert faults < pages, f"{faults} page faults over 10 batches, {pages} pages in one batch's floats"


def test_two_outputs_per_batch_get_depth_plus_two_buffers_each() -> None:
    def pairs(batch: Any) -> Any:
        return {"a": batch["image"], "b": batch["image"].flip(0).contiguous(), "label": batch["label"]}

    norm = normalize(MEAN, STD)

    def both(batch: Any, *, allocate: Any = None) -> Any:
        return norm(pairs(batch), allocate=allocate)

    ptrs: set[int] = set()
    for index, out in enumerate(to_device(loader(12), "cpu", depth=DEPTH, transform=both)):
        assert torch.equal(out["a"], want_batch(index)) and torch.equal(out["b"], want_batch(index).flip(0))
        ptrs.update((out["a"].data_ptr(), out["b"].data_ptr()))
        del out
    assert len(ptrs) <= 2 * BOUND


def test_a_transform_without_allocate_is_called_with_the_batch_alone() -> None:
    calls: list[tuple[Any, ...]] = []

    def plain(batch: Any) -> Any:
        calls.append(batch)
        return batch

    def pooled(batch: Any, *, allocate: Any) -> Any:
        out = allocate((2, 3), torch.float64)
        assert out.shape == (2, 3) and out.dtype == torch.float64 and out.is_contiguous()
        return out.fill_(float(batch[0]))

    assert not takes_allocate(plain) and not takes_allocate(lambda b, allocate=None: b) and takes_allocate(pooled)
    assert [int(b[0]) for b in to_device([torch.tensor([i]) for i in range(3)], "cpu", transform=plain)] == [0, 1, 2]
    assert len(calls) == 3
    outs = [float(b[0, 0]) for b in to_device([torch.tensor([i]) for i in range(6)], "cpu", transform=pooled)]
    assert outs == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_normalize_alone_makes_new_tensors_as_before() -> None:
    norm = normalize(MEAN, STD)
    x = torch.randint(0, 256, (2, 3, 4, 5), dtype=torch.uint8)
    pool = OutputPool(DEPTH)
    pooled, fresh = norm(x, allocate=pool), norm(x)
    assert torch.equal(pooled, fresh) and pooled.stride() == fresh.stride() and pool.buffers == 1
    # not C-contiguous: converted as .to() does (its strides kept), never through the pool
    last = x.contiguous(memory_format=torch.channels_last)
    out = norm(last, allocate=pool)
    assert out.stride() == norm(last).stride() and out.stride() != pooled.stride() and pool.buffers == 1
    assert torch.equal(out, fresh)
    # an output dtype of uint8: the input is never written, pool or not
    same = normalize((0.0, 0.0, 0.0), (1.0, 1.0, 1.0), scale=1.0, dtype=torch.uint8)
    keep = x.clone()
    assert torch.equal(same(x, allocate=pool), keep) and torch.equal(x, keep) and pool.buffers == 1


def test_allocate_serves_any_dtype_reuses_only_free_memory_and_checks_its_arguments() -> None:
    pool = OutputPool(depth=1)  # at most 3 buffers per output
    first = pool((2, 3), torch.bfloat16)
    assert first.shape == (2, 3) and first.dtype == torch.bfloat16 and first.is_contiguous()
    ptr = first.data_ptr()
    row = first[1]
    del first
    assert pool((2, 3), torch.bfloat16).data_ptr() != ptr  # a view still holds it
    del row
    again = pool((3, 2), torch.float16)  # the same bytes, free now: reused
    assert again.data_ptr() == ptr and pool.buffers == 2
    assert pool((0, 3), torch.float32).shape == (0, 3) and pool.buffers == 2  # nothing to reuse
    pool = OutputPool(depth=1)
    kept = []
    for _ in range(5):  # five batches of one output each, all kept: past the bound the oldest is forgotten
        pool.begin_batch()
        kept.append(pool((4,), torch.float64))
    assert pool.buffers == 3 and len({t.data_ptr() for t in kept}) == 5
    with pytest.raises(TypeError, match=r"dtype should be a torch\.dtype"):
        pool((2,), "float32")
    with pytest.raises(ValueError, match="shape should be sizes >= 0"):
        pool((-1, 2), torch.float32)
    pool.drop()
    assert pool.buffers == 0 and [float(t.fill_(1).sum()) for t in kept] == [4.0] * 5


# --------------------------------------------------------------- nothing held after
def test_the_pool_is_freed_on_close() -> None:
    refs: dict[int, weakref.ref] = {}
    iterator = iter(to_device(loader(12), "cpu", depth=DEPTH, transform=normalize(MEAN, STD)))
    for _ in range(6):
        batch = next(iterator)
        watch(pool_of(iterator), refs)
    pool = pool_of(iterator)
    iterator.close()
    assert pool.buffers == 0
    assert alive(refs) == 1  # the batch still bound here, and only it
    assert torch.equal(batch["image"], want_batch(5))
    del batch
    assert alive(refs) == 0


def test_the_pool_is_freed_after_break_out_of_a_loop() -> None:
    refs: dict[int, weakref.ref] = {}
    passes = to_device(loader(12), "cpu", depth=DEPTH, transform=normalize(MEAN, STD))
    iterator = iter(passes)
    for index, batch in enumerate(iterator):  # noqa: B007  (the batch broken out at is checked below)
        watch(pool_of(iterator), refs)
        if index == 5:
            break
    assert len(refs) >= BOUND
    del iterator  # the loop's own reference went with the break: dropping ours closes the pass
    assert alive(refs) == 1 and torch.equal(batch["image"], want_batch(5))
    del batch
    assert alive(refs) == 0


def test_the_pool_is_freed_at_the_end_of_the_epoch() -> None:
    refs: dict[int, weakref.ref] = {}
    iterator = iter(to_device(loader(8), "cpu", depth=DEPTH, transform=normalize(MEAN, STD)))
    for batch in iterator:
        watch(pool_of(iterator), refs)
        del batch
    assert pool_of(iterator).buffers == 0 and alive(refs) == 0


def test_an_exception_in_the_loader_mid_epoch_leaves_nothing_held() -> None:
    refs: dict[int, weakref.ref] = {}
    iterator = iter(to_device(loader(12, fail_at=6 * BATCH + 1), "cpu", depth=DEPTH, transform=normalize(MEAN, STD)))
    for index in range(6):
        batch = next(iterator)
        assert torch.equal(batch["image"], want_batch(index))
        watch(pool_of(iterator), refs)
        del batch
    with pytest.raises(KeyError, match="sample 25 is missing") as caught:
        next(iterator)
    # the error (kept here, with its traceback through the pipeline's frames) holds no buffer
    assert pool_of(iterator).buffers == 0 and alive(refs) == 0 and caught.value is not None
    # the loader goes on after its error, as without the pool, and fills a new one
    batch = next(iterator)
    assert torch.equal(batch["image"], want_batch(7))
    watch(pool_of(iterator), refs)
    del batch
    iterator.close()
    assert alive(refs) == 0
