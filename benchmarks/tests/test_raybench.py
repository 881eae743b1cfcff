"""The Ray bench rows' text, from a report of made-up figures (the bench itself runs in
`make bench`, never in the tests)."""

from __future__ import annotations

from stoker_bench import raybench


def report(two_nodes):
    return {
        "one_node": {
            "samples": 2560,
            "reps": 3,
            "rates": {
                "stoker (2 workers)": [3000.0, 3100.0, 2900.0],
                "stoker.ray": [1800.0, 1900.0, 1700.0],
                "torch.utils.data (2 workers)": [2000.0, 2100.0, 1900.0],
            },
            "epoch_rates": {
                "stoker (2 workers)": [2500.0, 2600.0, 2400.0],
                "stoker.ray": [1000.0, 1100.0, 900.0],
                "torch.utils.data (2 workers)": [2000.0, 2000.0, 1800.0],
            },
            "first_batch_s": {
                "stoker (2 workers)": [0.1] * 3,
                "stoker.ray": [0.9] * 3,
                "torch.utils.data (2 workers)": [0.2] * 3,
            },
            "ray_init_s": 3.5,
            "ray_first_batch_with_init_s": 5.25,
            "ray_cold_epoch_s": 6.5,
            "memory": {"rss": 900e6, "uss": 400e6, "object_store": 120e6},
            "read_tasks": {"1": 1000.0, "4": 1800.0},
            "default_read_tasks": 4,
        },
        "two_nodes": two_nodes,
    }


def test_table_gives_rates_ratios_start_up_and_memory():
    text = raybench.table(
        report(
            {
                "cluster_start_s": 9.0,
                "samples": 2560,
                "wall_s": 2.0,
                "samples_per_s": 1280.0,
                "rank_rates": [700.0, 650.0],
                "rank_first_batch_s": [1.0, 1.1],
                "cold_first_batch_s": [4.0, 4.5],
            }
        )
    )
    lines = text.splitlines()
    ray_row = next(line for line in lines if line.strip().startswith("stoker.ray "))
    assert "1,000 (900-1,100)" in ray_row and "0.50x" in ray_row  # the epoch's rate
    assert "1,800 (1,700-1,900)" in ray_row and "0.90x" in ray_row  # after the first batch
    assert "1.00x" in next(line for line in lines if line.strip().startswith("torch.utils.data"))
    assert "1.25x" in next(line for line in lines if line.strip().startswith("stoker (2 workers)"))
    assert "ray.init 3.50 s" in text and "5.25 s" in text and "6.50 s" in text
    assert "900 MB RSS" in text and "400 MB USS" in text and "120 MB in use" in text
    assert "1: 1,000, 4: 1,800" in text and "the default here: 4" in text
    assert "1,280 samples/s together" in text and "cluster start 9.0 s" in text


def test_table_says_why_the_two_node_part_was_skipped():
    text = raybench.table(report({"skipped": "unshare or ip is not installed"}))
    assert text.splitlines()[-1].endswith("skipped (unshare or ip is not installed)")
