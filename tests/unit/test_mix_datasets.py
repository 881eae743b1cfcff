"""stoker.mix: token documents, the weighted mix, packed rows and the stream sampler, with
stoker's loader (workers, resume on another world size, refused foreign states)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

import stoker
from stoker._base.hooks import upcoming_of
from stoker.mix import (
    DocumentError,
    MixedDataset,
    PackedDataset,
    StreamSampler,
    TokenDataset,
    collate_packed,
)


def corpus(counts: tuple[int, ...] = (300, 200, 100), seed: int = 0, top: int = 900) -> list[TokenDataset]:
    rng = np.random.default_rng(seed)
    return [
        TokenDataset.from_documents([rng.integers(1, 30_000, rng.integers(1, top)) for _ in range(n)]) for n in counts
    ]


# -- TokenDataset -----------------------------------------------------------------------------


def test_token_dataset_holds_documents_as_views_with_lengths() -> None:
    docs = [np.array([5, 6, 7]), np.array([], dtype=np.int64), [1, 2]]
    ds = TokenDataset.from_documents(docs)
    assert len(ds) == 3
    assert ds.tokens.dtype == np.uint16
    assert ds[0].tolist() == [5, 6, 7] and ds[1].tolist() == [] and ds[2].tolist() == [1, 2]
    assert ds[-1].tolist() == [1, 2]
    assert ds.lengths.tolist() == [3, 0, 2]
    assert np.shares_memory(ds[0], ds.tokens)
    with pytest.raises(IndexError, match="document 3 is out of range"):
        ds[3]


def test_token_dataset_bad_input_names_the_argument() -> None:
    with pytest.raises(TypeError, match="tokens should be a 1-D integer numpy array, but got an array of shape"):
        TokenDataset(np.zeros(3, np.float32), np.array([0, 3]))
    with pytest.raises(ValueError, match=r"offsets should start at 0 and end at len\(tokens\) = 4, but got 0 \.\.\. 3"):
        TokenDataset(np.arange(4), np.array([0, 3]))
    with pytest.raises(ValueError, match="offsets should not decrease, but got a decrease at entry 2"):
        TokenDataset(np.arange(4), np.array([0, 3, 2, 4]))
    with pytest.raises(DocumentError, match="document 1 has shape"):
        TokenDataset.from_documents([np.arange(3), np.zeros((2, 2), np.int64)])
    with pytest.raises(DocumentError, match="document 0 is a str"):
        TokenDataset.from_documents(["abc"])


# -- MixedDataset -----------------------------------------------------------------------------


def test_mix_gives_exact_proportions_and_each_source_its_shuffled_pass() -> None:
    a, b = (
        TokenDataset.from_documents([[i] for i in range(300)]),
        TokenDataset.from_documents([[1000 + i] for i in range(100)]),
    )
    mix = MixedDataset([a, b], [0.75, 0.25], seed=5)
    sources, samples = mix.sources_block(0, 1000)
    assert np.bincount(sources).tolist() == [750, 250]
    # every window of 4 positions holds 3 of a and 1 of b (the bound for two sources is 1)
    assert mix.max_deviation(0, 1000, window=4) <= 1.0
    assert mix.max_deviation(0, 1000, window=1000) == 0.0
    # the first 300 draws of source 0 are one shuffled pass over it, and then a new one
    firsts = samples[sources == 0]
    assert sorted(firsts[:300].tolist()) == list(range(300))
    assert firsts[:300].tolist() != list(range(300))
    assert sorted(firsts[300:600].tolist()) == list(range(300))
    assert firsts[300:600].tolist() != firsts[:300].tolist()
    # the item at a position is the source's sample, and the vectorised block agrees
    for p in (0, 1, 17, 999):
        s, j = mix.source_at(p)
        assert (s, j) == (sources[p], samples[p])
        assert mix[p].tolist() == [a, b][s][j].tolist()


def test_mix_is_a_function_of_its_arguments_and_seed() -> None:
    srcs = corpus()
    one = MixedDataset(srcs, [2, 1, 1], seed=1).sources_block(0, 2000)
    again = MixedDataset(srcs, [2, 1, 1], seed=1).sources_block(0, 2000)
    other = MixedDataset(srcs, [2, 1, 1], seed=2).sources_block(0, 2000)
    assert all(np.array_equal(x, y) for x, y in zip(one, again))
    assert np.array_equal(one[0], other[0]) and not np.array_equal(one[1], other[1])


def test_schedule_changes_the_weights_at_its_positions() -> None:
    mix = MixedDataset(corpus(), [(0, [1, 0, 0]), (100, [0, 1, 1]), (300, [1, 1, 2])])
    s, _ = mix.sources_block(0, 700)
    assert set(s[:100].tolist()) == {0}
    assert np.bincount(s[100:300], minlength=3).tolist() == [0, 100, 100]
    assert np.bincount(s[300:700], minlength=3).tolist() == [100, 100, 200]
    assert mix.weights_at(150) == [0.0, 0.5, 0.5]


def test_token_weights_follow_token_shares() -> None:
    rng = np.random.default_rng(3)
    short = TokenDataset.from_documents([rng.integers(1, 9, rng.integers(10, 30)) for _ in range(400)])
    long = TokenDataset.from_documents([rng.integers(1, 9, rng.integers(200, 400)) for _ in range(400)])
    by_tokens = MixedDataset([short, long], [0.5, 0.5], weigh="tokens")
    got = by_tokens.proportions(0, 20_000)
    assert got["token_shares"] == pytest.approx([0.5, 0.5], abs=0.01)
    assert got["document_shares"][0] > 0.9  # short documents are drawn far more often
    by_docs = MixedDataset([short, long], [0.5, 0.5]).proportions(0, 20_000)
    assert by_docs["document_shares"] == [0.5, 0.5]
    # given totals are used as they are (no document read)
    given = MixedDataset(
        [short, long], [0.5, 0.5], weigh="tokens", tokens=[int(short.lengths.sum()), int(long.lengths.sum())]
    )
    assert np.array_equal(given.sources_block(0, 500)[0], by_tokens.sources_block(0, 500)[0])


def test_exhausted_modes_end_epochs_and_start_new_mixes() -> None:
    a = TokenDataset.from_documents([[i] for i in range(30)])
    b = TokenDataset.from_documents([[100 + i] for i in range(10)])
    end = MixedDataset([a, b], [1, 1], exhausted="end")
    assert len(end) == 21  # a, b alternate: position 21 would be b's 11th draw
    stop = MixedDataset([a, b], [1, 1], exhausted="stop")
    assert len(stop) == 40  # b leaves after its pass, a goes on alone to the end of its own
    s, j = stop.sources_block(0, 40)
    assert sorted(j[s == 0].tolist()) == list(range(30)) and sorted(j[s == 1].tolist()) == list(range(10))
    # epoch 1 is a new mix: the same counts, another order
    s1, j1 = stop.sources_block(40, 80)
    assert np.array_equal(s1, s) and not np.array_equal(j1, j)
    repeat = MixedDataset([a, b], [1, 1])
    assert len(repeat) == 40
    assert len(MixedDataset([a, b], [1, 1], length=7)) == 7


@pytest.mark.parametrize(
    ("weights", "message", "error"),
    [
        ([1, -1, 1], r"weights\[1\] should be a finite number >= 0, but got weights\[1\]=-1", ValueError),
        ([0, 0, 0], "weights should have a positive entry, but got all zero", ValueError),
        ([1, 1], r"weights should have one entry per source \(3\), but got 2 entries", ValueError),
        ([1, float("nan"), 1], r"weights\[1\] should be a finite number >= 0, but got weights\[1\]=nan", ValueError),
        ([1, "x", 1], r"weights\[1\] should be a finite number >= 0, but got weights\[1\]='x'", TypeError),
        (
            [(0, [1, 1, 1]), (0, [1, 2, 1])],
            r"starts should be 0 then strictly increasing, but got \[0, 0\]",
            ValueError,
        ),
        (
            [(0, [1, 1, 1]), (10, [1, 1])],
            r"weights should have one entry per source \(3\), but got 2 entries",
            ValueError,
        ),
    ],
)
def test_bad_weights_are_refused_naming_them(weights: list[object], message: str, error: type[Exception]) -> None:
    with pytest.raises(error, match=message):
        MixedDataset(corpus(), weights)


def test_bad_mix_arguments_are_refused() -> None:
    srcs = corpus()
    with pytest.raises(ValueError, match=r"weigh should be 'documents' or 'tokens', but got weigh='bytes'"):
        MixedDataset(srcs, [1, 1, 1], weigh="bytes")
    with pytest.raises(ValueError, match=r"exhausted should be 'repeat', 'stop' or 'end', but got exhausted='loop'"):
        MixedDataset(srcs, [1, 1, 1], exhausted="loop")
    with pytest.raises(ValueError, match="seed should be an int >= 0, but got seed=-1"):
        MixedDataset(srcs, [1, 1, 1], seed=-1)
    with pytest.raises(TypeError, match=r"seed should be an int >= 0, but got seed=1\.5"):
        MixedDataset(srcs, [1, 1, 1], seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sources should be a non-empty list of datasets, but got an empty one"):
        MixedDataset([], [])
    with pytest.raises(TypeError, match="sources should be a list of datasets, but got a str"):
        MixedDataset("abc", [1, 1, 1])
    with pytest.raises(TypeError, match=r"sources\[1\] should be a map-style dataset .*, but got int"):
        MixedDataset([srcs[0], 5], [1, 1])
    with pytest.raises(TypeError, match="window_shards should be an int >= 1, but got window_shards='4'"):
        MixedDataset(srcs, [1, 1, 1], window_shards="4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window_shards should be an int >= 1, but got window_shards=0"):
        MixedDataset(srcs, [1, 1, 1], window_shards=0)
    with pytest.raises(ValueError, match="source 1 is empty but has a positive weight"):
        MixedDataset([srcs[0], TokenDataset.from_documents([])], [1, 1])
    with pytest.raises(ValueError, match=r"length should be at most the mix's \d+ positions, but got length=999"):
        MixedDataset(srcs, [1, 1, 1], exhausted="end", length=999)
    with pytest.raises(TypeError, match="length should be an int >= 1 or None, but got length='9'"):
        MixedDataset(srcs, [1, 1, 1], exhausted="end", length="9")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="length should be an int >= 1 or None, but got length=0"):
        MixedDataset(srcs, [1, 1, 1], length=0)
    with pytest.raises(ValueError, match=r"tokens should have one entry per source \(3\), but got 2 entries"):
        MixedDataset(srcs, [1, 1, 1], weigh="tokens", tokens=[5, 5])
    with pytest.raises(IndexError, match="position -1 is negative"):
        MixedDataset(srcs, [1, 1, 1])[-1]


def test_token_weights_over_a_bad_document_name_the_source_and_index() -> None:
    good = TokenDataset.from_documents([[1, 2, 3]] * 5)
    bad = [np.arange(3), np.arange(4), np.ones(3, np.float32)]
    with pytest.raises(DocumentError, match="document 2 of source 1 has shape"):
        MixedDataset([good, bad], [1, 1], weigh="tokens")


# -- PackedDataset ----------------------------------------------------------------------------


def rows_of(packed: PackedDataset, count: int) -> list[dict[str, object]]:
    return [packed[g] for g in range(count)]


def test_packed_rows_hold_every_document_once_and_split_only_long_ones() -> None:
    docs = TokenDataset.from_documents(corpus((120,), top=1500)[0][i] for i in range(120))
    packed = PackedDataset(docs, seq_len=1024, window_size=40, method="best_fit", window_unit="documents")
    assert len(packed) == packed._cum[3]  # the rows of the first 3 windows
    pieces: dict[int, list[tuple[int, int]]] = {}
    for g in range(len(packed)):
        row = packed[g]
        ids, cu = row["input_ids"], row["cu_seqlens"]
        assert ids.shape == (1024,) and cu.dtype == np.int32
        for (p, s, e), a, b in zip(packed.pieces(g), cu[:-1], cu[1:]):
            assert np.array_equal(ids[a:b], docs[p][s:e])
            assert np.array_equal(row["position_ids"][a:b], np.arange(e - s))
            assert row["labels"][a] == -100 and np.array_equal(row["labels"][a + 1 : b], ids[a + 1 : b])
            pieces.setdefault(p, []).append((s, e))
        assert (row["labels"][cu[-1] :] == -100).all() and (row["segment_ids"][cu[-1] :] == 0).all()
        assert row["max_seqlen"] == int(np.diff(cu).max())
    assert sorted(pieces) == [p for p in range(120) if docs.lengths[p]]
    for p, parts in pieces.items():
        parts.sort()
        assert parts[0][0] == 0 and parts[-1][1] == docs.lengths[p]
        assert all(x[1] == y[0] for x, y in itertools.pairwise(parts))
        if docs.lengths[p] <= 1024:
            assert len(parts) == 1
    assert packed.utilisation() > 0.9


def test_long_documents_dropped_when_asked() -> None:
    docs = TokenDataset.from_documents([np.arange(1, 50), np.arange(1, 300), np.arange(1, 20)])
    packed = PackedDataset(docs, seq_len=100, window_size=3, long="drop")
    kept = {p for g in range(len(packed)) for p, _, _ in packed.pieces(g)}
    assert kept == {0, 2}


def test_packed_stream_is_the_same_in_any_access_order_and_process() -> None:
    mix = MixedDataset(corpus(), [(0, [0.5, 0.3, 0.2]), (500, [0.2, 0.3, 0.5])], weigh="tokens", seed=4)
    one = PackedDataset(mix, seq_len=512, window_size=64)
    order = np.random.default_rng(0).permutation(3 * len(one)).tolist()
    other = PackedDataset(
        MixedDataset(corpus(), [(0, [0.5, 0.3, 0.2]), (500, [0.2, 0.3, 0.5])], weigh="tokens", seed=4),
        seq_len=512,
        window_size=64,
        rows_per_epoch=5,
    )
    got = {g: other[g]["input_ids"] for g in order}  # random access from a fresh table
    for g in range(3 * len(one)):
        assert np.array_equal(one[g]["input_ids"], got[g])


def test_greedy_and_best_fit_differ_and_best_fit_packs_tighter() -> None:
    mix = MixedDataset(corpus(top=2000), [1, 1, 1])
    best = PackedDataset(mix, seq_len=2048, window_size=256, method="best_fit", rows_per_epoch=50)
    greedy = PackedDataset(mix, seq_len=2048, window_size=256, method="greedy", rows_per_epoch=50)
    best.locate(400), greedy.locate(400)
    assert best.utilisation() >= greedy.utilisation()
    assert best.utilisation() > 0.95


def test_a_bad_document_names_its_source_and_index_when_packed() -> None:
    good = TokenDataset.from_documents([[1, 2, 3]] * 20)

    class Broken(stoker.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 20

        def __getitem__(self, i: int) -> object:
            return np.arange(3, dtype=np.float64) if i == 7 else np.arange(3)

    class Measured(Broken):
        lengths = np.full(20, 3, dtype=np.int64)  # fetching reads these, not the documents

    # measured for fetching: the bad document is found then
    with pytest.raises(DocumentError, match=r"document 7 of source 1 has shape \(3,\) and dtype float64"):
        PackedDataset(MixedDataset([good, Broken()], [1, 1]), seq_len=16, window_size=8)
    with pytest.raises(DocumentError, match="document 7 of dataset has shape"):
        PackedDataset(Broken(), seq_len=16, window_size=8)
    # lengths known: the bad document is found when its row is made, named by position and source
    mix = MixedDataset([good, Measured()], [1, 1])
    packed = PackedDataset(mix, seq_len=16, window_size=8)
    position = next(p for p in range(40) if mix.source_at(p) == (1, 7))
    row = next(g for g in range(len(packed)) if any(p == position for p, _, _ in packed.pieces(g)))
    with pytest.raises(DocumentError, match=rf"mix position {position} \(source 1, sample 7\) has shape"):
        packed[row]
    assert packed[0]["input_ids"].dtype == np.int64


def test_packed_arguments_are_checked() -> None:
    docs = corpus((10,))[0]
    with pytest.raises(TypeError, match=r"seq_len should be an int >= 1, but got seq_len=2\.5"):
        PackedDataset(docs, seq_len=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seq_len should be an int >= 1, but got seq_len=0"):
        PackedDataset(docs, seq_len=0)
    with pytest.raises(ValueError, match="window_size should be an int >= 1, but got window_size=0"):
        PackedDataset(docs, seq_len=8, window_size=0)
    with pytest.raises(ValueError, match=r"method should be 'greedy' or 'best_fit', but got method='worst_fit'"):
        PackedDataset(docs, seq_len=8, method="worst_fit")
    with pytest.raises(ValueError, match=r"long should be 'split' or 'drop', but got long='truncate'"):
        PackedDataset(docs, seq_len=8, long="truncate")
    with pytest.raises(TypeError, match="field should be a str or None, but got field=3"):
        PackedDataset(docs, seq_len=8, field=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rows_per_epoch should be an int >= 1, but got rows_per_epoch=0"):
        PackedDataset(docs, seq_len=8, rows_per_epoch=0)
    with pytest.raises(ValueError, match="no documents"):
        PackedDataset(TokenDataset.from_documents([]), seq_len=8, rows_per_epoch=3)


def test_collate_packed_flattens_with_contiguous_boundaries() -> None:
    docs = TokenDataset.from_documents([np.arange(1, 6), np.arange(1, 4), np.arange(1, 9)])
    packed = PackedDataset(docs, seq_len=10, window_size=3, method="greedy")
    batch = collate_packed([packed[0], packed[1]])
    assert batch["input_ids"].shape == (2, 10)
    # row 0: documents 0 (5) and 1 (3) then 2 pad; row 1: document 2 (8) then 2 pad
    assert batch["cu_seqlens"].tolist() == [0, 5, 8, 10, 18, 20]
    assert batch["cu_seqlens"].dtype == np.int32 and batch["max_seqlen"] == 8
    with pytest.raises(ValueError, match="at least one row"):
        collate_packed([])


def test_tensors_come_as_torch_and_collate_keeps_them() -> None:
    torch = pytest.importorskip("torch")
    docs = TokenDataset.from_documents([np.arange(1, 6), np.arange(1, 4)])
    packed = PackedDataset(docs, seq_len=10, window_size=2, tensors=True)
    row = packed[0]
    assert isinstance(row["input_ids"], torch.Tensor) and row["cu_seqlens"].dtype == torch.int32
    batch = collate_packed([row, row])
    assert isinstance(batch["cu_seqlens"], torch.Tensor) and batch["input_ids"].shape == (2, 10)


# -- with the loader ---------------------------------------------------------------------------


def make(schedule_start: int = 500, world: int = 1, rank: int = 0, workers: int = 0) -> stoker.DataLoader:
    mix = MixedDataset(corpus(), [(0, [0.5, 0.3, 0.2]), (schedule_start, [0.2, 0.3, 0.5])], weigh="tokens", seed=4)
    rows = PackedDataset(mix, seq_len=512, window_size=64)
    sampler = StreamSampler(rows, num_replicas=world, rank=rank, drop_last=True)
    return stoker.DataLoader(rows, batch_size=4, sampler=sampler, collate_fn=collate_packed, num_workers=workers)


def ids(batches: list[dict[str, np.ndarray]]) -> list[bytes]:
    return [row.tobytes() for b in batches for row in b["input_ids"]]


def test_stream_sampler_walks_epochs_and_splits_ranks() -> None:
    loader = make()
    rows = loader.dataset
    epoch0 = [list(b) for b in loader.batch_sampler]
    loader.sampler.set_epoch(1)
    epoch1 = [list(b) for b in loader.batch_sampler]
    n = len(rows)
    assert [g for b in epoch0 for g in b] == list(range(n))
    assert [g for b in epoch1 for g in b][0] == n
    split = [list(StreamSampler(rows, num_replicas=3, rank=r)) for r in range(3)]
    interleaved = [g for group in zip(*split) for g in group]
    assert interleaved[:n] == list(range(n))


@pytest.mark.timeout(120)
def test_workers_give_the_rows_of_the_main_process() -> None:
    serial = ids(list(make(workers=0)))
    assert ids(list(make(workers=2))) == serial
    rows = make().dataset
    assert serial == [rows[g]["input_ids"].tobytes() for g in range(len(serial))]


@pytest.mark.timeout(120)
def test_resume_on_another_world_size_continues_the_global_rows() -> None:
    reference = ids(list(make()))
    states = []
    taken: list[list[bytes]] = []
    for r in range(4):
        loader = make(world=4, rank=r, workers=1)
        it = iter(loader)
        taken.append(ids([next(it) for _ in range(5)]))
        states.append(json.loads(json.dumps(loader.state_dict())))
        del it
    killed = [x for group in zip(*[[t[i : i + 1] for i in range(0, len(t))] for t in taken]) for y in group for x in y]
    assert killed == reference[: 5 * 4 * 4]
    resumed = []
    for r in range(2):
        loader = make(world=2, rank=r, workers=2)
        loader.load_state_dict(states[0])
        resumed.append(ids(list(loader)))
    rest = [x for group in zip(*resumed) for x in group]
    assert killed + rest == reference[: len(killed) + len(rest)]
    assert len(killed) + len(rest) >= len(reference) - 8


def test_a_state_of_another_mix_is_refused_saying_what_differs() -> None:
    loader = make()
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    other = make(schedule_start=600)
    with pytest.raises(ValueError, match=r"stream.mix.schedule_starts: saved \[0, 500\], this loader \[0, 600\]"):
        other.load_state_dict(state)
    first = next(iter(other))  # nothing was applied: the other loader starts at its beginning
    assert first["input_ids"][0].tobytes() == other.dataset[0]["input_ids"].tobytes()


def test_doctor_lines_report_shares_and_utilisation() -> None:
    from stoker._doctor.sweep import stream_lines

    rows = make().dataset
    lines = stream_lines(rows)
    assert lines[0].startswith("packing: best_fit, seq_len 512, 64 rows a window")
    assert "utilisation 0.9" in lines[0]
    assert lines[1].startswith("mix: 3 sources, weighed by tokens")
    assert stream_lines(object()) == []


@pytest.mark.timeout(120)
def test_thread_and_spawn_workers_give_the_rows_of_the_main_process() -> None:
    serial = ids(list(make(workers=0)))
    loader = make()
    threads = stoker.DataLoader(
        loader.dataset, batch_size=4, sampler=loader.sampler, collate_fn=collate_packed, num_workers=2, thread_pool=True
    )
    assert ids(list(threads)) == serial
    fresh = make()  # pickled into a spawned worker (its lock is not: a new one is made there)
    spawned = stoker.DataLoader(
        fresh.dataset,
        batch_size=4,
        sampler=fresh.sampler,
        collate_fn=collate_packed,
        num_workers=1,
        multiprocessing_context="spawn",
    )
    assert ids(list(spawned)) == serial


def test_a_stream_that_packs_into_no_rows_is_an_error_not_a_hang() -> None:
    empty = TokenDataset.from_documents([np.zeros(0, np.int64)] * 10)
    with pytest.raises(ValueError, match="the first 10 documents pack into no rows: every one is empty"):
        PackedDataset(empty, seq_len=8, window_size=4)
    packed = PackedDataset(empty, seq_len=8, window_size=4, rows_per_epoch=5)
    with pytest.raises(ValueError, match="row 0 is past the end of the packed stream"):
        packed[0]
    long = TokenDataset.from_documents([np.arange(1, 20)] * 10)
    with pytest.raises(ValueError, match=r"or longer than seq_len 8 \(long='drop'\)"):
        PackedDataset(long, seq_len=8, window_size=4, long="drop")


class _KillsOnce(TokenDataset):
    """A source whose worker is SIGKILLed the first time it reads document 5 (a flag file
    says it happened, so the restarted worker reads on)."""

    flag = ""

    def __getitem__(self, index: int) -> np.ndarray:
        import os
        import signal

        if index == 5 and not os.path.exists(self.flag):
            open(self.flag, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(index)


@pytest.mark.timeout(120)
def test_a_killed_worker_is_replaced_and_the_rows_are_the_same(tmp_path: object) -> None:
    srcs = corpus()
    killer = _KillsOnce(srcs[1].tokens, srcs[1].offsets)
    killer.flag = str(tmp_path) + "/killed"

    def loader(sources: list[TokenDataset], workers: int) -> stoker.DataLoader:
        mix = MixedDataset(sources, [0.5, 0.3, 0.2], seed=2)
        rows = PackedDataset(mix, seq_len=512, window_size=64)
        return stoker.DataLoader(
            rows,
            batch_size=4,
            sampler=StreamSampler(rows),
            collate_fn=collate_packed,
            num_workers=workers,
            max_worker_restarts=2,
        )

    expected = ids(list(loader(srcs, 0)))
    with pytest.warns(stoker.WorkerRestartWarning, match="killed by signal SIGKILL"):
        assert ids(list(loader([srcs[0], killer, srcs[2]], 2))) == expected


def test_hugging_face_rows_are_documents_through_field() -> None:
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(5)
    docs = [[rng.integers(1, 500, rng.integers(3, 90)).tolist() for _ in range(n)] for n in (40, 25)]
    hf = [datasets.Dataset.from_dict({"input_ids": d, "text": ["x"] * len(d)}) for d in docs]
    arrays = [TokenDataset.from_documents(d) for d in docs]
    mix = MixedDataset(hf, [0.7, 0.3], weigh="tokens", field="input_ids", seed=1)
    reference = MixedDataset(arrays, [0.7, 0.3], weigh="tokens", seed=1)
    assert np.array_equal(mix.sources_block(0, 300)[0], reference.sources_block(0, 300)[0])
    assert isinstance(mix[0], dict)  # the sample as the source gives it
    packed = PackedDataset(mix, seq_len=128, window_size=16)
    plain = PackedDataset(reference, seq_len=128, window_size=16)
    assert len(packed) == len(plain)
    for g in range(len(packed)):
        assert np.array_equal(packed[g]["input_ids"], plain[g]["input_ids"])
    with pytest.raises(ValueError, match="field should be the mix's field 'input_ids' or None, but got field='ids'"):
        PackedDataset(mix, seq_len=128, field="ids")
    with pytest.raises(
        DocumentError, match=r"document 0 of dataset is a dict without the field 'ids' \(keys \['input_ids', 'text'\]\)"
    ):
        PackedDataset(hf[0], seq_len=128, field="ids")
    direct = PackedDataset(hf[0], seq_len=128, window_size=16, field="input_ids")
    assert direct[0]["input_ids"][:3].tolist() == docs[0][direct.pieces(0)[0][0]][:3]


class _Fetching(TokenDataset):
    """A source that fetches ahead (`stoker_upcoming`): it records what it is told."""

    def __init__(self, source: TokenDataset) -> None:
        super().__init__(source.tokens, source.offsets)
        self.told: list[int] = []

    def stoker_upcoming(self, indices: list[int], behind: int) -> bool:
        self.told.extend(indices)
        return True


class _MyMix(MixedDataset):
    """A user's subclass of MixedDataset."""


class _MyPacked(PackedDataset):
    """A user's subclass of PackedDataset."""


def test_upcoming_batches_reach_the_sources_that_fetch_ahead() -> None:
    srcs = corpus()
    fetching = _Fetching(srcs[1])
    plain = MixedDataset(srcs, [0.5, 0.3, 0.2])
    assert upcoming_of(plain) is None  # no source fetches ahead: nor does the mix
    assert upcoming_of(PackedDataset(plain, seq_len=512, window_size=64)) is None
    mix = MixedDataset([srcs[0], fetching, srcs[2]], [0.5, 0.3, 0.2])
    rows = PackedDataset(mix, seq_len=512, window_size=64)
    assert type(mix) is MixedDataset and type(rows) is PackedDataset  # no class is swapped
    assert upcoming_of(mix) is not None and upcoming_of(rows) is not None
    # a user's subclasses ask their instances as the classes do
    assert upcoming_of(_MyMix(srcs, [0.5, 0.3, 0.2])) is None
    assert upcoming_of(_MyPacked(_MyMix([srcs[0], fetching, srcs[2]], [0.5, 0.3, 0.2]), seq_len=512)) is not None
    loader = stoker.DataLoader(rows, batch_size=4, sampler=StreamSampler(rows), collate_fn=collate_packed)
    assert sum(1 for _ in loader) == -(-len(rows) // 4)
    # told, in order, each of its samples that the epoch's rows hold (first mention of each)
    needed = [p for g in range(len(rows)) for p, _, _ in rows.pieces(g)]
    expected = [mix.source_at(p)[1] for p in dict.fromkeys(needed) if mix.source_at(p)[0] == 1]
    assert list(dict.fromkeys(fetching.told)) == list(dict.fromkeys(expected))
