"""BSDS500 (Arbelaez, Maire, Fowlkes, Malik, TPAMI 2011): photos with several human
segmentations each, scored as regions (protocol §4b: Covering, PRI, VI).

Layout (the January 2013 release, ``BSR/BSDS500/data``)::

    root/images/{train,val,test}/*.jpg
    root/groundTruth/{train,val,test}/*.mat

``scipy.io.loadmat(f)['groundTruth']`` is a ``(1, K)`` object array, one entry per annotator;
entry ``k``'s ``['Segmentation'][0, 0]`` is the ``(H, W)`` uint16 map of region ids (from 1),
the photo's size (481 x 321 or 321 x 481). A sample's ``target`` is the ``(K, H, W)`` int32
stack of the K segmentations at the photo's resolution (the official benchmark scores there).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from segment.datasets.base import (
    DataError,
    SegmentationDataset,
    Sample,
    describe,
    load_rgb,
    require_dir,
    require_file,
)

SPLITS = ("train", "val", "test")
GT_WHAT = "a BSDS500 ground-truth .mat (groundTruth: a 1 x K cell of structs with a Segmentation map)"


def parse_splits(split: str | Sequence[str]) -> list[str]:
    """``"val"``, ``"train,val"``, ``["train", "val"]`` or ``"all"`` -> the split names.

    ``"all"`` is every split of :data:`SPLITS`; :class:`BSDS500` keeps those present.
    """
    if isinstance(split, str):
        parts = [p.strip() for p in split.split(",") if p.strip()]
    else:
        parts = [str(p).strip() for p in split]
    if not parts:
        raise ValueError("dataset.split: name a split (train, val, test, all or a list of them)")
    if parts == ["all"]:
        return list(SPLITS)
    bad = [p for p in parts if p not in SPLITS]
    if bad:
        raise ValueError(f"dataset.split: unknown split {bad[0]!r}; choose from {', '.join(SPLITS)}, all"
                         " or a list of them (e.g. dataset.split=[train,val])")
    if len(set(parts)) != len(parts):
        raise ValueError(f"dataset.split: a split is named twice in {parts}")
    return parts


def read_segmentations(path: Path) -> np.ndarray:
    """The human segmentations of one ``.mat`` file as a ``(K, H, W)`` int32 array.

    Raises:
        FileNotFoundError: no such file.
        DataError: a file ``scipy.io.loadmat`` cannot read, or without the BSDS structure
            (named in the one-line message).
    """
    import scipy.io

    require_file(path, GT_WHAT)
    try:
        mat = scipy.io.loadmat(str(path))
    except (ValueError, TypeError, OSError, EOFError, IndexError, KeyError, NotImplementedError,
            zlib.error, scipy.io.matlab.MatReadError) as e:
        raise DataError(f"{path}: expected {GT_WHAT} that scipy.io.loadmat can read ({type(e).__name__}: {e})") from e
    cell = mat.get("groundTruth")
    if not isinstance(cell, np.ndarray) or cell.dtype != object or cell.size == 0:
        raise DataError(f"{path}: expected {GT_WHAT}; it has no groundTruth cell (variables: "
                        f"{', '.join(k for k in mat if not k.startswith('__')) or 'none'})")
    maps = []
    for k, entry in enumerate(cell.ravel()):
        try:
            seg = np.asarray(entry["Segmentation"][0, 0])
        except (ValueError, TypeError, IndexError, KeyError) as e:
            raise DataError(f"{path}: expected {GT_WHAT}; annotator {k + 1} has no Segmentation ({e})") from e
        if seg.ndim != 2 or seg.dtype.kind not in "iu" or seg.size == 0:
            raise DataError(f"{path}: expected {GT_WHAT}; the Segmentation of annotator {k + 1} is not a"
                            f" 2-D integer map ({describe(seg)})")
        if maps and seg.shape != maps[0].shape:
            raise DataError(f"{path}: the Segmentation of annotator {k + 1} is {seg.shape[1]}x{seg.shape[0]},"
                            f" annotator 1's is {maps[0].shape[1]}x{maps[0].shape[0]}")
        maps.append(seg.astype(np.int32))
    return np.stack(maps)


class BSDS500(SegmentationDataset):
    """The BSDS500 photos of one or more splits with their human segmentations.

    Items are sorted by split (in the order given) then by file stem; names are
    ``split/stem`` (unique across splits).

    Args:
        root: the folder holding ``images/`` and ``groundTruth/`` (``BSR/BSDS500/data``).
        split: ``train``, ``val``, ``test``, a list of them or ``all`` (every split folder
            present).
        images_dir, gt_dir: the two folders under ``root``.

    Raises:
        FileNotFoundError: a missing folder, or a photo without its ``.mat`` (named).
        ValueError: an unknown split, or no photo at all.
    """

    task = "regions"
    num_classes = 0  # regions are scored against human segmentations, not classes
    # settings that only choose the photos (names carry the split): segment-eval's metric
    # cache is shared by runs over different splits of the same output
    selection_keys = ("split",)

    def __init__(
        self,
        root: str | os.PathLike,
        split: str | Sequence[str] = "val",
        images_dir: str = "images",
        gt_dir: str = "groundTruth",
    ) -> None:
        super().__init__(None)
        self.root = require_dir(root, f"the BSDS500 folder with {images_dir}/ and {gt_dir}/")
        splits = parse_splits(split)
        if split == "all" or (not isinstance(split, str) and list(split) == ["all"]):
            splits = [s for s in splits if (self.root / images_dir / s).is_dir()]
            if not splits:
                raise FileNotFoundError(f"{self.root / images_dir}: expected split folders"
                                        f" ({', '.join(SPLITS)}), found none")
        self.splits = splits
        self.items: list[tuple[str, Path, Path]] = []
        for s in splits:
            img_dir = require_dir(self.root / images_dir / s, f"the BSDS500 {s} photos (*.jpg)")
            gt = require_dir(self.root / gt_dir / s, f"the BSDS500 {s} ground truth (*.mat)")
            for img in sorted(img_dir.glob("*.jpg"), key=lambda p: p.stem):
                mat = gt / f"{img.stem}.mat"
                if not mat.is_file():
                    raise FileNotFoundError(f"{mat}: expected the ground truth of {img} ({GT_WHAT}),"
                                            " but no such file exists")
                self.items.append((f"{s}/{img.stem}", img, mat))
        if not self.items:
            raise ValueError(f"{self.root}: no photos (*.jpg) in {images_dir}/{{{','.join(splits)}}}/")

    def __len__(self) -> int:
        return len(self.items)

    def name(self, index: int) -> str:
        return self.items[self._check_index(index)][0]

    def __getitem__(self, index: int) -> Sample:
        name, img_path, mat_path = self.items[self._check_index(index)]
        image = load_rgb(img_path)
        segs = read_segmentations(mat_path)
        if segs.shape[1:] != (image.size[1], image.size[0]):
            raise DataError(
                f"{mat_path}: the human segmentations are {segs.shape[2]}x{segs.shape[1]}, the photo"
                f" {img_path} is {image.size[0]}x{image.size[1]}"
            )
        return Sample(name=name, image=image, target=segs)
