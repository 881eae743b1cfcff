"""`DecodeOnDevice`, `collate_jpegs` and `decode_jpegs` on the CPU: the same crops as
`DecodeCrop`, the ragged batch's layout, bad files named, and the GPU path's crop-resize code
run on the CPU with libjpeg-turbo standing in for nvJPEG."""

from __future__ import annotations

import dataclasses
import io
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

PIL = pytest.importorskip("PIL")
torch = pytest.importorskip("torch")
from PIL import Image  # noqa: E402

from stoker._vision import device_decode  # noqa: E402
from stoker._vision.photos import photo_paths  # noqa: E402
from stoker.torch import normalize, to_device  # noqa: E402
from stoker.vision import (  # noqa: E402
    DecodeCrop,
    DecodeError,
    DecodeOnDevice,
    JpegBatch,
    JpegCrop,
    collate_jpegs,
    decode_jpegs,
)

try:
    PHOTOS = photo_paths()
except FileNotFoundError as exc:  # pragma: no cover - scikit-image is a test dependency
    pytest.skip(str(exc), allow_module_level=True)

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# the GPU path's arithmetic (a full decode, then torch's antialiased bilinear resize) against
# the fused CPU path, both decoded by libjpeg-turbo here: measured minimum 39.9 dB (median 53.8)
# on these files, 37.6 dB (median 50.5) on 600 crops of W9's kind of files
# (docs/guide/vision.md, "Decoding on the GPU")
RESIZE_PSNR_BOUND_DB = 33.0


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def write(path: Path, photo: str, size: tuple[int, int], mode: str = "RGB", fmt: str = "JPEG", **save: Any) -> str:
    image = Image.open(photo).convert("RGB").resize(size, Image.Resampling.BILINEAR)
    if mode != "RGB":
        image = image.convert(mode)
    image.save(path, fmt, **({"quality": 90} if fmt == "JPEG" else {}), **save)
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """JPEGs at ImageNet's sizes (and small ones), greyscale, CMYK, EXIF upright and turned,
    and a PNG: every route a file can take."""
    root = tmp_path_factory.mktemp("jpegs")
    sizes = [(500, 375), (375, 500), (640, 480), (800, 600), (120, 90), (333, 500)]
    made = [write(root / f"photo{i}.jpg", PHOTOS[i % len(PHOTOS)], size) for i, size in enumerate(sizes)]
    made.append(write(root / "grey.jpg", PHOTOS[1], (400, 300), mode="L"))
    made.append(write(root / "cmyk.jpg", PHOTOS[2], (400, 300), mode="CMYK"))
    upright, turned = Image.Exif(), Image.Exif()
    upright[0x0112], turned[0x0112] = 1, 6
    made.append(write(root / "exif-upright.jpg", PHOTOS[3], (400, 300), exif=upright))
    made.append(write(root / "exif-turned.jpg", PHOTOS[4 % len(PHOTOS)], (400, 300), exif=turned))
    made.append(write(root / "picture.png", PHOTOS[0], (300, 200), fmt="PNG"))
    return made


def batch_of(paths: list[str], make: DecodeOnDevice) -> JpegBatch:
    batch = collate_jpegs([(make(p), k) for k, p in enumerate(paths)])
    assert isinstance(batch[0], JpegBatch) and torch.equal(batch[1], torch.arange(len(paths)))
    return batch[0]


# ------------------------------------------------------------------- the worker's crops
@pytest.mark.parametrize("size", [224, (96, 160)])
def test_the_cpu_fallback_equals_decode_crop_for_the_same_parameters(files: list[str], size: Any) -> None:
    for seed in range(4):
        parameters = {"scale": (0.2, 0.9), "ratio": (0.6, 1.5), "flip": 0.5}
        ours, theirs = (
            DecodeOnDevice(size, **parameters, generator=seed),
            DecodeCrop(size, **parameters, generator=seed),
        )
        batch = batch_of(files, ours)
        want = np.stack([theirs(p) for p in files])
        crops = decode_jpegs(decoder="cpu")([batch])[0]
        assert crops.dtype == torch.uint8 and np.array_equal(crops.numpy(), want)
        normalised = decode_jpegs(MEAN, STD, device="cpu")([batch])[0]
        assert torch.equal(normalised, normalize(MEAN, STD)(torch.from_numpy(want)))


def test_only_files_nvjpeg_takes_travel_as_bytes(files: list[str]) -> None:
    batch = batch_of(files, DecodeOnDevice(64, generator=0))
    names = [Path(p).name for p in files]
    kept = {names[i] for i in range(len(files)) if batch.decoded[i]}
    assert kept == {"cmyk.jpg", "exif-turned.jpg", "picture.png"}  # decoded in the worker
    assert batch.pixels.shape == (3, 3, 64, 64)
    for i, path in enumerate(files):
        if not batch.decoded[i]:
            assert batch.jpeg(i).tobytes() == Path(path).read_bytes()


def test_the_ragged_batch_is_plain_arrays_of_the_bytes_boxes_and_flips(files: list[str]) -> None:
    make = DecodeOnDevice(32, flip=0.5, generator=1)
    paths = files[:6]
    crops = [make(p) for p in paths]
    batch = collate_jpegs(crops)
    assert isinstance(batch, JpegBatch) and len(batch) == 6
    assert batch.data.dtype == np.uint8 and batch.data.ndim == 1
    assert batch.offsets.dtype == np.int64 and batch.offsets.tolist()[0] == 0
    assert batch.offsets[-1] == sum(len(Path(p).read_bytes()) for p in paths) == len(batch.data)
    assert batch.boxes.dtype == np.int32 and batch.boxes.shape == (6, 4)
    assert batch.flips.dtype == np.bool_ and batch.flips.tolist() == [c.flip for c in crops]
    assert [tuple(b) for b in batch.boxes.tolist()] == [c.box for c in crops]
    assert batch.indices.tolist() == [-1] * 6  # called outside a loader: no sample index
    assert batch.size == (32, 32) and "photo0.jpg" in batch.names[0]
    for crop, (top, left, h, w) in zip(crops, batch.boxes.tolist()):
        assert isinstance(crop, JpegCrop) and h > 0 and w > 0 and top >= 0 and left >= 0
    assert batch == collate_jpegs(crops) and batch != collate_jpegs(crops[:5])


def test_crops_of_other_sizes_or_kinds_cannot_share_a_batch(files: list[str]) -> None:
    with pytest.raises(ValueError, match="crop size"):
        collate_jpegs([DecodeOnDevice(32)(files[0]), DecodeOnDevice(48)(files[0])])
    with pytest.raises(TypeError, match="JpegCrop"):
        collate_jpegs([DecodeOnDevice(32)(files[0]), "not a crop"])


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="flip"):
        DecodeOnDevice(224, flip=2.0)
    with pytest.raises(TypeError, match="size"):
        DecodeOnDevice("big")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="source"):
        DecodeOnDevice(224)(42)
    with pytest.raises(TypeError, match="give it as ImageFolder's loader="):
        DecodeOnDevice(224)(Image.new("RGB", (8, 8)))
    with pytest.raises(
        ValueError, match="decoder should be 'auto', 'cpu', 'nvjpeg' or 'nvimgcodec', but got decoder='opencv'"
    ):
        decode_jpegs(decoder="opencv")
    with pytest.raises(ValueError, match="both be given"):
        decode_jpegs(MEAN)
    with pytest.raises(ValueError, match="std should be values without a zero, but got std="):
        decode_jpegs(MEAN, (0.2, 0.0, 0.2))


# -------------------------------------------------------------------------- bad files
def test_a_corrupt_header_raises_in_the_worker_naming_the_file(files: list[str], tmp_path: Path) -> None:
    data = Path(files[0]).read_bytes()
    path = tmp_path / "bad-header.jpg"
    path.write_bytes(data[:200] + bytes(range(256)) * 40)
    with pytest.raises(DecodeError, match=r"cannot decode '.*bad-header\.jpg'"):
        DecodeOnDevice(64, generator=0)(str(path))
    with pytest.raises(DecodeError, match="missing"):
        DecodeOnDevice(64)(str(tmp_path / "missing.jpg"))


def test_a_corrupt_body_raises_at_decode_naming_the_file_and_index(files: list[str], tmp_path: Path) -> None:
    data = Path(files[0]).read_bytes()
    path = tmp_path / "cut-short.jpg"
    path.write_bytes(data[: len(data) // 3])  # the header is whole: the worker cannot tell
    make = DecodeOnDevice(64, generator=0)
    crop = make(str(path))
    assert crop.pixels is None and len(crop.data) == len(data) // 3
    batch = collate_jpegs([make(files[1]), dataclasses.replace(crop, index=17)])
    with pytest.raises(DecodeError, match=r"cannot decode '.*cut-short\.jpg' \(sample 17, image 1 of the batch\)"):
        decode_jpegs(MEAN, STD, device="cpu")(batch)
    with pytest.raises(DecodeError, match=r"cut-short\.jpg") as raised:  # through to_device: a note too
        next(iter(to_device([batch], "cpu", transform=decode_jpegs(MEAN, STD))))
    assert any("to_device's transform" in note for note in getattr(raised.value, "__notes__", []))


# ------------------------------------------ the GPU path's code, libjpeg-turbo for nvJPEG
def libjpeg_full(tensors: list[Any]) -> list[Any]:
    """What nvJPEG returns (full images, uint8 CHW), decoded by libjpeg-turbo on the CPU."""
    simplejpeg = pytest.importorskip("simplejpeg")
    return [
        torch.from_numpy(simplejpeg.decode_jpeg(t.numpy().tobytes(), colorspace="RGB")).permute(2, 0, 1)
        for t in tensors
    ]


def on_device(batch: JpegBatch, decoder: Any = libjpeg_full) -> np.ndarray:
    transform = device_decode._DecodeJpegs(torch.device("cpu"), "auto", lambda crops: crops)
    return transform._on_device(batch, decoder, torch.device("cpu")).numpy()


def test_the_device_paths_crop_resize_flip_is_close_to_the_cpu_path(files: list[str]) -> None:
    worst, flipped = math.inf, 0
    for seed in range(6):
        batch = batch_of(files, DecodeOnDevice(224, generator=seed))
        flipped += int(batch.flips.sum())
        gpu_like, cpu = on_device(batch), decode_jpegs(decoder="cpu")(batch).numpy()
        for i in range(len(batch)):
            if batch.decoded[i]:
                assert np.array_equal(gpu_like[i], cpu[i])  # the worker's pixels, as they came
            else:
                worst = min(worst, psnr(gpu_like[i], cpu[i]))
    assert flipped > 0 and worst >= RESIZE_PSNR_BOUND_DB, worst


def test_the_device_path_names_a_file_its_decoder_refuses(files: list[str], tmp_path: Path) -> None:
    data = Path(files[0]).read_bytes()
    start = data.index(b"\xff\xda")  # start of scan: keep the header, garble the entropy-coded data
    broken = tmp_path / "garbled.jpg"
    broken.write_bytes(data[: start + 200] + b"\xff\xd0\xff\x99" * 2000 + b"\xff\xd9")
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(data[: len(data) // 2])
    make = DecodeOnDevice(64, generator=0)
    for path, place in ((broken, 1), (cut, 2)):
        crops = [make(files[1]), make(files[2]), make(files[3])]
        crops[place] = dataclasses.replace(make(str(path)), index=40 + place)
        with pytest.raises(DecodeError, match=rf"{path.name}' \(sample {40 + place}, image {place} of the batch\)"):
            on_device(collate_jpegs(crops))


def test_the_device_path_sends_a_cut_short_file_to_the_cpu(files: list[str]) -> None:
    calls: list[int] = []

    def counting(tensors: list[Any]) -> list[Any]:
        calls.append(len(tensors))
        return libjpeg_full(tensors)

    make = DecodeOnDevice(48, generator=2)
    crops = [make(p) for p in files[:3]]
    padded = dataclasses.replace(crops[1], data=np.concatenate([crops[1].data, np.frombuffer(b"trailing", np.uint8)]))
    batch = collate_jpegs([crops[0], padded, crops[2]])
    out = on_device(batch, counting)
    assert calls == [2]  # the file without its end-of-image marker was decoded on the CPU
    assert np.array_equal(out[1], decode_jpegs(decoder="cpu")(batch).numpy()[1])


def test_decoded_crops_are_a_collated_batchs_images() -> None:
    pixels = np.arange(3 * 8 * 8, dtype=np.uint8).reshape(3, 8, 8)
    out = io.BytesIO()
    Image.fromarray(pixels.transpose(1, 2, 0)).save(out, "PNG")
    crop = DecodeOnDevice(8, scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=0.0, generator=0)(out.getvalue())
    assert crop.pixels is not None and len(crop.data) == 0  # a PNG: decoded in the worker
    batch = {"image": collate_jpegs([crop, crop]), "label": torch.tensor([1, 2])}
    got = decode_jpegs(device="cpu")(batch)
    assert set(got) == {"image", "label"} and torch.equal(got["label"], torch.tensor([1, 2]))
    assert torch.equal(got["image"], torch.from_numpy(np.stack([pixels, pixels])))
