"""`stoker.ray.DataLoader`: this rank's batches of a map-style dataset read by Ray Data read
tasks, in the sampler's order, with epochs and an exact (and elastic) `state_dict()` resume."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .._base.checks import check_bool, check_int
from .._data.collate import default_collate
from .._data.distributed import DEFAULT_SEED, DistributedSampler
from .._data.samplers import BatchSampler
from .blocks import _BatchRows
from .epoch import _batch_tasks, _sampler, _Units, base_seed_of, read_task_count
from .errors import _describe_type, _explained
from .read import _cluster_cpus, _put_dataset, _ray_dataset

if TYPE_CHECKING:
    import ray.data

STATE_VERSION = 1

# Keys of a state that may differ from this loader's: an elastic resume (see load_state_dict).
ELASTIC_KEYS = ("world_size", "rank", "total_size")


def config_differences(saved: dict[str, Any], current: dict[str, Any], ignore: Sequence[str] = ()) -> list[str]:
    """'key: saved X, this loader Y' for every key (but those ignored) whose values differ."""
    return [
        f"{key}: saved {saved.get(key)!r}, this loader {current[key]!r}"
        for key in current
        if key not in ignore and saved.get(key) != current[key]
    ]


def _resolve_seed(seed: int | None) -> int:
    """The shuffling seed: `seed`, or for None the DistributedSampler's default (the same on
    every rank, with nothing communicated)."""
    if seed is None:
        return DEFAULT_SEED
    return int(check_int("seed", seed, none_ok=True))


class DataLoader:
    """This rank's batches of a map-style dataset, fetched and collated by Ray Data read tasks.

    Rank `rank` of `world_size` gets exactly the batches that `stoker.DistributedSampler(
    dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
    drop_last=drop_last)` with `set_epoch(epoch)` and `stoker.BatchSampler(sampler,
    batch_size, drop_last)` give it: `drop_last` goes to both, as torch users pass it.
    Batches are collated by `collate_fn` (default `stoker.default_collate`: numpy; use
    `stoker.torch.default_collate` for torch tensors) inside the read tasks.

    `seed=None` is the DistributedSampler's default seed, 0, as in torch: every rank must pass
    the same seed, and the constructor communicates nothing. `stoker.sample_rng()` in the
    dataset draws what it draws under `stoker.DataLoader(..., generator=seed,
    persistent_workers=True)` over the same sampler with set_epoch(epoch) = the loader's
    epoch count.

    `in_order=True` delivers the sampler's order; `in_order=False` lets a batch made early
    overtake one made late within the prefetch window, and such a loader is not exactly
    resumable: its `state_dict()` raises ValueError.

    `state_dict()` / `load_state_dict()` resume exactly mid-epoch; a state saved under another
    world size (or rank) resumes elastically: the samples no old rank consumed are split over
    the new ranks (`DistributedSampler.resume_elastic`). Starts Ray (`ray.init()`) if it is
    not running. Iterating raises `ReadError` when the dataset or the collate_fn raised in a
    read task, and `ShippingError` when the dataset cannot be sent to the cluster or
    rebuilt there.

    Args:
        dataset: The map-style dataset (with `__len__` and `__getitem__`); it must pickle,
            and its class must be importable on the Ray workers.
        batch_size: The number of samples in a batch.
        shuffle: Shuffle the samples each epoch from `seed + epoch`. Defaults to False.
        seed: The shuffling seed, the same on every rank, and the base of the per-sample
            seeds (`base_seed_of`); None means 0. Defaults to None.
        rank: This rank, 0 <= rank < world_size. Defaults to 0.
        world_size: The number of ranks. Defaults to 1.
        drop_last: Drop the tail that does not divide evenly over the ranks, and each
            rank's short final batch. Defaults to False.
        collate_fn: Makes a batch of a list of samples, in the read task; None means
            `stoker.default_collate`. Defaults to None.
        prefetch_batches: Ray Data's count of blocks (batches) fetched ahead.
            Defaults to 2.
        in_order: Deliver the batches in the sampler's order. Defaults to True.
        read_tasks: The number of Ray read tasks of an epoch; None chooses one for every
            40 batches and at least one per cluster CPU (`read_task_count`).
            Defaults to None.

    Raises:
        TypeError: when `dataset` has no `__len__` or `__getitem__`, `batch_size`,
            `world_size`, `rank`, `prefetch_batches` or `read_tasks` is not an int (None
            is accepted for `read_tasks` and `seed`), `seed` is not an int, or `shuffle`,
            `drop_last` or `in_order` is not a bool.
        ValueError: when `batch_size` or `world_size` is below 1, `rank` is not in
            [0, world_size - 1], `prefetch_batches` is negative, or `read_tasks` is below 1.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        batch_size: int,
        shuffle: bool = False,
        seed: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        prefetch_batches: int = 2,
        in_order: bool = True,
        read_tasks: int | None = None,
    ) -> None:
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise TypeError(
                f"stoker.ray.DataLoader takes a map-style dataset (with __len__ and __getitem__), "
                f"got {_describe_type(dataset)}"
            )
        self.batch_size = check_int("batch_size", batch_size, low=1)
        self.world_size = check_int("world_size", world_size, low=1)
        rank = check_int("rank", rank, low=0)
        if rank >= world_size:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {world_size - 1}]")
        self.rank = rank
        self.prefetch_batches = check_int("prefetch_batches", prefetch_batches, low=0)
        for name, flag in (("shuffle", shuffle), ("drop_last", drop_last), ("in_order", in_order)):
            check_bool(name, flag)
        if read_tasks is not None:
            read_task_count(1, 1, read_tasks)  # checks the value
        self.dataset = dataset
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.in_order = in_order
        self.read_tasks = read_tasks
        self.collate_fn = default_collate if collate_fn is None else collate_fn
        self.seed = _resolve_seed(seed)
        self.epoch = 0
        self._position = 0  # batches of the current epoch delivered (or skipped by a resume)
        self._elastic: tuple[int, int, int] | None = None  # the current epoch's elastic origin
        self._resumed = False  # a loaded state waits for the next iteration
        self._ref: Any = None
        self._lock = threading.Lock()

    # -------------------------------------------------------------- epochs
    def set_epoch(self, epoch: int) -> None:
        """Set the epoch the next iteration gives (shuffle is seeded with seed + epoch).

        A state loaded for another epoch no longer applies.

        Args:
            epoch: The epoch number, an int >= 0.

        Raises:
            TypeError: when `epoch` is not an int.
            ValueError: when `epoch` is negative.
        """
        epoch = check_int("epoch", epoch, low=0)
        if epoch != self.epoch:  # a loaded state was for another epoch: it no longer applies
            self._position = 0
            self._elastic = None
            self._resumed = False
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        return list(self._batch_sampler())

    def _rank_sampler(self) -> DistributedSampler:
        """This rank's DistributedSampler (at epoch 0)."""
        return _sampler(
            len(self.dataset),
            shuffle=self.shuffle,
            seed=self.seed,
            rank=self.rank,
            world_size=self.world_size,
            drop_last=self.drop_last,
        )

    def _batch_sampler(self) -> BatchSampler:
        """This rank's batches of the current epoch (the rest of an elastic epoch, when one is
        being resumed), as `rank_batches` gives them."""
        sampler = self._rank_sampler()
        sampler.set_epoch(self.epoch)
        if self._elastic is not None:
            sampler.resume_elastic(*self._elastic)
        return BatchSampler(sampler, self.batch_size, self.drop_last)

    def __len__(self) -> int:
        """This rank's batches in the current epoch (the rest of an elastic epoch, when one is
        being resumed)."""
        return len(self._batch_sampler())

    def __iter__(self) -> Iterator[Any]:
        """The current epoch's batches for this rank: all of them, or, right after
        `load_state_dict`, those the saved run had not delivered."""
        resumed, self._resumed = self._resumed, False
        if not resumed:
            self._position = 0
            self._elastic = None
        batches = self._batches()
        start = self._position
        if start >= len(batches):
            return
        if self._ref is None:
            self._ref = _put_dataset(self.dataset)
        units = list(enumerate(batches))[start:]
        tasks = _batch_tasks(units, read_task_count(len(units), _cluster_cpus(), self.read_tasks))
        work = _Units(
            self._ref,
            _describe_type(self.dataset),
            tasks,
            base_seed_of(self.seed),
            self.epoch,
            self.collate_fn,
            False,
            self.rank,
        )
        yield from self._deliver(_ray_dataset(work, self.in_order), start)

    def _deliver(self, dataset: ray.data.Dataset, start: int) -> Iterator[Any]:
        expected = start
        blocks = iter(
            dataset.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=self.prefetch_batches)
        )
        rows = _BatchRows()
        try:
            while True:
                try:
                    table = next(blocks)
                    made = rows.feed(table)
                except StopIteration:
                    made = rows.finish()
                    table = None
                except Exception as exc:
                    explained = _explained(exc)
                    if explained is None:
                        raise
                    raise explained from exc
                for position, batch in made:
                    if self.in_order and position != expected:
                        raise RuntimeError(
                            f"stoker.ray: expected the batch at position {expected}, Ray Data delivered {position}"
                        )
                    expected += 1
                    self._position += 1
                    yield batch
                if table is None:
                    break
        finally:
            close = getattr(blocks, "close", None)
            if close is not None:
                close()

    # -------------------------------------------------------------- state
    def _config(self) -> dict[str, Any]:
        sampler = self._rank_sampler()
        return {
            "dataset_length": len(self.dataset),
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
            "world_size": self.world_size,
            "rank": self.rank,
            "total_size": sampler.total_size,
        }

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: the epoch and the batches of it delivered.

        Returns:
            A dict of plain values (the configuration, epoch and position) for
            `load_state_dict`.

        Raises:
            ValueError: for a loader with `in_order=False` (its delivery order is not the
                sampler's).
        """
        if not self.in_order:
            raise ValueError(
                "stoker.ray.DataLoader(in_order=False) is not exactly resumable: batches made early "
                "may have overtaken others, so a position does not say which were delivered; use "
                "in_order=True to save states"
            )
        return {
            "version": STATE_VERSION,
            "loader": "stoker.ray.DataLoader",
            "config": self._config(),
            "epoch": self.epoch,
            "position": self._position,
            "elastic": list(self._elastic) if self._elastic is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from a `state_dict()`: the next iteration yields exactly the batches that were
        not yet delivered. A state of another world size (or rank) resumes elastically.

        Args:
            state: A dict made by `state_dict()`.

        Raises:
            ValueError: applying nothing, for a state of another kind or version, of
                another configuration (naming what differs), or saved part-way through an
                elastically resumed epoch and loaded under yet another world size or rank.
        """
        if not isinstance(state, dict) or state.get("loader") != "stoker.ray.DataLoader":
            raise ValueError("load_state_dict expects a dict made by stoker.ray.DataLoader.state_dict()")
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"this stoker.ray state has version {state.get('version')!r}; this stoker reads version {STATE_VERSION}"
            )
        saved = dict(state["config"])
        config = self._config()
        ignore: list[str] = list(ELASTIC_KEYS)
        differ = config_differences(saved, config, ignore)
        if differ:
            raise ValueError(
                "this stoker.ray.DataLoader state comes from another configuration and was not applied; "
                + "; ".join(differ)
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        saved_elastic: tuple[int, int, int] | None = None
        if state.get("elastic") is not None:
            consumed, replicas, total = state["elastic"]
            saved_elastic = (int(consumed), int(replicas), int(total))
        elastic = saved_elastic
        if saved["world_size"] != self.world_size or saved["rank"] != self.rank:
            if saved_elastic is not None and position > 0:
                raise ValueError(
                    "this stoker.ray.DataLoader state was saved part-way through an epoch that was "
                    "itself resumed from another world size; it can be resumed with the world size "
                    f"and rank it was saved with (world_size={saved['world_size']}, rank={saved['rank']}), "
                    f"not with world_size={self.world_size}, rank={self.rank}"
                )
            if saved_elastic is None:
                elastic = (
                    position * self.batch_size,
                    int(saved["world_size"]),
                    int(saved["total_size"]),
                )
            position = 0
        self.epoch = epoch
        self._elastic = elastic
        self._position = position
        self._resumed = True

    def close(self) -> None:
        """Release the dataset's copy in Ray's object store (the loader can still iterate: it
        is sent again)."""
        self._ref = None
