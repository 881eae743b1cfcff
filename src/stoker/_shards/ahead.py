"""Downloads ahead of a `ShardedDataset`'s readers, in the loader's process.

The loader tells the dataset each batch's indices as its sampler draws them (`stoker_upcoming`,
the look-ahead hook); `DownloadsAhead` downloads the shards those batches need, in the order they are
needed, a few threads at a time (`DaemonPool`, each shard in parallel ranges:
`download_parts`), and leases each one (a pin in the cache) until the samples drawn from it
have been read. Readers in any process count their reads in a small file of their own
(`Reads`); `DownloadsAhead` sums them (`Tally`) to end each lease, so eviction takes only shards
that no unread batch needs, and never the window being read.
"""

from __future__ import annotations

import collections
import itertools
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, BinaryIO

import numpy as np

from .._base.process import at_fork


def download_parts(
    read: Callable[[str, int, int], bytes], name: str, size: int, part: int, parallel: int, out: BinaryIO
) -> int:
    """Download object `name` into `out` as ranges of `part` bytes, `parallel` requests in
    flight, written in order: an object store serves each connection at a bounded rate, so one
    shard arrives several times faster over several connections. At most `parallel` + 1 parts
    are held in memory. `read(name, start, end)` reads one range (`Store.read`)."""
    starts = range(0, size, part)
    pool = DaemonPool(parallel, "stoker-parts")
    try:
        pending: collections.deque[Future[bytes]] = collections.deque()
        parts = iter(starts)
        for start in itertools.islice(parts, parallel):
            pending.append(pool.submit(read, name, start, min(size, start + part)))
        written = 0
        try:
            while pending:
                data = pending.popleft().result()
                out.write(data)
                written += len(data)
                for start in itertools.islice(parts, 1):
                    pending.append(pool.submit(read, name, start, min(size, start + part)))
        finally:
            for job in pending:
                job.cancel()
    finally:
        pool.shutdown()
    return written


class DaemonPool:
    """Up to `threads` daemon threads running submitted calls, in order, that exist only while
    there is work: a thread ends when it finds the queue empty, and `submit` starts one when
    fewer than `threads` run. So no idle download thread outlives an epoch's last download
    (and is there when the user's process forks), and none holds up the interpreter's exit, as
    ThreadPoolExecutor's do: a download under way when the program ends is abandoned, and the
    cache removes its temporary file later (its lock went with the process)."""

    def __init__(self, threads: int, name: str) -> None:
        self.most = threads
        self.name = name
        self.queue: collections.deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = collections.deque()
        self.lock = threading.Lock()
        self.live = 0
        self.started = 0
        self.closed = False
        self.threads: list[threading.Thread] = []  # started, not yet seen ended by wait_idle

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        job: Future[Any] = Future()
        with self.lock:
            if self.closed:
                job.cancel()
                return job
            self.queue.append((job, fn, args))
            if self.live < self.most:
                self.live += 1
                self.started += 1
                thread = threading.Thread(target=self._run, name=f"{self.name}-{self.started}", daemon=True)
                self.threads = [t for t in self.threads if t.is_alive()]
                self.threads.append(thread)
                thread.start()
        return job

    def wait_idle(self, timeout: float) -> None:
        """Wait, at most `timeout` seconds, for every thread to end (the calls under way, and
        those queued, to finish): before a fork, so that none runs in the forking process."""
        deadline = time.monotonic() + timeout
        with self.lock:
            threads = list(self.threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            _wait_exited(thread)

    def _run(self) -> None:
        while True:
            with self.lock:
                if not self.queue:
                    self.live -= 1
                    return
                job, fn, args = self.queue.popleft()
            if not job.set_running_or_notify_cancel():
                continue
            try:
                job.set_result(fn(*args))
            except BaseException as exc:
                job.set_exception(exc)

    def shutdown(self) -> None:
        """Cancel what has not started; the threads end after what they are running."""
        with self.lock:
            self.closed = True
            waiting, self.queue = self.queue, collections.deque()
        for job, _, _ in waiting:
            job.cancel()


class Reads:
    """How many samples of each shard one process has read: an array of int64 in a file of its
    own, `reads/<key>.<pid>` in the cache folder, that only this process writes and the
    loader's process (its `DownloadsAhead`) maps and sums, to end each lease once the samples drawn
    from its shard are read. Reading costs one increment a sample. Nothing is counted when no
    loader downloads ahead for the dataset (no file `reads/<key>` marks it: a dataset read by
    torch's loader leaves no file), or when the file cannot be made: leases then end only as
    the loader's window moves on."""

    def __init__(self, folder: str, key: str, shards: int) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.counts: np.ndarray | None = None
        self._map: mmap.mmap | None = None
        if not os.path.exists(os.path.join(folder, key)):
            return
        try:
            path = os.path.join(folder, f"{key}.{self.pid}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                os.ftruncate(fd, 8 * max(1, shards))
                self._map = mmap.mmap(fd, 8 * max(1, shards))
            finally:
                os.close(fd)
            self.counts = np.frombuffer(self._map, dtype=np.int64)
        except (OSError, ValueError):
            self.counts = None

    def add(self, number: int) -> None:
        counts = self.counts
        if counts is not None:
            with self.lock:  # thread workers share the process's file
                counts[number] += 1

    def close(self) -> None:
        if self._map is not None:  # called in the process that made it (see PerProcess)
            self.counts = None
            try:
                self._map.close()
            except BufferError:  # a view is still alive: the mapping goes with it
                pass
        self._map = None


class Tally:
    """The loader's process's sum of the read counts of the processes reading for it (files
    `reads/<key>.<pid>`, see `Reads`). A reader that has exited has its counts added to a
    running total and its file removed; files left by a loader's process that died are
    removed when another one starts counting in the folder."""

    def __init__(self, folder: str, key: str, shards: int) -> None:
        self.folder, self.key, self.shards = folder, key, shards
        self.done = np.zeros(shards, dtype=np.int64)  # what exited readers read
        self.live: dict[str, tuple[int, np.ndarray]] = {}  # file name -> (pid, its counts)
        try:
            names = os.listdir(folder)
        except OSError:
            names = []
        for name in names:  # "<loader pid>-<token>" (a loader's mark) and ".<reader pid>"
            if not _alive(name.split("-", 1)[0]):
                _unlink(os.path.join(folder, name))
        try:  # the mark that tells readers to count
            os.makedirs(folder, exist_ok=True)
            os.close(os.open(os.path.join(folder, key), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
        except OSError:
            pass

    def total(self) -> np.ndarray:
        try:
            names = [n for n in os.listdir(self.folder) if n.startswith(self.key + ".") and n not in self.live]
        except OSError:
            names = []
        for name in names:
            try:
                with open(os.path.join(self.folder, name), "rb") as file:
                    view = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError):  # not sized yet: seen at the next look
                continue
            if len(view) >= 8 * self.shards:
                self.live[name] = (int(name.rsplit(".", 1)[1]), np.frombuffer(view, dtype=np.int64, count=self.shards))
        total = self.done.copy()
        for name, (pid, counts) in list(self.live.items()):
            total += counts
            if pid != os.getpid() and not _alive(str(pid)):  # its counts are final
                self.done += counts
                del self.live[name]
                _unlink(os.path.join(self.folder, name))
        return total

    def close(self) -> None:
        self.live.clear()
        try:
            names = [n for n in os.listdir(self.folder) if n == self.key or n.startswith(self.key + ".")]
        except OSError:
            names = []
        for name in names:
            _unlink(os.path.join(self.folder, name))


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (ValueError, OverflowError):  # not a pid: not one of these files
        return True
    except PermissionError:  # another user's process
        return True
    return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class DownloadsAhead:
    """The downloads ahead of one loader's batches, in its process, and the leases that keep
    their shards in the cache until the batches are read.

    Each shard a drawn batch needs is leased (`ShardCache.lease`: downloaded if absent, then
    pinned), in the order the batches need them. A lease ends when the samples drawn from its
    shard have all been read (the readers count their reads in files this sums, see
    `Reads`), or when every batch needing it has left the loader's window (`behind`): so the
    shards being read are never evicted to make room for those drawn ahead, whatever the
    workers, ranks or timestamps do, and each shard is downloaded once per epoch when the cache
    holds about two windows.

    The leases of every process on the machine are held to the cap less the largest shard: a
    lease that would pass it is skipped (nothing downloaded, nothing evicted) and tried again
    once a lease has ended. So a reader that needs a shard nobody leased (the cap too small for
    a window, or another rank's leases ahead) finds room by evicting shards nobody leases, and
    never waits for a lease to end: a worker of another rank, waiting at a barrier with this
    one, cannot deadlock against it. The lookahead stops at half the cap. Leases are pins, held
    by an open file's lock: the kernel drops them with the process. A thread watches the read
    counts while a lease is held or wanted (between draws, and after the epoch's last draw), and
    stops when nothing is read or drawn for `STALL_S` (an iterator dropped half-way leaves
    batches drawn that nobody reads: no thread goes on watching them). Nor does the watch run
    while this process forks (a loader's fork workers, the user's `os.fork()`): it is stopped
    and joined just before, and the next draw starts it again (see `_quiet_for_fork`)."""

    WATCH_S = 0.02  # how often the read counts are looked at while a lease is held or wanted
    RETRY_S = 0.25  # how often a skipped lease is tried again when none of ours ended
    # a watch that sees no sample read and no batch drawn for this long stops (the iterator was
    # dropped, or the step is long): the next draw starts it again; leases are kept till then
    STALL_S = 3.0

    def __init__(
        self,
        starts: np.ndarray,
        sizes: Sequence[int],
        lease_shard: Callable[[int, Callable[[bool], None]], bool],
        unpin_shard: Callable[[int], None],
        tally: Tally,
        threads: int,
    ) -> None:
        """
        Args:
            starts: The index of each shard's first sample (int64, ascending).
            sizes: Each shard's size in bytes.
            lease_shard: `lease_shard(number, decided)` pins shard `number` (downloading it
                first) if the cache's leases leave room for it, calls `decided(fits)` as soon
                as that is known, and returns whether it pinned.
            unpin_shard: `unpin_shard(number)` ends a pin `lease_shard` took.
            tally: The sum of the read counts of the processes reading for this one.
            threads: How many downloads run at once.
        """
        self.starts = starts
        self.sizes = sizes
        self.lease_shard = lease_shard
        self.unpin_shard = unpin_shard
        self.pool = DaemonPool(threads, "stoker-shards")
        self.lock = threading.Lock()
        self.batches: collections.deque[tuple[int, ...]] = collections.deque()  # drawn, maybe unread
        self.uses: collections.Counter[int] = collections.Counter()  # shard -> those batches needing it
        shards = len(sizes)
        self.drawn_samples = np.zeros(shards, dtype=np.int64)  # drawn from each shard so far
        self.read = np.zeros(shards, dtype=np.int64)  # read from each shard, as last summed
        self.tally = tally
        self.jobs: dict[int, Future[bool]] = {}  # shard -> its lease being taken
        self.leased: set[int] = set()  # shards this process pins for the batches
        self.retried = 0.0
        self.progress = time.monotonic()  # the last draw, or the last read the watch saw
        self.watching = False
        self.watcher: threading.Thread | None = None
        self.forking = False  # between the before- and after-fork hooks: no watch runs
        self.wake = threading.Event()  # set: the watch stops now (a fork is coming)
        self.closed = False
        # leases are decided one after another in the order needed (their downloads overlap):
        # a shard needed later never takes the room of one needed sooner
        self.turns = threading.Condition()
        self.tickets = 0  # handed out
        self.turn = 0  # the ticket whose lease is being decided
        self.round = 0
        self.blocked = -1  # the last round in which a lease did not fit: its later ones wait

    def drawn(self, indices: list[int], behind: int, prefetch_shards: int, cache_bytes: int) -> bool:
        """A batch drawn (its sample indices), `behind` earlier batches maybe still unread: lease
        the shards they need. True when the drawing should go on: fewer than `prefetch_shards`
        shards are wanted beyond the oldest batch's, and they fill at most half `cache_bytes`."""
        found = np.searchsorted(self.starts, np.asarray(indices, dtype=np.int64), side="right") - 1
        numbers = tuple(dict.fromkeys(found.tolist()))
        with self.lock:
            self.progress = time.monotonic()
            np.add.at(self.drawn_samples, found, 1)
            self.batches.append(numbers)
            for s in numbers:
                self.uses[s] += 1
            while len(self.batches) > behind + 1:
                for s in self.batches.popleft():
                    self.uses[s] -= 1
                    if self.uses[s] <= 0:
                        del self.uses[s]
            wanted, ended = self._settle(retry=True)
            # look further while fewer than prefetch_shards shards are wanted beyond those of
            # the oldest batch that still needs one, and the wanted shards fill at most half
            # the cap
            first = next((b for b in self.batches if any(s in wanted for s in b)), ())
            ahead = set(wanted) - set(first)
            live = sum(self.sizes[s] for s in wanted)
            more = len(ahead) < prefetch_shards and 2 * live < cache_bytes
            self._watch_if_needed()
        self._unpin(ended)
        return more

    def pause_for_fork(self) -> None:
        """Stop the watch and wait for its thread to end (it ends within one look at the read
        counts); none starts until `resume_after_fork`. Leases are kept. Then wait a moment for
        the download threads: between epochs a lease taken for the last batches may still be
        settling; a download under way mid-epoch is not waited for past `_FORK_POOL_WAIT_S`."""
        with self.lock:
            self.forking = True
            thread = self.watcher
        if thread is not None and thread is not threading.current_thread():
            self.wake.set()
            thread.join(timeout=_FORK_JOIN_S)
            _wait_exited(thread)
        self.pool.wait_idle(_FORK_POOL_WAIT_S)

    def resume_after_fork(self) -> None:
        """In the parent after a fork: the next draw starts the watch again. Not this hook: a
        thread started here would run at Python's check for threads, just after the hooks."""
        with self.lock:
            self.forking = False
            self.wake.clear()

    def _settle(self, retry: bool) -> tuple[dict[int, None], list[int]]:
        """Under the lock: the shards unread batches still need, in the order needed; the
        leases that end (to unpin outside the lock); a lease attempt for each wanted shard
        neither leased nor being leased (when `retry`, or when a lease ended)."""
        self.read = self.tally.total()
        wanted = {s: None for s in self.uses if self.read[s] < self.drawn_samples[s]}
        ended = [s for s in self.leased if s not in wanted]
        self.leased.difference_update(ended)
        if (retry or ended) and not self.closed:
            self.retried = time.monotonic()
            self.round += 1
            for s in wanted:
                if s not in self.leased and s not in self.jobs:
                    self.jobs[s] = self.pool.submit(self._lease, s, self.tickets, self.round)
                    self.tickets += 1
        return wanted, ended

    def _watch_if_needed(self) -> None:
        """Under the lock: start the watching thread, if none runs and one is needed (started
        under the lock, so that `pause_for_fork` sees every watch that runs)."""
        if self.watching or self.closed or self.forking or not (self.leased or self.jobs or self.uses):
            return
        self.watching = True
        self.watcher = threading.Thread(target=self._watch, name="stoker-shards-leases", daemon=True)
        _live.add(self)
        self.watcher.start()

    def _watch(self) -> None:
        """End leases as their samples are read, and try skipped ones again, while any lease is
        held or wanted; then the thread ends (none idles in a process the user may fork)."""
        while True:
            self.wake.wait(self.WATCH_S)
            with self.lock:
                before = int(self.read.sum())
                now = time.monotonic()
                wanted, ended = self._settle(retry=now - self.retried >= self.RETRY_S)
                if int(self.read.sum()) != before:
                    self.progress = now
                stalled = now - self.progress >= self.STALL_S
                if self.closed or self.forking or stalled or not (self.leased or self.jobs or wanted):
                    self.watching = False  # every batch drawn is read: the next draw starts one
                    stop = True
                else:
                    stop = False
            self._unpin(ended)
            if stop:
                return

    def _lease(self, number: int, ticket: int, round_: int) -> bool:
        with self.turns:
            while self.turn < ticket and not self.closed:
                self.turns.wait(1.0)
            skip = self.closed or self.blocked >= round_

        def decided(fits: bool) -> None:
            with self.turns:
                if not fits:
                    self.blocked = max(self.blocked, round_)
                self.turn = max(self.turn, ticket + 1)
                self.turns.notify_all()

        got = False
        if skip:
            decided(False)
        else:
            try:
                got = self.lease_shard(number, decided)
            except Exception:  # the reader that needs the shard meets the error itself
                got = False
        with self.lock:
            self.jobs.pop(number, None)
            if got and not self.closed and number in self.uses and self.read[number] < self.drawn_samples[number]:
                self.leased.add(number)
                return True
        if got:  # no unread batch needs it any more
            self._unpin([number])
        return False

    def _unpin(self, numbers: list[int]) -> None:
        for s in numbers:
            self.unpin_shard(s)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.batches.clear()
            self.uses.clear()
            ended, self.leased = list(self.leased), set()
            self.tally.close()
        with self.turns:
            self.turns.notify_all()
        self.pool.shutdown()
        self._unpin(ended)


# how long a fork waits for a lease watch to end (it ends within one look at the read counts;
# the bound only keeps a fork from waiting on a watch stuck in a slow file system)
_FORK_JOIN_S = 5.0
# how long a fork waits for the download threads to go idle
_FORK_POOL_WAIT_S = 1.0


def _wait_exited(thread: threading.Thread) -> None:
    """Wait until a joined thread's OS thread is gone (Linux; a bounded wait): `join` returns
    once its Python part has ended, a moment (well under a millisecond) before the OS thread
    exits, and Python 3.12 counts the OS threads when it checks a fork for threads."""
    if thread.is_alive() or thread.native_id is None:
        return
    task = f"/proc/self/task/{thread.native_id}"
    deadline = time.monotonic() + _FORK_JOIN_S
    while os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.0002)


# the DownloadsAhead of this process that have started a watch
_live: weakref.WeakSet[DownloadsAhead] = weakref.WeakSet()


def _quiet_for_fork() -> None:
    """Before this process forks: no lease watch runs (a fork with threads running copies
    their locks held; Python 3.12+ warns at such a fork). The downloads under way, if any, go
    on: a download is not stopped for a fork."""
    for ahead in list(_live):
        ahead.pause_for_fork()


def _resume_in_parent() -> None:
    for ahead in list(_live):
        ahead.resume_after_fork()


def _forget_in_child() -> None:
    """The child's copies are the parent's downloads ahead; the child makes its own."""
    _live.clear()


# the lease watch may unpin through the shard cache, whose own `before` hook takes the lock its
# descriptors are opened under: the watch is stopped first (the outer ring)
at_fork(before=_quiet_for_fork, after_in_parent=_resume_in_parent, after_in_child=_forget_in_child, stops_threads=True)
