"""Exact resume with worker processes: every start method, persistent or not, resumed with
another worker count (processes, threads, none), and a state carried to a new process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import stoker
from stoker.testing import assert_resumes_identically


class Numbers(stoker.Dataset):
    def __init__(self, n: int = 29) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([i, i * i])


@pytest.mark.parametrize("persistent", [False, True])
def test_process_workers_resume_exactly_with_other_worker_counts(start_method: str, persistent: bool) -> None:
    def make_loader(num_workers: int = 2):
        kwargs = {"multiprocessing_context": start_method, "persistent_workers": persistent} if num_workers else {}
        return stoker.DataLoader(Numbers(), batch_size=3, shuffle=True, generator=17, num_workers=num_workers, **kwargs)

    # 10 batches an epoch: inside the first epoch, at its very end, inside the second
    assert_resumes_identically(make_loader, steps=[4, 10, 13], worker_counts=[0, 1, 2], epochs=2)


def test_thread_workers_and_rollover_resume_exactly() -> None:
    def make_loader(num_workers: int = 2):
        return stoker.DataLoader(
            Numbers(),
            batch_size=4,
            shuffle=True,
            generator=3,
            last_batch="rollover",
            num_workers=num_workers,
            thread_pool=num_workers > 0,
        )

    assert_resumes_identically(make_loader, steps=[0, 3, 7, 8, 12], worker_counts=[0, 2], epochs=3)


def test_prefetched_next_epoch_of_persistent_workers_is_replayed() -> None:
    """With a generator-less sampler the next epoch's order comes from the global RNG when it
    is prefetched; a state taken after that prefetch must give that same order."""
    np.random.seed(5)
    start = np.random.get_state()

    def make_loader(num_workers: int = 2):
        np.random.set_state(start)  # each run from the same global RNG state
        return stoker.DataLoader(
            Numbers(12),
            batch_size=2,
            shuffle=True,
            num_workers=num_workers,
            persistent_workers=num_workers > 0,
            prefetch_factor=4 if num_workers else None,
            auto_reload=num_workers > 0,
        )

    # persistent both ways: a non-persistent loader draws a base seed from the global RNG each
    # epoch (as torch does), so with a generator-less sampler later epochs would differ
    assert_resumes_identically(make_loader, steps=[5, 6, 7], worker_counts=[2, 1], epochs=3)


CHILD = """
import json, sys
import numpy as np
sys.path.insert(0, {tests!r})
import stoker
from integration.test_resume_workers import Numbers

def make():
    return stoker.DataLoader(Numbers(), batch_size=3, shuffle=True, generator=8, num_workers=2,
                             multiprocessing_context="spawn")

if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    loader = make()
    if mode == "save":
        it = iter(loader)
        seen = [next(it).tolist() for _ in range(4)]
        with open(path, "w") as f:
            json.dump(loader.state_dict(), f)
        print(json.dumps(seen))
    else:
        with open(path) as f:
            loader.load_state_dict(json.load(f))
        print(json.dumps([b.tolist() for b in loader] + [b.tolist() for b in loader]))
"""


@pytest.mark.timeout(120)
def test_a_state_file_from_one_process_resumes_in_another_under_spawn(tmp_path) -> None:
    import os

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD.format(tests=tests)))
    state = tmp_path / "state.json"

    def child(mode: str) -> list:
        out = subprocess.run(
            [sys.executable, str(script), mode, str(state)], capture_output=True, text=True, timeout=90
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    head = child("save")
    rest = child("load")
    loader = stoker.DataLoader(Numbers(), batch_size=3, shuffle=True, generator=8)
    reference = [b.tolist() for b in loader] + [b.tolist() for b in loader]
    assert head + rest == reference
