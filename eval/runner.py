"""``segment-eval``: score any number of methods on a benchmark from one backbone pass.

Flow (:func:`run_eval`)::

    dataset, backbone, methods (configs)
      -> this rank's shard of the first `limit` images, minus those in the metric cache
      -> batches: backbone.extract(pixels, union of the methods' captures, prompts=classes)
           -> every method on the same record -> protocol post-processing -> per-image
              metric states -> cache (one JSON per image, atomic) + a few PNG panels
      -> gather the per-image states on rank 0, sum them in data set order
      -> Markdown table on stdout, results.json / results.csv / results.md in `output`

Binary sets report the protocol's scores (at the evaluation size, ``mask_at``) and the peer
metrics of the saliency literature (fgIoU, acc, maxF, maxF_img: per-image means, scored at
the ground truth's original resolution with the maps ``segment`` writes there,
:func:`peer_maps`; definitions in :mod:`segment.eval.metrics`). Multi-class sets report the
DiffSeg protocol's pixAcc / mIoU / per-class IoU; sets of human segmentations (task
``regions``, BSDS500) Segmentation Covering, PRI and VI of the label maps ``segment`` writes
at the photo's size (:func:`score_regions`). Both kinds of region sets also give the mean and
median number of regions per image and the share of pixels in regions under 1% of the image.

Methods (``cfg.methods``), each scored from the same attention record:

- ``null``: only ``cfg.method`` (the default method);
- a list of ``configs/method`` names, or of ``{config: NAME, name: LABEL, KNOB: VALUE}``
  entries (``methods=[rollout,{config:bounce,name:bounce3,steps:3}]``);
- a dict ``LABEL -> method config``, as experiment files build it with the defaults-list
  packaging ``- /method@methods.LABEL: bounce`` and knobs under ``methods.LABEL``.

The default method (``cfg.method``) comes first unless ``include_default=false``.

The metric cache lives in ``output/cache/<fingerprint>/``: the fingerprint covers the
model, the data set, the post-processing, the package version, :data:`CACHE_VERSION` and the
source of the backbone, data set and scoring modules; each image's file holds one state per
method, keyed by the method's config and the source of its class's modules and of the
Markov core (:func:`method_key`), so a rerun with the same ``output`` skips images already
scored, adding a method scores only that method, and an upgrade or a code change never mixes
old and new numbers. The log says how many per-image results were reused.

Prompts: a text-conditioned backbone (``Backbone.text_conditioned``, e.g. FLUX) is prompted
with each image's class name; an image without one (an unknown synset) falls back to
``model.default_class`` alone, and results.json counts those images (``prompt_fallbacks``).
"""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import io
import json
import logging
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from segment.datasets.base import DataError
from segment.run import dist
from segment.eval.metrics import (
    BinaryState,
    Bootstrap,
    MulticlassState,
    PeerCurves,
    RegionState,
    State,
    binary_states,
    bootstrap,
    hungarian_state,
    matched_classes,
    peer_curves,
    region_state,
    state_from_dict,
    total,
)
from torch import Tensor

import segment
from segment.core.masks import (
    MethodOutput,
    label_upsampling_setting,
    labels_at,
    minmax,
    threshold_mean,
    to_masks,
    to_masks_and_labels,
)
from segment.core.record import AttentionRecord, Capture
from segment.models.base import Backbone
from segment.utils import (  # noqa: F401  (exit codes re-exported for callers)
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    atomic_path,
    atomic_write_json,
    atomic_write_text,
    unwrap_instantiation,
)

log = logging.getLogger(__name__)

# protocol columns, then the peer metrics (per-image means at the original resolution)
BINARY_COLUMNS = ("pixAcc", "mIoU", "mIoU_CA", "mAP", "fgIoU", "acc", "maxF", "maxF_img")
# + per-class IoU; regions: mean per image, regions_median: median per image, small_px: percent
# of the pixels in regions under 1% of their image
MULTICLASS_COLUMNS = ("pixAcc", "mIoU", "regions", "regions_median", "small_px")
# human segmentations (BSDS500): Covering and PRI as fractions, VI in bits (as the field writes them)
REGION_COLUMNS = ("Covering", "PRI", "VI", "regions_median", "regions", "small_px")
COLUMNS = {"binary": BINARY_COLUMNS, "multiclass": MULTICLASS_COLUMNS, "regions": REGION_COLUMNS}
# the scores that get bootstrap intervals (results.json: all; CSV: INTERVAL_CSV; Markdown:
# INTERVAL_MD)
INTERVAL_SCORES = {"binary": ("pixAcc", "mIoU", "mAP", "fgIoU", "acc", "maxF", "maxF_img"),
                   "multiclass": ("pixAcc", "mIoU"), "regions": ("Covering", "PRI", "VI")}
INTERVAL_CSV = {"binary": ("mIoU", "mAP", "fgIoU", "maxF"), "multiclass": ("mIoU",),
                "regions": ("Covering", "PRI", "VI")}
INTERVAL_MD = {"binary": ("mIoU",), "multiclass": ("mIoU",), "regions": ("Covering", "PRI", "VI")}
# how the scores of a task are written: percent (x 100, 4 decimals in JSON, 2 in Markdown) or
# as they are (fractions and bits: 6 decimals in JSON, 3 in Markdown)
PERCENT = {"binary": True, "multiclass": True, "regions": False}
_MD_FORMAT = {"Covering": ".3f", "PRI": ".3f", "VI": ".3f", "regions_median": ".1f"}
# bump when a change outside the hashed modules (see fingerprint, method_key) changes scores
CACHE_VERSION = 6  # 6: multi-class states hold region counts and small-region pixels


class ConfigError(ValueError):
    """A setting of ``segment-eval`` that cannot work (reported without a traceback)."""


# ---------------------------------------------------------------------------------------
# methods from the config
# ---------------------------------------------------------------------------------------


@dataclass
class MethodSpec:
    """One row of the table: a label and the method's config (``_target_`` + knobs)."""

    label: str
    cfg: DictConfig
    method: Any = None
    key: str = ""

    def __post_init__(self) -> None:
        self.key = config_hash(self.cfg, drop=("name",))


def config_hash(cfg: Any, drop: Sequence[str] = ()) -> str:
    """Short stable hash of a config node (resolved; ``drop`` keys left out)."""
    if isinstance(cfg, (DictConfig, ListConfig)):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    if isinstance(cfg, dict):
        cfg = {k: v for k, v in cfg.items() if k not in drop}
    blob = json.dumps(cfg, sort_keys=True, default=str).encode()
    return hashlib.sha1(blob).hexdigest()[:12]


def _module_source(name: str) -> bytes:
    """The source of module ``name`` (found without importing it), empty when unknown."""
    mod = sys.modules.get(name)
    path = getattr(mod, "__file__", None) if mod is not None else None
    if path is None:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        path = spec.origin if spec is not None else None
    try:
        return Path(path).read_bytes() if path else b""
    except OSError:
        return b""


def source_hash(modules: Sequence[str]) -> str:
    """Short hash of the source files of ``modules`` (names and contents)."""
    h = hashlib.sha1()
    for name in sorted(set(modules)):
        h.update(name.encode() + b"\0" + _module_source(name) + b"\0")
    return h.hexdigest()[:12]


# the Markov core every attention method runs on (regions imports it lazily) and the method
# modules others build on (the interface, the CLS score of regions and kmeans)
_METHOD_CORE = ("segment.core.markov", "segment.core.regions", "segment.core.clusters",
                "segment.methods.base", "segment.methods.attention")
# what turns a method's output into scores
_SCORING = ("segment.core.record", "segment.core.reduce", "segment.core.masks", "segment.eval.metrics",
            "segment.models.base", "segment.datasets.base")


def method_key(spec: MethodSpec) -> str:
    """Cache key of a method: its config hash plus the source of its class's modules (the
    class and its bases) and of the Markov core."""
    if spec.method is None:
        raise ValueError(f"method {spec.label!r} is not instantiated")
    mods = [c.__module__ for c in type(spec.method).__mro__
            if c.__module__ not in ("builtins", "abc")]
    return f"{config_hash(spec.cfg, drop=('name',))}-{source_hash([*mods, *_METHOD_CORE])}"


def _compose_method(name: str) -> DictConfig:
    """The ``configs/method/<name>.yaml`` option, composed by Hydra (defaults lists work)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import MissingConfigException

    def go() -> DictConfig:
        try:
            return compose(config_name=None, overrides=[f"+method={name}"]).method
        except MissingConfigException:
            from segment.run.front import config_names, suggest

            names = config_names("method")
            raise ConfigError(
                f"methods: no method config named {name!r} in configs/method"
                f"{suggest(name, names)}; choose one of: {', '.join(names)}"
            ) from None

    if GlobalHydra.instance().is_initialized():
        return go()
    with initialize_config_module("segment.configs", version_base="1.3"):
        return go()


def _with_knobs(config: str, knobs: dict[str, Any], where: str) -> DictConfig:
    """``configs/method/<config>.yaml`` with ``knobs`` set; a knob the config does not have is
    a one-line :class:`ConfigError` naming the entry, the knob and the closest one."""
    from segment.run.front import suggest

    node = _compose_method(config)
    unknown = [str(k) for k in knobs if str(k) not in node]
    if unknown:
        keys = [str(k) for k in node if str(k) != "_target_"]
        k = unknown[0]
        raise ConfigError(
            f"{where}: method config {config!r} has no setting {k!r}{suggest(k, keys)};"
            f" its settings: {', '.join(keys)}"
        )
    return OmegaConf.merge(node, knobs)


def _label_of_default(cfg: DictConfig) -> str:
    m = cfg.method
    if "name" in m and m.name:
        return str(m.name)
    try:
        from hydra.core.hydra_config import HydraConfig

        choice = HydraConfig.get().runtime.choices.get("method")
        if choice:
            return str(choice)
    except (ValueError, AttributeError):
        pass
    return str(m.get("_target_", "method")).rsplit(".", 1)[-1]


def _knob_label(base: str, knobs: dict[str, Any]) -> str:
    if not knobs:
        return base
    return base + "(" + ",".join(f"{k}={v}" for k, v in sorted(knobs.items())) + ")"


def resolve_methods(cfg: DictConfig) -> list[MethodSpec]:
    """The methods to score, default first (see the module docstring for the forms)."""
    specs: list[MethodSpec] = []
    if cfg.get("include_default", True) or cfg.get("methods") is None:
        if cfg.get("method") is None:
            raise ConfigError("no method: set method=NAME or methods=[...]")
        specs.append(MethodSpec(_label_of_default(cfg), cfg.method))
    methods = cfg.get("methods")
    if methods is None:
        pass
    elif isinstance(methods, DictConfig):
        for label, node in methods.items():
            if isinstance(node, str):
                node = _compose_method(node)
            elif not isinstance(node, DictConfig):
                raise ConfigError(f"methods.{label}: expected a method config or a config name, got {node!r}")
            if "_target_" not in node:
                if "config" not in node:
                    raise ConfigError(
                        f"methods.{label}: expected a method config with _target_ (e.g. from"
                        f" '- /method@methods.{label}: bounce'), or {{config: NAME, KNOB: VALUE}}"
                    )
                knobs = {k: v for k, v in node.items() if k != "config"}
                node = _with_knobs(str(node.config), knobs, f"methods.{label}")
            specs.append(MethodSpec(str(label), node))
    elif isinstance(methods, (ListConfig, list, tuple)):
        for entry in methods:
            if isinstance(entry, str):
                specs.append(MethodSpec(entry, _compose_method(entry)))
            elif isinstance(entry, (DictConfig, dict)) and "config" in entry:
                entry = OmegaConf.create(entry) if isinstance(entry, dict) else entry
                knobs = {str(k): v for k, v in entry.items() if k not in ("config",)}
                label = str(knobs.pop("name", None) or _knob_label(str(entry.config), knobs))
                node = _with_knobs(str(entry.config), knobs, f"methods ({label})")
                if "name" in node:
                    node.name = label
                specs.append(MethodSpec(label, node))
            else:
                raise ConfigError(
                    f"methods: each entry must be a configs/method name or {{config: NAME, name: LABEL, "
                    f"KNOB: VALUE}}, got {entry!r}"
                )
    else:
        raise ConfigError(f"methods must be null, a list or a dict, got {type(methods).__name__}")
    # the default method given again in the list is the same row
    seen: dict[str, MethodSpec] = {}
    out = []
    for s in specs:
        if s.label in seen:
            if seen[s.label].key == s.key:
                continue
            raise ConfigError(f"two different methods are labelled {s.label!r}; give one another name")
        seen[s.label] = s
        out.append(s)
    return out


def instantiate_method(spec: MethodSpec) -> Any:
    from hydra.utils import instantiate

    kwargs = {"name": spec.label} if "name" in spec.cfg else {}
    try:
        method = instantiate(spec.cfg, **kwargs)
    except Exception as e:  # a bad knob value: one line, exit 2 (Hydra wraps the error)
        cause = unwrap_instantiation(e)
        if isinstance(cause, (ValueError, TypeError)):
            raise ConfigError(f"cannot build method {spec.label!r}: {cause}") from e
        raise
    if not callable(getattr(method, "capture", None)) or not callable(method):
        raise ConfigError(
            f"method {spec.label!r} ({spec.cfg.get('_target_')}) must have capture(num_layers)"
            " and be callable on an AttentionRecord"
        )
    return method


def union_capture(methods: Sequence[Any], num_layers: int) -> Capture:
    """The smallest capture serving every method (``Capture.union`` folded)."""
    caps = [m.capture(num_layers) for m in methods]
    out = caps[0]
    for c in caps[1:]:
        out = out.union(c, num_layers)
    return out


# ---------------------------------------------------------------------------------------
# metric cache
# ---------------------------------------------------------------------------------------

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass
class CacheEntry:
    """One image's cached results.

    Attributes:
        states: method key -> metric state.
        prompt_fallback: whether a text-conditioned backbone was prompted with the default
            class because the image had no class name (``None``: no prompt was used).
    """

    states: dict[str, State] = field(default_factory=dict)
    prompt_fallback: bool | None = None


class MetricCache:
    """Per-image metric states on disk: ``root/<name>.json`` = ``{method key: state}``.

    Files are written atomically (temp file + rename), so an interrupted run leaves every
    file either complete or absent.
    """

    def __init__(self, root: Path, enabled: bool = True) -> None:
        self.root = root
        self.enabled = enabled
        if enabled:
            root.mkdir(parents=True, exist_ok=True)

    def path(self, name: str) -> Path:
        safe = _SAFE.sub("_", name)
        if safe != name:
            safe = f"{safe}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
        return self.root / f"{safe}.json"

    def load_entry(self, name: str) -> CacheEntry:
        if not self.enabled:
            return CacheEntry()
        p = self.path(name)
        if not p.is_file():
            return CacheEntry()
        try:
            data = json.loads(p.read_text())
            if data.get("name") != name:
                return CacheEntry()
            states = {k: state_from_dict(v) for k, v in data["methods"].items()}
            fallback = data.get("prompt_fallback")
            return CacheEntry(states, None if fallback is None else bool(fallback))
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("ignoring unreadable metric cache file %s", p)
            return CacheEntry()

    def save(self, name: str, states: dict[str, State], prompt_fallback: bool | None = None) -> None:
        if not self.enabled:
            return
        data = {"name": name, "methods": {k: v.to_dict() for k, v in states.items()}}
        if prompt_fallback is not None:
            data["prompt_fallback"] = prompt_fallback
        with atomic_path(self.path(name)) as tmp:
            tmp.write_text(json.dumps(data))


# ---------------------------------------------------------------------------------------
# scoring one batch
# ---------------------------------------------------------------------------------------


def _targets(batch: Sequence[Any]) -> list[Tensor]:
    return [torch.from_numpy(np.ascontiguousarray(s.target)) for s in batch]


def _originals(batch: Sequence[Any]) -> list[Tensor]:
    """The binary ground truths at their original resolution (``Sample.original``; the
    target itself where the set gives none)."""
    return [torch.from_numpy(np.ascontiguousarray(s.target if s.original is None else s.original))
            for s in batch]


def peer_maps(out: MethodOutput, sizes: list[tuple[int, int]]) -> list[tuple[Tensor, Tensor]]:
    """Per image ``(R, mask)`` at ``sizes`` exactly as ``segment`` writes them there (the maps
    the peer metrics score, whatever ``mask_at``).

    ``R``: the method's heatmap upsampled bilinearly to the size and min-max normalised per
    image (:func:`segment.core.masks.heatmap_at`; the map ``maxF`` thresholds). The mask:
    ``R > mean(R)`` for heatmap methods; for region methods the union of the foreground
    regions with the labels upsampled by ``segment``'s default ``label_upsampling``
    (``smooth``), not a resized 224 px mask (:func:`segment.run.outputs.postprocess`).
    """
    mode = label_upsampling_setting(None)
    return _maps_by_size(out, sizes, lambda sub, size: to_masks_and_labels(sub, size, mode)[:2])


def _method_maps(out: MethodOutput, sizes: list[tuple[int, int]], mask_at: str) -> list[tuple[Tensor, Tensor]]:
    """Per image ``(R, mask)`` at its target size (protocol §3 post-processing).

    ``mask_at="image"``: upsample bilinearly, min-max, threshold at the mean (ViT protocol);
    ``"grid"``: threshold at the mean on the method's own grid, then nearest to the target
    size (ConceptAttention's FLUX protocol); ``R`` for AP is the bilinear one in both.
    """
    def maps(sub: MethodOutput, size: tuple[int, int]) -> tuple[Tensor, Tensor]:
        r, mask = to_masks(sub, size)
        if mask_at == "grid" and sub.labels is None:
            grid_mask = threshold_mean(minmax(sub.heatmap.float()))
            mask = labels_at(grid_mask.long(), size).bool()
        return r, mask

    return _maps_by_size(out, sizes, maps)


def _maps_by_size(out: MethodOutput, sizes: list[tuple[int, int]],
                  maps: Callable[[MethodOutput, tuple[int, int]], tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]]:
    """Per image ``maps(sub, size)[j]``: the images of one size go through ``maps`` together
    as the sub-output ``sub`` (their heatmaps, labels and foreground)."""
    b = out.heatmap.shape[0]
    if len(sizes) != b:
        raise ValueError(f"method returned {b} heatmaps for a batch of {len(sizes)}")
    groups: dict[tuple[int, int], list[int]] = {}
    for i, s in enumerate(sizes):
        groups.setdefault(s, []).append(i)
    res: list[tuple[Tensor, Tensor] | None] = [None] * b
    for size, idx in groups.items():
        sub = MethodOutput(
            heatmap=out.heatmap[idx],
            labels=None if out.labels is None else out.labels[idx],
            foreground=None if out.foreground is None else out.foreground[idx],
        )
        r, mask = maps(sub, size)
        for j, i in enumerate(idx):
            res[i] = (r[j], mask[j])
    return res  # type: ignore[return-value]


def score_binary(out: MethodOutput, targets: list[Tensor], mask_at: str,
                 originals: list[Tensor] | None = None) -> list[BinaryState]:
    return score_binary_many([out], targets, mask_at, originals)[0]


def _size_groups(sizes: Sequence[tuple[int, ...]], methods: int) -> list[list[tuple[int, int]]]:
    groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for m in range(methods):
        for i, size in enumerate(sizes):
            groups.setdefault(size, []).append((m, i))
    return list(groups.values())


def score_binary_many(outs: Sequence[MethodOutput], targets: list[Tensor], mask_at: str,
                      originals: list[Tensor] | None = None) -> list[list[BinaryState]]:
    """Per method, per image states of several methods' outputs on one batch.

    The maps stay on the methods' device; every (method, image) pair of one target size is
    scored in one batched call (AP by one sort per row, :func:`binary_states`). The peer
    metrics are scored against ``originals`` (the ground truths at their original
    resolution; ``None``: the targets) with :func:`peer_maps` at their sizes.
    """
    originals = targets if originals is None else originals
    if len(originals) != len(targets):
        raise ValueError(f"{len(originals)} original ground truths for {len(targets)} targets")
    sizes = [tuple(t.shape) for t in targets]
    maps = [_method_maps(out, sizes, mask_at) for out in outs]
    osizes = [tuple(t.shape) for t in originals]
    omaps = [peer_maps(out, osizes) for out in outs]
    peer: dict[tuple[int, int], PeerCurves] = {}
    for pairs in _size_groups(osizes, len(outs)):
        r = torch.stack([omaps[m][i][0] for m, i in pairs])
        pred = torch.stack([omaps[m][i][1] for m, i in pairs])
        gt = torch.stack([originals[i] for _, i in pairs]).to(r.device).bool()
        curves = peer_curves(r, pred, gt)
        for k, pair in enumerate(pairs):
            peer[pair] = curves.rows([k])
    res: list[list[BinaryState | None]] = [[None] * len(targets) for _ in outs]
    for pairs in _size_groups(sizes, len(outs)):
        r = torch.stack([maps[m][i][0] for m, i in pairs])
        pred = torch.stack([maps[m][i][1] for m, i in pairs])
        gt = torch.stack([targets[i] for _, i in pairs]).to(r.device).bool()
        curves = PeerCurves.stack([peer[p] for p in pairs])
        for (m, i), st in zip(pairs, binary_states(r, pred, gt, curves)):
            res[m][i] = st
    return res  # type: ignore[return-value]


def score_multiclass(out: MethodOutput, targets: list[Tensor], num_classes: int, label: str) -> list[MulticlassState]:
    _need_labels(out, label, "multi-class sets")
    states = []
    for i, t in enumerate(targets):
        lab = labels_at(out.labels[i : i + 1], tuple(t.shape))[0].cpu()
        states.append(hungarian_state(lab, t, num_classes))
    return states


def _need_labels(out: MethodOutput, label: str, what: str) -> None:
    if out.labels is None:
        raise ConfigError(
            f"method {label!r} returns only a heatmap; {what} need a region method"
            " (MethodOutput.labels), e.g. the region-growing methods"
        )


def region_labels(out: MethodOutput, i: int, size: tuple[int, int]) -> Tensor:
    """Image ``i``'s label map at ``size`` exactly as ``segment`` writes it (``labels/``, with
    the default ``label_upsampling``: ``smooth``, :func:`segment.core.masks.labels_at`)."""
    return labels_at(out.labels[i : i + 1], size, label_upsampling_setting(None))[0]


def score_regions(out: MethodOutput, targets: list[Tensor], label: str) -> list[RegionState]:
    """Per image :func:`segment.eval.metrics.region_state` of the method's label map, at the
    size of the human segmentations (``targets[i]``: ``(K, H, W)``) as ``segment`` writes it
    (:func:`region_labels`), against every one of them."""
    _need_labels(out, label, "sets of human segmentations")
    return [region_state(region_labels(out, i, tuple(t.shape[-2:])).cpu(), t) for i, t in enumerate(targets)]


# ---------------------------------------------------------------------------------------
# panels
# ---------------------------------------------------------------------------------------


def _colour_heat(r: Tensor) -> np.ndarray:
    import cv2

    x = (r.clamp(0, 1).cpu().numpy() * 255).astype(np.uint8)
    return cv2.cvtColor(cv2.applyColorMap(x, cv2.COLORMAP_INFERNO), cv2.COLOR_BGR2RGB)


def _gray(mask: Tensor | np.ndarray) -> np.ndarray:
    m = mask.cpu().numpy() if isinstance(mask, Tensor) else np.asarray(mask)
    return np.repeat((m.astype(np.uint8) * 255)[..., None], 3, axis=2)


# distinct class colours (Tableau 20, dark then light); more classes take seeded random ones
_TAB20 = np.array([
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
    (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207),
    (174, 199, 232), (255, 187, 120), (152, 223, 138), (255, 152, 150), (197, 176, 213),
    (196, 156, 148), (247, 182, 210), (199, 199, 199), (219, 219, 141), (158, 218, 229),
], dtype=np.uint8)


def class_palette(k: int) -> np.ndarray:
    """``(k, 3)`` uint8: one fixed colour per class (the same in every panel)."""
    if k <= len(_TAB20):
        return _TAB20[:k].copy()
    rng = np.random.default_rng(27)
    return np.concatenate([_TAB20, rng.integers(30, 256, (k - len(_TAB20), 3), dtype=np.uint8)])


def colour_classes(cls: np.ndarray, k: int) -> np.ndarray:
    """``(H, W)`` class map -> RGB: classes ``0..k-1`` in :func:`class_palette`, negative
    values (segments left unmatched, see :func:`matched_classes`) in dark shades of grey,
    anything else (ignored pixels) black."""
    pal = class_palette(k)
    out = np.zeros((*cls.shape, 3), np.uint8)
    ok = (cls >= 0) & (cls < k)
    out[ok] = pal[cls[ok]]
    un = cls < 0
    out[un] = (40 + 25 * ((-cls[un] - 1) % 4)).astype(np.uint8)[:, None]
    return out


def colour_regions(labels: np.ndarray | Tensor) -> np.ndarray:
    """``(H, W)`` region ids -> RGB, the regions in :func:`class_palette` colours in the order of
    their ids."""
    lab = labels.cpu().numpy() if isinstance(labels, Tensor) else np.asarray(labels)
    ids, inv = np.unique(lab, return_inverse=True)
    return colour_classes(inv.reshape(lab.shape), len(ids))


def _text_strip(width: int, items: list[tuple[int, str]], height: int = 18,
                swatches: np.ndarray | None = None) -> np.ndarray:
    """A white strip with ``(x, text)`` labels (and a colour swatch before each, if given)."""
    import cv2

    head = np.full((height, width, 3), 255, np.uint8)
    for n, (x, text) in enumerate(items):
        if swatches is not None:
            head[4 : height - 4, x : x + 10] = swatches[n]
            x += 13
        cv2.putText(head, text, (x + 2, 13), cv2.FONT_HERSHEY_SIMPLEX, 0.45, (0, 0, 0), 1, cv2.LINE_AA)
    return head


def _legend(width: int, names: list[str]) -> list[np.ndarray]:
    """Colour key of the classes: strips of ``[swatch] name`` wrapped to ``width``."""
    pal = class_palette(len(names))
    strips, items, x = [], [], 0
    for c, name in enumerate(names):
        step = 22 + 8 * len(name)
        if x + step > width and items:
            strips.append(_text_strip(width, [(xi, t) for xi, t, _ in items], swatches=pal[[ci for _, _, ci in items]]))
            items, x = [], 0
        items.append((x, name, c))
        x += step
    if items:
        strips.append(_text_strip(width, [(xi, t) for xi, t, _ in items], swatches=pal[[ci for _, _, ci in items]]))
    return strips


def write_panel(path: Path, image, target: np.ndarray, rows: list[tuple[str, list[np.ndarray]]],
                columns: Sequence[str] | None = None, class_names: Sequence[str] | None = None) -> None:
    """One PNG: column headers, then per method a row ``image | heatmap | mask | ground
    truth`` (labelled); ``target`` is a bool mask, a class map (with ``class_names``) or an
    ``(H, W, 3)`` uint8 image shown as it is.

    Multi-class sets (``class_names`` given): rows are ``image | labels | ground truth``, the
    ground truth in :func:`class_palette` colours (ignored pixels black) above a colour key;
    ``columns`` names the columns in a header.
    """
    import cv2
    from PIL import Image

    h, w = target.shape[:2]
    img = np.asarray(image.convert("RGB").resize((w, h), Image.BILINEAR))
    if target.ndim == 3 and target.shape[2] == 3 and target.dtype == np.uint8:
        gt = target  # already in colour (e.g. a human segmentation, colour_regions)
    elif class_names is not None:
        gt = colour_classes(target.astype(np.int64), len(class_names))
    elif target.dtype == bool:
        gt = _gray(target)
    else:
        raise ValueError(f"write_panel: a binary panel needs a bool target, got {target.dtype}"
                         " (pass class_names for a class map)")
    pad = 4
    lines = []
    if columns is None and rows:  # binary: image | heatmap | mask | ground truth
        n = len(rows[0][1])
        columns = ["image", *(["heatmap", "mask"] + [""] * n)[:n], "ground truth"]
    if columns:
        lines.append(_text_strip((w + pad) * len(columns), [(c * (w + pad), t) for c, t in enumerate(columns)]))
    for label, tiles in rows:
        row = [img, *tiles, gt]
        row = [np.pad(t, ((0, 0), (0, pad), (0, 0)), constant_values=255) for t in row]
        strip = np.concatenate(row, axis=1)
        head = np.full((18, strip.shape[1], 3), 255, np.uint8)
        cv2.putText(head, label, (2, 13), cv2.FONT_HERSHEY_SIMPLEX, 0.45, (0, 0, 0), 1, cv2.LINE_AA)
        lines.append(np.concatenate([head, strip, np.full((pad, strip.shape[1], 3), 255, np.uint8)], 0))
    if class_names is not None:
        lines.extend(_legend(lines[-1].shape[1], list(class_names)))
    canvas = np.concatenate(lines, 0)
    buf = io.BytesIO()
    Image.fromarray(canvas).save(buf, format="PNG")
    with atomic_path(path) as tmp:
        tmp.write_bytes(buf.getvalue())


# ---------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------


@dataclass
class Results:
    """The table: one row per method, scores in percent (binary, multi-class) or as the
    field writes them (``regions``: Covering and PRI as fractions, VI in bits).

    Multi-class rows also hold ``regions`` (mean predicted segments per image),
    ``regions_median``, ``small_px`` (percent of the pixels in segments under 1% of their
    image) and ``iou`` (class name -> IoU in percent, ``None`` for a class never seen nor
    predicted), shown as one column per class in the CSV (``IoU_<name>``) and Markdown tables.
    Region rows (BSDS500) hold ``Covering``, ``PRI``, ``VI``, ``regions_median``, ``regions``
    and ``small_px``.

    With bootstrap intervals (:func:`add_intervals`) every row holds ``ci95`` (score ->
    ``[low, high]``) and every row after the first ``delta`` (``{"vs": first row, score:
    [difference, low, high]}``, paired over the same resampled images); the CSV gets them
    for :data:`INTERVAL_CSV` and the Markdown for :data:`INTERVAL_MD`.
    """

    task: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    class_names: tuple[str, ...] = ()

    @property
    def columns(self) -> tuple[str, ...]:
        return COLUMNS[self.task]

    @property
    def _num(self) -> str:
        return ".2f" if PERCENT[self.task] else ".3f"

    @property
    def _intervals(self) -> bool:
        return bool(self.rows) and "ci95" in self.rows[0]

    def _class_values(self, r: dict[str, Any]) -> list[str]:
        iou = r.get("iou") or {}
        return ["" if iou.get(c) is None else f"{iou[c]:.2f}" for c in self.class_names]

    def _delta_text(self, r: dict[str, Any], score: str) -> str:
        d = (r.get("delta") or {}).get(score)
        f = "+" + self._num
        return "" if d is None else f"{d[0]:{f}} ({d[1]:{f}}, {d[2]:{f}})"

    def markdown(self) -> str:
        extra: list[str] = []
        scores = INTERVAL_MD[self.task] if self._intervals else ()
        deltas = scores if len(self.rows) > 1 else ()
        extra = [f"{s} 95% CI" for s in scores]
        extra += [f"Δ{s} vs {self.rows[0]['method']} (95% CI)" for s in deltas]
        cols = ("method", *self.columns, *self.class_names, "images", *extra)
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        num = self._num
        for r in self.rows:
            vals = [r["method"], *(f"{r[c]:{_MD_FORMAT.get(c, '.2f')}}" for c in self.columns),
                    *self._class_values(r), str(r["images"])]
            for s in scores:
                lo, hi = r["ci95"][s]
                vals.append(f"{lo:{num}}-{hi:{num}}")
            vals += [self._delta_text(r, s) for s in deltas]
            lines.append("| " + " | ".join(v or "-" for v in vals) + " |")
        return "\n".join(lines) + "\n"

    def csv(self) -> str:
        buf = io.StringIO()
        per_class = [f"IoU_{c}" for c in self.class_names]
        scores = INTERVAL_CSV[self.task] if self._intervals else ()
        deltas = scores if len(self.rows) > 1 else ()
        extra = [f"{s}_{k}" for s in scores for k in ("ci95_low", "ci95_high")]
        extra += [f"delta_{s}{k}" for s in deltas for k in ("", "_ci95_low", "_ci95_high")]
        wr = csv.writer(buf, lineterminator="\n")
        wr.writerow(["method", *self.columns, *per_class, "images", *extra])
        for r in self.rows:
            iou = r.get("iou") or {}
            delta = r.get("delta") or {}
            wr.writerow([r["method"], *(r[c] for c in self.columns),
                         *("" if iou.get(c) is None else iou[c] for c in self.class_names), r["images"],
                         *(v for s in scores for v in r["ci95"][s]),
                         *(v for s in deltas for v in delta.get(s, ("", "", "")))])
        return buf.getvalue()

    def write(self, out: Path) -> None:
        atomic_write_json(out / "results.json", self.rows)
        atomic_write_text(out / "results.csv", self.csv())
        atomic_write_text(out / "results.md", self.markdown())


def add_intervals(results: Results, boot: Bootstrap, keys: Sequence[str]) -> None:
    """Put the bootstrap intervals into ``results.rows`` (in the rows' units: percent rounded
    to 1e-4, or fractions and bits rounded to 1e-6 for region sets): ``ci95`` per row and,
    for every row after the first, ``delta`` against the first row (``keys[i]`` is row
    ``i``'s method in ``boot``)."""
    scores = INTERVAL_SCORES[results.task]
    scale, digits = (100.0, 4) if PERCENT[results.task] else (1.0, 6)
    if boot.level != 0.95:
        raise ValueError(f"the tables name 95% intervals, got level {boot.level}")
    ref_row, ref = results.rows[0], keys[0]
    for row, key in zip(results.rows, keys):
        row["ci95"] = {s: [round(scale * v, digits) for v in boot.interval(key, s)] for s in scores}
        if row is ref_row:
            continue
        delta = {"vs": ref_row["method"]}
        for s in scores:
            lo, hi = boot.difference(key, ref, s)
            delta[s] = [round(row[s] - ref_row[s], digits), round(scale * lo, digits), round(scale * hi, digits)]
        row["delta"] = delta


def _row(label: str, state: State, class_names: Sequence[str] = ()) -> dict[str, Any]:
    sc = state.scores()
    row: dict[str, Any] = {"method": label, **sc.percent()}
    if isinstance(state, MulticlassState):
        names = list(class_names) or [str(i) for i in range(len(sc.iou))]
        row["iou"] = {c: None if math.isnan(x) else 100.0 * x for c, x in zip(names, sc.iou)}
    return row


def class_names_of(dataset: Any) -> tuple[str, ...]:
    """The data set's class names for tables and panels (``"0", "1", ...`` when it has none)."""
    names = getattr(dataset, "class_names", None)
    k = int(dataset.num_classes)
    if names is None or len(names) != k or len(set(names)) != k:
        return tuple(str(i) for i in range(k))
    return tuple(str(c) for c in names)


# ---------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------


def _bootstrap_reps(cfg: DictConfig) -> int:
    reps = cfg.get("bootstrap", 0)
    if not isinstance(reps, int) or isinstance(reps, bool) or reps < 0:
        raise ConfigError(f"bootstrap must be a whole number of resamples >= 0 (0 = off), got {reps!r}")
    return int(reps)


def _output_dir(cfg: DictConfig) -> Path:
    if cfg.get("output"):
        return Path(str(cfg.output))
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:
        raise ConfigError("no output folder: pass output=DIR (Hydra's run dir exists only under segment-eval)") from None


def fingerprint(cfg: DictConfig, selection: Sequence[str] = ()) -> str:
    """What decides the per-image numbers besides the method: model, data set, post-processing,
    package version, :data:`CACHE_VERSION` and the source of the backbone, data set and
    scoring modules.

    ``selection``: data set settings that only choose which items are read, each item's name
    saying where it comes from (the data set's ``selection_keys``, e.g. BSDS500's ``split``:
    ``val/241048``); they are left out, so that runs of the same output over splits share the
    per-image results (like ``limit``)."""
    model = OmegaConf.to_container(cfg.model, resolve=True)
    if isinstance(model, dict):
        model = {k: v for k, v in model.items() if k != "device"}
    data = OmegaConf.to_container(cfg.dataset, resolve=True)
    if isinstance(data, dict):
        data = {k: v for k, v in data.items() if k not in set(selection)}
    targets = [str(node.get("_target_", "")).rsplit(".", 1)[0] for node in (cfg.model, cfg.dataset)]
    return config_hash({
        "model": model, "dataset": data, "mask_at": cfg.get("mask_at", "image"),
        "version": segment.__version__, "cache": CACHE_VERSION,
        "code": source_hash([*(t for t in targets if t), *_SCORING]),
    })


def _instantiate_model(cfg: DictConfig, device: torch.device) -> Backbone:
    from hydra.utils import instantiate

    kwargs = {"device": str(device)} if "device" in cfg.model else {}
    if cfg.get("seed") is not None:  # same random-init weights on every rank and rerun
        torch.manual_seed(int(cfg.seed))
    try:
        model = instantiate(cfg.model, **kwargs)
    except Exception as e:  # no weights offline, a checkpoint that does not fit: one line, exit 2
        cause = unwrap_instantiation(e)
        raise ConfigError(f"cannot build the model: {type(cause).__name__}: {cause}") from e
    if not isinstance(model, Backbone):
        raise ConfigError(f"model {cfg.model.get('_target_')} is not a segment.models.base.Backbone"
                          f" (got {type(model).__name__})")
    return model


def _instantiate_dataset(cfg: DictConfig) -> Any:
    from hydra.utils import instantiate

    missing = [k for k in cfg.dataset if OmegaConf.is_missing(cfg.dataset, k)]
    if missing:
        raise ConfigError(f"dataset: set {', '.join('dataset.' + k for k in missing)} (e.g. dataset.{missing[0]}=PATH)")
    try:
        return instantiate(cfg.dataset)
    except Exception as e:  # Hydra wraps constructor errors in InstantiationException
        cause = e.__cause__ or e
        if isinstance(cause, (FileNotFoundError, ValueError)):
            raise ConfigError(str(cause)) from e
        raise


def run_eval(cfg: DictConfig) -> int:
    """Evaluate the configured methods; returns the exit code (0 ok, 2 bad input/config,
    130 interrupted: rerun with the same ``output`` to resume)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        ctx = dist.init(cfg.get("device", "auto"))
    except ValueError as e:  # e.g. device=cuda without CUDA, a bad torchrun environment
        print(f"segment-eval: bad settings: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return _run(cfg, ctx)
    except ConfigError as e:
        print(f"segment-eval: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except DataError as e:  # a data set file that cannot be read as expected (named in e)
        print(f"segment-eval: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("segment-eval: interrupted; rerun with the same output= to resume from the metric cache",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        dist.close(ctx)


def _run(cfg: DictConfig, ctx: dist.DistContext) -> int:
    out_dir = Path(dist.broadcast(str(_output_dir(cfg)), ctx))
    mask_at = str(cfg.get("mask_at", "image"))
    if mask_at not in ("image", "grid"):
        raise ConfigError(f"mask_at must be 'image' or 'grid', got {mask_at!r}")
    reps = _bootstrap_reps(cfg)
    for knob, low in (("batch_size", 1), ("num_workers", 0)):
        v = cfg.get(knob)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
            raise ConfigError(f"{knob} must be an integer >= {low}, got {v!r}")

    dataset = _instantiate_dataset(cfg)
    if mask_at != "image" and dataset.task != "binary":
        raise ConfigError(
            f"mask_at={mask_at} has no effect on {type(dataset).__name__} ({dataset.task}):"
            " it says how binary masks are made from heatmaps; region labels are scored as"
            " they are"
        )
    specs = resolve_methods(cfg)
    for s in specs:
        s.method = instantiate_method(s)
        s.key = method_key(s)
    n = len(dataset)
    limit = cfg.get("limit")
    if limit is not None:
        if int(limit) < 1:
            raise ConfigError(f"limit must be a positive number of images, got {limit}")
        n = min(n, int(limit))
    indices = list(range(n))
    names = [dataset.name(i) for i in indices]
    if len(set(names)) != len(names):
        raise ConfigError(f"{type(dataset).__name__}: item names are not unique")

    cache_root = out_dir / "cache"
    cache = MetricCache(cache_root / fingerprint(cfg, getattr(dataset, "selection_keys", ())),
                        enabled=bool(cfg.get("cache", True)))
    mine = dist.shard(indices, ctx)
    keys = [s.key for s in specs]
    states: dict[int, dict[str, State]] = {}
    fallbacks: dict[int, bool | None] = {}
    todo = []
    reused = 0
    for i in mine:
        entry = cache.load_entry(names[i])
        states[i] = entry.states
        fallbacks[i] = entry.prompt_fallback
        reused += sum(k in entry.states for k in keys)
        if any(k not in entry.states for k in keys):
            todo.append(i)
    log.info(
        "rank %d/%d: %d images, %d with every row in the metric cache, %d to score with %d methods",
        ctx.rank, ctx.world_size, len(mine), len(mine) - len(todo), len(todo), len(specs),
    )
    if cache.enabled:
        others = [p for p in cache_root.iterdir() if p.is_dir() and p != cache.root]
        log.info(
            "metric cache %s: reused %d of %d (image, method) results%s", cache.root, reused,
            len(mine) * len(keys),
            f"; {len(others)} other cache folder(s) (another model, data set, post-processing,"
            " package version or code) not used" if others else "",
        )

    t0 = time.perf_counter()
    timing = _Timing()
    if todo or ctx.distributed:  # under torchrun every rank checks, so all refuse alike
        backbone = _build_backbone(cfg, ctx, specs, timing)
    if todo:
        _score(cfg, ctx, dataset, specs, todo, states, cache, out_dir, mask_at, fallbacks, timing, backbone)
    elapsed = time.perf_counter() - t0 - timing.build_s

    # one collective: every rank's per-image states and prompt fallbacks together
    mine_out = ({i: {k: v.to_dict() for k, v in st.items()} for i, st in states.items()}, fallbacks)
    gathered = dist.gather(mine_out, ctx)
    if not ctx.is_main:
        return EXIT_OK
    per_image: dict[int, dict[str, dict]] = {}
    prompted: dict[int, bool | None] = {}
    for part_states, part_prompted in gathered or []:
        per_image.update(part_states)
        prompted.update(part_prompted)
    empty = {"binary": lambda: BinaryState(), "regions": lambda: RegionState(),
             "multiclass": lambda: MulticlassState.zero(dataset.num_classes)}[dataset.task]
    names = class_names_of(dataset) if dataset.task == "multiclass" else ()
    results = Results(task=dataset.task, class_names=names)
    for s in specs:
        acc = total((state_from_dict(per_image[i][s.key]) for i in indices), empty())
        row = _row(s.label, acc, names)
        scored = timing.images.get(s.key, 0)
        row["images_per_s"] = round(len(todo) / elapsed, 4) if todo and scored else None
        row["method_ms_per_image"] = round(1e3 * timing.method_s[s.key] / scored, 3) if scored else None
        results.rows.append(row)
    if reps and len(indices) > 1:  # the same resampled images for every row: paired deltas
        boot = bootstrap({s.key: [state_from_dict(per_image[i][s.key]) for i in indices] for s in specs},
                         reps=reps, level=0.95, seed=int(cfg.get("seed") or 0))
        add_intervals(results, boot, [s.key for s in specs])
    if any(prompted.get(i) is not None for i in indices):  # a text-conditioned backbone
        count = sum(bool(prompted.get(i)) for i in indices)
        for row in results.rows:
            row["prompt_fallbacks"] = count
        if count:
            log.warning("%d of %d images had no class name and were prompted with the default"
                        " class", count, len(indices))
    results.write(out_dir)
    atomic_write_text(out_dir / "config.yaml", OmegaConf.to_yaml(cfg))
    print(results.markdown(), end="")
    if todo:
        log.info("scored %d images in %.1f s (%.2f images/s on rank 0)", len(todo), elapsed, len(todo) / max(elapsed, 1e-9))
    log.info("results in %s", out_dir)
    return EXIT_OK


def batch_prompts(classes: Sequence[str | None], default: str | None,
                  names: Sequence[str]) -> list[str] | None:
    """Per-image prompts: each image's class name, ``default`` for an image without one.

    ``None`` when no image has a class name (the backbone then uses its own default).

    Raises:
        ConfigError: some images lack a class name and there is no ``default``.
    """
    if all(c is None for c in classes):
        return None
    missing = [n for n, c in zip(names, classes) if c is None]
    if missing and default is None:
        raise ConfigError(
            f"{', '.join(missing)}: no class name to prompt with and model.default_class is not set"
        )
    return [default if c is None else c for c in classes]  # type: ignore[misc]


@dataclass
class _Timing:
    """Where the scoring time of this rank went (seconds) and how many images each method
    scored now (not from the cache)."""

    method_s: dict[str, float] = field(default_factory=dict)
    images: dict[str, int] = field(default_factory=dict)
    build_s: float = 0.0  # building the backbone (not counted in images_per_s)


TIMING_KEYS = ("images_per_s", "method_ms_per_image")
"""Keys of a results row that are measurements of this run, not scores: ``images_per_s``,
the images scored per second by the whole run (reading, one backbone pass, every method,
scoring; rank 0); ``method_ms_per_image``, this method's own time per image. ``null``
when the row came from the metric cache only."""


def _build_backbone(cfg, ctx, specs, timing: _Timing) -> Backbone:
    """The model, with every method checked against it (:func:`segment.run.api.check_method`:
    layers it lacks, knobs that need pixels it does not provide): before the first batch,
    one line, exit 2."""
    from segment.run.api import check_method

    t_build = time.perf_counter()
    backbone = _instantiate_model(cfg, ctx.device)
    for s in specs:
        try:
            check_method(s.method, backbone)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"method {s.label!r} cannot run on this model: {e}") from e
    timing.build_s = time.perf_counter() - t_build
    return backbone


def input_size_groups(backbone: Backbone, images: Sequence[Any]) -> list[list[int]]:
    """The positions of ``images`` grouped by the backbone's input size for each
    (:meth:`segment.models.base.Backbone.input_size`; one group, in order, when every image
    gets the same size: ``None``), groups in the order of their first image."""
    groups: dict[Any, list[int]] = {}
    for j, im in enumerate(images):
        groups.setdefault(backbone.input_size(im), []).append(j)
    return list(groups.values())


def _score(cfg, ctx, dataset, specs, todo, states, cache, out_dir, mask_at, fallbacks,
           timing: _Timing, backbone: Backbone) -> None:
    from torch.utils.data import DataLoader, Subset
    from tqdm import tqdm

    loader = DataLoader(
        Subset(dataset, todo),
        batch_size=int(cfg.get("batch_size", 8)),
        shuffle=False,
        num_workers=int(cfg.get("num_workers", 0) or 0),
        collate_fn=list,
    )
    bar = tqdm(total=len(todo), desc="segment-eval", unit="img",
               disable=not ctx.is_main or not cfg.get("progress", True), dynamic_ncols=True)
    pos = 0
    for batch in loader:
        idx = todo[pos : pos + len(batch)]
        pos += len(batch)
        # one backbone pass per input size (model.match_orientation: portrait and landscape)
        for part in input_size_groups(backbone, [s.image for s in batch]):
            _score_batch(cfg, dataset, specs, [batch[j] for j in part], [idx[j] for j in part], states,
                         cache, out_dir, mask_at, fallbacks, timing, backbone)
        bar.update(len(batch))
    bar.close()


def _score_batch(cfg, dataset, specs, batch, idx, states, cache, out_dir, mask_at, fallbacks,
                 timing: _Timing, backbone: Backbone) -> None:
    """Score the images ``batch`` (data set indices ``idx``, one input size) with every
    method that lacks them: one backbone pass, then the metric states, cache files and panels."""
    prompted = backbone.text_conditioned  # FLUX: a class word per image, else the default
    default_class = backbone.default_class
    panels = int(cfg.get("panels", 4) or 0)
    need = [s for s in specs if any(s.key not in states[i] for i in idx)]
    capture = union_capture([s.method for s in need], backbone.num_layers)
    pixels = backbone.collate([s.image for s in batch])
    classes = [s.class_name for s in batch]
    if prompted:
        prompts = batch_prompts(classes, default_class, [s.name for s in batch])
        for j, i in enumerate(idx):
            fallbacks[i] = classes[j] is None
        if any(c is None for c in classes):
            log.warning("no class name for %s: prompted with the default class %r",
                        ", ".join(s.name for s, c in zip(batch, classes) if c is None),
                        default_class)
    else:  # prompts are ignored; passed when every image has one
        prompts = classes if all(c is not None for c in classes) else None
    with torch.inference_mode():
        record: AttentionRecord = backbone.extract(pixels, capture, prompts=prompts)
        targets = _targets(batch)
        panel_rows: dict[int, list] = {j: [] for j, i in enumerate(idx) if i < panels}
        outs = []
        for s in need:
            t_s = time.perf_counter()
            outs.append(s.method(record))
            timing.method_s[s.key] = timing.method_s.get(s.key, 0.0) + time.perf_counter() - t_s
        if dataset.task == "binary":  # all methods' maps of the batch scored together
            new_all = score_binary_many(outs, targets, mask_at, _originals(batch))
        elif dataset.task == "regions":
            new_all = [score_regions(o, targets, s.label) for s, o in zip(need, outs)]
        else:
            new_all = [score_multiclass(o, targets, dataset.num_classes, s.label) for s, o in zip(need, outs)]
        for s, out, new in zip(need, outs, new_all):
            for j, i in enumerate(idx):
                states[i][s.key] = new[j]
            timing.images[s.key] = timing.images.get(s.key, 0) + len(idx)
            if panel_rows:
                _panel_tiles(panel_rows, out, targets, mask_at, s.label, dataset.task,
                             dataset.num_classes)
    for j, i in enumerate(idx):
        cache.save(batch[j].name, states[i], fallbacks.get(i))
    for j, rows in panel_rows.items():
        path = out_dir / "panels" / f"{_SAFE.sub('_', batch[j].name)}.png"
        if dataset.task == "binary":
            write_panel(path, batch[j].image, batch[j].target, rows)
        elif dataset.task == "regions":  # the first human segmentation, in region colours
            write_panel(path, batch[j].image, colour_regions(batch[j].target[0]), rows,
                        columns=["image", "labels (as segment writes them)", "human 1"])
        else:
            write_panel(path, batch[j].image, batch[j].target, rows,
                        columns=["image", "labels (matched class)", "ground truth"],
                        class_names=class_names_of(dataset))


def _panel_tiles(panel_rows, out: MethodOutput, targets, mask_at, label, task, num_classes=2) -> None:
    for j in panel_rows:
        size = tuple(targets[j].shape[-2:])
        one = MethodOutput(
            heatmap=out.heatmap[j : j + 1],
            labels=None if out.labels is None else out.labels[j : j + 1],
            foreground=None if out.foreground is None else out.foreground[j : j + 1],
        )
        if task == "binary":
            ((r, m),) = _method_maps(one, [size], mask_at)
            panel_rows[j].append((label, [_colour_heat(r), _gray(m)]))
        elif task == "regions":  # every region in its own colour
            lab = region_labels(one, 0, size).cpu().numpy()
            panel_rows[j].append((f"{label}: {len(np.unique(lab))} regions", [colour_regions(lab)]))
        else:  # segments coloured by the class the image's Hungarian matching gives them
            lab = labels_at(one.labels, size)[0].cpu().numpy()
            cls = matched_classes(lab, targets[j].numpy(), num_classes)
            panel_rows[j].append((f"{label}: {len(np.unique(lab))} regions", [colour_classes(cls, num_classes)]))
