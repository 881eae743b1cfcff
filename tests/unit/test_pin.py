"""The pin_memory thread and the pin step, on real threads with a stand-in for pinning
(these machines have no accelerator, and a CPU tensor cannot be pinned without one)."""

from __future__ import annotations

import collections
import contextlib
import gc
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import pytest

import stoker._core.pin as pin_module
from stoker._core.pin import PIN_THREAD_NOTE, PinThread, device_setup, pin_batch, pin_function

SETTLE_S = 5.0  # generous bound for a thread that has been told to stop


@pytest.fixture
def threads():
    """Makes PinThreads and closes every one of them after the test."""
    made: list[PinThread] = []

    def make(pin, **kwargs) -> PinThread:
        made.append(PinThread(pin, **kwargs))
        return made[-1]

    yield make
    for pin_thread in made:
        pin_thread.close()


def wait_gone(thread: threading.Thread) -> None:
    thread.join(SETTLE_S)
    assert not thread.is_alive()
    assert thread not in threading.enumerate()


class Pinned(NamedTuple):
    """What the stand-in pin step makes of a batch."""

    batch: object


class Recorder:
    """A pin step that records what it pinned, on which thread; can be held at an event."""

    def __init__(self, hold: threading.Event | None = None) -> None:
        self.hold = hold
        self.seen: list[object] = []
        self.idents: list[int] = []
        self.started = threading.Event()

    def __call__(self, batch: object) -> Pinned:
        self.started.set()
        if self.hold is not None:
            assert self.hold.wait(SETTLE_S), "test never released the pin step"
        self.seen.append(batch)
        self.idents.append(threading.get_ident())
        return Pinned(batch)


# ------------------------------------------------------------------------- PinThread
def test_pins_in_submit_order_and_takes_in_order(threads):
    pin = Recorder()
    pt = threads(pin)
    for key in range(200):
        pt.submit(key, f"batch {key}")
    assert [pt.take(key, timeout=SETTLE_S) for key in range(200)] == [Pinned(f"batch {key}") for key in range(200)]
    assert pin.seen == [f"batch {key}" for key in range(200)]
    assert pt.pending == 0


def test_takes_out_of_order_pinning_stays_fifo(threads):
    import random

    pin = Recorder()
    pt = threads(pin)
    keys = list(range(100, 160))  # keys need not start at 0 or be small
    for key in keys:
        pt.submit(key, key * 10)
    order = keys[:]
    random.Random(0).shuffle(order)
    for key in order:
        assert pt.take(key, timeout=SETTLE_S) == Pinned(key * 10)
    assert pin.seen == [key * 10 for key in keys]
    assert pt.pending == 0


def test_pin_step_runs_on_the_pin_thread(threads):
    pin = Recorder()
    pt = threads(pin, name="pin-under-test")
    for key in range(5):
        pt.submit(key, key)
    for key in range(5):
        pt.take(key, timeout=SETTLE_S)
    assert set(pin.idents) == {pt.thread.ident}
    assert threading.get_ident() not in pin.idents
    assert pt.thread.name == "pin-under-test"
    assert pt.thread.daemon


def test_submit_does_not_wait_for_pinning(threads):
    hold = threading.Event()
    pt = threads(Recorder(hold))
    for key in range(50):
        pt.submit(key, key)  # the pin step is held: a submit that waited for it would never return
    assert pt.pending == 50
    hold.set()
    assert pt.take(49, timeout=SETTLE_S) == Pinned(49)


def test_none_is_a_batch_like_any_other(threads):
    pt = threads(Recorder())
    pt.submit(0, None)
    assert pt.take(0, timeout=SETTLE_S) == Pinned(None)


def test_error_surfaces_at_that_batch_only(threads):
    raised: list[BaseException] = []

    def pin(batch):
        if batch == 3:
            raised.append(ValueError("cannot pin batch 3"))
            raise raised[-1]
        return Pinned(batch)

    pt = threads(pin)
    for key in range(8):
        pt.submit(key, key)
    for key in range(3):
        assert pt.take(key, timeout=SETTLE_S) == Pinned(key)
    with pytest.raises(ValueError, match="cannot pin batch 3") as info:
        pt.take(3, timeout=SETTLE_S)
    assert info.value is raised[0]  # the original exception, not a copy
    if sys.version_info >= (3, 11):
        assert PIN_THREAD_NOTE in info.value.__notes__
    else:
        assert PIN_THREAD_NOTE in str(info.value.__cause__)
    # the traceback still reaches the pin step's own frame
    assert any(entry.name == "pin" for entry in info.traceback)
    for key in range(4, 8):
        assert pt.take(key, timeout=SETTLE_S) == Pinned(key)
    assert pt.alive
    assert pt.pending == 0


def test_base_exception_in_pin_step_is_delivered_and_thread_survives(threads):
    def pin(batch):
        if batch == 0:
            raise SystemExit("from the pin step")
        return Pinned(batch)

    pt = threads(pin)
    pt.submit(0, 0)
    pt.submit(1, 1)
    with pytest.raises(SystemExit, match="from the pin step"):
        pt.take(0, timeout=SETTLE_S)
    assert pt.take(1, timeout=SETTLE_S) == Pinned(1)


def test_take_times_out_and_the_batch_stays_pending(threads):
    hold = threading.Event()
    pt = threads(Recorder(hold))
    pt.submit(0, "a")
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        pt.take(0, timeout=0.3)
    assert time.monotonic() - start >= 0.3  # it waited as long as it was told
    assert pt.pending == 1
    hold.set()
    assert pt.take(0, timeout=SETTLE_S) == Pinned("a")


def test_take_of_unknown_key_raises_at_once(threads):
    pt = threads(Recorder())
    pt.submit(0, "a")
    with pytest.raises(KeyError):
        pt.take(1, timeout=SETTLE_S)  # never submitted: a KeyError, not the TimeoutError of a wait
    assert pt.take(0, timeout=SETTLE_S) == Pinned("a")
    with pytest.raises(KeyError):
        pt.take(0)  # already taken


def test_duplicate_pending_key_is_refused(threads):
    hold = threading.Event()
    pt = threads(Recorder(hold))
    pt.submit(0, "a")
    with pytest.raises(ValueError, match="key 0"):
        pt.submit(0, "b")
    hold.set()
    assert pt.take(0, timeout=SETTLE_S) == Pinned("a")
    pt.submit(0, "c")  # taken, so the key is free again
    assert pt.take(0, timeout=SETTLE_S) == Pinned("c")


@contextlib.contextmanager
def ctrl_c_after(seconds: float):
    """KeyboardInterrupt in the main thread after `seconds`, as Ctrl-C would raise it."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs SIGALRM timers")
def test_ctrl_c_interrupts_a_waiting_take(threads):
    assert threading.current_thread() is threading.main_thread()
    hold = threading.Event()
    pt = threads(Recorder(hold))
    pt.submit(0, "a")

    with ctrl_c_after(0.2), pytest.raises(KeyboardInterrupt):
        pt.take(0)  # no timeout: only the interrupt can end this wait
    hold.set()  # the interrupted take left the pin thread usable
    assert pt.take(0, timeout=SETTLE_S) == Pinned("a")


def test_wait_leaves_the_batch_pending_for_take(threads):
    hold = threading.Event()
    pt = threads(Recorder(hold))
    pt.submit(0, "a")
    with pytest.raises(TimeoutError):
        pt.wait(0, timeout=0.05)
    hold.set()
    pt.wait(0, timeout=SETTLE_S)
    pt.wait(0, timeout=SETTLE_S)  # still there: waiting takes nothing
    assert pt.pending == 1
    assert pt.take(0, timeout=0) == Pinned("a")
    with pytest.raises(KeyError):
        pt.wait(0)


def test_wait_returns_for_a_failed_pin_and_take_raises(threads):
    def fail(batch: object) -> object:
        raise MemoryError("planted")

    pt = threads(fail)
    pt.submit(0, "a")
    pt.wait(0, timeout=SETTLE_S)
    with pytest.raises(MemoryError, match="planted"):
        pt.take(0)


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs SIGALRM timers")
def test_ctrl_c_during_wait_keeps_the_batch(threads):
    hold = threading.Event()
    pt = threads(Recorder(hold))
    pt.submit(0, "a")

    with ctrl_c_after(0.2), pytest.raises(KeyboardInterrupt):
        pt.wait(0)
    assert pt.pending == 1
    hold.set()
    assert pt.take(0, timeout=SETTLE_S) == Pinned("a")


def test_discard_queued_ready_and_in_flight(threads):
    hold = threading.Event()
    pin = Recorder(hold)
    pt = threads(pin)
    for key in range(4):
        pt.submit(key, key)
    assert pin.started.wait(SETTLE_S)  # batch 0 is being pinned, 1..3 are queued
    assert pt.discard(0)  # in flight
    assert pt.discard(2)  # queued
    assert not pt.discard(2)
    assert not pt.discard(99)
    assert pt.pending == 2
    hold.set()
    assert pt.take(3, timeout=SETTLE_S) == Pinned(3)
    assert pt.discard(1)  # ready
    assert pt.pending == 0
    assert pin.seen == [0, 1, 3]  # a discarded queued batch is never pinned
    for key in (0, 1, 2):
        with pytest.raises(KeyError):
            pt.take(key)


def test_clear_forgets_everything_and_the_thread_goes_on(threads):
    hold = threading.Event()
    pin = Recorder(hold)
    pt = threads(pin)
    for key in range(5):
        pt.submit(key, key)
    assert pin.started.wait(SETTLE_S)
    assert pt.clear() == 5
    assert pt.pending == 0
    hold.set()
    pt.submit(10, 10)
    assert pt.take(10, timeout=SETTLE_S) == Pinned(10)
    assert pin.seen == [0, 10]
    assert pt.pending == 0


# ---------------------------------------------------------------------------- close
def test_close_when_idle_stops_the_thread(threads):
    pt = threads(Recorder())
    pt.submit(0, "a")
    assert pt.take(0, timeout=SETTLE_S) == Pinned("a")
    thread = pt.thread
    assert thread in threading.enumerate()
    pt.close()
    assert not thread.is_alive()
    assert thread not in threading.enumerate()
    assert not pt.alive
    pt.close()  # idempotent


def test_close_with_batches_pending_drops_them(threads):
    hold = threading.Event()
    pin = Recorder(hold)
    pt = threads(pin)
    for key in range(5):
        pt.submit(key, key)
    assert pin.started.wait(SETTLE_S)
    hold.set()
    pt.close()
    assert pt.pending == 0
    wait_gone(pt.thread)
    assert len(pin.seen) <= 1  # at most the batch already in the pin step when close came
    with pytest.raises(RuntimeError, match="closed"):
        pt.take(4)


def test_close_while_the_pin_step_is_stuck_is_bounded(threads, monkeypatch):
    monkeypatch.setattr(pin_module, "PIN_JOIN_TIMEOUT_S", 0.3)
    hold = threading.Event()
    pin = Recorder(hold)
    pt = threads(pin)
    pt.submit(0, "stuck")
    pt.submit(1, "queued")
    assert pin.started.wait(SETTLE_S)
    start = time.monotonic()
    pt.close()
    assert time.monotonic() - start >= 0.3  # waited for the thread ...
    assert pt.thread.is_alive()  # ... but returned with it still inside the stuck pin step
    with pytest.raises(RuntimeError, match="closed"):
        pt.take(0)
    hold.set()
    wait_gone(pt.thread)
    assert pin.seen == ["stuck"]  # the queued batch was dropped, never pinned


def test_take_and_submit_after_close_raise(threads):
    pt = threads(Recorder())
    pt.submit(0, "a")
    pt.close()
    with pytest.raises(RuntimeError, match="closed"):
        pt.take(0)
    with pytest.raises(RuntimeError, match="closed"):
        pt.take(0, timeout=0.1)
    with pytest.raises(RuntimeError, match="closed"):
        pt.submit(1, "b")


def test_close_wakes_a_waiting_take(threads):
    hold = threading.Event()
    pin = Recorder(hold)
    pt = threads(pin)
    pt.submit(0, "a")
    assert pin.started.wait(SETTLE_S)
    outcome: list[BaseException] = []

    def consumer():
        try:
            pt.take(0)
        except BaseException as error:
            outcome.append(error)

    waiter = threading.Thread(target=consumer)
    waiter.start()
    time.sleep(0.2)
    closer = threading.Thread(target=pt.close)
    closer.start()
    waiter.join(SETTLE_S)
    assert not waiter.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError)
    hold.set()
    closer.join(SETTLE_S)
    wait_gone(pt.thread)


def test_dropped_pin_thread_is_collected_and_stops():
    pt = PinThread(Recorder())
    pt.submit(0, "a")
    thread = pt.thread
    ref = weakref.ref(pt)
    del pt
    gc.collect()
    assert ref() is None  # the thread holds no reference to its PinThread
    wait_gone(thread)


def test_owner_with_a_finalizer_is_collected():
    class Owner:
        def __init__(self) -> None:
            self.pin_thread = PinThread(pin_batch)
            self.close = weakref.finalize(self, self.pin_thread.close)

    owner = Owner()
    owner.pin_thread.submit(0, [1, 2])
    assert owner.pin_thread.take(0, timeout=SETTLE_S) == [1, 2]
    thread = owner.pin_thread.thread
    ref = weakref.ref(owner)
    del owner
    gc.collect()
    assert ref() is None
    wait_gone(thread)


def test_thread_that_died_is_reported_not_waited_on(threads, monkeypatch):
    def die(shared):
        return False  # the thread's loop ends, as an unexpected exit would end it

    monkeypatch.setattr(pin_module, "_pin_next", die)
    pt = threads(Recorder())
    pt.thread.join(SETTLE_S)
    pt.submit(0, "a")
    with pytest.raises(RuntimeError, match="exited"):
        pt.take(0, timeout=SETTLE_S)  # it must notice the dead thread, not time out
    assert not pt.alive


def test_init_runs_once_on_the_pin_thread_before_pinning(threads):
    events: list[tuple[str, int]] = []
    pt = threads(
        lambda batch: events.append(("pin", threading.get_ident())) or batch,
        init=lambda: events.append(("init", threading.get_ident())),
    )
    for key in range(3):
        pt.submit(key, key)
    for key in range(3):
        assert pt.take(key, timeout=SETTLE_S) == key
    ident = pt.thread.ident
    assert events == [("init", ident)] + [("pin", ident)] * 3


def test_failed_init_is_raised_at_take(threads):
    def init():
        raise OSError("no device")

    pt = threads(Recorder(), init=init)
    pt.thread.join(SETTLE_S)
    pt.submit(0, "a")
    with pytest.raises(RuntimeError, match="failed to start") as info:
        pt.take(0)
    assert isinstance(info.value.__cause__, OSError)
    assert not pt.alive


# ------------------------------------------------------------------------ pin_function
def no_accelerator():
    torch = pytest.importorskip("torch")
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present")
    return torch


def call_pin_function(device: str):
    return pin_function(device, stacklevel=2)  # the warning names this line


CALL_LINE = call_pin_function.__code__.co_firstlineno + 1


def pin_warnings(record: Any) -> list[Any]:
    """The warnings of the pin step among those recorded (not, say, a DeprecationWarning of
    a library imported meanwhile)."""
    return [w for w in record if issubclass(w.category, UserWarning) and "pin_memory" in str(w.message)]


def test_pin_function_without_accelerator_warns_and_returns_none():
    no_accelerator()
    with pytest.warns(UserWarning) as record:
        assert call_pin_function("") is None
    ours = pin_warnings(record)
    assert [str(w.message) for w in ours] == [
        "'pin_memory' argument is set as true but no accelerator is found, then device pinned memory won't be used."
    ]
    assert ours[0].filename == __file__
    assert ours[0].lineno == CALL_LINE


def test_pin_function_device_argument_is_deprecated():
    no_accelerator()
    with pytest.warns(UserWarning) as record:
        assert call_pin_function("cuda:1") is None
    messages = [str(w.message) for w in pin_warnings(record)]
    assert messages[0] == (
        "pin_memory_device is deprecated, the current accelerator will be used as "
        "the device, ignore pin_memory_device='cuda:1'."
    )
    assert "no accelerator is found" in messages[1]
    assert len(messages) == 2


def test_pin_function_without_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    with pytest.warns(UserWarning, match="torch is not installed") as record:
        assert call_pin_function("") is None
    assert str(pin_warnings(record)[0].message) == (
        "'pin_memory' argument is set as true but torch is not installed, then device pinned memory won't be used."
    )
    assert device_setup() is None


def test_pin_function_with_accelerator_returns_pin_batch(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.simplefilter("error", RuntimeWarning)  # stoker's categories: not the others'
        assert pin_function("", stacklevel=2) is pin_batch


def test_device_setup_moves_the_pin_thread_to_the_consumers_device(threads, monkeypatch):
    torch = pytest.importorskip("torch")
    chosen: list[tuple[int, int]] = []
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 3)
    monkeypatch.setattr(
        torch.accelerator,
        "set_device_index",
        lambda index: chosen.append((index, threading.get_ident())),
    )
    setup = device_setup()
    assert setup is not None
    assert chosen == []  # read here, set only on the pin thread
    pt = threads(Recorder(), init=setup)
    pt.submit(0, "a")
    pt.take(0, timeout=SETTLE_S)
    assert chosen == [(3, pt.thread.ident)]


def test_device_setup_without_accelerator_is_none():
    no_accelerator()
    assert device_setup() is None


# --------------------------------------------------------------------------- pin_batch
class Pinnable:
    """A custom batch type that pins itself, as torch lets a batch do."""

    def __init__(self, name: str) -> None:
        self.name = name

    def pin_memory(self) -> tuple[str, str]:
        return ("pinned", self.name)


class Point(NamedTuple):
    x: object
    y: object


class Frozen(Mapping):
    """An immutable mapping built from a dict."""

    def __init__(self, data: dict) -> None:
        self._data = dict(data)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class Tagged(dict):
    """A dict with an attribute of its own, which a rebuilt dict would lose."""

    tag = "class"


class Pair(tuple):
    """A tuple subclass whose constructor does not take one iterable."""

    def __new__(cls, a, b):
        return super().__new__(cls, (a, b))


def test_pin_batch_pins_through_nested_structures():
    array = np.arange(3)
    batch = {
        "a": Pinnable("a"),
        "list": [Pinnable("b"), 1, "text", b"bytes"],
        "tuple": (Pinnable("c"), (Pinnable("d"),)),
        "point": Point(Pinnable("e"), 2.5),
        "array": array,
        "none": None,
    }
    out = pin_batch(batch)
    assert out == {
        "a": ("pinned", "a"),
        "list": [("pinned", "b"), 1, "text", b"bytes"],
        "tuple": (("pinned", "c"), (("pinned", "d"),)),
        "point": Point(("pinned", "e"), 2.5),
        "array": array,
        "none": None,
    }
    assert type(out["point"]) is Point
    assert out["array"] is array  # not a tensor, no pin_memory(): untouched
    assert isinstance(batch["a"], Pinnable)  # the input is not changed
    assert isinstance(batch["list"][0], Pinnable)


def test_pin_batch_keeps_container_types():
    tagged = Tagged(x=Pinnable("x"))
    tagged.tag = "instance"
    ordered = collections.OrderedDict([("b", Pinnable("b")), ("a", 1)])
    default = collections.defaultdict(list, {"k": Pinnable("k")})
    frozen = Frozen({"f": Pinnable("f")})
    out_tagged = pin_batch(tagged)
    assert type(out_tagged) is Tagged and out_tagged.tag == "instance"
    assert out_tagged == {"x": ("pinned", "x")}
    out_ordered = pin_batch(ordered)
    assert type(out_ordered) is collections.OrderedDict
    assert list(out_ordered.items()) == [("b", ("pinned", "b")), ("a", 1)]
    out_default = pin_batch(default)
    assert type(out_default) is collections.defaultdict and out_default.default_factory is list
    out_frozen = pin_batch(frozen)
    assert type(out_frozen) is Frozen and dict(out_frozen) == {"f": ("pinned", "f")}
    assert pin_batch(collections.deque([Pinnable("q")])) == collections.deque([("pinned", "q")])


def test_pin_batch_falls_back_to_plain_containers():
    out = pin_batch(Pair(Pinnable("a"), 1))
    assert out == (("pinned", "a"), 1) and type(out) is tuple
    assert pin_batch(range(3)) == [0, 1, 2]


def test_pin_batch_leaves_strings_classes_and_plain_attributes():
    class WithAttribute:
        pin_memory = True  # not a method

    thing = WithAttribute()
    assert pin_batch("abc") == "abc"
    assert pin_batch(bytearray(b"ab")) == bytearray(b"ab")
    assert pin_batch(Pinnable) is Pinnable  # a class, not a batch
    assert pin_batch(thing) is thing
    assert pin_batch(7) == 7


def test_pin_batch_calls_pin_memory_on_torch_tensors(monkeypatch):
    torch = pytest.importorskip("torch")
    pinned: list[object] = []

    def fake_pin_memory(self, *args, **kwargs):
        pinned.append(self)
        return ("pinned tensor", self.shape[0])

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin_memory)
    t1, t2 = torch.zeros(2), torch.zeros(3)
    out = pin_batch({"x": t1, "y": [t2, Point(t1, "s")]})
    assert out == {
        "x": ("pinned tensor", 2),
        "y": [("pinned tensor", 3), Point(("pinned tensor", 2), "s")],
    }
    assert [p is t for p, t in zip(pinned, (t1, t2, t1))] == [True, True, True]


def test_pin_batch_on_the_pin_thread(threads):
    pt = threads(pin_batch)
    pt.submit(0, {"x": [Pinnable("x")]})
    assert pt.take(0, timeout=SETTLE_S) == {"x": [("pinned", "x")]}
