"""The mixing and packing benchmark (issue 34): `python benchmarks/mix_bench.py [options]`.

The corpus is real text available offline: the Python files, type stubs and text files of the
packages installed beside stoker, in three sources ("code": library .py files, "tests": .py
files under test folders, "stubs+text": .pyi, .md, .rst and .txt). Files are taken in a fixed
pseudo-random order (a hash of their path) up to a byte cap per source, each file one document,
and tokenised by a byte-level BPE (`tokenizers`, vocabulary 8,192) trained on a sample of the
corpus: byte-level BPE keeps every byte, and its lengths are those of a language model's
documents (bytes alone would make the documents ~3x longer). The tokens are cached under
build/mixbench/ (keyed by the caps and the installed files).

Rows (all measured in this run):
- the document-length distribution of each source and of each synthetic length law;
- packing utilisation (real tokens over row tokens) on four length laws: the corpus (`--passes`
  passes over it in the mix's order), lognormal lengths of median 300 and of median 1,500
  tokens (sigma 1.6), and a Pareto tail (x_m 200 tokens, alpha 1.3). For each, at seq_len
  2,048 and 8,192 and K from 64 to 4,096: stoker's best-fit and greedy with windows of K rows
  (`window_unit="rows"`) against Grain's best-fit and first-fit packers with K packing bins,
  the same bin count (each emits K rows at a time; Grain sends its K bins when a piece fits
  none), and stoker's best-fit with windows of K documents (the default unit) for reference.
  Documents longer than seq_len are split into seq_len pieces for every packer (Grain refuses
  longer inputs), and every packer packs the same pieces in the same order. Grain's packers are
  run through a model of their placement rule (online, each piece into the fullest bin it fits,
  or the first, all K bins sent when it fits none), checked in the same run to give exactly
  the rows Grain 0.2.18's own `BestFitPackIterDataset` and `FirstFitPackIterDataset` give on
  the first pieces of each law (Grain itself takes about 0.3 ms a piece: `--real-grain` runs
  it on everything);
- row tokens per second: stoker's MixedDataset -> PackedDataset through stoker.DataLoader at 0
  and 2 workers, and Grain's mix -> BestFitPackIterDataset -> batch in one thread (and with 2
  worker processes, `mp_prefetch`), at seq_len 2,048, batch 8;
- the mix's largest deviation from its weights over windows of 1,000 consecutive documents, for
  three weight vectors and a two-piece schedule: stoker's MixedDataset, Grain's
  `MapDataset.mix`, torchdata.nodes' `MultiNodeWeightedSampler` (neither takes a schedule).
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import itertools
import json
import os
import sys
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

SOURCES = ("code", "tests", "stubs+text")
CAPS_MB = (24.0, 12.0, 12.0)
VOCAB = 8192
SEQ_LENS = (2048, 8192)
WINDOWS = (64, 256, 1024, 4096)
WEIGHTS = (0.5, 0.3, 0.2)
BATCH = 8
DEVIATION_WINDOW = 1000


def _source_of(path: Path) -> int | None:
    name = path.name
    if name.endswith(".py"):
        parts = set(path.parts)
        return 1 if parts & {"test", "tests", "testing"} or name.startswith("test_") else 0
    if name.endswith((".pyi", ".md", ".rst", ".txt")):
        return 2
    return None


def _order_key(path: Path) -> str:
    return hashlib.sha1(str(path).encode()).hexdigest()


def collect(root: Path, caps_mb: Sequence[float]) -> list[list[Path]]:
    """Each source's files in hash order, up to its byte cap; files over 1 MiB are left out (a
    few generated tables)."""
    found: list[list[Path]] = [[] for _ in SOURCES]
    for path in root.rglob("*"):
        s = _source_of(path)
        if s is not None and path.is_file():
            found[s].append(path)
    out = []
    for s, files in enumerate(found):
        files.sort(key=_order_key)
        taken, size = [], 0
        for p in files:
            n = p.stat().st_size
            if n == 0 or n > 1 << 20:
                continue
            taken.append(p)
            size += n
            if size >= caps_mb[s] * 1e6:
                break
        out.append(taken)
    return out


def byte_tokens(text: str) -> np.ndarray:
    """The byte-level tokeniser: UTF-8 bytes as ids 1-256 (0 is padding)."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + 1


def tokenise(files: list[list[Path]], cache: Path, vocab: int = VOCAB) -> tuple[list[list[np.ndarray]], str]:
    """Every file as a document of BPE token ids (ids + 1: 0 is padding); cached."""
    key = hashlib.sha1(json.dumps([[str(p) for p in f] for f in files] + [vocab]).encode()).hexdigest()[:16]
    path = cache / f"corpus-{key}.npz"
    if path.exists():
        data = np.load(path)
        docs = []
        for s in range(len(files)):
            tokens, offsets = data[f"t{s}"], data[f"o{s}"]
            docs.append([tokens[a:b] for a, b in itertools.pairwise(offsets.tolist())])
        return docs, f"BPE {vocab} (cached {path.name})"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [[p.read_bytes().decode("utf-8", "replace") for p in f] for f in files]
    sample = [t for source in texts for t in source[: max(1, len(source) // 4)]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(sample, trainer)
    docs = []
    arrays: dict[str, np.ndarray] = {}
    for s, source in enumerate(texts):
        enc = tok.encode_batch(source)
        ids = [np.asarray(e.ids, np.int32) + 1 for e in enc]
        docs.append(ids)
        arrays[f"t{s}"] = np.concatenate(ids) if ids else np.zeros(0, np.int32)
        arrays[f"o{s}"] = np.concatenate([[0], np.cumsum([len(x) for x in ids])]).astype(np.int64)
    cache.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return docs, f"BPE {vocab} (trained on a quarter of each source's files)"


def length_table(docs: list[list[np.ndarray]]) -> list[str]:
    out = ["source        docs   tokens      mean    p10    p50    p90    p99     max  >2048  >8192"]
    for name, source in zip(SOURCES, docs):
        n = np.array([len(d) for d in source])
        p = np.percentile(n, [10, 50, 90, 99]).astype(int)
        out.append(
            f"{name:<11} {len(n):>6} {int(n.sum()):>8,} {n.mean():>9.0f} {p[0]:>6} {p[1]:>6} {p[2]:>6} {p[3]:>6} "
            f"{int(n.max()):>7} {100 * (n > 2048).mean():>5.1f}% {100 * (n > 8192).mean():>5.1f}%"
        )
    return out


# -- utilisation ------------------------------------------------------------------------------


def pieces_of(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Lengths after splitting documents longer than seq_len (as stoker's long="split" and as
    Grain needs): full pieces from the start, then the rest."""
    out: list[int] = []
    for n in lengths.tolist():
        while n > seq_len:
            out.append(seq_len)
            n -= seq_len
        if n:
            out.append(n)
    return np.asarray(out, np.int64)


def _rates(tokens: int, rows: int, full: int, seq_len: int) -> tuple[float, int, float]:
    """Utilisation, rows, and the utilisation of the rows that are not one full split piece
    (what the packing itself achieved: a full piece fills a row whatever the packer)."""
    rest = rows - full
    return tokens / (rows * seq_len), rows, ((tokens - full * seq_len) / (rest * seq_len) if rest else 1.0)


def packed_windows(lengths: np.ndarray, window: int, seq_len: int, method: Any, unit: str) -> list[list[Any]]:
    """Every window's rows of a finite sequence of documents, packed by stoker's pure core as
    `PackedDataset` packs them: windows of `window` documents, or windows of `window` rows
    whose unplaced pieces are carried on (until the documents and carried pieces are placed)."""
    from stoker._mix.pack_rows import pack_rows_window, pack_window, piece_tokens

    if unit != "rows":
        return [pack_window(lengths[s : s + window], seq_len, method) for s in range(0, len(lengths), window)]
    cum = np.concatenate([[0], np.cumsum(piece_tokens(lengths, seq_len))])
    out: list[list[Any]] = []
    carry: list[Any] = []
    a = 0
    while a < len(lengths) or carry:
        need = window * seq_len - sum(e - s for _, s, e in carry)
        b = a if need <= 0 else min(int(np.searchsorted(cum, cum[a] + need, side="left")), len(lengths))
        rows, carry = pack_rows_window(carry, lengths[a:b], a, window, seq_len, method)
        out.append(rows)
        a = b
    return out


def stoker_utilisation(
    lengths: np.ndarray, seq_len: int, window: int, method: str, unit: str = "documents"
) -> tuple[float, int, float]:
    """stoker's packer over `lengths` with windows of `window` documents or rows (`unit`)."""
    windows = packed_windows(lengths, window, seq_len, method, unit)
    rows = sum(len(w) for w in windows)
    tokens = sum(e - s for w in windows for row in w for _, s, e in row)
    full = sum(1 for w in windows for row in w if len(row) == 1 and row[0][2] - row[0][1] == seq_len)
    return _rates(tokens, rows, full, seq_len)


def grain_rows(pieces: np.ndarray, seq_len: int, bins: int, method: str) -> list[tuple[int, int]]:
    """(tokens, pieces) of each row Grain's packer emits, by running Grain itself."""
    import grain
    import grain.experimental as ge

    elements = [{"input_ids": np.ones(n, np.int32)} for n in pieces.tolist()]
    packer = ge.BestFitPackIterDataset if method == "best_fit" else ge.FirstFitPackIterDataset
    ds = packer(
        grain.MapDataset.source(elements).to_iter_dataset(),
        length_struct={"input_ids": seq_len},
        num_packing_bins=bins,
        shuffle_bins=False,
    )
    out = []
    for row in ds:
        segments = row["input_ids_segment_ids"]
        out.append((int((segments > 0).sum()), int(segments.max())))
    return out


def grain_model_rows(pieces: np.ndarray, seq_len: int, bins: int, method: str) -> list[tuple[int, int]]:
    """(tokens, pieces) of each row under Grain's placement rule, as its packers document it:
    the pieces in order, each into the fullest of the `bins` bins it fits ("best_fit") or the
    first it fits ("first_fit"), an empty bin counting as the emptiest; when a piece fits no
    bin, every non-empty bin is emitted in bin order and the piece starts the next batch.
    Checked against Grain itself (`grain_rows`) in every run."""
    out: list[tuple[int, int]] = []
    fill = [0] * bins
    count = [0] * bins
    used = 0  # bins 0..used-1 hold pieces (both rules take the lowest empty bin first)

    def send() -> None:
        nonlocal used
        out.extend(zip(fill[:used], count[:used]))
        for b in range(used):
            fill[b] = count[b] = 0
        used = 0

    if method == "best_fit":
        # bins with room, keyed room * base + bin: the first key >= n * base is the tightest
        # fit, lowest bin first (Grain's argmax of fill takes the first of equal fills)
        base = bins + 1
        rooms: list[int] = []
        for n in pieces.tolist():
            pos = bisect.bisect_left(rooms, n * base)
            if pos < len(rooms):
                b = rooms.pop(pos) % base
            else:
                if used == bins:
                    send()
                    rooms = []
                b, used = used, used + 1
            fill[b] += n
            count[b] += 1
            if fill[b] < seq_len:
                bisect.insort(rooms, (seq_len - fill[b]) * base + b)
    else:
        # a max-tree over the bins' room finds the first bin a piece fits in O(log bins)
        size = 1 << max(0, (bins - 1).bit_length())
        fresh = [seq_len] * (2 * size)
        for leaf in range(size + bins, 2 * size):
            fresh[leaf] = -1  # no such bin
        for i in range(size - 1, 0, -1):
            fresh[i] = max(fresh[2 * i], fresh[2 * i + 1])
        tree = list(fresh)
        for n in pieces.tolist():
            if tree[1] < n:
                send()
                tree = list(fresh)
            i = 1
            while i < size:
                i = 2 * i if tree[2 * i] >= n else 2 * i + 1
            b = i - size
            used = max(used, b + 1)
            fill[b] += n
            count[b] += 1
            tree[i] -= n
            i //= 2
            while i:
                tree[i] = max(tree[2 * i], tree[2 * i + 1])
                i //= 2
    send()
    return out


def grain_utilisation(
    lengths: np.ndarray, seq_len: int, bins: int, method: str, model: bool = False
) -> tuple[float, int, float]:
    """Grain's packer (itself, or `grain_model_rows` with `model`) over `lengths` split into
    seq_len pieces, with `bins` packing bins."""
    pieces = pieces_of(lengths, seq_len)
    rows = (grain_model_rows if model else grain_rows)(pieces, seq_len, bins, method)
    tokens = sum(t for t, _ in rows)
    full = sum(1 for t, c in rows if t == seq_len and c == 1)
    assert tokens == int(pieces.sum()), (tokens, int(pieces.sum()))
    return _rates(tokens, len(rows), full, seq_len)


def law_lengths(law: str, tokens: int, seed: int = 0) -> np.ndarray:
    """Document lengths drawn from a synthetic length law until they hold `tokens` tokens:
    "lognormal 300" and "lognormal 1500" (median, sigma 1.6), "pareto" (x_m 200, alpha 1.3,
    capped at 1M tokens)."""
    rng = np.random.default_rng(seed)
    out: list[np.ndarray] = []
    total = 0
    while total < tokens:
        if law.startswith("lognormal"):
            n = rng.lognormal(np.log(float(law.split()[1])), 1.6, 4096)
        elif law == "pareto":
            n = 200.0 * (1.0 + rng.pareto(1.3, 4096))
        else:
            raise ValueError(f"law should be 'lognormal <median>' or 'pareto', but got {law!r}")
        block = np.clip(n, 1, 1 << 20).astype(np.int64)
        out.append(block)
        total += int(block.sum())
    lengths = np.concatenate(out)
    return lengths[: int(np.searchsorted(np.cumsum(lengths), tokens)) + 1]


LAWS = ("corpus", "lognormal 300", "lognormal 1500", "pareto")


def utilisation_rows(lengths: np.ndarray, law: str, windows: Sequence[int], real_grain: bool) -> list[dict[str, Any]]:
    """The utilisation table's rows for one length law."""
    out = []
    for seq_len in SEQ_LENS:
        for k in windows:
            grain = [
                grain_utilisation(lengths, seq_len, k, m, model=not real_grain)[0] for m in ("best_fit", "first_fit")
            ]
            out.append(
                {
                    "law": law,
                    "seq_len": seq_len,
                    "K": k,
                    "stoker_best_fit": stoker_utilisation(lengths, seq_len, k, "best_fit", "rows")[0],
                    "stoker_greedy": stoker_utilisation(lengths, seq_len, k, "greedy", "rows")[0],
                    "grain_best_fit": grain[0],
                    "grain_first_fit": grain[1],
                    "stoker_best_fit_documents": stoker_utilisation(lengths, seq_len, k, "best_fit")[0],
                }
            )
    return out


def check_grain_model(laws: dict[str, np.ndarray], count: int, bins: int) -> list[str]:
    """Where `grain_model_rows` differs from Grain itself on the first `count` pieces of each
    law (seq_len 2,048 and 8,192, both packers, `bins` bins): empty when it never does."""
    differ = []
    for law, lengths in laws.items():
        for seq_len in SEQ_LENS:
            pieces = pieces_of(lengths, seq_len)[:count]
            for method in ("best_fit", "first_fit"):
                if grain_model_rows(pieces, seq_len, bins, method) != grain_rows(pieces, seq_len, bins, method):
                    differ.append(f"{law}, seq_len {seq_len}, {method}")
    return differ


def mixed_lengths(docs: list[list[np.ndarray]], weights: Sequence[float], count: int) -> np.ndarray:
    """The lengths of the first `count` documents of stoker's token-weighted mix of the sources
    (the sequence every packer is given)."""
    from stoker.mix import MixedDataset, TokenDataset

    mix = MixedDataset([TokenDataset.from_documents(s) for s in docs], list(weights), weigh="tokens", seed=0)
    return mix.stoker_lengths(0, count)


# -- throughput --------------------------------------------------------------------------------


def stoker_rate(docs: list[list[np.ndarray]], seq_len: int, window: int, workers: int, rows: int) -> float:
    import stoker
    from stoker.mix import MixedDataset, PackedDataset, StreamSampler, TokenDataset, collate_packed

    mix = MixedDataset([TokenDataset.from_documents(s) for s in docs], list(WEIGHTS), weigh="tokens", seed=0)
    packed = PackedDataset(mix, seq_len=seq_len, window_size=window, rows_per_epoch=rows + BATCH)
    loader = stoker.DataLoader(
        packed, batch_size=BATCH, sampler=StreamSampler(packed), collate_fn=collate_packed, num_workers=workers
    )
    it = iter(loader)
    next(it)  # start-up (and the workers' start) outside the timing, for both loaders alike
    start = time.perf_counter()
    got = 0
    for batch in it:
        got += batch["input_ids"].size
    return got / (time.perf_counter() - start)


def grain_pipeline(docs: list[list[np.ndarray]], seq_len: int, bins: int) -> Any:
    import grain
    import grain.experimental as ge

    sources = []
    for source in docs:
        pieces = [{"input_ids": d[a : a + seq_len]} for d in source for a in range(0, len(d), seq_len)]
        sources.append(grain.MapDataset.source(pieces).shuffle(seed=0).repeat())
    # Grain mixes by elements: the token weights as element weights by mean piece length
    mean_len = [np.mean([min(len(d), seq_len) for d in source]) for source in docs]
    weights = [w / m for w, m in zip(WEIGHTS, mean_len)]
    mixed = grain.MapDataset.mix(sources, weights).to_iter_dataset()
    packed = ge.BestFitPackIterDataset(
        mixed, length_struct={"input_ids": seq_len}, num_packing_bins=bins, shuffle_bins=False
    )
    return packed.batch(BATCH)


def grain_rate(docs: list[list[np.ndarray]], seq_len: int, bins: int, rows: int, workers: int) -> float:
    import grain

    ds = grain_pipeline(docs, seq_len, bins)
    if workers:
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    it = iter(ds)
    next(it)  # start-up (and the workers' start) outside the timing, for both loaders alike
    start = time.perf_counter()
    got = 0
    while got < rows * seq_len:
        got += next(it)["input_ids"].size
    rate = got / (time.perf_counter() - start)
    close = getattr(it, "close", None)
    if close is not None:
        close()
    return rate


# -- mix deviation -----------------------------------------------------------------------------


def deviation(sources: np.ndarray, weights: Sequence[float], window: int) -> float:
    """The largest |count_s - window * q_s| over every run of `window` consecutive positions."""
    S = len(weights)
    q = np.asarray(weights, np.float64) / sum(weights)
    onehot = np.zeros((len(sources) + 1, S), np.int64)
    onehot[np.arange(1, len(sources) + 1), sources] = 1
    cum = np.cumsum(onehot, axis=0)
    counts = cum[window:] - cum[:-window]
    return float(np.abs(counts - window * q).max()) if len(counts) else 0.0


def stoker_mix_sources(sizes: Sequence[int], weights: Any, count: int) -> np.ndarray:
    from stoker.mix import MixedDataset, TokenDataset

    srcs = [TokenDataset.from_documents([np.ones(1, np.int32)] * n) for n in sizes]
    return MixedDataset(srcs, weights, seed=0).sources_block(0, count)[0]


def scheduled_deviation(sources: np.ndarray, schedule: Sequence[tuple[int, Sequence[float]]], window: int) -> float:
    """`deviation` over each piece of a schedule (windows inside one piece)."""
    worst = 0.0
    for n, (start, weights) in enumerate(schedule):
        end = schedule[n + 1][0] if n + 1 < len(schedule) else len(sources)
        worst = max(worst, deviation(sources[start:end], weights, window))
    return worst


def grain_mix_sources(sizes: Sequence[int], weights: Sequence[float], count: int) -> np.ndarray:
    import grain

    srcs = [grain.MapDataset.range(n).map(lambda i, s=s: s).repeat() for s, n in enumerate(sizes)]
    mixed = grain.MapDataset.mix(srcs, list(weights))
    return np.fromiter((mixed[i] for i in range(count)), np.int64, count)


def torchdata_mix_sources(sizes: Sequence[int], weights: Sequence[float], count: int) -> np.ndarray:
    from torchdata.nodes import IterableWrapper, MultiNodeWeightedSampler

    nodes = {str(s): IterableWrapper(itertools.repeat(s)) for s in range(len(sizes))}
    sampler = MultiNodeWeightedSampler(nodes, {str(s): float(w) for s, w in enumerate(weights)}, seed=0)
    return np.fromiter(itertools.islice(sampler, count), np.int64, count)


def _bound(weights: Sequence[float]) -> float:
    q = np.asarray(weights, np.float64) / sum(weights)
    positive = int((q > 0).sum())
    return float((1 + q * (positive - 2)).max())


# -- the run ------------------------------------------------------------------------------------


def _fmt(x: float | None, pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f}%" if pct else f"{x / 1e6:.2f}M"


def main(argv: Sequence[str] | None = None) -> int:
    """`python benchmarks/mix_bench.py [options]`: build the corpus, run every row, print the
    tables and write the JSON.

    Args:
        argv: The options; None means `sys.argv[1:]`. Defaults to None.

    Returns:
        int: the exit status.
    """
    from . import HOME

    parser = argparse.ArgumentParser(prog="benchmarks/mix_bench.py", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--caps-mb",
        default=",".join(str(c) for c in CAPS_MB),
        help="bytes of files per source, in MB (default %(default)s)",
    )
    parser.add_argument("--windows", default=",".join(str(k) for k in WINDOWS), help="K values (default %(default)s)")
    parser.add_argument(
        "--passes",
        type=int,
        default=4,
        help="passes over the corpus packed in the utilisation table (default %(default)s)",
    )
    parser.add_argument("--rows", type=int, default=4000, help="rows timed per throughput row (default %(default)s)")
    parser.add_argument(
        "--mix-positions", type=int, default=200_000, help="positions per mix row (default %(default)s)"
    )
    parser.add_argument(
        "--law-tokens",
        type=int,
        default=48_000_000,
        help="tokens drawn for each synthetic length law (default %(default)s)",
    )
    parser.add_argument(
        "--real-grain",
        action="store_true",
        help="run Grain's packers themselves in the utilisation table (slow: about 0.3 ms a piece)",
    )
    parser.add_argument("--quick", action="store_true", help="small caps and counts (a smoke run)")
    parser.add_argument(
        "--json",
        default=os.path.join(os.path.dirname(HOME), "build", "mixbench.json"),
        help="where the JSON goes (default build/mixbench.json)",
    )
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    caps = [float(x) for x in args.caps_mb.split(",")]
    windows = [int(k) for k in args.windows.split(",")]
    rows_timed, positions, passes, law_tokens = args.rows, args.mix_positions, args.passes, args.law_tokens
    if args.quick:
        caps, windows, rows_timed, positions, passes, law_tokens = [0.4, 0.2, 0.2], [16, 64], 200, 20_000, 1, 1_000_000
    report: dict[str, Any] = {"caps_mb": caps, "weights": list(WEIGHTS)}

    began = time.perf_counter()
    root = Path(sysconfig.get_path("purelib"))
    files = collect(root, caps)
    docs, how = tokenise(files, Path(os.path.dirname(HOME)) / "build" / "mixbench")
    print(
        f"corpus: {root} - {', '.join(f'{n}: {len(f)} files' for n, f in zip(SOURCES, files))}; "
        f"tokeniser {how}; {time.perf_counter() - began:.1f} s"
    )
    for line in length_table(docs):
        print("  " + line)
    report["lengths"] = {n: [len(d) for d in s] for n, s in zip(SOURCES, docs)}

    total_docs = sum(len(s) for s in docs) * passes
    laws = {"corpus": mixed_lengths(docs, WEIGHTS, total_docs)}
    for law in LAWS[1:]:
        laws[law] = law_lengths(law, law_tokens)
    print(
        f"\nlength laws (tokens a document): the corpus is the first {total_docs:,} documents of the token-weighted "
        f"mix {'/'.join(map(str, WEIGHTS))} ({passes} pass{'es' if passes != 1 else ''}, each source reshuffled per pass); the others are drawn "
        "(seed 0) up to about as many tokens"
    )
    print("  law               docs      tokens     mean    p10    p50    p90    p99      max  >2048  >8192")
    for law, n in laws.items():
        p = np.percentile(n, [10, 50, 90, 99]).astype(int)
        print(
            f"  {law:<15} {len(n):>6} {int(n.sum()):>11,} {n.mean():>8.0f} {p[0]:>6} {p[1]:>6} {p[2]:>6} {p[3]:>6} "
            f"{int(n.max()):>8} {100 * (n > 2048).mean():>5.1f}% {100 * (n > 8192).mean():>5.1f}%"
        )
    report["laws"] = {law: {"documents": len(n), "tokens": int(n.sum())} for law, n in laws.items()}

    checked = 300 if args.quick else 1500
    if not args.real_grain:
        differ = check_grain_model(laws, checked, min(windows))
        report["grain_model_differs"] = differ
        print(
            f"\nGrain's packers modelled: on the first {checked:,} pieces of each law, at seq_len "
            f"{' and '.join(map(str, SEQ_LENS))} with {min(windows)} bins, the model gives Grain 0.2.18's own rows "
            + ("exactly (best-fit and first-fit)" if not differ else "NOT: " + "; ".join(differ))
        )
    print(
        "\npacking utilisation (real tokens / row tokens) at the same bin count: stoker's windows of K rows "
        "(window_unit='rows') against Grain's K packing bins (both emit K rows at a time), the same pieces in the same "
        "order (documents longer than seq_len split into seq_len pieces for every packer); 'K documents': stoker's "
        "default unit, for reference" + (" (Grain itself)" if args.real_grain else " (Grain: the model checked above)")
    )
    print(
        "law             seq_len      K  stoker best_fit  stoker greedy  grain best_fit  grain first_fit  "
        "vs grain bf | stoker bf, K documents"
    )
    util: list[dict[str, Any]] = []
    for law, lengths in laws.items():
        for u in utilisation_rows(lengths, law, windows, args.real_grain):
            util.append(u)
            print(
                f"{law:<15} {u['seq_len']:>7} {u['K']:>6}  {_fmt(u['stoker_best_fit'], True):>15}  "
                f"{_fmt(u['stoker_greedy'], True):>13}  {_fmt(u['grain_best_fit'], True):>14}  "
                f"{_fmt(u['grain_first_fit'], True):>15}  {100 * (u['stoker_best_fit'] - u['grain_best_fit']):>+8.2f} pt"
                f" | {_fmt(u['stoker_best_fit_documents'], True):>10}"
            )
    report["utilisation"] = util
    behind = [u for u in util if u["stoker_best_fit"] < u["grain_best_fit"] - 0.005]
    worst = min(util, key=lambda u: u["stoker_best_fit"] - u["grain_best_fit"])
    print(
        "target: stoker best_fit (K rows) within 0.5 pt of Grain's best-fit at K bins: "
        + (
            "met in every row"
            if not behind
            else "MISSED at " + ", ".join(f"{u['law']} seq_len {u['seq_len']} K {u['K']}" for u in behind)
        )
        + f" (closest: {100 * (worst['stoker_best_fit'] - worst['grain_best_fit']):+.2f} pt, {worst['law']}, "
        f"seq_len {worst['seq_len']}, K {worst['K']})"
    )

    seq_len, k = 2048, 1024 if 1024 in windows else windows[-1]
    print(
        f"\nrow tokens per second (mix -> pack best_fit, seq_len {seq_len}, K {k}, batch {BATCH}, "
        f"{rows_timed:,} rows; Grain: K bins)"
    )
    rates: dict[str, float | None] = {}
    for name, fn in (
        ("stoker, 0 workers", lambda: stoker_rate(docs, seq_len, k, 0, rows_timed)),
        ("stoker, 2 workers", lambda: stoker_rate(docs, seq_len, k, 2, rows_timed)),
        ("grain, 1 thread", lambda: grain_rate(docs, seq_len, k, rows_timed, 0)),
        ("grain, 2 worker processes", lambda: grain_rate(docs, seq_len, k, rows_timed, 2)),
    ):
        try:
            rates[name] = fn()
        except Exception as exc:  # a baseline that fails says so in its row
            rates[name] = None
            print(f"  {name:<28} failed: {type(exc).__name__}: {exc}")
            continue
        print(f"  {name:<28} {_fmt(rates[name]):>9} tokens/s")
    report["tokens_per_s"] = rates
    best_stoker = max((v for n, v in rates.items() if n.startswith("stoker") and v), default=None)
    best_grain = max((v for n, v in rates.items() if n.startswith("grain") and v), default=None)
    if best_stoker and best_grain:
        ratio = best_stoker / best_grain
        print(f"  stoker's best / grain's best: {ratio:.1f}x (target >= 2x: {'met' if ratio >= 2 else 'MISSED'})")

    sizes = [len(s) for s in docs]
    print(
        f"\nmix deviation: largest |count - {DEVIATION_WINDOW} q| over every {DEVIATION_WINDOW} consecutive "
        f"documents of the first {positions:,} (weights of documents)"
    )
    settings: list[tuple[str, Any]] = [
        ("0.5/0.3/0.2", [0.5, 0.3, 0.2]),
        ("1/1/1", [1, 1, 1]),
        ("0.61/0.27/0.12", [0.61, 0.27, 0.12]),
        ("schedule", [(0, [0.47, 0.33, 0.2]), (positions // 2, [0.12, 0.27, 0.61])]),
    ]
    print(f"  {'weights':<16} {'stoker':>8} {'bound':>6} {'grain':>8} {'torchdata':>10}")
    devs: dict[str, dict[str, float | None]] = {}
    for label, weights in settings:
        row: dict[str, float | None] = {}
        if label == "schedule":
            row["stoker"] = scheduled_deviation(
                stoker_mix_sources(sizes, weights, positions), weights, DEVIATION_WINDOW
            )
            row["bound"] = max(_bound(w) for _, w in weights)
            row["grain"] = row["torchdata"] = None  # neither takes a schedule of weights
        else:
            row["bound"] = _bound(weights)
            for name, fn2 in (
                ("stoker", stoker_mix_sources),
                ("grain", grain_mix_sources),
                ("torchdata", torchdata_mix_sources),
            ):
                try:
                    row[name] = deviation(fn2(sizes, weights, positions), weights, DEVIATION_WINDOW)
                except Exception as exc:  # a baseline that fails says so in its row
                    row[name] = None
                    print(f"  {label}: {name} failed: {type(exc).__name__}: {exc}")
        devs[label] = row
        cells = [f"{row[k]:.2f}" if row[k] is not None else "-" for k in ("stoker", "bound", "grain", "torchdata")]
        print(f"  {label:<16} {cells[0]:>8} {cells[1]:>6} {cells[2]:>8} {cells[3]:>10}")
    within = all(
        r["stoker"] is not None and r["bound"] is not None and r["stoker"] <= r["bound"] for r in devs.values()
    )
    print(f"  stoker within the documented bound 1 + q(S'-2) in every row: {'yes' if within else 'NO'}")
    bound = max(float(r["bound"] or 0.0) for r in devs.values())
    report["deviation"] = devs
    report["deviation_bound"] = bound
    report["deviation_within_bound"] = within
    report["seconds"] = time.perf_counter() - began
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f)
    print(f"\n({report['seconds']:.0f} s; {args.json})")
    return 0
