"""W9's measuring code on a few real JPEGs: every row at each worker count, its figures, the
table, and the fused rows carrying a quarter of the standard rows' bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("PIL")

from stoker._vision import photos
from stoker_bench import jpegbench


def test_w9_rows_on_a_few_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        made = photos.make_jpegs(str(tmp_path), 24, classes=3)
    except FileNotFoundError as exc:  # pragma: no cover - scikit-image is a test dependency
        pytest.skip(str(exc))
    monkeypatch.setattr(jpegbench, "files", lambda count: made)
    monkeypatch.setattr(jpegbench, "BATCH", 8)
    report = jpegbench.run([0, 1], reps=1, quick=True)
    rows = {(r["loader"], r["pipeline"], r["workers"]): r for r in report["rows"]}
    assert set(rows) == {(loader, pipeline, w) for loader, pipeline in jpegbench.ROWS for w in (0, 1)}
    for row in rows.values():
        assert row["images_per_s"] > 0 and row["cpu_ms_per_image"] > 0
    standard, fused = rows[("stoker.torch", "standard", 0)], rows[("stoker.torch", "fused", 0)]
    labels = 8 * 8 / 1e6  # int64 labels of a batch
    assert fused["mb_per_batch"] - labels == pytest.approx((standard["mb_per_batch"] - labels) / 4)
    text = jpegbench.table(report)
    assert "W9" in text and "fused" in text and "CPU ms/image" in text


def test_w9_epochs_give_every_worker_8_batches() -> None:
    assert [jpegbench.epoch_images(w, False, 2000) for w in (0, 1, 2, 8, 14)] == [1024, 1024, 1024, 4096, 7168]
    assert jpegbench.epoch_images(14, True, 2000) == 256 and jpegbench.epoch_images(2, True, 24) == 24
    dataset = jpegbench.Standard(["a.jpg", "b.jpg"], images=5)
    assert len(dataset) == 5
