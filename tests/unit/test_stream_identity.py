"""A loader state names its stream completely: each constructor argument of `TokenDataset`,
`MixedDataset`, `PackedDataset` and `StreamSampler` is changed in turn (enumerated from the
signature, so that an argument added later without a case here fails the test), and a state
saved over the first stream is refused naming the differing key exactly when the rows differ,
with nothing applied; accepted, and continued exactly, when they are equal."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytest
from tests.support.identity_cases import (
    ELASTIC,
    check_case,
    check_signature,
    epoch,
    listed,
    saved_state,
)

import stoker
from stoker._data import identity
from stoker.mix import MixedDataset, PackedDataset, StreamSampler, TokenDataset


def documents(n: int, seed: int, top: int = 300) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 30_000, rng.integers(1, top)) for _ in range(n)]


def corpus(seed: int = 0, counts: tuple[int, ...] = (60, 40, 20), top: int = 300) -> list[TokenDataset]:
    return [TokenDataset.from_documents(documents(n, seed * 10 + k, top)) for k, n in enumerate(counts)]


class FieldDocs:
    """A user's map-style dataset (no `stoker_describe`) whose samples are mappings with two
    token fields of different lengths."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.ids = documents(n, seed)
        self.other = documents(n, seed + 100, top=40)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"ids": self.ids[i], "other": self.other[i]}


class OtherDocs(FieldDocs):
    """Another type of user dataset, same length and contents."""


# -- TokenDataset -----------------------------------------------------------------------------

BASE_DOCS = documents(50, 1)
TOKENS = TokenDataset.from_documents(BASE_DOCS)


def token_loader(ds: TokenDataset) -> Callable[[], stoker.DataLoader[Any]]:
    return lambda: stoker.DataLoader(ds, batch_size=4, shuffle=True, generator=7, collate_fn=listed)


def _edited_tokens() -> TokenDataset:
    tokens = TOKENS.tokens.copy()
    tokens[len(tokens) // 2] += 1  # one token in the middle
    return TokenDataset(tokens, TOKENS.offsets)


def _recut() -> TokenDataset:
    offsets = TOKENS.offsets.copy()
    offsets[5] -= 1  # the same tokens, one boundary moved
    return TokenDataset(TOKENS.tokens, offsets)


TOKEN_CASES: dict[str, list[tuple[Callable[[], TokenDataset], str | None]]] = {
    "tokens": [
        (_edited_tokens, "stream.tokens_digest"),
        (lambda: TokenDataset(TOKENS.tokens.astype(np.int64), TOKENS.offsets), "stream.dtype"),
        (lambda: TokenDataset(TOKENS.tokens.copy(), TOKENS.offsets.copy()), None),  # equal copies
    ],
    "offsets": [
        (_recut, "stream.offsets_digest"),
        (lambda: TokenDataset(TOKENS.tokens, TOKENS.offsets.astype(np.int32)), None),  # made int64
    ],
}


def test_every_token_dataset_argument_has_a_case() -> None:
    check_signature(TokenDataset, TOKEN_CASES)


@pytest.mark.parametrize(("argument", "n"), [(a, n) for a, cases in TOKEN_CASES.items() for n in range(len(cases))])
def test_a_token_dataset_state_is_refused_exactly_when_the_rows_differ(argument: str, n: int) -> None:
    make, key = TOKEN_CASES[argument][n]
    check_case(token_loader(TOKENS), token_loader(make()), key)


# -- MixedDataset -----------------------------------------------------------------------------

SOURCES = corpus()
TOTALS = [int(s.lengths.sum()) for s in SOURCES]
MIX_BASE: dict[str, Any] = {"sources": SOURCES, "weights": [0.5, 0.3, 0.2], "weigh": "tokens", "tokens": TOTALS}
FIELD_SOURCES = [FieldDocs(40, 1), FieldDocs(30, 2)]
FIELD_BASE: dict[str, Any] = {"sources": FIELD_SOURCES, "weights": [1, 1], "weigh": "tokens", "field": "ids"}


def mix_loader(kwargs: Mapping[str, Any]) -> Callable[[], stoker.DataLoader[Any]]:
    def make() -> stoker.DataLoader[Any]:
        mix = MixedDataset(**kwargs)
        return stoker.DataLoader(mix, batch_size=4, sampler=StreamSampler(mix), collate_fn=listed)

    return make


def _replaced(k: int, source: Any) -> list[Any]:
    return [source if i == k else s for i, s in enumerate(SOURCES)]


# argument -> [(the saved run's arguments, the loading run's, the key a refusal names or None)]
MIX_CASES: dict[str, list[tuple[dict[str, Any], dict[str, Any], str | None]]] = {
    "sources": [
        (MIX_BASE, dict(MIX_BASE, sources=_replaced(1, corpus(seed=5)[1])), "stream.source.1.tokens_digest"),
        (MIX_BASE, dict(MIX_BASE, sources=_replaced(2, corpus(counts=(60, 40, 21))[2])), "stream.sizes"),
        (MIX_BASE, dict(MIX_BASE, sources=[TokenDataset(s.tokens.copy(), s.offsets.copy()) for s in SOURCES]), None),
        (FIELD_BASE, dict(FIELD_BASE, sources=[FIELD_SOURCES[0], OtherDocs(30, 3)]), "stream.source.1.type"),
    ],
    "weights": [
        (MIX_BASE, dict(MIX_BASE, weights=[0.5, 0.2, 0.3]), "stream.weights"),
        (MIX_BASE, dict(MIX_BASE, weights=[(0, [0.5, 0.3, 0.2]), (60, [0.2, 0.3, 0.5])]), "stream.schedule_starts"),
        # a piece that starts in the second epoch: the first epoch's rows are equal, not the stream's
        (MIX_BASE, dict(MIX_BASE, weights=[(0, [0.5, 0.3, 0.2]), (200, [0.2, 0.3, 0.5])]), "stream.schedule_starts"),
    ],
    "weigh": [(MIX_BASE, dict(MIX_BASE, weigh="documents"), "stream.weigh")],
    "exhausted": [(MIX_BASE, dict(MIX_BASE, exhausted="stop"), "stream.exhausted")],
    "seed": [(MIX_BASE, dict(MIX_BASE, seed=1), "stream.seed")],
    "length": [(MIX_BASE, dict(MIX_BASE, length=80), "stream.length")],
    "tokens": [
        # the issue's case: other totals give other document weights
        (MIX_BASE, dict(MIX_BASE, tokens=[TOTALS[0] * 2, TOTALS[1], TOTALS[2]]), "stream.document_weights"),
        # every total doubled: the same document weights, the same rows
        (MIX_BASE, dict(MIX_BASE, tokens=[t * 2 for t in TOTALS]), None),
        # counted rather than given: the same
        (MIX_BASE, dict(MIX_BASE, tokens=None), None),
        # weighed by documents, tokens= is not used
        (dict(MIX_BASE, weigh="documents"), dict(MIX_BASE, weigh="documents", tokens=[1, 2, 3]), None),
    ],
    "field": [
        (FIELD_BASE, dict(FIELD_BASE, field="other"), "stream.document_weights"),
        # weighed by documents the field is not read: the mix's rows are the same
        (dict(FIELD_BASE, weigh="documents"), dict(FIELD_BASE, weigh="documents", field="other"), None),
    ],
    # with no sharded source the windows do not exist (a sharded source: tests/shards)
    "window_shards": [(MIX_BASE, dict(MIX_BASE, window_shards=2), None)],
}


def test_every_mixed_dataset_argument_has_a_case() -> None:
    check_signature(MixedDataset, MIX_CASES)


@pytest.mark.parametrize(("argument", "n"), [(a, n) for a, cases in MIX_CASES.items() for n in range(len(cases))])
def test_a_mix_state_is_refused_exactly_when_the_rows_differ(argument: str, n: int) -> None:
    saved, loading, key = MIX_CASES[argument][n]
    check_case(mix_loader(saved), mix_loader(loading), key)


def test_the_issue_case_names_the_weights_the_tokens_made() -> None:
    base, other = mix_loader(MIX_BASE), mix_loader(dict(MIX_BASE, tokens=[TOTALS[0] * 2, TOTALS[1], TOTALS[2]]))
    with pytest.raises(ValueError, match=r"stream.document_weights: saved \[\[\d+, \d+, \d+\]\], this loader \[\["):
        other().load_state_dict(saved_state(base))


# -- PackedDataset (over a mix) ---------------------------------------------------------------

MIX = MixedDataset(corpus(top=600), [0.5, 0.3, 0.2], seed=2)
PACK_BASE: dict[str, Any] = {"dataset": MIX, "seq_len": 256, "window_size": 16}
FIELD_PACK: dict[str, Any] = {"dataset": FieldDocs(60, 3), "seq_len": 64, "window_size": 16, "field": "ids"}


def pack_loader(kwargs: Mapping[str, Any]) -> Callable[[], stoker.DataLoader[Any]]:
    def make() -> stoker.DataLoader[Any]:
        rows = PackedDataset(**kwargs)
        return stoker.DataLoader(rows, batch_size=2, sampler=StreamSampler(rows), collate_fn=listed)

    return make


PACK_CASES: dict[str, list[tuple[dict[str, Any], dict[str, Any], str | None]]] = {
    "dataset": [
        (PACK_BASE, dict(PACK_BASE, dataset=MixedDataset(corpus(top=600), [0.5, 0.3, 0.2], seed=3)), "stream.mix.seed"),
        (
            PACK_BASE,
            dict(PACK_BASE, dataset=MixedDataset(corpus(seed=4, top=600), [0.5, 0.3, 0.2], seed=2)),
            "stream.mix.source.0.tokens_digest",
        ),
        (PACK_BASE, dict(PACK_BASE, dataset=MixedDataset(corpus(top=600), [0.5, 0.3, 0.2], seed=2)), None),
        (FIELD_PACK, dict(FIELD_PACK, dataset=OtherDocs(60, 4)), "stream.data.type"),
    ],
    "seq_len": [(PACK_BASE, dict(PACK_BASE, seq_len=200), "stream.seq_len")],
    "window_size": [(PACK_BASE, dict(PACK_BASE, window_size=8), "stream.window_size")],
    "fields": [(PACK_BASE, dict(PACK_BASE, fields="jax"), "stream.fields")],
    "window_unit": [(PACK_BASE, dict(PACK_BASE, window_unit="documents"), "stream.window_unit")],
    "method": [(PACK_BASE, dict(PACK_BASE, method="greedy"), "stream.method")],
    "long": [(PACK_BASE, dict(PACK_BASE, long="drop"), "stream.long")],
    "pad_id": [(PACK_BASE, dict(PACK_BASE, pad_id=7), "stream.pad_id")],
    "rows_per_epoch": [(PACK_BASE, dict(PACK_BASE, rows_per_epoch=40), "stream.rows_per_epoch")],
    "tensors": [(PACK_BASE, dict(PACK_BASE, tensors=True), None)],  # the same values, as torch tensors
    "field": [(FIELD_PACK, dict(FIELD_PACK, field="other"), "stream.field")],
}


def test_every_packed_dataset_argument_has_a_case() -> None:
    check_signature(PackedDataset, PACK_CASES)


@pytest.mark.parametrize(("argument", "n"), [(a, n) for a, cases in PACK_CASES.items() for n in range(len(cases))])
def test_a_packed_state_is_refused_exactly_when_the_rows_differ(argument: str, n: int) -> None:
    if PACK_CASES[argument][n][1].get("tensors"):
        pytest.importorskip("torch")
    saved, loading, key = PACK_CASES[argument][n]
    check_case(pack_loader(saved), pack_loader(loading), key)


# -- StreamSampler ----------------------------------------------------------------------------

ROWS = PackedDataset(**PACK_BASE)


def sampler_loader(kwargs: Mapping[str, Any]) -> Callable[[], stoker.DataLoader[Any]]:
    def make() -> stoker.DataLoader[Any]:
        dataset = kwargs.get("dataset", ROWS)
        sampler = StreamSampler(**dict(kwargs, dataset=dataset))
        return stoker.DataLoader(dataset, batch_size=2, sampler=sampler, collate_fn=listed)

    return make


WORLD = {"num_replicas": 3, "rank": 0}
SAMPLER_CASES: dict[str, list[tuple[dict[str, Any], dict[str, Any], str | None]]] = {
    "dataset": [({}, {"dataset": PackedDataset(**dict(PACK_BASE, seq_len=300))}, "stream.seq_len")],
    "num_replicas": [(WORLD, dict(WORLD, num_replicas=2), ELASTIC)],
    "rank": [(WORLD, dict(WORLD, rank=1), ELASTIC)],
    "drop_last": [
        (WORLD, dict(WORLD, drop_last=True), "sampler_drop_last"),  # the tail is dropped, not padded
        ({}, {"drop_last": True}, "sampler_drop_last"),  # one rank: the same rows, still recorded
    ],
}


def test_every_stream_sampler_argument_has_a_case() -> None:
    check_signature(StreamSampler, SAMPLER_CASES)
    assert len(ROWS) % 3, "the drop_last case needs an epoch that 3 ranks do not divide"


@pytest.mark.parametrize(("argument", "n"), [(a, n) for a, cases in SAMPLER_CASES.items() for n in range(len(cases))])
def test_a_stream_sampler_state_is_refused_when_the_rows_differ(argument: str, n: int) -> None:
    saved, loading, key = SAMPLER_CASES[argument][n]
    if argument == "drop_last" and not saved:
        # one rank: drop_last drops nothing, the rows are equal, and the recorded flag still
        # refuses (a conservative refusal, documented: the flag is recorded whatever the world)
        assert epoch(sampler_loader(saved)) == epoch(sampler_loader(loading))
        with pytest.raises(ValueError, match="sampler_drop_last: saved False, this loader True"):
            sampler_loader(loading)().load_state_dict(saved_state(sampler_loader(saved)))
        return
    check_case(sampler_loader(saved), sampler_loader(loading), key)


# -- the description itself -------------------------------------------------------------------


def test_a_state_missing_a_key_or_with_an_extra_one_is_refused_naming_it() -> None:
    make = mix_loader(MIX_BASE)
    state = saved_state(make)
    del state["config"]["stream.seed"]
    state["config"]["stream.something_new"] = 1
    with pytest.raises(ValueError) as refused:
        make().load_state_dict(state)
    assert "stream.seed: saved records none, this loader 0" in str(refused.value)
    assert "stream.something_new: saved 1, this loader records none" in str(refused.value)


def test_a_large_array_is_digested_from_a_bounded_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(identity, "FULL_DIGEST_BYTES", 1 << 16)
    arr = (np.arange(1 << 22) % 65_521).astype(np.uint16)  # 8 MiB: over the lowered threshold
    base = identity.array_digest(arr)
    assert identity.array_digest(arr.copy()) == base
    blocks = np.unique(np.linspace(0, len(arr) - 2048, identity.SAMPLE_BLOCKS).astype(np.int64))
    assert len(blocks) == identity.SAMPLE_BLOCKS
    for where in (0, len(arr) - 1, int(blocks[500]) + 7):  # first, last and a sampled block
        edited = arr.copy()
        edited[where] += 1
        assert identity.array_digest(edited) != base
    between = arr.copy()
    between[int(blocks[500]) + 2048 + 1] += 1  # between two sampled blocks: not seen (documented)
    assert identity.array_digest(between) == base
    assert identity.array_digest(arr.astype(np.int32)) != base  # the dtype is part of it
    assert identity.array_digest(arr[: len(arr) - 1]) != base  # so is the length


def test_a_small_array_is_digested_whole() -> None:
    arr = np.arange(1 << 16, dtype=np.int64)
    edited = arr.copy()
    edited[12_345] += 1
    assert identity.array_digest(arr) != identity.array_digest(edited)
    assert identity.array_digest(arr) == identity.array_digest(arr.copy())


def test_the_description_is_computed_once_and_is_plain_json() -> None:
    ds = TokenDataset.from_documents(documents(20, 9))
    first = ds.stoker_describe()
    assert ds._digests is not None
    ds.tokens = ds.tokens.copy()
    ds.tokens[0] += 1  # arrays are taken as fixed after construction: the kept digest stays
    assert ds.stoker_describe() == first
    rows = PackedDataset(MixedDataset(corpus(), [1, 1, 1]), seq_len=64)
    described = rows.stoker_describe()
    assert json.loads(json.dumps(described)) == described
    assert {"mix.source.0.tokens_digest", "mix.source.2.offsets_digest", "pad_id", "field"} <= set(described)


def test_an_arbitrary_source_is_named_by_type_length_and_hugging_face_fingerprint() -> None:
    assert identity.describe_data(FieldDocs(5)) == {"type": "FieldDocs", "length": 5}
    datasets = pytest.importorskip("datasets")
    hf = datasets.Dataset.from_dict({"ids": [[1, 2], [3]]})
    described = identity.describe_data(hf)
    assert described["type"] == "Dataset" and described["length"] == 2
    other = datasets.Dataset.from_dict({"ids": [[1, 2], [4]]})
    assert described["fingerprint"] != identity.describe_data(other)["fingerprint"]
