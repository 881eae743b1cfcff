"""One errors module per public module: every exception type stoker defines lives in an
`errors` module of its package, each public module exports its errors from there under the
same names as before, and each pickles back to its own type with its message and fields (a
worker's error crosses to the main process)."""

from __future__ import annotations

import ast
import importlib
import pickle
from pathlib import Path
from typing import Any

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "stoker"

# public module -> the error names it exports, as before the errors were gathered
PUBLIC = {
    "stoker.shards": ["AccessDeniedError", "CacheFullError", "CorruptShardError", "MissingObjectError", "StoreError"],
    "stoker.vision": ["DecodeError"],
    "stoker": ["UnshardedWarning", "WorkerDiedError", "WorkerError", "WorkerRestartWarning"],
}


def exception_classes(path: Path) -> list[str]:
    """The classes defined at the top of `path` whose bases name an exception or warning."""
    tree = ast.parse(path.read_text())
    found = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(b) for b in node.bases]
            if any(b.endswith(("Error", "Exception", "Warning")) or b in ("_Located",) for b in bases):
                found.append(node.name)
    return found


def test_every_exception_type_is_defined_in_an_errors_module() -> None:
    # _mix is gathered by its own item of issue 42; EndOfStream is a worker's control signal
    elsewhere = {
        str(path.relative_to(SRC)): names
        for path in sorted(SRC.rglob("*.py"))
        if path.name != "errors.py" and "_mix" not in path.parts
        for names in [[n for n in exception_classes(path) if n != "EndOfStream"]]
        if names
    }
    assert elsewhere == {}, f"exception types outside an errors module: {elsewhere}"


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_modules_export_their_errors_from_their_errors_module(module: str) -> None:
    public = importlib.import_module(module)
    for name in PUBLIC[module]:
        cls = getattr(public, name)
        assert name in public.__all__
        assert cls.__module__.endswith(".errors"), f"{module}.{name} is defined in {cls.__module__}"


def _instances() -> list[Any]:
    from stoker._data.errors import (
        CollateTypeError,
        CollateValueError,
        DatasetTypeError,
        DatasetValueError,
    )
    from stoker._doctor.errors import DoctorError, MeasureError
    from stoker._shards import errors as shard_errors
    from stoker._vision.errors import DecodeError

    return [
        shard_errors.StoreError("s3://b/x", "503 after 6 retries"),
        shard_errors.MissingObjectError("s3://b/x"),
        shard_errors.AccessDeniedError("s3://b/x", "403"),
        shard_errors.MissingIndexError("s3://b/p"),
        shard_errors.MalformedIndexError("s3://b/p/stoker-index.json: not JSON"),
        shard_errors.CacheFullError("shard cache /c has no room"),
        shard_errors.CorruptShardError("s.tar, sample 3: bad header"),
        shard_errors.Relayed("transient", "ConnectionResetError: reset"),
        shard_errors.OwnerGone("pid 1 has exited"),
        shard_errors.Transient("short body"),
        CollateTypeError("cannot collate a set"),
        CollateValueError("lengths differ"),
        DatasetValueError("Size mismatch"),
        DatasetTypeError("not a dataset"),
        DoctorError("cannot import x"),
        MeasureError("sample 3 raised"),
        DecodeError("a.jpg: truncated"),
    ]


@pytest.mark.parametrize("exc", _instances(), ids=lambda e: type(e).__name__)
def test_each_error_pickles_to_its_own_type_with_its_message(exc: BaseException) -> None:
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and str(back) == str(exc)
    assert vars(back) == vars(exc)


def test_the_shard_errors_keep_the_builtin_types_users_catch() -> None:
    from stoker.shards import (
        AccessDeniedError,
        CacheFullError,
        CorruptShardError,
        MissingObjectError,
        StoreError,
    )

    assert issubclass(MissingObjectError, FileNotFoundError) and issubclass(AccessDeniedError, PermissionError)
    assert all(issubclass(c, OSError) for c in (StoreError, CacheFullError, CorruptShardError))
    from stoker._shards.errors import MalformedIndexError, MissingIndexError

    assert issubclass(MissingIndexError, MissingObjectError) and issubclass(MalformedIndexError, ValueError)
