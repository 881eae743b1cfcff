"""`SharedList`: a read-only list of strings, bytes and numbers kept in a few numpy arrays.

Why: a dataset holding a big Python list (two million file paths and labels, say) makes
every forked worker's private memory grow towards the size of that list during an epoch.
Reading a Python object writes its reference count, and that write copies the object's
memory page into the worker (copy-on-write; PyTorch issue 13246). A `SharedList` keeps no
Python object per element: its elements are encoded once into a byte blob and an offsets
array (or a plain int64 / float64 array when every element is an int / a float), and each
read decodes one element into a new object. Reading a numpy array's buffer writes nothing
to it, so forked workers share the pages for good; and as the arrays are what a
`SharedList` pickles to, stoker hands them to spawn and forkserver workers through shared
memory (like any numpy array of at least 1 MiB in a dataset) instead of copying them.

Elements: `str`, `bytes`, `int` (any size), `float`, and tuples (possibly nested) of these.
Subclasses (`numpy.str_`, `numpy.float64`, an `IntEnum`, a namedtuple) and numpy integer and
floating scalars are accepted and come back as the plain built-in type. `bool` and `None`
are not supported (a `bool` would come back as an `int`).
"""

from __future__ import annotations

import marshal
import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NoReturn, overload

import numpy as np

__all__ = ["SharedList"]

_SUPPORTED = "SharedList holds str, bytes, int, float and tuples of them"
_MARSHAL_VERSION = 4  # a fixed format, readable by every supported Python

# storage modes: what the arrays hold
_STR, _BYTES, _INT, _FLOAT, _MIXED = range(5)
# element kinds in mixed mode
_K_STR, _K_BYTES, _K_MARSHAL = range(3)

_EMPTY_U8 = np.zeros(0, np.uint8)
_EMPTY_I8 = np.zeros(0, np.int64)


def _describe(value: Any) -> str:
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _normalize(value: Any, where: str) -> Any:
    """`value` as plain built-in types, or TypeError naming `where` if it is not supported."""
    t = type(value)
    if t is str or t is bytes or t is int or t is float:
        return value
    if isinstance(value, tuple):
        return tuple(_normalize(v, f"{where}[{k}]") for k, v in enumerate(value))
    if isinstance(value, (bool, np.bool_)):
        pass
    elif isinstance(value, str):
        return str.__str__(value)
    elif isinstance(value, bytes):
        return bytes(value)
    elif isinstance(value, (int, np.integer)):
        return int(value)
    elif isinstance(value, (float, np.floating)):
        return float(value)
    raise TypeError(f"SharedList element {where} is {_describe(value)}; {_SUPPORTED}")


def _offsets(lengths: Iterable[int], n: int) -> np.ndarray:
    offsets = np.zeros(n + 1, np.int64)
    if n:
        np.cumsum(np.fromiter(lengths, np.int64, count=n), out=offsets[1:])
    return offsets


def _blob(parts: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(parts), np.uint8) if parts else _EMPTY_U8


def _encode_mixed(items: Sequence[Any]) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    parts: list[bytes] = []
    kinds = np.empty(len(items), np.uint8)
    for i, x in enumerate(items):
        t = type(x)
        if t is str:
            try:
                parts.append(x.encode("utf-8"))
                kinds[i] = _K_STR
                continue
            except UnicodeEncodeError:  # lone surrogates: marshal keeps them
                pass
        elif t is bytes:
            parts.append(x)
            kinds[i] = _K_BYTES
            continue
        parts.append(marshal.dumps(x, _MARSHAL_VERSION))
        kinds[i] = _K_MARSHAL
    return _MIXED, _blob(parts), _offsets(map(len, parts), len(parts)), kinds


def _encode(iterable: Iterable[Any]) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """(mode, data, offsets, kinds) holding the elements of `iterable`."""
    items: Sequence[Any] = iterable if isinstance(iterable, (list, tuple)) else list(iterable)
    n = len(items)
    types = set(map(type, items))
    if not types <= {str, bytes, int, float}:
        items = [_normalize(x, str(i)) for i, x in enumerate(items)]
        types = set(map(type, items))
    if not types or types == {str}:
        try:
            parts = [s.encode("utf-8") for s in items]
        except UnicodeEncodeError:
            return _encode_mixed(items)
        return _STR, _blob(parts), _offsets(map(len, parts), n), _EMPTY_U8
    if types == {bytes}:
        return _BYTES, _blob(list(items)), _offsets(map(len, items), n), _EMPTY_U8
    if types == {int}:
        try:
            return _INT, np.array(items, dtype=np.int64), _EMPTY_I8, _EMPTY_U8
        except OverflowError:
            return _encode_mixed(items)
    if types == {float}:
        return _FLOAT, np.array(items, dtype=np.float64), _EMPTY_I8, _EMPTY_U8
    return _encode_mixed(items)


def _rebuild(mode: int, data: np.ndarray, offsets: np.ndarray, kinds: np.ndarray) -> SharedList:
    """A SharedList over these arrays (what unpickling calls)."""
    self: SharedList = object.__new__(_CLASSES[mode])
    for array in (data, offsets, kinds):
        array.flags.writeable = False
    self._mode = mode
    self._data = data
    self._offsets = offsets
    self._kinds = kinds
    # reads go through memoryviews: indexing one gives a Python int/float directly, with no
    # numpy scalar in between (cast: a native format whatever byte order numpy exported)
    raw = data.data.cast("B")
    offs = offsets.data.cast("B").cast("q")
    self._b = raw
    self._s = offs[:-1]
    self._e = offs[1:]
    self._k = kinds.data.cast("B")
    if mode == _INT:
        self._v = raw.cast("q")
        self._n = len(data)
    elif mode == _FLOAT:
        self._v = raw.cast("d")
        self._n = len(data)
    else:
        self._v = raw
        self._n = max(len(offsets) - 1, 0)
    return self


class SharedList(Sequence[Any]):
    """A read-only list of `str`, `bytes`, `int`, `float` and (nested) tuples of them that
    forked workers share without copying and spawn/forkserver workers receive through
    shared memory.

    `SharedList(iterable)` encodes the elements once; `sl[i]` decodes element `i` (a new
    object each time), `sl[a:b]` gives a plain `list`. Otherwise it behaves like a read-only
    `list`: `len`, iteration, `in`, `index`, `count`, `==` with lists, tuples and other
    SharedLists. Subclasses of the supported types (`numpy.str_`, a namedtuple) and numpy
    integer/floating scalars come back as the plain built-in type; `bool` and `None` are not
    supported. Floats compare as floats do: a list holding `nan` never equals a SharedList.
    Changing it (`sl[i] = x`, `append`, ...) raises TypeError: build a new one instead.

    Args:
        iterable: The elements, read once; a SharedList is returned as it is (not
            copied). Defaults to ().

    Raises:
        TypeError: when an element (or an item of a tuple element) is not a `str`,
            `bytes`, `int`, `float` or tuple; the message names its position.
    """

    __slots__ = ("_b", "_data", "_e", "_k", "_kinds", "_mode", "_n", "_offsets", "_s", "_v")

    _mode: int
    _data: np.ndarray
    _offsets: np.ndarray
    _kinds: np.ndarray
    _b: memoryview
    _s: memoryview
    _e: memoryview
    _k: memoryview
    _v: memoryview[Any]
    _n: int

    def __new__(cls, iterable: Iterable[Any] = ()) -> SharedList:
        if isinstance(iterable, SharedList):
            return iterable
        return _rebuild(*_encode(iterable))

    def __init__(self, iterable: Iterable[Any] = ()) -> None:
        # __new__ did the work (it may return an existing SharedList, which must not change);
        # this is the signature the API reference shows, which it reads from __init__ alone
        pass

    # ------------------------------------------------------------------ reading
    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...
    def __getitem__(self, index: int | slice) -> Any:  # overridden per storage mode
        return self._other(index)

    def _other(self, index: Any) -> Any:
        """The slice `index`, or the error for a bad index."""
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._n))]
        try:
            operator.index(index)
        except TypeError:
            raise TypeError(f"SharedList indices must be integers or slices, not {type(index).__name__}") from None
        raise IndexError("SharedList index out of range")

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[Any]:
        for i in range(self._n):
            yield self[i]

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays."""
        return int(self._data.nbytes + self._offsets.nbytes + self._kinds.nbytes)

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        """The (read-only) numpy arrays that hold the elements."""
        return (self._data, self._offsets, self._kinds)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SharedList):
            if self._n != other._n:
                return False
            if self._mode == other._mode and all(a.tobytes() == b.tobytes() for a, b in zip(self.arrays, other.arrays)):
                return True
        elif isinstance(other, (list, tuple)):
            if self._n != len(other):
                return False
        else:
            return NotImplemented
        return all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        head = ", ".join(repr(self[i]) for i in range(min(self._n, 3)))
        more = ", ..." if self._n > 3 else ""
        return f"SharedList([{head}{more}], len={self._n})"

    # ------------------------------------------------------------------ pickling, copying
    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (self._mode, self._data, self._offsets, self._kinds)

    def __copy__(self) -> SharedList:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> SharedList:
        return self

    # ------------------------------------------------------------------ no writing
    def _read_only(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("SharedList is read-only; build a new one from a list to change it")

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _read_only
    append = extend = insert = pop = remove = clear = sort = reverse = _read_only


class _StrList(SharedList):
    __slots__ = ()

    def __getitem__(self, index: Any) -> Any:
        try:
            return self._b[self._s[index] : self._e[index]].tobytes().decode()
        except (TypeError, IndexError):
            return self._other(index)

    def __iter__(self) -> Iterator[Any]:
        b = self._b
        for a, z in zip(self._s, self._e):
            yield b[a:z].tobytes().decode()


class _BytesList(SharedList):
    __slots__ = ()

    def __getitem__(self, index: Any) -> Any:
        try:
            return self._b[self._s[index] : self._e[index]].tobytes()
        except (TypeError, IndexError):
            return self._other(index)

    def __iter__(self) -> Iterator[Any]:
        b = self._b
        for a, z in zip(self._s, self._e):
            yield b[a:z].tobytes()


class _NumberList(SharedList):
    __slots__ = ()

    def __getitem__(self, index: Any) -> Any:
        try:
            value = self._v[index]
        except (TypeError, IndexError):
            return self._other(index)
        if type(value) is memoryview:  # a slice
            return value.tolist()
        return value

    def __iter__(self) -> Iterator[Any]:
        return iter(self._v)


class _MixedList(SharedList):
    __slots__ = ()

    def __getitem__(self, index: Any) -> Any:
        try:
            raw = self._b[self._s[index] : self._e[index]]
            kind = self._k[index]
        except (TypeError, IndexError):
            return self._other(index)
        if kind == _K_STR:
            return raw.tobytes().decode()
        if kind == _K_BYTES:
            return raw.tobytes()
        return marshal.loads(raw)


_CLASSES: dict[int, type[SharedList]] = {
    _STR: _StrList,
    _BYTES: _BytesList,
    _INT: _NumberList,
    _FLOAT: _NumberList,
    _MIXED: _MixedList,
}
