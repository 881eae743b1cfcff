"""`stoker.torch.to_device` without an accelerator: device="cpu", and a recording copier that
stands in for the CUDA one, so that order, depth, lifetimes and errors are checked here."""

from __future__ import annotations

import gc
import sys
import weakref
from collections import namedtuple
from dataclasses import dataclass
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from stoker._core.device import DeviceLoader  # noqa: E402
from stoker._core.torch_place import map_tensors  # noqa: E402
from stoker.torch import DataLoader, to_device  # noqa: E402

Pair = namedtuple("Pair", ["image", "label"])


class Host:
    """A host batch that can be watched for its collection (lists and tensors of a batch are
    what the double copies; this wraps one so its lifetime can be seen)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.tensor = torch.full((4,), float(index))


@dataclass
class Handle:
    index: int
    host: Any
    readied: bool = False
    complete: bool = False


class RecordingCopier:
    """A copier whose copies complete only when `release` waits for them, and which notes:
    how many copies were started and not yet handed over at each hand-over, whether any host
    batch was collected before its copy completed, and how many handles are unreleased."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.ahead_at_ready: list[int] = []
        self.unreleased: dict[int, Handle] = {}
        self.completed: set[int] = set()
        self.freed_early: list[int] = []
        self.freed: list[int] = []
        self.log: list[tuple[str, int]] = []

    def start(self, batch: Host) -> Handle:
        index = batch.index
        self.started.append(index)
        self.log.append(("start", index))
        weakref.finalize(batch, self._freed, index)
        handle = Handle(index, batch)
        self.unreleased[index] = handle
        return handle

    def _freed(self, index: int) -> None:
        self.freed.append(index)
        if index not in self.completed:
            self.freed_early.append(index)

    def ready(self, handle: Handle) -> Any:
        assert not handle.readied
        handle.readied = True
        self.log.append(("ready", handle.index))
        self.ahead_at_ready.append(sum(1 for h in self.unreleased.values() if not h.readied and h.index > handle.index))
        return ("device", handle.index, handle.host.tensor.clone())

    def release(self, handle: Handle) -> None:
        assert handle.index in self.unreleased, "released twice"
        handle.complete = True  # the wait: the copy has completed from here on
        self.completed.add(handle.index)
        self.log.append(("release", handle.index))
        del self.unreleased[handle.index]
        handle.host = None


def hosts(n: int, fail_at: int | None = None):
    for i in range(n):
        if i == fail_at:
            raise KeyError(f"sample of batch {i}")
        yield Host(i)


class Source:
    """An iterable of `n` host batches, made afresh on every `iter()`; batch `fail_at` raises."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n, self.fail_at = n, fail_at

    def __iter__(self):
        return hosts(self.n, self.fail_at)

    def __len__(self) -> int:
        return self.n


# ----------------------------------------------------------------------- device="cpu"
def test_cpu_batches_come_in_order_and_equal() -> None:
    batches = [torch.arange(6).reshape(2, 3) + i for i in range(7)]
    out = list(to_device(batches, "cpu"))
    assert len(out) == 7
    for got, want in zip(out, batches):
        assert torch.equal(got, want) and got.device.type == "cpu"


def test_cpu_nested_containers_are_kept() -> None:
    batch = {
        "pair": Pair(torch.ones(2), 3),
        "list": [torch.zeros(1), "text", b"raw", 1.5],
        "tuple": (torch.tensor([7]), None),
        "nested": {"deep": [{"t": torch.tensor(2.0)}]},
    }
    (got,) = list(to_device([batch], torch.device("cpu"), depth=1))
    assert isinstance(got["pair"], Pair) and torch.equal(got["pair"].image, torch.ones(2))
    assert got["pair"].label == 3
    assert got["list"][1:] == ["text", b"raw", 1.5] and isinstance(got["list"], list)
    assert isinstance(got["tuple"], tuple) and got["tuple"][1] is None
    assert torch.equal(got["nested"]["deep"][0]["t"], torch.tensor(2.0))


def test_map_tensors_rebuilds_containers_and_passes_others() -> None:
    seen: list[Any] = []
    batch = [torch.ones(1), ("a", torch.zeros(1)), {"k": torch.ones(2)}, object]
    out = map_tensors(batch, lambda t: seen.append(t) or t * 2)
    assert len(seen) == 3
    assert torch.equal(out[0], torch.full((1,), 2.0)) and out[1][0] == "a" and out[3] is object


def test_len_is_the_loaders_and_absent_without_one() -> None:
    assert len(to_device([torch.zeros(1)] * 5, "cpu")) == 5
    with pytest.raises(TypeError):
        len(to_device(iter([torch.zeros(1)]), "cpu"))


def test_every_iter_is_a_new_pass() -> None:
    loader = to_device([torch.tensor([i]) for i in range(4)], "cpu", depth=3)
    assert [int(t) for t in loader] == [0, 1, 2, 3]
    assert [int(t) for t in loader] == [0, 1, 2, 3]


# ------------------------------------------------------------------ arguments
@pytest.mark.parametrize("depth", [0, -1])
def test_depth_below_one_is_a_value_error(depth: int) -> None:
    with pytest.raises(ValueError, match=r"depth should be an int >= 1.*but got depth=" + str(depth)):
        to_device([], "cpu", depth=depth)


@pytest.mark.parametrize("depth", ["2", 2.0, True, None])
def test_depth_not_an_int_is_a_type_error(depth: Any) -> None:
    with pytest.raises(TypeError, match="depth should be an int >= 1"):
        to_device([], "cpu", depth=depth)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() > 7, reason="cuda:7 exists here")
def test_missing_cuda_device_is_named() -> None:
    with pytest.raises(ValueError, match=r"device 'cuda:7' does not exist") as info:
        to_device([], "cuda:7")
    if not torch.cuda.is_available():
        assert "CUDA is not available" in str(info.value) and "'cpu'" in str(info.value)
    with pytest.raises(ValueError, match=r"device 'cuda:7' does not exist"):
        to_device([], 7)


def test_bad_device_values() -> None:
    with pytest.raises(TypeError, match="device should be"):
        to_device([], 1.5)
    with pytest.raises(ValueError, match="not a device torch knows"):
        to_device([], "gpu:0")
    with pytest.raises(ValueError, match="not supported by to_device"):
        to_device([], "meta")


# ------------------------------------------------------- ordering and lifetimes (double)
def run(source: Any, depth: int, copier: RecordingCopier | None = None) -> tuple[list[int], RecordingCopier]:
    copier = copier or RecordingCopier()
    out = [index for _, index, _ in DeviceLoader(source, copier, depth)]
    gc.collect()
    return out, copier


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_order_and_at_most_depth_in_flight(depth: int) -> None:
    out, copier = run(Source(12), depth)
    assert out == list(range(12))
    assert copier.started == list(range(12))
    assert max(copier.ahead_at_ready) == depth
    # while the consumer holds batch i, the copies of i+1..i+depth are under way
    assert copier.ahead_at_ready == [min(depth, 11 - i) for i in range(12)]
    assert copier.unreleased == {}


def test_a_host_batch_lives_until_its_copy_completed() -> None:
    out, copier = run(Source(9), depth=3)
    assert out == list(range(9))
    assert copier.freed_early == []
    assert sorted(copier.freed) == list(range(9))
    # batch i is let go when the consumer asks for i+1, not before it was handed over
    log = copier.log
    for i in range(9):
        assert log.index(("ready", i)) < log.index(("release", i))
        if i + 1 < 9:
            assert log.index(("release", i)) < log.index(("ready", i + 1))


def test_the_consumer_gets_the_batch_before_the_next_host_batch_is_let_go() -> None:
    copier = RecordingCopier()
    it = iter(DeviceLoader(Source(4), copier, depth=1))
    next(it)
    assert copier.unreleased.keys() == {0, 1}  # 0 handed over, 1 in flight
    next(it)
    assert copier.unreleased.keys() == {1, 2}
    it.close()
    assert copier.unreleased == {}


@pytest.mark.parametrize("depth", [1, 3])
def test_a_loader_error_surfaces_at_its_batch(depth: int) -> None:
    copier = RecordingCopier()
    it = iter(DeviceLoader(Source(10, fail_at=4), copier, depth))
    got = [next(it)[1] for _ in range(4)]
    assert got == [0, 1, 2, 3]
    with pytest.raises(KeyError, match="sample of batch 4"):
        next(it)
    # the source (a generator) ended with its error; so does the pass
    with pytest.raises(StopIteration):
        next(it)
    gc.collect()
    assert copier.unreleased == {} and copier.freed_early == []


def test_the_loader_may_go_on_after_an_error() -> None:
    class Flaky:
        def __init__(self) -> None:
            self.i = 0

        def __iter__(self):
            return self

        def __next__(self) -> Host:
            self.i += 1
            if self.i == 3:
                raise RuntimeError("batch 2 failed")
            if self.i > 5:
                raise StopIteration
            return Host(self.i - 1)

    copier = RecordingCopier()
    it = iter(DeviceLoader(Flaky(), copier, 2))
    assert [next(it)[1], next(it)[1]] == [0, 1]
    with pytest.raises(RuntimeError, match="batch 2 failed"):
        next(it)
    assert [b[1] for b in it] == [3, 4]
    assert copier.unreleased == {}


def test_a_copy_error_surfaces_at_its_batch() -> None:
    class Failing(RecordingCopier):
        def start(self, batch: Host) -> Handle:
            if batch.index == 2:
                raise MemoryError("out of device memory at batch 2")
            return super().start(batch)

    copier = Failing()
    it = iter(DeviceLoader(Source(5), copier, 2))
    assert [next(it)[1], next(it)[1]] == [0, 1]
    with pytest.raises(MemoryError, match="batch 2"):
        next(it)
    assert [b[1] for b in it] == [3, 4]
    assert copier.unreleased == {}


@pytest.mark.parametrize("how", ["close", "drop", "break"])
def test_breaking_out_releases_every_handle(how: str) -> None:
    copier = RecordingCopier()
    loader = DeviceLoader(Source(20), copier, depth=4)
    if how == "break":
        for _, index, _ in loader:
            if index == 3:
                break
    else:
        it = iter(loader)
        for _ in range(4):
            next(it)
        assert len(copier.unreleased) == 5 and it.in_flight == 4
        if how == "close":
            it.close()
            it.close()  # idempotent
            with pytest.raises(StopIteration):
                next(it)
        del it
    gc.collect()
    assert copier.unreleased == {}
    assert copier.freed_early == []
    assert copier.started == list(range(8))  # nothing pulled beyond depth ahead


# ------------------------------------------------------- over a real DataLoader
class Squares:
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.full((3, 5), float(i * i)), "i": i, "name": f"s{i}"}


def test_over_a_stoker_loader_with_workers() -> None:
    loader = DataLoader(Squares(), batch_size=4, num_workers=2)
    want = list(loader)
    got = list(to_device(loader, "cpu", depth=2))
    assert len(got) == len(want) == 10
    for g, w in zip(got, want):
        assert torch.equal(g["x"], w["x"]) and torch.equal(g["i"], w["i"]) and g["name"] == w["name"]


# ------------------------------------------- the CUDA copier's calls, against fakes
class FakeCuda:
    """Stands in for `torch.cuda`: records what CudaCopier asks of streams and events."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.in_side_stream = False
        fake = self

        class Stream:
            def __init__(self, name: str) -> None:
                self.name = name

            def wait_event(self, event: Any) -> None:
                fake.log.append(("wait_event", self.name, event.id))

            def synchronize(self) -> None:
                fake.log.append(("stream_synchronize", self.name))

        class Event:
            count = 0

            def __init__(self) -> None:
                Event.count += 1
                self.id = Event.count

            def record(self, stream: Any) -> None:
                fake.log.append(("record", stream.name, self.id))

            def synchronize(self) -> None:
                fake.log.append(("event_synchronize", self.id))

        class Context:
            def __init__(self, on_enter: Any, on_exit: Any) -> None:
                self.on_enter, self.on_exit = on_enter, on_exit

            def __enter__(self) -> None:
                self.on_enter()

            def __exit__(self, *exc: Any) -> None:
                self.on_exit()

        self.Event = Event
        self.side = Stream("side")
        self.consumer = Stream("consumer")
        self.device = lambda device: Context(lambda: None, lambda: None)

        def enter() -> None:
            fake.in_side_stream = True

        def leave() -> None:
            fake.in_side_stream = False

        self.stream = lambda stream: Context(enter, leave)
        self.current_stream = lambda device=None: self.consumer


class Moving(torch.Tensor):
    """A CPU tensor whose `.to()` and `record_stream()` report to a FakeCuda."""

    cuda: FakeCuda

    def to(self, *args: Any, **kwargs: Any) -> Any:
        Moving.cuda.log.append(("to", kwargs.get("non_blocking"), Moving.cuda.in_side_stream))
        return self

    def record_stream(self, stream: Any) -> None:
        Moving.cuda.log.append(("record_stream", stream.name))


def test_cuda_copier_calls_in_order() -> None:
    from types import SimpleNamespace

    from stoker._core.torch_place import CudaCopier

    cuda = FakeCuda()
    Moving.cuda = cuda
    copier = CudaCopier.__new__(CudaCopier)
    copier._torch = SimpleNamespace(cuda=cuda)
    copier.device = "cuda:0"
    copier.stream = cuda.side
    batch = {"x": torch.ones(2).as_subclass(Moving), "y": [torch.zeros(1).as_subclass(Moving), "s"]}
    handle = copier.start(batch)
    assert cuda.log == [("to", True, True), ("to", True, True), ("record", "side", handle.event.id)]
    cuda.log.clear()
    moved = copier.ready(handle)
    assert moved["y"][1] == "s" and handle.moved is None and handle.host is batch
    assert cuda.log == [("wait_event", "consumer", handle.event.id)] + [("record_stream", "consumer")] * 2
    cuda.log.clear()
    copier.release(handle)
    assert cuda.log == [("event_synchronize", handle.event.id)] and handle.host is None


def test_cuda_copier_waits_for_queued_copies_when_a_copy_fails() -> None:
    from types import SimpleNamespace

    from stoker._core.torch_place import CudaCopier

    cuda = FakeCuda()
    Moving.cuda = cuda

    class Failing(Moving):
        def to(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("CUDA out of memory")

    copier = CudaCopier.__new__(CudaCopier)
    copier._torch = SimpleNamespace(cuda=cuda)
    copier.device = "cuda:0"
    copier.stream = cuda.side
    with pytest.raises(RuntimeError, match="out of memory"):
        copier.start([torch.ones(1).as_subclass(Moving), torch.ones(1).as_subclass(Failing)])
    assert cuda.log == [("to", True, True), ("stream_synchronize", "side")]


# ------------------------------------------------------------------- transform
def test_transform_runs_on_each_moved_batch_on_the_cpu() -> None:
    from stoker.torch import to_device

    seen: list[Any] = []

    def double(batch: Any) -> Any:
        seen.append(batch)
        return batch * 2

    batches = list(to_device([torch.arange(3), torch.arange(3, 6)], "cpu", transform=double))
    assert [b.tolist() for b in batches] == [[0, 2, 4], [6, 8, 10]] and len(seen) == 2


def test_transform_error_surfaces_at_its_batch_after_the_earlier_ones() -> None:
    from stoker.torch import to_device

    def picky(batch: Any) -> Any:
        if int(batch[0]) == 3:
            raise KeyError("no threes")
        return batch

    it = iter(
        to_device(
            [torch.tensor([1]), torch.tensor([2]), torch.tensor([3]), torch.tensor([4])],
            "cpu",
            depth=2,
            transform=picky,
        )
    )
    assert int(next(it)[0]) == 1 and int(next(it)[0]) == 2
    with pytest.raises(KeyError, match="no threes") as caught:
        next(it)
    if sys.version_info >= (3, 11):
        assert any("to_device's transform" in note and "picky" in note for note in caught.value.__notes__)
    assert int(next(it)[0]) == 4  # the loader goes on, as after a loader error


def test_transform_not_callable_is_a_type_error() -> None:
    from stoker.torch import to_device

    with pytest.raises(TypeError, match="transform"):
        to_device([], "cpu", transform=3)  # type: ignore[arg-type]


def test_normalize_converts_uint8_per_channel_and_leaves_the_rest() -> None:
    from stoker.torch import normalize, to_device

    images = torch.randint(0, 256, (4, 3, 5, 5), dtype=torch.uint8)
    labels = torch.arange(4)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    (out,) = list(to_device([{"image": images, "label": labels}], "cpu", transform=normalize(mean, std)))
    want = (images.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    assert out["image"].dtype == torch.float32 and torch.allclose(out["image"], want, atol=1e-6)
    assert torch.equal(out["label"], labels)
    pair = normalize(mean, std, key=0)((images, images))
    assert pair[0].dtype == torch.float32 and pair[1].dtype == torch.uint8
    with pytest.raises(ValueError, match="3 channels"):
        normalize(mean, std)(torch.zeros(2, 4, 2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="std"):
        normalize(mean, (1.0, 0.0, 1.0))
    with pytest.raises(ValueError, match="one value per channel"):
        normalize(mean, (1.0,))


def test_cuda_copier_runs_the_transform_on_the_side_stream_before_the_event() -> None:
    from types import SimpleNamespace

    from stoker._core.torch_place import CudaCopier

    cuda = FakeCuda()
    Moving.cuda = cuda

    def transform(batch: Any) -> Any:
        cuda.log.append(("transform", cuda.in_side_stream))
        return {"x": batch["x"], "extra": torch.zeros(1).as_subclass(Moving)}

    copier = CudaCopier.__new__(CudaCopier)
    copier._torch = SimpleNamespace(cuda=cuda)
    copier.device = "cuda:0"
    copier.stream = cuda.side
    copier.transform = transform
    handle = copier.start({"x": torch.ones(2).as_subclass(Moving)})
    assert cuda.log == [("to", True, True), ("transform", True), ("record", "side", handle.event.id)]
    cuda.log.clear()
    moved = copier.ready(handle)
    assert set(moved) == {"x", "extra"}
    # the transform's output tensors are the ones marked as used by the consumer's stream
    assert cuda.log == [("wait_event", "consumer", handle.event.id)] + [("record_stream", "consumer")] * 2
