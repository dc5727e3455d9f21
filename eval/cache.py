"""The per-image metric cache of ``segment-eval``: ``output/cache/<fingerprint>/<image>.json``.

The fingerprint (:func:`fingerprint`) covers the model, the data set, the post-processing,
the package version, :data:`CACHE_VERSION` and the source of the backbone, data set and
scoring modules (the record, reduction, masks and metrics modules and the backbone and data
set bases; a change elsewhere that changes scores, e.g. in :mod:`segment.eval.scoring`,
must raise :data:`CACHE_VERSION`). Each image's file holds one state per method, keyed by
the method's config and the source of its class's modules and of the Markov core
(:func:`segment.eval.specs.method_key`), so a rerun with the same ``output`` skips images
already scored, adding a method scores only that method, and an upgrade or a code change
never mixes old and new numbers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from segment.eval.metrics import State, state_from_dict
from segment.eval.specs import config_hash, source_hash

import segment
from segment.datasets.base import SegmentationDataset
from segment.utils import atomic_path

log = logging.getLogger(__name__)

# bump when a change outside the hashed modules (see fingerprint, method_key) changes scores;
# segment.eval.scoring (the evaluator's post-processing) is such a module: it is not in
# _SCORING, as segment.eval.runner, where that code lived before, was not
CACHE_VERSION = 7  # 7: region and multi-class states hold the regions' escape probabilities
# 6: multi-class states hold region counts and small-region pixels
# what turns a method's output into scores
_SCORING = ("segment.core.record", "segment.core.reduce", "segment.core.masks", "segment.eval.metrics",
            "segment.models.base", "segment.datasets.base", "segment.eval.hierarchy", "segment.eval.trees")

SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")
"""What is replaced by ``_`` when an item's name becomes a file name (cache files, panels)."""


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
        safe = SAFE_NAME.sub("_", name)
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
            states = {k: _from_dict(v) for k, v in data["methods"].items()}
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


def _from_dict(d: dict) -> Any:
    """A cached state: a metric state, or a hierarchy's per-image scores
    (:class:`segment.eval.hierarchy.ImageScores`, kind ``hierarchy``)."""
    if d.get("kind") == "hierarchy":
        from segment.eval.hierarchy import ImageScores

        return ImageScores.from_dict(d)
    return state_from_dict(d)


def cache_dir(out_dir: Path, cfg: DictConfig, dataset: SegmentationDataset) -> Path:
    """``out_dir/cache/<fingerprint>``: where a run of ``cfg`` over ``dataset`` keeps its
    per-image states (the data set's ``selection_keys`` left out of the fingerprint)."""
    return out_dir / "cache" / fingerprint(cfg, dataset.selection_keys)


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
    eigen = cfg.get("eigen")  # a chosen eigensolver may break near-ties otherwise: its own key
    return config_hash({
        **({"eigen": eigen} if eigen is not None else {}),
        "model": model, "dataset": data, "mask_at": cfg.get("mask_at", "image"),
        "version": segment.__version__, "cache": CACHE_VERSION,
        "code": source_hash([*(t for t in targets if t), *_SCORING]),
    })

