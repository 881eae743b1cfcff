"""A fused JPEG decode and random resized crop: decode only the pixels the crop needs.

`RandomResizedCrop` as torchvision draws it (a box of `scale` of the image's area and an
aspect ratio log-uniform in `ratio`, ten tries, then a centre crop) is drawn from the image's
header alone, before any pixel is decoded. The JPEG is then decoded at the smallest DCT
scale (1, 1/2, 1/4 or 1/8: libjpeg's scaled IDCT, Pillow's `Image.draft`) at which the box
still has at least the output's pixels, so a crop that will be shrunk is never decoded at
full size; the box is cropped and resized in one pass (`Image.resize(box=...)`, bilinear
with antialiasing, as torchvision's PIL path does), flipped if drawn, and returned as uint8
CHW. Float conversion and normalisation are left to the consumer (the GPU: see
`stoker.torch.normalize`).

With `simplejpeg` installed (the `vision` extra; a libjpeg-turbo binding whose wheels bundle
the library) the JPEG is decoded by it instead of Pillow, with the same pixels (Pillow also
decodes with libjpeg-turbo) and less overhead; with OpenCV installed (also in the extra) the
crop is resized by it, several times faster than Pillow's antialiased bilinear resize: a crop
of a JPEG decoded at full size by `_finish_array`, one decoded at a reduced scale (whose
edges fall between its pixels) by an exact affine warp, `_finish_scaled`. With a TurboJPEG 3
library as well
(`_vision/turbo.py`: libjpeg-turbo 3, or the `turbojpeg` extra) a crop decoded at full size
is decoded alone: the rows below it are never decoded, the rows above and the columns
beside it get no inverse DCT. libjpeg-turbo also offers scales of 7/8, 3/4 and 5/8, but
they decode more slowly than the full size (measured: 0.8-0.9 ms against 0.5 ms for a
500x375 JPEG) and blur more, so only the power-of-two scales are used.

Other formats (PNG, WebP, ...) and JPEGs that are not three-channel (greyscale, CMYK) are
decoded in full and converted to RGB: the same box, the same result path. The quality bounds
(against a full-resolution decode of the same box, and against torchvision's transform for
the same box and flip: 35 dB PSNR) are stated and tested in `tests/unit/test_vision.py`.
"""

from __future__ import annotations

import io
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._base.checks import check_number, fail
from .errors import DecodeError

SCALE = (0.08, 1.0)
RATIO = (3.0 / 4.0, 4.0 / 3.0)
REDUCTIONS = (8, 4, 2)  # libjpeg's DCT scales below 1, largest first


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError as exc:  # pragma: no cover - exercised only without Pillow
        raise ImportError("stoker.vision needs Pillow; install it with `pip install stoker[vision]`") from exc
    return Image


def crop_box(
    height: int, width: int, rng: Any, scale: Sequence[float] = SCALE, ratio: Sequence[float] = RATIO
) -> tuple[int, int, int, int]:
    """(top, left, height, width) of a random resized crop of an image of `height` x
    `width`, drawn as torchvision's `RandomResizedCrop.get_params` draws it, from `rng`.

    Ten tries at a box of a random share of the area and a log-uniform aspect ratio; when
    none fits, the centre crop of the largest box whose aspect ratio is within `ratio`.

    Args:
        height: The image's height in pixels.
        width: The image's width in pixels.
        rng: A `numpy.random.Generator` (anything with its `uniform` and `integers`).
        scale: The (low, high) range of the box's share of the image's area; SCALE is
            torchvision's (0.08, 1.0). Defaults to SCALE.
        ratio: The (low, high) range of the box's aspect ratio (width / height), drawn
            log-uniformly; RATIO is torchvision's (3/4, 4/3). Defaults to RATIO.

    Returns:
        The box (top, left, height, width), in the image's pixels.
    """
    area = height * width
    log_low, log_high = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_low, log_high))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w = width
        h = round(w / min(ratio))
    elif in_ratio > max(ratio):
        h = height
        w = round(h * max(ratio))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def open_image(source: Any) -> Any:
    Image = _pil()
    if isinstance(source, (bytes, bytearray, memoryview)):
        return Image.open(io.BytesIO(source))
    if isinstance(source, (str, os.PathLike)):
        return Image.open(source)
    if hasattr(source, "read"):
        return Image.open(source)
    raise TypeError(f"source should be a path, bytes or a binary file object, but got a {type(source).__name__}")


def find_simplejpeg() -> Any:
    try:
        import simplejpeg
    except ImportError:
        return None
    return simplejpeg


_JPEG_MAGIC = b"\xff\xd8\xff"
JPEG_END = b"\xff\xd9"


def read_jpeg(source: Any) -> bytes | None:
    """The bytes of `source` if it is JPEG data or a JPEG file, else None."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as file:
            data = file.read()
    else:
        return None
    return data if data[:3] == _JPEG_MAGIC else None


def _cv2() -> Any:
    try:
        import cv2
    except ImportError:
        return None
    return cv2


def _turbojpeg() -> Any:
    from .turbo import library

    return library()


# shrinks up to this factor are resized bilinearly without antialiasing (what aliasing there
# is stays under the quality bound); a larger shrink s goes bilinearly to k times the output,
# k = ceil(s / LINEAR_UP_TO), then averages k x k blocks: OpenCV's area resize by an integer
# factor is fast, by any other factor 5-8x slower (0.4-0.7 ms for a 224 output), and the two
# steps are closer to Pillow's antialiased resize than one area resize (W9's crops: median
# 49.4 against 47.3 dB)
LINEAR_UP_TO = 1.5


def _finish_array(
    cv2: Any, pixels: np.ndarray, box: tuple[int, int, int, int], size: tuple[int, int], flip: bool
) -> np.ndarray:
    """`_finish` for pixels decoded at full size (HWC), resized by OpenCV: about 3x faster than
    Pillow's antialiased bilinear resize."""
    top, left, h, w = box
    region = pixels[top : top + h, left : left + w]
    out_height, out_width = size
    blocks = math.ceil(max(h / out_height, w / out_width) / LINEAR_UP_TO)
    out = cv2.resize(region, (out_width * blocks, out_height * blocks), interpolation=cv2.INTER_LINEAR)
    if blocks > 1:
        out = cv2.resize(out, (out_width, out_height), interpolation=cv2.INTER_AREA)
    if flip:
        out = cv2.flip(out, 1)
    return _planes(cv2, out)


def _planes(cv2: Any, pixels: np.ndarray) -> np.ndarray:
    """HWC pixels as a CHW array: OpenCV's split writes each channel's plane straight into the
    array, 6x faster than numpy's strided copy of a transpose (0.007 against 0.043 ms)."""
    out = np.empty((pixels.shape[2], pixels.shape[0], pixels.shape[1]), np.uint8)
    planes = cv2.split(np.ascontiguousarray(pixels), list(out))
    if any(plane.ctypes.data != row.ctypes.data for plane, row in zip(planes, out)):
        return np.stack(planes)  # OpenCV chose to allocate its own planes
    return out


def jpeg_with_header(turbo: Any, source: Any) -> tuple[bytes | None, Any]:
    """(the bytes of a JPEG source, its header as libjpeg-turbo reads it); (None, None) for
    other sources, (bytes, None) for a JPEG whose header it refuses."""
    data = read_jpeg(source)
    if data is None:
        return None, None
    try:
        return data, turbo.decode_jpeg_header(data)
    except ValueError:
        return data, None


def fused_turbo(
    turbo: Any,
    data: bytes,
    header: tuple[Any, ...],
    box: tuple[int, int, int, int] | None,
    size: tuple[int, int],
    flip: bool,
) -> np.ndarray | None:
    """The libjpeg-turbo path of `decode_crop`; None for JPEGs it does not take (not YCbCr)."""
    full_height, full_width, colorspace = header[0], header[1], header[2]
    if colorspace not in ("YCbCr", "RGB"):
        return None
    top, left, h, w = box if box is not None else (0, 0, full_height, full_width)
    out_height, out_width = size
    reduction = reduction_for(h, w, out_height, out_width)
    cv2 = _cv2()
    partial = _turbojpeg() if cv2 is not None and reduction == 1 else None
    # a region decode stops at the crop's last row and would not notice a file cut short below
    # it: one without its end-of-image marker is decoded in full, which reports the truncation
    if partial is not None and data.rstrip(b"\x00")[-2:] == JPEG_END:
        region = partial.decode_region(data, top, left, h, w)
        if region is not None:
            return _finish_array(cv2, region, (0, 0, h, w), size, flip)
    pixels = turbo.decode_jpeg(
        data,
        colorspace="RGB",
        min_height=math.ceil(full_height / reduction),
        min_width=math.ceil(full_width / reduction),
    )
    if cv2 is not None and reduction == 1:
        return _finish_array(cv2, pixels, (top, left, h, w), size, flip)
    if cv2 is not None:
        return _finish_scaled(cv2, pixels, full_width, full_height, (top, left, h, w), size, flip)
    return _finish(_pil().fromarray(pixels), full_width, full_height, (top, left, h, w), size, flip)


def _finish_scaled(
    cv2: Any,
    pixels: np.ndarray,
    full_width: int,
    full_height: int,
    box: tuple[int, int, int, int],
    size: tuple[int, int],
    flip: bool,
) -> np.ndarray:
    """`_finish_array` for pixels decoded at a reduced DCT scale, where the box's edges fall
    between pixels: an affine warp samples the box exactly (bilinearly, to k times the output,
    k = ceil(shrink / LINEAR_UP_TO)), then k x k blocks are averaged, as `_finish_array`
    does. Pillow's resize with a fractional box took 0.95 ms, this 0.43 ms, at a PSNR against
    torchvision's pixels of 37.7 against 38.3 dB at worst (150 such crops of W9's files)."""
    top, left, h, w = box
    sx, sy = pixels.shape[1] / full_width, pixels.shape[0] / full_height
    box_width, box_height = w * sx, h * sy
    out_height, out_width = size
    blocks = math.ceil(max(box_height / out_height, box_width / out_width) / LINEAR_UP_TO)
    width, height = out_width * blocks, out_height * blocks
    ax, ay = box_width / width, box_height / height
    # output pixel j's centre (j + 0.5) lies at left * sx + (j + 0.5) * ax in edge coordinates,
    # 0.5 less in OpenCV's pixel-centre coordinates
    warp = np.array([[ax, 0.0, left * sx + 0.5 * ax - 0.5], [0.0, ay, top * sy + 0.5 * ay - 0.5]])
    out = cv2.warpAffine(
        pixels, warp, (width, height), flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP, borderMode=cv2.BORDER_REPLICATE
    )
    if blocks > 1:
        out = cv2.resize(out, (out_width, out_height), interpolation=cv2.INTER_AREA)
    if flip:
        out = cv2.flip(out, 1)
    return _planes(cv2, out)


def reduction_for(box_height: int, box_width: int, out_height: int, out_width: int) -> int:
    """The largest DCT reduction (8, 4, 2, else 1) at which a box of `box_height` x
    `box_width` keeps at least `out_height` x `out_width` pixels."""
    for reduction in REDUCTIONS:
        if box_width / reduction >= out_width and box_height / reduction >= out_height:
            return reduction
    return 1


def decode_crop(
    source: Any,
    box: tuple[int, int, int, int] | None,
    size: tuple[int, int],
    flip: bool = False,
    *,
    reduce: bool = True,
    image: Any = None,
) -> np.ndarray:
    """Decode `source`, crop `box`, resize it to `size` and flip it if asked: uint8, CHW.

    A JPEG is decoded at the smallest DCT scale that still gives the box at least `size`
    pixels, and the crop and resize are one bilinear (antialiased) pass.

    Args:
        source: The image: a path, bytes or a binary file object.
        box: (top, left, height, width) in the full image's pixels; None crops the
            whole image.
        size: The output's (height, width).
        flip: Flip the crop left-right. Defaults to False.
        reduce: Decode at a reduced DCT scale where the crop allows it; False decodes at
            full size (the reference the fused path is measured against).
            Defaults to True.
        image: `source` already opened as a PIL image, or None to open it.
            Defaults to None.

    Returns:
        The pixels, a uint8 array of shape (3, height, width).

    Raises:
        TypeError: when `source` is not a path, bytes or a binary file object.
        ImportError: when Pillow is needed and not installed.
        OSError: when the image cannot be opened or decoded (Pillow's errors, e.g.
            `PIL.UnidentifiedImageError`; `DecodeCrop` wraps them in `DecodeError`).
    """
    turbo = find_simplejpeg() if reduce else None
    if turbo is not None and image is None:
        data, header = jpeg_with_header(turbo, source)
        if data is not None:
            if header is not None:
                made = fused_turbo(turbo, data, header, box, size, flip)
                if made is not None:
                    return made
            source = data  # read once: Pillow decodes the same bytes
    img = open_image(source) if image is None else image
    full_width, full_height = img.size
    top, left, h, w = box if box is not None else (0, 0, full_height, full_width)
    out_height, out_width = size
    if reduce and img.format == "JPEG" and img.mode == "RGB":
        reduction = reduction_for(h, w, out_height, out_width)
        if reduction > 1:
            img.draft("RGB", (math.ceil(full_width / reduction), math.ceil(full_height / reduction)))
    if img.mode != "RGB":
        img = img.convert("RGB")
    return _finish(img, full_width, full_height, (top, left, h, w), size, flip)


def _finish(
    img: Any, full_width: int, full_height: int, box: tuple[int, int, int, int], size: tuple[int, int], flip: bool
) -> np.ndarray:
    """Crop `box` (in the full image's pixels) out of `img` (decoded at any scale), resize it
    to `size` in the same pass, flip it if asked: uint8 CHW."""
    Image = _pil()
    top, left, h, w = box
    sx, sy = img.size[0] / full_width, img.size[1] / full_height
    region = (left * sx, top * sy, (left + w) * sx, (top + h) * sy)
    out = img.resize((size[1], size[0]), Image.Resampling.BILINEAR, box=region)
    if flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.ascontiguousarray(np.asarray(out).transpose(2, 0, 1))


def _pair(size: int | Sequence[int], name: str) -> tuple[int, int]:
    accepted = "a positive int or (height, width)"
    if isinstance(size, bool):
        fail(TypeError, name, accepted, size)
    if isinstance(size, int):
        pair = (size, size)
    elif (
        isinstance(size, Sequence)
        and len(size) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in size)
    ):
        pair = (int(size[0]), int(size[1]))
    else:
        fail(TypeError, name, accepted, size)
    if min(pair) <= 0:
        fail(ValueError, name, accepted, size)
    return pair


def _range(value: Sequence[float], name: str, positive: bool, most: float | None = None) -> tuple[float, float]:
    accepted = f"(low, high) with {'0 < ' if positive else ''}low <= high{f' <= {most:g}' if most is not None else ''}"
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        fail(TypeError, name, accepted, value)
    if low > high or (positive and low <= 0) or (most is not None and high > most):
        fail(ValueError, name, accepted, value)
    return low, high


class DecodeCrop:
    """torchvision's ImageNet training transform fused into the JPEG decode: a drop-in for
    `Compose([RandomResizedCrop(size, scale, ratio), RandomHorizontalFlip(flip), ToTensor(),
    Normalize(mean, std)])` that returns uint8 CHW pixels (a numpy array; stoker.torch's and
    torch's collate make batches of them tensors) and leaves `ToTensor` and `Normalize` to
    the device: `stoker.torch.to_device(loader, device, transform=normalize(mean, std))`.
    Call it on a path, bytes or a binary file; `stoker.vision.ImageFolder(root,
    transform=DecodeCrop(224))` hands it each file's path.

    The same laws as torchvision's: the box is drawn as `RandomResizedCrop.get_params` draws
    it (`crop_box`: a share of the image's area uniform in `scale`, an aspect ratio
    log-uniform in `ratio`, width and height rounded, ten tries, then the centre crop of the
    largest box whose ratio is within `ratio`), then the flip with probability `flip`, in that
    order; the output is `size`. The draws come from
    another stream than torch's global RNG (see Randomness): the same law, other samples.

    The pixels: the box comes from the JPEG's header, and only what it needs is decoded (a
    region, or a DCT-scaled image when the box is at least twice the output each way); the
    resize is OpenCV's where installed. Against torchvision's pixels for the same box and
    flip (Pillow's full decode, crop, bilinear antialiased resize, flip) every crop is at
    least 35 dB PSNR (measured on 1,000 crops of real JPEGs at ImageNet's sizes: minimum 37.3 dB,
    median 49.9 dB; asserted in `tests/unit/test_vision.py`). One difference by design: a
    JPEG with an EXIF orientation is turned upright first (torchvision's loader ignores it).
    A PIL image given instead of a file (what torchvision's `ImageFolder` passes a
    transform) is cropped and resized exactly as torchvision does it: the same pixels.

    Randomness: from `generator` (a numpy Generator or an int seed) if given; inside a
    stoker worker's fetch, from `stoker.sample_rng()` (so a sample's crop depends on the
    seed, its index and the epoch, not on the worker count or kind, and resumes exactly);
    otherwise from numpy's global RNG. torchvision draws from torch's global RNG, seeded
    per worker, so its crops depend on which worker reads a sample.

    Args:
        size: The output's size: an int for a square, or (height, width).
            Defaults to 224.
        scale: The (low, high) range of the crop's share of the image's area, with
            0 < low <= high <= 1; SCALE is torchvision's (0.08, 1.0). Defaults to SCALE.
        ratio: The (low, high) range of the crop's aspect ratio (width / height), drawn
            log-uniformly, with 0 < low <= high; RATIO is torchvision's (3/4, 4/3).
            Defaults to RATIO.
        flip: The probability of a horizontal flip, in [0, 1]. Defaults to 0.5.
        generator: A `numpy.random.Generator` or an int seed to draw every crop from;
            None draws per sample inside a stoker worker's fetch (`stoker.sample_rng()`),
            else from numpy's global RNG. Defaults to None.

    Raises:
        TypeError: when `size` is not an int or an (int, int) pair, `scale` or `ratio` is
            not a pair of numbers, or `generator` is of another kind.
        ValueError: when `size` is not positive, `scale` or `ratio` is out of range, or
            `flip` is not a probability.
    """

    def __init__(
        self,
        size: int | Sequence[int] = 224,
        scale: Sequence[float] = SCALE,
        ratio: Sequence[float] = RATIO,
        flip: float = 0.5,
        *,
        generator: np.random.Generator | int | None = None,
    ) -> None:
        self.size = _pair(size, "size")
        self.scale = _range(scale, "scale", positive=True, most=1.0)
        self.ratio = _range(ratio, "ratio", positive=True)
        self.flip = check_number("flip", flip, low=0, high=1, unit="a probability")
        if generator is not None and not isinstance(generator, np.random.Generator):
            if isinstance(generator, bool) or not isinstance(generator, (int, np.integer)):
                fail(TypeError, "generator", "a numpy Generator, an int seed or None", generator)
            generator = np.random.default_rng(int(generator))
        self.generator = generator
        # import the decoders here, in the main process: forked workers inherit them instead of
        # each importing them (a quarter of a second of CPU for OpenCV) on their first image
        find_simplejpeg()
        _cv2()
        _turbojpeg()

    def _rng(self) -> Any:
        if self.generator is not None:
            return self.generator
        from .._core import seeding

        try:
            return seeding.sample_rng()
        except RuntimeError:  # outside a stoker fetch
            return np.random.mtrand._rand

    def __call__(self, source: Any) -> np.ndarray:
        """The crop of the image at `source`.

        Args:
            source: The image: a path, bytes or a binary file object (decoded only as far
                as the crop needs); or a PIL image already decoded (what torchvision's
                `ImageFolder` hands a `transform`), cropped and resized as torchvision's
                `RandomResizedCrop` does it, with the same pixels.

        Returns:
            The pixels, a uint8 array of shape (3, height, width) of `size`.

        Raises:
            TypeError: when `source` is not a path, bytes, a binary file object or a PIL
                image.
            DecodeError: when the file is not an image, or is empty, truncated or
                corrupt (also when Pillow is missing); the message names the file.
        """
        if _is_pil(source):
            return self._decoded(source)
        if not isinstance(source, (bytes, bytearray, memoryview, str, os.PathLike)) and not hasattr(source, "read"):
            raise TypeError(
                f"source should be a path, bytes, a binary file object or a PIL image, but got {type(source).__name__}"
            )
        try:
            return self._decode(source)
        except DecodeError:
            raise
        except Exception as exc:
            raise DecodeError(f"cannot decode {describe_source(source)}: {type(exc).__name__}: {exc}") from exc

    def _draw(self, height: int, width: int) -> tuple[tuple[int, int, int, int], bool]:
        """This sample's box and flip, drawn in torchvision's order: the box, then the flip."""
        rng = self._rng()
        if isinstance(rng, np.random.Generator):
            box = crop_box(height, width, rng, self.scale, self.ratio)
            return box, bool(rng.random() < self.flip)
        # numpy's legacy global RandomState
        box = crop_box(height, width, _Legacy(rng), self.scale, self.ratio)
        return box, bool(rng.random_sample() < self.flip)

    def _decoded(self, image: Any) -> np.ndarray:
        """torchvision's `resized_crop` + `hflip` on a decoded PIL image: crop the box, then a
        bilinear antialiased resize of the crop alone (Pillow's), then the flip."""
        Image = _pil()
        box, flip = self._draw(image.height, image.width)
        top, left, h, w = box
        if image.mode != "RGB":
            image = image.convert("RGB")
        out = image.crop((left, top, left + w, top + h)).resize((self.size[1], self.size[0]), Image.Resampling.BILINEAR)
        if flip:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return np.ascontiguousarray(np.asarray(out).transpose(2, 0, 1))

    def _decode(self, source: Any) -> np.ndarray:
        turbo = find_simplejpeg()
        data, header = jpeg_with_header(turbo, source) if turbo is not None else (None, None)
        img = None
        if data is not None and may_be_rotated(data):
            header = None  # EXIF orientation: decode in full and turn as exif_transpose does
        if header is not None:
            height, width = header[0], header[1]
        else:
            img = oriented(open_image(data if data is not None else source))
            width, height = img.size
        box, flip = self._draw(height, width)
        if header is not None:
            made = fused_turbo(turbo, data, header, box, self.size, flip)  # type: ignore[arg-type]
            if made is not None:
                return made
            img = open_image(data)
        return decode_crop(source, box, self.size, flip, image=img)

    def __repr__(self) -> str:
        return f"DecodeCrop(size={self.size}, scale={self.scale}, ratio={self.ratio}, flip={self.flip})"


def _is_pil(source: Any) -> bool:
    """Whether `source` is a PIL image (without importing Pillow when it is not loaded)."""
    module = sys.modules.get("PIL.Image")
    return module is not None and isinstance(source, module.Image)


def describe_source(source: Any) -> str:
    if isinstance(source, (str, os.PathLike)):
        return repr(os.fspath(source))
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"{len(source)} bytes of image data"
    return repr(getattr(source, "name", source))


_EXIF = b"Exif\x00\x00"


def may_be_rotated(data: bytes) -> bool:
    """Whether a JPEG carries EXIF (where an orientation lives): an APP1 segment that starts
    with it, among the segments before the first scan. Walking the segments' headers reads a
    few dozen bytes, where searching the first 64 KiB read most of a typical file (0.03 ms);
    a header that cannot be walked falls back to that search."""
    end, at = len(data), 2
    while at + 4 <= end:
        if data[at] != 0xFF:
            break  # not a marker where one should be: search instead
        marker = data[at + 1]
        if marker == 0xFF:  # a fill byte before the marker
            at += 1
            continue
        if marker in _STANDALONE:
            at += 2
            continue
        if marker in (0xDA, 0xD9):  # the first scan, or the end: no EXIF before it
            return False
        if marker == 0xE1 and data[at + 4 : at + 10] == _EXIF:
            return True
        at += 2 + (data[at + 2] << 8 | data[at + 3])
    return data.find(_EXIF, 0, 65536) >= 0


# markers without a length: SOI, TEM, RST0-7
_STANDALONE = frozenset([0xD8, 0x01, *range(0xD0, 0xD8)])


def oriented(img: Any) -> Any:
    """`img` turned upright as `ImageOps.exif_transpose` turns it (decoded), or as it is when
    its EXIF orientation is 1 or absent (still lazy)."""
    try:
        orientation = img.getexif().get(0x0112, 1)
    except Exception:  # unreadable EXIF: as the image is
        return img
    if orientation in (None, 1):
        return img
    from PIL import ImageOps

    return ImageOps.exif_transpose(img.convert("RGB") if img.mode not in ("RGB", "L") else img)


class _Legacy:
    """numpy's global RandomState with the Generator methods `crop_box` calls."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def uniform(self, low: float, high: float) -> float:
        return float(self.state.uniform(low, high))

    def integers(self, low: int, high: int) -> int:
        return int(self.state.randint(low, high))
