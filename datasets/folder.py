"""Folder pairs: ``images/`` + ``masks/`` with matching basenames (ECSSD, DUTS, PASCAL-S).

Masks may be 0/255 or 0/1 (any Pillow mode; 16-bit and float included); graded masks are
binarised at ``threshold`` (a fraction of the mask's full scale, 0.5 by default). The mask is
resized to the evaluation size with Pillow ``NEAREST`` before thresholding, exactly like
ecssd-dev's REFERENCE.md: ``convert('L').resize((224, 224), NEAREST) > 127``. Each sample
also carries the mask binarised at its original size (``Sample.original``), where
``segment-eval`` scores the peer metrics (fgIoU, acc, maxF).
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


def pair_by_stem(
    root: Path, images_dir: str, other_dir: str, other: str, kind: str, *, missing: str = "error",
    hint: str = "",
) -> list[tuple[str, Path, Path]]:
    """``(stem, image, other file)`` for the images of ``root/images_dir`` paired by basename
    with the masks or labels of ``root/other_dir`` (any image extension), sorted by stem.

    Args:
        other: what the second folder holds, singular ("mask", "label"), for the errors.
        kind: the kind of data set, for the errors ("folder-pair", "label-folder").
        missing: ``"error"``: a file without its partner raises a ``ValueError`` naming it;
            ``"skip"``: only the pairs are kept.
        hint: appended to the unpaired-file errors (e.g. how to skip them).
    """
    layout = f"{images_dir}/ and {other_dir}/ under its root"
    img_dir = require_dir(root / images_dir, f"the images of a {kind} data set ({layout})")
    oth_dir = require_dir(root / other_dir, f"the {other}s of a {kind} data set ({layout})")
    images = _by_stem(img_dir, IMAGE_EXTENSIONS)
    others = _by_stem(oth_dir, MASK_EXTENSIONS)
    if missing == "error":
        for have, lack, name, partner, where in ((others, images, other, "image", img_dir),
                                                  (images, others, "image", other, oth_dir)):
            lonely = sorted(set(have) - set(lack))
            if lonely:
                raise ValueError(
                    f"{have[lonely[0]]}: {'an' if name[0] in 'aeiou' else 'a'} {name} with no"
                    f" {partner} of the same stem in {where} ({len(lonely)} such {name}s){hint}"
                )
    stems = sorted(set(images) & set(others))
    if not stems:
        raise ValueError(f"{root}: no image/{other} pairs in {images_dir}/ and {other_dir}/")
    return [(s, images[s], others[s]) for s in stems]


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
        self.items = pair_by_stem(self.root, images_dir, masks_dir, "mask", "folder-pair",
                                  missing=missing, hint="; dataset.missing=skip evaluates only the pairs")
        self.threshold = float(threshold)

    def __len__(self) -> int:
        return len(self.items)

    def name(self, index: int) -> str:
        return self.items[self._check_index(index)][0]

    def mask(self, index: int) -> np.ndarray:
        """``(H, W)`` bool mask of item ``index`` at the evaluation size."""
        return self.masks(index)[0]

    def masks(self, index: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Item ``index``'s bool mask at the evaluation size and, when that is not its own
        size, at its original size (binarised there at ``threshold``; else ``None``)."""
        _, _, path = self.items[self._check_index(index)]
        im = open_image(path, "a mask image (0/255, 0/1 or graded)")
        if self.size is None or im.size == (self.size[1], self.size[0]):
            return mask_to_fraction(im) > self.threshold, None
        if im.mode not in ("L", "I", "I;16", "I;16B", "I;16L", "F"):
            im = im.convert("L")  # 1, P, RGB, RGBA, LA, CMYK ... as the reference reads them
        original = mask_to_fraction(im) > self.threshold
        return mask_to_fraction(im.resize((self.size[1], self.size[0]), Image.NEAREST)) > self.threshold, original

    def __getitem__(self, index: int) -> Sample:
        index = self._check_index(index)
        name, img_path, _ = self.items[index]
        target, original = self.masks(index)
        return Sample(name=name, image=load_rgb(img_path), target=target, original=original)
