"""A text pipeline: variable-length token sequences, padded per batch.

Batches are numpy arrays (`stoker.DataLoader`; with `stoker.torch.DataLoader` and torch
arrays in `pad_collate` they would be tensors): `input_ids` (batch, longest) int32 padded
with PAD_ID, `attention_mask` (batch, longest) uint8, 1 on real tokens, and `lengths`
(batch,) int64. Each batch is padded to its own longest sequence, not to a global maximum.

    python examples/text_pipeline.py          # a short toy loop
    stoker doctor examples/text_pipeline.py:make_loader --seconds 20
"""

from __future__ import annotations

import time

import numpy as np

import stoker

PAD_ID = 0
VOCAB = 32_000


class TokenSequences(stoker.Dataset):
    """`n` synthetic token sequences of 8..`max_len` tokens (a long-tailed length
    distribution, as real text has), made deterministically from `seed`."""

    def __init__(self, n: int = 20_000, max_len: int = 512, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        lengths = np.clip(rng.lognormal(4.5, 0.7, n).astype(np.int64), 8, max_len)
        # All sequences in one flat int32 array plus offsets: a list of 20,000 arrays would be
        # 20,000 Python objects, copied into each forked worker as they are touched.
        self.tokens = rng.integers(1, VOCAB, int(lengths.sum()), dtype=np.int32)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]


def pad_collate(samples: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Pad a list of 1-d token arrays to the longest one."""
    lengths = np.array([len(s) for s in samples], np.int64)
    input_ids = np.full((len(samples), int(lengths.max())), PAD_ID, np.int32)
    for row, sequence in zip(input_ids, samples):
        row[: len(sequence)] = sequence
    attention_mask = (np.arange(input_ids.shape[1]) < lengths[:, None]).astype(np.uint8)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "lengths": lengths}


def make_dataset() -> TokenSequences:
    return TokenSequences()


def make_loader() -> stoker.DataLoader:
    return stoker.DataLoader(
        make_dataset(), batch_size=32, shuffle=True, collate_fn=pad_collate, num_workers=2, generator=0
    )


def main() -> None:
    loader = make_loader()
    # A toy "model": a mean-pooled embedding lookup; it only reads the batch as a model would.
    embeddings = np.random.default_rng(0).standard_normal((VOCAB, 16), dtype=np.float32)
    start = time.perf_counter()
    tokens = padded = 0
    for batch in loader:
        mask = batch["attention_mask"][..., None]
        pooled = (embeddings[batch["input_ids"]] * mask).sum(axis=1) / batch["lengths"][:, None]
        assert pooled.shape == (len(batch["lengths"]), 16)
        tokens += int(batch["lengths"].sum())
        padded += batch["input_ids"].size
    elapsed = time.perf_counter() - start
    print(
        f"{len(loader.dataset)} sequences, {tokens:,} tokens in {elapsed:.2f} s: {tokens / elapsed:,.0f} tokens/s; "
        f"{100 * tokens / padded:.0f} % of the padded batch is real tokens"
    )


if __name__ == "__main__":
    main()
