"""The fused JPEG decode-and-crop: the crop box drawn as torchvision's RandomResizedCrop draws
it, the quality against a full-resolution decode of the same box on real photographs, the
fallbacks (PNG, greyscale, CMYK), reproducible randomness (a generator, or stoker's
sample_rng whatever the worker count), and `ImageFolder` with torchvision's class indices."""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

import stoker  # noqa: E402
from stoker._vision import crop as _crop  # noqa: E402
from stoker._vision import turbo as _turbo  # noqa: E402
from stoker._vision.crop import RATIO, SCALE  # noqa: E402
from stoker._vision.photos import photo_paths  # noqa: E402
from stoker.vision import DecodeCrop, ImageFolder, crop_box, decode_crop  # noqa: E402

try:
    PHOTOS = photo_paths()
except FileNotFoundError as exc:  # pragma: no cover - scikit-image is a test dependency
    pytest.skip(str(exc), allow_module_level=True)

# the bound stated in docs/guide/vision.md: a fused decode (a DCT-scaled or region JPEG
# decode, then OpenCV's resize when installed) against decoding at full resolution and resizing
# the same box with Pillow; measured minimum 38.9 dB on these photographs, 37.5 dB on W9's files
PSNR_BOUND_DB = 35.0


def jpeg(path: str, size: tuple[int, int], mode: str = "RGB", quality: int = 90) -> bytes:
    image = Image.open(path).convert("RGB").resize(size, Image.Resampling.BILINEAR)
    if mode != "RGB":
        image = image.convert(mode)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=quality)
    return out.getvalue()


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


# ----------------------------------------------------------------- the crop box
def test_crop_boxes_follow_random_resized_crops_rules() -> None:
    rng = np.random.default_rng(0)
    for _ in range(2000):
        top, left, h, w = crop_box(375, 500, rng)
        assert 0 <= top <= 375 - h and 0 <= left <= 500 - w and h > 0 and w > 0
        # rounding w and h to pixels moves area and ratio a little off their draws
        assert 0.08 * 0.9 <= h * w / (375 * 500) <= 1.0
        assert 3 / 4 * 0.9 <= w / h <= 4 / 3 * 1.1


def test_an_impossible_box_falls_back_to_torchvisions_centre_crop() -> None:
    rng = np.random.default_rng(0)
    # a very wide strip: no box of ratio within (3/4, 4/3) and 90 % of the area fits
    assert crop_box(10, 1000, rng, scale=(0.9, 1.0)) == (0, (1000 - 13) // 2, 10, 13)
    assert crop_box(1000, 10, rng, scale=(0.9, 1.0)) == ((1000 - 13) // 2, 0, 13, 10)


# ---------------------------------------------------------------------- quality
@pytest.mark.parametrize("partial", [True, False], ids=["region decode", "full decode"])
@pytest.mark.parametrize("size", [(500, 375), (800, 600), (1024, 768)])
def test_fused_decode_matches_a_full_resolution_decode_of_the_same_box(
    size: tuple[int, int], partial: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if partial and _turbo.library() is None:
        pytest.skip("no TurboJPEG 3 library (libjpeg-turbo 3, or the turbojpeg extra)")
    if not partial:
        monkeypatch.setattr(_crop, "_turbojpeg", lambda: None)
    rng = np.random.default_rng(1)
    worst, scaled = math.inf, 0
    for path in PHOTOS:
        data = jpeg(path, size)
        for _ in range(12):
            box = crop_box(size[1], size[0], rng)
            fused = decode_crop(data, box, (224, 224))
            reference = decode_crop(data, box, (224, 224), reduce=False)
            assert fused.shape == (3, 224, 224) and fused.dtype == np.uint8
            quality = psnr(fused, reference)
            worst = min(worst, quality)
            scaled += _crop.reduction_for(box[2], box[3], 224, 224) > 1
    assert worst >= PSNR_BOUND_DB, f"worst PSNR {worst:.1f} dB"
    if size[1] < 448:  # no box of a 375-high image has two output heights: decoded at full size
        assert scaled == 0
        if _crop._cv2() is None:  # Pillow resizes both: the very same pixels
            assert worst == math.inf


def test_the_fused_path_is_decoded_at_a_reduced_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    """A crop shrunk more than 2x is decoded at half size or less (not decoded in full)."""
    data = jpeg(PHOTOS[0], (1024, 768))
    turbo = _crop.find_simplejpeg()
    decoded: list[tuple[int, int]] = []
    if turbo is not None:
        real = turbo.decode_jpeg

        class Spy:
            def __getattr__(self, name: str) -> Any:
                return getattr(turbo, name)

            def decode_jpeg(self, *args: Any, **kwargs: Any) -> Any:
                pixels = real(*args, **kwargs)
                decoded.append(pixels.shape[:2])
                return pixels

        monkeypatch.setattr(_crop, "find_simplejpeg", lambda: Spy())
    else:  # Pillow's draft
        real_draft = Image.Image.draft

        def draft(self: Any, mode: Any, size: Any) -> Any:
            made = real_draft(self, mode, size)
            decoded.append((self.size[1], self.size[0]))
            return made

        monkeypatch.setattr(Image.Image, "draft", draft)
    out = decode_crop(data, (0, 0, 768, 1024), (224, 224))
    assert out.shape == (3, 224, 224)
    assert decoded and decoded[-1][0] <= 384 and decoded[-1][1] <= 512  # half of 1024 x 768 or less


# --------------------------------------------------------- the region decode
needs_turbo = pytest.mark.skipif(_turbo.library() is None, reason="no TurboJPEG 3 library")


@needs_turbo
def test_a_region_decode_equals_a_full_decode_of_the_region() -> None:
    simplejpeg = pytest.importorskip("simplejpeg")
    turbo = _turbo.library()
    assert turbo is not None
    rng = np.random.default_rng(2)
    for path, size in zip(PHOTOS, [(500, 375), (640, 480), (375, 500), (1024, 768)] * 4):
        data = jpeg(path, size)
        full = simplejpeg.decode_jpeg(data, colorspace="RGB")
        height, width = full.shape[:2]
        boxes = [crop_box(height, width, rng) for _ in range(6)]
        boxes += [(0, 0, height, width), (height - 7, width - 9, 7, 9), (3, 1, 5, width - 1)]
        for top, left, h, w in boxes:
            region = turbo.decode_region(data, top, left, h, w)
            assert region is not None and region.shape == (h, w, 3) and region.dtype == np.uint8
            assert psnr(region, full[top : top + h, left : left + w]) >= 55.0, (path, size, (top, left, h, w))


@needs_turbo
def test_decode_crop_decodes_only_the_region_of_a_jpeg(monkeypatch: pytest.MonkeyPatch) -> None:
    turbo = _turbo.library()
    calls: list[tuple[int, ...]] = []
    real = type(turbo).decode_region

    def spy(self: Any, data: bytes, *box: int) -> Any:
        calls.append(box)
        return real(self, data, *box)

    monkeypatch.setattr(type(turbo), "decode_region", spy)
    data = jpeg(PHOTOS[0], (500, 375))
    out = decode_crop(data, (40, 50, 300, 280), (224, 224))
    assert calls == [(40, 50, 300, 280)] and out.shape == (3, 224, 224)
    calls.clear()
    decode_crop(data, (0, 0, 375, 500), (64, 64))  # shrunk more than 2x: a DCT-scaled full decode
    assert calls == []


@needs_turbo
def test_a_jpeg_cut_short_below_the_crop_is_still_an_error(tmp_path: Path) -> None:
    data = jpeg(PHOTOS[1], (500, 375))
    path = tmp_path / "cut.jpg"
    path.write_bytes(data[: len(data) * 9 // 10])  # the top rows are all there
    top_box = (0, 0, 150, 150)  # well above the cut: the region itself decodes
    assert _turbo.library().decode_region(path.read_bytes(), *top_box) is not None  # type: ignore[union-attr]
    with pytest.raises(stoker.vision.DecodeError, match=r"cut\.jpg"):
        DecodeCrop(128, generator=0)(str(path))
    with pytest.raises(ValueError):  # simplejpeg's word for a truncated file
        decode_crop(str(path), top_box, (128, 128))


@needs_turbo
def test_region_decodes_in_threads_equal_serial_ones() -> None:
    from concurrent.futures import ThreadPoolExecutor

    datas = [jpeg(path, (500, 375)) for path in PHOTOS[:6]]
    boxes = [crop_box(375, 500, np.random.default_rng(i)) for i in range(len(datas))]
    serial = [decode_crop(d, b, (224, 224)) for d, b in zip(datas, boxes)]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            threaded = list(pool.map(lambda pair: decode_crop(pair[0], pair[1], (224, 224)), zip(datas, boxes)))
            assert all(np.array_equal(a, b) for a, b in zip(serial, threaded))


def test_without_a_turbojpeg_3_library_the_region_decode_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_turbo, "_found", [])
    monkeypatch.setattr(_turbo, "_candidates", lambda: ["/nonexistent/libturbojpeg.so.0"])
    assert _turbo.library() is None
    out = DecodeCrop(224, generator=0)(jpeg(PHOTOS[0], (500, 375)))
    assert out.shape == (3, 224, 224)


@pytest.mark.parametrize("kind", ["png", "grey", "cmyk"])
def test_other_formats_fall_back_to_a_full_decode_with_the_same_result(kind: str, tmp_path: Path) -> None:
    image = Image.open(PHOTOS[1]).convert("RGB").resize((640, 480))
    path = tmp_path / f"picture.{'png' if kind == 'png' else 'jpg'}"
    if kind == "png":
        image.save(path, "PNG")
    else:
        image.convert("L" if kind == "grey" else "CMYK").save(path, "JPEG", quality=90)
    box = (10, 20, 300, 400)
    out = decode_crop(str(path), box, (128, 96))
    want = Image.open(path).convert("RGB").resize((96, 128), Image.Resampling.BILINEAR, box=(20, 10, 420, 310))
    assert out.shape == (3, 128, 96)
    assert np.array_equal(out, np.asarray(want).transpose(2, 0, 1))


def test_flip_mirrors_the_crop() -> None:
    data = jpeg(PHOTOS[2], (500, 375))
    box = (20, 30, 200, 250)
    assert np.array_equal(decode_crop(data, box, (64, 64), flip=True), decode_crop(data, box, (64, 64))[:, :, ::-1])


# ----------------------------------------------------------------- DecodeCrop
def test_decode_crop_is_reproducible_from_its_generator() -> None:
    data = jpeg(PHOTOS[0], (500, 375))
    first = [DecodeCrop(96, generator=5)(data) for _ in range(1)]
    again = DecodeCrop(96, generator=5)
    assert np.array_equal(first[0], again(data))
    other = DecodeCrop(96, generator=6)
    assert not np.array_equal(DecodeCrop(96, generator=5)(data), other(data))


def test_decode_crop_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="size"):
        DecodeCrop(0)
    with pytest.raises(TypeError, match="size"):
        DecodeCrop("big")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scale"):
        DecodeCrop(224, scale=(1.0, 0.5))
    with pytest.raises(ValueError, match="ratio"):
        DecodeCrop(224, ratio=(0.0, 1.0))
    with pytest.raises(
        ValueError, match=r"flip should be a finite number >= 0 and <= 1 \(a probability\), but got flip=2"
    ):
        DecodeCrop(224, flip=2)
    with pytest.raises(TypeError, match="flip should be a finite number"):
        DecodeCrop(224, flip="half")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"scale should be \(low, high\) with 0 < low <= high <= 1, but got scale=\(0.5, 2\)"
    ):
        DecodeCrop(224, scale=(0.5, 2))
    with pytest.raises(TypeError, match="generator"):
        DecodeCrop(224, generator="seed")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="source"):
        DecodeCrop(224, generator=0)(42)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("images")
    for c, name in enumerate(["zebra", "apple", "mango"]):
        (root / name / "sub").mkdir(parents=True)
        for k in range(4):
            where = root / name / ("sub" if k == 3 else "") / f"{k}.jpg"
            where.write_bytes(jpeg(PHOTOS[(c + k) % len(PHOTOS)], (500, 375)))
        (root / name / "notes.txt").write_text("not an image")
    return root


def test_image_folder_has_torchvisions_classes_and_samples(folder: Path) -> None:
    dataset = ImageFolder(folder)
    assert dataset.classes == ["apple", "mango", "zebra"]
    assert dataset.class_to_idx == {"apple": 0, "mango": 1, "zebra": 2}
    assert len(dataset) == 12 and dataset.targets == [0] * 4 + [1] * 4 + [2] * 4
    assert [os.path.relpath(p, folder) for p, _ in dataset.samples[:4]] == [
        "apple/0.jpg",
        "apple/1.jpg",
        "apple/2.jpg",
        "apple/sub/3.jpg",
    ]
    image, target = dataset[5]
    assert isinstance(image, Image.Image) and image.mode == "RGB" and target == 1
    with pytest.raises(ValueError, match="extensions and is_valid_file"):
        ImageFolder(folder, extensions=(".jpg",), is_valid_file=lambda p: True)
    with pytest.raises(FileNotFoundError, match="no class folder"):
        ImageFolder(folder / "apple" / "sub")


def test_image_folder_with_the_fused_loader_gives_the_same_crops_at_any_worker_count(folder: Path) -> None:
    dataset = ImageFolder(folder, loader=DecodeCrop(64))

    def epoch(workers: int) -> list[np.ndarray]:
        loader = stoker.DataLoader(dataset, batch_size=4, num_workers=workers, generator=3)
        batches = list(loader)
        assert all(b[0].dtype == np.uint8 and b[0].shape == (4, 3, 64, 64) for b in batches)
        return [b[0] for b in batches]

    inline, workers = epoch(0), epoch(2)
    assert all(np.array_equal(a, b) for a, b in zip(inline, workers))  # sample_rng: per sample


# ------------------------------------------------------------ more fallbacks
def test_webp_falls_back_with_the_same_result(tmp_path: Path) -> None:
    path = tmp_path / "picture.webp"
    Image.open(PHOTOS[3]).convert("RGB").resize((320, 240)).save(path, "WEBP", quality=90)
    box = (5, 10, 200, 250)
    want = Image.open(path).convert("RGB").resize((64, 64), Image.Resampling.BILINEAR, box=(10, 5, 260, 205))
    assert np.array_equal(decode_crop(str(path), box, (64, 64)), np.asarray(want).transpose(2, 0, 1))


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_rotated_jpegs_are_turned_as_exif_transpose_turns_them(orientation: int, tmp_path: Path) -> None:
    from PIL import ImageOps

    path = tmp_path / f"rotated-{orientation}.jpg"
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.open(PHOTOS[0]).convert("RGB").resize((400, 300)).save(path, "JPEG", quality=90, exif=exif)
    upright = ImageOps.exif_transpose(Image.open(path))
    # a crop of the whole image shows the orientation: compare with the upright image resized
    crop = DecodeCrop(48, scale=(1.0, 1.0), ratio=(upright.width / upright.height,) * 2, flip=0.0, generator=0)
    out = crop(str(path))
    want = np.asarray(upright.convert("RGB").resize((48, 48), Image.Resampling.BILINEAR)).transpose(2, 0, 1)
    assert psnr(out, want) > 30


# -------------------------------------------------------------- bad input
@pytest.mark.parametrize("damage", ["empty", "truncated", "not an image", "garbage jpeg"])
def test_a_bad_file_is_a_decode_error_naming_it(damage: str, tmp_path: Path) -> None:
    data = jpeg(PHOTOS[1], (500, 375))
    content = {
        "empty": b"",
        "truncated": data[: len(data) // 3],
        "not an image": b"name,value\n1,2\n" * 50,
        "garbage jpeg": data[:200] + bytes(range(256)) * 40,
    }[damage]
    path = tmp_path / "bad.jpg"
    path.write_bytes(content)
    with pytest.raises(stoker.vision.DecodeError, match=r"cannot decode '.*bad\.jpg'"):
        DecodeCrop(64, generator=0)(str(path))
    with pytest.raises(OSError):  # DecodeError is an OSError, as PIL's errors are
        DecodeCrop(64, generator=0)(content)


def test_a_bad_file_raises_at_its_batch_and_nothing_else_is_lost(folder: Path, tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "images"
    shutil.copytree(folder, root)
    broken = root / "mango" / "1.jpg"
    broken.write_bytes(broken.read_bytes()[:100])
    dataset = ImageFolder(root, loader=DecodeCrop(32))
    loader = stoker.DataLoader(dataset, batch_size=1, num_workers=2, max_worker_restarts=1)
    got, errors = [], []
    iterator = iter(loader)
    while True:
        try:
            _, target = next(iterator)
        except StopIteration:
            break
        except stoker.vision.DecodeError as exc:
            errors.append(str(exc))
            continue
        got.append(int(target[0]))
    assert len(errors) == 1 and "mango" in errors[0] and "1.jpg" in errors[0]
    assert sorted(got) == sorted(t for i, t in enumerate(dataset.targets) if dataset.samples[i][0] != str(broken))


def test_scale_and_size_outside_their_ranges_are_value_errors() -> None:
    for scale in [(0.0, 1.0), (0.5, 1.5), (-0.1, 0.5)]:
        with pytest.raises(ValueError, match="scale"):
            DecodeCrop(224, scale=scale)
    with pytest.raises(ValueError, match="size"):
        DecodeCrop((224, 0))


# ------------------------------------------------- the box's distribution
def torchvision_get_params(
    height: int, width: int, scale: Any, ratio: Any, generator: Any
) -> tuple[int, int, int, int]:
    """`RandomResizedCrop.get_params` as torchvision documents and implements it, with torch's
    ops and float32 tensors, drawing from `generator` (torchvision draws from torch's global
    RNG): the reference the box law is checked against."""
    import torch

    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1], generator=generator).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=generator)).item()
        w = round(math.sqrt(target_area * aspect_ratio))
        h = round(math.sqrt(target_area / aspect_ratio))
        if 0 < w <= width and 0 < h <= height:
            i = int(torch.randint(0, height - h + 1, size=(1,), generator=generator).item())
            j = int(torch.randint(0, width - w + 1, size=(1,), generator=generator).item())
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = round(w / min(ratio))
    elif in_ratio > max(ratio):
        h = height
        w = round(h * max(ratio))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class TorchDraws:
    """torch's RNG behind the two calls `crop_box` makes (`uniform`, `integers`), drawn as
    torchvision draws them: so crop_box and torchvision take the very same numbers."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator

    def uniform(self, low: float, high: float) -> float:
        import torch

        return float(torch.empty(1).uniform_(low, high, generator=self.generator).item())

    def integers(self, low: int, high: int) -> int:
        import torch

        return int(torch.randint(low, high, size=(1,), generator=self.generator).item())


# sizes of ImageNet's images, extremes, and scale/ratio laws that reach the fallback
LAW_CASES = [
    ((375, 500), SCALE, RATIO),
    ((500, 375), SCALE, RATIO),
    ((333, 500), SCALE, RATIO),
    ((600, 800), SCALE, RATIO),
    ((224, 224), SCALE, RATIO),
    ((3, 4), SCALE, RATIO),
    ((10, 1000), (0.9, 1.0), RATIO),
    ((1000, 10), (0.9, 1.0), RATIO),
    ((100, 110), (0.9, 1.0), RATIO),
    ((375, 500), (0.5, 0.9), (0.5, 2.0)),
]


@pytest.mark.parametrize(
    ("shape", "scale", "ratio"), LAW_CASES, ids=[f"{c[0][0]}x{c[0][1]}-{c[1]}-{c[2]}" for c in LAW_CASES]
)
def test_crop_box_is_torchvisions_get_params_draw_for_draw(shape: tuple[int, int], scale: Any, ratio: Any) -> None:
    """Given torch's draws, crop_box makes torchvision's boxes: the same tries, rounding,
    bounds and fallback. (torchvision takes log(ratio) and exp in float32, crop_box in
    float64; a box could differ where a width falls on a rounding edge: none did here.)"""
    torch = pytest.importorskip("torch")
    height, width = shape
    ours = TorchDraws(torch.Generator().manual_seed(41))
    theirs = torch.Generator().manual_seed(41)
    boxes = [crop_box(height, width, ours, scale, ratio) for _ in range(1000)]
    want = [torchvision_get_params(height, width, scale, ratio, theirs) for _ in range(1000)]
    assert boxes == want
    assert ours.generator.get_state().equal(theirs.get_state())  # the same number of draws


def test_box_distribution_matches_random_resized_crops() -> None:
    """stoker draws from numpy (per sample, from its seed), torchvision from torch's global
    RNG: another stream, the same law. The box's share of the area, its log aspect ratio and
    its centre have the same distributions (two-sample Kolmogorov-Smirnov)."""
    torch = pytest.importorskip("torch")
    stats = pytest.importorskip("scipy.stats")

    for (height, width), count in [((375, 500), 4000), ((500, 333), 4000), ((10, 1000), 500)]:
        rng = np.random.default_rng(12345)
        ours = np.array([crop_box(height, width, rng) for _ in range(count)], dtype=np.float64)
        generator = torch.Generator().manual_seed(12345)
        theirs = np.array(
            [torchvision_get_params(height, width, SCALE, RATIO, generator) for _ in range(count)], dtype=np.float64
        )
        features = {
            "area": lambda b: b[:, 2] * b[:, 3] / (height * width),  # noqa: B023
            "log aspect": lambda b: np.log(b[:, 3] / b[:, 2]),
            "centre_y": lambda b: (b[:, 0] + b[:, 2] / 2) / height,  # noqa: B023
            "centre_x": lambda b: (b[:, 1] + b[:, 3] / 2) / width,  # noqa: B023
        }
        for name, feature in features.items():
            a, b = feature(ours), feature(theirs)
            if np.ptp(a) == 0 and np.ptp(b) == 0:  # the fallback only: one box both ways
                assert a[0] == b[0], (height, width, name)
                continue
            p_value = stats.ks_2samp(a, b).pvalue
            assert p_value > 0.001, f"{height}x{width} {name}: the box distributions differ (KS p={p_value:.2g})"


def test_the_area_and_log_ratio_follow_their_uniform_laws() -> None:
    """Against the law itself, not only torchvision's samples: on a large image (rounding
    negligible) a box's share of the area is uniform on scale and its log aspect ratio
    uniform on log(ratio), except where a try is refused (too wide or too tall)."""
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(7)
    boxes = np.array([crop_box(4000, 4000, rng, scale=(0.08, 0.5)) for _ in range(4000)], dtype=np.float64)
    area = boxes[:, 2] * boxes[:, 3] / 4000**2
    log_aspect = np.log(boxes[:, 3] / boxes[:, 2])
    # at most half the area and a ratio within 4/3: every try fits, none is refused
    assert stats.kstest(area, stats.uniform(0.08, 0.42).cdf).pvalue > 0.001
    low, high = math.log(3 / 4), math.log(4 / 3)
    assert stats.kstest(log_aspect, stats.uniform(low, high - low).cdf).pvalue > 0.001


def test_the_flip_is_drawn_with_probability_p_after_the_box() -> None:
    """A left-right ramp shows each output's flip: about half of them for p=0.5, and each
    sample's flip is the draw after its box (torchvision's order)."""
    ramp = np.tile(np.linspace(0, 255, 64, dtype=np.float64), (48, 1))
    image = Image.fromarray(np.stack([ramp] * 3, axis=-1).astype(np.uint8))
    out = io.BytesIO()
    image.save(out, "PNG")  # lossless: the ramp's direction is unmistakable
    data = out.getvalue()
    crop = DecodeCrop(8, flip=0.5, generator=np.random.default_rng(3))
    flips = []
    for _ in range(2000):
        pixels = crop(data)
        flips.append(bool(pixels[0, :, 0].mean() > pixels[0, :, -1].mean()))
    count = sum(flips)
    assert abs(count - 1000) < 4.5 * math.sqrt(2000 * 0.25), count  # binomial(2000, 0.5)
    replay = np.random.default_rng(3)
    drawn = []
    for _ in range(2000):
        crop_box(48, 64, replay)
        drawn.append(bool(replay.random() < 0.5))
    assert flips == drawn
    never = DecodeCrop(8, flip=0.0, generator=0)
    always = DecodeCrop(8, flip=1.0, generator=0)
    for _ in range(20):
        assert never(data)[0, :, 0].mean() < never(data)[0, :, -1].mean()
        assert always(data)[0, :, 0].mean() > always(data)[0, :, -1].mean()


# ------------------------------------------- the drop-in against torchvision's pixels
# the bound stated in docs/guide/vision.md and DecodeCrop's docstring: DecodeCrop's output
# against torchvision's transform on the same JPEG for the same box and flip (Pillow's full
# decode, crop, bilinear antialiased resize, flip); measured on 1,000 crops of 200 W9-style
# files: minimum 37.3 dB, median 49.9 dB
DROP_IN_PSNR_DB = 35.0


def torchvision_pixels(path: str, box: tuple[int, int, int, int], flip: bool, size: int) -> np.ndarray:
    """What torchvision's `ImageFolder` (its `pil_loader`) + `RandomResizedCrop(size)` (on a PIL
    image: `crop`, then `resize` with Pillow's bilinear filter, antialiased) +
    `RandomHorizontalFlip` make of `path` for this box and flip, as uint8 CHW (`ToTensor`
    divides by 255; `Normalize` is the same affine map on both sides)."""
    with open(path, "rb") as file:
        image = Image.open(file).convert("RGB")
    top, left, h, w = box
    image = image.crop((left, top, left + w, top + h)).resize((size, size), Image.Resampling.BILINEAR)
    if flip:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(image).transpose(2, 0, 1)


@pytest.fixture(scope="module")
def real_jpegs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    from stoker._vision.photos import make_jpegs

    return make_jpegs(str(tmp_path_factory.mktemp("real-jpegs")), 60, seed=41)


@pytest.mark.parametrize("partial", [True, False], ids=["region decode", "full decode"])
def test_decode_crop_is_within_the_stated_psnr_of_torchvisions_transform(
    real_jpegs: list[str], partial: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if partial and _turbo.library() is None:
        pytest.skip("no TurboJPEG 3 library (libjpeg-turbo 3, or the turbojpeg extra)")
    if not partial:
        monkeypatch.setattr(_crop, "_turbojpeg", lambda: None)
    qualities, flips = [], 0
    for i, path in enumerate(real_jpegs):
        for k in range(4):
            seed = 100 * i + k
            pixels = DecodeCrop(224, generator=seed)(path)
            width, height = Image.open(path).size
            replay = np.random.default_rng(seed)  # DecodeCrop's draws: the box, then the flip
            box = crop_box(height, width, replay)
            flip = bool(replay.random() < 0.5)
            flips += flip
            assert pixels.shape == (3, 224, 224) and pixels.dtype == np.uint8
            qualities.append(psnr(pixels, torchvision_pixels(path, box, flip, 224)))
    assert 0 < flips < len(qualities)
    assert min(qualities) >= DROP_IN_PSNR_DB, f"worst PSNR {min(qualities):.1f} dB"
    assert float(np.median(qualities)) >= 45.0, f"median PSNR {np.median(qualities):.1f} dB"


def test_a_pil_image_is_cropped_with_torchvisions_pixels(real_jpegs: list[str]) -> None:
    """torchvision's ImageFolder hands its transform a decoded PIL image: DecodeCrop then does
    exactly what RandomResizedCrop + RandomHorizontalFlip do to it."""
    for seed, path in enumerate(real_jpegs[:12]):
        with open(path, "rb") as file:
            image = Image.open(file).convert("RGB")
        pixels = DecodeCrop(160, generator=seed)(image)
        replay = np.random.default_rng(seed)
        box = crop_box(image.height, image.width, replay)
        assert np.array_equal(pixels, torchvision_pixels(path, box, bool(replay.random() < 0.5), 160))


def test_image_folder_hands_decode_crop_the_path(folder: Path) -> None:
    seen: list[Any] = []

    class Spy(DecodeCrop):
        def __call__(self, source: Any) -> np.ndarray:
            seen.append(source)
            return super().__call__(source)

    dataset = ImageFolder(folder, transform=Spy(32, generator=0))
    pixels, target = dataset[5]
    assert seen == [dataset.samples[5][0]] and pixels.shape == (3, 32, 32) and target == 1
    # another transform still gets a decoded PIL image, as torchvision's ImageFolder gives it
    assert isinstance(ImageFolder(folder, transform=lambda image: image)[0][0], Image.Image)
    # and an explicit loader is used as given
    raw = ImageFolder(folder, transform=Spy(32, generator=0), loader=lambda path: Path(path).read_bytes())
    assert raw[0][0].shape == (3, 32, 32) and isinstance(seen[-1], bytes)


def test_normalize_on_the_device_equals_to_tensor_and_normalize(real_jpegs: list[str]) -> None:
    """The other half of the drop-in: uint8 batches normalised by to_device's transform are
    what ToTensor + Normalize make on the CPU (float32 rounding apart)."""
    torch = pytest.importorskip("torch")
    from stoker.torch import normalize, to_device

    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    crop = DecodeCrop(64, generator=0)
    images = torch.from_numpy(np.stack([crop(path) for path in real_jpegs[:8]]))
    labels = torch.arange(8)
    ((moved, moved_labels),) = list(to_device([(images, labels)], "cpu", transform=normalize(mean, std)))
    want = (images.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    assert moved.dtype == torch.float32 and torch.equal(moved_labels, labels)
    assert torch.allclose(moved, want, atol=1e-5)


def test_exif_is_found_by_walking_the_segments_before_the_scan() -> None:
    plain = jpeg(PHOTOS[0], (64, 48))
    exif = Image.Exif()
    exif[0x0112] = 6
    out = io.BytesIO()
    Image.open(io.BytesIO(plain)).save(out, "JPEG", exif=exif, icc_profile=b"\0" * 300)
    tagged = out.getvalue()
    assert not _crop.may_be_rotated(plain)
    assert _crop.may_be_rotated(tagged)
    # "Exif" in the pixels' data is not an EXIF segment
    assert not _crop.may_be_rotated(plain[:-2] + b"Exif\x00\x00" + plain[-2:])
    # a header that cannot be walked: the search over the first 64 KiB decides
    assert _crop.may_be_rotated(b"\xff\xd8\x00garbage Exif\x00\x00 more")
    assert not _crop.may_be_rotated(b"\xff\xd8\x00garbage")


def test_a_box_decoded_at_a_reduced_scale_is_sampled_at_its_exact_edges() -> None:
    """A box whose edges fall between the pixels of a DCT-scaled decode is warped exactly:
    close to Pillow's resize of the same fractional box, and to torchvision's pixels."""
    cv2 = pytest.importorskip("cv2")
    simplejpeg = pytest.importorskip("simplejpeg")
    data = jpeg(PHOTOS[0], (1024, 768))
    full = simplejpeg.decode_jpeg(data)
    for box, reduction in [((3, 5, 701, 937), 2), ((0, 0, 768, 1024), 2), ((101, 77, 470, 500), 2)]:
        scaled = simplejpeg.decode_jpeg(
            data, min_height=math.ceil(768 / reduction), min_width=math.ceil(1024 / reduction)
        )
        warped = _crop._finish_scaled(cv2, scaled, 1024, 768, box, (224, 224), False)
        pillow = _crop._finish(Image.fromarray(scaled), 1024, 768, box, (224, 224), False)
        top, left, h, w = box
        reference = np.asarray(
            Image.fromarray(full).crop((left, top, left + w, top + h)).resize((224, 224), Image.Resampling.BILINEAR)
        ).transpose(2, 0, 1)
        assert psnr(warped, pillow) >= 40.0, box
        assert psnr(warped, reference) >= DROP_IN_PSNR_DB, box
        flipped = _crop._finish_scaled(cv2, scaled, 1024, 768, box, (224, 224), True)
        assert np.array_equal(flipped, warped[:, :, ::-1])
