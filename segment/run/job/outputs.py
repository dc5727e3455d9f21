"""What a ``segment`` run writes: per-image files, COCO annotations, manifest and gallery.

Layout of an output folder (``<name>`` keeps the image's sub-folders, see
:func:`segment.run.io.output_names`)::

    masks/<name>.png       0/255 foreground mask, original resolution (8-bit grey)
    heatmaps/<name>.png    heatmap R, original resolution: indexed PNG, index round(255 R),
                           palette = the colour map (viewers show colours, R is recoverable)
    overlays/<name>.jpg    the image with the mask (or the coloured regions) drawn on it
    labels/<name>.png      region ids as an indexed PNG (multi-region methods only)
    gallery/<kind>/<name>.jpg   small thumbnails used by index.html
    records/<name>.json    the per-image record: written last, it marks the image as done
    annotations.json       COCO: images, categories, one RLE annotation per mask / region
    run.json               the manifest (config, versions, device, timings, statuses)
    index.html             a static gallery that opens from disk

Every file is written atomically (temporary file + rename, :mod:`segment.utils`), so an
interrupted run leaves old or complete files, never truncated ones; a record exists only
once all files of its image are complete.
"""

from __future__ import annotations

import colorsys
import contextlib
import functools
import html
import io
import json
import os
import platform
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch
from PIL import Image
from pycocotools import mask as mask_utils

from segment.core.masks import MethodOutput, to_masks_and_labels
from segment.utils import atomic_write_bytes, atomic_write_json, atomic_write_text

FOREGROUND_ID = 1
BACKGROUND_ID = 2
CATEGORIES = [
    {"id": FOREGROUND_ID, "name": "foreground", "supercategory": "region"},
    {"id": BACKGROUND_ID, "name": "background", "supercategory": "region"},
]
"""COCO categories: a binary method gives one ``foreground`` annotation per image; a
multi-region method gives one annotation per region, ``foreground`` or ``background`` by
the method's decision for that region."""

RECORD_VERSION = 1


@dataclass(frozen=True)
class RenderOptions:
    """How the per-image files look.

    Attributes:
        colormap: OpenCV colour map for heatmaps (``inferno``, ``turbo``, ``jet``, ``viridis``...).
        overlay_alpha: strength of the overlay: how much the background is darkened (binary)
            or how much of the region colour is mixed in (regions), in ``[0, 1]``.
        jpeg_quality: quality of overlays and thumbnails (1-100).
        png_compression: zlib level of the PNGs (0-9; 1 is fast and still small for masks).
        thumb_size: longest side of the gallery thumbnails, pixels.
        fsync: flush every file to disk before renaming it into place (safe against power
            loss as well as crashes; renaming alone already protects against crashes).
    """

    colormap: str = "inferno"
    overlay_alpha: float = 0.6
    jpeg_quality: int = 90
    png_compression: int = 1
    thumb_size: int = 256
    fsync: bool = True

    def __post_init__(self) -> None:
        colormap_id(self.colormap)
        if not 0.0 <= self.overlay_alpha <= 1.0:
            raise ValueError(f"overlay_alpha must lie in [0, 1], got {self.overlay_alpha}")
        if not 1 <= self.jpeg_quality <= 100:
            raise ValueError(f"jpeg_quality must lie in [1, 100], got {self.jpeg_quality}")
        if not 0 <= self.png_compression <= 9:
            raise ValueError(f"png_compression must lie in [0, 9], got {self.png_compression}")
        if self.thumb_size < 16:
            raise ValueError(f"thumb_size must be at least 16 px, got {self.thumb_size}")


def colormap_id(name: str) -> int:
    """OpenCV's id of a colour map name (case-insensitive)."""
    cid = getattr(cv2, f"COLORMAP_{str(name).upper()}", None)
    if cid is None:
        known = sorted(k[9:].lower() for k in dir(cv2) if k.startswith("COLORMAP_"))
        raise ValueError(f"unknown colormap {name!r}; choose one of {known}")
    return int(cid)


@dataclass
class Segmentation:
    """One image's result at its original resolution.

    Attributes:
        heatmap: ``(H, W)`` float32 ``R`` in ``[0, 1]`` (protocol §3).
        mask: ``(H, W)`` bool foreground.
        labels: ``(H, W)`` int32 region ids, multi-region methods only.
        foreground: ``(K,)`` bool, region ``k`` is foreground; with ``labels``.
        escape: the escape probability of every region of the method's token partition
            (``method=cuts``), else ``None``.
    """

    heatmap: np.ndarray
    mask: np.ndarray
    labels: np.ndarray | None = None
    foreground: np.ndarray | None = None
    escape: list[float] | None = None

    @property
    def size(self) -> tuple[int, int]:
        return self.mask.shape[0], self.mask.shape[1]


def postprocess(out: MethodOutput, index: int, size: tuple[int, int],
                label_upsampling: str = "smooth") -> Segmentation:
    """Image ``index`` of a batch output at ``size = (H, W)`` with the protocol's rule.

    Uses :func:`segment.core.masks.to_masks_and_labels`: bilinear upsampling, min-max, threshold
    at the mean (the union of foreground regions for region methods). The labels are
    upsampled by ``label_upsampling``: ``smooth`` (:func:`segment.core.masks.smooth_labels_at`: the argmax
    of the regions' bilinearly upsampled one-hot maps), so region boundaries and the mask
    they bound do not step every ``H / h`` pixels on photos larger than the backbone
    input, or ``nearest`` (``segment-eval``'s rule at the label resolution).
    """
    one = MethodOutput(
        heatmap=out.heatmap[index : index + 1].float().cpu(),
        labels=None if out.labels is None else out.labels[index : index + 1].cpu(),
        foreground=None if out.foreground is None else out.foreground[index : index + 1].cpu(),
    )
    r, mask, lab = to_masks_and_labels(one, size, label_upsampling)
    labels = fg = None
    if lab is not None:
        labels = lab[0].int().numpy()
        fg = one.foreground[0].bool().numpy()
    escape = None if out.escape is None else [round(float(e), 6) for e in out.escape[index]]
    return Segmentation(heatmap=r[0].numpy(), mask=mask[0].numpy(), labels=labels, foreground=fg,
                        escape=escape)


# --------------------------------------------------------------------------- paths


def rel_output(kind: str, name: str) -> str:
    """Relative path (``/``-separated) of one output of image ``name``.

    ``kind``: ``mask``, ``heatmap``, ``overlay``, ``labels``, ``record`` or
    ``thumb/<column>`` (``thumb/image``, ``thumb/mask``...).
    """
    if kind.startswith("thumb/"):
        return f"gallery/{kind[6:]}/{name}.jpg"
    try:
        folder, ext = {
            "mask": ("masks", ".png"),
            "heatmap": ("heatmaps", ".png"),
            "overlay": ("overlays", ".jpg"),
            "labels": ("labels", ".png"),
            "record": ("records", ".json"),
        }[kind]
    except KeyError:
        raise ValueError(f"unknown output kind {kind!r}") from None
    return f"{folder}/{name}{ext}"


# --------------------------------------------------------------------------- rendering


def palette(k: int) -> np.ndarray:
    """``(k, 3)`` uint8 RGB colours, well separated (golden-ratio hues, alternating value);
    read-only, shared between calls."""
    return _palette(int(k))


@functools.lru_cache(maxsize=64)
def _palette(k: int) -> np.ndarray:
    cols = []
    for i in range(k):
        h = (i * 0.618033988749895) % 1.0
        v = 0.95 if i % 2 == 0 else 0.75
        cols.append(colorsys.hsv_to_rgb(h, 0.75, v))
    pal = (np.asarray(cols, dtype=np.float64).reshape(k, 3) * 255).round().astype(np.uint8)
    pal.setflags(write=False)
    return pal


def region_colors(labels: np.ndarray, k: int) -> np.ndarray:
    """``(H, W, 3)`` uint8 RGB: every pixel the :func:`palette` colour of its region id
    (ids below ``k``); an OpenCV table look-up up to 256 ids (3x faster than a gather)."""
    if k > 256:
        return np.take(palette(k), labels, axis=0)
    lut = np.zeros((256, 1, 3), np.uint8)
    lut[:k, 0] = palette(k)
    return cv2.LUT(cv2.cvtColor(labels.astype(np.uint8), cv2.COLOR_GRAY2RGB), lut)


def colormap_lut(colormap: str = "inferno") -> np.ndarray:
    """``(256, 3)`` uint8 RGB colours of an OpenCV colour map; read-only, shared between
    calls (OpenCV builds the map's table on every call: ~0.35 ms, twice per written image)."""
    return _colormap_lut(colormap_id(colormap))


@functools.lru_cache(maxsize=32)
def _colormap_lut(cid: int) -> np.ndarray:
    ramp = np.arange(256, dtype=np.uint8).reshape(256, 1)
    lut = np.ascontiguousarray(cv2.applyColorMap(ramp, cid)[:, 0, ::-1])
    lut.setflags(write=False)
    return lut


def quantize(heatmap: np.ndarray) -> np.ndarray:
    """``(H, W)`` values in ``[0, 1]`` -> uint8 ``round(255 * R)`` (halves to even, values
    outside saturated; OpenCV's one-pass conversion, equal to ``np.rint`` and a clip)."""
    return cv2.convertScaleAbs(cv2.max(np.asarray(heatmap, dtype=np.float32), 0.0), alpha=255.0)


def colorize(heatmap: np.ndarray, colormap: str = "inferno") -> np.ndarray:
    """``(H, W)`` values in ``[0, 1]`` -> ``(H, W, 3)`` uint8 RGB through a colour map."""
    return colormap_lut(colormap)[quantize(heatmap)]


def heatmap_image(heatmap: np.ndarray, colormap: str = "inferno") -> Image.Image:
    """The heatmap as an indexed image: index ``round(255 * R)``, palette = the colour map.

    Viewers show the colours; ``np.asarray(Image.open(path)) / 255`` gives ``R`` back (to
    1/255), and the file is a third of an RGB PNG's size. ``heatmap`` may also be the
    quantized uint8 map itself.
    """
    u8 = heatmap if heatmap.dtype == np.uint8 else quantize(heatmap)
    im = Image.frombytes("P", (u8.shape[1], u8.shape[0]), np.ascontiguousarray(u8).tobytes())
    im.putpalette(colormap_lut(colormap).tobytes())
    return im


def _line_width(size: tuple[int, int]) -> int:
    return max(1, round(min(size) / 250))


def overlay(image: np.ndarray, seg: Segmentation, alpha: float = 0.6) -> np.ndarray:
    """The image with its segmentation drawn on it, ``(H, W, 3)`` uint8 RGB.

    Binary: the background darkened by ``alpha`` and the mask outline in green. Regions:
    each region tinted with its palette colour (background regions also darkened), region
    borders in black and the foreground outline in white.
    """
    width = _line_width(seg.size)
    mask_u8 = seg.mask.astype(np.uint8)
    if seg.labels is None:
        out = cv2.convertScaleAbs(image, alpha=1.0 - alpha)  # darkened copy (uint8)
        cv2.copyTo(image, mask_u8, out)  # foreground as it was
        colour = (0, 255, 0)
    else:
        k = max(int(seg.labels.max()) + 1, len(seg.foreground))
        tint = region_colors(seg.labels, k)
        out = cv2.addWeighted(image, 1.0 - alpha, tint, alpha, 0.0)
        dark = cv2.convertScaleAbs(out, alpha=1.0 - alpha / 2)
        cv2.copyTo(out, mask_u8, dark)
        out = dark
        lab = seg.labels
        edge = np.zeros(lab.shape, bool)
        edge[:, 1:] |= lab[:, 1:] != lab[:, :-1]
        edge[1:, :] |= lab[1:, :] != lab[:-1, :]
        edge = edge.view(np.uint8)
        if width > 1:
            edge = cv2.dilate(edge, np.ones((width, width), np.uint8))
        out = cv2.bitwise_and(out, out, mask=1 - edge)  # borders black (0 where masked out)
        colour = (255, 255, 255)
    out = np.ascontiguousarray(out)
    contours, _ = cv2.findContours(mask_u8, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
    cv2.drawContours(out, contours, -1, colour, width)
    return out


def label_image(labels: np.ndarray, k: int) -> Image.Image:
    """``(H, W)`` region ids -> indexed PNG image (mode ``P`` with :func:`palette`).

    More than 256 regions do not fit a palette: then a 16-bit grey image (mode ``I;16``).
    """
    if k <= 256:
        h, w = labels.shape
        im = Image.frombytes("P", (w, h), np.ascontiguousarray(labels, dtype=np.uint8).tobytes())
        pal = np.zeros((256, 3), np.uint8)
        pal[:k] = palette(k)
        im.putpalette(pal.tobytes())
        return im
    if k > 65536:
        raise ValueError(f"{k} regions do not fit a 16-bit label image")
    return Image.fromarray(np.ascontiguousarray(labels, dtype=np.uint16))  # mode I;16


def thumbnail(rgb: np.ndarray, size: int) -> np.ndarray:
    """Shrink ``(H, W, 3)`` (or grey ``(H, W)``) so the longest side is at most ``size`` (area interpolation)."""
    h, w = rgb.shape[:2]
    s = size / max(h, w)
    if s >= 1.0:
        return rgb
    return cv2.resize(rgb, (max(1, round(w * s)), max(1, round(h * s))), interpolation=cv2.INTER_AREA)


# --------------------------------------------------------------------------- writing


@contextlib.contextmanager
def single_threaded_rendering() -> Iterator[None]:
    """OpenCV's own thread pool off for the duration (restored after).

    A batch run renders on its writer threads, one image per thread, while the backbone
    keeps the cores busy: splitting each small OpenCV call (look-ups, resizes, encodes)
    over OpenCV's pool as well only adds hand-offs. On the 2-core development machine it
    cost 15% more CPU per written image (55 against 46 ms at the bundled examples); the
    pixels are the same.
    """
    before = cv2.getNumThreads()
    cv2.setNumThreads(1)
    try:
        yield
    finally:
        cv2.setNumThreads(before)


def _encode(ext: str, rgb_or_grey: np.ndarray, params: list[int]) -> bytes:
    a = cv2.cvtColor(rgb_or_grey, cv2.COLOR_RGB2BGR) if rgb_or_grey.ndim == 3 else rgb_or_grey
    ok, buf = cv2.imencode(ext, a, params)
    if not ok:
        raise OSError(f"could not encode a {ext} image of shape {a.shape}")
    return buf.tobytes()


def _png(im: Image.Image, opts: RenderOptions) -> bytes:
    """PNG bytes of a Pillow image (Pillow's encoder: fastest here for 8-bit and palette)."""
    buf = io.BytesIO()
    im.save(buf, format="PNG", compress_level=opts.png_compression)
    return buf.getvalue()


def write_file(path: Path, data: bytes, fsync: bool = True) -> None:
    """Atomically write ``data`` (temp file + rename; ``fsync`` first when asked).

    Raises:
        OSError: naming ``path`` (a failed ``write`` or ``fsync`` names no file of its own).
    """
    try:
        atomic_write_bytes(path, data, fsync)
    except OSError as e:
        if e.filename is not None and not os.fsdecode(e.filename).endswith(".tmp"):
            raise
        raise OSError(e.errno, e.strerror or str(e), os.fspath(path)) from e


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
    Regions: one annotation per region present in the label map, with its ``region_id`` and
    the category ``foreground``/``background`` the method chose for it. ``score`` = mean of
    the heatmap R over the annotated pixels.

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
    anns = []
    for j, k in enumerate(ids.tolist()):
        fg = bool(seg.foreground[k]) if k < len(seg.foreground) else False
        score = float(heat[pix[j]: pix[j + 1]].mean())
        anns.append(_annotation(rles[j], FOREGROUND_ID if fg else BACKGROUND_ID, score, int(k),
                                area=areas[j], bbox=boxes[j]))
    return anns


@dataclass
class ImageRecord:
    """The per-image record (``records/<name>.json``); its presence marks the image done.

    Attributes:
        name: output name.
        source: path relative to the input root.
        source_path: absolute path of the file when it was processed.
        source_bytes: file size then (a changed file is processed again).
        source_mtime_ns: modification time then.
        width: image width after EXIF orientation (the outputs' width).
        height: image height likewise.
        fingerprint: hash of the model and method configs that produced it.
        outputs: kind -> path relative to the output root (``mask``, ``heatmap``...).
        annotations: COCO annotations without ``id``/``image_id``.
        mask_fraction: share of foreground pixels.
        num_regions: regions in the label map (multi-region methods), else ``None``.
        escape: the escape probability of every region of the method's token partition
            (``method=cuts``: the escape cuts, before pixel refinement splits them into
            connected pieces), else
            ``None``.
        source_mode: Pillow mode of the file.
        notes: non-fatal remarks from reading.
        seconds: time spent post-processing and writing.
    """

    name: str
    source: str
    source_path: str
    source_bytes: int
    source_mtime_ns: int
    width: int
    height: int
    fingerprint: str
    outputs: dict[str, str]
    annotations: list[dict[str, Any]]
    mask_fraction: float
    num_regions: int | None = None
    escape: list[float] | None = None
    source_mode: str = ""
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    version: int = RECORD_VERSION

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ImageRecord:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def write_image(
    root: str | os.PathLike,
    name: str,
    image: np.ndarray,
    seg: Segmentation,
    opts: RenderOptions,
    **record_fields: Any,
) -> ImageRecord:
    """Write every file of one image, then its record (last, so it marks completion).

    An existing record of ``name`` is deleted first: if the process dies half-way, the image
    has no record and a rerun does it again. Everything is encoded before the first file is
    written; a write that fails (or Ctrl-C) removes every file of this image, new or old, so
    its files appear all together or not at all.

    Args:
        root: the output folder.
        name: the image's output name.
        image: ``(H, W, 3)`` uint8 RGB at original resolution.
        seg: the post-processed result at the same resolution.
        opts: rendering options.
        **record_fields: the :class:`ImageRecord` fields about the source (``source``,
            ``source_path``, ``source_bytes``, ``source_mtime_ns``, ``fingerprint``,
            ``source_mode``, ``notes``).

    Returns:
        The record that was written.

    Raises:
        OutputWriteError: the file system refused a write (full disk, quota, read-only).
    """
    t0 = time.perf_counter()
    root = Path(root)
    if image.shape[:2] != seg.size:
        raise ValueError(f"image {image.shape[:2]} and segmentation {seg.size} sizes differ for {name!r}")
    jpg = [cv2.IMWRITE_JPEG_QUALITY, opts.jpeg_quality]
    thumb_jpg = [cv2.IMWRITE_JPEG_QUALITY, 85]
    lut = colormap_lut(opts.colormap)
    mask_u8 = seg.mask.astype(np.uint8) * 255
    heat_u8 = quantize(seg.heatmap)
    over = overlay(image, seg, opts.overlay_alpha)
    files: dict[str, bytes] = {
        # a mask has long runs: libpng without row filters is 3x faster than Pillow here
        "mask": _encode(".png", mask_u8, [cv2.IMWRITE_PNG_COMPRESSION, opts.png_compression,
                                          cv2.IMWRITE_PNG_FILTER, cv2.IMWRITE_PNG_FILTER_NONE]),
        "heatmap": _png(heatmap_image(heat_u8, opts.colormap), opts),
        "overlay": _encode(".jpg", over, jpg),
    }
    # thumbnails: shrink first, colour after (cheap at any image size)
    thumbs = {
        "image": thumbnail(image, opts.thumb_size),
        "heatmap": lut[thumbnail(heat_u8, opts.thumb_size)],
        "mask": thumbnail(mask_u8, opts.thumb_size),
        "overlay": thumbnail(over, opts.thumb_size),
    }
    if seg.labels is not None:
        k = int(seg.labels.max()) + 1
        files["labels"] = _png(label_image(seg.labels, k), opts)
        small = cv2.resize(seg.labels.astype(np.uint8 if k <= 256 else np.float32),
                           thumbs["mask"].shape[::-1], interpolation=cv2.INTER_NEAREST)
        thumbs["labels"] = region_colors(small.astype(np.int32, copy=False), k)
    for col, small in thumbs.items():  # encoded before anything is written (see below)
        files[f"thumb/{col}"] = _encode(".jpg", small, thumb_jpg)
    outputs = {kind: rel_output(kind, name) for kind in files}
    annotations = coco_annotations(seg)
    rec = ImageRecord(
        name=name,
        width=int(seg.size[1]),
        height=int(seg.size[0]),
        outputs=outputs,
        annotations=annotations,
        mask_fraction=float(seg.mask.mean()),
        # the image's own region count (one annotation per region present): ``foreground``
        # is padded to the batch's largest K, so its length would depend on the batch
        num_regions=None if seg.labels is None else len(annotations),
        escape=seg.escape,
        **record_fields,
    )
    # only file-system calls from here on: all of the image's files, or none of them
    try:
        # an old record must not vouch for files that are about to be replaced
        _unlink(root / rel_output("record", name))
        for kind, data in files.items():
            write_file(root / outputs[kind], data, opts.fsync)
        # files of a kind this method does not make (labels/ of a region method, when a heatmap
        # method redoes the image into the same folder) would be taken for this run's
        for kind in ("labels", "thumb/labels"):
            if kind not in outputs:
                _unlink(root / rel_output(kind, name))
        rec.seconds = round(time.perf_counter() - t0, 4)
        write_record(root, rec, opts.fsync)
    except BaseException as e:
        # no partial set (new files, or old ones no record vouches for): a resume redoes it
        for kind in {*outputs, "labels", "thumb/labels"}:
            with contextlib.suppress(OSError):
                _unlink(root / rel_output(kind, name))
        if isinstance(e, OSError) and not isinstance(e, OutputWriteError):
            raise OutputWriteError(root, e) from e
        raise
    return rec


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


class OutputWriteError(OSError):
    """The output folder's file system refused a write (a full disk, a quota, a read-only
    remount): a fault of the run, not of the image being written.

    Attributes:
        root: the output folder.
        path: the file that could not be written (``None`` if unknown).
        strerror, errno: the system's error.
    """

    def __init__(self, root: str | os.PathLike, error: OSError, path: str | os.PathLike | None = None) -> None:
        if path is None and error.filename is not None:
            path = os.fsdecode(error.filename)
        super().__init__(error.errno, error.strerror or str(error), None if path is None else os.fspath(path))
        self.root = Path(root)
        self.path = None if path is None else Path(path)

    def __str__(self) -> str:
        where = f" ({self.path})" if self.path is not None else ""
        return f"{self.strerror}{where}"


def write_record(root: str | os.PathLike, rec: ImageRecord, fsync: bool = True) -> None:
    # the fields as they are (json copies nothing; dataclasses.asdict would deep-copy every
    # annotation first, ~10 ms an image)
    fields = {k: getattr(rec, k) for k in rec.__dataclass_fields__}
    data = (json.dumps(fields, separators=(",", ":")) + "\n").encode("utf-8")
    write_file(Path(root) / rel_output("record", rec.name), data, fsync)


def load_record(root: str | os.PathLike, name: str) -> ImageRecord | None:
    """The record of image ``name``, or ``None`` when absent or unreadable."""
    p = Path(root) / rel_output("record", name)
    try:
        d = json.loads(p.read_text("utf-8"))
        if d.get("version") != RECORD_VERSION or d.get("name") != name:
            return None
        return ImageRecord.from_dict(d)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def record_is_current(
    rec: ImageRecord | None, root: str | os.PathLike, *, fingerprint: str, source_bytes: int,
    source_mtime_ns: int,
) -> bool:
    """Whether ``rec`` says the image is done with these settings and this file content.

    Done = same model/method fingerprint, same source size and mtime, and every output the
    record lists still present.
    """
    if rec is None or rec.fingerprint != fingerprint:
        return False
    if rec.source_bytes != source_bytes or rec.source_mtime_ns != source_mtime_ns:
        return False
    root = Path(root)
    return all((root / rel).is_file() for rel in rec.outputs.values())


# --------------------------------------------------------------------------- run-level files


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


def package_versions(names: Iterable[str] = (
    "segment", "torch", "torchvision", "timm", "hydra-core", "omegaconf", "numpy", "pillow",
    "opencv-python-headless", "pycocotools", "safetensors", "tqdm",
)) -> dict[str, str | None]:
    """Installed versions of the packages a run depends on (``None`` when absent)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            out[n] = None
    out["cuda"] = torch.version.cuda
    return out


@dataclass
class ImageStatus:
    """Per-image outcome, for the manifest."""

    name: str
    source: str
    status: str  # done | resumed | skipped (could not be segmented: ``reason`` says why)
    reason: str | None = None
    seconds: float | None = None
    rank: int | None = None  # the torchrun rank that segmented it (distributed runs)
    # files refused for themselves (unreadable, too large, too small): their size and mtime
    # then, so that a rerun skips them while they and the refusing settings are unchanged
    # (known_bad: skipped again without reading, unless retry_skipped=true)
    unreadable: bool | None = None
    source_bytes: int | None = None
    source_mtime_ns: int | None = None
    known_bad: bool | None = None
    # done or resumed: the regions in its label map and (method=cuts) the escape probability
    # of every region of the token partition, as in its record
    regions: int | None = None
    escape: list[float] | None = None

    @classmethod
    def finished(cls, rec: ImageRecord, status: str, **kw: Any) -> ImageStatus:
        """The status of an image whose outputs are written (``done``) or kept (``resumed``)."""
        return cls(rec.name, rec.source, status, regions=rec.num_regions, escape=rec.escape, **kw)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def device_info(device: torch.device | None) -> dict[str, Any]:
    """The device of a run for run.json: its name, torch threads (and CPU count)."""
    if device is None:
        return {}
    info: dict[str, Any] = {"device": str(device), "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        info["name"] = torch.cuda.get_device_name(device)
    else:
        import platform

        info["name"] = platform.processor() or platform.machine()
        info["cpu_count"] = os.cpu_count()
    return info


def write_manifest(path: str | os.PathLike, manifest: dict[str, Any]) -> None:
    atomic_write_json(path, manifest, default=str)


_GALLERY_CSS = """
*{box-sizing:border-box}
body{font-family:system-ui,sans-serif;margin:0 auto;padding:1em 1.5em;max-width:%(maxw)dpx;color:#222}
h1{font-size:1.4em;margin:.2em 0 .4em}
.wrap{overflow-x:auto}
table{border-collapse:collapse;width:100%%;table-layout:fixed}
td,th{border:1px solid #ccc;padding:4px;vertical-align:top;text-align:left}
th{background:#f3f3f3;position:sticky;top:0;z-index:1}
col.name{width:11em}
td img{width:100%%;height:auto;max-width:%(t)dpx;display:block}
.name{font-family:monospace;overflow-wrap:normal;word-break:normal;hyphens:none;overflow-x:auto}
.small{color:#666;font-size:85%%}
.legend{display:flex;flex-wrap:wrap;gap:.6em 2em;align-items:center;margin:.6em 0 1em;font-size:90%%}
.legend>div{max-width:100%%}
.bar{display:inline-block;width:14em;max-width:40vw;height:.9em;border:1px solid #888;vertical-align:middle;margin:0 .3em}
.sw{display:inline-block;width:.9em;height:.9em;border:1px solid #555;vertical-align:middle;margin:1px}
.sw.fg{outline:2px solid #111;outline-offset:1px}
.key{font-size:80%%;color:#444;margin-top:2px}
.skipped td:first-child{width:40%%}
@media (max-width:900px){body{padding:.5em}table{min-width:760px}}
"""


def _name_html(name: str) -> str:
    """An escaped file name that may wrap only after a separator (``/ _ -`` or a space), never
    in the middle of a word."""
    out = []
    for ch in name:
        out.append(html.escape(ch))
        if ch in "/_- ":
            out.append("<wbr>")
    return "".join(out)


def _hex(rgb: Sequence[int]) -> str:
    return "#%02x%02x%02x" % tuple(int(v) for v in rgb)


def _legend(colormap: str, with_labels: bool) -> str:
    """The key above the table: heatmap colour bar, mask and overlay conventions, labels."""
    lut = colormap_lut(colormap)
    stops = ",".join(_hex(lut[i]) for i in np.linspace(0, 255, 17).round().astype(int))
    parts = [
        f'<div><b>heatmap</b> R: 0 <span class="bar" style="background:linear-gradient(to right,{stops})">'
        f"</span> 1 <span class=\"small\">({html.escape(colormap)}; binary masks: R &gt; mean R)</span></div>",
        '<div><b>mask</b>: <span class="sw" style="background:#fff"></span> foreground '
        '<span class="sw" style="background:#000"></span> background</div>',
    ]
    if with_labels:
        parts.append(
            '<div><b>labels</b>: one colour per region; <span class="sw fg" style="background:#ccc"></span> '
            "ringed = foreground region, plain = background (key under each label map)</div>"
            "<div><b>overlay</b>: regions tinted, foreground outlined in white, background regions darkened</div>"
        )
    else:
        parts.append("<div><b>overlay</b>: background darkened, mask outlined in green</div>")
    return '<div class="legend">' + "".join(parts) + "</div>"


def _region_key(rec: ImageRecord) -> str:
    """Swatches of the regions of one image, foreground ones ringed."""
    regions = sorted({(int(a["region_id"]), a["category_id"] == FOREGROUND_ID)
                      for a in rec.annotations if "region_id" in a})
    if not regions:
        return ""
    pal = palette(max(r for r, _ in regions) + 1)
    sw = lambda r, fg: (f'<span class="sw{" fg" if fg else ""}" style="background:{_hex(pal[r])}" '  # noqa: E731
                        f'title="region {r}: {"foreground" if fg else "background"}"></span>')
    fg = "".join(sw(r, True) for r, f in regions if f)
    bg = "".join(sw(r, False) for r, f in regions if not f)
    return f'<div class="key">fg {fg or "none"}<br>bg {bg or "none"}</div>'


def _href(rel: str) -> str:
    return html.escape(urllib.parse.quote(rel), quote=True)


def source_link(source_path: str, root: str | os.PathLike) -> str:
    """Relative link from the output folder to a source file (absolute URI as fallback)."""
    try:
        return Path(os.path.relpath(source_path, os.path.abspath(root))).as_posix()
    except ValueError:  # another drive on Windows
        return Path(source_path).resolve().as_uri()


def render_gallery(
    root: str | os.PathLike,
    records: Sequence[ImageRecord],
    skipped: Sequence[dict[str, str]] = (),
    ignored: Sequence[dict[str, str]] = (),
    title: str = "segment",
    summary: Sequence[tuple[str, str]] = (),
    thumb_size: int = 256,
    colormap: str = "inferno",
) -> str:
    """The HTML of the static gallery: a legend (heatmap colour bar, mask, overlay and label
    keys), one row per image (image | heatmap | mask | overlay, plus labels with a
    foreground/background key for region methods), thumbnails linking to the full-size
    files, then the ``skipped`` images (that could not be segmented) and the ``ignored``
    files (not images), each ``{"path", "reason"}``. All links are relative.

    The layout fits the window (columns share its width, thumbnails scale down; at least
    1,280 px show every column without scrolling) and names wrap only after separators."""
    with_labels = any("labels" in r.outputs for r in records)
    cols = ["image", "heatmap", "mask", "overlay"] + (["labels"] if with_labels else [])
    e = html.escape
    out = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{e(title)}</title><style>"
        f"{_GALLERY_CSS % {'t': thumb_size, 'maxw': 220 + len(cols) * (thumb_size + 10)}}"
        "</style></head><body>",
        f"<h1>{_name_html(title)}</h1>",
    ]
    if summary:
        out.append("<p>" + "<br>".join(f"<b>{e(k)}</b>: {_name_html(v)}" for k, v in summary) + "</p>")
    out.append(_legend(colormap, with_labels))
    out.append('<div class="wrap"><table class="images"><colgroup><col class="name">'
               + "<col>" * len(cols) + "</colgroup>")
    out.append("<thead><tr><th>name</th>" + "".join(f"<th>{c}</th>" for c in cols) + "</tr></thead><tbody>")
    for r in records:
        cells = [
            f'<td class="name" title="{e(r.name)}">{_name_html(r.name)}<div class="small">{r.width}&times;{r.height}<br>'
            f"foreground {100 * r.mask_fraction:.1f}%"
            + (f"<br>{r.num_regions} regions" if r.num_regions is not None else "")
            + "</div></td>"
        ]
        for c in cols:
            thumb = r.outputs.get(f"thumb/{c}")
            full = source_link(r.source_path, root) if c == "image" else r.outputs.get(c)
            if thumb is None:
                cells.append("<td></td>")
                continue
            key = _region_key(r) if c == "labels" else ""
            cells.append(
                f'<td><a href="{_href(full or thumb)}"><img loading="lazy" src="{_href(thumb)}" '
                f'alt="{e(c)} of {e(r.name)}"></a>{key}</td>'
            )
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</tbody></table></div>")
    for heading, files in (("Skipped", skipped), ("Ignored", ignored)):
        if not files:
            continue
        out.append(f'<h2>{heading} ({len(files)})</h2><div class="wrap"><table class="skipped">'
                   "<tr><th>file</th><th>reason</th></tr>")
        for f in files:
            out.append(f"<tr><td class=\"name\" title=\"{e(f['path'])}\">{_name_html(f['path'])}</td><td>{e(f['reason'])}</td></tr>")
        out.append("</table></div>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def write_gallery(path: str | os.PathLike, records: Sequence[ImageRecord], **kwargs: Any) -> None:
    """Write :func:`render_gallery` for the output folder that holds ``path``."""
    path = Path(path)
    atomic_write_text(path, render_gallery(path.parent, records, **kwargs))
