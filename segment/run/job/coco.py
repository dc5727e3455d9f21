"""COCO annotations of a ``segment`` run: one RLE annotation per mask (binary methods) or per
region (region methods), and ``annotations.json`` from the per-image records."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from pycocotools import mask as mask_utils

from segment.run.api.render import Segmentation
from segment.utils import atomic_write_text

if TYPE_CHECKING:
    from segment.run.job.records import ImageRecord

FOREGROUND_ID = 1
BACKGROUND_ID = 2
CATEGORIES = [
    {"id": FOREGROUND_ID, "name": "foreground", "supercategory": "region"},
    {"id": BACKGROUND_ID, "name": "background", "supercategory": "region"},
]
"""COCO categories: a binary method gives one ``foreground`` annotation per image; a
multi-region method gives one annotation per region, ``foreground`` or ``background`` by
the method's decision for that region."""


def json_floats(values: np.ndarray | None, decimals: int = 6) -> list[float | None] | None:
    """A float array as a JSON list: rounded to ``decimals``, NaN as ``None`` (``null``)."""
    if values is None:
        return None
    return [None if v != v else round(float(v), decimals) for v in np.asarray(values).tolist()]


def _annotation(rle: dict, category: int, score: float, region: int | None,
                area: int | None = None, bbox: list[float] | None = None) -> dict[str, Any]:
    ann = {
        "category_id": category,
        "segmentation": {"size": [int(s) for s in rle["size"]], "counts": rle["counts"].decode("ascii")},
        "area": int(mask_utils.area(rle)) if area is None else area,
        "bbox": [float(v) for v in mask_utils.toBbox(rle).tolist()] if bbox is None else bbox,
        "iscrowd": 0,
        "score": score,
    }
    if region is not None:
        ann["region_id"] = region
    return ann


def _runs_by_region(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Runs of equal values of a 1-D label sequence, grouped by value.

    Returns:
        ``starts`` and ``ends`` of the runs (grouped by region id, in sequence order within
        a region), the region ids present (increasing), and ``bounds``: region ``j``'s runs
        are ``bounds[j]:bounds[j + 1]``.
    """
    n = flat.size
    cut = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    starts = np.concatenate([[0], cut])
    ends = np.concatenate([cut, [n]])
    run_lab = flat[starts]
    order = np.argsort(run_lab, kind="stable")  # few runs: cheap
    ids, first = np.unique(run_lab[order], return_index=True)
    return starts[order], ends[order], ids, np.concatenate([first, [order.size]])


def region_rles(labels: np.ndarray) -> tuple[np.ndarray, list[dict]]:
    """COCO RLEs of every region of a label map, from one pass over its runs.

    Equal (byte for byte) to ``mask_utils.encode`` of each ``labels == k`` mask: the
    column-major label sequence is cut into runs once, and region ``k``'s counts are the
    gaps and lengths of its runs (starting with the zeros before its first run, ending
    with the zeros after its last run when there are any), laid out for every region at
    once.

    Args:
        labels: ``(H, W)`` non-negative integer region ids.

    Returns:
        The region ids present (increasing) and their compressed RLEs, in the same order.
    """
    h, w = labels.shape
    n = h * w
    starts, ends, ids, bounds = _runs_by_region(np.ascontiguousarray(labels.T).ravel())
    k = len(ids)
    runs = np.diff(bounds)  # runs per region
    first = bounds[:-1]
    prev_end = np.empty_like(ends)  # end of the region's previous run (0 before its first)
    prev_end[1:] = ends[:-1]
    prev_end[first] = 0
    tail = n - ends[bounds[1:] - 1]  # zeros after a region's last run
    size = 2 * runs + (tail > 0)
    off = np.concatenate([[0], np.cumsum(size)])
    counts = np.empty(int(off[-1]), dtype=np.int64)
    region = np.repeat(np.arange(k), runs)
    pos = off[region] + 2 * (np.arange(len(starts)) - first[region])
    counts[pos] = starts - prev_end
    counts[pos + 1] = ends - starts
    counts[off[1:][tail > 0] - 1] = tail[tail > 0]
    flat = counts.tolist()
    objs = [{"size": [h, w], "counts": flat[off[j]: off[j + 1]]} for j in range(k)]
    return ids, mask_utils.frPyObjects(objs, h, w) if objs else []


def coco_annotations(seg: Segmentation) -> list[dict[str, Any]]:
    """COCO annotations of one image (without ``id``/``image_id``), RLE-compressed.

    Binary: one ``foreground`` annotation for the mask (none when the mask is empty).
    Regions: one annotation per region present in the label map, with its ``region_id``, the
    category ``foreground``/``background`` the method chose for it, and its ``height`` and
    ``escape`` (``Segmentation.region_height`` and ``region_escape`` of its id, 6 decimals:
    the height of the split that made the region, and the probability that the stationary
    walk leaves it in one step; ``null`` for a method without a hierarchy). ``score`` = mean
    of the heatmap R over the annotated pixels.

    Regions are done from the runs of the label map (:func:`region_rles`; the heatmap is
    gathered region by region from the row-major runs, so each score is ``np.mean`` of the
    same values in the same order as ``R[labels == k]``), not one full mask per region.
    """
    if seg.labels is None:
        if not seg.mask.any():
            return []
        rle = mask_utils.encode(np.asfortranarray(seg.mask.astype(np.uint8)))
        return [_annotation(rle, FOREGROUND_ID, float(seg.heatmap[seg.mask].mean()), None)]
    ids, rles = region_rles(seg.labels)
    starts, ends, _, bounds = _runs_by_region(seg.labels.ravel())
    lens = ends - starts
    # pixel indices of the runs, concatenated (region by region, row-major inside): steps of
    # 1 inside a run, a jump to the next run's start between runs
    step = np.ones(seg.labels.size, dtype=np.int64)
    step[0] = starts[0]
    step[(np.cumsum(lens) - lens)[1:]] = starts[1:] - ends[:-1] + 1
    heat = seg.heatmap.ravel()[np.cumsum(step)]
    pix = np.concatenate([[0], np.cumsum(lens)])[bounds]  # pixel range of each region
    areas = np.diff(pix).tolist()  # = mask_utils.area of each RLE
    boxes = mask_utils.toBbox(rles).tolist()  # all regions in one call
    heights, escapes = json_floats(seg.region_height), json_floats(seg.region_escape)
    anns = []
    for j, k in enumerate(ids.tolist()):
        fg = bool(seg.foreground[k]) if k < len(seg.foreground) else False
        score = float(heat[pix[j]: pix[j + 1]].mean())
        ann = _annotation(rles[j], FOREGROUND_ID if fg else BACKGROUND_ID, score, int(k),
                          area=areas[j], bbox=boxes[j])
        ann["height"] = None if heights is None else heights[k]  # one entry per id: k is one
        ann["escape"] = None if escapes is None else escapes[k]
        anns.append(ann)
    return anns


def build_coco(records: Sequence[ImageRecord], info: dict[str, Any] | None = None) -> dict[str, Any]:
    """A COCO dict of the records, image ids ``1..`` in the given order.

    ``images[i].file_name`` is the source path relative to the input root;
    ``segment_name`` is the output name. Annotations get sequential ids.
    """
    images, anns = [], []
    for i, rec in enumerate(records, start=1):
        images.append({
            "id": i, "file_name": rec.source, "width": rec.width, "height": rec.height,
            "segment_name": rec.name,
        })
        for a in rec.annotations:
            anns.append({"id": len(anns) + 1, "image_id": i, **a})
    return {
        "info": dict(info or {}),
        "licenses": [],
        "images": images,
        "annotations": anns,
        "categories": [dict(c) for c in CATEGORIES],
    }


def write_coco(path: str | os.PathLike, records: Sequence[ImageRecord], info: dict[str, Any] | None = None) -> None:
    atomic_write_text(path, json.dumps(build_coco(records, info), separators=(",", ":")) + "\n")


