"""The Hugging Face Trainer's training steps on the CPU, its own torch DataLoader against
stoker's (`stoker.torch.adopt(trainer)`), at 0 and 2 workers, repetitions interleaved.

The model is a tiny GPT-2 built from a config (2 layers, 128 wide, random weights: nothing is
downloaded); each sample is 128 token ids made by a few hundred microseconds of numpy work (a
stand-in for tokenising and packing text), so that loading is part of the step. Prints
samples/s, milliseconds per step and stoker's ratio over torch's per worker count. Runs in the
default environment (no thread settings).

    python benchmarks/trainer_step.py [--steps 40] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

SEQUENCE = 128
VOCAB = 2048
BATCH = 16


class Texts(torch.utils.data.Dataset):
    """Sample i: SEQUENCE token ids drawn and mixed by numpy, a few hundred µs of CPU each."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> dict[str, Any]:
        rng = np.random.default_rng(i)
        words = rng.integers(0, VOCAB, size=4096)
        for _ in range(6):  # "tokenising": hashing and merging passes over the text
            words = (words * 1103515245 + 12345) % VOCAB
            words = np.sort(words[: len(words) // 2 * 2].reshape(-1, 2), axis=1).ravel()
        ids = torch.from_numpy(words[:SEQUENCE].astype(np.int64))
        return {"input_ids": ids, "labels": ids}


def run(loader: str, workers: int, steps: int) -> float:
    """Seconds per step over `steps` steps after 5 warm ones."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    import stoker.torch

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=128, n_head=2, vocab_size=VOCAB, n_positions=SEQUENCE)
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            times.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=BATCH,
            max_steps=steps + 5,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=workers,
            remove_unused_columns=False,
        )
        trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Texts(), callbacks=[Clock()])
        if loader == "stoker":
            stoker.torch.adopt(trainer)
        trainer.train()
    return (times[-1] - times[4]) / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--reps", type=int, default=3)
    options = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results: dict[tuple[str, int], list[float]] = {}
    for rep in range(options.reps):
        for workers in (0, 2):
            for loader in ("torch", "stoker"):
                seconds = run(loader, workers, options.steps)
                results.setdefault((loader, workers), []).append(seconds)
                print(f"rep {rep + 1}: {loader} workers={workers}: {1000 * seconds:.1f} ms/step", file=sys.stderr)
    print(
        f"Trainer step, tiny GPT-2 (2 x 128), batch {BATCH} of {SEQUENCE} tokens, CPU, "
        f"{options.steps} steps after 5, {options.reps} repetitions interleaved; {os.cpu_count()} CPUs"
    )
    print(f"{'loader':<8}{'workers':>8}{'ms/step':>10}{'samples/s':>11}{'vs torch':>10}")
    for workers in (0, 2):
        base = statistics.median(results[("torch", workers)])
        for loader in ("torch", "stoker"):
            seconds = statistics.median(results[(loader, workers)])
            print(f"{loader:<8}{workers:>8}{1000 * seconds:>10.1f}{BATCH / seconds:>11.0f}{base / seconds:>10.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
