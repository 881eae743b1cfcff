"""W12's measuring code on a few real JPEGs in class folders: both loaders and both pipelines at
0 and 2 workers, the epoch's length, the workers' CPU and page faults found in /proc, the
table, the command line, and the fallback pipeline's dataset and transforms."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("PIL")

import torch

from stoker._vision import photos
from stoker.vision import ImageFolder
from stoker_bench import jpegbench, w12


@pytest.fixture
def few(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """24 JPEGs in 3 class folders stand in for W12's files; batches of 4."""
    try:
        made = photos.make_jpegs(str(tmp_path / "jpegs"), 24, classes=3)
    except FileNotFoundError as exc:  # pragma: no cover - scikit-image is a test dependency
        pytest.skip(str(exc))
    monkeypatch.setattr(jpegbench, "files", lambda count: made)
    monkeypatch.setattr(w12, "QUICK_BATCH", 4)
    return made


def test_w12_rows_at_0_and_2_workers(few: list[str]) -> None:
    report = w12.run([0, 2], reps=1, quick=True)
    rows = {(r["pipeline"], r["loader"], r["workers"]): r for r in report["rows"]}
    expected = {(p.name, loader, w) for p in w12.PIPELINES.values() for loader in p.loaders for w in (0, 2)}
    assert set(rows) == expected and {"float", "uint8"} <= {p for p, _, _ in rows}
    for (_, _, workers), row in rows.items():
        # every worker delivers at least 8 batches; the epoch covers every file at least once
        assert row["samples"] == 4 * max(8 * max(workers, 1), 6) == sum(r["images"] for r in row["all"])
        assert row["epoch_images_per_s"] > 0 and row["middle_images_per_s"] > 0 and row["first_batch_s"] > 0
        if workers == 0:
            assert row["worker_processes"] is None and row["worker_faults_per_image"] is None
        elif sys.platform.startswith("linux"):
            assert row["worker_processes"] == 2
            assert row["worker_user_ms_per_image"] + row["worker_sys_ms_per_image"] > 0
            assert row["worker_faults_per_image"] > 0
    labels = 4 * 8 / 1e6  # int64 labels of a batch
    for loader in w12.LOADERS:
        floats, bytes_ = rows[("float", loader, 2)]["batch_mb"], rows[("uint8", loader, 2)]["batch_mb"]
        assert floats - labels == pytest.approx(4 * (bytes_ - labels))
    text = w12.table(report)
    assert text.startswith("W12: ImageFolder of 24 real JPEGs") and report["transforms"] in text
    assert "stoker.torch" in text and "uint8" in text and "1.00x" in text


def test_w12_from_the_command_line(few: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from stoker_bench.cli import main

    assert main(["--quick", "--workloads", "W12", "--out-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "W12: ImageFolder" in printed and "W1 tiny" not in printed  # no W1-W8 table
    report = json.loads((tmp_path / "w12.json").read_text())
    assert {r["workers"] for r in report["rows"]} == set(w12.QUICK_WORKERS)


def test_fallback_folder_and_transforms(few: list[str]) -> None:
    root = str(Path(few[0]).parent.parent)
    folder = w12.Folder(root, jpegbench.standard_transform())
    assert folder.samples == ImageFolder(root).samples  # torchvision's order and class indices
    torch.manual_seed(0)
    image, label = folder[5]
    assert image.shape == (3, 224, 224) and image.dtype == torch.float32 and label == folder.samples[5][1]
    assert image.min() < 0 < image.max()  # normalised
    uint8 = w12.Folder(root, jpegbench.standard_transform(uint8=True))[5][0]
    assert uint8.shape == (3, 224, 224) and uint8.dtype == torch.uint8
    repeated = w12.Repeat(folder, 50)
    assert len(repeated) == 50 and repeated.dataset is folder
    torch.manual_seed(1)
    first = repeated[5 + 24][0]
    torch.manual_seed(1)
    assert torch.equal(first, folder[5][0])  # sample i reads file i % files


def test_fewer_repetitions_above_the_cpus() -> None:
    assert [w12.reps_at(w, 3, cpus=2) for w in (1, 2, 4, 14)] == [3, 3, 1, 1]
    assert [w12.reps_at(w, 3, cpus=16) for w in (2, 14)] == [3, 3]
    assert w12.epoch_samples(14, 2000, 256) == 14 * 8 * 256 and w12.epoch_samples(2, 2000, 256) == 4096
    assert w12.epoch_samples(0, 2000, 256) == 2048  # every file once, whole batches
