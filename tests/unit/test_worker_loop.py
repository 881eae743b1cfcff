"""The worker loop run in-process, with lists standing in for channels."""

from __future__ import annotations

import random

import numpy as np
import pytest

from stoker._core.errors import ExceptionInfo, WorkerError
from stoker._core.protocol import Done, Exhausted, Failed, ReplicaBatch, Reset, Stop, Task
from stoker._core.worker import WorkerConfig, get_worker_info, run_worker


def collate(samples):
    return list(samples)


def make_config(dataset, kind="map", worker_init_fn=None, thread=True, drop_last=False):
    return WorkerConfig(
        worker_id=1,
        num_workers=3,
        base_seed=100,
        dataset=dataset,
        dataset_kind=kind,
        auto_collation=True,
        collate_fn=collate,
        drop_last=drop_last,
        worker_init_fn=worker_init_fn,
        thread=thread,
    )


def run(config, requests):
    inbox = [*requests, Stop()]
    out = []
    run_worker(config, lambda timeout: inbox.pop(0), out.append)
    return out


class Squares:
    def __getitem__(self, i):
        if i == 13:
            raise KeyError("thirteen")
        return i * i

    def __len__(self):
        return 20


def test_each_task_gets_one_reply_in_order():
    replies = run(make_config(Squares()), [Task(0, [1, 2]), Task(1, [3])])
    assert replies == [Done(0, [1, 4]), Done(1, [9])]


def test_exception_is_recorded_with_worker_and_indices_and_loop_continues():
    replies = run(make_config(Squares()), [Task(0, [12, 13]), Task(1, [2])])
    assert isinstance(replies[0], Failed) and replies[1] == Done(1, [4])
    error = replies[0].error
    assert isinstance(error, ExceptionInfo)
    rebuilt = error.rebuild()
    assert type(rebuilt) is KeyError
    assert "worker 1" in str(rebuilt) and "[12, 13]" in str(rebuilt) and "thirteen" in str(rebuilt)
    assert "__getitem__" in str(rebuilt.__cause__)


def test_worker_init_fn_failure_answers_every_task():
    def init(worker_id):
        raise ValueError(f"init {worker_id}")

    replies = run(make_config(Squares(), worker_init_fn=init), [Task(0, [1]), Task(1, [2])])
    assert [type(r) for r in replies] == [Failed, Failed]
    rebuilt = replies[1].error.rebuild()
    assert type(rebuilt) is ValueError and "worker_init_fn" in str(rebuilt) and "init 1" in str(rebuilt)


def test_worker_info_visible_inside_and_cleared_after():
    seen = []

    class Probe:
        def __getitem__(self, i):
            seen.append(get_worker_info())
            return i

    run(make_config(Probe()), [Task(0, [0])])
    info = seen[0]
    assert (info.id, info.num_workers, info.seed) == (1, 3, 101)
    assert get_worker_info() is None


class Stream:
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def _plain(replies):
    """(kind, task, batch) of each reply: an iterable replica's batch comes with its record
    (see replica), checked apart."""
    out = []
    for reply in replies:
        if isinstance(reply, Done):
            assert isinstance(reply.payload, ReplicaBatch)
            out.append(("done", reply.task_id, reply.payload.batch))
        else:
            assert isinstance(reply, Exhausted)
            out.append(("end", reply.task_id, None))
    return out


def test_iterable_exhaustion_partial_batch_and_reset():
    replies = run(
        make_config(Stream(5), kind="iterable"),
        [Task(0, 2), Task(1, 2), Task(2, 2), Task(3, 2), Reset(), Task(4, 2)],
    )
    assert _plain(replies) == [
        ("done", 0, [0, 1]),
        ("done", 1, [2, 3]),
        ("done", 2, [4]),
        ("end", 3, None),
        ("done", 4, [0, 1]),
    ]
    # each batch says how far the stream got; the one it ended in says so, once
    records = [r.payload.record for r in replies if isinstance(r, Done)]
    assert [(rec.drawn, rec.ended) for rec in records] == [(2, False), (4, False), (5, True), (2, False)]
    assert replies[3].record is None  # the end was reported with the batch it happened in


def test_iterable_drop_last_discards_partial_batch():
    replies = run(make_config(Stream(3), kind="iterable", drop_last=True), [Task(0, 2), Task(1, 2)])
    assert _plain(replies) == [("done", 0, [0, 1]), ("end", 1, None)]
    assert replies[1].record is not None and replies[1].record.ended  # the stream's end, with no batch


def test_process_worker_seeds_globals_from_base_seed():
    draws = []

    class Draw:
        def __getitem__(self, i):
            draws.append((random.random(), float(np.random.random())))
            return i

    state = random.getstate(), np.random.get_state()
    try:
        run(make_config(Draw(), thread=False), [Task(0, [0])])
        run(make_config(Draw(), thread=False), [Task(0, [0])])
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
    assert draws[0] == draws[1]


def test_stop_iteration_in_worker_does_not_end_the_users_loop():
    class Bad:
        def __getitem__(self, i):
            raise StopIteration

    replies = run(make_config(Bad()), [Task(0, [0])])
    rebuilt = replies[0].error.rebuild()
    assert isinstance(rebuilt, WorkerError) and not isinstance(rebuilt, StopIteration)


def test_exception_needing_several_arguments_still_rebuilds():
    class Picky(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}/{b}")

    class Bad:
        def __getitem__(self, i):
            raise Picky(1, 2)

    replies = run(make_config(Bad()), [Task(0, [0])])
    rebuilt = replies[0].error.rebuild()
    assert "1/2" in str(rebuilt) or "1/2" in "".join(getattr(rebuilt, "__notes__", []))
    assert isinstance(rebuilt, (Picky, WorkerError))


@pytest.mark.parametrize("timeout_polls", [3])
def test_idle_worker_exits_when_parent_is_gone(timeout_polls):
    polls = []

    def receive(timeout):
        polls.append(timeout)
        return None

    run_worker(make_config(Squares()), receive, lambda r: None, parent_alive=lambda: len(polls) < timeout_polls)
    assert len(polls) == timeout_polls
