"""The pinned arena's bookkeeping, with a registrar double standing in for CUDA: plain
`pin_memory=True` registers nothing and pins every batch by copying (torch's pinned memory
tracks the streams that read it; a registered slot cannot); with `pin_memory="born"`, or in
an epoch stoker's `to_device` consumes, only the main process registers; each mapping is
registered once, and unregistered while still mapped — when a slot is retired, at close,
after a killed worker; a released slot goes to a worker only once its fence is done; a
registration that fails falls back to the pin thread with one warning; batches born in
registered slots skip the pin step and arrive exact, and once the arena is registered a
plain epoch's batches are copied out of it."""

from __future__ import annotations

import gc
import os
import signal
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import stoker.torch as st  # noqa: E402
from stoker._core import hostpin, iterator  # noqa: E402
from stoker._core.arena import SlotPool  # noqa: E402
from stoker._core.device import DeviceLoader  # noqa: E402

ROWS = 4096  # float32: 16 KiB a sample


def mapped(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            low, high = (int(part, 16) for part in line.split()[0].split("-"))
            if low <= address < high:
                return True
    return False


class Fence:
    def __init__(self, done: bool = True) -> None:
        self.is_done = done
        self.waited = False

    def done(self) -> bool:
        return self.is_done

    def wait(self) -> None:
        self.waited = True
        self.is_done = True


class Registrar:
    """Records every call with the calling pid; checks what CUDA would require."""

    def __init__(self, fail_after: int | None = None, fences_done: bool = True) -> None:
        self.main = os.getpid()
        self.log: list[tuple[int, str, int]] = []
        self.registered: set[int] = set()
        self.fail_after = fail_after
        self.fences = 0
        self.fences_done = fences_done  # False: a fence is done only once waited on
        self.waited: list[Fence] = []
        self.copies = 0
        self.lock = threading.Lock()

    def register(self, address: int, size: int) -> None:
        with self.lock:
            if self.fail_after is not None and len(self.log) >= self.fail_after:
                raise RuntimeError("cudaErrorMemoryAllocation (locked-memory limit)")
            assert address not in self.registered, "registered twice"
            assert mapped(address), "registered before it was mapped"
            self.registered.add(address)
            self.log.append((os.getpid(), "register", address))

    def unregister(self, address: int) -> None:
        with self.lock:
            assert address in self.registered, "unregistered but never registered"
            assert mapped(address), "unmapped before it was unregistered"
            self.registered.discard(address)
            self.log.append((os.getpid(), "unregister", address))

    def fence(self) -> Fence:
        self.fences += 1
        registrar = self

        class Recorded(Fence):
            def wait(self) -> None:
                super().wait()
                registrar.waited.append(self)

        return Recorded(self.fences_done)

    def pinned_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.copies += 1
        return tensor.clone()  # torch's pinned memory needs CUDA; a fresh block stands in


@pytest.fixture
def registrar(monkeypatch: pytest.MonkeyPatch) -> Registrar:
    """Pinning as if CUDA were here: the double registers, and the pin step is counted."""
    double = Registrar()
    monkeypatch.setattr(hostpin, "cuda_registrar", lambda: double)
    return double


@pytest.fixture
def pin_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []

    def pin(batch: Any) -> Any:
        calls.append(1)
        return batch

    monkeypatch.setattr(iterator, "pin_function", lambda device, stacklevel: pin)
    return calls


class Rows(st.Dataset):
    def __init__(self, n: int = 96, grow_at: int | None = None) -> None:
        self.n, self.grow_at = n, grow_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        rows = ROWS * (4 if self.grow_at is not None and i >= self.grow_at else 1)
        return torch.full((rows,), float(i)), i


def check_batches(loader: Any, n: int) -> None:
    seen = []
    for x, i in loader:
        assert torch.equal(x[:, 0], i.float()) and torch.equal(x[:, -1], i.float())
        seen += i.tolist()
    assert sorted(seen) == list(range(n))


def in_registered_slot(loader: Any, tensor: torch.Tensor) -> bool:
    registry = loader._arena.registry
    return registry is not None and registry.holds(tensor.data_ptr())


# ------------------------------------------------------------- who gets born-pinned slots
def test_plain_pin_memory_registers_nothing_and_pins_every_batch_by_copying(
    registrar: Registrar, pin_calls: list[int]
) -> None:
    loader = st.DataLoader(Rows(), batch_size=8, num_workers=2, pin_memory=True)
    for _ in range(2):
        check_batches(loader, 96)
    assert registrar.log == [] and registrar.fences == 0  # no slot is pinned memory torch does not own
    assert len(pin_calls) == 2 * 12  # the pin thread copied every batch into torch's pinned memory


def test_pin_memory_is_validated_naming_the_accepted_values() -> None:
    with pytest.raises(ValueError, match=r"pin_memory should be True, False or 'born'.*got pin_memory='yes'"):
        st.DataLoader(Rows(), pin_memory="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"pin_memory should be True, False or 'born', but got pin_memory=None"):
        st.DataLoader(Rows(), pin_memory=None)  # type: ignore[arg-type]
    assert st.DataLoader(Rows(), pin_memory="born").pin_memory == "born"
    assert st.DataLoader(Rows(), pin_memory=np.True_).pin_memory is True  # type: ignore[arg-type]


class Moved:
    """A copier double as to_device's CudaCopier is: the consumer gets copies of the tensors,
    and each host batch is kept until `release` (the copy's completion)."""

    keeps_host_until_copied = True

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.in_slot = 0  # host batches that came born pinned in the arena

    def start(self, batch: Any) -> Any:
        x, i = batch
        self.in_slot += in_registered_slot(self.loader, x)
        return [batch, (x.clone(), i.clone())]

    def ready(self, handle: Any) -> Any:
        return handle[1]

    def release(self, handle: Any) -> None:
        handle[0] = None


def test_to_device_gets_born_pinned_batches_and_a_later_plain_epoch_copies_them_out(
    monkeypatch: pytest.MonkeyPatch, pin_calls: list[int]
) -> None:
    double = Registrar(fences_done=False)
    monkeypatch.setattr(hostpin, "cuda_registrar", lambda: double)
    loader = st.DataLoader(Rows(), batch_size=8, num_workers=2, pin_memory=True, persistent_workers=True)
    copier = Moved(loader)
    check_batches(DeviceLoader(loader, copier, depth=2), 96)
    assert copier.in_slot == 12 and not pin_calls  # every batch born pinned: no pin step
    assert double.registered and double.waited  # released slots were reused after their fence only
    seen = []
    for x, i in loader:  # a plain epoch of the same loader: nothing handed out lies in a slot
        assert not in_registered_slot(loader, x) and not in_registered_slot(loader, i)
        assert torch.equal(x[:, 0], i.float())
        seen += i.tolist()
    assert sorted(seen) == list(range(96)) and len(pin_calls) == 12 and double.copies >= 24
    del loader, copier
    gc.collect()
    assert double.registered == set()


def test_main_process_registers_each_slot_once_and_unregisters_it_at_close(
    registrar: Registrar, pin_calls: list[int]
) -> None:
    loader = st.DataLoader(Rows(), batch_size=8, num_workers=2, pin_memory="born")
    for _ in range(3):
        check_batches(loader, 96)
    registered = [entry for entry in registrar.log if entry[1] == "register"]
    assert registered and {pid for pid, _, _ in registrar.log} == {registrar.main}
    assert not pin_calls  # every batch was born pinned: no pin step
    assert registrar.fences > 0  # released slots were fenced before reuse
    del loader
    gc.collect()
    assert registrar.registered == set()  # unregistered (while mapped) when the arena went
    assert len([e for e in registrar.log if e[1] == "unregister"]) == len(registered)


def test_a_retired_slot_is_unregistered_before_it_is_unmapped(registrar: Registrar, pin_calls: list[int]) -> None:
    loader = st.DataLoader(Rows(48, grow_at=24), batch_size=8, num_workers=1, pin_memory="born")
    check_batches(loader, 48)  # batches of the second half outgrow their slots: retired
    gc.collect()
    unregistered = [e for e in registrar.log if e[1] == "unregister"]
    assert unregistered, "the outgrown slots were not unregistered"
    assert registrar.registered  # the loader's current slots stay registered
    del loader
    gc.collect()
    assert registrar.registered == set()


class KillsOnce(Rows):
    def __init__(self, marker: Path) -> None:
        super().__init__(64)
        self.marker = marker

    def __getitem__(self, i: int) -> Any:
        if i == 20 and not self.marker.exists():
            self.marker.write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


def test_registrations_stay_consistent_after_a_killed_worker(
    registrar: Registrar, pin_calls: list[int], tmp_path: Path
) -> None:
    loader = st.DataLoader(
        KillsOnce(tmp_path / "killed"), batch_size=4, num_workers=2, pin_memory="born", max_worker_restarts=1
    )
    with pytest.warns(st.WorkerRestartWarning):
        check_batches(loader, 64)
    check_batches(loader, 64)
    assert (tmp_path / "killed").exists()
    assert {pid for pid, _, _ in registrar.log} == {registrar.main}
    del loader
    gc.collect()
    assert registrar.registered == set()


def test_a_failed_registration_falls_back_to_the_pin_thread_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, pin_calls: list[int]
) -> None:
    double = Registrar(fail_after=1)
    monkeypatch.setattr(hostpin, "cuda_registrar", lambda: double)
    loader = st.DataLoader(Rows(), batch_size=8, num_workers=2, pin_memory="born")
    with pytest.warns(RuntimeWarning, match="could not pin its shared-memory arena in place") as caught:
        check_batches(loader, 96)
        check_batches(loader, 96)
    # only the warning this test owns: others (Python 3.12's DeprecationWarning at a fork of a
    # process with threads, CUDA's) may be recorded beside it
    ours = [w for w in caught if issubclass(w.category, RuntimeWarning) and "could not pin" in str(w.message)]
    assert len(ours) == 1
    assert "locked-memory limit" in str(ours[0].message)
    assert pin_calls  # batches in unregistered slots were pinned by the pin step
    assert len(double.registered) == 1
    del loader
    gc.collect()
    assert double.registered == set()


@pytest.mark.parametrize("pin_memory", [True, "born"])
def test_without_cuda_nothing_is_registered(pin_calls: list[int], pin_memory: Any) -> None:
    if torch.cuda.is_available():
        pytest.skip("a machine without CUDA")
    assert hostpin.cuda_registrar() is None
    loader = st.DataLoader(Rows(32), batch_size=8, num_workers=2, pin_memory=pin_memory)
    check_batches(loader, 32)
    assert len(pin_calls) == 4  # the pin thread pins every batch, as before


# ------------------------------------------------------------------ the reuse guard
def test_a_fenced_slot_waits_for_its_fence_before_reuse() -> None:
    pool = SlotPool()
    fences: list[Fence] = []

    def fence() -> Fence:
        fences.append(Fence(done=False))
        return fences[-1]

    pool.fence = fence
    for slot_id in (1, 2):
        pool.maps[slot_id], pool.sizes[slot_id], pool.fds[slot_id] = bytearray(8), 8, -1
    pool.released.extend([1, 2])
    fences_before = len(fences)
    # both released slots are fenced; slot 2's copy completes first
    assert pool.take_free(set()) == 1 and fences[0].waited  # none done: waits for the oldest
    assert len(fences) == fences_before + 2
    pool.released.append(1)
    fences[1].is_done = True  # slot 2's fence
    assert pool.take_free(set()) == 2 and not fences[2].waited  # a done slot before a pending one
    assert pool.take_free(set()) == 1 and fences[2].waited
    assert pool.take_free(set()) is None


def test_born_pinned_sees_tensors_outside_registered_slots() -> None:
    registry = hostpin.Registry(Registrar())
    inside = np.zeros(1024, dtype=np.uint8)
    registry._starts, registry._ends = [inside.ctypes.data], {inside.ctypes.data: inside.ctypes.data + 1024}
    slot_tensor = torch.from_numpy(inside[64:128])
    assert registry.born_pinned({"x": slot_tensor, "names": ["a"], "n": 3})
    assert not registry.born_pinned({"x": slot_tensor, "y": [torch.zeros(3)]})
    assert registry.born_pinned([torch.zeros(0), slot_tensor])  # an empty tensor has nothing to copy


def test_copied_replaces_what_lies_in_a_registered_slot_and_strict_sees_numpy() -> None:
    double = Registrar()
    registry = hostpin.Registry(double)
    inside = np.arange(1024, dtype=np.uint8)
    registry._starts, registry._ends = [inside.ctypes.data], {inside.ctypes.data: inside.ctypes.data + 1024}
    slot_tensor, slot_array, outside = torch.from_numpy(inside[64:128]), inside[:8], torch.zeros(3)
    batch = {"x": slot_tensor, "a": [slot_array, "name"], "o": outside}
    assert registry.born_pinned(batch) is False  # `outside` is not in a slot
    assert registry.born_pinned({"x": slot_tensor, "a": [slot_array]})
    assert not registry.born_pinned({"x": slot_tensor, "a": [slot_array]}, strict=True)
    copied = registry.copied(batch)
    assert not registry.holds(copied["x"].data_ptr()) and torch.equal(copied["x"], slot_tensor)
    assert not registry.holds(copied["a"][0].ctypes.data) and np.array_equal(copied["a"][0], slot_array)
    assert copied["a"][1] == "name" and copied["o"] is outside  # the rest is left as it is
    assert double.copies == 1  # tensors through the registrar: torch's pinned memory
