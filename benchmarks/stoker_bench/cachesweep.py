"""How many times each shard is downloaded per epoch when the cache holds only a few windows
(`python benchmarks/shards_bench.py --cache-sweep`).

`ShardedSampler` reads an epoch window by window (`window_shards` shards shuffled together),
so a cache that holds about two windows should download each shard once per epoch: the
readers use one window while the downloads ahead bring the next. This sweep measures it: a
dataset of `shards` tar shards of `shard_mb` MiB, read for `epochs` epochs by `ranks` rank
processes of `workers` workers each (`ShardedSampler(num_replicas=ranks, rank=r)`, the ranks
waiting for one another after every batch, as a data-parallel step does), sharing one cache
folder capped at `caps` windows (a window's bytes: `window_shards` shards of the mean size).
Each sample costs its reader `sample_ms` (a sleep standing for a decode), so that a window is
read over about a second, as it would be in training, rather than in a blink.

Downloads are counted outside stoker, by inotify on the cache's `shards/` folder: every
completed download is one rename into it. Two stores: the local filesystem (`file://`) and a
moto S3 server on loopback (no delay, no bandwidth cap).

The figure reported: downloads per shard per epoch (1.00 is the floor for a cache smaller
than the dataset), and the most downloads of one shard in one epoch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
import select
import shutil
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# inotify's event for a file moved into the watched folder (a download renamed into place)
_IN_MOVED_TO = 0x00000080
_EVENT = struct.Struct("iIII")
BARRIER_TIMEOUT_S = 300.0


class Pace:
    """A transform that takes `ms` milliseconds a sample (what a decode would take)."""

    def __init__(self, ms: float) -> None:
        self.s = ms / 1000

    def __call__(self, sample: Any) -> Any:
        if self.s:
            time.sleep(self.s)
        return sample


class DownloadWatch:
    """Counts the files renamed into `folder` (one per completed download), per name, with
    Linux's inotify, in a thread; `snapshot()` returns the counts so far."""

    def __init__(self, folder: str) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self._fd = libc.inotify_init1(os.O_CLOEXEC | os.O_NONBLOCK)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        if libc.inotify_add_watch(self._fd, os.fsencode(folder), _IN_MOVED_TO) < 0:
            os.close(self._fd)
            raise OSError(ctypes.get_errno(), f"inotify_add_watch failed on {folder}")
        self._stop_r, self._stop_w = os.pipe()
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, name="download-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            ready, _, _ = select.select([self._fd, self._stop_r], [], [])
            if self._fd in ready:
                self._drain()
            if self._stop_r in ready:
                self._drain()
                return

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return
            at = 0
            while at < len(data):
                _, mask, _, length = _EVENT.unpack_from(data, at)
                name = data[at + _EVENT.size : at + _EVENT.size + length].rstrip(b"\0").decode()
                at += _EVENT.size + length
                if mask & _IN_MOVED_TO:
                    with self._lock:
                        self._counts[name] = self._counts.get(name, 0) + 1

    def snapshot(self) -> dict[str, int]:
        """The downloads counted so far, per shard file name (waits for the events already
        queued)."""
        time.sleep(0.05)
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        os.write(self._stop_w, b"x")
        self._thread.join(10)
        for fd in (self._fd, self._stop_r, self._stop_w):
            os.close(fd)


def write_dataset(url: str, shards: int, shard_mb: float, storage_options: dict[str, Any] | None = None) -> Any:
    """`shards` tar shards of about `shard_mb` MiB of random samples (20 KiB each) at `url`."""
    from stoker.shards import write_shards

    sample_bytes = 20 << 10
    shard_bytes = int(shard_mb * 2**20)
    per_shard = max(1, shard_bytes // (sample_bytes + 1536))
    rng = np.random.default_rng(0)
    blob = rng.integers(0, 256, sample_bytes + 251, dtype=np.uint8).tobytes()
    samples = (
        {"__key__": f"{i:07d}", "bin": blob[i % 251 : i % 251 + sample_bytes], "cls": i}
        for i in range(shards * per_shard)
    )
    # a sample takes its bytes (whole 512-byte blocks) and two headers and the label's block
    return write_shards(
        samples, url, shard_bytes=per_shard * (sample_bytes + 1536) - 1, workers=1, storage_options=storage_options
    )


def _rank(cfg: dict[str, Any], rank: int, step: Any, epoch_end: Any, errors: Any) -> None:
    """One rank: read `epochs` epochs, waiting for the other ranks after each batch and for
    the parent at the end of each epoch."""
    try:
        os.environ.update(cfg["env"])
        from stoker import DataLoader
        from stoker.shards import ShardedDataset, ShardedSampler

        data = ShardedDataset(
            cfg["url"],
            cache_dir=cfg["cache_dir"],
            cache_bytes=cfg["cap"],
            decode=None,
            storage_options=cfg["storage_options"],
            transform=Pace(cfg["sample_ms"]),
        )
        sampler = ShardedSampler(
            data, num_replicas=cfg["ranks"], rank=rank, seed=0, window_shards=cfg["window_shards"], drop_last=True
        )
        loader = DataLoader(
            data, batch_size=cfg["batch"], sampler=sampler, num_workers=cfg["workers"], collate_fn=len, timeout=120
        )
        for epoch in range(cfg["epochs"]):
            sampler.set_epoch(epoch)
            seen = 0
            for n in loader:
                seen += n
                step.wait(BARRIER_TIMEOUT_S)
            if seen != len(sampler):
                raise RuntimeError(f"rank {rank} read {seen} samples of {len(sampler)} in epoch {epoch}")
            epoch_end.wait(BARRIER_TIMEOUT_S)  # the parent counts
            epoch_end.wait(BARRIER_TIMEOUT_S)  # and lets the next epoch start
        data.close()
    except BaseException as exc:
        errors.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        step.abort()
        epoch_end.abort()
        raise


def measure(cfg: dict[str, Any]) -> dict[str, Any]:
    """One point of the sweep: a fresh cache, `ranks` rank processes, `epochs` epochs.

    Returns:
        dict: "downloads" (per epoch, total), "per_shard_per_epoch", "most_per_shard"
        (per epoch), "seconds" (per epoch), or "error".
    """
    from stoker.shards import ShardedDataset

    os.environ.update(cfg["env"])
    probe = ShardedDataset(
        cfg["url"], cache_dir=cfg["cache_dir"], cache_bytes=cfg["cap"], storage_options=cfg["storage_options"]
    )
    shards = len(probe.index.shards)
    watch = DownloadWatch(os.path.join(probe.cache.directory, "shards"))
    ctx = multiprocessing.get_context("spawn")
    step, epoch_end = ctx.Barrier(cfg["ranks"]), ctx.Barrier(cfg["ranks"] + 1)
    errors = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(cfg, r, step, epoch_end, errors)) for r in range(cfg["ranks"])]
    out: dict[str, Any] = {"shards": shards, "downloads": [], "most_per_shard": [], "seconds": []}
    try:
        for p in procs:
            p.start()
        before: dict[str, int] = {}
        began = time.perf_counter()
        for _ in range(cfg["epochs"]):
            epoch_end.wait(BARRIER_TIMEOUT_S)
            now = watch.snapshot()
            out["seconds"].append(time.perf_counter() - began)
            delta = {k: v - before.get(k, 0) for k, v in now.items()}
            out["downloads"].append(sum(delta.values()))
            out["most_per_shard"].append(max(delta.values(), default=0))
            before = now
            began = time.perf_counter()
            epoch_end.wait(BARRIER_TIMEOUT_S)
        for p in procs:
            p.join(60)
    except threading.BrokenBarrierError:
        pass
    finally:
        watch.close()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    if not errors.empty() or any(p.exitcode != 0 for p in procs):
        why = errors.get() if not errors.empty() else f"exit codes {[p.exitcode for p in procs]}"
        return {"error": why}
    out["per_shard_per_epoch"] = [d / shards for d in out["downloads"]]
    return out


def sweep(
    shards: int = 15,
    shard_mb: float = 2.2,
    window_shards: int = 4,
    caps: Sequence[float] = (1.2, 2.0, 3.0),
    settings: Sequence[tuple[str, int]] = (("file", 1), ("s3", 4)),
    workers: int = 2,
    epochs: int = 2,
    batch: int = 16,
    sample_ms: float = 5.0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The whole sweep: for each (store, ranks) of `settings` and each cap of `caps` (in
    windows), `measure` with a fresh cache.

    Returns:
        dict: "settings" and "rows" (one per store, ranks and cap).
    """
    from . import with_test_support

    with_test_support()
    from tests.support.s3server import S3Server, client_env

    say = progress or (lambda text: None)
    work = tempfile.mkdtemp(prefix="stoker-cachesweep-")
    rows: list[dict[str, Any]] = []
    server = None
    try:
        for store, ranks in settings:
            env: dict[str, str] = {}
            options: dict[str, Any] | None = None
            if store == "s3":
                if server is None:
                    server = S3Server().start()
                    server.make_bucket("sweep")
                env = client_env(server.endpoint)
                os.environ.update(env)
                url = "s3://sweep/data"
            else:
                url = os.path.join(work, "data")
            index = write_dataset(url, shards, shard_mb, options)
            sizes = [s.size for s in index.shards]
            window_bytes = window_shards * sum(sizes) / len(sizes)
            for cap_windows in caps:
                cap = max(max(sizes), int(cap_windows * window_bytes))
                cache_dir = os.path.join(work, f"cache-{store}-{ranks}-{cap_windows}")
                cfg = {
                    "url": url,
                    "cache_dir": cache_dir,
                    "cap": cap,
                    "env": env,
                    "storage_options": options,
                    "ranks": ranks,
                    "workers": workers,
                    "window_shards": window_shards,
                    "epochs": epochs,
                    "batch": batch,
                    "sample_ms": sample_ms,
                }
                result = measure(cfg)
                row = {
                    "store": store,
                    "ranks": ranks,
                    "workers": workers,
                    "cap_windows": cap_windows,
                    "cap_bytes": cap,
                    "shards": len(sizes),
                    **result,
                }
                rows.append(row)
                say(_line(row))
                shutil.rmtree(cache_dir, ignore_errors=True)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return {
        "settings": {
            "shards": shards,
            "shard_mb": shard_mb,
            "window_shards": window_shards,
            "workers": workers,
            "epochs": epochs,
            "batch": batch,
            "sample_ms": sample_ms,
        },
        "rows": rows,
    }


def _line(row: dict[str, Any]) -> str:
    head = f"{row['store']} {row['ranks']}x{row['workers']} cap {row['cap_windows']:g} windows"
    if "error" in row:
        return f"{head}: {row['error']}"
    per = ", ".join(f"{x:.2f}" for x in row["per_shard_per_epoch"])
    return f"{head}: downloads {row['downloads']} of {row['shards']} shards; per shard per epoch {per}; most of one shard {row['most_per_shard']}"


def table(report: dict[str, Any]) -> str:
    """The sweep as markdown."""
    s = report["settings"]
    epochs = s["epochs"]
    lines = [
        f"{len(report['rows'][0:1]) and report['rows'][0]['shards']} shards of about {s['shard_mb']:g} MiB, "
        f"window_shards={s['window_shards']}, {s['workers']} workers per rank, batch {s['batch']}, {epochs} epochs, "
        f"{s['sample_ms']:g} ms a sample",
        "",
        "| store | ranks x workers | cap (windows) | "
        + " | ".join(f"epoch {e + 1} downloads/shard" for e in range(epochs))
        + " | most of one shard | epoch 1 s |",
        "|---|---|---:|" + "---:|" * (epochs + 2),
    ]
    for row in report["rows"]:
        if "error" in row:
            lines.append(
                f"| {row['store']} | {row['ranks']} x {row['workers']} | {row['cap_windows']:g} | {row['error']} |"
            )
            continue
        per = " | ".join(f"{x:.2f}" for x in row["per_shard_per_epoch"])
        lines.append(
            f"| {row['store']} | {row['ranks']} x {row['workers']} | {row['cap_windows']:g} | {per} | "
            f"{max(row['most_per_shard'])} | {row['seconds'][0]:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="benchmarks/shards_bench.py --cache-sweep", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--shards", type=int, default=15)
    parser.add_argument("--shard-mb", type=float, default=2.2)
    parser.add_argument("--window-shards", type=int, default=4)
    parser.add_argument("--caps", default="1.2,2,3", help="caps in windows, comma-separated")
    parser.add_argument("--settings", default="file:1,s3:4", help="store:ranks, comma-separated (file, s3)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--sample-ms", type=float, default=5.0, help="each sample's cost to its reader")
    args = parser.parse_args(argv)
    settings = [(part.split(":")[0], int(part.split(":")[1])) for part in args.settings.split(",") if part]
    report = sweep(
        shards=args.shards,
        shard_mb=args.shard_mb,
        window_shards=args.window_shards,
        caps=[float(c) for c in args.caps.split(",") if c],
        settings=settings,
        workers=args.workers,
        epochs=args.epochs,
        batch=args.batch,
        sample_ms=args.sample_ms,
        progress=lambda text: print(text, flush=True),
    )
    print()
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
