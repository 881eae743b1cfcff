"""`ImageFolder`: torchvision's folder layout (root/class_name/image), class indices and
attributes, as a stoker `Dataset` that needs neither torch nor torchvision."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._data.datasets import Dataset
from .._data.shared_list import SharedList

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
"""The file extensions `ImageFolder` takes by default (torchvision's), matched case-insensitively."""


def pil_loader(path: str) -> Any:
    """The image at `path` as a PIL image in RGB (torchvision's default loader).

    Args:
        path: The image file.

    Returns:
        The decoded image, converted to RGB.

    Raises:
        ImportError: when Pillow is not installed.
        OSError: when the file cannot be read or is not an image.
    """
    from PIL import Image

    with open(path, "rb") as file:
        image = Image.open(file)
        return image.convert("RGB")


def _path(path: str) -> str:
    """The loader for a transform that decodes the file itself: the path, unread."""
    return path


def find_classes(root: str) -> tuple[list[str], dict[str, int]]:
    """The class folders under `root`, sorted, and their indices (torchvision's rule).

    Args:
        root: The dataset's folder, holding one folder per class.

    Returns:
        (classes, class_to_idx): the class names sorted, and each name's index.

    Raises:
        FileNotFoundError: when `root` holds no folder (or does not exist).
    """
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    if not classes:
        raise FileNotFoundError(
            f"ImageFolder found no class folder in {root!r} (it expects root/class_name/image files)"
        )
    return classes, {name: index for index, name in enumerate(classes)}


class ImageFolder(Dataset[tuple[Any, int]]):
    """Images in `root/<class>/**/<file>`: sample i is `(transform(loader(path)), class
    index)`, with class indices, `classes`, `class_to_idx`, `samples`, `targets` and `imgs` as
    torchvision's `ImageFolder` gives them (classes sorted; files sorted within each class,
    subfolders walked). `loader` defaults to a PIL RGB image, except when `transform` is a
    `stoker.vision.DecodeCrop`: then the file's path goes to the transform undecoded, so
    `ImageFolder(root, transform=DecodeCrop(224))` decodes only what the crop needs (as
    `loader=DecodeCrop(224)` does). `extensions` or `is_valid_file` (not both) choose the
    files. Paths are kept in a `SharedList`, not a list of Python strings, so workers do not
    copy them page by page as they are read.

    Args:
        root: The dataset's folder: `root/<class>/.../<file>`.
        transform: Called on each loaded image; its result is the sample. A `DecodeCrop`
            with no `loader` is given the file's path. Defaults to None.
        target_transform: Called on each class index. Defaults to None.
        loader: Turns a path into an image; None means `pil_loader` (a PIL RGB image), or
            the path itself when `transform` is a `DecodeCrop`. Defaults to None.
        is_valid_file: Says whether a path is an image to take; None takes the files
            whose extension is in `extensions`. Defaults to None.
        extensions: The file extensions to take (case-insensitive); None means
            `IMG_EXTENSIONS`. Defaults to None.

    Raises:
        ValueError: when both `extensions` and `is_valid_file` are given.
        FileNotFoundError: when `root` holds no class folder, or no valid file.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        loader: Callable[[str], Any] | None = None,
        is_valid_file: Callable[[str], bool] | None = None,
        extensions: Sequence[str] | None = None,
    ) -> None:
        root = os.fspath(root)
        if is_valid_file is not None and extensions is not None:
            raise ValueError("Both extensions and is_valid_file cannot be not None at the same time")
        if is_valid_file is None:
            allowed = tuple(e.lower() for e in (extensions if extensions is not None else IMG_EXTENSIONS))

            def is_valid_file(path: str) -> bool:
                return path.lower().endswith(allowed)

        self.root = root
        self.classes, self.class_to_idx = find_classes(root)
        paths: list[str] = []
        targets: list[int] = []
        for name in self.classes:
            folder = os.path.join(root, name)
            for directory, _, files in sorted(os.walk(folder, followlinks=True)):
                for file in sorted(files):
                    path = os.path.join(directory, file)
                    if is_valid_file(path):
                        paths.append(path)
                        targets.append(self.class_to_idx[name])
        if not paths:
            raise FileNotFoundError(f"ImageFolder found no valid image file under {root!r}")
        self._paths = SharedList(paths)
        self._targets = np.asarray(targets, dtype=np.int64)
        if loader is None:
            from .crop import DecodeCrop

            loader = _path if isinstance(transform, DecodeCrop) else pil_loader
        self.loader = loader
        self.transform = transform
        self.target_transform = target_transform

    def __len__(self) -> int:
        return len(self._targets)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        path, target = self._paths[index], int(self._targets[index])
        sample = self.loader(path)
        if self.transform is not None:
            sample = self.transform(sample)
        if self.target_transform is not None:
            return sample, self.target_transform(target)
        return sample, target

    @property
    def samples(self) -> list[tuple[str, int]]:
        """(path, class index) of every sample, in order (built on each access)."""
        return list(zip(self._paths, self._targets.tolist()))

    imgs = samples

    @property
    def targets(self) -> list[int]:
        """The class index of every sample, in order (built on each access)."""
        return self._targets.tolist()
