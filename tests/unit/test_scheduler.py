"""The scheduler alone: windows, assignment, ordering, iterable exhaustion, epochs."""

from __future__ import annotations

import random

import pytest

from stoker._core.protocol import Done, Exhausted, Failed, Reset, Task
from stoker._core.scheduler import Scheduler


def batches(n: int, size: int = 2):
    return iter([list(range(i * size, (i + 1) * size)) for i in range(n)])


def run_to_end(s: Scheduler, order=None, rng=None):
    """Drive a scheduler with instant workers that reply in `order` ('fifo' or shuffled)."""
    out, pending = [], []
    while True:
        for worker, msg in s.dispatch():
            if isinstance(msg, Task):
                pending.append((worker, msg))
        if rng is not None:
            rng.shuffle(pending)
        while pending:
            worker, task = pending.pop(0)
            s.complete(worker, Done(task.task_id, task.index))
        got = s.deliver()
        while got is not None:
            out.append(got[1].payload)
            got = s.deliver()
        if s.current_finished():
            s.finish_epoch()
            return out


def test_window_limits_dispatch():
    s = Scheduler(num_workers=2, window=4)
    s.begin_epoch(batches(10))
    sent = s.dispatch()
    assert [w for w, _ in sent] == [0, 1, 0, 1]
    assert [m.task_id for _, m in sent] == [0, 1, 2, 3]
    assert s.dispatch() == []  # window full until something is delivered
    s.complete(1, Done(1, "b1"))
    assert s.deliver() is None  # in order: task 0 first
    assert s.dispatch() == []  # a ready batch still holds its window slot
    s.complete(0, Done(0, "b0"))
    assert s.deliver()[1].payload == "b0"
    assert s.deliver()[1].payload == "b1"
    assert [m.task_id for _, m in s.dispatch()] == [4, 5]


@pytest.mark.parametrize("seed", range(5))
def test_in_order_delivery_whatever_completion_order(seed):
    s = Scheduler(num_workers=3, window=6)
    s.begin_epoch(batches(20))
    assert run_to_end(s, rng=random.Random(seed)) == [list(range(i * 2, i * 2 + 2)) for i in range(20)]


def test_out_of_order_delivers_each_batch_exactly_once():
    s = Scheduler(num_workers=3, window=6, in_order=False)
    s.begin_epoch(batches(20))
    out = run_to_end(s, rng=random.Random(1))
    assert sorted(map(tuple, out)) == [tuple(range(i * 2, i * 2 + 2)) for i in range(20)]


def test_out_of_order_prefers_least_loaded_worker():
    s = Scheduler(num_workers=2, window=4, in_order=False)
    s.begin_epoch(batches(10))
    first = s.dispatch()
    assert sorted(w for w, _ in first) == [0, 0, 1, 1]
    # worker 1 answers both; worker 0 is slow
    for w, m in first:
        if w == 1:
            s.complete(1, Done(m.task_id, m.index))
    assert s.deliver() is not None and s.deliver() is not None
    assert [w for w, _ in s.dispatch()] == [1, 1]


def test_failure_is_delivered_in_order():
    s = Scheduler(num_workers=2, window=4)
    s.begin_epoch(batches(4))
    sent = s.dispatch()
    s.complete(1, Failed(1, "boom"))
    s.complete(0, Done(0, "b0"))
    assert isinstance(s.deliver()[1], Done)
    index, reply = s.deliver()
    assert isinstance(reply, Failed) and index == sent[1][1].index


def test_empty_epoch_finishes_immediately():
    s = Scheduler(num_workers=2, window=4)
    s.begin_epoch(iter([]))
    assert s.dispatch() == []
    assert s.current_finished()


def test_iterable_round_robin_skips_exhausted_workers():
    s = Scheduler(num_workers=2, window=4, iterable_index=8)
    s.begin_epoch()
    sent = s.dispatch()
    assert [(w, m.index) for w, m in sent] == [(0, 8), (1, 8), (0, 8), (1, 8)]
    s.complete(0, Done(0, "w0-a"))
    s.complete(1, Exhausted(1))  # worker 1 had nothing at all
    s.complete(0, Done(2, "w0-b"))
    s.complete(1, Exhausted(3))
    out = []
    while (got := s.deliver()) is not None:
        out.append(got[1].payload)
    assert out == ["w0-a", "w0-b"]
    again = s.dispatch()
    assert [w for w, _ in again] == [0, 0, 0, 0]  # only worker 0 is still active
    for _, m in again:
        s.complete(0, Exhausted(m.task_id))
    assert s.deliver() is None
    assert s.current_finished()


def test_next_epoch_prefetch_shares_the_window():
    s = Scheduler(num_workers=1, window=3)
    s.begin_epoch(batches(2))
    sent = s.dispatch()
    assert len(sent) == 2 and s.dispatching_done()
    s.begin_epoch(batches(2))
    assert [m.task_id for _, m in s.dispatch()] == [2]  # one slot left in the window
    for _, m in sent:
        s.complete(0, Done(m.task_id, m.index))
    assert s.deliver() is not None and s.deliver() is not None
    assert s.current_finished()
    s.finish_epoch()
    assert s.current_epoch == 1


def test_iterable_epoch_after_first_resets_workers_before_tasks():
    s = Scheduler(num_workers=2, window=2, iterable_index=None)
    s.begin_epoch()
    for w, m in s.dispatch():
        s.complete(w, Exhausted(m.task_id))
    assert s.deliver() is None and s.current_finished()
    s.finish_epoch()
    s.begin_epoch(reset_workers=True)
    kinds = [(w, type(m).__name__) for w, m in s.dispatch()]
    assert kinds[:2] == [(0, "Reset"), (1, "Reset")]
    assert all(k == "Task" for _, k in kinds[2:])


def test_abandoned_epoch_drops_late_replies_and_frees_window():
    s = Scheduler(num_workers=2, window=2)
    s.begin_epoch(batches(10))
    sent = s.dispatch()
    s.abandon_epoch()
    assert s.in_flight == 0
    s.begin_epoch(batches(1))
    new = s.dispatch()
    assert len(new) == 1
    for w, m in sent:  # late replies of the abandoned epoch are ignored
        s.complete(w, Done(m.task_id, "stale"))
    w, m = new[0]
    s.complete(w, Done(m.task_id, "fresh"))
    assert s.deliver()[1].payload == "fresh"
    assert s.current_finished()


def test_reply_from_wrong_worker_is_rejected():
    s = Scheduler(num_workers=2, window=2)
    s.begin_epoch(batches(2))
    s.dispatch()
    with pytest.raises(ValueError, match="belongs to worker 0"):
        s.complete(1, Done(0, None))


def test_waiting_for_names_task_and_worker():
    s = Scheduler(num_workers=2, window=2)
    s.begin_epoch(batches(3))
    s.dispatch()
    w = s.waiting_for()
    assert (w.task_id, w.worker_id, w.index, w.batch) == (0, 0, [0, 1], 0)


def test_reset_message_type():
    assert Reset() == Reset()


# ------------------------------------------------------------- lost workers
def lost(owed) -> Failed:
    return Failed(owed.task_id, ("lost", owed.batch, owed.index))  # type: ignore[arg-type]


def test_batch_b_of_every_epoch_goes_to_worker_b_mod_n_with_next_epoch_prefetch():
    s = Scheduler(num_workers=3, window=6)
    s.begin_epoch(batches(7))
    first = s.dispatch()
    assert [w for w, _ in first] == [0, 1, 2, 0, 1, 2]
    for w, t in first:
        s.complete(w, Done(t.task_id, t.index))
    for _ in range(6):
        s.deliver()
    sent = s.dispatch()  # batch 6, then the epoch's end is found
    assert [w for w, _ in sent] == [0]
    s.begin_epoch(batches(7))  # prefetched while epoch 0 is still delivering
    assert [w for w, _ in s.dispatch()][:5] == [0, 1, 2, 0, 1]


def test_a_lost_worker_fails_at_its_first_owed_position_after_earlier_batches():
    s = Scheduler(num_workers=2, window=6)
    s.begin_epoch(batches(10))
    sent = s.dispatch()
    for w, t in sent:
        if w == 0:
            s.complete(w, Done(t.task_id, t.index))
    assert [o.batch for o in s.owed(1)] == [1, 3, 5]
    s.lose_worker(1, lost)
    assert s.dispatch() == []  # a failure is queued: nothing more is sent
    first = s.deliver()
    assert first is not None and isinstance(first[1], Done) and first[1].task_id == 0
    second = s.deliver()
    assert second is not None and second[1].error == ("lost", 1, [2, 3])


def test_a_lost_worker_owing_nothing_fails_the_next_batch_it_would_be_given():
    s = Scheduler(num_workers=2, window=2)
    s.begin_epoch(batches(10))
    for w, t in s.dispatch():
        s.complete(w, Done(t.task_id, t.index))
    s.lose_worker(1, lost)  # it owed nothing
    assert s.deliver()[1].task_id == 0
    assert s.deliver()[1].task_id == 1
    sent = s.dispatch()
    assert [w for w, _ in sent] == [0]  # batch 2 to worker 0; batch 3 (worker 1's) failed at once
    assert s.dispatch() == []
    w, t = sent[0]
    s.complete(w, Done(t.task_id, t.index))
    assert s.deliver()[1].task_id == 2
    assert s.deliver()[1].error == ("lost", 3, [6, 7])


def test_unordered_delivery_gives_every_live_batch_before_a_lost_workers_failure():
    s = Scheduler(num_workers=2, window=6, in_order=False)
    s.begin_epoch(batches(10))
    sent = s.dispatch()
    owed = len(s.owed(1))
    s.lose_worker(1, lost)
    live = [(w, t) for w, t in sent if w == 0]
    assert live
    assert s.deliver() is None  # the failure waits while live workers' tasks are unresolved
    out = []
    for w, t in live:
        s.complete(w, Done(t.task_id, t.index))
        got = s.deliver()
        while got is not None:
            out.append(got[1])
            got = s.deliver()
    assert [type(r) for r in out] == [Done] * len(live) + [Failed] * owed
    assert out[-1].error[0] == "lost"


def test_resize_moves_the_rest_of_an_epoch_to_more_workers() -> None:
    s = Scheduler(1, 1)
    s.begin_epoch(iter([[b] for b in range(7)]))
    first = s.dispatch()
    assert [w for w, _ in first] == [0]
    with pytest.raises(RuntimeError, match="outstanding"):
        s.resize(3, 6)  # task 0 is not answered yet
    s.complete(0, Done(first[0][1].task_id, "b0"))
    assert s.deliver() is not None
    s.resize(3, 6)
    sent = s.dispatch()
    # batch b goes to worker b mod 3, the window is 6
    assert [(w, m.batch) for w, m in sent] == [(1, 1), (2, 2), (0, 3), (1, 4), (2, 5), (0, 6)]
    with pytest.raises(ValueError, match="at least one worker"):
        s.resize(0, 1)


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_upcoming_is_what_deliver_gives_next_and_delivers_nothing(in_order, seed):
    rng = random.Random(seed)
    s = Scheduler(num_workers=3, window=6, in_order=in_order)
    s.begin_epoch(batches(20))
    pending: list = []
    delivered = 0
    while delivered < 20:
        pending += [(w, m) for w, m in s.dispatch() if isinstance(m, Task)]
        rng.shuffle(pending)
        for _ in range(rng.randint(0, len(pending))):
            worker, task = pending.pop()
            s.complete(worker, Done(task.task_id, task.index))
        upcoming = s.upcoming()
        assert s.upcoming() is upcoming  # asking twice delivers nothing
        got = s.deliver()
        assert (got is None and upcoming is None) or (got is not None and got[1] is upcoming)
        delivered += got is not None
    assert s.upcoming() is None


def test_upcoming_steps_over_an_exhausted_gap():
    s = Scheduler(num_workers=2, window=4, iterable_index=None)
    s.begin_epoch(None)
    sent = [m for _, m in s.dispatch()]
    s.complete(0, Exhausted(sent[0].task_id))
    s.complete(1, Done(sent[1].task_id, "b1"))
    assert s.upcoming().payload == "b1"
    assert s.deliver()[1].payload == "b1"
