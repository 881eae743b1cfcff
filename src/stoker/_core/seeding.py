"""Randomness that depends on what is fetched, not on which worker fetches it.

Two mechanisms, both derived with numpy's `SeedSequence` from the loader's run seed
(`WorkerConfig.draw_seed`: the base seed of the run's first iterator, the same for every
worker and every epoch, see `RandomSource.run_seed`), the loader's epoch number
(`Task.epoch`) and a key, under a constant tag that keeps the kinds apart. Not from each
iterator's own base seed: a persistent iterator draws one for its life and a fresh iterator
one per epoch (as torch's do), and the draws must not depend on which delivers an epoch.

- `sample_seed()` / `sample_rng()`, for a dataset's `__getitem__`: the fetcher opens a
  `FetchScope` for each batch, in the fetching thread, and moves it from sample to sample:

      tag      key                         when
      SAMPLE   the sample's index          map-style, while `dataset[index]` runs
      BATCH    the batch's position        `__getitems__(indices)` of the whole batch, and
               (and rank, if not 0)        the collate_fn (every dataset kind)
      ITEM     (worker id, items drawn)    iterable: while the replica makes its next item;
               (worker id,)                while `iter(dataset)` runs

  Nothing is computed until one of the two is called: the fetcher only updates a few
  attributes of the scope per sample. The scope lives in a `threading.local`, so thread
  workers fetching at once each see their own, and a fetch nested inside another (a
  loader with num_workers=0 iterated inside `__getitem__`) restores the outer scope.

- `seed_each_batch=True` (tag GLOBAL, key the batch's position): `seed_batch_globals`
  seeds a worker process's global RNGs before each batch; in the main process
  (num_workers=0) `seed_main_globals` does the same after saving the caller's states, and
  `restore_globals` puts them back once the batch is fetched, so the training loop's own
  draws are as if no fetch had happened.
"""

from __future__ import annotations

import hashlib
import random
import sys
import threading
from typing import Any

import numpy as np

# Tags: the first entropy word, so that the kinds of seeding never share a stream.
SAMPLE = 0x5354_4B31  # a map-style sample, keyed by its index
BATCH = 0x5354_4B32  # a whole batch (__getitems__, collate_fn), keyed by its position
ITEM = 0x5354_4B33  # an item of an iterable replica, keyed by (worker id, items drawn)
GLOBAL = 0x5354_4B34  # seed_each_batch: the global RNGs, keyed by the batch's position

_WORD = 0xFFFF_FFFF
# Key encodings: a type word, then the value. Every encoding says its own length, so that
# the concatenation of several is never the encoding of another list of keys.
_NONNEGATIVE, _NEGATIVE, _STR, _BYTES, _TUPLE = range(5)


def _encode(key: Any, out: list[int]) -> None:
    """Append `key` to `out` as 32-bit words, prefix-free."""
    if isinstance(key, (str, bytes)):
        data = key.encode("utf-8", "surrogatepass") if isinstance(key, str) else key
        out.append(_STR if isinstance(key, str) else _BYTES)
        digest = hashlib.blake2b(data, digest_size=16).digest()
        out.extend(int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4))
        return
    if isinstance(key, tuple):
        out.append(_TUPLE)
        out.append(len(key))
        for part in key:
            _encode(part, out)
        return
    try:
        n = key.__index__()  # int, bool, numpy integers
    except (AttributeError, TypeError):
        raise TypeError(
            "stoker.sample_seed() and stoker.sample_rng() derive the seed from the sample's index, "
            f"which should be an int, str, bytes or a tuple of those, but got {type(key).__name__} ({key!r:.60})"
        ) from None
    out.append(_NEGATIVE if n < 0 else _NONNEGATIVE)
    n = abs(n)
    words = []
    while n:
        words.append(n & _WORD)
        n >>= 32
    out.append(len(words))
    out.extend(words)


def seed_sequence(tag: int, base_seed: int, epoch: int, key: Any) -> np.random.SeedSequence:
    """The SeedSequence of (tag, base seed, epoch, key)."""
    words = [tag]
    _encode(base_seed, words)
    _encode(epoch, words)
    _encode(key, words)
    return np.random.SeedSequence(np.array(words, dtype=np.uint32))


def batch_key(batch: int, rank: int) -> Any:
    """The BATCH key of batch position `batch` on training rank `rank`: ranks share the base
    seed and count their batches alike, and their batch-level draws must not repeat each
    other's (rank 0 keeps the plain position)."""
    return batch if rank == 0 else (batch, rank)


class FetchScope:
    """What the current sample's randomness derives from; one per batch fetched.

    The fetcher moves it from sample to sample with `at(tag, key)`, or, in its per-sample
    loop, by setting `key` and clearing `made` (two stores: the cheapest way to move). The
    SeedSequence and the Generator are made only when `sample_seed()` or `sample_rng()` asks.
    """

    __slots__ = ("base_seed", "epoch", "key", "made", "tag")

    def __init__(self, base_seed: int, epoch: int, tag: int = BATCH, key: Any = 0) -> None:
        self.base_seed = base_seed
        self.epoch = epoch
        self.tag = tag
        self.key = key
        # (SeedSequence, Generator or None) of the current key, once asked for
        self.made: tuple[np.random.SeedSequence, np.random.Generator | None] | None = None

    def at(self, tag: int, key: Any) -> None:
        """Move to another sample (or to the batch, or an iterable's next item)."""
        self.tag = tag
        self.key = key
        self.made = None

    def sequence(self) -> np.random.SeedSequence:
        made = self.made
        if made is None:
            sequence = seed_sequence(self.tag, self.base_seed, self.epoch, self.key)
            self.made = (sequence, None)
            return sequence
        return made[0]

    def seed(self) -> int:
        return int(self.sequence().generate_state(1, np.uint64)[0])

    def rng(self) -> np.random.Generator:
        made = self.made
        if made is not None and made[1] is not None:
            return made[1]
        sequence = self.sequence()
        rng = np.random.Generator(np.random.PCG64(sequence))
        self.made = (sequence, rng)
        return rng


_local = threading.local()


def enter(scope: FetchScope) -> FetchScope | None:
    """Make `scope` this thread's current one; returns the one it replaces (for `leave`)."""
    previous: FetchScope | None = getattr(_local, "scope", None)
    _local.scope = scope
    return previous


def leave(previous: FetchScope | None) -> None:
    """End the current scope, going back to `previous` (None outside any fetch)."""
    _local.scope = previous


def current_scope() -> FetchScope | None:
    """This thread's current scope, or None outside a fetch."""
    scope: FetchScope | None = getattr(_local, "scope", None)
    return scope


def _scope(name: str) -> FetchScope:
    scope: FetchScope | None = getattr(_local, "scope", None)
    if scope is None:
        raise RuntimeError(
            f"stoker.{name}() can only be called while a stoker DataLoader fetches a batch: inside "
            "the dataset's __getitem__ or __getitems__, an IterableDataset's iterator, or the "
            "collate_fn, in the thread that fetches (any worker kind, or num_workers=0). It is "
            "derived from the loader's base seed, the epoch and the sample, so it has no value "
            "outside a fetch (nor in worker_init_fn); there, use get_worker_info().seed"
        )
    return scope


def sample_seed() -> int:
    """A 64-bit seed (0 <= seed < 2**64) for the sample being fetched.

    Derived from (the loader's run seed, the epoch, the sample's index): the same sample
    in the same epoch gets the same seed whichever worker fetches it, whatever
    `num_workers` is and whether the workers are persistent. The run seed is the base seed
    of the loader's first iterator (drawn from its `generator`, or the global RNG, as torch
    draws it), kept for later epochs and in the loader's `state_dict()`. With `__getitems__`,
    and in the collate_fn, it is the batch's seed (run seed, epoch, batch position); in an
    IterableDataset, the item's (run seed, epoch, worker id, number of items the replica drew
    before it). Calling it again for the same sample returns the same seed.

    Returns:
        The seed, an int in [0, 2**64).

    Raises:
        RuntimeError: when called outside a fetch (outside `__getitem__`, `__getitems__`,
            an IterableDataset's iteration or the collate_fn), e.g. in `worker_init_fn`:
            use `get_worker_info().seed` there.
    """
    return _scope("sample_seed").seed()


def sample_rng() -> np.random.Generator:
    """A numpy Generator for the sample being fetched, seeded as `sample_seed()` describes.

    Calls within one sample return the same Generator, so its stream continues rather
    than restarting.

    Returns:
        A `numpy.random.Generator` (PCG64) for the sample being fetched.

    Raises:
        RuntimeError: when called outside a fetch (outside `__getitem__`, `__getitems__`,
            an IterableDataset's iteration or the collate_fn).
    """
    return _scope("sample_rng").rng()


# ------------------------------------------------------------------ seed_each_batch


def _global_seeds(base_seed: int, epoch: int, batch: int, rank: int = 0) -> tuple[int, np.ndarray, int]:
    """(Python's seed, numpy's seed words, torch's seed) for one batch of one rank (ranks
    share the base seed; their augmentations must not repeat each other's)."""
    key = batch if rank == 0 else (batch, rank)
    state = seed_sequence(GLOBAL, base_seed, epoch, key).generate_state(5, np.uint64)
    return int(state[0]) | int(state[1]) << 64, state[2:4].view(np.uint32), int(state[4])


def seed_batch_globals(base_seed: int, epoch: int, batch: int, rank: int = 0) -> None:
    """Seed a worker process's global RNGs for one batch: Python's `random`, numpy's
    global RNG and, if torch is imported, torch's CPU generator (and CUDA's, if this
    process initialised CUDA)."""
    py_seed, np_seed, torch_seed = _global_seeds(base_seed, epoch, batch, rank)
    random.seed(py_seed)
    np.random.seed(np_seed)
    torch = sys.modules.get("torch")
    generator = getattr(torch, "default_generator", None)
    if generator is not None:
        generator.manual_seed(torch_seed)
        cuda = getattr(torch, "cuda", None)
        if cuda is not None and cuda.is_initialized():
            cuda.manual_seed_all(torch_seed)


Saved = tuple[Any, Any, Any, Any]  # (random's state, numpy's state, torch's generator, its state)


def seed_main_globals(base_seed: int, epoch: int, batch: int, rank: int = 0) -> Saved:
    """In the main process (num_workers=0): save the global RNGs' states, then seed them
    for one batch as a worker process would (torch: the CPU generator only; the CUDA
    generators belong to the training loop and are left alone). Pass the result to
    `restore_globals` once the batch is fetched, whether or not the fetch raised."""
    torch = sys.modules.get("torch")
    generator = getattr(torch, "default_generator", None)
    saved = (
        random.getstate(),
        np.random.get_state(),
        generator,
        generator.get_state() if generator is not None else None,
    )
    py_seed, np_seed, torch_seed = _global_seeds(base_seed, epoch, batch, rank)
    random.seed(py_seed)
    np.random.seed(np_seed)
    if generator is not None:
        generator.manual_seed(torch_seed)
    return saved


def restore_globals(saved: Saved) -> None:
    """Put back the states `seed_main_globals` saved."""
    py_state, np_state, generator, torch_state = saved
    random.setstate(py_state)
    np.random.set_state(np_state)
    if generator is not None:
        generator.set_state(torch_state)
