"""What a ``segment`` run writes per image: its files and its record (the run files:
:mod:`segment.run.job.coco`, :mod:`segment.run.job.manifest`, :mod:`segment.run.job.gallery`).

Layout of an output folder (``<name>`` keeps the image's sub-folders, see
:func:`segment.run.io.output_names`)::

    masks/<name>.png       0/255 foreground mask, original resolution (8-bit grey)
    heatmaps/<name>.png    heatmap R, original resolution: indexed PNG, index round(255 R),
                           palette = the colour map (viewers show colours, R is recoverable)
    overlays/<name>.jpg    the image with the mask (or the coloured regions) drawn on it
    labels/<name>.png      region ids as an indexed PNG (multi-region methods only)
    hierarchy/<name>.npz   every level of the regions: the leaf map at the image size and the
                           merge table (methods that give a hierarchy only: cuts;
                           :mod:`segment.run.job.hierarchy_files` reads it)
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

import contextlib
import io
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np
from PIL import Image

from segment.run.api.render import (
    RenderOptions,
    Segmentation,
    colormap_lut,
    heatmap_image,
    label_image,
    overlay,
    quantize,
    region_colors,
    thumbnail,
)
from segment.run.job.coco import coco_annotations, json_floats
from segment.run.job.hierarchy_files import encode_hierarchy
from segment.utils import atomic_write_bytes

RECORD_VERSION = 2
"""2: ``region_height`` and ``region_escape`` aligned with the label ids, each region's
annotation with its ``height`` and ``escape``; version 1 carried the token partition's
escape probabilities under ``escape`` (not aligned with the labels), so its images are
segmented again."""



def rel_output(kind: str, name: str) -> str:
    """Relative path (``/``-separated) of one output of image ``name``.

    ``kind``: ``mask``, ``heatmap``, ``overlay``, ``labels``, ``hierarchy``, ``record`` or
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
            "hierarchy": ("hierarchy", ".npz"),
            "record": ("records", ".json"),
        }[kind]
    except KeyError:
        raise ValueError(f"unknown output kind {kind!r}") from None
    return f"{folder}/{name}{ext}"


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
        region_height: per label id of ``labels/`` (index-aligned with the ids: entry ``k``
            is label ``k``'s, ``labels.max() + 1`` entries), the height of the split that
            made the region (it exists for the thresholds ``t`` with ``height < t <=
            until``), 6 decimals; a connected component inherits the value of the region of
            the default level it is a piece of (``Segmentation.region_height``); ``null``
            for an id no pixel has. ``None`` for methods without a hierarchy (only ``cuts``
            gives one).
        region_escape: likewise, the probability in ``[0, 1]`` that the stationary walk on
            the whole chain leaves the region in one step (not a threshold).
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
    region_height: list[float | None] | None = None
    region_escape: list[float | None] | None = None
    source_mode: str = ""
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    version: int = RECORD_VERSION

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ImageRecord:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def encode_mask(mask: np.ndarray, opts: RenderOptions) -> bytes:
    """The PNG bytes of ``masks/<name>.png``: ``(H, W)`` bool -> 8-bit grey 0/255."""
    # a mask has long runs: libpng without row filters is 3x faster than Pillow here
    return _encode(".png", mask.astype(np.uint8) * 255,
                   [cv2.IMWRITE_PNG_COMPRESSION, opts.png_compression,
                    cv2.IMWRITE_PNG_FILTER, cv2.IMWRITE_PNG_FILTER_NONE])


def encode_labels(labels: np.ndarray, opts: RenderOptions) -> bytes:
    """The PNG bytes of ``labels/<name>.png``: ``(H, W)`` non-negative integer ids -> an
    indexed PNG (a 16-bit grey one past 256 ids, :func:`segment.run.api.render.label_image`)."""
    return _png(label_image(labels, int(labels.max()) + 1), opts)


def encode_files(image: np.ndarray, seg: Segmentation, opts: RenderOptions) -> dict[str, bytes]:
    """Every file of one image, encoded and not yet written: output kind (``mask``,
    ``heatmap``, ``overlay``, ``labels``, ``hierarchy``, ``thumb/<column>``) -> bytes.

    Args:
        image: ``(H, W, 3)`` uint8 RGB at original resolution.
        seg: the post-processed result at the same resolution.
        opts: rendering options.
    """
    jpg = [cv2.IMWRITE_JPEG_QUALITY, opts.jpeg_quality]
    thumb_jpg = [cv2.IMWRITE_JPEG_QUALITY, 85]
    lut = colormap_lut(opts.colormap)
    mask_u8 = seg.mask.astype(np.uint8) * 255
    heat_u8 = quantize(seg.heatmap)
    over = overlay(image, seg, opts.overlay_alpha)
    files: dict[str, bytes] = {
        "mask": encode_mask(seg.mask, opts),
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
        files["labels"] = encode_labels(seg.labels, opts)
        small = cv2.resize(seg.labels.astype(np.uint8 if k <= 256 else np.float32),
                           thumbs["mask"].shape[::-1], interpolation=cv2.INTER_NEAREST)
        thumbs["labels"] = region_colors(small.astype(np.int32, copy=False), k)
    if seg.hierarchy is not None:
        files["hierarchy"] = encode_hierarchy(seg.hierarchy, seg.leaves, seg.mask)
    for col, small in thumbs.items():  # encoded before anything is written (write_image)
        files[f"thumb/{col}"] = _encode(".jpg", small, thumb_jpg)
    return files


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
    files = encode_files(image, seg, opts)
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
        region_height=json_floats(seg.region_height),
        region_escape=json_floats(seg.region_escape),
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
        for kind in ("labels", "thumb/labels", "hierarchy"):
            if kind not in outputs:
                _unlink(root / rel_output(kind, name))
        rec.seconds = round(time.perf_counter() - t0, 4)
        write_record(root, rec, opts.fsync)
    except BaseException as e:
        # no partial set (new files, or old ones no record vouches for): a resume redoes it
        for kind in {*outputs, "labels", "thumb/labels", "hierarchy"}:
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
