"""How a result looks: one image's segmentation at its own size (:func:`postprocess`, the
protocol's post-processing) and its drawings (heatmap colours, overlays, label images,
thumbnails). The Python API shows them; the ``segment`` job writes them
(:mod:`segment.run.job.records`)."""

from __future__ import annotations

import colorsys
import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import cv2
import numpy as np
from PIL import Image

from segment.core.hierarchy import Hierarchy
from segment.core.masks import MethodOutput, labels_at, to_masks_and_labels


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
        hierarchy: the image's :class:`segment.core.hierarchy.Hierarchy` (methods that give
            every level: ``cuts``), else ``None``.
        leaves: ``(H, W)`` int32 with ``hierarchy``: every pixel's leaf (the finest level),
            upsampled from the method's grid by the same rule as ``labels``
            (``label_upsampling``); the level at ``t`` is
            ``hierarchy.leaf_labels_at(t)[leaves]``, so the levels nest exactly.
        level: with ``hierarchy``, the threshold of the level ``labels`` are
            (``Method.default_level``; ``None`` when not known).
        region_height: ``(labels.max() + 1,)`` float64, index-aligned with the ids of
            ``labels``: the height of the split that made each region, so that it exists at
            the thresholds ``t`` with ``height < t <= until`` (``0`` for the whole image);
            NaN for an id no pixel has. A label is a connected component of a region of
            ``hierarchy.level(level)`` and takes that region's values
            (:meth:`segment.core.hierarchy.Hierarchy.label_values`, counted on the method's
            grid). ``None`` without a hierarchy.
        region_escape: likewise, the probability in ``[0, 1]`` that the stationary walk on
            the image's whole chain leaves the region in one step (a property of the region,
            not a threshold: ``height`` is what a threshold is compared with).
    """

    heatmap: np.ndarray
    mask: np.ndarray
    labels: np.ndarray | None = None
    foreground: np.ndarray | None = None
    hierarchy: Hierarchy | None = None
    leaves: np.ndarray | None = None
    level: float | None = None
    region_height: np.ndarray | None = None
    region_escape: np.ndarray | None = None

    @property
    def size(self) -> tuple[int, int]:
        return self.mask.shape[0], self.mask.shape[1]


def postprocess(out: MethodOutput, index: int, size: tuple[int, int],
                label_upsampling: str = "smooth", level: float | None = None) -> Segmentation:
    """Image ``index`` of a batch output at ``size = (H, W)`` with the protocol's rule.

    Uses :func:`segment.core.masks.to_masks_and_labels`: bilinear upsampling, min-max, threshold
    at the mean (the union of foreground regions for region methods). The labels are
    upsampled by ``label_upsampling``: ``smooth`` (:func:`segment.core.masks.smooth_labels_at`: the argmax
    of the regions' bilinearly upsampled one-hot maps), so region boundaries and the mask
    they bound do not step every ``H / h`` pixels on photos larger than the backbone
    input, or ``nearest`` (``segment-eval``'s rule at the label resolution). A method's
    leaf map (``MethodOutput.leaves``) reaches the image size by the same rule; ``level``
    is the threshold of the default level of a method's hierarchy (``Method.default_level``),
    whose regions give each label its height and escape
    (:meth:`segment.core.hierarchy.Hierarchy.label_values` on the method's grid, where every
    label lies in the region it was split from; NaN for an id absent at ``size``).
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
    tree = leaves = height = escape = None
    if out.hierarchy is not None:
        tree = out.hierarchy[index]
        grid_leaves = out.leaves[index].cpu()
        leaves = labels_at(grid_leaves[None], size, label_upsampling)[0].int().numpy()
        if level is not None and labels is not None:
            k = int(labels.max()) + 1
            h, e = tree.label_values(one.labels[0], grid_leaves, float(level), k)
            absent = np.bincount(labels.ravel(), minlength=k) == 0
            height, escape = h.numpy(), e.numpy()
            height[absent] = escape[absent] = np.nan
    return Segmentation(heatmap=r[0].numpy(), mask=mask[0].numpy(), labels=labels, foreground=fg,
                        hierarchy=tree, leaves=leaves,
                        level=None if tree is None or level is None else float(level),
                        region_height=height, region_escape=escape)


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


def thumb_shape(height: int, width: int, size: int) -> tuple[int, int]:
    """``(h, w)`` of the thumbnail of a ``height x width`` image: the longest side at most
    ``size``, the aspect kept (what :func:`thumbnail` makes; the gallery's canvases too)."""
    s = size / max(height, width)
    if s >= 1.0:
        return int(height), int(width)
    return max(1, round(height * s)), max(1, round(width * s))


def thumbnail(rgb: np.ndarray, size: int) -> np.ndarray:
    """Shrink ``(H, W, 3)`` (or grey ``(H, W)``) to :func:`thumb_shape` (area interpolation)."""
    h, w = rgb.shape[:2]
    th, tw = thumb_shape(h, w, size)
    if (th, tw) == (h, w):
        return rgb
    return cv2.resize(rgb, (tw, th), interpolation=cv2.INTER_AREA)


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


