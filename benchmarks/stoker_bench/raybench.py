"""`stoker-bench`'s Ray rows: stoker.ray on the images workload (W2: 3x224x224 uint8, batch 64).

1. One node, Ray given 2 CPUs (`ray.init(num_cpus=2)` in this process): `stoker.ray.DataLoader`
   against `stoker.DataLoader(num_workers=2)` and `torch.utils.data.DataLoader(num_workers=2)`,
   repetitions interleaved. Each run is one epoch of a fresh loader, with two rates (the same
   rules for all three): the whole epoch's (samples over the time from `iter()` to the last
   batch) and the rate after the first batch (which flatters a loader whose first batch comes
   late, as Ray's does: its read tasks have run ahead meanwhile); and the time to its first
   batch. stoker.ray's start-up (ray.init, then a first epoch that starts Ray's workers) is
   measured once, before the repetitions. During that epoch and one more, untimed, a thread
   samples the memory of Ray's processes (RSS and USS, summed) and the object store's use
   (never during the timed epochs: reading the processes' memory maps costs CPU). Then
   stoker.ray with read tasks of several sizes (how `stoker.ray.read_task_count` was chosen).
2. Two ranks on a two-node cluster (one CPU each) inside a loopback-only network namespace
   (`unshare --net`, as tests/ray does), each rank a thread of one driver iterating its own
   `stoker.ray.DataLoader(rank=r, world_size=2)`: samples/s of the two together. Skipped, with a
   line saying why, where a namespace cannot be made.

No timed assertion anywhere: figures are printed, with ratios from the same run.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from . import HOME

BATCH = 64
SAMPLES = 5120  # 80 batches, 770 MB an epoch
TWO_NODE_SAMPLES = 2560  # 40 batches: Ray's objects cross between the nodes over loopback TCP
QUICK_SAMPLES = 1280
BATCHES_PER_TASK_CHOICES = (5, 10, 20, 40)
NAMESPACE = ["unshare", "--net", "--pid", "--fork", "--mount-proc", "--kill-child", "--"]
TWO_NODE_TIMEOUT_S = 150
RAY_NAMES = ("raylet", "gcs_server", "ray::", "default_worker", "log_monitor", "dashboard")


def missing() -> str | None:
    """Why the Ray rows cannot run here, or None."""
    import importlib.util

    for module in ("ray", "psutil"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install 'stoker[ray]')"
    return None


def _epoch(batches: Iterable[Any]) -> tuple[float, float, int, float]:
    """(seconds to the first batch, samples/s after it, samples, seconds in all) of one pass."""
    begun = time.perf_counter()
    first = 0.0
    count = 0
    after = 0
    for batch in batches:
        n = len(batch)
        if not count:
            first = time.perf_counter()
        else:
            after += n
        count += n
    end = time.perf_counter()
    return first - begun, after / max(end - first, 1e-9), count, end - begun


class MemoryWatch:
    """Samples Ray's processes (summed RSS and USS) and the object store's use, in a thread,
    while `active` is set (the other loaders' shared memory would count as the store's)."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.rss = 0
        self.uss = 0
        self.store = 0
        self.active = threading.Event()
        self.shm_baseline = shm_used()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raybench-memory", daemon=True)

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.active.is_set():
                self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> None:
        rss, uss = ray_process_memory()
        self.rss = max(self.rss, rss)
        self.uss = max(self.uss, uss)
        self.store = max(self.store, shm_used() - self.shm_baseline)


def ray_process_memory() -> tuple[int, int]:
    """Summed (RSS, USS) of this machine's Ray processes (not this driver)."""
    import psutil

    rss = uss = 0
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        if proc.info["pid"] == os.getpid():
            continue
        text = (proc.info["name"] or "") + " " + " ".join(proc.info["cmdline"] or [])
        if not any(name in text for name in RAY_NAMES):
            continue
        try:
            full = proc.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss += full.rss
        uss += full.uss
    return rss, uss


def shm_used() -> int:
    """Bytes used in /dev/shm, where Ray's object store keeps its (unlinked) memory file: the
    store's resident pages are the rise of this over its value before Ray started."""
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return (stat.f_blocks - stat.f_bfree) * stat.f_frsize


def quiet_ray_data() -> None:
    """No progress bars or per-dataset log lines from Ray Data in the bench's output."""
    import logging

    import ray.data

    logging.getLogger("ray.data").setLevel(logging.ERROR)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def one_node(samples: int, reps: int, with_torch: bool) -> dict[str, Any]:
    """Part 1: stoker.ray on one node against the local loaders."""
    import ray

    import stoker
    import stoker.ray as sray

    from .bench import Images

    dataset: Any = Images(samples)
    temp_dir = tempfile.mkdtemp(prefix="rb", dir="/tmp")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    loaders: dict[str, Callable[[], Iterable[Any]]] = {
        "stoker (2 workers)": lambda: stoker.DataLoader(dataset, batch_size=BATCH, num_workers=2),
        "stoker.ray": lambda: sray.DataLoader(dataset, batch_size=BATCH, seed=0),
    }
    if with_torch:
        import torch.utils.data

        loaders["torch.utils.data (2 workers)"] = lambda: torch.utils.data.DataLoader(
            dataset, batch_size=BATCH, num_workers=2
        )
    rates: dict[str, list[float]] = {name: [] for name in loaders}
    epoch_rates: dict[str, list[float]] = {name: [] for name in loaders}
    firsts: dict[str, list[float]] = {name: [] for name in loaders}
    watch = MemoryWatch()
    begun = time.perf_counter()
    ray.init(
        num_cpus=2,
        object_store_memory=512 << 20,
        include_dashboard=False,
        _temp_dir=temp_dir,
        log_to_driver=False,
        configure_logging=False,
    )
    init_s = time.perf_counter() - begun
    quiet_ray_data()
    try:
        with watch:
            # the first stoker.ray epoch starts Ray's worker processes: it gives the start-up
            # figure and is not one of the repetitions
            watch.active.set()
            cold_first_s, _, _, cold_s = _epoch(sray.DataLoader(dataset, batch_size=BATCH, seed=0))
            first_ray = init_s + cold_first_s
            # one more epoch under the watch, untimed: sampling reads every Ray process's
            # memory map, CPU that the timed epochs below must not pay
            _epoch(sray.DataLoader(dataset, batch_size=BATCH, seed=0))
            watch.sample()
            watch.active.clear()
            for _ in range(reps):
                for name, make in loaders.items():
                    first_s, rate, count, total_s = _epoch(make())
                    if count != samples:
                        raise RuntimeError(f"{name} gave {count} samples, not {samples}")
                    rates[name].append(rate)
                    epoch_rates[name].append(count / total_s)
                    firsts[name].append(first_s)
        tasks: dict[int, float] = {}
        batches = samples // BATCH
        for per_task in BATCHES_PER_TASK_CHOICES:
            count = max(1, batches // per_task)
            _, _, done, total_s = _epoch(sray.DataLoader(dataset, batch_size=BATCH, seed=0, read_tasks=count))
            tasks[count] = done / total_s
        cpus = float(ray.cluster_resources().get("CPU", 0))
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    return {
        "samples": samples,
        "reps": reps,
        "rates": rates,
        "epoch_rates": epoch_rates,
        "first_batch_s": firsts,
        "ray_init_s": init_s,
        "ray_first_batch_with_init_s": first_ray,
        "ray_cold_epoch_s": cold_s,
        "memory": {"rss": watch.rss, "uss": watch.uss, "object_store": watch.store},
        "read_tasks": {str(k): v for k, v in tasks.items()},
        "default_read_tasks": sray.read_task_count(batches, cpus),
    }


def two_ranks_in_namespace(samples: int) -> dict[str, Any]:
    """Part 2, run inside the namespace (by `two_nodes`): a two-node cluster, two ranks."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray
    from ray.cluster_utils import Cluster

    import stoker.ray as sray

    from .bench import Images

    temp_dir = tempfile.mkdtemp(prefix="rc", dir="/tmp")
    args: dict[str, Any] = {
        "num_cpus": 1,
        "object_store_memory": 200 << 20,
        "node_ip_address": "127.0.0.1",
        "include_dashboard": False,
        "temp_dir": temp_dir,
    }
    # Ray writes the cluster's address under $RAY_TMPDIR/ray (default /tmp/ray): keep it in ours
    os.environ["RAY_TMPDIR"] = temp_dir
    os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
    begun = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args=args)
    cluster.add_node(**args)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False)
    start_s = time.perf_counter() - begun
    quiet_ray_data()
    dataset = Images(samples)
    try:
        results: dict[int, tuple[float, float, int, float]] = {}
        errors: list[str] = []

        firsts: dict[int, float] = {}

        def rank(r: int, barrier: threading.Barrier) -> None:
            try:
                loader = sray.DataLoader(dataset, batch_size=BATCH, seed=0, rank=r, world_size=2)
                firsts[r] = _epoch(loader)[0]  # the first epoch starts Ray's workers
                barrier.wait()
                loader.set_epoch(1)
                results[r] = _epoch(loader)
            except Exception as exc:
                barrier.abort()
                errors.append(f"rank {r}: {type(exc).__name__}: {exc}")

        barrier = threading.Barrier(3)
        threads = [threading.Thread(target=rank, args=(r, barrier)) for r in range(2)]
        for t in threads:
            t.start()
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            pass
        begun = time.perf_counter()
        for t in threads:
            t.join()
        wall = time.perf_counter() - begun
        if errors:
            raise RuntimeError("; ".join(errors))
        total = sum(results[r][2] for r in range(2))
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    return {
        "cluster_start_s": start_s,
        "samples": total,
        "wall_s": wall,
        "samples_per_s": total / wall,
        "rank_rates": [results[r][1] for r in range(2)],
        "rank_first_batch_s": [results[r][0] for r in range(2)],
        "cold_first_batch_s": [firsts[r] for r in range(2)],
    }


def two_nodes(samples: int) -> dict[str, Any]:
    """Part 2 from outside: run `two_ranks_in_namespace` in a fresh namespace; a dict with
    "skipped" when a namespace cannot be made."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return {"skipped": "unshare or ip is not installed"}
    out = tempfile.mktemp(prefix="raybench-", suffix=".json")
    command = [
        *NAMESPACE,
        "sh",
        "-c",
        'ip link set lo up && exec "$0" "$@"',
        sys.executable,
        "-m",
        "stoker_bench.raybench",
        "--two-nodes",
        str(samples),
        out,
    ]
    # the harness need not be installed: its folder goes on the fresh interpreter's PYTHONPATH
    # (and so on that of the Ray cluster it starts, whose workers unpickle the dataset)
    paths = [HOME, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)))
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env
    )
    try:
        output, _ = proc.communicate(timeout=TWO_NODE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # --kill-child: the namespace's processes go with it
        proc.communicate()
        return {"skipped": f"the two-node run took over {TWO_NODE_TIMEOUT_S} s and was killed"}
    try:
        if proc.returncode != 0:
            tail = output.strip().splitlines()[-1:] or [""]
            return {"skipped": f"the two-node run failed (exit {proc.returncode}): {tail[0][:200]}"}
        with open(out) as f:
            result: dict[str, Any] = json.load(f)
        return result
    finally:
        if os.path.exists(out):
            os.unlink(out)


def run(quick: bool = False, with_torch: bool = True) -> dict[str, Any]:
    """Both parts' figures."""
    samples = QUICK_SAMPLES if quick else SAMPLES
    return {
        "one_node": one_node(samples, 1 if quick else 3, with_torch),
        "two_nodes": two_nodes(QUICK_SAMPLES if quick else TWO_NODE_SAMPLES),
    }


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def table(report: dict[str, Any]) -> str:
    """The Ray rows as text."""
    one = report["one_node"]
    rates = one["rates"]
    epochs = one["epoch_rates"]
    torch_name = "torch.utils.data (2 workers)"
    torch_epoch = _median(epochs[torch_name]) if torch_name in epochs else None
    torch_rate = _median(rates[torch_name]) if torch_name in rates else None
    lines = [
        f"Ray: W2 images (3x224x224 uint8, batch {BATCH}), {one['samples']:,} samples an epoch, "
        f"one node with Ray given 2 CPUs, {one['reps']} reps (median, min-max)",
        f"  {'loader':30}{'epoch samples/s':>26}{'vs torch':>9}{'after 1st batch':>26}{'vs torch':>9}"
        f"{'first batch':>12}",
    ]

    def cells(values: list[float], reference: float | None) -> str:
        ratio = f"{_median(values) / reference:.2f}x" if reference else "-"
        spread = f"{_median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"
        return f"{spread:>26}{ratio:>9}"

    for name in rates:
        lines.append(
            f"  {name:30}{cells(epochs[name], torch_epoch)}{cells(rates[name], torch_rate)}"
            f"{_median(one['first_batch_s'][name]):>11.2f}s"
        )
    memory = one["memory"]
    lines.append(
        f"  stoker.ray start-up: ray.init {one['ray_init_s']:.2f} s; first batch of the first loader "
        f"{one['ray_first_batch_with_init_s']:.2f} s after ray.init began (its epoch, not counted "
        f"above: {one['ray_cold_epoch_s']:.2f} s)"
    )
    lines.append(
        f"  Ray's processes at most {_mb(memory['rss'])} RSS, {_mb(memory['uss'])} USS (summed); "
        f"object store at most {_mb(memory['object_store'])} in use"
    )
    tasks = ", ".join(f"{k}: {v:,.0f}" for k, v in one["read_tasks"].items())
    lines.append(
        f"  stoker.ray epoch samples/s by number of read tasks ({tasks}); the default here: {one['default_read_tasks']}"
    )
    two = report["two_nodes"]
    if "skipped" in two:
        lines.append(f"Ray, two ranks on a two-node loopback cluster: skipped ({two['skipped']})")
    else:
        lines.append(
            f"Ray, two ranks on a two-node loopback cluster (1 CPU each, one network namespace): "
            f"{two['samples_per_s']:,.0f} samples/s together in the second epoch ({two['samples']:,} "
            f"samples in {two['wall_s']:.2f} s, first batch at {max(two['rank_first_batch_s']):.2f} s; "
            f"the first epoch's first batch at {max(two['cold_first_batch_s']):.2f} s); "
            f"cluster start {two['cluster_start_s']:.1f} s"
        )
    return "\n".join(lines)


def main(quick: bool = False, with_torch: bool = True, json_path: str | None = None) -> int:
    """Run and print the Ray rows (one line saying why, when Ray is not installed)."""
    reason = missing()
    if reason:
        print(f"Ray rows: skipped ({reason})")
        return 0
    report = run(quick, with_torch)
    print(table(report), flush=True)
    if json_path:
        os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--two-nodes":
        figures = two_ranks_in_namespace(int(sys.argv[2]))
        with open(sys.argv[3], "w") as f:
            json.dump(figures, f)
        sys.exit(0)
    sys.exit(main(quick="--quick" in sys.argv))
