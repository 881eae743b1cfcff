"""`ArrayRecordDataset`: a map-style dataset over ArrayRecord files (Grain's random-access
format, read with the `array_record` package).

Record `i` of the dataset is found by a cumulative count of the files' records (the global
index becomes a file and a record within it), and a batch is read with one call per file
(`ArrayRecordReader.read(indices)`, which decodes only the chunks the batch needs).

What the `array_record` package (0.8.6) does with bad files, and what this module does about it:

- Opening a missing, cut-short, grown or corrupt file does not raise: the reader comes back
  with `ok()` False and `num_records()` 0, and reads of it return empty bytes (a silent wrong
  record). Every reader opened here is checked (`ok()`, and the record count the dataset was
  made with) before it is read.
- A chunk whose bytes are damaged raises `RuntimeError` ("Corrupted Riegeli/records file:
  chunk data hash mismatch ...") when a record of it is read: chunks carry hashes, so a damaged
  record is an error, not a wrong record (160 single-bit flips tried: none read back wrong,
  none aborted the interpreter). It is raised here as `CorruptShardError` naming the file and
  the record.
- Opening any reader starts the package's global pool of 64 threads in that process, for
  good, and decoding zstd chunks starts riegeli's background cleaner thread. Neither survives
  `fork()`: a child that read after its parent had written a file hung (spinning) or died of
  SIGSEGV (in absl's mutex, under riegeli's `BackgroundCleaner::Register`) in 14 of 17 tries,
  after its parent had only opened a reader in 1 of 6, after its parent had read records in
  none of 29; a child of a process that had only imported the package read in 16 of 16. So:
  - the files are checked and counted at construction in a short-lived child interpreter
    (0.1-0.3 s for 16 files; opening them here would cost 2-7 ms a file and leave the loader's
    process unsafe to fork), and a file whose check killed the child would be named, not
    crash the caller;
  - readers are opened lazily, in the process that reads (the loader's with `num_workers=0`,
    else each worker), and never cross a fork or a pickle;
  - a process forked from one that has read through this module refuses to open a reader,
    with an error that says to start workers with forkserver or spawn, rather than risk a hang.
    (array_record use of the user's own, such as writing the files in the loader's process,
    cannot be seen from here: the guide says to write them elsewhere.)
"""

from __future__ import annotations

import bisect
import collections
import errno
import glob
import hashlib
import importlib
import json
import operator
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, Union

from .._base.checks import check_callable
from .._base.process import PerProcess
from .._data.datasets import Dataset
from .._data.identity import callable_name
from .errors import CorruptShardError

__all__ = ["ArrayRecordDataset"]

PathLike = Union[str, "os.PathLike[str]"]

# Reader options: no readahead, as random access wants (array_record's default, 16 MB, reads
# ahead for sequential scans).
READER_OPTIONS = "readahead_buffer_size:0"
# The most readers one process keeps open (each holds a descriptor and its file's chunk
# index); the least recently used is dropped beyond it.
MOST_OPEN = 64
# How long the child that checks the files may take: this, plus CHECK_S_PER_FILE a file.
CHECK_S = 60.0
CHECK_S_PER_FILE = 2.0

# Run in a fresh interpreter by `_check_files`: it imports only array_record, reads the JSON
# {"sys_path": [...], "paths": [...]} from stdin, and prints one JSON line per file, as soon
# as that file is checked (so that a file that kills it is the one after the last line).
_CHECKER = r"""
import json, re, sys
request = json.loads(sys.stdin.read())
sys.path[:0] = [p for p in request["sys_path"] if p not in sys.path]
try:
    from array_record.python.array_record_module import ArrayRecordReader
except ImportError as exc:
    print(json.dumps({"import_error": str(exc)}), flush=True)
    sys.exit(0)
for path in request["paths"]:
    try:
        reader = ArrayRecordReader(path, request["options"])
    except Exception as exc:
        print(json.dumps({"error": str(exc) or type(exc).__name__}), flush=True)
        continue
    if not reader.ok():
        why = ""
        try:
            reader.read_all()  # a reader that failed to open raises its status here
        except Exception as exc:
            why = str(exc)
        print(json.dumps({"error": why}), flush=True)
        continue
    options = reader.writer_options_string() or ""
    group = re.search(r"(?:^|,)group_size:(\d+)", options)
    print(json.dumps({"records": reader.num_records(), "group_size": int(group.group(1)) if group else None}), flush=True)
    reader.close()
"""


# The pid of the process that last used array_record's native code through this module (opened a
# reader); a process forked from it inherits the value, and refuses to open readers (see above).
_native_pid: int | None = None


def _mark_native_use() -> None:
    global _native_pid
    _native_pid = os.getpid()


def _refuse_if_forked_after_use(path: str) -> None:
    """Raise when this process was forked from one that had used array_record through this module."""
    used = _native_pid
    if used is not None and used != os.getpid():
        raise RuntimeError(
            f"cannot read {path} in this process (pid {os.getpid()}): it was forked from process {used} after "
            "that one had read ArrayRecord files, and array_record's threads and locks do not survive fork() "
            "(a read here can hang or crash). Start the DataLoader's workers with "
            "multiprocessing_context='forkserver' (or 'spawn'), or read nothing from the dataset in the "
            "loader's process before its workers start."
        )


def _module() -> Any:
    """The `array_record` reader module, imported on first use."""
    try:
        return importlib.import_module("array_record.python.array_record_module")
    except ImportError as exc:
        raise ImportError(
            "ArrayRecordDataset needs the array_record package: pip install 'stoker[arrayrecord]' "
            f"(or pip install array_record) ({exc})"
        ) from exc


def _has_magic(text: str) -> bool:
    return any(c in text for c in "*?[")


def _expand(paths: Any) -> list[str]:
    """The files `paths` names, in order (each pattern's matches sorted), as absolute paths."""
    if isinstance(paths, (str, os.PathLike)):
        items = [paths]
    elif isinstance(paths, Sequence) and not isinstance(paths, (bytes, bytearray)):
        items = list(paths)
        if not items:
            raise ValueError("paths should name at least one ArrayRecord file, but got paths=[]")
    else:
        raise TypeError(
            "paths should be a path, a glob pattern or a sequence of them (str or os.PathLike), "
            f"but got paths={paths!r}"
        )
    files: list[str] = []
    for item in items:
        if not isinstance(item, (str, os.PathLike)):
            raise TypeError(f"paths should hold str or os.PathLike entries, but got {item!r} in paths={paths!r}")
        text = os.path.expanduser(os.fspath(item))
        if not isinstance(text, str):
            raise TypeError(f"paths should hold str or os.PathLike entries, but got {item!r} in paths={paths!r}")
        if not os.path.lexists(text) and _has_magic(text):
            matched = sorted(p for p in glob.glob(text, recursive=True) if os.path.isfile(p))
            if not matched:
                raise FileNotFoundError(errno.ENOENT, "no ArrayRecord file matches the pattern", text)
            files.extend(os.path.abspath(p) for p in matched)
            continue
        if os.path.isdir(text):
            raise IsADirectoryError(
                errno.EISDIR,
                f"an ArrayRecord path names a folder: pass its files, or a pattern such as "
                f"{os.path.join(text, '*.array_record')!r}",
                text,
            )
        if not os.path.isfile(text):
            raise FileNotFoundError(errno.ENOENT, "no such ArrayRecord file", text)
        if not os.access(text, os.R_OK):
            raise PermissionError(errno.EACCES, "the ArrayRecord file cannot be read", text)
        files.append(os.path.abspath(text))
    return files


def _unreadable(path: str, why: str) -> CorruptShardError:
    because = f" ({why})" if why else ""
    return CorruptShardError(
        f"{path}: not a readable ArrayRecord file{because}: its footer does not parse, so it is cut short, "
        "grown or corrupt"
    )


def _check_files(paths: list[str]) -> list[tuple[int, int | None]]:
    """Each file's (record count, group size), read in a fresh interpreter (see the module's
    docstring); in this process when no interpreter can be started.

    Raises:
        CorruptShardError: naming the first file that is not a readable ArrayRecord file.
        TimeoutError: when the check runs past its time, naming the file it was at.
    """
    _module()  # the ImportError's advice, here rather than from the child
    request = json.dumps({"sys_path": sys.path, "paths": paths, "options": READER_OPTIONS})
    try:
        if not sys.executable:
            raise FileNotFoundError("sys.executable is empty")
        child = subprocess.Popen(
            [sys.executable, "-c", _CHECKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    except OSError:
        return _check_here(paths)
    timeout = CHECK_S + CHECK_S_PER_FILE * len(paths)
    try:
        out, err = child.communicate(request, timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        timed_out = True
    found: list[tuple[int, int | None]] = []
    for line in out.splitlines():
        if not line.startswith("{"):  # anything else a library printed
            continue
        answer = json.loads(line)
        if "import_error" in answer:  # the child's sys.path differs in a way the list does not mend
            return _check_here(paths)
        if "error" in answer:
            raise _unreadable(paths[len(found)], answer["error"])
        found.append((int(answer["records"]), answer["group_size"]))
    if len(found) == len(paths):
        return found
    at = paths[len(found)]
    if timed_out:
        raise TimeoutError(f"{at}: checking the ArrayRecord files ran past {timeout:g} s at this file")
    code = child.returncode
    died = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    raise CorruptShardError(
        f"{at}: opening this ArrayRecord file ended the process that checked it ({died}): "
        f"it is corrupt, or array_record cannot read it. {err.strip()[-500:]}".rstrip()
    )


def _open_reader(module: Any, path: str) -> Any:
    """A reader of `path` in this process, refused after a fork from a process that read
    natively, and checked readable (array_record reports a bad file by `ok()`, not by raising)."""
    _refuse_if_forked_after_use(path)
    _mark_native_use()
    try:
        reader = module.ArrayRecordReader(path, READER_OPTIONS)
    except Exception as exc:
        raise _unreadable(path, str(exc)) from exc
    if not reader.ok():
        raise _unreadable(path, "")
    return reader


def _check_here(paths: list[str]) -> list[tuple[int, int | None]]:
    module = _module()
    found: list[tuple[int, int | None]] = []
    for path in paths:
        reader = _open_reader(module, path)
        group = re.search(r"(?:^|,)group_size:(\d+)", reader.writer_options_string() or "")
        found.append((int(reader.num_records()), int(group.group(1)) if group else None))
        reader.close()
    return found


class ArrayRecordDataset(Dataset[Any]):
    """The records of ArrayRecord files (Grain's random-access format), as one map-style dataset.

    `ds[i]` is record `i` counted across the files in the order given, as `bytes` (or what
    `decode` makes of them); a batch's records are read with one call per file. Each file is
    checked and counted once, at construction; each process that reads (the loader's, or each
    worker) opens its own readers on first use, so the dataset works with thread and process
    workers (fork within the limit below), with `stoker.DataLoader`, `stoker.torch.DataLoader`
    and torch's.

        import numpy as np
        from stoker import ArrayRecordDataset, DataLoader

        def decode(record: bytes) -> np.ndarray:  # at a module's top level: workers unpickle it
            return np.frombuffer(record, np.int32)

        data = ArrayRecordDataset("data/train-*.array_record", decode=decode)
        loader = DataLoader(data, batch_size=256, shuffle=True, generator=0, num_workers=8,
                            multiprocessing_context="forkserver")

    Workers are best started by forkserver or spawn: array_record's threads and locks do not
    survive `fork()`, so a worker forked after the loader's process has read from the dataset
    (or written ArrayRecord files) could hang or crash. A worker forked after such a read
    refuses to read, with a `RuntimeError` saying so; one forked from a process that has only
    made the dataset reads normally.

    Files written for random access use `group_size:1` (a read decodes a whole group);
    `stoker doctor` says when a file was written otherwise.

    Args:
        paths: A file, a glob pattern (`"data/train-*.array_record"`; `**` spans folders) or a
            sequence of them, each a str or `os.PathLike`. The records are numbered through the
            files in the order given, a pattern's matches in sorted order. A path that exists is
            taken as it is, even if it holds `*`, `?` or `[`.
        decode: A callable applied to each record's bytes; `ds[i]` is what it returns. None
            returns the bytes. Defaults to None.

    Raises:
        TypeError: when `paths` is not a path, a pattern or a sequence of them, or `decode` is
            neither callable nor None.
        ValueError: when `paths` is an empty sequence.
        FileNotFoundError: when a path names no file, or a pattern matches none (naming it).
        IsADirectoryError: when a path names a folder (the message suggests a pattern).
        PermissionError: when a file cannot be read.
        CorruptShardError: when a file is not a readable ArrayRecord file (cut short, grown,
            garbage, a damaged footer), naming it.
        ImportError: when the `array_record` package is not installed
            (`pip install 'stoker[arrayrecord]'`).
    """

    def __init__(self, paths: PathLike | Sequence[PathLike], *, decode: Callable[[bytes], Any] | None = None) -> None:
        check_callable("decode", decode, none_ok=True, takes="a record's bytes")
        self.decode = decode
        files = _expand(paths)
        checked = _check_files(files)
        self.paths: tuple[str, ...] = tuple(files)
        self.record_counts: tuple[int, ...] = tuple(count for count, _ in checked)
        self._group_sizes = [group for _, group in checked]
        self._sizes = [os.path.getsize(p) for p in files]
        self._starts = [0]  # record number of each file's first record, then the total
        for count in self.record_counts:
            self._starts.append(self._starts[-1] + count)
        self._per_process()

    def _per_process(self) -> None:
        self._readers: PerProcess[_OpenReaders] = PerProcess(_OpenReaders, close=_OpenReaders.close)

    def __len__(self) -> int:
        return self._starts[-1]

    def _index(self, i: Any) -> int:
        try:
            index = operator.index(i)
        except TypeError:
            raise TypeError(
                f"ArrayRecordDataset indices should be integers, but got {type(i).__name__}: {i!r}"
            ) from None
        n = self._starts[-1]
        at = index + n if index < 0 else index
        if not 0 <= at < n:
            raise IndexError(f"index {index} is out of range for an ArrayRecordDataset of {n} records")
        return at

    def __getitem__(self, i: int) -> Any:
        return self._read([self._index(i)])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The records at `indices` (in that order, repeats allowed), read with one call per file.

        Args:
            indices: Record numbers of the dataset (negative ones count from the end).

        Raises:
            IndexError: when an index is out of range (naming the dataset's length).
            TypeError: when an index is not an integer.
            CorruptShardError: when a record cannot be read, naming the file, the record and
                its index in the dataset; or when a file changed since the dataset was made.
            FileNotFoundError: when a file is gone since the dataset was made.
            RuntimeError: in a process forked from one that had read through this dataset (or
                another `ArrayRecordDataset`), whose array_record state cannot be used here.
        """
        return self._read([self._index(i) for i in indices])

    def _read(self, indices: list[int]) -> list[Any]:
        by_file: dict[int, tuple[list[int], list[int]]] = {}  # file -> (slots in the batch, local indices)
        for slot, index in enumerate(indices):
            number = bisect.bisect_right(self._starts, index) - 1
            slots, local = by_file.setdefault(number, ([], []))
            slots.append(slot)
            local.append(index - self._starts[number])
        out: list[Any] = [None] * len(indices)
        readers = self._readers.get()
        for number, (slots, local) in by_file.items():
            reader = readers.get(number, self)
            try:
                records = reader.read(local)
            except Exception as exc:
                readers.forget(number)
                raise self._failed_read(number, local, exc) from exc
            for slot, record in zip(slots, records):
                out[slot] = record
        if self.decode is not None:
            decode = self.decode
            out = [decode(record) for record in out]
        return out

    def _failed_read(self, number: int, local: list[int], exc: Exception) -> CorruptShardError:
        """The error for a batched read of file `number` that raised `exc`: the first of its
        records that fails alone is named (read again one at a time, on a fresh reader)."""
        path = self.paths[number]
        try:
            reader = self._open(number)
            for k in local:
                try:
                    reader.read([k])
                except Exception as alone:
                    return CorruptShardError(
                        f"{path}: record {k} (index {self._starts[number] + k} of the dataset) cannot be read: {alone}"
                    )
        except CorruptShardError as reopened:
            return reopened
        return CorruptShardError(f"{path}: records {local} cannot be read: {exc}")

    def _open(self, number: int) -> Any:
        """A reader of file `number`, checked: readable, and holding the records it held when the
        dataset was made."""
        path = self.paths[number]
        module = _module()
        if not os.path.isfile(path):
            raise FileNotFoundError(errno.ENOENT, "the ArrayRecord file is gone since the dataset was made", path)
        reader = _open_reader(module, path)
        count = int(reader.num_records())
        if count != self.record_counts[number]:
            raise CorruptShardError(
                f"{path}: holds {count} records, but held {self.record_counts[number]} when the dataset "
                "was made: the file changed"
            )
        return reader

    def close(self) -> None:
        """Drop this process's readers (each closes its file); the next read opens them again."""
        self._readers.clear()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_readers"]  # each process opens its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._per_process()

    def stoker_describe(self) -> dict[str, Any]:
        """What a loader state saved over this dataset must agree on: the number of records and
        of files, a digest of each file's name (without its folder: the same files elsewhere are
        the same stream), record count and size in bytes, in order, and the name of `decode`
        (its code is not compared)."""
        layout = [[os.path.basename(p), c, s] for p, c, s in zip(self.paths, self.record_counts, self._sizes)]
        digest = hashlib.sha256(json.dumps(layout, separators=(",", ":")).encode()).hexdigest()[:32]
        return {
            "type": "ArrayRecordDataset",
            "records": len(self),
            "files": len(self.paths),
            "files_digest": digest,
            "decode": callable_name(self.decode),
        }

    def stoker_doctor_lines(self) -> list[str]:
        """What `stoker doctor` prints for this dataset: its size, and the files written with
        groups of more than one record (a random read decodes the whole group)."""
        lines = [f"ArrayRecordDataset: {len(self):,} records in {len(self.paths)} files"]
        grouped = [(g, p) for g, p in zip(self._group_sizes, self.paths) if g is not None and g > 1]
        if grouped:
            largest, example = max(grouped)
            lines.append(
                f"{len(grouped)} of the files were written with group_size > 1 (up to {largest}, e.g. {example}): "
                "each random read decodes a whole group; write with group_size:1 for random access"
            )
        return lines

    def __repr__(self) -> str:
        return f"ArrayRecordDataset({len(self)} records in {len(self.paths)} files)"


class _OpenReaders:
    """The readers one process has open, most recently used last (at most MOST_OPEN).

    A reader dropped from here closes its file when the last reference to it goes (a thread
    worker may still be reading it): readers are never closed under a read."""

    def __init__(self) -> None:
        self._open: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, number: int, dataset: ArrayRecordDataset) -> Any:
        with self._lock:
            reader = self._open.get(number)
            if reader is not None:
                self._open.move_to_end(number)
                return reader
        reader = dataset._open(number)  # outside the lock: opening reads the file's footer
        with self._lock:
            self._open.setdefault(number, reader)
            self._open.move_to_end(number)
            while len(self._open) > MOST_OPEN:
                self._open.popitem(last=False)
            return self._open[number]

    def forget(self, number: int) -> None:
        with self._lock:
            self._open.pop(number, None)

    def close(self) -> None:
        with self._lock:
            self._open.clear()
