"""The leak check that tests/conftest.py puts on every test under tests/, whatever its tier:
run on a generated suite, it must fail exactly the tests that leave something behind, name
what they left, and let the others (and declared exceptions, tests that opt out with a
reason, and what another program on the machine makes meanwhile) pass."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent

LEAKY = """
import mmap, os, subprocess, sys, threading, time

import numpy as np
import pytest

import stoker

kept = []  # module-level: outlives each test, as a leak does


class Numbers(stoker.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return np.full(4, i, np.float32)


def stuck_thread(name):
    stop = threading.Event()
    kept.append(stop)
    threading.Thread(target=stop.wait, name=name, daemon=True).start()


def test_clean_with_workers():
    loader = stoker.DataLoader(Numbers(), batch_size=2, num_workers=2)
    assert len(list(loader)) == 4  # its arena goes with it once the test returns


def test_child_process():
    # a child that ends when its stdin closes: with this pytest process, at the latest
    kept.append(subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE))


def test_thread():
    stuck_thread("leaky-thread")


def test_pipe():
    kept.append(os.pipe())


def test_dev_shm_entry():
    # a segment made and kept mapped (not its descriptor: the entry is all that is left)
    fd = os.open(f"/dev/shm/stoker-leak-check-{os.environ['LEAKY_SHM_TOKEN']}", os.O_CREAT | os.O_RDWR)
    os.ftruncate(fd, 4096)
    kept.append(mmap.mmap(fd, 4096))
    os.close(fd)


def test_dev_shm_entry_named_after_this_process():
    # as torch's file_system strategy names its files; nobody holds it, its name says whose it is
    open(f"/dev/shm/torch_{os.getpid()}_{os.environ['LEAKY_SHM_TOKEN']}", "w").close()


def test_another_programs_dev_shm_entries_are_not_ours():
    where = os.environ["LEAKY_OTHER_DIR"]
    open(os.path.join(where, "make"), "w").close()
    deadline = time.monotonic() + 60  # a bound on a hang
    while not os.path.exists(os.path.join(where, "made")):
        assert time.monotonic() < deadline, "the other program never made its entries"
        time.sleep(0.01)
    made = [name for name in os.listdir("/dev/shm") if "other" + os.environ["LEAKY_SHM_TOKEN"] in name]
    assert len(made) == 3, made


def test_loader_kept():
    loader = stoker.DataLoader(Numbers(), batch_size=2, num_workers=2)
    assert len(list(loader)) == 4
    kept.append(loader)


@pytest.mark.leaks_allowed("threads", reason="this test keeps a thread on purpose")
def test_declared_thread():
    stuck_thread("declared-thread")


@pytest.mark.leaks_allowed("threads", reason="allows threads, not pipes")
def test_declared_thread_and_an_undeclared_pipe():
    stuck_thread("declared-thread-2")
    kept.append(os.pipe())


@pytest.mark.leaks_allowed("threads")
def test_declaration_without_a_reason():
    pass


@pytest.mark.leaks_allowed("sockets", reason="not a kind the check knows")
def test_declaration_of_an_unknown_kind():
    pass


def test_failing_test_is_reported_once():
    stuck_thread("thread-of-a-failing-test")
    assert False, "the test's own failure"


def test_with_no_leaks_fixture(no_leaks):
    assert no_leaks is not None
"""

OTHER_TIER = """
import threading

import pytest

kept = []


def test_every_tier_is_checked():
    stop = threading.Event()
    kept.append(stop)
    threading.Thread(target=stop.wait, name="unit-thread", daemon=True).start()


@pytest.mark.leaks_allowed(reason="opts out of the check: keeps a thread and a pipe on purpose")
def test_opted_out():
    import os

    stop = threading.Event()
    kept.append((stop, os.pipe()))
    threading.Thread(target=stop.wait, daemon=True).start()


def test_no_leaks_gives_the_snapshot(no_leaks):
    stop = threading.Event()
    kept.append(stop)
    threading.Thread(target=stop.wait, name="opted-in-thread", daemon=True).start()
"""


# Another program on the machine (not a process of the test session's): when asked (a file "make"
# in its folder), it makes three /dev/shm entries during the test: one nobody holds (as a
# multiprocessing segment its maker has closed and a resource tracker unlinks later), one it keeps
# mapped, and one named after it as torch names its files; then it says so ("made") and waits.
OTHER_PROGRAM = """
import mmap, os, sys, time

where, token = sys.argv[1], sys.argv[2]
deadline = time.monotonic() + 120  # a bound on a hang
while not os.path.exists(os.path.join(where, "make")):
    if time.monotonic() > deadline:
        sys.exit("never asked")
    time.sleep(0.01)
open(f"/dev/shm/psm_{token}", "w").close()
fd = os.open(f"/dev/shm/held-{token}", os.O_CREAT | os.O_RDWR)
os.ftruncate(fd, 4096)
held = mmap.mmap(fd, 4096)
os.close(fd)
open(f"/dev/shm/torch_{os.getpid()}_{token}", "w").close()
open(os.path.join(where, "made.tmp"), "w").close()
os.replace(os.path.join(where, "made.tmp"), os.path.join(where, "made"))
sys.stdin.read()  # holds its mapping until the test is done with it
"""


def outcomes(junit: Path) -> dict[str, list[str]]:
    """Per test name: its failures and errors, as "failure: message" / "error: message"."""
    out = {}
    for case in ET.parse(junit).iter("testcase"):
        out[case.get("name")] = [
            f"{child.tag}: {child.get('message', '')}" for child in case if child.tag in ("failure", "error")
        ]
    return out


def test_the_leak_check_fails_what_leaks_and_names_it(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    for tier in ("integration", "unit"):
        (suite / tier).mkdir(parents=True)
    shutil.copy(TESTS / "conftest.py", suite)  # which imports tests.support from the repo root
    # the marker, registered in pyproject.toml for the real suite
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n    leaks_allowed(*kinds, reason): see pyproject.toml\n")
    (suite / "integration" / "test_leaky.py").write_text(textwrap.dedent(LEAKY))
    (suite / "unit" / "test_other_tier.py").write_text(textwrap.dedent(OTHER_TIER))
    token = uuid.uuid4().hex
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(OTHER_PROGRAM), str(other_dir), "other" + token], stdin=subprocess.PIPE
    )
    junit = tmp_path / "junit.xml"
    try:
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-p",
                "no:cacheprovider",
                "-q",
                "--leak-settle=0.3",
                "-o",
                "timeout=60",
                "-o",
                "timeout_method=thread",
                f"--junitxml={junit}",
                str(suite),
            ],
            cwd=suite,
            env=dict(
                os.environ,
                LEAKY_SHM_TOKEN=token,
                LEAKY_OTHER_DIR=str(other_dir),
                PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src")]),
            ),
            capture_output=True,
            text=True,
            timeout=90,
        )
    finally:
        other.communicate(timeout=60)  # EOF on its stdin: it exits
        for name in os.listdir("/dev/shm"):
            if token in name:
                os.unlink(f"/dev/shm/{name}")
    output = run.stdout + run.stderr
    assert run.returncode == 1, output
    got = outcomes(junit)

    def error(name: str) -> str:
        problems = got[name]
        assert len(problems) == 1 and problems[0].startswith("error: "), (name, problems, output)
        assert "left behind" in problems[0], problems
        return problems[0]

    assert got["test_clean_with_workers"] == [], output
    assert "child processes left" in error("test_child_process") and "sys.stdin.read()" in error("test_child_process")
    assert "threads left: ['leaky-thread']" in error("test_thread")
    assert "file descriptors left" in error("test_pipe") and "pipe:" in error("test_pipe")
    assert f"/dev/shm entries left: ['stoker-leak-check-{token}']" in error("test_dev_shm_entry")
    named = error("test_dev_shm_entry_named_after_this_process")
    assert "/dev/shm entries left: ['torch_" in named and token in named
    assert got["test_another_programs_dev_shm_entries_are_not_ours"] == [], output
    assert other.returncode == 0, "the other program was never asked to make its entries"
    kept_loader = error("test_loader_kept")
    assert "/memfd:stoker-slot" in kept_loader and "a DataLoader's arena" in kept_loader
    assert got["test_declared_thread"] == [], output
    mixed = error("test_declared_thread_and_an_undeclared_pipe")
    assert "pipe:" in mixed and "threads left" not in mixed
    assert "needs a reason=" in got["test_declaration_without_a_reason"][0], output
    assert "['sockets'] not in" in got["test_declaration_of_an_unknown_kind"][0], output
    failing = got["test_failing_test_is_reported_once"]
    assert len(failing) == 1 and failing[0].startswith("failure: ") and "own failure" in failing[0], failing
    assert got["test_with_no_leaks_fixture"] == [], output
    assert "threads left: ['unit-thread']" in error("test_every_tier_is_checked")
    assert got["test_opted_out"] == [], output
    assert "threads left: ['opted-in-thread']" in error("test_no_leaks_gives_the_snapshot")
