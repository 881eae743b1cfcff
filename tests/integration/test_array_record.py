"""ArrayRecordDataset over real ArrayRecord files written with array_record's own writer: the
records Grain's ArrayRecordDataSource reads from the same files, every record once per epoch
through stoker's loaders (no workers, fork, spawn and thread workers), decode, files and
patterns, the errors for missing, empty, corrupt, truncated and changed files (never a silent
wrong record), pickling without open readers, and an exact mid-epoch resume."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stoker import DataLoader
from stoker._shards.array_record import ArrayRecordDataset
from stoker._shards.errors import CorruptShardError

ar = pytest.importorskip("array_record.python.array_record_module")

GRAIN_TIMEOUT_S = 100
CHILD_TIMEOUT_S = 100
HERE = os.path.dirname(os.path.abspath(__file__))


def payload(number: int) -> bytes:
    """Record `number`'s bytes: its number, then bytes that differ from record to record."""
    return b"%d:" % number + bytes((number * 7 + k) % 256 for k in range(number % 13 + 20))


def record_number(record: bytes) -> int:
    """The decode the loader tests use (module level: spawn workers unpickle it by name)."""
    return int(record.split(b":", 1)[0])


def write(path: Path, numbers: range | list[int], options: str = "group_size:1") -> Path:
    writer = ar.ArrayRecordWriter(str(path), options)
    for number in numbers:
        writer.write(payload(number))
    writer.close()
    return path


@pytest.fixture
def parts(tmp_path: Path) -> list[Path]:
    """Three files of 7, 0 and 11 records (record numbers 0-17 in order), and one more part
    of 5 written with groups of 4 records."""
    return [
        write(tmp_path / "part-0.array_record", range(7)),
        write(tmp_path / "part-1.array_record", []),
        write(tmp_path / "part-2.array_record", range(7, 18)),
        write(tmp_path / "part-3.array_record", range(18, 23), "group_size:4"),
    ]


def test_the_records_are_those_grain_reads(parts: list[Path], tmp_path: Path) -> None:
    """Grain's ArrayRecordDataSource, in a fresh interpreter (grain imports jax), over the same
    files: the same length and the same bytes at every index, one by one and as a batch."""
    pytest.importorskip("grain")
    out = tmp_path / "grain.pkl"
    code = (
        "import pickle, sys\n"
        "import grain\n"
        "source = grain.sources.ArrayRecordDataSource(sys.argv[2:])\n"
        "records = [source[i] for i in range(len(source))]\n"
        "pickle.dump(records, open(sys.argv[1], 'wb'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(out), *map(str, parts)],
        capture_output=True,
        text=True,
        timeout=GRAIN_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    grain_records = pickle.loads(out.read_bytes())
    data = ArrayRecordDataset(parts)
    assert len(data) == len(grain_records) == 23
    assert [data[i] for i in range(len(data))] == grain_records
    order = list(np.random.default_rng(0).permutation(len(data))) + [3, 3, 22]
    assert data.__getitems__(order) == [grain_records[i] for i in order]
    assert grain_records[9] == payload(9)  # and both are what was written


def test_files_patterns_and_indices(parts: list[Path], tmp_path: Path) -> None:
    everything = [payload(n) for n in range(23)]
    # a pattern: its matches sorted; PathLike entries; a path and a pattern mixed, in the order given
    assert [r for r in ArrayRecordDataset(str(tmp_path / "part-*.array_record"))] == everything
    assert len(ArrayRecordDataset(parts)) == 23
    mixed = ArrayRecordDataset([parts[2], tmp_path / "part-[01].array_record"])
    assert mixed.paths == (str(parts[2]), str(parts[0]), str(parts[1]))
    assert mixed.record_counts == (11, 7, 0)
    assert list(mixed) == [payload(n) for n in (*range(7, 18), *range(7))]
    data = ArrayRecordDataset(parts)
    # the file boundaries, the empty file between them, negative indices, repeats, any order
    assert [data[i] for i in (0, 6, 7, 17, 18, 22, -1, -23)] == [everything[i] for i in (0, 6, 7, 17, 18, 22, 22, 0)]
    assert data.__getitems__([22, 0, 7, 7, 6, 18, -2]) == [everything[i] for i in (22, 0, 7, 7, 6, 18, 21)]
    assert data.__getitems__(np.array([5, 8])) == [everything[5], everything[8]]
    assert data.__getitems__([]) == []
    # a path that exists is taken as it is, even with a pattern's characters in its name
    odd = write(tmp_path / "odd[1].array_record", range(3))
    assert list(ArrayRecordDataset(odd)) == [payload(n) for n in range(3)]
    nested = tmp_path / "deep" / "er"
    nested.mkdir(parents=True)
    write(nested / "x.array_record", range(2))
    assert len(ArrayRecordDataset(str(tmp_path / "**" / "x.array_record"))) == 2


def test_decode(parts: list[Path]) -> None:
    data = ArrayRecordDataset(parts, decode=record_number)
    assert [data[i] for i in range(len(data))] == list(range(23))
    assert data.__getitems__([22, 0, 9]) == [22, 0, 9]
    calls: list[bytes] = []
    counted = ArrayRecordDataset(parts[0], decode=lambda b: calls.append(b) or len(b))
    assert counted[2] == len(payload(2)) and calls == [payload(2)]


@pytest.mark.parametrize(
    "engine",
    [
        {"num_workers": 0},
        {"num_workers": 2, "multiprocessing_context": "forkserver"},
        {"num_workers": 2, "multiprocessing_context": "spawn", "persistent_workers": True},
        {"num_workers": 2, "thread_pool": True},
    ],
    ids=["no-workers", "forkserver", "spawn", "threads"],
)
def test_the_loader_reads_every_record_once_per_epoch(parts: list[Path], engine: dict) -> None:
    """Fork workers are tested in a fresh interpreter (below): this process has written the
    files with array_record, which a forked child must not inherit."""
    data = ArrayRecordDataset(parts, decode=record_number)
    data[3]  # readers open in this process: they do not travel to the workers
    loader = DataLoader(data, batch_size=4, shuffle=True, generator=7, **engine)
    epochs = [[int(x) for batch in loader for x in batch] for _ in range(2)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(23))
    assert epochs[0] != epochs[1]  # shuffled anew each epoch
    again = DataLoader(data, batch_size=4, shuffle=True, generator=7)
    assert [int(x) for batch in again for x in batch] == epochs[0]  # the same order without workers
    assert data[10] == 10  # this process's readers still read after the workers are gone


FORK_CHILD = """
import json, sys
from stoker import DataLoader
from stoker._shards.array_record import ArrayRecordDataset
from test_array_record import record_number

data = ArrayRecordDataset(sys.argv[1:], decode=record_number)  # checked in a child: nothing native here
loader = DataLoader(data, batch_size=4, shuffle=True, generator=7, num_workers=2, multiprocessing_context="fork")
epochs = [[int(x) for batch in loader for x in batch] for _ in range(2)]
data[0]  # now this process has used array_record: a worker forked from it must refuse to read
try:
    list(DataLoader(data, batch_size=4, num_workers=2, multiprocessing_context="fork"))
    refused = None
except RuntimeError as exc:
    refused = str(exc)
print("RESULT " + json.dumps({"epochs": epochs, "refused": refused}))
"""


def test_fork_workers_read_and_a_fork_after_a_read_is_refused(parts: list[Path]) -> None:
    """In a fresh interpreter that has not touched array_record's native code: fork workers read
    every record once per epoch; after the loader's process reads, fork workers refuse with an
    error that says what to do, rather than risk a hang or a crash in array_record."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, *sys.path]))
    done = subprocess.run(
        [sys.executable, "-c", FORK_CHILD, *map(str, parts)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        env=env,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and len(lines) == 1, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(lines[0][len("RESULT ") :])
    for epoch in result["epochs"]:
        assert sorted(epoch) == list(range(23))
    assert result["refused"] is not None, "a worker forked after the parent read was not refused"
    assert "forked from process" in result["refused"] and "multiprocessing_context='forkserver'" in result["refused"]


def test_the_torch_flavour_loads_it(parts: list[Path]) -> None:
    torch = pytest.importorskip("torch")
    from stoker.torch import DataLoader as TorchFlavourLoader

    data = ArrayRecordDataset(parts, decode=record_number)
    batches = list(TorchFlavourLoader(data, batch_size=5))
    assert all(isinstance(b, torch.Tensor) for b in batches)
    assert torch.cat(batches).tolist() == list(range(23))


def test_bad_paths_are_refused_naming_them(parts: list[Path], tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such ArrayRecord file") as missing:
        ArrayRecordDataset([parts[0], tmp_path / "absent.array_record"])
    assert missing.value.filename == str(tmp_path / "absent.array_record")
    with pytest.raises(FileNotFoundError, match="no ArrayRecord file matches the pattern") as empty:
        ArrayRecordDataset(str(tmp_path / "train-*.array_record"))
    assert empty.value.filename == str(tmp_path / "train-*.array_record")
    with pytest.raises(IsADirectoryError, match=r"pattern such as .*\*\.array_record"):
        ArrayRecordDataset(tmp_path)
    with pytest.raises(ValueError, match=r"paths should name at least one ArrayRecord file, but got paths=\[\]"):
        ArrayRecordDataset([])
    with pytest.raises(TypeError, match="paths should be a path, a glob pattern or a sequence"):
        ArrayRecordDataset(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"paths should hold str or os\.PathLike entries, but got 5"):
        ArrayRecordDataset([parts[0], 5])  # type: ignore[list-item]
    with pytest.raises(
        TypeError, match="decode should be a callable taking a record's bytes or None, but got decode=3"
    ):
        ArrayRecordDataset(parts, decode=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("damage", ["garbage", "half", "grown", "empty", "footer"])
def test_a_file_that_is_not_array_record_is_refused_naming_it(parts: list[Path], tmp_path: Path, damage: str) -> None:
    good = parts[2].read_bytes()
    bad = tmp_path / "bad.array_record"
    if damage == "garbage":
        bad.write_bytes(np.random.default_rng(0).bytes(len(good)))
    elif damage == "half":
        bad.write_bytes(good[: len(good) // 2])
    elif damage == "grown":
        bad.write_bytes(good + b"\0")
    elif damage == "empty":
        bad.write_bytes(b"")
    else:  # a byte of the postscript, in the file's last 64 KiB block
        body = bytearray(good)
        body[len(body) - (1 << 16) + 30] ^= 0x5A
        bad.write_bytes(bytes(body))
    with pytest.raises(CorruptShardError, match="not a readable ArrayRecord file") as refused:
        ArrayRecordDataset([parts[0], bad])
    assert str(refused.value).startswith(f"{bad}: ")


def corrupt_record(path: Path, number: int) -> None:
    """Flip a byte inside record `number`'s stored bytes (the file is uncompressed)."""
    body = bytearray(path.read_bytes())
    at = body.find(payload(number))
    assert at > 0
    body[at + len(payload(number)) - 1] ^= 0xFF
    path.write_bytes(bytes(body))


def test_a_damaged_record_is_an_error_naming_file_and_record(tmp_path: Path) -> None:
    first = write(tmp_path / "a.array_record", range(5))
    damaged = write(tmp_path / "b.array_record", range(5, 30), "group_size:1,uncompressed")
    corrupt_record(damaged, 17)  # record 12 of file b, index 17 of the dataset
    data = ArrayRecordDataset([first, damaged], decode=record_number)
    assert data.__getitems__([16, 18, 3]) == [16, 18, 3]  # the chunks around it read
    expected = rf"^{damaged}: record 12 \(index 17 of the dataset\) cannot be read: .*hash mismatch"
    with pytest.raises(CorruptShardError, match=expected):
        data[17]
    with pytest.raises(CorruptShardError, match=expected):
        data.__getitems__([0, 20, 17, 6])
    assert data[29] == 29
    # and from a worker, with its type
    loader = DataLoader(data, batch_size=6, num_workers=2, multiprocessing_context="forkserver")
    with pytest.raises(CorruptShardError, match=r"record 12 \(index 17 of the dataset\)"):
        list(loader)


def test_a_file_changed_after_construction_is_an_error(parts: list[Path], tmp_path: Path) -> None:
    path = write(tmp_path / "c.array_record", range(10))
    data = ArrayRecordDataset([parts[0], path])
    write(path, range(4))  # rewritten with fewer records
    with pytest.raises(CorruptShardError, match=rf"^{path}: holds 4 records, but held 10 .*the file changed"):
        data[12]
    path.write_bytes(parts[0].read_bytes()[:70000])  # cut short
    with pytest.raises(CorruptShardError, match=rf"^{path}: not a readable ArrayRecord file"):
        data[12]
    path.unlink()
    with pytest.raises(FileNotFoundError, match="gone since the dataset was made"):
        data[12]
    assert data[1] == payload(1)  # the other file still reads


def test_out_of_range_and_non_integer_indices(parts: list[Path]) -> None:
    data = ArrayRecordDataset(parts)
    for index in (23, -24, 10**12):
        with pytest.raises(IndexError, match=f"index {index} is out of range for an ArrayRecordDataset of 23 records"):
            data[index]
    with pytest.raises(IndexError, match="of 23 records"):
        data.__getitems__([0, 23])
    with pytest.raises(TypeError, match="indices should be integers, but got str"):
        data["1"]  # type: ignore[index]
    with pytest.raises(TypeError, match="indices should be integers, but got float"):
        data.__getitems__([1.0])  # type: ignore[list-item]


def test_pickles_without_its_open_readers(parts: list[Path]) -> None:
    data = ArrayRecordDataset(parts, decode=record_number)
    assert data[20] == 20  # readers open here: they must not travel
    assert data._readers.peek() is not None
    copy = pickle.loads(pickle.dumps(data))
    assert copy._readers.peek() is None
    assert copy.paths == data.paths and copy.record_counts == data.record_counts
    assert [copy[i] for i in range(len(copy))] == list(range(23))
    data.close()
    assert data._readers.peek() is None and data[0] == 0  # opened again on use


def test_resume_mid_epoch_gives_the_rest_exactly(parts: list[Path], tmp_path: Path) -> None:
    data = ArrayRecordDataset(parts, decode=record_number)

    def loader(**extra: object) -> DataLoader:
        return DataLoader(data, batch_size=3, shuffle=True, generator=11, **extra)

    whole = [b.tolist() for b in loader()]
    run = loader(num_workers=2, multiprocessing_context="forkserver")
    it = iter(run)
    head = [next(it).tolist() for _ in range(3)]
    state = json.loads(json.dumps(run.state_dict()))  # as a checkpoint keeps it
    del it
    resumed = loader()
    resumed.load_state_dict(state)
    assert head + [b.tolist() for b in resumed] == whole
    # a state taken over other files is refused, naming what differs
    other = ArrayRecordDataset([parts[2], parts[0], parts[1], parts[3]], decode=record_number)
    elsewhere = DataLoader(other, batch_size=3, shuffle=True, generator=11)
    with pytest.raises(ValueError, match="files_digest"):
        elsewhere.load_state_dict(state)


def test_describe_and_doctor_lines(parts: list[Path], tmp_path: Path) -> None:
    data = ArrayRecordDataset(parts)
    described = data.stoker_describe()
    assert described["records"] == 23 and described["files"] == 4 and described["decode"] is None
    # the same files in another folder are the same stream; a decode is named
    moved = tmp_path / "moved"
    moved.mkdir()
    copies = [moved / p.name for p in parts]
    for source, target in zip(parts, copies):
        target.write_bytes(source.read_bytes())
    assert ArrayRecordDataset(copies).stoker_describe() == described
    assert ArrayRecordDataset(parts, decode=record_number).stoker_describe()["decode"] == "record_number"
    lines = data.stoker_doctor_lines()
    assert lines[0] == "ArrayRecordDataset: 23 records in 4 files"
    assert "1 of the files were written with group_size > 1 (up to 4" in lines[1] and str(parts[3]) in lines[1]
    assert ArrayRecordDataset(parts[:3]).stoker_doctor_lines() == ["ArrayRecordDataset: 18 records in 3 files"]


def test_construction_leaves_no_array_record_threads_here(tmp_path: Path) -> None:
    """Counting happens in a child interpreter: array_record's reader pool (64 threads, for the
    process's life) is not started in the loader's process until it reads. Checked in a fresh
    interpreter, since any earlier test may have read in this one."""
    path = write(tmp_path / "t.array_record", range(3))
    code = (
        "import os, sys\n"
        "from stoker._shards.array_record import ArrayRecordDataset\n"
        "base = len(os.listdir('/proc/self/task'))\n"
        "data = ArrayRecordDataset(sys.argv[1])\n"
        "before = len(os.listdir('/proc/self/task'))\n"
        "data[0]\n"
        "print(len(data), base, before, len(os.listdir('/proc/self/task')))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    records, base, before, after = map(int, done.stdout.split())
    assert records == 3 and before == base and after > before


def test_readers_beyond_the_cap_are_dropped_and_reopened(parts: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker._shards import array_record

    monkeypatch.setattr(array_record, "MOST_OPEN", 2)
    data = ArrayRecordDataset(parts, decode=record_number)
    for _ in range(2):  # every file opened, dropped and opened again on the way
        assert data.__getitems__(list(range(23))[::-1]) == list(range(23))[::-1]
        assert [data[i] for i in (0, 8, 20, 1, 9, 21)] == [0, 8, 20, 1, 9, 21]
    readers = data._readers.peek()
    assert readers is not None and len(readers._open) == 2


def test_a_check_that_dies_or_stalls_names_the_file(parts: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The checking child answers one line per file: one that dies by a signal at the second
    file (as an abort in array_record would) or stalls there names that file."""
    from stoker._shards import array_record

    answer_first = (
        "import json, os, signal, sys, time\n"
        "request = json.loads(sys.stdin.read())\n"
        "print(json.dumps({'records': 7, 'group_size': 1}), flush=True)\n"
    )
    monkeypatch.setattr(array_record, "_CHECKER", answer_first + "os.kill(os.getpid(), signal.SIGKILL)\n")
    with pytest.raises(CorruptShardError, match=rf"^{parts[1]}: opening this ArrayRecord file ended .*SIGKILL"):
        ArrayRecordDataset(parts)
    monkeypatch.setattr(array_record, "_CHECKER", answer_first + "time.sleep(30)\n")
    monkeypatch.setattr(array_record, "CHECK_S", 0.5)
    monkeypatch.setattr(array_record, "CHECK_S_PER_FILE", 0.0)
    with pytest.raises(TimeoutError, match=rf"^{parts[1]}: checking the ArrayRecord files ran past 0.5 s"):
        ArrayRecordDataset(parts)
