"""The multi-class sets of the DiffSeg protocol (protocol §4): COCO-Stuff-27, Cityscapes-27
and any label folder (``images/`` + ``labels/``, e.g. CamVid).

COCO-Stuff-27 and Cityscapes-27 follow the unsupervised-segmentation convention (PiCIE, STEGO, DiffSeg): the image and
its labels are centre-cropped to the largest square, labels are resized with ``NEAREST`` to
the evaluation size, and unlabelled pixels are 255 (ignored by the metrics).

- **COCO-Stuff-27**: the ``stuffthingmaps`` PNGs (pixel = COCO category id - 1 in 0..181,
  255 = unlabelled) mapped to 27 coarse classes (12 thing and 15 stuff super-categories) by
  the fine-to-coarse table below; evaluated on the curated list of 2,175 val2017 images
  (``Coco164kFull_Stuff_Coarse_7.txt``, from the IIC / PiCIE / STEGO / DiffSeg releases).
- **Cityscapes-27**: ``gtFine`` ``*_labelIds.png`` with labelIds 7-33 -> classes 0-26, all
  other ids -> 255.
- **Label folders** (:class:`LabelFolder`): class-id (or colour-coded) PNGs paired with the
  images by stem, evaluated by default at the label resolution with no crop.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from segment.datasets.base import (
    IGNORE_INDEX,
    DataError,
    SegmentationDataset,
    Sample,
    center_crop_box,
    describe,
    load_rgb,
    open_image,
    require_dir,
    require_file,
    resize_nearest,
)

COCOSTUFF27_CLASSES = (
    # things (COCO super-categories)
    "electronic", "appliance", "food", "furniture", "indoor", "kitchen", "accessory",
    "animal", "outdoor", "person", "sports", "vehicle",
    # stuff (COCO-Stuff super-categories)
    "ceiling", "floor", "food-stuff", "furniture-stuff", "raw-material", "textile", "wall",
    "window", "building", "ground", "plant", "sky", "solid", "structural", "water",
)

# COCO-Stuff fine index (category id - 1, 0..181) -> coarse class (0..26), the table used by
# IIC, PiCIE, STEGO and DiffSeg. Indices of ids absent from COCO follow their neighbours.
COCOSTUFF_FINE_TO_COARSE = (
    9, 11, 11, 11, 11, 11, 11, 11, 11, 8, 8, 8, 8, 8, 8, 7, 7, 7, 7, 7,  # fine 0-19
    7, 7, 7, 7, 7, 6, 6, 6, 6, 6, 6, 6, 6, 10, 10, 10, 10, 10, 10, 10,  # fine 20-39
    10, 10, 10, 5, 5, 5, 5, 5, 5, 5, 5, 2, 2, 2, 2, 2, 2, 2, 2, 2,  # fine 40-59
    2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 0, 0, 0, 0, 0, 0, 1, 1, 1,  # fine 60-79
    1, 1, 1, 4, 4, 4, 4, 4, 4, 4, 4, 17, 17, 22, 20, 20, 22, 15, 25, 16,  # fine 80-99
    13, 12, 12, 17, 17, 23, 15, 15, 17, 15, 21, 15, 25, 13, 13, 13, 13, 13, 22, 26,  # fine 100-119
    14, 14, 15, 22, 21, 21, 24, 20, 22, 15, 17, 16, 15, 22, 24, 21, 17, 25, 16, 21,  # fine 120-139
    17, 22, 16, 21, 21, 25, 21, 26, 21, 24, 20, 17, 14, 21, 26, 15, 23, 20, 21, 24,  # fine 140-159
    15, 24, 22, 25, 15, 20, 17, 17, 22, 14, 18, 18, 18, 18, 18, 18, 18, 26, 26, 19,  # fine 160-179
    19, 24,  # fine 180-181
)
assert len(COCOSTUFF_FINE_TO_COARSE) == 182

CITYSCAPES27_CLASSES = (
    "road", "sidewalk", "parking", "rail track", "building", "wall", "fence", "guard rail",
    "bridge", "tunnel", "pole", "polegroup", "traffic light", "traffic sign", "vegetation",
    "terrain", "sky", "person", "rider", "car", "truck", "bus", "caravan", "trailer", "train",
    "motorcycle", "bicycle",
)
CITYSCAPES_FIRST_ID = 7  # labelIds 7..33 -> classes 0..26


def _lut(mapping: dict[int, int]) -> np.ndarray:
    """A 256-entry lookup table: defined entries as given, all others -1 (= invalid)."""
    lut = np.full(256, -1, dtype=np.int64)
    for k, v in mapping.items():
        lut[k] = v
    return lut


COCOSTUFF27_LUT = _lut({**dict(enumerate(COCOSTUFF_FINE_TO_COARSE)), IGNORE_INDEX: IGNORE_INDEX})
CITYSCAPES27_LUT = np.where(
    (np.arange(256) >= CITYSCAPES_FIRST_ID) & (np.arange(256) < CITYSCAPES_FIRST_ID + 27),
    np.arange(256) - CITYSCAPES_FIRST_ID,
    IGNORE_INDEX,
).astype(np.int64)


def read_label_png(path: Path, what: str) -> np.ndarray:
    """An ``(H, W)`` uint8 label map from a PNG (L or P mode; RGB only when grey)."""
    im = open_image(path, what)
    arr = np.asarray(im)
    if arr.ndim == 3:
        if arr.shape[2] >= 3 and (arr[..., 0] == arr[..., 1]).all() and (arr[..., 0] == arr[..., 2]).all():
            arr = arr[..., 0]
        else:
            raise DataError(f"{path}: expected {what} with one channel, got {describe(arr)}")
    if arr.dtype != np.uint8:
        if arr.min(initial=0) < 0 or arr.max(initial=0) > 255:
            raise DataError(f"{path}: expected {what} with values in 0..255, got {describe(arr)}")
        arr = arr.astype(np.uint8)
    return arr


class _CroppedLabels(SegmentationDataset):
    """Shared logic: (image path, label path) pairs, centre crop, LUT, nearest resize."""

    task = "multiclass"
    lut: np.ndarray
    label_what = "a label PNG"

    def __init__(self, size, crop: str) -> None:
        super().__init__(size)
        if crop not in ("none", "center"):
            raise ValueError(f"crop must be 'none' or 'center', got {crop!r}")
        self.crop = crop
        self.items: list[tuple[str, Path, Path]] = []

    def __len__(self) -> int:
        return len(self.items)

    def name(self, index: int) -> str:
        return self.items[self._check_index(index)][0]

    def read_raw(self, path: Path) -> np.ndarray:
        """The label file as an ``(H, W)`` uint8 array of raw values (before the LUT)."""
        return read_label_png(path, self.label_what)

    def labels(self, raw: np.ndarray, path: Path) -> np.ndarray:
        out = self.lut[raw]
        if (out < 0).any():
            bad = np.unique(raw[out < 0])
            raise DataError(f"{path}: expected {self.label_what}, found unexpected values {bad[:10].tolist()}")
        return out

    def __getitem__(self, index: int) -> Sample:
        index = self._check_index(index)
        name, img_path, lab_path = self.items[index]
        image = load_rgb(img_path)
        raw = self.read_raw(lab_path)
        if raw.shape != (image.size[1], image.size[0]):
            raise DataError(
                f"{lab_path}: labels are {raw.shape[1]}x{raw.shape[0]}, the image {img_path} is "
                f"{image.size[0]}x{image.size[1]}"
            )
        if self.crop == "center":
            box = center_crop_box(*image.size)
            image = image.crop(box)
            raw = raw[box[1] : box[3], box[0] : box[2]]
        target = self.labels(resize_nearest(raw, self.size), lab_path)
        return Sample(name=name, image=image, target=target)


class CocoStuff27(_CroppedLabels):
    """COCO-Stuff with 27 coarse classes on the curated val2017 list (DiffSeg / STEGO layout).

    Args:
        root: the COCO-Stuff folder.
        split: ``val2017`` (or ``train2017``).
        image_list: the curated id list, relative to ``root`` (one image id per line).
        images_dir: image folder relative to ``root`` (``{split}`` is filled in).
        labels_dir: ``stuffthingmaps`` folder relative to ``root``.
        size: evaluation size ``(H, W)``; ``None`` keeps the (cropped) native size.
        crop: ``"center"`` (DiffSeg) or ``"none"``.
        expected: number of images the list should hold (2,175 for the curated val list);
            a different count warns. ``None`` disables the check.
    """

    num_classes = 27
    class_names = COCOSTUFF27_CLASSES
    lut = COCOSTUFF27_LUT
    label_what = "a COCO-Stuff stuffthingmap (fine ids 0..181, 255 unlabelled)"

    def __init__(
        self,
        root: str | os.PathLike,
        split: str = "val2017",
        image_list: str | None = "curated/{split}/Coco164kFull_Stuff_Coarse_7.txt",
        images_dir: str = "images/{split}",
        labels_dir: str = "annotations/{split}",
        size: Sequence[int] | int | None = (512, 512),
        crop: str = "center",
        expected: int | None = 2175,
    ) -> None:
        super().__init__(size, crop)
        self.root = require_dir(root, "the COCO-Stuff folder")
        img_dir = require_dir(self.root / images_dir.format(split=split), f"COCO {split} images")
        lab_dir = require_dir(
            self.root / labels_dir.format(split=split), f"COCO-Stuff {split} stuffthingmaps (PNG)"
        )
        if image_list is not None:
            list_path = require_file(
                self.root / image_list.format(split=split),
                "the curated image list (one id per line; Coco164kFull_Stuff_Coarse_7.txt from the "
                "IIC/STEGO/DiffSeg releases)",
            )
            ids = [ln.strip() for ln in list_path.read_text().splitlines() if ln.strip()]
            if expected is not None and len(ids) != expected:
                warnings.warn(f"{list_path}: {len(ids)} image ids, the curated list has {expected}", stacklevel=2)
        else:
            ids = sorted(p.stem for p in lab_dir.glob("*.png"))
        if not ids:
            raise ValueError(f"{self.root}: no images to evaluate")
        for i in ids:
            self.items.append((i, img_dir / f"{i}.jpg", lab_dir / f"{i}.png"))
        missing = [str(p) for _, a, b in self.items for p in (a, b) if not p.is_file()]
        if missing:
            raise FileNotFoundError(
                f"{len(missing)} files of the COCO-Stuff list are missing, e.g. {missing[:3]} "
                f"(expected images as {images_dir}/ID.jpg and labels as {labels_dir}/ID.png under {self.root})"
            )


class Cityscapes27(_CroppedLabels):
    """Cityscapes with the 27 classes of labelIds 7-33 (DiffSeg / STEGO), others ignored.

    Args:
        root: the Cityscapes folder with ``leftImg8bit/`` and ``gtFine/``.
        split: ``val`` (or ``train``).
        size: evaluation size ``(H, W)``; ``None`` keeps the (cropped) native size.
        crop: ``"center"`` (DiffSeg) or ``"none"``.
    """

    num_classes = 27
    class_names = CITYSCAPES27_CLASSES
    lut = CITYSCAPES27_LUT
    label_what = "a Cityscapes gtFine labelIds PNG"

    def __init__(
        self,
        root: str | os.PathLike,
        split: str = "val",
        size: Sequence[int] | int | None = (512, 512),
        crop: str = "center",
    ) -> None:
        super().__init__(size, crop)
        self.root = require_dir(root, "the Cityscapes folder (leftImg8bit/, gtFine/)")
        img_root = require_dir(self.root / "leftImg8bit" / split, f"Cityscapes leftImg8bit/{split}")
        gt_root = require_dir(self.root / "gtFine" / split, f"Cityscapes gtFine/{split}")
        for img in sorted(img_root.glob("*/*_leftImg8bit.png")):
            stem = img.name[: -len("_leftImg8bit.png")]
            lab = gt_root / img.parent.name / f"{stem}_gtFine_labelIds.png"
            if not lab.is_file():
                raise FileNotFoundError(f"{lab}: expected the gtFine labelIds of {img}")
            self.items.append((f"{img.parent.name}/{stem}", img, lab))
        if not self.items:
            raise ValueError(f"{img_root}: expected CITY/*_leftImg8bit.png images, found none")


class LabelFolder(_CroppedLabels):
    """Any multi-class set laid out as ``root/images/*`` + ``root/labels/*``, paired by stem.

    Labels are class-id PNGs (``0 .. num_classes - 1``, ``ignore_index`` for unlabelled
    pixels; L or P mode, or RGB with equal channels), or RGB-coded PNGs read through a
    colour table (``colors``). The ignore value of the files becomes
    :data:`~segment.datasets.base.IGNORE_INDEX` (255) in :attr:`Sample.target`, the project's
    convention. By default the set is evaluated at the label resolution with no crop
    (protocol §4, label folders); CamVid is ``configs/dataset/camvid.yaml``.

    Args:
        root: folder holding ``images_dir`` and ``labels_dir``.
        num_classes: ``K``, the number of classes.
        ignore_index: the label value of unlabelled pixels in the files (not a class).
        class_names: ``K`` names (tables and panels); ``None`` = no names.
        colors: ``K`` RGB triples, the colour of each class in RGB-coded label PNGs;
            ``None`` = the files hold class ids.
        ignore_color: with ``colors``, the RGB colour of unlabelled pixels (``None``: every
            pixel must have a class colour).
        size: evaluation size ``(H, W)`` of the labels (Pillow ``NEAREST``); ``None`` keeps
            the label resolution.
        crop: ``"none"`` or ``"center"`` (largest centred square, image and labels alike).
        images_dir: sub-folder of the images.
        labels_dir: sub-folder of the labels (same stems, any image extension).

    Raises:
        ValueError: a label with no image, an image with no label (both name the file), two
            files of one stem, bad knobs; while reading an item, a label whose size differs
            from its image's, or a value (colour) that is neither a class nor the ignore
            value (names the file and the values).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        num_classes: int,
        ignore_index: int = IGNORE_INDEX,
        class_names: Sequence[str] | None = None,
        colors: Sequence[Sequence[int]] | None = None,
        ignore_color: Sequence[int] | None = None,
        size: Sequence[int] | int | None = None,
        crop: str = "none",
        images_dir: str = "images",
        labels_dir: str = "labels",
    ) -> None:
        from segment.datasets.folder import pair_by_stem

        super().__init__(size, crop)
        k = int(num_classes)
        if not 1 <= k <= 255:
            raise ValueError(f"num_classes must lie in 1..255 (8-bit label PNGs), got {num_classes}")
        ignore = int(ignore_index)
        if not 0 <= ignore <= 255 or ignore < k:
            raise ValueError(
                f"ignore_index must lie in {k}..255 (a value that is not a class id), got {ignore_index}"
            )
        self.num_classes = k
        self.source_ignore = ignore
        if class_names is not None:
            names = tuple(str(c) for c in class_names)
            if len(names) != k:
                raise ValueError(f"class_names has {len(names)} names for num_classes={k}")
            self.class_names = names
        self.colors = None
        if colors is not None:
            table = [tuple(int(v) for v in c) for c in colors]
            if len(table) != k or any(len(c) != 3 or not all(0 <= v <= 255 for v in c) for c in table):
                raise ValueError(f"colors must be {k} RGB triples in 0..255 (one per class), got {list(colors)}")
            if ignore_color is not None:
                ic = tuple(int(v) for v in ignore_color)
                if len(ic) != 3 or not all(0 <= v <= 255 for v in ic):
                    raise ValueError(f"ignore_color must be an RGB triple in 0..255, got {ignore_color}")
                table.append(ic)
            if len(set(table)) != len(table):
                raise ValueError(f"colors (with ignore_color) must be distinct, got {table}")
            self.colors = table
        elif ignore_color is not None:
            raise ValueError("ignore_color needs colors (a colour table for RGB-coded labels)")
        self.lut = _lut({**{c: c for c in range(k)}, ignore: IGNORE_INDEX})
        self.label_what = (
            "an RGB label PNG with the colours of dataset.colors"
            if self.colors is not None
            else f"a label PNG with class ids 0..{k - 1} and {ignore} (ignored)"
        )

        self.root = require_dir(root, f"a folder with {images_dir}/ and {labels_dir}/")
        self.items = pair_by_stem(self.root, images_dir, labels_dir, "label", "label-folder")

    def read_raw(self, path: Path) -> np.ndarray:
        if self.colors is None:
            return read_label_png(path, self.label_what)
        arr = np.asarray(open_image(path, self.label_what).convert("RGB")).astype(np.int64)
        code = (arr[..., 0] << 16) | (arr[..., 1] << 8) | arr[..., 2]
        table = np.array([(r << 16) | (g << 8) | b for r, g, b in self.colors], dtype=np.int64)
        values = np.array([*range(self.num_classes), self.source_ignore][: len(table)], dtype=np.uint8)
        order = np.argsort(table)
        pos = np.clip(np.searchsorted(table[order], code), 0, len(table) - 1)
        found = table[order][pos] == code
        if not found.all():
            bad = np.unique(code[~found])[:10]
            rgb = [((int(c) >> 16) & 255, (int(c) >> 8) & 255, int(c) & 255) for c in bad]
            raise DataError(
                f"{path}: expected {self.label_what}, found colours that are neither a class nor"
                f" ignore_color: {rgb}"
            )
        return values[order][pos]
