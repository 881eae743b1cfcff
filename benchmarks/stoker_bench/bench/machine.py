"""What `stoker-bench` records of the machine: the memcpy ceilings (one core, two threads) and
the environment as found (CPUs, torch's threads, thread variables, stoker's bytecode)."""

from __future__ import annotations

import itertools
import os
import sys
import time
from typing import Any

import numpy as np

from stoker._core.loader import usable_cpus


def memcpy_gbps(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """One core's memcpy bandwidth: bytes copied per second, best of `reps`."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def memcpy_threads_gbps(threads: int = 2, nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Memcpy bandwidth of `threads` threads at once: each copies its share of one `nbytes`
    buffer with `np.copyto` (which releases the GIL), all started together; bytes copied per
    second from the start to the last thread's end, best of `reps`."""
    import threading

    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    bounds = [nbytes * k // threads for k in range(threads + 1)]
    best = float("inf")
    for _ in range(reps):
        ready = threading.Barrier(threads + 1)

        def copy(lo: int, hi: int, ready: threading.Barrier = ready) -> None:
            ready.wait()
            np.copyto(dst[lo:hi], src[lo:hi])

        workers = [threading.Thread(target=copy, args=(lo, hi)) for lo, hi in itertools.pairwise(bounds)]
        for thread in workers:
            thread.start()
        ready.wait()
        start = time.perf_counter()
        for thread in workers:
            thread.join()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def environment() -> dict[str, Any]:
    """What the run saw: CPUs, torch's thread count in the main process, thread variables.

    torch is looked at when it is imported: always when it is among the loaders (`--no-torch`
    does not import it just to report on it)."""
    machine: dict[str, Any] = {
        "cpus": usable_cpus(),
        "os_cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": None,
        "torch_threads": None,
    }
    torch = sys.modules.get("torch")  # imported by loader_modules unless --no-torch
    if torch is not None:
        machine["torch"] = torch.__version__
        machine["torch_threads"] = torch.get_num_threads()
    for name in THREAD_VARIABLES:
        machine[name] = os.environ.get(name, "unset")
    # spawn and forkserver workers import stoker afresh: without cached bytecode they compile it
    import importlib.util

    from stoker._core import loader

    machine["stoker_bytecode_cached"] = os.path.exists(importlib.util.cache_from_source(loader.__file__))
    machine["PYTHONDONTWRITEBYTECODE"] = os.environ.get("PYTHONDONTWRITEBYTECODE", "unset")
    return machine


def environment_line(machine: dict[str, Any]) -> str:
    """One line of what `environment` recorded."""
    torch = (
        f"torch {machine['torch']} with {machine['torch_threads']} threads in the main process"
        if machine.get("torch")
        else "torch not loaded"
    )
    variables = " ".join(f"{name}={machine.get(name, 'unset')}" for name in THREAD_VARIABLES)
    bytecode = ""
    if "stoker_bytecode_cached" in machine:
        bytecode = (
            f", stoker's bytecode {'cached' if machine['stoker_bytecode_cached'] else 'not cached'} "
            f"(PYTHONDONTWRITEBYTECODE={machine.get('PYTHONDONTWRITEBYTECODE', 'unset')})"
        )
    return (
        f"environment (as found, nothing set by the bench): {machine.get('cpus')} usable CPUs "
        f"(os.cpu_count() {machine.get('os_cpu_count')}), {torch}, {variables}{bytecode}"
    )
