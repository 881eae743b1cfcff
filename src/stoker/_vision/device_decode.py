"""JPEGs decoded on the accelerator: the workers ship bytes and crop boxes, the GPU decodes.

```
 worker (DecodeOnDevice)                 worker (collate_jpegs)          to_device's copy stream
 ───────────────────────                 ──────────────────────          (decode_jpegs)
 read the file's bytes and header  ──▶   one JpegBatch per batch:  ──▶  nvJPEG decodes the batch
 draw box + flip from the sample's        data    uint8 (total,)         (torchvision's decode_jpeg
   seeded RNG (DecodeCrop's law)          offsets int64 (n + 1,)         on CUDA, or nvImageCodec),
 JpegCrop(bytes, box, flip, index)        boxes   int32 (n, 4)           then per image: crop (a
   (files nvJPEG should not take:         flips   bool (n,)              slice), bilinear
   decoded here, as DecodeCrop does,      pixels  uint8 (k, 3, H, W)     antialiased resize, flip;
   and shipped as pixels)                 ... numpy arrays: the arena    round, normalise: float
                                          carries them in shared memory  (n, 3, H, W)
```

The box and the flip are drawn in the worker from the sample's RNG exactly as `DecodeCrop`
draws them (`crop_box`, then one uniform for the flip), so a batch is the same for any worker
count and kind and resumes exactly; only the decoding moves. Without CUDA (device 'cpu'), or
with neither torchvision nor nvImageCodec, `decode_jpegs` decodes each box on the CPU with the
fused path of `crop.py`, taking the same choices `DecodeCrop` takes for each file, so its
pixels equal `DecodeCrop`'s for the same parameters (tested).

Stream safety follows `to_device`: the transform runs with the copy stream current, and every
kernel here is queued on it; torchvision's decoder works on a stream of its own and makes the
current stream wait for it before returning; the crops are allocated on the copy stream, and
`to_device` records its event after the transform and makes the consumer's stream wait on it.
The host batch (the arena's slot) stays referenced until that event has completed.

Files nvJPEG is not given: anything but a JPEG, JPEGs that are not YCbCr, RGB or greyscale,
and JPEGs whose EXIF orientation is not 1 are decoded in the worker (DecodeCrop's path), and
on the device a JPEG without its end-of-image marker (cut short, or with trailing data) is
decoded on the CPU, which reports a truncated file as `DecodeCrop` does: nvJPEG may decode a
truncated file without an error.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._base.checks import check_choice
from .._data.collate import empty
from .crop import (
    JPEG_END,
    RATIO,
    SCALE,
    DecodeCrop,
    DecodeError,
    decode_crop,
    describe_source,
    find_simplejpeg,
    fused_turbo,
    jpeg_with_header,
    may_be_rotated,
    open_image,
    oriented,
    read_jpeg,
)

DECODERS = ("auto", "cpu", "nvjpeg", "nvimgcodec")
_SHIPPED_COLORSPACES = ("YCbCr", "RGB", "Gray")  # what nvJPEG decodes to RGB as libjpeg does


# ------------------------------------------------------------------------ the worker side
@dataclass(frozen=True)
class JpegCrop:
    """One sample as `DecodeOnDevice` returns it: the JPEG's bytes and the crop to take, or the
    crop already decoded (for a file the device decoder is not given).

    Args:
        data: The file's bytes (uint8, one dimension); empty when `pixels` is set.
        box: (top, left, height, width) in the upright image's pixels.
        flip: Whether the crop is flipped left-right.
        size: The output's (height, width).
        name: The file (its path, quoted) or "N bytes of image data", for error messages.
        index: The sample's index in the dataset, -1 when it is not known (outside a
            map-style fetch). Defaults to -1.
        pixels: The crop decoded in the worker (uint8, (3, height, width)), or None.
            Defaults to None.
    """

    data: np.ndarray
    box: tuple[int, int, int, int]
    flip: bool
    size: tuple[int, int]
    name: str
    index: int = -1
    pixels: np.ndarray | None = None


def _sample_index() -> int:
    """The index of the map-style sample being fetched, else -1."""
    from .._core import seeding

    scope = seeding.current_scope()
    if scope is None or scope.tag != seeding.SAMPLE:
        return -1
    try:
        return int(scope.key)
    except (TypeError, ValueError):
        return -1


def _orientation(data: bytes) -> int:
    """The EXIF orientation of a JPEG (1 when absent or unreadable)."""
    try:
        value = open_image(data).getexif().get(0x0112, 1)
    except Exception:
        return 1
    return 1 if value is None else int(value)


def _upright_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) of a JPEG whose bytes nvJPEG is given, from its header alone; None for
    one that is decoded in the worker instead (unreadable header, CMYK, rotated by EXIF)."""
    turbo = find_simplejpeg()
    if turbo is not None:
        header = jpeg_with_header(turbo, data)[1]
        if header is None or header[2] not in _SHIPPED_COLORSPACES:
            return None
        if may_be_rotated(data) and _orientation(data) != 1:
            return None
        return int(header[0]), int(header[1])
    try:
        img = open_image(data)
    except Exception:
        return None
    if img.format != "JPEG" or img.mode not in ("RGB", "L"):
        return None
    if may_be_rotated(data) and _orientation(data) != 1:
        return None
    return int(img.height), int(img.width)


class DecodeOnDevice:
    """`DecodeCrop`'s random resized crop and flip, with the decoding left to the device: call
    it on a path or bytes (as `ImageFolder`'s `loader`) to get a `JpegCrop`, the file's bytes
    and the crop box and flip drawn from the sample's RNG exactly as `DecodeCrop` draws them.
    Batch the samples with `collate_jpegs` and decode them on the GPU with
    `to_device(loader, "cuda", transform=decode_jpegs(mean, std))`.

    Only the header is read here: a file whose header is corrupt raises `DecodeError` here
    (naming the file; the loader adds the sample's index); one whose body is corrupt raises it
    at decode, naming the file and the sample's index. Files the device decoder is not given
    (other formats, CMYK JPEGs, JPEGs turned by their EXIF orientation) are decoded here as
    `DecodeCrop` decodes them, and shipped as pixels.

    Args:
        size: The output's size: an int for a square, or (height, width).
            Defaults to 224.
        scale: The (low, high) range of the crop's share of the image's area, with
            0 < low <= high <= 1; SCALE is torchvision's (0.08, 1.0). Defaults to SCALE.
        ratio: The (low, high) range of the crop's aspect ratio (width / height), drawn
            log-uniformly; RATIO is torchvision's (3/4, 4/3). Defaults to RATIO.
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
        # the arguments are DecodeCrop's, checked by it; it also decodes the files kept here
        self._crop = DecodeCrop(size, scale, ratio, flip, generator=generator)
        self.size = self._crop.size
        self.scale = self._crop.scale
        self.ratio = self._crop.ratio
        self.flip = self._crop.flip
        self.generator = self._crop.generator

    def __call__(self, source: Any) -> JpegCrop:
        """The JPEG at `source` with its crop box and flip, not decoded.

        Args:
            source: The image: a path, bytes or a binary file object.

        Returns:
            A `JpegCrop`: the bytes, box and flip; or, for a file decoded here, the pixels.

        Raises:
            TypeError: when `source` is not a path, bytes or a binary file object.
            DecodeError: when the file cannot be read, is not an image or its header is
                corrupt (a file decoded here: also a corrupt body); the message names the
                file and, inside a loader's fetch, the sample's index.
        """
        if not isinstance(source, (bytes, bytearray, memoryview, str, os.PathLike)) and not hasattr(source, "read"):
            hint = ""
            if type(source).__module__.startswith("PIL."):
                hint = (
                    " (an image already decoded: DecodeOnDevice reads the file's bytes, so give it as "
                    "ImageFolder's loader=, not as its transform=)"
                )
            raise TypeError(
                f"source should be a path, bytes or a binary file object, but got {type(source).__name__}{hint}"
            )
        index = _sample_index()
        try:
            data = read_jpeg(source) if isinstance(source, (bytes, bytearray, memoryview, str, os.PathLike)) else None
            upright = _upright_size(data) if data is not None else None
            if data is None or upright is None:
                # DecodeCrop draws from the same RNG, untouched so far: the same crop as its own
                pixels = self._crop(source)
        except Exception as exc:
            cause = exc.__cause__ if isinstance(exc, DecodeError) and exc.__cause__ is not None else exc
            sample = f" (sample {index})" if index >= 0 else ""
            raise DecodeError(
                f"cannot decode {describe_source(source)}{sample}: {type(cause).__name__}: {cause}"
            ) from cause
        if data is None or upright is None:
            return JpegCrop(
                np.empty(0, np.uint8), (0, 0, 0, 0), False, self.size, describe_source(source), index, pixels
            )
        box, flip = self._draw(*upright)
        return JpegCrop(np.frombuffer(data, np.uint8), box, flip, self.size, describe_source(source), index)

    def _draw(self, height: int, width: int) -> tuple[tuple[int, int, int, int], bool]:
        """The box and the flip, drawn by `DecodeCrop`'s own draw (one law, one place)."""
        return self._crop._draw(height, width)

    def __repr__(self) -> str:
        return f"DecodeOnDevice(size={self.size}, scale={self.scale}, ratio={self.ratio}, flip={self.flip})"


# ----------------------------------------------------------------------- the batch
@dataclass(frozen=True, eq=False)
class JpegBatch:
    """A batch of `JpegCrop`s as one ragged buffer: numpy arrays, which cross from a worker
    process in the loader's shared-memory arena (no pickled bytes).

    Args:
        data: uint8 (total,): the JPEGs' bytes back to back.
        offsets: int64 (n + 1,): JPEG i is `data[offsets[i]:offsets[i + 1]]` (empty for a
            crop decoded in the worker).
        boxes: int32 (n, 4): each crop's (top, left, height, width).
        flips: bool (n,): which crops are flipped.
        indices: int64 (n,): each sample's dataset index (-1 where unknown).
        decoded: bool (n,): which crops the worker decoded; their pixels are in `pixels`,
            in order.
        pixels: uint8 (k, 3, height, width): the crops the worker decoded.
        names: Each sample's file, for error messages.
        size: The output's (height, width).
    """

    data: np.ndarray
    offsets: np.ndarray
    boxes: np.ndarray
    flips: np.ndarray
    indices: np.ndarray
    decoded: np.ndarray
    pixels: np.ndarray
    names: list[str]
    size: tuple[int, int]

    def __len__(self) -> int:
        return len(self.flips)

    def __eq__(self, other: object) -> bool:
        """Equal when every array, name and the size are."""
        if not isinstance(other, JpegBatch):
            return NotImplemented
        arrays = ("data", "offsets", "boxes", "flips", "indices", "decoded", "pixels")
        return (
            self.size == other.size
            and self.names == other.names
            and all(np.array_equal(getattr(self, a), getattr(other, a)) for a in arrays)
        )

    __hash__ = None  # type: ignore[assignment]

    def jpeg(self, i: int) -> np.ndarray:
        """The bytes of JPEG i, a view of `data`.

        Args:
            i: The sample's place in the batch.
        """
        return self.data[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def where(self, i: int) -> str:
        """Sample i named for an error message: its file, its index in the dataset, its place.

        Args:
            i: The sample's place in the batch.
        """
        index = int(self.indices[i])
        sample = f"sample {index}, " if index >= 0 else ""
        return f"{self.names[i]} ({sample}image {i} of the batch)"


def _collate_crops(crops: Sequence[JpegCrop], *, collate_fn_map: Any = None) -> JpegBatch:
    for i, crop in enumerate(crops):
        if not isinstance(crop, JpegCrop):
            raise TypeError(f"collate_jpegs: sample 0 is a JpegCrop but sample {i} is {type(crop).__name__}")
    size = crops[0].size
    n = len(crops)
    lengths = np.fromiter((len(c.data) for c in crops), np.int64, n)
    offsets = empty((n + 1,), np.int64)
    offsets[0] = 0
    np.cumsum(lengths, out=offsets[1:])
    data = empty((int(offsets[-1]),), np.uint8)
    boxes = empty((n, 4), np.int32)
    flips = empty((n,), np.bool_)
    indices = empty((n,), np.int64)
    decoded = empty((n,), np.bool_)
    kept = [c.pixels for c in crops if c.pixels is not None]
    pixels = empty((len(kept), 3, *size), np.uint8)
    for i, crop in enumerate(crops):
        if crop.size != size:
            raise ValueError(f"collate_jpegs: sample 0's crop size is {size} but sample {i}'s is {crop.size}")
        data[offsets[i] : offsets[i + 1]] = crop.data
        boxes[i] = crop.box
        flips[i] = crop.flip
        indices[i] = crop.index
        decoded[i] = crop.pixels is not None
    for k, made in enumerate(kept):
        pixels[k] = made
    return JpegBatch(data, offsets, boxes, flips, indices, decoded, pixels, [c.name for c in crops], size)


_maps: dict[int, Any] = {}


def collate_jpegs(samples: Sequence[Any]) -> Any:
    """torch's `default_collate` with every `JpegCrop` in the samples batched as one
    `JpegBatch` (the JPEGs' bytes back to back, their boxes and flips); the DataLoader's
    `collate_fn` for `DecodeOnDevice`. Labels and other fields become tensors as torch makes them.

    Args:
        samples: The batch's samples (e.g. `(JpegCrop, label)` pairs from `ImageFolder`).

    Returns:
        The batch: the samples' structure, each `JpegCrop` field a `JpegBatch`.

    Raises:
        TypeError: when a field holds a `JpegCrop` in one sample and not in another, or a
            type torch does not collate.
        ValueError: when the crops' sizes differ.
    """
    from .._data import torch_collate

    if torch_collate._deferring and "torch" not in sys.modules:
        base = torch_collate._torch_free_map
    else:
        base = torch_collate.default_collate_fn_map()
    extended = _maps.get(id(base))
    if extended is None:
        extended = _maps[id(base)] = {JpegCrop: _collate_crops, **base}
    return torch_collate.collate(samples, collate_fn_map=extended)


# ------------------------------------------------------------------------ the device side
def decode_box(data: Any, box: tuple[int, int, int, int], size: tuple[int, int], flip: bool) -> np.ndarray:
    """The crop `box` of the JPEG `data`, resized to `size` and flipped if asked, decoded on
    the CPU with the choices `DecodeCrop` makes for the same file (so the same pixels).

    Args:
        data: The JPEG's bytes (bytes or a uint8 array).
        box: (top, left, height, width) in the upright image's pixels.
        size: The output's (height, width).
        flip: Flip the crop left-right.

    Returns:
        uint8 (3, height, width).

    Raises:
        OSError, ValueError: what the decoders raise for a corrupt or truncated file.
    """
    data = bytes(data)
    turbo = find_simplejpeg()
    header = None
    if turbo is not None and not may_be_rotated(data):
        header = jpeg_with_header(turbo, data)[1]
    if header is not None:
        made = fused_turbo(turbo, data, header, box, size, flip)
        if made is not None:
            return made
        img = open_image(data)
    else:
        img = oriented(open_image(data))
    return decode_crop(data, box, size, flip, image=img)


def _decode_error(batch: JpegBatch, i: int, exc: BaseException) -> DecodeError:
    error = DecodeError(f"cannot decode {batch.where(i)}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def _cpu_crops(batch: JpegBatch, rows: Sequence[int]) -> np.ndarray:
    """uint8 (len(rows), 3, H, W): the crops of `rows` decoded on the CPU (or the worker's)."""
    out = np.empty((len(rows), 3, *batch.size), np.uint8)
    where_pixels = np.cumsum(batch.decoded) - 1
    for j, i in enumerate(rows):
        if batch.decoded[i]:
            out[j] = batch.pixels[where_pixels[i]]
            continue
        top, left, h, w = (int(v) for v in batch.boxes[i])
        try:
            out[j] = decode_box(batch.jpeg(i), (top, left, h, w), batch.size, bool(batch.flips[i]))
        except Exception as exc:
            raise _decode_error(batch, i, exc) from exc
    return out


def resize_crops(
    images: Sequence[Any], boxes: Any, flips: Any, size: tuple[int, int], out: Any, rows: Sequence[int]
) -> None:
    """Crop, resize and flip decoded images into `out` (float32, (n, 3, H, W)), on the tensors'
    device and current stream: `out[rows[j]]` is `images[j]`'s box `boxes[j]` (top, left, height,
    width), resized bilinearly with antialiasing, flipped where `flips[j]`; unrounded."""
    import torch
    from torch.nn import functional

    for j, image in enumerate(images):
        top, left, h, w = (int(v) for v in boxes[j])
        region = image[:3, top : top + h, left : left + w].unsqueeze(0).to(torch.float32)
        resized = functional.interpolate(region, size=size, mode="bilinear", align_corners=False, antialias=True)[0]
        out[rows[j]] = resized.flip(-1) if flips[j] else resized


Decoder = Callable[[list[Any]], list[Any]]


def _torchvision_decoder(device: Any) -> Decoder | None:
    try:
        from torchvision.io import ImageReadMode, decode_jpeg  # type: ignore[import-not-found, unused-ignore]
    except Exception:  # not installed, or built for another torch
        return None

    def decode(tensors: list[Any]) -> list[Any]:
        return list(decode_jpeg(tensors, mode=ImageReadMode.RGB, device=device))

    return decode


def _nvimgcodec_decoder(device: Any) -> Decoder | None:
    try:
        from nvidia import nvimgcodec  # type: ignore[import-not-found, unused-ignore]
    except Exception:
        return None
    import torch

    decoders: dict[int, Any] = {}
    lock = threading.Lock()

    def decode(tensors: list[Any]) -> list[Any]:
        with lock:
            decoder = decoders.get(device.index)
            if decoder is None:
                decoder = decoders[device.index] = nvimgcodec.Decoder(device_id=device.index)
        stream = torch.cuda.current_stream(device)
        images = decoder.decode([t.numpy() for t in tensors], cuda_stream=stream.cuda_stream)
        out = []
        for k, image in enumerate(images):
            if image is None:
                raise RuntimeError(f"nvImageCodec could not decode image {k} of the batch")
            out.append(torch.as_tensor(image, device=device).permute(2, 0, 1))
        return out

    return decode


def _decode_all(decoder: Decoder, tensors: list[Any], batch: JpegBatch, rows: Sequence[int]) -> list[Any]:
    """`decoder(tensors)`; when the batch fails, each JPEG alone, to name the one that fails."""
    try:
        return decoder(tensors)
    except Exception as exc:
        batch_error = exc
    for tensor, i in zip(tensors, rows):
        try:
            decoder([tensor])
        except Exception as exc:
            raise _decode_error(batch, i, exc) from batch_error
    raise batch_error


def _host_tensor(array: np.ndarray) -> Any:
    import torch

    if not array.flags.writeable:  # an arena view may be read-only; torch wants writable memory
        array = array.copy()
    return torch.from_numpy(array)


_warned = False


class _DecodeJpegs:
    """The transform `decode_jpegs` returns: every `JpegBatch` in a batch becomes its crops."""

    def __init__(self, device: Any, decoder: str, finish: Callable[[Any], Any]) -> None:
        self.device = device
        self.decoder = decoder
        self.finish = finish
        self._made: dict[Any, tuple[str, Decoder | None]] = {}

    def _where(self) -> Any:
        import torch

        if self.device is not None:
            return self.device
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _backend(self, device: Any) -> tuple[str, Decoder | None]:
        made = self._made.get(device)
        if made is not None:
            return made
        global _warned
        if device.type != "cuda" or self.decoder == "cpu":
            made = ("cpu", None)
        else:
            makers = {"nvjpeg": _torchvision_decoder, "nvimgcodec": _nvimgcodec_decoder}
            names = ("nvjpeg", "nvimgcodec") if self.decoder == "auto" else (self.decoder,)
            made = ("cpu", None)
            for name in names:
                found = makers[name](device)
                if found is not None:
                    made = (name, found)
                    break
            else:
                if self.decoder != "auto":
                    raise RuntimeError(
                        f"decode_jpegs(decoder={self.decoder!r}) needs "
                        f"{'torchvision (with CUDA)' if self.decoder == 'nvjpeg' else 'nvImageCodec (nvidia-nvimgcodec)'}, "
                        f"which does not import here"
                    )
                if not _warned:
                    _warned = True
                    warnings.warn(
                        "decode_jpegs: neither torchvision nor nvImageCodec imports here; JPEGs are "
                        "decoded on the CPU in the main process and copied to the GPU",
                        RuntimeWarning,
                        stacklevel=3,
                    )
        self._made[device] = made
        return made

    def decode(self, batch: JpegBatch) -> Any:
        """The crops of one `JpegBatch`: (n, 3, H, W) on the device, through `finish`."""
        device = self._where()
        name, decoder = self._backend(device)
        if name == "cpu" or decoder is None:
            crops = _host_tensor(_cpu_crops(batch, range(len(batch))))
            return self.finish(crops.to(device))
        return self.finish(self._on_device(batch, decoder, device))

    def _on_device(self, batch: JpegBatch, decoder: Decoder, device: Any) -> Any:
        import torch

        n = len(batch)
        out = torch.empty((n, 3, *batch.size), dtype=torch.float32, device=device)
        gpu_rows, cpu_rows = [], []
        for i in range(n):
            if not batch.decoded[i] and bytes(batch.jpeg(i)[-2:]) == JPEG_END:
                gpu_rows.append(i)
            else:  # decoded in the worker; or cut short (nvJPEG might not say so)
                cpu_rows.append(i)
        if gpu_rows:
            tensors = [_host_tensor(batch.jpeg(i)) for i in gpu_rows]
            images = _decode_all(decoder, tensors, batch, gpu_rows)
            resize_crops(images, batch.boxes[gpu_rows], batch.flips[gpu_rows], batch.size, out, gpu_rows)
            del images
            out.round_().clamp_(0, 255)
        if cpu_rows:
            crops = _host_tensor(_cpu_crops(batch, cpu_rows)).to(device, non_blocking=True)
            out[torch.as_tensor(cpu_rows, device=device)] = crops.to(torch.float32)
        return out.to(torch.uint8)

    def __repr__(self) -> str:
        return f"decode_jpegs(device={self.device}, decoder={self.decoder!r})"

    def __call__(self, batch: Any) -> Any:
        from .._core.pin import WALK, map_batch

        return map_batch(batch, lambda obj: self.decode(obj) if isinstance(obj, JpegBatch) else WALK)


def decode_jpegs(
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    *,
    scale: float = 255.0,
    dtype: Any = None,
    device: Any = None,
    decoder: str = "auto",
) -> Callable[[Any], Any]:
    """A `to_device` transform: every `JpegBatch` in a batch (`DecodeOnDevice` +
    `collate_jpegs`) becomes its crops, (n, 3, height, width) on the device, normalised as
    `normalize(mean, std)` normalises uint8 (or uint8 when `mean` and `std` are None).

    On a CUDA device the JPEGs are decoded as one batch by nvJPEG (torchvision's
    `decode_jpeg(..., device=...)`, else nvImageCodec), then each box is cropped, resized
    (bilinear, antialiased) and flipped there, on the stream `to_device` runs it on; pixels
    differ from the CPU path's by the decoders' rounding (nvJPEG's IDCT and chroma upsampling
    are not libjpeg-turbo's). On the CPU, each box is decoded by the fused CPU path, with the
    same pixels as `DecodeCrop` for the same parameters.

    Args:
        mean: One mean per channel, in the scaled units; None (with `std` None): return
            uint8 crops. Defaults to None.
        std: One standard deviation per channel, none of them zero. Defaults to None.
        scale: What the uint8 values are divided by first. Defaults to 255.0.
        dtype: The torch dtype of normalised crops; None: `torch.float32`. Defaults to None.
        device: Where to decode: a `torch.device` or a string; None: the current CUDA device
            (the one `to_device` makes current) where CUDA is available, else the CPU.
            Defaults to None.
        decoder: 'auto' (nvJPEG through torchvision, else nvImageCodec, else the CPU, with a
            warning, on CUDA), 'cpu', 'nvjpeg' or 'nvimgcodec'; on a CPU device every
            choice decodes on the CPU. Defaults to 'auto'.

    Returns:
        The transform, a function of one batch, for `to_device(..., transform=...)`.

    Raises:
        ValueError: when only one of `mean` and `std` is given, they differ in length, `std`
            holds a zero, `scale` is not positive, or `decoder` is not one of 'auto',
            'cpu', 'nvjpeg' and 'nvimgcodec';
            the transform raises `DecodeError` for a JPEG it cannot decode, naming the file,
            the sample's index and its place in the batch, and RuntimeError when the decoder
            named cannot be imported.
    """
    import torch

    from .._core.torch_place import normalize

    check_choice("decoder", decoder, DECODERS)
    if (mean is None) != (std is None):
        raise ValueError(f"mean and std should both be given or both be None, but got mean={mean!r}, std={std!r}")
    if mean is None:

        def finish(crops: Any) -> Any:
            return crops
    else:
        norm = normalize(mean, std, scale=scale, dtype=dtype)  # type: ignore[arg-type]

        def finish(crops: Any) -> Any:
            return norm(crops)

    where = None if device is None else torch.device(device)
    transform = _DecodeJpegs(where, decoder, finish)
    return transform
