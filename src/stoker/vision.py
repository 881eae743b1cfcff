"""Images for training: a fused JPEG decode-and-crop, and an `ImageFolder` without torchvision.

`DecodeCrop(224)` is `RandomResizedCrop(224)` + a random horizontal flip fused into the JPEG
decode: the crop box comes from the image's header, the JPEG is decoded at the smallest DCT
scale that still covers the crop at the output size, and the result is uint8 CHW (normalise
on the GPU with `stoker.torch.normalize`). Needs Pillow (`pip install stoker[vision]`).
`ImageFolder(root, transform=DecodeCrop(224))` with `to_device(loader, device,
transform=normalize(mean, std))` is the drop-in for torchvision's ImageNet training pipeline
(docs/guide/vision.md: the two lines to change, the laws, the PSNR bound).

`DecodeOnDevice(224)` draws the same crops and leaves the decoding to the GPU: the workers
ship each JPEG's bytes, box and flip (`collate_jpegs` makes one ragged buffer per batch) and
`to_device(loader, "cuda", transform=decode_jpegs(mean, std))` decodes them with nvJPEG.
"""

from ._vision.crop import DecodeCrop, crop_box, decode_crop
from ._vision.device_decode import DecodeOnDevice, JpegBatch, JpegCrop, collate_jpegs, decode_jpegs
from ._vision.errors import DecodeError
from ._vision.folder import IMG_EXTENSIONS, ImageFolder, find_classes, pil_loader

__all__ = [
    "IMG_EXTENSIONS",
    "DecodeCrop",
    "DecodeError",
    "DecodeOnDevice",
    "ImageFolder",
    "JpegBatch",
    "JpegCrop",
    "collate_jpegs",
    "crop_box",
    "decode_crop",
    "decode_jpegs",
    "find_classes",
    "pil_loader",
]
