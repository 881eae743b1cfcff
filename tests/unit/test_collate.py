"""Type-preserving collation (`stoker.default_collate`) and torch's (`stoker.torch`)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple

import numpy as np
import pytest

import stoker
from stoker import default_collate, default_convert

Pair = namedtuple("Pair", "a b")


@dataclasses.dataclass
class Record:
    image: np.ndarray
    label: int


def test_numpy_arrays_stack_and_stay_numpy() -> None:
    batch = default_collate([np.arange(3, dtype=np.int16) + i for i in range(4)])
    assert isinstance(batch, np.ndarray) and batch.dtype == np.int16 and batch.shape == (4, 3)
    assert batch[2].tolist() == [2, 3, 4]


def test_python_numbers_become_numpy_with_wide_types() -> None:
    ints, floats, bools = default_collate([1, 2]), default_collate([1.5, 2.0]), default_collate([True, False])
    assert ints.dtype == np.int64 and ints.tolist() == [1, 2]
    assert floats.dtype == np.float64 and floats.tolist() == [1.5, 2.0]
    assert bools.dtype == np.bool_ and bools.tolist() == [True, False]


def test_numpy_scalars_keep_their_dtype() -> None:
    out = default_collate([np.float32(1), np.float32(2)])
    assert out.dtype == np.float32 and out.tolist() == [1.0, 2.0]


def test_strings_and_none_become_lists() -> None:
    assert default_collate(["a", "b"]) == ["a", "b"]
    assert default_collate([b"x", b"y"]) == [b"x", b"y"]
    assert default_collate([None, None]) == [None, None]


def test_containers_keep_their_type() -> None:
    samples = [OrderedDict(x=np.zeros(2), meta=("s", i), p=Pair(i, [i, i + 1])) for i in range(3)]
    out = default_collate(samples)
    assert type(out) is OrderedDict and list(out) == ["x", "meta", "p"]
    assert isinstance(out["meta"], tuple) and out["meta"][0] == ["s", "s", "s"]
    assert out["meta"][1].tolist() == [0, 1, 2]
    assert isinstance(out["p"], Pair) and out["p"].a.tolist() == [0, 1, 2]
    assert isinstance(out["p"].b, list) and out["p"].b[1].tolist() == [1, 2, 3]


def test_dataclasses_recurse() -> None:
    out = default_collate([Record(np.ones((2, 2)) * i, i) for i in range(3)])
    assert isinstance(out, Record) and out.image.shape == (3, 2, 2) and out.label.tolist() == [0, 1, 2]


def test_ragged_arrays_name_shapes_and_path() -> None:
    samples = [{"image": [np.zeros(3), np.zeros(3)]}, {"image": [np.zeros(3), np.zeros(4)]}]
    with pytest.raises(ValueError) as info:
        default_collate(samples)
    message = str(info.value)
    assert "sample['image'][1]" in message and "(3,)" in message and "(4,)" in message


def test_unsupported_type_names_type_and_path() -> None:
    class Opaque:
        pass

    with pytest.raises(TypeError) as info:
        default_collate([{"x": Opaque()}, {"x": Opaque()}])
    assert "Opaque" in str(info.value) and "sample['x']" in str(info.value)


def test_mixed_types_and_lengths_are_reported() -> None:
    with pytest.raises(TypeError, match="sample 1"):
        default_collate([np.zeros(2), "text"])
    with pytest.raises(ValueError, match="length 2 and sample 1 has length 3"):
        default_collate([[1, 2], [1, 2, 3]])
    with pytest.raises(ValueError, match="empty"):
        default_collate([])


def test_registry_extends_collation_per_type() -> None:
    class Box:
        def __init__(self, v: int) -> None:
            self.v = v

    fn_map = {**stoker.default_collate_fn_map, Box: lambda batch, *, collate_fn_map=None: sum(b.v for b in batch)}
    assert stoker.collate([{"b": Box(1)}, {"b": Box(2)}], collate_fn_map=fn_map) == {"b": 3}


def test_default_convert_is_identity() -> None:
    sample = {"x": np.zeros(2), "y": (1, 2)}
    assert default_convert(sample) is sample


def test_torch_tensors_stay_tensors_in_numpy_flavour() -> None:
    torch = pytest.importorskip("torch")
    out = default_collate([{"t": torch.ones(2) * i, "n": np.ones(2)} for i in range(3)])
    assert isinstance(out["t"], torch.Tensor) and out["t"].shape == (3, 2)
    assert isinstance(out["n"], np.ndarray)


def test_allocator_receives_every_array_output() -> None:
    from stoker._data import collate as _collate

    seen: list[tuple[tuple[int, ...], np.dtype]] = []

    def alloc(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        seen.append((shape, np.dtype(dtype)))
        return np.empty(shape, dtype)

    with _collate.allocator(alloc):
        out = default_collate([{"x": np.ones((2, 2), np.uint8), "y": 1} for _ in range(4)])
    assert out["x"].sum() == 16 and out["y"].tolist() == [1, 1, 1, 1]
    assert ((4, 2, 2), np.dtype(np.uint8)) in seen and ((4,), np.dtype(np.int64)) in seen


# ------------------------------------------------------------------ torch flavour
def _torch_pair():
    torch = pytest.importorskip("torch")
    import torch.utils.data as tud

    import stoker.torch as st

    return torch, tud, st


def _same(a, b) -> bool:
    import torch

    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize(
    "samples",
    [
        [1, 2, 3],
        [1.5, 2.5],
        [True, False],
        [np.float32(1), np.float32(2)],
        [np.int16(1), np.int16(2)],
        [np.zeros((2, 3), np.uint8), np.ones((2, 3), np.uint8)],
        [np.array(1.5), np.array(2.5)],
        ["a", "b"],
        [(1, "x", np.zeros(2)), (2, "y", np.ones(2))],
        [{"a": [1, 2], "b": {"c": 1.0}}, {"a": [3, 4], "b": {"c": 2.0}}],
        [Pair(1, "s"), Pair(2, "t")],
        [OrderedDict(z=1, a=2), OrderedDict(z=3, a=4)],
    ],
    ids=lambda s: type(s[0]).__name__,
)
def test_torch_flavour_equals_torch(samples) -> None:
    torch, tud, st = _torch_pair()
    assert _same(st.default_collate(samples), tud.default_collate(samples))
    for sample in samples:
        assert _same(st.default_convert(sample), tud.default_convert(sample))


def test_torch_flavour_errors_have_torch_types_and_a_path() -> None:
    torch, tud, st = _torch_pair()
    with pytest.raises(RuntimeError) as info:
        st.default_collate([{"x": [torch.zeros(2), torch.zeros(2)]}, {"x": [torch.zeros(2), torch.zeros(3)]}])
    assert "sample['x'][1]" in str(info.value)
    with pytest.raises(RuntimeError, match="equal size"):
        st.default_collate([[1, 2], [1]])
    with pytest.raises(TypeError, match="found"):
        st.default_collate([object(), object()])
    with pytest.raises(TypeError):
        st.default_collate([np.array(["a"]), np.array(["b"])])


# ---------------------------------------------------- the fast paths and their edges
# Uniform batches are stacked and converted at C speed; every other batch must still get
# the checking path's result or error, in both flavours and inside an allocator.
def _in_slot(collate, samples):
    from stoker._data import collate as _collate

    pool = np.zeros(1 << 16, np.uint8)
    used = [0]

    def alloc(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        dt = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dt.itemsize
        start = (used[0] + 63) // 64 * 64
        used[0] = start + nbytes
        return pool[start : start + nbytes].view(dt).reshape(shape)

    with _collate.allocator(alloc):
        return collate(samples)


EDGE_BATCHES = [
    [np.zeros((1, 3), np.float32), np.ones((3, 3), np.float32), np.ones((2, 3), np.float32)],  # rows add up
    [np.zeros(3, np.float32), np.zeros(3, np.float64)],  # dtypes differ
    [np.zeros(3, ">f4"), np.ones(3, ">f4")],  # non-native byte order
    [np.array(1.5), np.array(2.5)],  # 0-d arrays
    [np.zeros(2), np.array(3.0)],  # 0-d among 1-d
    [np.zeros((0, 2)), np.zeros((0, 2))],  # empty first axis
    [np.arange(6).reshape(2, 3)[:, ::2], np.arange(4).reshape(2, 2)],  # non-contiguous sample
]


@pytest.mark.parametrize("samples", EDGE_BATCHES, ids=range(len(EDGE_BATCHES)))
def test_numpy_flavour_edges_match_a_plain_stack(samples) -> None:
    for collate in (default_collate, lambda s: _in_slot(default_collate, s)):
        try:
            expected = np.stack(samples)
        except ValueError:
            with pytest.raises(ValueError, match="different shapes"):
                collate(samples)
            continue
        out = collate(samples)
        same = all(a.dtype == samples[0].dtype for a in samples)
        dtype = samples[0].dtype if same else np.result_type(*samples)  # byte order kept
        assert out.dtype == dtype and out.shape == expected.shape
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize(
    "samples",
    [
        *EDGE_BATCHES,
        [1, 2**40, -3],
        [True, False, True],
        [1, True],  # ints and bools: torch's inference decides
        [1.5, 2.0, -0.0],
        [1.5, 2],  # a float batch holding an int
        [{"id": i, "x": np.full(4, i, np.float32)} for i in range(5)],
        [{"a": 1, "b": 2}, OrderedDict(a=3, b=4)],  # dict and another mapping
    ],
    ids=lambda s: repr(s)[:40],
)
def test_torch_flavour_edges_equal_torch(samples) -> None:
    torch, tud, st = _torch_pair()
    try:
        expected = tud.default_collate(samples)
    except Exception as exc:  # torch refuses: so must stoker, with torch's exception type
        for collate in (st.default_collate, lambda s: _in_slot(st.default_collate, s)):
            with pytest.raises(type(exc)):
                collate(samples)
        return
    assert _same(st.default_collate(samples), expected)
    assert _same(_in_slot(st.default_collate, samples), expected)


def test_torch_flavour_int_beyond_int64_raises_as_torch() -> None:
    torch, tud, st = _torch_pair()
    with pytest.raises((RuntimeError, ValueError, OverflowError)) as theirs:
        tud.default_collate([1, 2**70])
    with pytest.raises(type(theirs.value)):
        st.default_collate([1, 2**70])
    with pytest.raises(type(theirs.value)):
        _in_slot(st.default_collate, [1, 2**70])


def test_mapping_keys_that_differ_are_named_in_both_flavours() -> None:
    torch, tud, st = _torch_pair()
    batch = [{"a": 1, "b": 2}, {"a": 1, "c": 2}]
    with pytest.raises(ValueError, match="sample 1 has keys"):
        default_collate(batch)
    with pytest.raises(KeyError):
        tud.default_collate(batch)
    # the same length, and sample 0's keys found in the other: only a key of its own differs
    for other in ({"a": 1}, {"a": 1, "b": 2, "c": 3}, {"b": 2, "a": 1, "x": 0}):
        with pytest.raises(ValueError, match="sample 2 has keys"):
            default_collate([{"a": 1, "b": 2}, {"a": 3, "b": 4}, other])
        with pytest.raises(ValueError, match="sample 2 has keys"):
            st.default_collate([{"a": 1, "b": 2}, {"a": 3, "b": 4}, other])


def test_a_deferred_leaf_travels_as_a_tensor() -> None:
    """A worker that defers tensors hands the main process `TensorLeaf` arrays: the arena
    flags them as tensors, and pickled (no slot, or the pickle transport) they rebuild as
    tensors."""
    import pickle

    torch = pytest.importorskip("torch")
    from stoker._core.arena import _as_array
    from stoker._data.torch_collate import TensorLeaf

    leaf = np.arange(6, dtype=np.int16).reshape(2, 3).view(TensorLeaf)
    found = _as_array(leaf)
    assert found is not None and found[1] is True
    for protocol in (2, 5):
        back = pickle.loads(pickle.dumps({"x": leaf}, protocol=protocol))["x"]
        assert type(back) is torch.Tensor and back.dtype == torch.int16 and back.tolist() == leaf.tolist()


@pytest.mark.parametrize(
    "kind",
    [np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.float16, np.float32, np.float64, np.complex64],
)
def test_numpy_scalars_collate_as_torch_does(kind) -> None:
    torch, tud, st = _torch_pair()
    samples = [kind(1), kind(0), kind(1)]
    assert _same(st.default_collate(samples), tud.default_collate(samples))
    assert _same(_in_slot(st.default_collate, samples), tud.default_collate(samples))
