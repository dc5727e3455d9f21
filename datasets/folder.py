"""Folder pairs: ``images/`` + ``masks/`` with matching basenames (ECSSD, DUTS, PASCAL-S).

Masks may be 0/255 or 0/1 (any Pillow mode; 16-bit and float included); graded masks are
binarised at ``threshold`` (a fraction of the mask's full scale, 0.5 by default). The mask is
resized to the evaluation size with Pillow ``NEAREST`` before thresholding, exactly like
ecssd-dev's REFERENCE.md: ``convert('L').resize((224, 224), NEAREST) > 127``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from segment.datasets.base import (
    IMAGE_EXTENSIONS,
    SegmentationDataset,
    Sample,
    load_rgb,
    open_image,
    require_dir,
)

MASK_EXTENSIONS = (".png", ".bmp", ".tif", ".tiff", ".gif", ".jpg", ".jpeg", ".webp")


def _by_stem(folder: Path, extensions: Sequence[str]) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.suffix.lower() in extensions and not p.name.startswith("."):
            if p.stem in out:
                raise ValueError(f"{folder}: two files share the basename {p.stem!r}: {out[p.stem].name}, {p.name}")
            out[p.stem] = p
    return out


def mask_to_fraction(mask: Image.Image) -> np.ndarray:
    """A mask image as float64 ``(H, W)`` in ``[0, 1]`` (fraction of its full scale).

    8-bit modes are read through ``convert('L')``; masks whose values are all 0/1 are read as
    0/1, not 0/255. 16-bit and 32-bit integer masks scale by their type's maximum, float masks
    are taken as already in ``[0, 1]``.
    """
    if mask.mode in ("I;16", "I;16B", "I;16L"):
        arr = np.asarray(mask).astype(np.float64)
        return arr / 1.0 if arr.max(initial=0) <= 1 else arr / 65535.0
    if mask.mode == "I":
        arr = np.asarray(mask).astype(np.float64)
        top = arr.max(initial=0)
        return arr if top <= 1 else arr / (65535.0 if top <= 65535 else 2.0**31 - 1)
    if mask.mode == "F":
        return np.asarray(mask).astype(np.float64)
    arr = np.asarray(mask.convert("L")).astype(np.float64)
    return arr if arr.max(initial=0) <= 1 else arr / 255.0


class FolderPairs(SegmentationDataset):
    """Binary saliency / object masks from ``root/images`` and ``root/masks``.

    Args:
        root: folder holding ``images_dir`` and ``masks_dir``.
        size: evaluation size ``(H, W)`` of the masks; ``None`` keeps the native size.
        threshold: graded masks are foreground where ``value > threshold * full scale``.
        images_dir: sub-folder of the images.
        masks_dir: sub-folder of the masks (same basenames, any image extension).
        missing: ``"error"`` when an image has no mask (or a mask no image); ``"skip"`` keeps
            only the pairs.
    """

    task = "binary"
    num_classes = 2

    def __init__(
        self,
        root: str | os.PathLike,
        size: Sequence[int] | int | None = (224, 224),
        threshold: float = 0.5,
        images_dir: str = "images",
        masks_dir: str = "masks",
        missing: str = "error",
    ) -> None:
        super().__init__(size)
        if not 0.0 <= threshold < 1.0:
            raise ValueError(f"threshold must lie in [0, 1), got {threshold}")
        if missing not in ("error", "skip"):
            raise ValueError(f"missing must be 'error' or 'skip', got {missing!r}")
        self.root = require_dir(root, f"a folder with {images_dir}/ and {masks_dir}/")
        img_dir = require_dir(self.root / images_dir, "the images of a folder-pair data set")
        mask_dir = require_dir(self.root / masks_dir, "the masks of a folder-pair data set")
        images = _by_stem(img_dir, IMAGE_EXTENSIONS)
        masks = _by_stem(mask_dir, MASK_EXTENSIONS)
        unpaired = sorted(set(images) ^ set(masks))
        if unpaired and missing == "error":
            lonely = [str((images.get(s) or masks.get(s))) for s in unpaired[:5]]
            raise ValueError(
                f"{self.root}: expected every image in {images_dir}/ to have a mask with the same "
                f"basename in {masks_dir}/ and vice versa; {len(unpaired)} unpaired, e.g. {lonely} "
                f"(dataset.missing=skip evaluates only the pairs)"
            )
        stems = sorted(set(images) & set(masks))
        if not stems:
            raise ValueError(f"{self.root}: no image/mask pairs found in {images_dir}/ and {masks_dir}/")
        self.threshold = float(threshold)
        self.items = [(s, images[s], masks[s]) for s in stems]

    def __len__(self) -> int:
        return len(self.items)

    def name(self, index: int) -> str:
        return self.items[self._check_index(index)][0]

    def mask(self, index: int) -> np.ndarray:
        """``(H, W)`` bool mask of item ``index`` at the evaluation size."""
        _, _, path = self.items[self._check_index(index)]
        im = open_image(path, "a mask image (0/255, 0/1 or graded)")
        if self.size is not None and im.size != (self.size[1], self.size[0]):
            if im.mode not in ("L", "I", "I;16", "I;16B", "I;16L", "F"):
                im = im.convert("L")  # 1, P, RGB, RGBA, LA, CMYK ... as the reference reads them
            im = im.resize((self.size[1], self.size[0]), Image.NEAREST)
        return mask_to_fraction(im) > self.threshold

    def __getitem__(self, index: int) -> Sample:
        index = self._check_index(index)
        name, img_path, _ = self.items[index]
        return Sample(name=name, image=load_rgb(img_path), target=self.mask(index))
