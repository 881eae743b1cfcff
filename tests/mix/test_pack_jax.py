"""Packed rows as JAX models take them (`PackedDataset(fields="jax" | "maxtext")`): the same rows,
tokens and boundaries as the default convention for the same arguments, row for row; int32 fields
of fixed shapes that the default collate of a real `stoker.DataLoader` with 2 workers stacks into
one static shape; the attention mask built with `jax.numpy` from a batch's `segment_ids` equal to
the block-diagonal one read from its `cu_seqlens`, every row, with one compilation for every
batch; bad values refused by name; a loader state told apart from the default convention's."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import stoker
from stoker.mix import PackedDataset, StreamSampler, TokenDataset, collate_packed

SEQ_LEN = 32
PAD = 7
IGNORE = -100
JAX_KEYS = {"input_ids", "segment_ids", "positions", "labels", "cu_seqlens"}
MAXTEXT_KEYS = {
    "inputs",
    "inputs_segmentation",
    "inputs_position",
    "targets",
    "targets_segmentation",
    "targets_position",
    "cu_seqlens",
}


def corpus(n: int = 240, seed: int = 0) -> TokenDataset:
    """Documents of every kind a row meets: empty ones, short ones, ones longer than SEQ_LEN."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(2.3, 0.9, n).astype(np.int64), 5 * SEQ_LEN)
    lengths[::17] = 0
    return TokenDataset.from_documents([rng.integers(PAD + 1, 50_000, k) for k in lengths])


DOCS = corpus()


def packed(fields: str, **kwargs: Any) -> PackedDataset:
    args: dict[str, Any] = {"seq_len": SEQ_LEN, "window_size": 4, "pad_id": PAD}
    return PackedDataset(DOCS, **{**args, **kwargs, "fields": fields})


def test_one_row_in_each_convention() -> None:
    # greedy over windows of 4 documents: row 0 holds documents 0, 1 and 3 (2 is empty)
    docs = TokenDataset.from_documents(
        [np.array([11, 12, 13]), np.array([14, 15]), np.array([], np.int64), np.array([16])]
    )
    rows = {
        f: PackedDataset(docs, 8, window_size=4, method="greedy", window_unit="documents", fields=f)
        for f in ("jax", "maxtext")
    }
    jax_row, maxtext_row = rows["jax"][0], rows["maxtext"][0]
    assert jax_row.keys() == JAX_KEYS
    assert jax_row["input_ids"].tolist() == [11, 12, 13, 14, 15, 16, 0, 0]
    assert jax_row["segment_ids"].tolist() == [1, 1, 1, 2, 2, 3, 0, 0]
    assert jax_row["positions"].tolist() == [0, 1, 2, 0, 1, 0, 0, 0]
    assert jax_row["labels"].tolist() == [-100, 12, 13, -100, 15, -100, -100, -100]
    assert jax_row["cu_seqlens"].tolist() == [0, 3, 5, 6, 6, 6, 6, 6, 6]
    assert maxtext_row.keys() == MAXTEXT_KEYS
    assert maxtext_row["inputs"].tolist() == jax_row["input_ids"].tolist()
    assert maxtext_row["inputs_segmentation"].tolist() == jax_row["segment_ids"].tolist()
    assert (
        maxtext_row["inputs_position"].tolist() == maxtext_row["targets_position"].tolist() == [0, 1, 2, 0, 1, 0, 0, 0]
    )
    assert maxtext_row["targets"].tolist() == [12, 13, 0, 15, 0, 0, 0, 0]
    assert maxtext_row["targets_segmentation"].tolist() == [1, 1, 0, 2, 0, 0, 0, 0]
    for row in (jax_row, maxtext_row):
        assert {v.dtype for v in row.values()} == {np.dtype(np.int32)}


def expected_cu(cu: np.ndarray) -> list[int]:
    return cu.tolist() + [int(cu[-1])] * (SEQ_LEN + 1 - len(cu))


@pytest.mark.parametrize("window_unit", ["rows", "documents"])
@pytest.mark.parametrize("long", ["split", "drop"])
@pytest.mark.parametrize("method", ["best_fit", "greedy"])
def test_the_same_rows_in_every_convention(method: str, long: str, window_unit: str) -> None:
    kwargs = {"method": method, "long": long, "window_unit": window_unit}
    torch_rows, jax_rows, maxtext_rows = (packed(f, **kwargs) for f in ("torch", "jax", "maxtext"))
    assert len(torch_rows) == len(jax_rows) == len(maxtext_rows)
    n = 2 * len(torch_rows)  # two epochs: the stream cycles past its end
    windows = {torch_rows.locate(g)[0] for g in range(n)}
    assert len(windows) >= 20, "the rows should cover many windows"
    multi = padded = 0
    for g in range(n):
        base, jax_row, mt = torch_rows[g], jax_rows[g], maxtext_rows[g]
        assert torch_rows.pieces(g) == jax_rows.pieces(g) == maxtext_rows.pieces(g), g
        assert jax_row.keys() == JAX_KEYS and mt.keys() == MAXTEXT_KEYS
        for row in (jax_row, mt):
            for key, value in row.items():
                assert value.dtype == np.int32, (g, key)
                assert value.shape == ((SEQ_LEN + 1,) if key == "cu_seqlens" else (SEQ_LEN,)), (g, key)
        ids, seg, pos, labels = base["input_ids"], base["segment_ids"], base["position_ids"], base["labels"]
        assert jax_row["input_ids"].tolist() == mt["inputs"].tolist() == ids.tolist(), g
        assert jax_row["segment_ids"].tolist() == mt["inputs_segmentation"].tolist() == seg.tolist(), g
        assert jax_row["positions"].tolist() == mt["inputs_position"].tolist() == pos.tolist(), g
        assert mt["targets_position"].tolist() == pos.tolist(), g
        assert jax_row["labels"].tolist() == labels.tolist(), g
        assert jax_row["cu_seqlens"].tolist() == mt["cu_seqlens"].tolist() == expected_cu(base["cu_seqlens"]), g
        # MaxText's targets: token t's target is the next token wherever `labels` trains it
        trained = np.append(labels[1:] != IGNORE, False)
        assert mt["targets"].tolist() == np.where(trained, np.append(ids[1:], PAD), PAD).tolist(), g
        assert mt["targets_segmentation"].tolist() == np.where(trained, seg, 0).tolist(), g
        multi += int(seg.max()) > 1
        padded += int(base["cu_seqlens"][-1]) < SEQ_LEN
    assert multi and padded, "the rows should include rows of several documents and rows with padding"


def test_bad_fields_are_refused_by_name() -> None:
    for bad in ("flax", "TORCH", "", None, 1):
        with pytest.raises(ValueError, match=r"^fields should be 'torch', 'jax' or 'maxtext', but got fields="):
            packed(bad)  # type: ignore[arg-type]


def test_values_that_do_not_fit_int32_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"^pad_id should fit int32 .* but got 2147483648"):
        packed("jax", pad_id=2**31)
    assert packed("torch", pad_id=2**31)[0]["input_ids"].dtype == np.int64  # the default keeps int64
    big = TokenDataset.from_documents([np.array([1, 2**31, 3]), np.array([4, 5])])
    for fields in ("jax", "maxtext"):
        rows = PackedDataset(big, 8, window_size=2, fields=fields)
        with pytest.raises(ValueError, match=r"^row 0 holds token id 2147483648, which does not fit int32"):
            rows[0]


def test_collate_packed_keeps_the_default_convention_and_refuses_the_jax_ones() -> None:
    torch_rows = packed("torch")
    batch = collate_packed([torch_rows[g] for g in range(4)])
    assert batch["input_ids"].shape == (4, SEQ_LEN) and batch["input_ids"].dtype == np.int64
    assert batch["cu_seqlens"][-1] == 4 * SEQ_LEN
    for fields in ("jax", "maxtext"):
        rows = packed(fields)
        with pytest.raises(ValueError, match=r"^collate_packed batches rows of PackedDataset\(fields='torch'\)"):
            collate_packed([rows[0], rows[1]])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fields", ["jax", "maxtext"])
def test_the_default_collate_stacks_fixed_shapes_through_two_workers(fields: str) -> None:
    rows = packed(fields)
    sampler = StreamSampler(rows)
    loader = stoker.DataLoader(rows, batch_size=4, sampler=sampler, num_workers=2, drop_last=True)
    order = list(sampler)
    batches = list(loader)
    assert len(batches) == len(order) // 4 >= 10
    keys = JAX_KEYS if fields == "jax" else MAXTEXT_KEYS
    for b, batch in enumerate(batches):
        assert batch.keys() == keys
        for key, value in batch.items():
            assert isinstance(value, np.ndarray) and value.dtype == np.int32, (b, key)
            assert value.shape == ((4, SEQ_LEN + 1) if key == "cu_seqlens" else (4, SEQ_LEN)), (b, key)
            expected = np.stack([rows[g][key] for g in order[4 * b : 4 * b + 4]])
            assert np.array_equal(value, expected), (b, key)


def test_a_state_tells_the_conventions_apart() -> None:
    assert "fields" not in packed("torch").stoker_describe()  # states saved before `fields` still load
    assert packed("jax").stoker_describe()["fields"] == "jax"

    def loader(fields: str) -> stoker.DataLoader[Any]:
        rows = packed(fields)
        return stoker.DataLoader(rows, batch_size=2, sampler=StreamSampler(rows), collate_fn=list)

    saved = loader("torch")
    it = iter(saved)
    next(it)
    state = saved.state_dict()
    with pytest.raises(ValueError, match=r"stream\.fields: saved records none, this loader 'jax'"):
        loader("jax").load_state_dict(state)
    loader("torch").load_state_dict(state)  # the same convention resumes
    del it


# Run in a fresh interpreter: JAX's thread pools outlive any test that computes with it, and a
# later test forking workers in this process would fork a multithreaded JAX. The loader's workers
# fork when its iterator starts, before JAX's first computation here.
MASK_SCRIPT = """
import numpy as np
import stoker
from stoker.mix import PackedDataset, StreamSampler, TokenDataset

rng = np.random.default_rng(1)
lengths = np.minimum(rng.lognormal(2.3, 1.0, 300).astype(np.int64), 100)
docs = TokenDataset.from_documents([rng.integers(1, 1000, k) for k in lengths])
SEQ = 32
out = {}
for fields, seg_key in (("jax", "segment_ids"), ("maxtext", "inputs_segmentation")):
    rows = PackedDataset(docs, SEQ, window_size=4, fields=fields)
    loader = stoker.DataLoader(rows, batch_size=8, sampler=StreamSampler(rows), num_workers=2, drop_last=True)
    out[fields] = [(np.asarray(b[seg_key]), np.asarray(b["cu_seqlens"])) for b in loader]

import jax
import jax.numpy as jnp

@jax.jit
def mask_from_segments(seg):
    causal = jnp.tril(jnp.ones((seg.shape[-1], seg.shape[-1]), bool))
    return (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0) & causal

@jax.jit
@jax.vmap
def mask_from_cu_seqlens(cu):
    # the definition of a block-diagonal causal mask: i attends to j when, for some segment k,
    # cu[k] <= j <= i < cu[k + 1] (an empty segment, cu[k] == cu[k + 1], holds no token)
    i = jnp.arange(SEQ)[:, None]
    j = jnp.arange(SEQ)[None, :]
    starts, ends = cu[:-1, None, None], cu[1:, None, None]
    return ((starts <= j) & (j <= i) & (i < ends)).any(axis=0)

checked = several = padded = 0
for fields, batches in out.items():
    for seg, cu in batches:
        masks, blocks = mask_from_segments(jnp.asarray(seg)), mask_from_cu_seqlens(jnp.asarray(cu))
        differ = np.flatnonzero(np.asarray(jnp.any(masks != blocks, axis=(1, 2))))
        assert not len(differ), (fields, differ.tolist())
        checked += len(seg)
        several += int(((np.diff(cu, axis=1) > 0).sum(axis=1) > 1).sum())
        padded += int((cu[:, -1] < SEQ).sum())
# one shape for every batch: each function compiled once
assert mask_from_segments._cache_size() == mask_from_cu_seqlens._cache_size() == 1
print(f"checked {checked} rows, {several} of several documents, {padded} with padding")
"""


@pytest.mark.timeout(240)
def test_the_attention_mask_from_segment_ids_is_the_block_diagonal_one_of_cu_seqlens() -> None:
    pytest.importorskip("jax")
    done = subprocess.run([sys.executable, "-c", MASK_SCRIPT], capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "os.fork() was called" not in done.stderr, done.stderr
    found = re.search(r"checked (\d+) rows, (\d+) of several documents, (\d+) with padding", done.stdout)
    assert found, done.stdout
    checked, several, padded = (int(n) for n in found.groups())
    assert checked >= 100 and several > 0 and padded > 0, done.stdout


def test_tensors_give_the_jax_rows_as_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    row, tensors = packed("jax")[3], packed("jax", tensors=True)[3]
    assert row.keys() == tensors.keys() == JAX_KEYS
    for key in JAX_KEYS:
        assert isinstance(tensors[key], torch.Tensor) and tensors[key].dtype == torch.int32, key
        assert np.array_equal(tensors[key].numpy(), row[key]), key
