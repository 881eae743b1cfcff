"""torch's observables that torchdata's `StatefulDataLoader` keeps, through `torch.utils.data`,
torchdata and `stoker.torch` side by side (issue 45):

- a dead worker's `WorkerDiedError` is rebuilt from its message (`type(e)(str(e))`, as torch's
  `ExceptionWrapper` and torch's own test of a segfaulting worker rebuild it) and pickles back
  with its attributes; so does every other error stoker defines with more than a message;
- `default_collate` of nested (and sparse) tensors raises torch's own RuntimeError in torch's
  words, directly and from a loader's `next()`;
- an `IterDataPipe` (or `MapDataPipe`) holding lambdas works under `spawn` with `dill`
  installed, as torch's loader makes it work, giving the same items.
"""

from __future__ import annotations

import ast
import base64
import gc
import json
import pickle
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchdata")
import torch.utils.data as tud  # noqa: E402
from torch._utils import ExceptionWrapper  # noqa: E402
from torch.utils.data.datapipes.iter import IterableWrapper  # noqa: E402
from torch.utils.data.datapipes.map import SequenceWrapper  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

import stoker.torch as st  # noqa: E402
from stoker._core import errors as core_errors  # noqa: E402
from stoker._shards import errors as shard_errors  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
    pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled:UserWarning"),
]

SRC = Path(__file__).resolve().parents[2] / "src" / "stoker"
WAIT_S = 60  # the loaders' own timeout: a hang fails the test instead of stalling the run
CHILD_S = 180  # the hard timeout of a child process
FAULT_AT = 5  # the sample index whose fetch kills its worker

# ------------------------------------------------------------------ a dead worker's error

# Runs in a child process: a stoker.torch.DataLoader whose worker dies (SIGKILL, or a real
# segfault) at sample FAULT_AT; prints what the loop caught, rebuilt from its message, pickled
# itself, and pickled inside torch's ExceptionWrapper (as torch's test harness sends it).
CHILD = textwrap.dedent(
    """
    import base64, ctypes, json, os, pickle, signal, sys
    import numpy as np
    import stoker.torch as st
    from torch._utils import ExceptionWrapper

    KIND, FAULT_AT, WAIT_S = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])

    class Dies(st.Dataset):
        def __len__(self):
            return 12
        def __getitem__(self, i):
            if i == FAULT_AT:
                if KIND == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                ctypes.string_at(0)  # a real segmentation fault
            return np.full(2, i)

    def b64(obj):
        return base64.b64encode(pickle.dumps(obj)).decode()

    out = {}
    loader = st.DataLoader(Dies(), batch_size=2, num_workers=2, timeout=WAIT_S, multiprocessing_context="fork")
    try:
        for _ in loader:
            pass
        out["caught"] = None
    except Exception as exc:
        out["caught"] = type(exc).__name__
        out["wrapper"] = b64(ExceptionWrapper(sys.exc_info(), where="in the child"))
        out["message"] = str(exc)
        out["attrs"] = {k: getattr(exc, k, "missing") for k in ("worker_id", "pid", "exitcode", "batch", "index")}
        try:
            rebuilt = type(exc)(str(exc))
            out["rebuilt"] = [type(rebuilt).__name__, str(rebuilt)]
        except Exception as failed:
            out["rebuilt"] = ["failed", repr(failed)]
        try:
            out["pickled"] = b64(exc)
        except Exception as failed:
            out["pickled"] = None
            out["pickle_failed"] = repr(failed)
    print(json.dumps(out))
    """
)


@pytest.mark.parametrize(("kind", "signum"), [("sigkill", 9), ("sigsegv", 11)])
def test_a_killed_workers_error_rebuilds_from_its_message_and_pickles_with_its_attributes(
    kind: str, signum: int
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, kind, str(FAULT_AT), str(WAIT_S)],
        capture_output=True,
        text=True,
        timeout=CHILD_S,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["caught"] == "WorkerDiedError", out
    attrs = out["attrs"]
    assert attrs["exitcode"] == -signum and attrs["worker_id"] in (0, 1) and isinstance(attrs["pid"], int)
    assert attrs["batch"] == FAULT_AT // 2 and FAULT_AT in attrs["index"]
    assert f"(pid {attrs['pid']})" in out["message"]

    # type(e)(str(e)): what torch's ExceptionWrapper and torch's segfault test do
    assert out["rebuilt"] == ["WorkerDiedError", out["message"]]

    # pickled in the child, unpickled here: same type, message and attributes
    assert out["pickled"] is not None, out.get("pickle_failed")
    back = pickle.loads(base64.b64decode(out["pickled"]))
    assert type(back) is st.WorkerDiedError and str(back) == out["message"]
    assert {k: getattr(back, k) for k in attrs} == attrs
    assert back.args == (out["message"],)

    # torch's wrapper re-raises the same type here (it falls back to RuntimeError when the
    # type cannot be made from a message)
    wrapper = pickle.loads(base64.b64decode(out["wrapper"]))
    assert isinstance(wrapper, ExceptionWrapper)
    with pytest.raises(st.WorkerDiedError) as raised:
        wrapper.reraise()
    assert out["message"] in str(raised.value) and "in the child" in str(raised.value)


def _classes_defined_in(module: Any) -> list[type[BaseException]]:
    """Every exception or warning class a module defines at its top level."""
    tree = ast.parse(Path(module.__file__).read_text())
    names = [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
    return [c for n in names if isinstance(c := getattr(module, n), type) and issubclass(c, BaseException)]


# one instance of each error class those modules define, made as stoker makes it
ERRORS: dict[type, BaseException] = {
    core_errors.WorkerError: core_errors.WorkerError("Caught Boom in DataLoader worker 0", "Boom"),
    core_errors.WorkerDiedError: core_errors.WorkerDiedError(
        1, 4242, -11, " while fetching sample indices [4, 5]", batch=2, index=[4, 5]
    ),
    core_errors.WorkerRestartWarning: core_errors.WorkerRestartWarning("worker 0 restarted"),
    core_errors.RemoteTraceback: core_errors.RemoteTraceback("Traceback (most recent call last): ..."),
    core_errors.UnshardedWarning: core_errors.UnshardedWarning("every rank reads all of it"),
    core_errors.ReplicaUnsaved: core_errors.ReplicaUnsaved("its state_dict() raised KeyError: 0", 1, "raised"),
    shard_errors.StoreError: shard_errors.StoreError("s3://b/x", "503 after 6 retries"),
    shard_errors.MissingObjectError: shard_errors.MissingObjectError("s3://b/x"),
    shard_errors.AccessDeniedError: shard_errors.AccessDeniedError("s3://b/x", "403"),
    shard_errors.Transient: shard_errors.Transient("short body"),
    shard_errors.Relayed: shard_errors.Relayed("transient", "ConnectionResetError: reset"),
    shard_errors.OwnerGone: shard_errors.OwnerGone("pid 1 has exited"),
    shard_errors.RangeNotSatisfiable: shard_errors.RangeNotSatisfiable("416"),
    shard_errors.SizeMismatch: shard_errors.SizeMismatch("3 bytes, expected 4"),
    shard_errors.MissingIndexError: shard_errors.MissingIndexError("s3://b/p"),
    shard_errors.MalformedIndexError: shard_errors.MalformedIndexError("s3://b/p/stoker-index.json: not JSON"),
    shard_errors.CacheFullError: shard_errors.CacheFullError("shard cache /c has no room"),
    shard_errors.CorruptShardError: shard_errors.CorruptShardError("s.tar, sample 3: bad header"),
}
# their one-argument form is the URL (public API), so a message given alone gains the default reason
URL_FIRST = (shard_errors.MissingObjectError, shard_errors.AccessDeniedError, shard_errors.MissingIndexError)


def test_every_error_class_of_the_core_and_shards_is_checked_here() -> None:
    defined = set(_classes_defined_in(core_errors)) | set(_classes_defined_in(shard_errors))
    assert defined - {shard_errors._AtURL} == set(ERRORS)


@pytest.mark.parametrize("exc", list(ERRORS.values()), ids=lambda e: type(e).__name__)
def test_each_error_is_rebuilt_from_its_message_and_pickles_with_its_attributes(exc: BaseException) -> None:
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and str(back) == str(exc) and vars(back) == vars(exc)
    rebuilt = type(exc)(str(exc))
    assert type(rebuilt) is type(exc)
    if isinstance(exc, URL_FIRST):
        assert str(exc) in str(rebuilt)
    else:
        assert str(rebuilt) == str(exc) and rebuilt.args == (str(exc),)
    again = pickle.loads(pickle.dumps(rebuilt))  # a rebuilt error pickles too
    assert type(again) is type(exc) and str(again) == str(rebuilt) and vars(again) == vars(rebuilt)


def test_a_worker_died_error_made_from_its_message_has_no_worker_fields() -> None:
    made = st.WorkerDiedError("DataLoader worker 0 (pid 7) was killed by signal SIGKILL (9)")
    assert str(made) == "DataLoader worker 0 (pid 7) was killed by signal SIGKILL (9)"
    assert (made.worker_id, made.pid, made.exitcode, made.batch, made.index) == (None,) * 5
    assert isinstance(made, RuntimeError)


# ------------------------------------------------------------------ nested tensors


def _nested(i: int, layout: Any = torch.strided) -> Any:
    return torch.nested.nested_tensor([torch.ones(2), torch.arange(float(i + 1))], layout=layout)


def _raised(call: Any) -> tuple[type, str]:
    """The type and message of what `call()` raises (the exception itself is dropped, so that
    nothing it refers to, a loader's iterator and its workers, outlives this call)."""
    try:
        call()
    except Exception as exc:
        return type(exc), str(exc)
    raise AssertionError("no exception")


def _batches() -> dict[str, list[Any]]:
    sparse = torch.sparse_coo_tensor([[0]], [1.0], (3,))
    return {
        "nested": [_nested(0), _nested(1)],
        "jagged": [_nested(0, torch.jagged), _nested(1, torch.jagged)],
        "nested-in-dict": [{"x": _nested(0), "y": 1}, {"x": _nested(1), "y": 2}],
        "nested-in-tuple": [(0, _nested(0)), (1, _nested(1))],
        "sparse": [sparse, sparse],
    }


@pytest.mark.parametrize("case", ["nested", "jagged", "nested-in-dict", "nested-in-tuple", "sparse"])
def test_default_collate_of_nested_and_sparse_tensors_raises_torchs_runtime_error(case: str) -> None:
    batch = _batches()[case]
    theirs = _raised(lambda: tud.default_collate(batch))
    ours = _raised(lambda: st.default_collate(batch))
    assert theirs[0] is RuntimeError and "are not currently supported by the default collate_fn" in theirs[1]
    assert ours == theirs


class NestedSamples(tud.Dataset):
    """Each sample is a nested tensor of two ragged rows."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> Any:
        return _nested(i)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loaders_over_nested_tensors_raise_torchs_error_in_next(num_workers: int) -> None:
    found = {}
    for name, cls in (("torch", tud.DataLoader), ("torchdata", StatefulDataLoader), ("stoker", st.DataLoader)):
        kwargs: dict[str, Any] = {"batch_size": 2, "num_workers": num_workers}
        if num_workers:
            kwargs["timeout"] = WAIT_S
        iterator = iter(cls(NestedSamples(), **kwargs))
        found[name] = _raised(iterator.__next__)
        # torch's own tests stop a failed iterator's workers so (torchdata's, merely dropped,
        # leaves its workers' pipes open until the next process starts)
        if num_workers:
            iterator._shutdown_workers()
        del iterator
        gc.collect()
    words = _raised(lambda: tud.default_collate([_nested(0), _nested(1)]))[1]
    if num_workers == 0:
        assert found["stoker"] == found["torchdata"] == found["torch"] == (RuntimeError, words)
    else:  # each says the error was caught in a worker, then torch's words
        for name, (kind, message) in found.items():
            assert kind is RuntimeError, name
            assert message.startswith("Caught RuntimeError in DataLoader worker"), (name, message)
            assert words in message, (name, message)


# ------------------------------------------------------------------ DataPipes holding lambdas


def _pipe_items(batch: Any) -> list[int]:
    return [int(x) for x in batch.reshape(-1)] if isinstance(batch, torch.Tensor) else [int(batch)]


def _under_spawn(cls: type, dataset: Any, **kwargs: Any) -> list[int]:
    loader = cls(dataset, num_workers=2, multiprocessing_context="spawn", timeout=WAIT_S, **kwargs)
    return [x for batch in loader for x in _pipe_items(batch)]


@pytest.mark.timeout(400)
def test_an_iter_datapipe_holding_lambdas_under_spawn_gives_torchs_items() -> None:
    def run(cls: type) -> list[int]:
        torch.manual_seed(3)
        # lambdas in every stage after the source; the random stage is seeded and the
        # sharding_filter sharded by the loader, in each spawned worker
        pipe = IterableWrapper(range(20)).shuffle(buffer_size=4).sharding_filter().map(lambda x: x * 2)
        return _under_spawn(cls, pipe.filter(lambda x: x % 3 != 0), batch_size=2)

    theirs = run(tud.DataLoader)
    stateful = run(StatefulDataLoader)
    ours = run(st.DataLoader)
    assert theirs == stateful
    assert ours == theirs
    assert sorted(ours) == [x * 2 for x in range(20) if x * 2 % 3 != 0]


@pytest.mark.timeout(300)
def test_a_map_datapipe_holding_lambdas_under_spawn_gives_torchs_items() -> None:
    def pipe() -> Any:
        return SequenceWrapper(range(12)).map(lambda x: x * 3)

    theirs = _under_spawn(tud.DataLoader, pipe(), batch_size=4)
    ours = _under_spawn(st.DataLoader, pipe(), batch_size=4)
    assert ours == theirs == [x * 3 for x in range(12)]


def test_loader_dataset_of_a_pipe_is_an_iter_datapipe_with_the_same_items() -> None:
    # torch and torchdata replace the pipe with a private wrapper (torch's way of pickling it with
    # dill); stoker keeps the user's pipe, so its attributes stay reachable. Both are IterDataPipes
    # and IterableDatasets, and iterate alike.
    pipe = IterableWrapper(range(6)).map(lambda x: -x)
    loaders = {"torch": tud.DataLoader(pipe), "torchdata": StatefulDataLoader(pipe), "stoker": st.DataLoader(pipe)}
    for name, loader in loaders.items():
        assert isinstance(loader.dataset, tud.IterDataPipe) and isinstance(loader.dataset, tud.IterableDataset), name
        assert list(loader.dataset) == [0, -1, -2, -3, -4, -5], name
    assert loaders["stoker"].dataset is pipe
    assert type(loaders["torch"].dataset) is type(loaders["torchdata"].dataset)
    assert loaders["torch"].dataset is not pipe


class _Started(tud.IterDataPipe):
    """A pipe holding a started generator: neither pickle nor dill can send it (dill sends the
    locks and lambdas pickle refuses)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = iter(x for x in range(4))

    def __iter__(self) -> Any:
        return iter(range(4))


@pytest.mark.timeout(300)
def test_a_pipe_dill_cannot_pickle_either_is_refused_under_spawn_naming_the_dataset() -> None:
    pipe = _Started().map(lambda x: x)
    loader = st.DataLoader(pipe, num_workers=2, multiprocessing_context="spawn", timeout=WAIT_S)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "Got pickle error" warning, checked elsewhere
        with pytest.raises(TypeError, match="the dataset") as raised:
            list(loader)
    assert "lambda" in str(raised.value)  # plain pickle's complaint: the first one met


@pytest.mark.timeout(300)
def test_dill_is_for_pipes_only_a_lambda_collate_fn_is_refused_as_in_torch() -> None:
    pipe = IterableWrapper(range(4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # both loaders' "Got pickle error" warning
        theirs = _raised(lambda: _under_spawn(tud.DataLoader, pipe, collate_fn=lambda b: b))
        ours = _raised(lambda: _under_spawn(st.DataLoader, pipe, collate_fn=lambda b: b))
    assert "pickle" in theirs[1].lower() and "lambda" in theirs[1]
    assert ours[0] is TypeError and "the collate_fn" in ours[1] and "lambda" in ours[1]
