"""`ShardCache`: a folder on local disk that holds whole shards under a byte cap, shared by
every process on the machine that uses the same folder (a loader's workers, the ranks of a job,
two jobs).

Layout of the folder:

    cache.lock        the global lock: reservations of room and evictions happen under it
    shards/<name>     complete, verified shards (the name escaped into one file name)
    tmp/<name>.*.part downloads in progress, pre-sized to their shard's size
    locks/<name>      one lock file per shard: its holder is the one process downloading it

The cap is on the sum of the sizes (`st_size`) of the files in `shards/` and `tmp/`. A
download first reserves its room: under the global lock it deletes the temporary files of
downloaders that died, evicts the least recently used shards that no process pins, and creates
its temporary file already at the shard's full size; so the cap holds at every instant, for
every process, whoever counts. Bytes arrive into that file, are hashed as they are written,
and the file is renamed to its final name once its size and checksum are right: a file under a
final name is always complete.

Every coordination is an `flock` (the kernel drops a lock when its holder dies, so a killed
process leaves nothing locked):
- the global lock file, exclusively, for reservations;
- a shard's lock file, exclusively, around "present? -> download -> verify -> rename";
- a temporary file, exclusively, by its downloader: one that can be locked is stale;
- a shard file, shared, by each process that pins it: eviction takes it exclusively without
  waiting, and skips the shard when it cannot; it empties the file, then unlinks it.
flock needs the folder on a local filesystem (not NFS).

A lease (`lease`) is a pin taken only when the pins of every process, with it, leave a given
room under the cap (counted under the global lock, where a shard whose exclusive lock cannot
be taken is pinned): the loader's process leases the shards its upcoming batches need, and the
room left lets a reader that needs a shard nobody leased make room without waiting for a lease.
A lease never waits for room: it is skipped when it does not fit.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import os
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO, NamedTuple, cast

from .._base.checks import check_callable, check_int, check_number, fail
from .._base.process import PerProcess, at_fork
from .errors import CacheFullError, CorruptShardError

__all__ = ["ShardCache", "measure_usage"]

_GLOBAL_LOCK = "cache.lock"
_SHARDS = "shards"
_TMP = "tmp"
_LOCKS = "locks"
_TMP_SUFFIX = ".part"
# how long a process waiting for a lock or for room sleeps between tries, at most
_MAX_POLL_S = 0.05
# escaped names longer than this end in a hash instead (file names are limited to 255 bytes)
_MAX_NAME = 180


# Every descriptor this module holds a lock through. A process forked while one is open would
# share the lock with its parent (flock belongs to the open file, which both then reference),
# and keep it after the parent lets go; the child closes its copies right after the fork.
_FDS: set[int] = set()
_FD_LOCK = threading.Lock()


def _before_fork() -> None:
    _FD_LOCK.acquire()


def _after_fork_in_parent() -> None:
    _FD_LOCK.release()


def _after_fork_in_child() -> None:
    for fd in _FDS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _FDS.clear()
    _FD_LOCK.release()


at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


def _open(path: str, flags: int, mode: int = 0o666) -> int:
    with _FD_LOCK:
        fd = os.open(path, flags | os.O_CLOEXEC, mode)
        _FDS.add(fd)
    return fd


def _close(fd: int) -> None:
    with _FD_LOCK:
        _FDS.discard(fd)
        os.close(fd)


def _try_lock(fd: int, operation: int) -> bool:
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _lock(fd: int, operation: int, deadline: float, waiting_for: Callable[[], str]) -> None:
    """Take flock `operation` on `fd`, polling, until `deadline` (time.monotonic)."""
    delay = 0.001
    while not _try_lock(fd, operation):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(errno.ETIMEDOUT, waiting_for())
        time.sleep(min(delay, left))
        delay = min(delay * 2, _MAX_POLL_S)


def _held(path: str, deadline: float, waiting_for: Callable[[], str]) -> int:
    """A descriptor of lock file `path` (made if absent) through which this process holds its
    exclusive flock (closing it lets go), waited for until `deadline`."""
    fd = _open(path, os.O_RDWR | os.O_CREAT)
    try:
        _lock(fd, fcntl.LOCK_EX, deadline, waiting_for)
    except BaseException:
        _close(fd)
        raise
    return fd


def _escape(name: str) -> str:
    """One file name for shard `name`, distinct for distinct names."""
    escaped = urllib.parse.quote(name, safe="-_.")
    if escaped.startswith("."):  # ".", ".." and hidden files
        escaped = "%2E" + escaped[1:]
    if len(escaped) > _MAX_NAME:  # "~" is escaped above, so only these names contain it
        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        escaped = f"{escaped[: _MAX_NAME - 40]}~{digest}"
    return escaped


def measure_usage(directory: str, locked: bool = False) -> int:
    """The bytes a cache folder holds: the sum of `st_size` of its complete shards and of its
    downloads in progress (the lock files are empty), read from outside, as a monitor would.

    Downloads in progress are listed first and a file is counted once (by inode), so one
    renamed into place while the folder is read is not counted twice. Without the lock, shards
    evicted and downloaded while the folder is read may still be counted with those they
    replaced (an over-count); with it, no room is reserved or freed meanwhile, and the count
    is the folder's usage at the moment the lock was taken.

    Args:
        directory: The cache's folder.
        locked: Whether to count under the cache's global lock (waiting for it). Defaults
            to False.

    Returns:
        The total in bytes (0 when the folder does not exist).
    """
    fd = None
    if locked:
        try:
            fd = _open(os.path.join(directory, _GLOBAL_LOCK), os.O_RDONLY)
        except FileNotFoundError:
            return 0
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        seen: set[int] = set()
        total = 0
        for sub in (_TMP, _SHARDS):
            try:
                entries = list(os.scandir(os.path.join(directory, sub)))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:  # evicted, or renamed, while the folder was read
                    continue
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_size
        return total
    finally:
        if fd is not None:
            _close(fd)


class _NoRoom(NamedTuple):
    """Why a shard does not fit now: bytes in use, of which pinned, and being downloaded."""

    used: int
    pinned: int
    downloading: int


@dataclass
class _Process:
    """What one process (not its forked children) holds and has counted. Its lock is never
    held while waiting for a file lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    pins: dict[str, list[int]] = field(default_factory=dict)  # name -> [fd, count]
    peak: int = 0
    evictions: int = 0
    downloads: int = 0


class _ShardWriter(io.RawIOBase):
    """The file a fetch writes a shard into: bytes go into the pre-sized temporary file and
    into the hash as they arrive; more bytes than the shard's size are refused (the file must
    not grow past its reservation). A fetch that retries may `seek(0)` and start over."""

    def __init__(self, fd: int, size: int, name: str, hashed: bool) -> None:
        super().__init__()
        self._fd = fd
        self._size = size
        self._name = name
        self._hashed = hashed
        self.hasher = hashlib.sha256()
        self.written = 0
        self.write_error: OSError | None = None

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.written

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        position = {io.SEEK_SET: 0, io.SEEK_CUR: self.written, io.SEEK_END: self.written}[whence]
        position += offset
        if position == 0:
            self.hasher = hashlib.sha256()
            self.written = 0
        elif position != self.written:
            raise io.UnsupportedOperation(
                f"a shard is written from its start to its end: seek to {position} is not "
                f"supported (at {self.written}; seek(0) starts over)"
            )
        return self.written

    def truncate(self, size: int | None = None) -> int:
        # the file keeps its reserved size; only the bytes written are counted and checked
        return self.written if size is None else size

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self.written + len(view) > self._size:
            raise CorruptShardError(
                f"shard {self._name}: more bytes than its size: expected {self._size} bytes, "
                f"got at least {self.written + len(view)}"
            )
        if self._hashed:
            self.hasher.update(view)
        done = 0
        while done < len(view):
            try:
                done += os.pwrite(self._fd, view[done:], self.written + done)
            except OSError as exc:
                self.write_error = exc
                raise
        self.written += done
        return done


class ShardCache:
    """A folder of whole shards on local disk, under a byte cap that is never exceeded,
    shared by every process of the machine that uses the same folder; each shard is downloaded
    once, by whichever process asks first, and the others wait for it.

    A `ShardCache` pickles (a worker gets a copy of its settings) and works in a forked
    child: pins belong to the process that took them. It is safe to use from several threads.
    Every process sharing a folder should pass the same `cap_bytes`: each enforces its own
    when it reserves room.

    Args:
        directory: The cache's folder, created if missing; on a local filesystem.
        cap_bytes: The most bytes the folder may hold (int > 0), downloads in progress
            included.
        timeout_s: How long `get` waits for room in the cache or for another process's
            download of the same shard, and `pin` for a shard being evicted, in seconds
            (>= 0). Defaults to 600.0.

    Raises:
        TypeError: An argument is not of the type described.
        ValueError: An argument's value is not what is described.
        OSError: The folder cannot be created or written (`PermissionError` when access is
            denied); the message names the folder.
    """

    def __init__(self, directory: str, cap_bytes: int, timeout_s: float = 600.0) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            fail(TypeError, "directory", "a non-empty path", directory)
        if not os.fspath(directory):
            fail(ValueError, "directory", "a non-empty path", directory)
        check_int("cap_bytes", cap_bytes, low=1, unit="bytes")
        check_number("timeout_s", timeout_s, low=0, unit="seconds")
        self.directory = os.path.abspath(os.fspath(directory))
        self.cap_bytes = cap_bytes
        self.timeout_s = float(timeout_s)
        # a forked child's pins are not its parent's (their descriptors were closed in the
        # child by the fork hook above): it gets a _Process of its own
        self._state = PerProcess(_Process)
        self._prepare()

    def _prepare(self) -> None:
        """Create the folder's layout; an error names the folder and says what is wrong."""
        try:
            for sub in (_SHARDS, _TMP, _LOCKS):
                os.makedirs(os.path.join(self.directory, sub), exist_ok=True)
            fd = os.open(os.path.join(self.directory, _GLOBAL_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            os.close(fd)
            # asked, not tried: a probe file could not be made on a disk other processes
            # have filled to the cap, and this process would fail for no fault of the folder
            tmp = os.path.join(self.directory, _TMP)
            if not os.access(tmp, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), tmp)
        except OSError as exc:
            if isinstance(exc, PermissionError) or exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise PermissionError(
                    exc.errno,
                    f"the shard cache folder {self.directory} is not writable ({exc.strerror}): "
                    "pass a cache folder this process can write to",
                ) from exc
            raise type(exc)(
                exc.errno,
                f"cannot make the shard cache folder {self.directory} ({exc.strerror}"
                f"{': ' + str(exc.filename) if exc.filename else ''}): pass a folder that "
                "can be created",
            ) from exc

    # -- per-process state ------------------------------------------------------------------

    @property
    def _proc(self) -> _Process:
        return self._state.get()

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory, "cap_bytes": self.cap_bytes, "timeout_s": self.timeout_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.directory = state["directory"]
        self.cap_bytes = state["cap_bytes"]
        self.timeout_s = state["timeout_s"]
        self._state = PerProcess(_Process)

    def __repr__(self) -> str:
        return f"ShardCache({self.directory!r}, cap_bytes={self.cap_bytes}, timeout_s={self.timeout_s})"

    @property
    def peak(self) -> int:
        """The highest number of bytes in the folder this process counted, right after each
        of its reservations (what was there plus the room it reserved)."""
        return self._proc.peak

    @property
    def evictions(self) -> int:
        """How many shards this process evicted."""
        return self._proc.evictions

    @property
    def downloads(self) -> int:
        """How many shards this process downloaded (and verified) into the cache."""
        return self._proc.downloads

    def usage(self) -> int:
        """The bytes the folder holds now: complete shards and downloads in progress.

        Returns:
            The sum of their sizes in bytes.
        """
        return measure_usage(self.directory)

    def path_of(self, name: str) -> str:
        """Where shard `name` lies in the cache when it is there.

        Args:
            name: The shard's name (a path relative to the store's prefix).

        Returns:
            The path of its file (which may not exist).

        Raises:
            TypeError: `name` is not a string.
            ValueError: `name` is empty or holds a NUL.
        """
        _check_name(name)
        return os.path.join(self.directory, _SHARDS, _escape(name))

    # -- get ----------------------------------------------------------------------------------

    def get(self, name: str, size: int, sha256: str | None, fetch: Callable[[BinaryIO], int]) -> str:
        """The local path of shard `name`, complete and verified; downloads it if it is absent.

        On the machine, exactly one process downloads a shard at a time: the others wait for
        it and then find the file. The shard is not pinned: read it through `reading`, or
        `pin` it, and call `get` again if it was evicted in between. An eviction empties the
        file before it unlinks it (so that its blocks are freed at once), so a file opened
        without a pin may be cut short under its reader.

        Args:
            name: The shard's name (a path relative to the store's prefix).
            size: Its size in bytes (int >= 0), as the index says.
            sha256: The hex sha256 of its bytes, checked after the download; None skips the
                check.
            fetch: Called with a binary file to write the shard's bytes into, from the first
                to the last (a retry may `seek(0)` and start over); returns the bytes written.

        Returns:
            The path of the shard's file in the cache.

        Raises:
            TypeError: An argument is not of the type described.
            ValueError: An argument's value is not what is described.
            CacheFullError: The shard does not fit in the cap, even after evicting every shard
                that nothing pins, within `timeout_s`.
            TimeoutError: Another process's download of the same shard did not end within
                `timeout_s`.
            CorruptShardError: The bytes fetched do not have the shard's size or sha256 (they
                are not kept).
            OSError: The disk of the cache folder is full (`errno.ENOSPC`; the partial file is
                removed). Whatever `fetch` raises is raised unchanged, after its partial file
                is removed.
        """
        path = self.path_of(name)
        _check_get(size, sha256, fetch)
        if self._present(path, size):
            return path
        deadline = time.monotonic() + self.timeout_s
        fd = self._download_lock(name, deadline)
        try:
            if self._present(path, size):
                return path
            if os.path.lexists(path):  # the store's shard changed size since it was cached
                self._discard(name, path, size)
            self._download(name, path, size, sha256, fetch)
            return path
        finally:
            _close(fd)  # closing the lock file drops its lock

    def lease(
        self,
        name: str,
        size: int,
        sha256: str | None,
        fetch: Callable[[BinaryIO], int],
        spare_bytes: int = 0,
        decided: Callable[[bool], None] | None = None,
    ) -> bool:
        """Pin shard `name`, downloading it first if it is absent, only if that leaves
        `spare_bytes` of the cap to what is neither pinned nor being downloaded; else do
        nothing. A lease is a pin (`unpin` ends it; the kernel ends it when the process dies)
        taken only when it fits, for a reader that will need the shard soon: what the leases
        of every process hold never grows past `cap_bytes - spare_bytes`, so a reader that
        needs a shard no one leased always finds room for it (`spare_bytes` at least its
        size) by evicting shards no one leases.

        Unlike `get`, it never waits for room: when the shard does not fit now, it returns
        False at once (a download is skipped, nothing is evicted), and the caller may try
        again once its own leases have ended. It evicts only shards nobody pins, as `get`.

        Args:
            name: The shard's name (a path relative to the store's prefix).
            size: Its size in bytes (int >= 0), as the index says.
            sha256: The hex sha256 of its bytes, checked after a download; None skips it.
            fetch: As `get`'s.
            spare_bytes: The room (bytes, int >= 0) the pins and downloads of every process,
                this lease's shard included, must leave under the cap. Defaults to 0.
            decided: Called once, with whether the shard fits, as soon as that is known: before
                its download, so that a caller can take leases one after another in a strict
                order while their downloads overlap. None calls nothing. Defaults to None.

        Returns:
            True when this process now pins the shard (once more: `unpin` it once), False
            when it did not fit.

        Raises:
            TypeError: An argument is not of the type described.
            ValueError: An argument's value is not what is described.
            TimeoutError: Another process's download of the same shard, or the cache's lock,
                was held for longer than `timeout_s`.
            CorruptShardError, OSError: As `get` (nothing is pinned then).
        """
        told = False

        def tell(fits: bool) -> bool:
            nonlocal told
            if not told:
                told = True
                if decided is not None:
                    decided(fits)
            return fits

        try:
            return self._lease(name, size, sha256, fetch, spare_bytes, tell)
        finally:
            tell(False)  # an error before the decision: it did not fit

    def _lease(
        self,
        name: str,
        size: int,
        sha256: str | None,
        fetch: Callable[[BinaryIO], int],
        spare_bytes: int,
        tell: Callable[[bool], bool],
    ) -> bool:
        path = self.path_of(name)
        _check_get(size, sha256, fetch)
        check_int("spare_bytes", spare_bytes, low=0, unit="bytes")
        proc = self._proc
        with proc.lock:
            held = proc.pins.get(name)
            if held is not None:
                held[1] += 1
                return tell(True)
        deadline = time.monotonic() + self.timeout_s
        if os.path.lexists(path):
            done = self._lease_present(name, path, size, spare_bytes, deadline)
            if done is not None:
                return tell(done)
        fd = self._download_lock(name, deadline)
        try:
            done = self._lease_present(name, path, size, spare_bytes, deadline)
            if done is not None:
                return tell(done)
            if os.path.lexists(path):  # the store's shard changed size since it was cached
                self._discard(name, path, size)
            return self._download(name, path, size, sha256, fetch, spare_bytes, tell)
        finally:
            _close(fd)

    def _lease_present(self, name: str, path: str, size: int, spare: int, deadline: float) -> bool | None:
        """Pin shard `name` at `path` if it is there (at `size` bytes) and fits the leases'
        budget; None when it is not there. Under the global lock, so no eviction runs
        between the budget's count and the pin."""
        gfd = self._global_lock(deadline, name)
        try:
            try:
                fd = _open(path, os.O_RDONLY)
            except FileNotFoundError:
                return None
            try:
                if os.fstat(fd).st_size != size:
                    _close(fd)
                    return None
                if _try_lock(fd, fcntl.LOCK_EX):  # nobody pins it: pinning it adds to the pins
                    pinned, downloading = self._committed(path)
                    if pinned + downloading + size + spare > self.cap_bytes:
                        _close(fd)
                        return False
                # a shared lock: beside other pins, or this exclusive one converted (no other
                # process can take it meanwhile: evictions hold the global lock)
                if not _try_lock(fd, fcntl.LOCK_SH):  # its downloader has not let go yet
                    _close(fd)
                    return False
            except BaseException:
                _close(fd)
                raise
        finally:
            _close(gfd)
        now = time.time_ns()
        with contextlib.suppress(OSError):
            os.utime(fd, ns=(now, now))
        self._hold(name, fd)
        return True

    def _hold(self, name: str, fd: int) -> None:
        """Count a pin of `name` through `fd` (a descriptor holding its shared lock)."""
        proc = self._proc
        with proc.lock:
            held = proc.pins.get(name)
            if held is None:
                proc.pins[name] = [fd, 1]
                return
            held[1] += 1  # another thread pinned it meanwhile: one descriptor is enough
        _close(fd)

    def _committed(self, exclude: str | None = None) -> tuple[int, int]:
        """Under the global lock: the bytes of the shards some process pins (all but
        `exclude`), and of the downloads in progress (removing those whose downloader
        died)."""
        downloading = self._scan_tmp()
        pinned = 0
        for entry in os.scandir(os.path.join(self.directory, _SHARDS)):
            if entry.path == exclude:
                continue
            try:
                fd = _open(entry.path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            except PermissionError:  # another user's shard: not this process's to evict
                with contextlib.suppress(OSError):
                    pinned += entry.stat(follow_symlinks=False).st_size
                continue
            try:
                if not _try_lock(fd, fcntl.LOCK_EX):
                    pinned += os.fstat(fd).st_size
            finally:
                _close(fd)
        return pinned, downloading

    def _scan_tmp(self) -> int:
        """Under the global lock: delete the temporary files of downloaders that died; the
        bytes of the downloads in progress."""
        downloading = 0
        for entry in list(os.scandir(os.path.join(self.directory, _TMP))):
            try:
                fd = _open(entry.path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                if _try_lock(fd, fcntl.LOCK_EX):  # its downloader died, or just let go of it
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                else:
                    downloading += os.fstat(fd).st_size
            finally:
                _close(fd)
        return downloading

    def _present(self, path: str, size: int) -> bool:
        """Whether a complete shard of `size` bytes is at `path`; touches it for the LRU."""
        try:
            if os.stat(path).st_size != size:
                return False
            now = time.time_ns()
            os.utime(path, ns=(now, now))
        except FileNotFoundError:  # absent, or evicted between the two calls
            return False
        return True

    def _discard(self, name: str, path: str, size: int) -> None:
        """Evict the cached copy of `name` whose size is not `size` (a store rewritten)."""
        gfd = self._global_lock(time.monotonic() + self.timeout_s, name)
        try:
            fd = _open(path, os.O_RDONLY)
            try:
                if not _try_lock(fd, fcntl.LOCK_EX):
                    raise OSError(
                        errno.EBUSY,
                        f"shard {name} in the cache {self.directory} has {os.fstat(fd).st_size} "
                        f"bytes, not the {size} the index says, and a process is reading it: "
                        "the store changed under a running job",
                    )
                os.unlink(path)
            finally:
                _close(fd)
        except FileNotFoundError:
            pass
        finally:
            _close(gfd)

    def _global_lock(self, deadline: float, name: str) -> int:
        return _held(
            os.path.join(self.directory, _GLOBAL_LOCK),
            deadline,
            lambda: (
                f"shard cache {self.directory}: waited longer than timeout_s={self.timeout_s} "
                f"for its lock, to make room for shard {name}; a process holding it may be stopped"
            ),
        )

    def _download_lock(self, name: str, deadline: float) -> int:
        """The shard's download lock, held (exclusive) through the returned descriptor (closing
        it drops the lock); waits until `deadline` for a process downloading the shard."""
        return _held(
            os.path.join(self.directory, _LOCKS, _escape(name)),
            deadline,
            lambda: (
                f"shard cache {self.directory}: another process has been downloading shard "
                f"{name} for longer than timeout_s={self.timeout_s}: raise timeout_s or look "
                "for a stuck process"
            ),
        )

    def _download(
        self,
        name: str,
        path: str,
        size: int,
        sha256: str | None,
        fetch: Callable[[BinaryIO], int],
        spare: int | None = None,
        tell: Callable[[bool], bool] | None = None,
    ) -> bool:
        """Fetch shard `name` into a reserved temporary file, verify it, rename it to `path`.
        The caller holds the shard's lock. With `spare` (a lease), the room is reserved only
        if the leases' budget allows, without waiting, and the shard ends pinned; returns
        whether it was downloaded."""
        reserved = self._reserve(name, size, spare)
        if tell is not None:
            tell(reserved is not None)
        if reserved is None:
            return False
        fd, tmp = reserved
        writer = _ShardWriter(fd, size, name, hashed=sha256 is not None)
        try:
            try:
                if size:
                    # blocks on disk now: a full disk shows before any byte is fetched
                    os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    writer.write_error = exc
                    raise
                # a filesystem without fallocate: the file is already at its size
            fetch(cast(BinaryIO, writer))
            if writer.written != size:
                raise CorruptShardError(f"shard {name}: wrong size: expected {size} bytes, got {writer.written}")
            if sha256 is not None:
                got = writer.hasher.hexdigest()
                if got != sha256.lower():
                    raise CorruptShardError(f"shard {name}: wrong sha256: expected {sha256.lower()}, got {got}")
            now = time.time_ns()
            os.utime(fd, ns=(now, now))
            if spare is None:
                # the rename is atomic: other processes see no file or the whole one (the page
                # cache is shared, so no fsync is needed for them to read every byte)
                os.rename(tmp, path)
            else:
                # renamed and its lock turned shared under the global lock, so that no eviction
                # finds it unpinned in between
                gfd = self._global_lock(time.monotonic() + self.timeout_s, name)
                try:
                    os.rename(tmp, path)
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                finally:
                    _close(gfd)
        except BaseException as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            _close(fd)
            full = writer.write_error
            if full is not None and full.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OSError(
                    full.errno,
                    f"the disk of the shard cache folder {self.directory} is full "
                    f"(writing shard {name}, {size} bytes): free space on it, or lower the "
                    f"cache's cap ({self.cap_bytes} bytes) below what the disk can hold",
                ) from exc
            raise
        proc = self._proc
        with proc.lock:
            proc.downloads += 1
        if spare is None:
            _close(fd)
        else:
            self._hold(name, fd)
        return True

    def _reserve(self, name: str, size: int, spare: int | None = None) -> tuple[int, str] | None:
        """Make room for `size` bytes and create the temporary file holding it, under the
        global lock; waits for room until the timeout. With `spare` (a lease), tries once.

        Returns:
            The temporary file's descriptor (locked, sized) and its path; None when a lease
            does not fit.
        """
        if size > self.cap_bytes:
            raise CacheFullError(
                f"shard cache {self.directory}: shard {name} ({size} bytes) is bigger than the "
                f"cache's cap ({self.cap_bytes} bytes): raise the cap to at least the largest shard"
            )
        deadline = time.monotonic() + self.timeout_s
        delay = 0.001
        while True:
            gfd = self._global_lock(deadline, name)
            try:
                found = self._make_room(name, size, spare)
                if not isinstance(found, _NoRoom):
                    return found
                if spare is not None:
                    return None
                used, pinned, downloading = found
            finally:
                _close(gfd)
            left = deadline - time.monotonic()
            if left <= 0:
                raise CacheFullError(
                    f"shard cache {self.directory} has no room for shard {name} ({size} bytes) "
                    f"after waiting {self.timeout_s:g} s: its cap is {self.cap_bytes} bytes, "
                    f"{used} are in use, of which {pinned} are pinned by readers and "
                    f"{downloading} are downloads in progress: raise the cap (cache_bytes)"
                )
            time.sleep(min(delay, left))
            delay = min(delay * 2, _MAX_POLL_S * 2)

    def _make_room(self, name: str, size: int, spare: int | None = None) -> tuple[int, str] | _NoRoom:
        """Under the global lock: delete stale temporary files, evict what must go, and create
        the temporary file. Returns (fd, path), or (bytes used, pinned, downloading) when
        the shard cannot fit now. With `spare` (a lease), the shard does not fit when the
        pins and downloads of every process, with it, would leave less than `spare` bytes."""
        if spare is not None:
            pinned, downloading = self._committed()
            if pinned + downloading + size + spare > self.cap_bytes:
                return _NoRoom(pinned + downloading, pinned, downloading)
        else:
            downloading = self._scan_tmp()
        shards = []
        for entry in os.scandir(os.path.join(self.directory, _SHARDS)):
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            shards.append((st.st_mtime_ns, st.st_size, entry.path))
        used = downloading + sum(s for _, s, _ in shards)
        pinned = 0
        if used + size > self.cap_bytes:
            shards.sort()
            freed = 0
            victims: list[tuple[int, str]] = []
            try:
                for _, _, victim in shards:
                    if used - freed + size <= self.cap_bytes:
                        break
                    try:
                        vfd = _open(victim, os.O_RDWR)
                    except FileNotFoundError:
                        continue
                    except PermissionError:  # another user's shard: not this process's to evict
                        pinned += os.stat(victim).st_size
                        continue
                    victims.append((vfd, victim))
                    if _try_lock(vfd, fcntl.LOCK_EX):
                        freed += os.fstat(vfd).st_size
                    else:
                        pinned += os.fstat(vfd).st_size
                        _close(vfd)
                        victims.pop()
                if used - freed + size > self.cap_bytes:
                    return _NoRoom(used, pinned, downloading)  # evicting would not be enough
                for vfd, victim in victims:
                    # emptied first: a process that opened it just now, to pin it, would
                    # otherwise keep its blocks on disk until it sees it is gone
                    os.ftruncate(vfd, 0)
                    os.unlink(victim)
                used -= freed
            finally:
                for vfd, _ in victims:
                    _close(vfd)
            proc = self._proc
            with proc.lock:
                proc.evictions += len(victims)
        return self._create_tmp(name, size, used)

    def _create_tmp(self, name: str, size: int, used: int) -> tuple[int, str]:
        tmp = os.path.join(self.directory, _TMP, f"{_escape(name)}.{os.getpid()}.{os.urandom(4).hex()}{_TMP_SUFFIX}")
        fd = _open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh file: nobody else has it
            os.ftruncate(fd, size)
        except BaseException:
            os.unlink(tmp)
            _close(fd)
            raise
        proc = self._proc
        with proc.lock:
            proc.peak = max(proc.peak, used + size)
        return fd, tmp

    # -- pins ---------------------------------------------------------------------------------

    def pin(self, name: str) -> None:
        """Keep shard `name` in the cache until `unpin`: no process evicts it meanwhile.

        Pins are counted within the process (pin twice, unpin twice) and belong to it: a
        forked child holds none of its parent's.

        Args:
            name: The shard's name.

        Raises:
            TypeError: `name` is not a string.
            ValueError: `name` is empty or holds a NUL.
            FileNotFoundError: The shard is not in the cache (never fetched, or evicted): call
                `get` and pin again.
            TimeoutError: An eviction of the shard held it for longer than `timeout_s`.
        """
        path = self.path_of(name)
        proc = self._proc
        with proc.lock:
            held = proc.pins.get(name)
            if held is not None:
                held[1] += 1
                return
        # waiting for the shared lock outside proc.lock: a thread of this process that is
        # evicting the shard holds its exclusive lock and may want proc.lock to count that
        self._hold(name, self._lock_shared(name, path))

    def _lock_shared(self, name: str, path: str) -> int:
        missing = f"shard {name} is not in the cache {self.directory} (evicted, or never fetched): get() it again"
        try:
            fd = _open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, missing, path) from None
        try:
            _lock(
                fd,
                fcntl.LOCK_SH,
                time.monotonic() + self.timeout_s,
                lambda: f"shard cache {self.directory}: shard {name} stayed locked for eviction",
            )
            if os.fstat(fd).st_nlink == 0:  # evicted while this process waited for its lock
                raise FileNotFoundError(errno.ENOENT, missing, path)
        except BaseException:
            _close(fd)
            raise
        return fd

    def unpin(self, name: str) -> None:
        """Undo one `pin` of shard `name` by this process; the last one lets it be evicted.

        Args:
            name: The shard's name.

        Raises:
            ValueError: This process does not pin `name`.
        """
        _check_name(name)
        proc = self._proc
        with proc.lock:
            held = proc.pins.get(name)
            if held is None:
                raise ValueError(f"name={name!r} is not pinned by this process: unpin follows pin")
            held[1] -= 1
            if held[1] == 0:
                del proc.pins[name]
                _close(held[0])

    def pinned(self) -> dict[str, int]:
        """The shards this process pins.

        Returns:
            Each pinned shard's name and how many times this process pinned it.
        """
        proc = self._proc
        with proc.lock:
            return {name: held[1] for name, held in proc.pins.items()}

    @contextlib.contextmanager
    def reading(self, name: str) -> Iterator[BinaryIO]:
        """Open shard `name` for reading, pinned while the block runs, and touched as used.

        Args:
            name: The shard's name.

        Yields:
            The shard's file, opened in binary mode (closed when the block ends).

        Raises:
            TypeError: `name` is not a string.
            ValueError: `name` is empty or holds a NUL.
            FileNotFoundError: The shard is not in the cache (evicted since `get`): call
                `get` again.
        """
        self.pin(name)
        try:
            path = self.path_of(name)
            now = time.time_ns()
            os.utime(path, ns=(now, now))
            with open(path, "rb") as f:
                yield f
        finally:
            self.unpin(name)


def _check_get(size: object, sha256: object, fetch: object) -> None:
    check_int("size", size, low=0, unit="bytes")
    if sha256 is not None:
        if not isinstance(sha256, str):
            fail(TypeError, "sha256", "64 hex digits or None", sha256)
        if len(sha256) != 64 or any(c not in "0123456789abcdefABCDEF" for c in sha256):
            fail(ValueError, "sha256", "64 hex digits or None", sha256)
    check_callable("fetch", fetch, takes="a binary file")


def _check_name(name: object) -> None:
    if not isinstance(name, str):
        fail(TypeError, "name", "a non-empty string without NUL", name)
    if not name or "\x00" in name:
        fail(ValueError, "name", "a non-empty string without NUL", name)
