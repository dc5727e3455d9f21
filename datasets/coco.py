"""COCO-format annotations (instances, stuff, or any set in that format) via pycocotools.

Masks come from ``COCO.annToMask`` (polygons, compressed and uncompressed RLE). Two tasks:

- ``binary``: foreground = union of the (selected categories') annotations; the class name
  is the category of the largest annotation (the prompt for text-conditioned backbones).
- ``multiclass``: a label map, annotations painted largest first (smaller objects stay on
  top), classes by ``label_map`` (category id -> class index; ``"cocostuff27"`` applies
  COCO-Stuff's fine-to-coarse map to category ids) or contiguous in category-id order;
  pixels without an annotation are ``ignore_index`` (or class 0 with ``background=True``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from segment.datasets.base import (
    IGNORE_INDEX,
    SegmentationDataset,
    Sample,
    center_crop_box,
    load_rgb,
    require_dir,
    require_file,
    resize_nearest,
)


def load_coco(path: str | os.PathLike):
    """A ``pycocotools.coco.COCO`` index of a COCO-format JSON file, with clear errors."""
    from pycocotools.coco import COCO

    p = require_file(path, "a COCO-format annotation JSON")
    try:
        with open(p, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: expected COCO-format JSON, cannot parse it ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected a JSON object with images/annotations/categories")
    missing = [k for k in ("images", "annotations", "categories") if k not in data]
    if missing:
        raise ValueError(f"{p}: expected COCO keys images/annotations/categories, missing {missing}")
    for i, ann in enumerate(data["annotations"]):
        for key in ("image_id", "category_id", "segmentation"):
            if key not in ann:
                raise ValueError(f"{p}: annotation #{i} has no {key!r}")
    for i, img in enumerate(data["images"]):
        for key in ("id", "file_name", "height", "width"):
            if key not in img:
                raise ValueError(f"{p}: image #{i} has no {key!r}")
    coco = COCO()
    coco.dataset = data
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    return coco


class CocoSegmentation(SegmentationDataset):
    """Images with COCO-format annotations as binary or multi-class ground truth.

    Args:
        images: folder of the images (``file_name`` is relative to it).
        annotations: the COCO-format JSON file.
        task: ``"binary"`` or ``"multiclass"``.
        size: evaluation size ``(H, W)``; ``None`` keeps the native size.
        categories: category names to use (binary: what counts as foreground; multiclass: the
            classes, in this order). ``None`` = all.
        label_map: multiclass only: ``{category_id: class_index}``, or ``"cocostuff27"``.
        num_classes: multiclass only: number of classes when ``label_map`` is a dict.
        background: multiclass only: unannotated pixels are class 0 (classes shift by one)
            instead of ``ignore_index``.
        crowd: include ``iscrowd`` annotations.
        skip_empty: leave out images without any usable annotation.
        crop: ``"none"`` or ``"center"`` (largest centred square, image and labels alike).
    """

    def __init__(
        self,
        images: str | os.PathLike,
        annotations: str | os.PathLike,
        task: str = "binary",
        size: Sequence[int] | int | None = (224, 224),
        categories: Sequence[str] | None = None,
        label_map: Mapping[int, int] | str | None = None,
        num_classes: int | None = None,
        background: bool = False,
        crowd: bool = True,
        skip_empty: bool = True,
        crop: str = "none",
    ) -> None:
        super().__init__(size)
        if task not in ("binary", "multiclass"):
            raise ValueError(f"task must be 'binary' or 'multiclass', got {task!r}")
        if crop not in ("none", "center"):
            raise ValueError(f"crop must be 'none' or 'center', got {crop!r}")
        idle = [f"{k}={v!r}" for k, v in (("label_map", label_map), ("num_classes", num_classes),
                                          ("background", background)) if v not in (None, False)]
        if task == "binary" and idle:
            raise ValueError(
                f"{', '.join(idle)}: multiclass settings, no effect with task=binary (the union of"
                " the annotations is the foreground); set task=multiclass or leave them unset"
            )
        self.task = task
        self.crop = crop
        self.crowd = crowd
        self.images_dir = require_dir(images, "the image folder of a COCO-format data set")
        self.coco = load_coco(annotations)
        self.annotations = Path(annotations)
        cats = {c["id"]: c["name"] for c in self.coco.dataset["categories"]}
        if categories is not None:
            by_name = {v: k for k, v in cats.items()}
            unknown = [c for c in categories if c not in by_name]
            if unknown:
                raise ValueError(f"{self.annotations}: unknown categories {unknown}; known: {sorted(by_name)}")
            cat_ids = [by_name[c] for c in categories]
        else:
            cat_ids = sorted(cats)
        self.category_names = cats
        self.cat_ids = cat_ids
        self.background = background
        if task == "binary":
            self.num_classes = 2
            self.class_map = {c: 1 for c in cat_ids}
            self.class_names = ["background", "foreground"]
        else:
            self.class_map, self.num_classes, self.class_names = self._class_map(
                label_map, num_classes, cat_ids, cats, background
            )
        ids = []
        for img_id in sorted(self.coco.imgs):
            anns = self._anns(img_id)
            if anns or not skip_empty:
                ids.append(img_id)
        if not ids:
            raise ValueError(f"{self.annotations}: no image has an annotation of the selected categories")
        self.ids = ids

    @staticmethod
    def _class_map(label_map, num_classes, cat_ids, cats, background):
        shift = 1 if background else 0
        if num_classes is not None and (label_map is None or isinstance(label_map, str)):
            raise ValueError(
                f"num_classes={num_classes}: no effect with label_map={label_map!r} (the classes"
                " are then the categories, or COCO-Stuff's 27); it sizes a dict label_map"
            )
        if label_map is None:
            cmap = {c: i + shift for i, c in enumerate(cat_ids)}
            names = (["background"] if background else []) + [cats[c] for c in cat_ids]
            return cmap, len(cat_ids) + shift, names
        if isinstance(label_map, str):
            if label_map != "cocostuff27":
                raise ValueError(f"label_map must be a dict or 'cocostuff27', got {label_map!r}")
            from segment.datasets.multiclass import COCOSTUFF27_CLASSES, COCOSTUFF_FINE_TO_COARSE

            # COCO-Stuff category ids are 1..182; the fine index is id - 1.
            cmap = {c: COCOSTUFF_FINE_TO_COARSE[c - 1] + shift for c in cat_ids if 1 <= c <= 182}
            names = (["background"] if background else []) + list(COCOSTUFF27_CLASSES)
            return cmap, len(COCOSTUFF27_CLASSES) + shift, names
        cmap = {int(k): int(v) + shift for k, v in dict(label_map).items() if int(k) in cat_ids}
        k = num_classes if num_classes is not None else (max(cmap.values(), default=-1) + 1 - shift)
        if any(not 0 <= v - shift < k for v in cmap.values()):
            raise ValueError(f"label_map values must lie in [0, {k}), got {sorted(set(cmap.values()))}")
        names = (["background"] if background else []) + [f"class{i}" for i in range(k)]
        return cmap, k + shift, names

    def _anns(self, img_id: int) -> list[dict]:
        anns = self.coco.imgToAnns.get(img_id, [])
        return [
            a for a in anns
            if a["category_id"] in self.class_map and (self.crowd or not a.get("iscrowd", 0))
        ]

    def __len__(self) -> int:
        return len(self.ids)

    def name(self, index: int) -> str:
        info = self.coco.imgs[self.ids[self._check_index(index)]]
        return Path(info["file_name"]).stem

    def _mask(self, ann: dict, info: dict) -> np.ndarray:
        try:
            with warnings.catch_warnings():  # pycocotools' numpy-2 copy= DeprecationWarning
                warnings.simplefilter("ignore", DeprecationWarning)
                m = self.coco.annToMask(ann)
        except Exception as e:  # pycocotools raises bare TypeErrors/IndexErrors on bad input
            raise ValueError(
                f"{self.annotations}: annotation {ann.get('id')} of image {info['id']}: cannot decode "
                f"its segmentation (expected polygons or RLE): {e}"
            ) from e
        if m.shape != (info["height"], info["width"]):
            raise ValueError(
                f"{self.annotations}: annotation {ann.get('id')} decodes to {m.shape}, image is "
                f"{(info['height'], info['width'])}"
            )
        return m.astype(bool)

    def target_native(self, index: int) -> tuple[np.ndarray, str | None]:
        """Ground truth at the image's own size and (binary) the class name."""
        img_id = self.ids[self._check_index(index)]
        info = self.coco.imgs[img_id]
        anns = sorted(self._anns(img_id), key=lambda a: -float(a.get("area", 0.0)))
        hw = (info["height"], info["width"])
        if self.task == "binary":
            fg = np.zeros(hw, dtype=bool)
            for a in anns:
                fg |= self._mask(a, info)
            name = self.category_names[anns[0]["category_id"]] if anns else None
            return fg, name
        lab = np.full(hw, 0 if self.background else IGNORE_INDEX, dtype=np.int64)
        for a in anns:  # largest first: smaller annotations stay on top
            lab[self._mask(a, info)] = self.class_map[a["category_id"]]
        return lab, None

    def __getitem__(self, index: int) -> Sample:
        index = self._check_index(index)
        info = self.coco.imgs[self.ids[index]]
        image = load_rgb(self.images_dir / info["file_name"])
        if image.size != (info["width"], info["height"]):
            raise ValueError(
                f"{self.images_dir / info['file_name']}: image is {image.size[0]}x{image.size[1]}, "
                f"{self.annotations} says {info['width']}x{info['height']}"
            )
        target, class_name = self.target_native(index)
        if self.crop == "center":
            box = center_crop_box(*image.size)
            image = image.crop(box)
            target = target[box[1] : box[3], box[0] : box[2]]
        return Sample(
            name=self.name(index),
            image=image,
            target=resize_nearest(target, self.size),
            class_name=class_name,
        )
