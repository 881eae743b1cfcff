"""One epoch of a ShardedDataset through a stoker DataLoader whose store goes through a
FaultProxy, run as a child process of tests/shards/test_dataset.py so that a loader that
hangs is killed by the parent's hard timeout instead of hanging the test run.

`python dataset_child.py SPEC_JSON` with SPEC holding: upstream (the S3 server's endpoint),
url, cache_dir, workers, proxy (FaultProxy keyword arguments in effect while the dataset is
made), faults (those set after it is made), store_retries, store_timeout_s. The AWS_*
variables come from the parent's environment. It prints one line
`RESULT {"ids": [...], "error": type name or null, "message": ..., "seconds": ..., "faults": {...}}`.
"""

from __future__ import annotations

import json
import sys
import time
import traceback


def main(spec: dict) -> dict:
    from tests.support.s3server import FaultProxy

    from stoker import DataLoader
    from stoker.shards import ShardedDataset, ShardedSampler

    with FaultProxy(spec["upstream"], **spec.get("proxy", {})) as proxy:
        data = ShardedDataset(
            spec["url"],
            cache_dir=spec["cache_dir"],
            storage_options={"endpoint_url": proxy.endpoint},
            store_retries=spec.get("store_retries", 6),
            store_timeout_s=spec.get("store_timeout_s", 30.0),
        )
        for name, value in spec.get("faults", {}).items():
            setattr(proxy, name, value)
        workers = spec.get("workers", 2)
        loader = DataLoader(
            data,
            batch_size=4,
            sampler=ShardedSampler(data, shuffle=False),
            num_workers=workers,
            multiprocessing_context="fork" if workers else None,
            timeout=60 if workers else 0,
        )
        ids: list[int] = []
        error = message = None
        started = time.monotonic()
        try:
            for batch in loader:
                ids.extend(int(c) for c in batch["cls"])
        except Exception as exc:  # what the loader raised is the result
            error = type(exc).__name__
            message = "".join(traceback.format_exception_only(type(exc), exc))
        return {
            "ids": ids,
            "error": error,
            "message": message,
            "seconds": time.monotonic() - started,
            "faults": dict(proxy.faults),
        }


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
