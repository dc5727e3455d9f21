"""What every evaluation data set returns, and the shared file helpers.

A data set is a ``torch.utils.data.Dataset`` of :class:`Sample`: the original RGB image (the
backbone's own ``preprocess`` resizes and normalises it), the ground truth already at the
evaluation resolution, a stable name (for the metric cache and panels) and, where the set
has one, the class name (text-conditioned backbones use it as their prompt).

Ground truth resizing follows the published protocols: Pillow ``NEAREST`` to the
evaluation size (protocol §3: 224 x 224 labels), optionally after a centre square crop
(DiffSeg's multi-class protocol, §4), applied to image and labels alike.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

Task = Literal["binary", "multiclass"]
IGNORE_INDEX = 255
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


class DataError(ValueError):
    """A file of a data set that cannot be read as the set expects (named in the message);
    ``segment-eval`` reports it in one line and exits with the bad-input code."""


@dataclass
class Sample:
    """One evaluation item.

    Attributes:
        name: stable identifier, unique in the set (file stem, index, ``city/stem``).
        image: the RGB image at its original resolution (after the set's crop, if any).
        target: ground truth at the evaluation size ``(H, W)``: ``bool`` foreground for binary
            sets; ``int64`` class ids in ``[0, num_classes)`` with ``ignore_index`` (255) for
            unlabelled pixels for multi-class sets.
        class_name: the object's class in words (ImageNet-segmentation, COCO binary), or
            ``None`` where the set has none.
        original: binary sets that resize their masks: the bool ground truth at its
            original resolution (the peer metrics are scored there); ``None`` where
            ``target`` is already the original.
    """

    name: str
    image: Image.Image
    target: np.ndarray
    class_name: str | None = None
    original: np.ndarray | None = None


class SegmentationDataset(Dataset, abc.ABC):
    """Base class of the evaluation sets.

    Attributes:
        task: ``"binary"`` (foreground / background) or ``"multiclass"``.
        num_classes: 2 for binary sets; the number of ground-truth classes otherwise.
        ignore_index: label of unlabelled pixels (multi-class).
        class_names: the ``num_classes`` ground-truth classes' names for tables and panels;
            ``None``: none (tables number the classes). A binary set's per-image class (a
            text backbone's prompt) is :meth:`Sample.class_name`, not this.
        selection_keys: settings that choose which images are evaluated without changing any
            image's result (BSDS500's ``split``): left out of the metric cache's fingerprint.
        size: ``(H, W)`` evaluation size of the ground truth; ``None`` keeps its native size.
    """

    task: Task = "binary"
    num_classes: int = 2
    ignore_index: int = IGNORE_INDEX
    class_names: Sequence[str] | None = None
    selection_keys: tuple[str, ...] = ()

    def __init__(self, size: Sequence[int] | int | None = (224, 224)) -> None:
        self.size = parse_size(size)

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def name(self, index: int) -> str:
        """The name of item ``index``, without reading its files (for resuming)."""

    @abc.abstractmethod
    def __getitem__(self, index: int) -> Sample: ...

    def names(self) -> list[str]:
        return [self.name(i) for i in range(len(self))]

    def _check_index(self, index: int) -> int:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {type(self).__name__} of {n} items")
        return index % n


def parse_size(size: Sequence[int] | int | None) -> tuple[int, int] | None:
    """``224`` or ``[224, 224]`` -> ``(H, W)``; ``None`` stays ``None``."""
    if size is None:
        return None
    if isinstance(size, int):
        size = (size, size)
    size = tuple(int(s) for s in size)
    if len(size) != 2 or min(size) < 1:
        raise ValueError(f"size must be H or (H, W) with positive entries, got {size}")
    return size  # type: ignore[return-value]


def require_file(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a :class:`Path`; raises ``FileNotFoundError`` saying what was expected."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: expected {what}, but no such file exists")
    return p


def require_dir(path: str | os.PathLike, what: str) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"{p}: expected {what}, but no such folder exists")
    return p


def open_image(path: str | os.PathLike, what: str = "an image") -> Image.Image:
    """Open and fully decode an image file, with a clear error for missing/corrupt files
    (:class:`DataError` for a file Pillow cannot decode)."""
    p = require_file(path, what)
    try:
        im = Image.open(p)
        im.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise DataError(f"{p}: expected {what} that Pillow can decode ({e})") from e
    return im


def load_rgb(path: str | os.PathLike) -> Image.Image:
    """An image file as RGB (any mode in; EXIF orientation is not applied, as in the
    published protocols)."""
    return open_image(path, "an RGB image").convert("RGB")


def center_crop_box(width: int, height: int) -> tuple[int, int, int, int]:
    """The largest centred square, as a Pillow ``(left, top, right, bottom)`` box
    (offsets ``(side - min) // 2``, DiffSeg's crop)."""
    c = min(width, height)
    left, top = (width - c) // 2, (height - c) // 2
    return left, top, left + c, top + c


def resize_nearest(arr: np.ndarray, size: tuple[int, int] | None) -> np.ndarray:
    """Resize an ``(H, W)`` integer / bool array to ``size = (H', W')`` with Pillow
    ``NEAREST`` (the protocols' label resize); ``None`` returns it unchanged."""
    if size is None or tuple(arr.shape[:2]) == tuple(size):
        return arr
    dtype = arr.dtype
    if dtype == bool:
        im = Image.fromarray(arr.astype(np.uint8))
    elif arr.max(initial=0) <= 255 and arr.min(initial=0) >= 0:
        im = Image.fromarray(arr.astype(np.uint8))
    else:
        im = Image.fromarray(arr.astype(np.int32))  # mode "I"
    out = np.asarray(im.resize((size[1], size[0]), Image.NEAREST))
    return out.astype(dtype)


def describe(arr: np.ndarray) -> str:
    return f"shape {tuple(arr.shape)}, dtype {arr.dtype}"
