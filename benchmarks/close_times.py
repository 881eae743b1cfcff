"""How long shutting a loader iterator down mid-epoch takes, with a full prefetch window.

`python benchmarks/close_times.py [options]` (run by `make bench` after `benchmarks/run.py`).

For each start method (fork, spawn, forkserver: those this platform has) and each stoker
transport (the default shared-memory arena, and `STOKER_TRANSPORT=pickle`, set in
`os.environ` while the iterator is made, used and closed), a map-style dataset of uint8
samples (default 1 MB each, batch 10: ~10 MB batches, 48 batches an epoch) is loaded with
`DataLoader(ds, batch_size=10, num_workers=4, prefetch_factor=2, multiprocessing_context=m)`,
which keeps 8 batches in flight. Cases:

- `full-close`: `next(it)` takes one batch; once the workers have made every batch they were
  sent (9 collated, counted through a log file the workers append to; or none for 0.3 s
  while every worker sleeps, as when one blocks sending a batch nobody reads: the `made`
  column says how many there were), `it.close()` is timed (`--settle S`: a fixed sleep instead).
- `full-drop`: the same, but the iterator is dropped: `del it; gc.collect()` is timed.
- `busy-close`: every sample sleeps 0.2 s (2 s a batch); right after iter(), once all four
  workers are inside `__getitem__`, `it.close()` is timed: how the shutdown ladder bounds a
  close while workers are busy. Neither loader interrupts a batch: stoker gives a busy worker
  the ladder's grace (`JOIN_TIMEOUT_S`) to finish it, then terminates it, so this close takes
  about the grace, whatever the machine; its limit is the grace plus the terminate step
  (`TERMINATE_TIMEOUT_S`), not the 500 ms of a full window.

torch.utils.data's DataLoader runs the same cases as a baseline (closing with its iterator's
`_shutdown_workers()`) when torch can be imported. After each close, the workers' pids (from
the log and from /proc, or `multiprocessing.active_children()` without /proc) are checked:
`left` counts those still running when close returned (they are then killed, after a grace
period, so that they cannot disturb the next measurement).

Repetitions: `--reps` (5) of stoker's full-window cases, `--busy-reps` (1) of its busy-close
(~2.5 s each) and `--torch-reps` (1) of the torch baseline (its spawn and forkserver workers
import torch, ~5 s a start on 2 cores); with these defaults the run takes about 2 minutes on
2 idle cores. The repetition loop is outermost. The table shows the median and max close
time and whether the max is within the case's limit; `--json PATH` writes the same with every
time.
Measured on stoker as it is at the time; see `git log` for when its shutdown changed.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from stoker._core.engines import JOIN_TIMEOUT_S, TERMINATE_TIMEOUT_S

CASES = ("full-close", "full-drop", "busy-close")
TRANSPORTS = ("arena", "pickle")
TRANSPORT_ENV = "STOKER_TRANSPORT"
TARGET_MS = 500.0  # a close with a full window, workers idle or blocked sending
BUSY_LIMIT_MS = (JOIN_TIMEOUT_S + TERMINATE_TIMEOUT_S) * 1000.0  # the ladder's grace, then terminate
QUIET_S = 0.3  # no batch made for this long: the workers have made all they can
SEND_MARGIN_S = 0.05  # after the last batch is collated, for its send to finish
GRACE_S = 5.0  # leftover workers get this long to go before they are killed


# ------------------------------------------------------------------ worker side
def _log(path: str, tag: str) -> None:
    """Append one line to the run's log; O_APPEND writes this small are atomic."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{tag} {os.getpid()}\n".encode())
    finally:
        os.close(fd)


class Samples:
    """Map-style: sample i is `sample_bytes` uint8 of value i % 251; optionally slow."""

    def __init__(self, length: int, sample_bytes: int, log_path: str, sleep_s: float = 0.0) -> None:
        self.length = length
        self.sample_bytes = sample_bytes
        self.log_path = log_path
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> np.ndarray:
        if self.sleep_s > 0:
            _log(self.log_path, "e")
            time.sleep(self.sleep_s)
        return np.full(self.sample_bytes, index % 251, dtype=np.uint8)


class LoggingCollate:
    """The loader's own default collate, then one log line: a batch was made."""

    def __init__(self, inner: Callable[[list[Any]], Any], log_path: str) -> None:
        self.inner = inner
        self.log_path = log_path

    def __call__(self, samples: list[Any]) -> Any:
        batch = self.inner(samples)
        _log(self.log_path, "c")
        return batch


# ------------------------------------------------------------------ processes
def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a process from /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def _descendants() -> set[int]:
    """The pids of this process's live descendants: its children, and the children of the
    forkserver it started."""
    if not os.path.isdir("/proc"):
        return {p.pid for p in multiprocessing.active_children() if p.pid is not None}
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None and stat[0] != "Z":
                children.setdefault(stat[1], []).append(int(name))
    found: set[int] = set()
    todo = [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    if os.path.isdir("/proc"):
        stat = _stat(pid)
        return stat is not None and stat[0] != "Z"
    return any(p.pid == pid for p in multiprocessing.active_children())


def _read_log(path: str) -> list[tuple[str, int]]:
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        tag, _, pid = line.partition(" ")
        if pid.isdigit():
            out.append((tag, int(pid)))
    return out


def _helper(pid: int) -> bool:
    """multiprocessing's own helper processes (forkserver, resource tracker), not workers."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return b"forkserver import main" in cmdline or b"resource_tracker import main" in cmdline


def _workers(log_path: str, before: set[int]) -> set[int]:
    """The run's worker pids: those that wrote to its log, and descendants new since it began."""
    new = {pid for pid in _descendants() - before if not _helper(pid)}
    return ({pid for _, pid in _read_log(log_path)} | new) - {os.getpid()}


def _reap(pids: set[int]) -> None:
    """Leftover workers: give them GRACE_S to go, then SIGKILL each by pid."""
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        multiprocessing.active_children()  # joins what has exited
        time.sleep(0.05)
    for pid in pids:
        if _alive(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    multiprocessing.active_children()


# ------------------------------------------------------------------ one measurement
@contextlib.contextmanager
def _environ(name: str, value: str | None) -> Iterator[None]:
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _running(pids: set[int]) -> bool:
    """Whether any of these processes is running or runnable (not asleep)."""
    if not os.path.isdir("/proc"):
        return False
    return any((stat := _stat(pid)) is not None and stat[0] in "RD" for pid in pids)


def _wait_for_window(log_path: str, before: set[int], target: int, settle: float | None) -> None:
    """Until `target` batches are made, or none has been made for QUIET_S while every worker
    sleeps (blocked sending a batch nobody reads, or idle); at most 10 s. A fixed `settle`
    seconds instead when given."""
    if settle is not None:
        time.sleep(settle)
        return
    start = last_change = time.monotonic()
    made = -1
    while time.monotonic() - start < 10.0:
        now_made = sum(tag == "c" for tag, _ in _read_log(log_path))
        now = time.monotonic()
        if now_made != made:
            made, last_change = now_made, now
        if made >= target:
            time.sleep(SEND_MARGIN_S)
            return
        if now - last_change >= QUIET_S and not _running(_workers(log_path, before)):
            return
        time.sleep(0.01)


def _wait_for_busy(log_path: str, workers: int) -> None:
    """Until every worker is inside `__getitem__` (at most 30 s)."""
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        if len({pid for tag, pid in _read_log(log_path) if tag == "e"}) >= workers:
            return
        time.sleep(0.01)


def measure(
    loader_kind: str, method: str, transport: str | None, case: str, args: argparse.Namespace
) -> dict[str, Any]:
    """One iterator: start it, fill (or busy) its workers, time its shutdown."""
    busy = case == "busy-close"
    began = time.perf_counter()
    fd, log_path = tempfile.mkstemp(prefix="stoker-close-", suffix=".log")
    os.close(fd)
    before = _descendants()
    try:
        dataset = Samples(
            args.batches * args.batch_size,
            args.sample_bytes,
            log_path,
            sleep_s=args.slow_sample if busy else 0.0,
        )
        context = multiprocessing.get_context(method)
        options = dict(
            batch_size=args.batch_size,
            num_workers=args.workers,
            prefetch_factor=args.prefetch,
            multiprocessing_context=context,
        )
        if loader_kind == "stoker":
            import stoker

            loader: Any = stoker.DataLoader(
                dataset, collate_fn=LoggingCollate(stoker.default_collate, log_path), **options
            )
            environ = _environ(TRANSPORT_ENV, transport)
        else:
            import torch.utils.data

            loader = torch.utils.data.DataLoader(
                dataset,
                collate_fn=LoggingCollate(torch.utils.data.default_collate, log_path),
                **options,
            )
            environ = contextlib.nullcontext()
        window = args.workers * args.prefetch
        with environ:
            holder = [iter(loader)]
            if busy:
                _wait_for_busy(log_path, args.workers)
            else:
                batch = next(holder[0])
                del batch
                _wait_for_window(log_path, before, window + 1, args.settle)
            made = sum(tag == "c" for tag, _ in _read_log(log_path))
            workers = _workers(log_path, before)
            if case == "full-drop":
                start = time.perf_counter()
                holder.clear()
                gc.collect()
            else:
                it = holder[0]
                close = it.close if loader_kind == "stoker" else it._shutdown_workers
                del it
                start = time.perf_counter()
                close()
                del close
            seconds = time.perf_counter() - start
            left = {pid for pid in workers if _alive(pid)}
            del holder
            start = time.perf_counter()
            gc.collect()  # what a bare collection costs here, for comparison with full-drop
            gc_seconds = time.perf_counter() - start
        if left:
            _reap(left)
        return {
            "seconds": seconds,
            "made": made,
            "expected": 0 if busy else window + 1,
            "workers": len(workers),
            "left": len(left),
            "gc_s": gc_seconds,
            "wall_s": time.perf_counter() - began,
        }
    finally:
        os.unlink(log_path)


# ------------------------------------------------------------------ the run
def _configs(args: argparse.Namespace, torch_ok: bool) -> list[tuple[str, str, str | None, str]]:
    configs: list[tuple[str, str, str | None, str]] = []
    for method in args.methods:
        for transport in args.transports:
            for case in args.cases:
                configs.append(("stoker", method, transport, case))
    if torch_ok:
        for method in args.methods:
            for case in args.cases:
                configs.append(("torch", method, None, case))
    return configs


def _reps(config: tuple[str, str, str | None, str], args: argparse.Namespace) -> int:
    if config[0] == "torch":
        return int(args.torch_reps)
    return int(args.busy_reps if config[3] == "busy-close" else args.reps)


def _summary(key: tuple[str, str, str | None, str], runs: list[dict[str, Any]]) -> dict[str, Any]:
    loader, method, transport, case = key
    ms = [r["seconds"] * 1000.0 for r in runs]
    limit_ms = BUSY_LIMIT_MS if case == "busy-close" else TARGET_MS
    return {
        "loader": loader,
        "method": method,
        "transport": transport if transport is not None else "-",
        "case": case,
        "median_ms": statistics.median(ms),
        "max_ms": max(ms),
        "limit_ms": limit_ms,
        "within_limit": max(ms) < limit_ms,
        "made_median": statistics.median(r["made"] for r in runs),
        "expected": runs[0]["expected"],
        "left_total": sum(r["left"] for r in runs),
        "workers_seen": [r["workers"] for r in runs],
        "ms": ms,
        "made": [r["made"] for r in runs],
        "left": [r["left"] for r in runs],
        "bare_gc_ms": [r["gc_s"] * 1000.0 for r in runs],
        "wall_s": sum(r["wall_s"] for r in runs),
    }


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        "loader",
        "method",
        "transport",
        "case",
        "reps",
        "made",
        "median ms",
        "max ms",
        "limit ms",
        "max<limit",
        "left",
    )
    body = []
    for r in rows:
        made = f"{r['made_median']:g}/{r['expected']}" if r["expected"] else f"{r['made_median']:g}"
        body.append(
            (
                r["loader"],
                r["method"],
                r["transport"],
                r["case"],
                str(len(r["ms"])),
                made,
                f"{r['median_ms']:.1f}",
                f"{r['max_ms']:.1f}",
                f"{r['limit_ms']:.0f}",
                "yes" if r["within_limit"] else "NO",
                str(r["left_total"]),
            )
        )
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    right = {4, 5, 6, 7, 8, 10}

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(head), line(tuple("-" * w for w in widths)), *(line(b) for b in body)])


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    available = multiprocessing.get_all_start_methods()
    parser.add_argument(
        "--methods",
        type=_csv,
        default=[m for m in ("fork", "spawn", "forkserver") if m in available],
        help="start methods, comma-separated (default: fork,spawn,forkserver, those available)",
    )
    parser.add_argument(
        "--transports", type=_csv, default=list(TRANSPORTS), help="stoker transports: arena,pickle (default both)"
    )
    parser.add_argument("--cases", type=_csv, default=list(CASES), help=f"default {','.join(CASES)}")
    parser.add_argument(
        "--reps", type=int, default=5, help="repetitions of each stoker full-window configuration (default 5)"
    )
    parser.add_argument(
        "--busy-reps", type=int, default=1, help="repetitions of stoker's busy-close, ~2.5 s each (default 1)"
    )
    parser.add_argument(
        "--torch-reps",
        type=int,
        default=1,
        help="repetitions of each torch baseline configuration (default 1; spawn and forkserver workers import torch, ~5 s each)",
    )
    parser.add_argument("--sample-bytes", type=int, default=1 << 20, help="bytes per sample (default 1 MiB)")
    parser.add_argument("--batch-size", type=int, default=10, help="samples per batch (default 10)")
    parser.add_argument("--batches", type=int, default=48, help="batches per epoch (default 48)")
    parser.add_argument("--workers", type=int, default=4, help="num_workers (default 4)")
    parser.add_argument("--prefetch", type=int, default=2, help="prefetch_factor (default 2)")
    parser.add_argument(
        "--slow-sample", type=float, default=0.2, help="seconds each sample sleeps in busy-close (default 0.2)"
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=None,
        help="sleep this long for the window to fill instead of watching the workers make it",
    )
    parser.add_argument("--no-torch", action="store_true", help="skip the torch.utils.data baseline")
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    for name, allowed in (("methods", available), ("transports", TRANSPORTS), ("cases", CASES)):
        wrong = [v for v in getattr(args, name) if v not in allowed]
        if wrong:
            parser.error(f"--{name}: {', '.join(wrong)} not among {', '.join(allowed)}")
    for name in ("reps", "busy_reps", "torch_reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # 4 workers on a 2-core machine is the point here, not a mistake to warn about
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    torch_version = None
    if not args.no_torch:
        try:
            import torch

            torch_version = torch.__version__
        except ImportError:
            pass
    configs = _configs(args, torch_version is not None)
    batch_mb = args.sample_bytes * args.batch_size / 1e6
    print(
        f"close times: {args.workers} workers x prefetch {args.prefetch} = "
        f"{args.workers * args.prefetch} batches of {batch_mb:.1f} MB in flight; "
        f"{len(configs)} configurations; reps: {args.reps} (stoker), {args.busy_reps} "
        f"(stoker busy-close), {args.torch_reps} (torch)",
        flush=True,
    )
    runs: dict[tuple[str, str, str | None, str], list[dict[str, Any]]] = {c: [] for c in configs}
    started = time.monotonic()
    reps = max(_reps(config, args) for config in configs)
    failed: dict[tuple[str, str, str | None, str], str] = {}
    for rep in range(reps):  # outermost, so that a slow patch of a busy machine hits all alike
        for config in configs:
            if rep < _reps(config, args) and config not in failed:
                try:
                    runs[config].append(measure(*config, args))
                except Exception as exc:  # the baseline's own failure is reported, not fatal
                    if config[0] != "torch":
                        raise
                    failed[config] = f"{type(exc).__name__}: {exc}".strip()
        print(f"  rep {rep + 1}/{reps} done ({time.monotonic() - started:.0f} s)", flush=True)
    rows = [_summary(config, runs[config]) for config in configs if runs[config]]
    print()
    print(_table(rows))
    for config, error in failed.items():
        print(f"{' '.join(str(part) for part in config)}: failed ({error})")
    bare_gc = statistics.median(ms for r in rows for ms in r["bare_gc_ms"])
    print(
        "made: batches collated when close was called (median) / those sent (window + the one "
        "taken); left: workers still running when close returned, over all reps.\n"
        f"limit: {TARGET_MS:.0f} ms for a full window; for busy-close, where each worker is inside a batch of "
        f"{args.batch_size} x {args.slow_sample:g} s that no loader interrupts, stoker's shutdown ladder: "
        f"{JOIN_TIMEOUT_S:g} s of grace to finish it, then terminate ({TERMINATE_TIMEOUT_S:g} s).\n"
        f"full-drop includes a gc.collect(): a bare one right after took {bare_gc:.1f} ms (median)."
    )
    if args.json:
        report = {
            "benchmark": "close_times",
            "args": {k: v for k, v in vars(args).items() if k != "json"},
            "machine": {
                "python": sys.version.split()[0],
                "platform": platform.platform(),
                "cpu_count": os.cpu_count(),
                "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                "numpy": np.__version__,
                "torch": torch_version,
            },
            "wall_s": time.monotonic() - started,
            "rows": rows,
            "failed": {" ".join(str(p) for p in c): e for c, e in failed.items()},
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
