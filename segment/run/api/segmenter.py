"""The Python API: ``segment.load(...)`` gives a :class:`Segmenter`; calling it on images
gives :class:`Result` objects. The ``segment`` command runs through the same object
(:class:`segment.run.job.pipeline.SegmentRun` calls :meth:`Segmenter.preprocess`,
:meth:`Segmenter.extract`, :meth:`Segmenter.apply` and :meth:`Segmenter.postprocess`, the
stages of :meth:`Segmenter.forward`), so the masks of the API and of the command cannot
drift apart.

Example::

    import segment

    seg = segment.load()                       # DINOv2 ViT-S/14 + escape cuts
    res = seg("photo.jpg")                     # or a PIL image, a numpy array or torch
                                               # tensor (uint8 or float in [0, 1], HxWx3 or
                                               # 3xHxW: to_image), a list
    res.mask                                   # (H, W) bool, the image's own size
    segment.show(res)                          # overlay as a PIL image

``load`` takes the config names of the command (``model=``, ``method=``) and the same
keys as overrides: ``segment.load(image_size=448, escape=0.4)`` sets ``model.image_size`` and
``method.escape``; a key that neither config has is refused with a suggestion.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from PIL import Image
from torch import Tensor

from segment.core.hierarchy import Hierarchy
from segment.core.masks import MethodOutput, label_upsampling_setting
from segment.core.record import AttentionRecord, Capture
from segment.methods.base import Method
from segment.models.base import Backbone
from segment.run.front.build import build
from segment.run.front.compose import (
    compose,
    config_names,
    run_value_problem,
    show_default,
    suggest,
    value_problem,
)
from segment.run.io import ImageReadError, read_image, to_rgb
from segment.run.api.registry import method_config
from segment.run.api.render import RenderOptions, Segmentation, overlay, postprocess

__all__ = ["Batch", "ImageReadError", "Region", "Result", "Segmenter", "compose_config", "config_names", "load", "show",
           "suggest", "to_image"]

ImageLike = Union[Image.Image, np.ndarray, Tensor, str, os.PathLike]

API_KEYS = ("batch_size", "max_pixels", "label_upsampling")
"""Run settings of ``configs/segment.yaml`` that the API honours (the others, such as
``output`` or ``render.*``, are about files and belong to the command)."""


# --------------------------------------------------------------------------- config


def compose_config(
    model: str = "dinov2_vits14",
    method: str | Method = "cuts",
    checkpoint: str | os.PathLike | None = None,
    device: str = "auto",
    **overrides: Any,
) -> DictConfig:
    """The config the command would compose for ``model=... method=...`` plus overrides.

    The command's config comes from :func:`segment.run.front.compose.compose` (Hydra's compose API,
    the composition of ``segment`` and ``segment-eval``); the API keeps its model, method,
    ``device`` and the run settings it honours (:data:`API_KEYS`). Overrides are Python
    values routed by name: a key of the model config goes to ``model.KEY``, a key of the
    method config to ``method.KEY``, ``batch_size``/``max_pixels`` to the run; dotted keys
    (``**{"model.image_size": 448}``) are taken as they are. Each is checked as the command
    checks its arguments (:func:`segment.run.front.compose.value_problem`). A built
    :class:`~segment.methods.base.Method` is written as the node that builds it again
    (:func:`segment.run.api.registry.method_config`) and takes no overrides.

    Raises:
        ValueError: for an unknown model, method or key (with a suggestion), a key both
            configs have (then name it ``model.KEY`` or ``method.KEY``), or a key of a
            method given built.
        TypeError: ``method`` neither a config name nor a Method.
    """
    built = None if isinstance(method, str) else method
    if built is not None and not isinstance(built, Method):
        raise TypeError(f"method must be a configs/method name (segment.list_methods()) or a"
                        f" segment.methods.Method (segment.create_method), got {type(built).__name__}")
    for group, name in (("model", model), ("method", method if built is None else None)):
        names = config_names(group)
        if name is not None and name not in names:
            raise ValueError(f"unknown {group} {name!r}{suggest(name, names)}; choose one of {names}")
    run = compose("segment", [f"model={model}"] + ([f"method={method}"] if built is None else []))
    cfg = OmegaConf.create({
        "model": run.model,
        "method": run.method if built is None else method_config(built),
        "device": str(device),
        **{k: run.get(k) for k in API_KEYS},
    })
    if checkpoint is not None:
        if "checkpoint" not in cfg.model:
            raise ValueError(f"model {model!r} takes no checkpoint (its keys: {sorted(cfg.model)})")
        cfg.model.checkpoint = str(Path(checkpoint).expanduser())
    known = [f"model.{k}" for k in cfg.model if k != "_target_"]
    known += [f"method.{k}" for k in cfg.method if k != "_target_"]
    known += list(API_KEYS)
    for key, value in overrides.items():
        path = _override_path(cfg, key, known, model, built)
        if path not in known:
            raise ValueError(f"unknown setting {path!r}{suggest(path, known)}")
        default = OmegaConf.select(cfg, path)
        if isinstance(default, (DictConfig, ListConfig)):
            default = OmegaConf.to_container(default)
        plain = OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value
        plain = list(plain) if isinstance(plain, tuple) else plain
        why = value_problem(default, plain) or run_value_problem("segment", path, default, plain)
        if why is not None:
            raise ValueError(f"{key}={plain!r}: {why} (the default is {show_default(default)})")
        OmegaConf.update(cfg, path, value, merge=False)
    return cfg


def _override_path(cfg: DictConfig, key: str, known: list[str], model: str,
                   built: Method | None) -> str:
    """The dotted path of an API override ``key`` (:func:`compose_config`): a dotted key as it
    is, else ``model.KEY``, ``method.KEY`` or the run's ``KEY``; refused when unknown, in both
    configs, or a setting of a method given built."""
    if "." in key:
        path = key
    else:
        where = [g for g in ("model", "method") if key in cfg[g] and key != "_target_"]
        if key in API_KEYS:
            where = ["run"]
        if len(where) > 1:
            raise ValueError(f"{key!r} is a key of both the model and the method config; "
                             f"pass it as model.{key} or method.{key} (**{{'model.{key}': ...}})")
        if not where:
            names = known + [k.split(".", 1)[1] for k in known if "." in k]
            raise ValueError(f"unknown setting {key!r}{suggest(key, names)}; the model "
                             f"{model!r} and the method {cfg.method.name!r} take: {', '.join(known)}")
        path = key if where[0] == "run" else f"{where[0]}.{key}"
    if built is not None and path.startswith("method."):
        field = path.split(".", 1)[1]
        name = repr(built.name) if built.name in config_names("method") else "NAME"
        raise ValueError(
            f"{key!r} is a setting of the method {built.name!r}, which was passed built: set"
            f" it on the method (dataclasses.replace(method, {field}=...) or"
            f" segment.create_method({name}, {field}=...))")
    return path


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Region:
    """One region of an image's hierarchy (:meth:`Result.regions_at`).

    Attributes:
        mask: ``(H, W)`` bool its pixels (the union of its leaves').
        node: its node in :class:`segment.core.hierarchy.Hierarchy` (leaves ``0 .. L-1``,
            then the splits).
        height: the height of the split that made it (``0`` for the whole image): it exists
            at the thresholds ``t`` with ``height < t <= until``.
        until: the height of its own split (``inf`` for a leaf).
        escape: the probability, in ``[0, 1]``, that the stationary walk on the image's
            whole chain leaves it in one step (not a threshold: ``height`` is).
    """

    mask: np.ndarray
    node: int
    height: float
    until: float
    escape: float


@dataclass
class Result:
    """One image's segmentation at its own size.

    Attributes:
        mask: ``(H, W)`` bool foreground (the ``masks/*.png`` of the command).
        heatmap: ``(H, W)`` float32 ``R`` in ``[0, 1]`` (protocol §3).
        labels: ``(H, W)`` int32 region ids (region methods), else ``None``.
        foreground: ``(K,)`` bool, region ``k`` is foreground (region methods), else ``None``.
        record: this image's :class:`~segment.core.record.AttentionRecord` (batch of one; the
            chain the method read), or ``None`` when not kept.
        image: the RGB image that was segmented (what :func:`show` draws on).
        region_height: ``(labels.max() + 1,)`` float64, index-aligned with the ids of
            ``labels`` (``region_height[k]`` is label ``k``'s): the height of the split that
            made the region, so that it exists at the thresholds ``t`` with
            ``height < t <= until`` (:meth:`regions_at`; ``0`` for the whole image). A label
            is a connected component of a region of the default level
            (``hierarchy.level(level)``) and inherits that region's values
            (:meth:`segment.core.hierarchy.Hierarchy.label_values`: the region holding most
            of its pixels, which is also the rule for the two labels of an image whose
            regions all fell on one side, :func:`segment.core.stages.decide_regions`); NaN
            for an id no pixel has. ``None`` for a method without a hierarchy (only ``cuts``
            gives one).
        region_escape: likewise, the probability in ``[0, 1]`` that the stationary walk on
            the image's whole chain leaves the region in one step. Not a threshold: the cut
            threshold ``method.escape`` bounds the heights (every region of the default level
            has ``height < escape``), while a region's own escape may be anything in
            ``[0, 1]``.
        hierarchy: the image's :class:`segment.core.hierarchy.Hierarchy`, every level of the
            escape cuts (``method=cuts``), else ``None``.
        leaves: ``(H, W)`` int32 with ``hierarchy``: every pixel's leaf (the finest level),
            upsampled to the image's size by ``label_upsampling`` as ``labels`` are. The
            levels (:meth:`labels_at`, :meth:`regions_at`) are unions of its leaves, so they
            nest exactly; the default level's ``labels`` are upsampled on their own and split
            into connected components, so ``labels_at(escape)`` holds the token regions
            before the components and may differ from ``labels`` on boundary pixels.
        level: with ``hierarchy``, the threshold of the level ``labels`` are (``escape``).
    """

    mask: np.ndarray
    heatmap: np.ndarray
    labels: np.ndarray | None
    foreground: np.ndarray | None
    record: AttentionRecord | None = None
    image: Image.Image | None = None
    region_height: np.ndarray | None = None
    region_escape: np.ndarray | None = None
    hierarchy: Hierarchy | None = None
    leaves: np.ndarray | None = None
    level: float | None = None

    @property
    def size(self) -> tuple[int, int]:
        """``(H, W)``."""
        return int(self.mask.shape[0]), int(self.mask.shape[1])

    @classmethod
    def from_segmentation(cls, seg: Segmentation, **kwargs: Any) -> Result:
        return cls(
            mask=seg.mask.astype(bool, copy=False),
            heatmap=seg.heatmap.astype(np.float32, copy=False),
            labels=None if seg.labels is None else seg.labels.astype(np.int32, copy=False),
            foreground=None if seg.foreground is None else seg.foreground.astype(bool, copy=False),
            region_height=seg.region_height,
            region_escape=seg.region_escape,
            hierarchy=seg.hierarchy,
            leaves=seg.leaves,
            level=seg.level,
            **kwargs,
        )

    def segmentation(self) -> Segmentation:
        """Back to the command's :class:`~segment.run.api.render.Segmentation` (for the writers)."""
        return Segmentation(heatmap=self.heatmap, mask=self.mask,
                            labels=None if self.labels is None else self.labels.astype(np.int32, copy=False),
                            foreground=self.foreground, hierarchy=self.hierarchy,
                            leaves=self.leaves, level=self.level,
                            region_height=self.region_height, region_escape=self.region_escape)

    def _tree(self) -> tuple[Hierarchy, np.ndarray]:
        if self.hierarchy is None or self.leaves is None:
            raise ValueError("this result has no hierarchy: its method gives one level "
                             "(method=cuts gives every level)")
        return self.hierarchy, self.leaves

    def labels_at(self, t: float) -> np.ndarray:
        """``(H, W)`` int32 the regions at threshold ``t``: the escape cuts keeping the splits
        of height below ``t`` (small ``t``: coarse; ``t`` above every height: the leaves),
        each region the union of its leaves' pixels, numbered as
        :meth:`segment.core.hierarchy.Hierarchy.labels_at` numbers them (a region with no
        pixel at this size leaves its id unused). For ``s < t`` every region at ``s`` is a
        union of regions at ``t``.

        Raises:
            ValueError: the result has no hierarchy.
        """
        tree, leaves = self._tree()
        return tree.leaf_labels_at(float(t)).numpy().astype(np.int32)[leaves]

    def regions_at(self, x: int, y: int) -> list[Region]:
        """The nested regions that contain pixel ``(x, y)`` (column ``x``, row ``y``), from
        the coarsest (the whole image) to the finest (the pixel's leaf): a point prompt
        whose answer holds every granularity. Each :class:`Region` exists for the
        thresholds ``height < t <= until`` (a node whose split is as high as its parent's
        exists at no threshold and is left out); each is the union of its leaves' pixels,
        so each mask contains the next.

        Raises:
            ValueError: the result has no hierarchy, or ``(x, y)`` lies outside the image.
        """
        tree, leaves = self._tree()
        h, w = leaves.shape
        if not (0 <= int(x) < w and 0 <= int(y) < h):
            raise ValueError(f"pixel (x={x}, y={y}) lies outside the {w}x{h} image")
        nodes, born, until = tree.ancestors(int(leaves[int(y), int(x)]))
        live = born < until  # a split as high as its parent's makes no level of its own
        nodes, born, until = nodes[live], born[live], until[live]
        under = tree.members()[nodes].numpy()  # (D, L) leaves under each node
        return [Region(mask=under[j][leaves], node=int(n), height=float(born[j]),
                       until=float(until[j]), escape=float(tree.escape[n]))
                for j, n in enumerate(nodes.tolist())]

    def show(self, alpha: float = 0.6) -> Image.Image:
        """The overlay as a PIL image (shown inline by Jupyter); see :func:`show`."""
        return show(self, alpha=alpha)

    def __repr__(self) -> str:  # a summary: the arrays (and the attention record) are large
        h, w = self.size
        parts = [f"{w}x{h}", f"foreground {100 * float(self.mask.mean()):.1f}%"]
        if self.labels is not None:
            regions = np.unique(self.labels)
            fg = int(self.foreground[regions[regions < len(self.foreground)]].sum()) if self.foreground is not None else 0
            parts.append(f"{len(regions)} regions ({fg} foreground)")
        parts.append("record kept" if self.record is not None else "no record")
        return f"Result({', '.join(parts)})"

    def _repr_png_(self) -> bytes:  # Jupyter: a bare ``res`` in a cell shows the overlay
        import io

        buf = io.BytesIO()
        self.show().save(buf, format="PNG")
        return buf.getvalue()


def show(result: Result, image: ImageLike | None = None, alpha: float = 0.6) -> Image.Image:
    """The result drawn on its image, as the command's ``overlays/*.jpg``: a PIL image.

    Binary methods darken the background and outline the mask in green; region methods
    tint each region and outline the foreground in white.

    Args:
        result: from :class:`Segmenter`.
        image: the image, when the result does not carry it.
        alpha: overlay strength in ``[0, 1]``.
    """
    im = to_image(image) if image is not None else result.image
    if im is None:
        raise ValueError("this result carries no image; pass it: show(result, image)")
    rgb = np.asarray(im)
    if rgb.shape[:2] != result.size:
        raise ValueError(f"image is {rgb.shape[1]}x{rgb.shape[0]} but the result is "
                         f"{result.size[1]}x{result.size[0]}")
    RenderOptions(overlay_alpha=alpha)  # validates alpha
    return Image.fromarray(overlay(rgb, result.segmentation(), alpha))


# --------------------------------------------------------------------------- inputs


ARRAY_RULE = ("a numpy array or torch tensor is uint8 in 0..255 or float in [0, 1]; 2-D is grey, "
              "3-D is channels-first (3, H, W) or (1, H, W) when its first dim is 3 or 1 and its last "
              "is not 3, else (H, W, 3), (H, W, 1) or (H, W, 4) RGBA")
"""How :func:`to_image` reads an array or a tensor (the same rule for both)."""


def to_image(x: ImageLike, *, max_pixels: int | None = None) -> Image.Image:
    """One input -> 8-bit RGB PIL image, as the command reads files.

    Accepts a path (read like the command reads it: EXIF orientation, any mode to RGB), a
    PIL image (any mode; converted like a file), or an array: a numpy array or torch tensor
    is uint8 in 0..255 or float in [0, 1] (rounded to 8 bit, as a saved image would be),
    and, 3-D, channels-first ``(3, H, W)`` / ``(1, H, W)`` when its first dim is 3 or 1 and
    its last is not 3, else ``(H, W, 3)``, ``(H, W, 1)`` or ``(H, W, 4)`` (RGBA, composited
    on white as a transparent file is); 2-D is grey.

    Raises:
        ValueError: for anything else (names the shape and dtype that came), or a float
            array out of ``[0, 1]`` (names the range found).
        ImageReadError: for a file that cannot be used (names the file).
    """
    if isinstance(x, (str, os.PathLike)):
        return read_image(x, max_pixels=max_pixels).image
    if isinstance(x, Image.Image):
        return to_rgb(x)
    if isinstance(x, Tensor):
        t = x.detach().cpu()
        return _array_image((t.float() if t.is_floating_point() else t).numpy(), "tensor", x.dtype)
    if isinstance(x, np.ndarray):
        return _array_image(x, "numpy array", x.dtype)
    raise ValueError(f"cannot segment a {type(x).__name__}: pass a path, a PIL image, a numpy array or "
                     f"torch tensor, or a list of these ({ARRAY_RULE})")


def _array_image(a: np.ndarray, kind: str, dtype: Any) -> Image.Image:
    """A numpy array (a tensor's values) -> 8-bit RGB PIL image by :data:`ARRAY_RULE`;
    ``kind`` and ``dtype`` (the tensor's own) name what came in an error."""
    shape = tuple(a.shape)
    if a.dtype != np.uint8 and a.dtype.kind != "f":
        raise ValueError(f"a {kind} must be uint8 (0..255) or float ([0, 1]) to be an image, got {shape} {dtype}")
    if a.ndim == 3 and a.shape[0] in (1, 3) and a.shape[-1] != 3:
        a = a.transpose(1, 2, 0)  # channels-first
    if a.ndim == 3 and a.shape[-1] == 1:
        a = a[..., 0]
    if not (a.ndim == 2 or (a.ndim == 3 and a.shape[-1] in (3, 4))) or 0 in a.shape:
        raise ValueError(f"cannot read a {kind} of shape {shape} {dtype} as an image: {ARRAY_RULE}")
    if a.dtype.kind == "f":
        a = _float_to_uint8(a, kind)
    mode = {2: "L", 3: "RGB", 4: "RGBA"}[a.shape[-1] if a.ndim == 3 else 2]
    im = Image.fromarray(np.ascontiguousarray(a), mode=mode)
    return im if mode == "RGB" else to_rgb(im)


def _float_to_uint8(a: np.ndarray, kind: str) -> np.ndarray:
    """Float values in ``[0, 1]`` -> uint8, ``round(255 x)`` in float32 (what a saved image holds)."""
    a = a.astype(np.float32, copy=False)
    if not np.isfinite(a).all():
        raise ValueError(f"a float {kind} must hold values in [0, 1] to be an image, got NaN or infinity")
    lo, hi = float(a.min()), float(a.max())
    if lo < 0 or hi > 1:
        hint = "; 0..255 values: pass them as uint8 or divide by 255" if 1 < hi <= 255 else ""
        raise ValueError(f"a float {kind} must hold values in [0, 1] to be an image, got [{lo:.3g}, {hi:.3g}]{hint}")
    return np.rint(a * np.float32(255.0)).astype(np.uint8)


def _record_item(record: AttentionRecord, i: int) -> AttentionRecord:
    """Image ``i`` of a batch record, as a batch of one (views, on the CPU)."""
    b = record.batch_size

    def one(d: dict) -> dict:
        return {k: (v[i : i + 1].cpu() if v.dim() and v.shape[0] == b else v.cpu()) for k, v in d.items()}

    return replace(
        record, attn=one(record.attn), keys=one(record.keys), head_weights=one(record.head_weights),
        extras=one(record.extras), query=None if record.query is None else [record.query[i]],
        pixels=None if record.pixels is None else record.pixels[i : i + 1].cpu(),
    )


# --------------------------------------------------------------------------- the segmenter


@dataclass
class Batch:
    """What :meth:`Segmenter.forward` returns for a batch.

    Attributes:
        out: the method's output on the CPU (``heatmap (B, h, w)``, labels, foreground).
        record: the attention record of the batch.
    """

    out: MethodOutput
    record: AttentionRecord


def _label_upsampling_for(value: str | None, method: Method) -> str:
    """The ``label_upsampling`` setting, refused when moved off ``smooth`` for a method that
    gives no region labels (a heatmap method's mask is the thresholded heatmap: the setting
    would change nothing)."""
    setting = label_upsampling_setting(value)
    if setting != "smooth" and not method.gives_labels:
        raise ValueError(
            f"label_upsampling={setting} has no effect with method"
            f" {method.name}: it gives a heatmap, no region"
            " labels (the setting applies to region methods, e.g. regions and kmeans)"
        )
    return setting


def check_method(method: Method, backbone: Backbone) -> Capture:
    """The capture ``method`` needs on ``backbone``, with every check of the method against
    the model: the backbone kinds it runs on (:attr:`Method.backbones`), the layers it selects
    (``ValueError`` for a layer the model lacks) and its knobs that read the input image (:meth:`Method.pixel_knobs`) on a backbone whose records
    carry none (``Backbone.provides_pixels``). ``segment``, ``segment-eval`` and the
    API call it once, before the first batch.

    Raises:
        ValueError: one line naming the method, the knob and the model.
    """
    if isinstance(method, Method) and backbone.kind not in method.backbones:
        kinds = " or ".join(sorted(method.backbones))
        raise ValueError(
            f"{method.name} runs on {kinds} backbones; model {backbone.name} is a"
            f" {backbone.kind} (choose another method or model)"
        )
    capture = method.capture(backbone.num_layers)
    if not backbone.provides_pixels:
        knobs = method.pixel_knobs()
        if knobs:
            raise ValueError(
                f"{method.name}: {', '.join(knobs)} reads the input image, which model"
                f" {backbone.name} does not provide (its attention records carry no pixels);"
                f" set {', '.join('method.' + k.split('=')[0] + '=0' for k in knobs)}"
            )
    return capture


class Segmenter:
    """A backbone and a method, ready to segment images (build with :func:`load`).

    Args:
        backbone: a :class:`segment.models.base.Backbone`.
        method: a :class:`segment.methods.Method`.
        batch_size: images per forward pass when called on a list.
        max_pixels: refuse image files with more pixels (``None`` = Pillow's limit).
        label_upsampling: how region labels (and the mask they bound) reach an image's own
            size: ``smooth`` (:func:`segment.core.masks.smooth_labels_at`) or ``nearest``
            (``segment-eval``'s rule).
        config: the composed config it was built from, when built from one.
    """

    def __init__(self, backbone: Backbone, method: Method, *, batch_size: int = 8,
                 max_pixels: int | None = None, label_upsampling: str = "smooth",
                 config: DictConfig | None = None) -> None:
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not isinstance(backbone, Backbone):
            raise TypeError(
                f"backbone must be a segment.models.base.Backbone, got {type(backbone).__name__}"
            )
        if not isinstance(method, Method):
            raise TypeError(f"method must be a segment.methods.Method, got {type(method).__name__}")
        self.label_upsampling = _label_upsampling_for(label_upsampling, method)
        self.backbone = backbone
        self.method = method
        self.batch_size = int(batch_size)
        self.max_pixels = max_pixels
        self.config = config
        self.capture = check_method(method, backbone)

    @classmethod
    def from_config(cls, cfg: DictConfig, *, backbone: Backbone | None = None,
                    method: Method | None = None,
                    model_overrides: dict[str, Any] | None = None) -> Segmenter:
        """Build from a composed config (``model``, ``method``, ``batch_size``, ``max_pixels``);
        an already built ``backbone`` / ``method`` is used as it is; ``model_overrides`` are
        passed to the model's constructor (torchrun: each rank's device).

        Raises:
            BuildError: (a ``ValueError``) the method or the model cannot be built, in one
                line naming it (:func:`segment.run.front.build.build`).
        """
        if method is None:  # first: a bad method setting is refused before weights load
            method = build(cfg.method, Method, "the method")
        labels = _label_upsampling_for(cfg.get("label_upsampling"), method)
        if backbone is None:
            backbone = build(cfg.model, Backbone, "the model", **(model_overrides or {}))
        return cls(backbone, method, batch_size=int(cfg.get("batch_size") or 8),
                   max_pixels=cfg.get("max_pixels"),
                   label_upsampling=labels, config=cfg)

    @property
    def name(self) -> str:
        return f"{self.backbone.name}/{self.method.name}"

    def __repr__(self) -> str:
        return f"Segmenter({self.name}, device={self.backbone.device})"

    # the three stages the command runs (in its threads)

    def preprocess(self, image: Image.Image) -> Tensor:
        """RGB image -> ``(3, H', W')`` backbone input."""
        return self.backbone.preprocess(image)

    def forward(self, pixels: Tensor | Sequence[Tensor]) -> Batch:
        """Preprocessed ``(B, 3, H', W')`` (or a list of ``(3, H', W')`` of one size) ->
        the method's output on the grid (on the CPU) and the attention record: :meth:`extract`
        then :meth:`apply` (the command runs the two in different threads)."""
        record = self.extract(pixels)
        return Batch(out=self.apply(record), record=record)

    def extract(self, pixels: Tensor | Sequence[Tensor]) -> AttentionRecord:
        """The backbone's forward with the method's capture: the batch's attention record."""
        if not isinstance(pixels, Tensor):
            pixels = torch.stack(list(pixels))
        with torch.no_grad():
            return self.backbone.extract(pixels, self.capture)

    def apply(self, record: AttentionRecord) -> MethodOutput:
        """The method on a batch's attention record, on this thread's torch threads; its
        output on the CPU. The command and the API both come here: their files and results
        stay equal."""
        with torch.no_grad():
            out = self.method(record)
        return MethodOutput(
            heatmap=out.heatmap.detach().float().cpu(),
            labels=None if out.labels is None else out.labels.detach().cpu(),
            foreground=None if out.foreground is None else out.foreground.detach().cpu(),
            converged=None if out.converged is None else out.converged.detach().cpu(),
            escape=None if out.escape is None else [e.detach().cpu() for e in out.escape],
            hierarchy=out.hierarchy,
            leaves=None if out.leaves is None else out.leaves.detach().cpu(),
        )

    def postprocess(self, out: MethodOutput, index: int, size: tuple[int, int]) -> Segmentation:
        """Image ``index`` of a batch at its size ``(H, W)``: protocol §3 (bilinear
        upsampling, min-max, threshold at the mean; union of foreground regions), the
        labels upsampled by ``label_upsampling``."""
        return postprocess(out, index, size, label_upsampling=self.label_upsampling,
                           level=self.method.default_level)

    # the API

    def __call__(self, images: ImageLike | Sequence[ImageLike], *, keep_record: bool = True
                 ) -> Result | list[Result]:
        """Segment one image (-> :class:`Result`) or a list (-> list, in order).

        Lists run in batches of ``batch_size`` in the given order, as the command batches
        a folder, so results equal the command's files.

        Args:
            images: a path, PIL image, numpy array or torch tensor (uint8 in 0..255 or
                float in ``[0, 1]``, ``(H, W, 3)`` or ``(3, H, W)``, grey, RGBA:
                :func:`to_image`), or a list/tuple of these.
            keep_record: attach each image's attention record to its result.
        """
        single = not isinstance(images, (list, tuple))
        items = [images] if single else list(images)
        pil = []
        for k, x in enumerate(items):
            try:
                pil.append(to_image(x, max_pixels=self.max_pixels))
            except ValueError as e:
                raise ValueError(f"image {k}: {e}" if not single else str(e)) from None
        results: list[Result] = []
        pending: list[tuple[Image.Image, Tensor]] = []

        def flush() -> None:
            if not pending:
                return
            batch = self.forward([p for _, p in pending])
            for i, (im, _) in enumerate(pending):
                seg = self.postprocess(batch.out, i, (im.height, im.width))
                rec = _record_item(batch.record, i) if keep_record else None
                results.append(Result.from_segmentation(seg, record=rec, image=im))
            pending.clear()

        for im in pil:
            px = self.preprocess(im)
            if pending and tuple(pending[0][1].shape) != tuple(px.shape):
                flush()  # a batch holds one preprocessed size
            pending.append((im, px))
            if len(pending) >= self.batch_size:
                flush()
        flush()
        return results[0] if single else results


def load(
    model: str = "dinov2_vits14",
    method: str | Method = "cuts",
    checkpoint: str | os.PathLike | None = None,
    device: str = "auto",
    **overrides: Any,
) -> Segmenter:
    """A ready :class:`Segmenter` for the command's ``model=`` and ``method=`` configs.

    Args:
        model: a ``configs/model`` name (``dinov2_vits14``, ``dinov2_vitb14_reg4``...;
            ``segment.list_models()``).
        method: a ``configs/method`` name (``cuts``, ``regions``, ``bounce``...;
            ``segment.list_methods()``), or a built method
            (``segment.create_method("cuts", escape=0.4)``), used as it is.
        checkpoint: local weights (``model.checkpoint``); ``None`` = the hub or its cache.
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:N``.
        **overrides: keys of the model or method config (``image_size=448``, ``escape=0.4``),
            ``batch_size``, ``max_pixels``; dotted keys via ``**{"method.steps": 3}``. A
            method given built takes none (they are its fields).

    Raises:
        ValueError: unknown model / method / key (with a suggestion) or a bad value; a
            model or method that cannot be built (:class:`~segment.run.front.build.BuildError`,
            one line naming it and the constructor's error, which is its ``__cause__``: e.g.
            pretrained weights neither cached nor downloadable, naming ``checkpoint=PATH``
            and the cache folder).
        TypeError: ``method`` neither a config name nor a Method.
        TorchPairError: (a ``RuntimeError``) torch and torchvision do not work together,
            one line naming both and the install command
            (:func:`segment.run.front.versions.check_torch_pair`).
    """
    from segment.run.front.versions import check_torch_pair

    check_torch_pair()
    cfg = compose_config(model, method, checkpoint=checkpoint, device=device, **overrides)
    return Segmenter.from_config(cfg, method=None if isinstance(method, str) else method)

