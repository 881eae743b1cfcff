"""stoker.SharedList: round trips of every supported kind, list behaviour, errors, pickling."""

from __future__ import annotations

import copy
import io
import math
import pickle
from collections import namedtuple

import numpy as np
import pytest

import stoker
from stoker import SharedList
from stoker._core.sharing import Packed, _SharingPickler

STRINGS = ["", "a", "/data/train/img_0001.jpg", "héllo wörld", "日本語", "emoji 🐍", "x" * 1000]
BYTES = [b"", b"\x00\xff", b"abc", bytes(range(256))]
INTS = [0, 1, -1, 7, -(2**63), 2**63 - 1, 123456789012]
FLOATS = [0.0, -0.0, 1.5, -2.25, math.inf, -math.inf, 1e308, 5e-324]
TUPLES = [(), (1,), ("a", b"b", 3, 4.5), (("nested", (1, (2, ()))), -7), ((),)]
MIXED = STRINGS + BYTES + INTS + FLOATS + TUPLES + [2**100, -(2**80), "\udc80 surrogate"]


def same(a: object, b: object) -> bool:
    """Equal and of the same type, recursively; -0.0 keeps its sign."""
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple):
        assert isinstance(b, tuple)
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        assert isinstance(b, float)
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    return a == b


@pytest.mark.parametrize(
    "items", [STRINGS, BYTES, INTS, FLOATS, TUPLES, MIXED], ids=["str", "bytes", "int", "float", "tuple", "mixed"]
)
def test_round_trip(items: list[object]) -> None:
    sl = SharedList(items)
    assert len(sl) == len(items)
    for i, x in enumerate(items):
        assert same(sl[i], x), (i, sl[i], x)
        assert same(sl[i - len(items)], x)
    assert all(same(a, b) for a, b in zip(sl, items))
    assert len(list(sl)) == len(items)
    assert sl == items and items == sl and sl == tuple(items)
    assert sl == SharedList(items)
    assert sl[1:3] == items[1:3] and isinstance(sl[1:3], list)
    assert sl[::-2] == items[::-2] and sl[:] == items and sl[5:2] == []
    assert sl.index(items[2]) == items.index(items[2])
    assert items[-1] in sl and sl.count(items[0]) == items.count(items[0])
    assert list(reversed(sl)) == items[::-1]


def test_nan_round_trip_and_iterables() -> None:
    sl = SharedList([math.nan, 1.0])
    assert math.isnan(sl[0]) and sl[1] == 1.0
    assert list(SharedList(iter(["a", "b"]))) == ["a", "b"]
    assert list(SharedList(f"s{i}" for i in range(3))) == ["s0", "s1", "s2"]
    assert SharedList(range(5)) == [0, 1, 2, 3, 4]


def test_subclasses_come_back_as_builtins() -> None:
    Point = namedtuple("Point", "x y")
    sl = SharedList([np.str_("p"), np.int64(3), np.float32(0.5), np.float64(2.5), Point(1, "a"), np.bytes_(b"q")])
    got = list(sl)
    assert got == ["p", 3, 0.5, 2.5, (1, "a"), b"q"]
    assert [type(x) for x in got] == [str, int, float, float, tuple, bytes]
    assert list(SharedList(np.array(["a", "bc"]))) == ["a", "bc"]


def test_index_errors() -> None:
    for items in (STRINGS, BYTES, INTS, FLOATS, MIXED, []):
        sl = SharedList(items)
        for bad in (len(items), -len(items) - 1, 10**6):
            with pytest.raises(IndexError, match="SharedList index out of range"):
                sl[bad]
        with pytest.raises(TypeError, match="integers or slices, not str"):
            sl["0"]  # type: ignore[call-overload]
    assert SharedList(INTS)[np.int64(2)] == INTS[2]


def test_empty() -> None:
    sl = SharedList()
    assert len(sl) == 0 and list(sl) == [] and sl[:] == [] and sl == [] and not sl
    assert SharedList([]) == sl and pickle.loads(pickle.dumps(sl)) == []
    assert "len=0" in repr(sl)


@pytest.mark.parametrize(
    ("items", "message"),
    [
        ([1, 2, 3, {"a": 1}], r"element 3 is a dict"),
        (["a", ["b"]], r"element 1 is a list"),
        ([None], r"element 0 is None"),
        (["a", object()], r"element 1 is an object"),
        ([True], r"element 0 is a bool"),
        ([1, ("a", [1])], r"element 1\[1\] is a list"),
        ([(1, (2, None))], r"element 0\[1\]\[1\] is None"),
        (["a", {1}], r"element 1 is a set"),
    ],
)
def test_unsupported_elements(items: list[object], message: str) -> None:
    with pytest.raises(TypeError, match=message) as info:
        SharedList(items)
    assert "SharedList holds str, bytes, int, float and tuples of them" in str(info.value)


def test_read_only() -> None:
    sl = SharedList(["a", "b"])
    with pytest.raises(TypeError, match="SharedList is read-only"):
        sl[0] = "c"
    with pytest.raises(TypeError, match="SharedList is read-only"):
        del sl[0]
    for name, args in [
        ("append", ("c",)),
        ("extend", (["c"],)),
        ("insert", (0, "c")),
        ("pop", ()),
        ("remove", ("a",)),
        ("clear", ()),
        ("sort", ()),
        ("reverse", ()),
    ]:
        with pytest.raises(TypeError, match="SharedList is read-only"):
            getattr(sl, name)(*args)
    with pytest.raises(TypeError, match="SharedList is read-only"):
        sl += ["c"]
    assert list(sl) == ["a", "b"]
    for items in (STRINGS, INTS, FLOATS, MIXED):
        for array in SharedList(items).arrays:
            assert not array.flags.writeable
            with pytest.raises(ValueError):
                array[...] = 0
    with pytest.raises(TypeError):
        hash(sl)


def test_pickle_and_copy() -> None:
    for items in (STRINGS, BYTES, INTS, FLOATS, TUPLES, MIXED):
        sl = SharedList(items)
        back = pickle.loads(pickle.dumps(sl))
        assert type(back) is type(sl) and back == sl
        assert all(same(a, b) for a, b in zip(back, items))
        assert all(not a.flags.writeable for a in back.arrays)
        assert copy.copy(sl) is sl and copy.deepcopy(sl) is sl
    assert SharedList(SharedList(STRINGS)) == STRINGS


def test_no_python_objects_kept_and_nbytes() -> None:
    paths = [f"/data/img_{i:06d}.jpg" for i in range(1000)]
    sl = SharedList(paths)
    assert all(isinstance(a, np.ndarray) and not a.dtype.hasobject for a in sl.arrays)
    assert sl.nbytes == sum(len(p) for p in paths) + 8 * 1001
    assert SharedList(range(1000)).nbytes == 8000


class Holder:
    def __init__(self) -> None:
        self.paths = SharedList(f"/data/train/class_{i % 1000:04d}/img_{i:08d}.jpg" for i in range(200_000))
        self.labels = SharedList(i % 1000 for i in range(200_000))


def test_pickled_under_packed_by_handle() -> None:
    """Under spawn/forkserver, stoker packs the dataset with Packed: a SharedList's big arrays
    must go through shared memory, not into the pickle bytes (the worker side is checked in
    tests/integration/test_shared_list_workers.py)."""
    holder = Holder()
    assert holder.paths.nbytes > 3 << 20 and holder.labels.nbytes > 1 << 20
    plain = len(pickle.dumps(holder))
    packed = Packed(holder)
    try:
        stream = io.BytesIO()
        _SharingPickler(stream, packed).dump(holder)
        assert len(packed._order) == 3  # the blob, the offsets, the labels
    finally:
        packed.close()
    assert plain > 10 << 20 and len(stream.getvalue()) < 4 << 10, (plain, len(stream.getvalue()))


def test_exported() -> None:
    assert "SharedList" in stoker.__all__
    flavour = pytest.importorskip("stoker.torch", exc_type=ImportError)
    assert flavour.SharedList is SharedList and "SharedList" in flavour.__all__
