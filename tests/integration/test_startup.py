"""Worker start-up: what a spawn/forkserver worker imports, and the forkserver that a
forkserver loader prepares (preloaded with stoker's worker modules and the dataset's module,
started when the loader is made). Each case runs in a fresh interpreter, with a hard timeout,
so that the test session's own forkserver and imports do not hide anything."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_fresh(code: str, tmp_path: Path) -> dict:
    """Run `code` in a fresh interpreter (tmp_path importable) and return the JSON it prints last."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT / "src")]))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


DATASET = """
import numpy as np
import stoker

class Squares(stoker.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return np.array([i, i * i])


def modules(batch):
    import sys
    return sorted(m for m in sys.modules if m.startswith("stoker"))
"""


def test_a_spawn_worker_imports_only_what_a_worker_needs(tmp_path: Path) -> None:
    (tmp_path / "squares.py").write_text(DATASET)
    report = run_fresh(
        """
        import json, sys
        import stoker
        from squares import Squares, modules

        if __name__ == "__main__":
            assert "stoker._core.loader" not in sys.modules  # importing stoker imports no loader
            loader = stoker.DataLoader(
                Squares(), batch_size=8, num_workers=1, multiprocessing_context="spawn",
                collate_fn=modules,
            )
            print(json.dumps({"worker": next(iter(loader))}))
        """,
        tmp_path,
    )
    worker = set(report["worker"])
    assert {"stoker._core.worker", "stoker._data.datasets"} <= worker
    # the main-process parts never reach a worker
    assert not worker & {"stoker._core.loader", "stoker._core.iterator", "stoker._core.auto", "stoker._doctor"}


@pytest.mark.skipif(sys.platform != "linux", reason="forkserver is a POSIX start method")
def test_a_forkserver_loader_starts_a_preloaded_server_when_made(tmp_path: Path) -> None:
    (tmp_path / "squares.py").write_text(DATASET)
    report = run_fresh(
        """
        import json
        from multiprocessing import forkserver
        import stoker
        from squares import Squares

        if __name__ == "__main__":
            forkserver.set_forkserver_preload(["__main__", "json"])  # the user's own list is kept
            loader = stoker.DataLoader(Squares(), batch_size=8, num_workers=2, multiprocessing_context="forkserver")
            server = forkserver._forkserver
            started = server._forkserver_pid is not None  # before any iter()
            batches = [b.tolist() for b in loader]
            print(json.dumps({"started": started, "preload": server._preload_modules, "batches": batches}))
        """,
        tmp_path,
    )
    assert report["started"]
    assert report["preload"][:2] == ["__main__", "json"]
    assert {"stoker._core.worker", "stoker._core.arena", "squares"} <= set(report["preload"])
    assert report["batches"] == [[[i, i * i] for i in range(k, k + 8)] for k in range(0, 40, 8)]


@pytest.mark.skipif(sys.platform != "linux", reason="forkserver is a POSIX start method")
def test_forkserver_workers_find_the_main_scripts_imports_already_imported(tmp_path: Path) -> None:
    """A forkserver worker runs the main script again; the server preloads what the script
    imported at its top, so the worker's run finds it imported instead of importing it anew."""
    (tmp_path / "squares.py").write_text(DATASET)
    imports = tmp_path / "imports.txt"
    (tmp_path / "heavy.py").write_text(
        "import os\n"
        f"with open({str(imports)!r}, 'a') as out:\n"
        "    out.write(f'{os.getpid()}\\n')\n"
        "def helper():\n"
        "    return 1\n"
    )
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
        import json, os
        import stoker
        from heavy import helper  # a function imported from the module is enough
        from squares import Squares

        if __name__ == "__main__":
            loader = stoker.DataLoader(Squares(), batch_size=8, num_workers=2, multiprocessing_context="forkserver")
            batches = [b.tolist() for b in loader]
            print(json.dumps({"main": os.getpid(), "batches": len(batches)}))
        """
        )
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT / "src")]))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["batches"] == 5
    pids = [int(line) for line in imports.read_text().split()]
    # the main process and the forkserver: not once more in each worker
    assert len(pids) == 2 and report["main"] in pids


FAILS_ONCE = """
import os
import sys

# counts its imports: the main process's comes first, then the forkserver's, then the workers'
count = os.path.join(os.path.dirname(os.path.abspath(__file__)), __name__ + ".count")
with open(count, "a") as out:
    out.write("+")
if os.path.getsize(count) == 2:  # the forkserver's import: a failure only there
    {action}
"""

NAMED = """
import numpy as np
import settings
import stoker

class Named(stoker.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return np.array([i, settings.ARGS.name == "lucky"])
"""


@pytest.mark.skipif(sys.platform != "linux", reason="forkserver is a POSIX start method")
def test_a_preload_module_that_raises_is_skipped_with_one_warning_and_workers_start(tmp_path: Path) -> None:
    """The forkserver preloads the main script's imports; one that raises there (and not in
    the main process or a worker) is skipped with a warning naming it, and the workers start;
    one that parses sys.argv at import reads the main process's arguments there."""
    (tmp_path / "raises_once.py").write_text(FAILS_ONCE.format(action='raise RuntimeError("not now")'))
    (tmp_path / "exits_once.py").write_text(FAILS_ONCE.format(action='sys.exit("not here")'))
    (tmp_path / "settings.py").write_text(
        "import argparse\n"
        "parser = argparse.ArgumentParser()\n"
        "parser.add_argument('--name', required=True)\n"
        "ARGS = parser.parse_args()\n"
    )
    (tmp_path / "named.py").write_text(NAMED)
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
        import json
        import exits_once
        import raises_once
        import stoker
        from named import Named
        from settings import ARGS

        if __name__ == "__main__":
            loader = stoker.DataLoader(Named(), batch_size=4, num_workers=2, multiprocessing_context="forkserver")
            print(json.dumps({"batches": [b.tolist() for b in loader]}))
        """
        )
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT / "src")]))
    done = subprocess.run(
        [sys.executable, str(script), "--name", "lucky"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    batches = json.loads(done.stdout.strip().splitlines()[-1])["batches"]
    assert batches == [[[i, 1] for i in range(k, k + 4)] for k in (0, 4)]  # each worker saw --name lucky
    for module, error in (("raises_once", "RuntimeError: not now"), ("exits_once", "SystemExit: not here")):
        assert done.stderr.count(f"could not preload module {module!r}") == 1, done.stderr
        assert error in done.stderr
        assert len((tmp_path / f"{module}.count").read_text()) == 4  # main, server, each worker
    assert "settings" not in done.stderr and "usage:" not in done.stderr, done.stderr


def test_main_imports_names_what_the_main_script_took(monkeypatch) -> None:
    import json
    import types

    from stoker._core.forkserver import main_imports

    main = types.ModuleType("__main__")
    main.__file__ = "/somewhere/train.py"
    main.json, main.loads, main.local = json, json.loads, 3  # a module, a function from one, a value
    main.Path = Path  # pathlib's class
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert main_imports() == ["json", Path.__module__]  # "pathlib"; "pathlib._local" from 3.13
    del main.__file__  # interactive: nothing runs again, nothing to preload
    assert main_imports() == []


def test_prepare_forkserver_adds_the_dataset_and_collate_modules_once(monkeypatch) -> None:
    import types
    from multiprocessing import forkserver

    import stoker
    from stoker._core.forkserver import ARGV_PREFIX, GUARD, WORKER_MODULES, prepare_forkserver

    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # nothing of pytest's
    fresh = forkserver.ForkServer()
    monkeypatch.setattr(forkserver, "_forkserver", fresh)
    monkeypatch.setattr(forkserver, "set_forkserver_preload", fresh.set_forkserver_preload)
    data = stoker.ArrayDataset([1, 2, 3])
    prepare_forkserver(data, stoker.default_collate)
    # the user's entries, then the guard that imports the rest under this process's argv
    expected = [
        "__main__",
        GUARD,
        ARGV_PREFIX + json.dumps(sys.argv),
        *WORKER_MODULES,
        "stoker._data.datasets",
        "stoker._data.collate",
    ]
    assert fresh._preload_modules == expected
    prepare_forkserver(data, stoker.default_collate)  # idempotent
    assert fresh._preload_modules == expected
    if importlib.util.find_spec("torch") is not None:
        import stoker.torch

        prepare_forkserver(data, stoker.torch.default_collate)  # the torch flavour's collate brings torch
        assert fresh._preload_modules[-1] == stoker.torch.default_collate.__module__
    assert fresh._forkserver_pid is None  # start=False starts nothing


MIXED = """
import sys
import numpy as np
import stoker

class Mixed(stoker.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return {
            "image": np.full((2, 3), i, np.uint8), "label": i, "weight": i / 2, "flag": i % 2 == 0,
            "score": np.float32(i), "name": f"s{i}", "pair": (i, np.arange(2) + i),
            "torch_loaded": "torch" in sys.modules,  # in this worker, when the sample was made
        }
"""


@pytest.mark.skipif(sys.platform != "linux", reason="forkserver is a POSIX start method")
@pytest.mark.parametrize(
    "env", [{}, {"STOKER_ARENA_MAX_BYTES": "1"}, {"STOKER_TRANSPORT": "pickle"}], ids=["arena", "no-slot", "pickle"]
)
def test_stoker_torch_workers_collate_without_importing_torch(tmp_path: Path, env: dict, monkeypatch) -> None:
    """A spawn/forkserver worker of stoker.torch whose dataset never imports torch does not
    import it to collate (seconds of start-up); the main process makes the tensors, equal
    in type, dtype and value to torch.utils.data's, whichever way the batch travels."""
    pytest.importorskip("torch")
    (tmp_path / "mixed.py").write_text(MIXED)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    report = run_fresh(
        """
        import json, warnings
        import torch
        import torch.utils.data as tud
        import stoker.torch as st
        from mixed import Mixed

        def same(a, b):
            if type(a) is not type(b):
                return False
            if isinstance(a, torch.Tensor):
                return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
            if isinstance(a, dict):
                return list(a) == list(b) and all(same(a[k], b[k]) for k in a if k != "torch_loaded")
            if isinstance(a, (list, tuple)):
                return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
            return a == b

        if __name__ == "__main__":
            warnings.simplefilter("ignore")  # the no-slot case warns once that it pickles
            want = list(tud.DataLoader(Mixed(), batch_size=4))
            out = {}
            for method in ("spawn", "forkserver"):
                got = list(st.DataLoader(Mixed(), batch_size=4, num_workers=2, multiprocessing_context=method))
                out[method] = {
                    "same": len(got) == len(want) and all(same(g, w) for g, w in zip(got, want)),
                    "torch_in_workers": [bool(b["torch_loaded"].any()) for b in got],
                }
            print(json.dumps(out))
        """,
        tmp_path,
    )
    for method in ("spawn", "forkserver"):
        assert report[method]["same"], report
        assert report[method]["torch_in_workers"] == [False] * 6, report
