"""The hooks `stoker.mix` answers (`_base/hooks.py`), asked of the instance: a user's subclass
of `MixedDataset` or `PackedDataset` over `ShardedDataset` sources keeps the downloads ahead
(the shards of batches not yet read are in the cache after the first batch); a dataset whose
`lengths` disagree with its documents is refused when a row is made, naming the document."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoker import DataLoader
from stoker._base.hooks import upcoming_of
from stoker.mix import MixedDataset, PackedDataset, StreamSampler, TokenDataset, collate_packed
from stoker.shards import ShardedDataset, write_shards

SIZES = (80, 60)


class MyMix(MixedDataset):
    """A user's subclass: a method of its own, nothing about downloads."""

    def share_of(self, source: int) -> float:
        return self.proportions(0, len(self))["document_shares"][source]


class MyPacked(PackedDataset):
    """A user's subclass of PackedDataset."""


class Telling(ShardedDataset):
    """A ShardedDataset that records what the loader tells it ahead (and by which process)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.told: list[tuple[int, list[int]]] = []

    def stoker_upcoming(self, indices: list[int], behind: int) -> bool:
        self.told.append((os.getpid(), list(indices)))
        return super().stoker_upcoming(indices, behind)


def tokens(source: int, i: int) -> np.ndarray:
    n = 5 + (i * 37 + source * 11) % 60
    return (np.arange(n, dtype=np.int32) * (i + 1) + source * 1000) % 30_000 + 1


def sources(root: Path, cache: str = "cache") -> list[ShardedDataset]:
    out = []
    for k, size in enumerate(SIZES):
        url = str(root / f"s{k}")
        if not (root / f"s{k}").exists():
            docs = [{"__key__": f"{i:05d}", "tokens.npy": tokens(k, i)} for i in range(size)]
            write_shards(docs, url, shard_bytes=2500, workers=1)
        out.append(ShardedDataset(url, cache_dir=str(root / f"{cache}{k}"), prefetch_shards=4))
    return out


def cached(source: ShardedDataset, shard: int) -> bool:
    return Path(source.cache.path_of(source.index.shards[shard].name)).exists()


def shards_of(mix: MixedDataset, positions: list[int]) -> set[tuple[int, int]]:
    """The (source, shard) pairs the documents at `positions` are read from."""
    out = set()
    for p in positions:
        s, j = mix.source_at(p)
        out.add((s, int(np.searchsorted(mix.sources[s].shard_starts, j, side="right")) - 1))
    return out


def wait_for(condition: Any, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def as_list(batch: list[Any]) -> list[Any]:
    return batch


@pytest.mark.timeout(120)
def test_a_subclass_of_mixed_dataset_keeps_its_downloads_ahead(tmp_path: Path) -> None:
    srcs = sources(tmp_path)
    assert all(len(s.index.shards) >= 10 for s in srcs)
    mix = MyMix(srcs, [0.6, 0.4], field="tokens.npy", window_shards=2, seed=3)
    assert type(mix) is MyMix and upcoming_of(mix) is not None
    loader = DataLoader(mix, batch_size=4, sampler=StreamSampler(mix), collate_fn=as_list, num_workers=0)
    it = iter(loader)
    first = next(it)
    assert [d["tokens.npy"].tolist() for d in first] == [tokens(*mix.source_at(p)).tolist() for p in range(4)]
    # the next batches' shards, which no read has asked for yet, are downloaded ahead
    later = shards_of(mix, list(range(4, 16))) - shards_of(mix, list(range(4)))
    assert later
    assert wait_for(lambda: any(cached(srcs[s], k) for s, k in later)), later
    rest = [d["tokens.npy"].tolist() for batch in it for d in batch]
    assert rest == [tokens(*mix.source_at(p)).tolist() for p in range(4, len(mix))]
    assert 0.5 < mix.share_of(0) < 0.7
    for s in srcs:
        s.close()


@pytest.mark.timeout(120)
def test_a_subclass_of_packed_dataset_passes_its_rows_documents_on_ahead(tmp_path: Path) -> None:
    # packing reads a stream's lengths ahead of the rows (a sharded source has no `lengths`
    # array, so its documents are read), so the evidence here is what the sources are told:
    # in the loader's process, each document of the epoch's rows, in the order of the rows
    srcs = [Telling(s.url, cache_dir=s.cache.directory, prefetch_shards=4) for s in sources(tmp_path)]
    rows = MyPacked(MyMix(srcs, [0.6, 0.4], field="tokens.npy", window_shards=2, seed=3), seq_len=64, window_size=4)
    assert type(rows) is MyPacked and upcoming_of(rows) is not None
    loader = DataLoader(rows, batch_size=2, sampler=StreamSampler(rows), collate_fn=collate_packed, num_workers=2)
    got = [r.tobytes() for batch in loader for r in batch["input_ids"]]
    assert got == [rows[g]["input_ids"].tobytes() for g in range(len(rows))]
    mix = rows.dataset
    needed = [mix.source_at(p) for p in dict.fromkeys(p for g in range(len(rows)) for p, _, _ in rows.pieces(g))]
    for k, src in enumerate(srcs):
        assert {pid for pid, _ in src.told} == {os.getpid()}  # the loader's process, not a worker
        told = [i for _, indices in src.told for i in indices]
        assert list(dict.fromkeys(told)) == list(dict.fromkeys(j for s, j in needed if s == k))
        src.close()


def test_a_lengths_array_shorter_than_a_document_raises_naming_it() -> None:
    docs = [np.arange(1, 1 + n) for n in (5, 9, 3, 7, 4, 6)]
    data = TokenDataset.from_documents(docs)
    data.lengths = data.lengths.copy()
    data.lengths[3] = 2  # document 3 really has 7 tokens
    packed = PackedDataset(data, seq_len=8, window_size=4, window_unit="documents")
    row = next(g for g in range(len(packed)) if any(p == 3 for p, _, _ in packed.pieces(g)))
    with pytest.raises(
        ValueError, match=r"document 3 of the dataset has 7 tokens, but its dataset's `lengths` gives 2"
    ):
        packed[row]
    # through a mix: the message names the mix position, the source and the sample
    mix = MixedDataset([TokenDataset.from_documents(docs), data], [1, 1], seed=1)
    packed = PackedDataset(mix, seq_len=8, window_size=4)
    position = next(p for p in range(len(mix)) if mix.source_at(p) == (1, 3))
    row = next(g for g in range(len(packed)) if any(p == position for p, _, _ in packed.pieces(g)))
    with pytest.raises(
        ValueError,
        match=rf"mix position {position} \(source 1, sample 3\) has 7 tokens, but its dataset's `lengths` gives 2",
    ):
        packed[row]


def test_a_lengths_array_longer_than_a_document_raises_naming_it() -> None:
    data = TokenDataset.from_documents([np.arange(1, 1 + n) for n in (5, 9, 3, 7)])
    data.lengths = data.lengths.copy()
    data.lengths[2] = 6  # document 2 really has 3 tokens
    packed = PackedDataset(data, seq_len=8, window_size=4, window_unit="documents")
    row = next(g for g in range(len(packed)) if any(p == 2 for p, _, _ in packed.pieces(g)))
    with pytest.raises(
        ValueError, match=r"document 2 of the dataset has 3 tokens, but its dataset's `lengths` gives 6"
    ):
        packed[row]
