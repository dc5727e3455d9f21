"""What a ``segment`` run knows: its settings (read once from the config) and its mutable
state (what it found, decided and did), passed explicitly to the planner
(:mod:`segment.run.job.plan`), the stage runner (:mod:`segment.run.job.stages`), the summary
writer (:mod:`segment.run.job.summary`) and the torchrun merge (:mod:`segment.run.job.shard`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from segment.core.masks import label_upsampling_setting
from segment.run.io import ImageFile
from segment.run.api.render import RenderOptions
from segment.run.job.manifest import ImageStatus
from segment.run.job.records import ImageRecord

__all__ = ["RunSettings", "RunState", "Timings", "config_fingerprint", "output_settings", "refusal_key"]


def _clean(node: Any) -> Any:
    """A config node as plain data, ``device`` left out (it decides no output)."""
    if node is None:
        return None
    d = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    if isinstance(d, dict):
        d = {k: v for k, v in d.items() if k != "device"}
    return d


def refusal_key(cfg: Any) -> str:
    """Hash of the settings that decide whether a readable image is refused: ``max_pixels``
    and ``min_size``, and with ``min_size: null`` (one patch of the model) the model config
    (``device`` left out). ``cfg``: a composed ``segment`` config or run.json's ``config``.
    A file an earlier run refused is not read again while its size, its mtime and this key
    are unchanged (:func:`segment.run.job.plan.known_unreadable`)."""
    get = cfg.get
    min_size = get("min_size")
    blob = {"max_pixels": get("max_pixels"), "min_size": min_size,
            "model": _clean(get("model")) if min_size is None else None}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:16]


def output_settings(cfg: Any) -> dict[str, Any]:
    """What decides an image's outputs, as plain data: the model and method configs
    (``device`` left out), the rendering options (``fsync`` left out) and
    ``label_upsampling``; the other settings (``progress``, ``num_workers``, ``limit``,
    ``output``...) decide none. ``cfg``: a composed ``segment`` config or run.json's
    ``config``. :func:`config_fingerprint` hashes it; a rerun names what changed in it
    (:func:`segment.run.job.rerun.setting_changes`)."""
    clean = _clean
    return {
        "model": clean(cfg.get("model")),
        "method": clean(cfg.get("method")),
        "render": {k: v for k, v in (clean(cfg.get("render")) or {}).items() if k != "fsync"},
        "label_upsampling": label_upsampling_setting(cfg.get("label_upsampling")),
    }


def config_fingerprint(cfg: DictConfig) -> str:
    """Hash of what decides an image's outputs (:func:`output_settings`). Records with
    another fingerprint are redone."""
    blob = output_settings(cfg)
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RunSettings:
    """The run settings of a composed ``segment`` config, checked (:meth:`from_config`).

    Attributes:
        out: the output folder (absolute).
        opts: how the per-image files look (``render.*``).
        batch_size: images per forward pass.
        num_workers: reader and writer threads; 0 = chosen for the device when the model
            is built.
        max_pixels: refuse larger images (``None``: Pillow's limit).
        min_size: refuse images with a smaller side (``None``: one patch of the model).
        overwrite: redo images whose record is current.
        limit: segment only the first ``limit`` images of the sorted listing (``None``: all).
        retry_skipped: read again the files an earlier run refused (unreadable, too large,
            too small; also with ``overwrite``).
        progress: a tqdm bar on stderr (rank 0 only).
        fingerprint: :func:`config_fingerprint` of the config.
        refusals: :func:`refusal_key` of the config.
        input_desc: the input as given (``bundled examples`` without ``input=``).
    """

    out: Path
    opts: RenderOptions
    batch_size: int
    num_workers: int
    max_pixels: Any
    min_size: Any
    overwrite: bool
    limit: int | None
    retry_skipped: bool
    progress: bool
    fingerprint: str
    refusals: str
    input_desc: str

    @classmethod
    def from_config(cls, cfg: DictConfig, *, is_main: bool = True) -> RunSettings:
        """The settings of ``cfg``; ``is_main``: this process is rank 0 (the one with a bar).

        Raises:
            ValueError: a setting out of range (``batch_size``, ``num_workers``,
                ``label_upsampling``, ``retry_skipped``), in that order.
            TypeError: an unknown ``render`` option.
        """
        opts = RenderOptions(**(OmegaConf.to_container(cfg.render, resolve=True) if cfg.get("render") else {}))
        out = Path(str(cfg.output)).expanduser().resolve()
        bs = cfg.get("batch_size")
        batch_size = 1 if bs is None else int(bs)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {bs}")
        nw = cfg.get("num_workers")
        num_workers = int(nw) if nw is not None else 0
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0 (0 or null = automatic), got {nw}")
        label_upsampling_setting(cfg.get("label_upsampling"))  # refused before the model is built
        overwrite = bool(cfg.get("overwrite", False))
        retry = cfg.get("retry_skipped", False)
        if not isinstance(retry, bool):
            raise ValueError(f"retry_skipped must be true or false, got {retry!r}")
        return cls(
            out=out, opts=opts, batch_size=batch_size, num_workers=num_workers,
            max_pixels=cfg.get("max_pixels"), min_size=cfg.get("min_size"), overwrite=overwrite,
            limit=None if cfg.get("limit") is None else int(cfg.limit),
            retry_skipped=retry or overwrite, progress=bool(cfg.get("progress", True)) and is_main,
            fingerprint=config_fingerprint(cfg), refusals=refusal_key(cfg),
            input_desc="bundled examples" if cfg.get("input") is None else str(cfg.input),
        )


@dataclass
class Timings:
    """Seconds spent in each part of a run (``run.json``'s ``timings``)."""

    scan_s: float = 0.0
    plan_s: float = 0.0
    model_load_s: float = 0.0
    processing_s: float = 0.0
    summary_s: float = 0.0
    read_s: float = 0.0  # summed over loader threads
    model_s: float = 0.0  # backbone forward with capture (Segmenter.extract), main thread
    method_s: float = 0.0  # the method on the records (Segmenter.apply), method thread
    write_s: float = 0.0  # summed over writer threads
    wait_input_s: float = 0.0  # main thread waiting for decoded images
    extra: dict[str, float] = field(default_factory=dict)

    def rounded(self) -> dict[str, float]:
        """Every timing (the fields, then ``extra``) in seconds, to 0.1 ms."""
        out = {k: round(v, 4) for k, v in self.__dict__.items() if isinstance(v, float)}
        out.update({k: round(v, 4) for k, v in self.extra.items()})
        return out


@dataclass
class RunState:
    """The mutable state of one run (of this rank, under torchrun).

    Attributes:
        files: every image of the input, sorted (all ranks see the same list).
        ignored: the other files of the input and why (``(relative path, reason)``).
        input_root: the folder the input was listed from (``None`` before the scan).
        mine: this rank's share of ``files`` (all of them in one process).
        statuses: per image name, what became of it (done, resumed, skipped).
        records: per image name, its record (made now or by an earlier run).
        known_bad: refused files skipped again without reading (see
            :func:`segment.run.job.plan.plan_items`).
        too_large: files refused from their header for more pixels than ``max_pixels``,
            before the model loads (:func:`segment.run.job.plan.refuse_too_large`).
        timings: seconds per part of the run.
        device: the device the model runs on, once built.
        started: when the run started (UTC).
        interrupted: it stopped on Ctrl-C (or, on rank 0 under torchrun, any rank did).
        error: the run-level error line, if any.
        fault: the first write the output file system refused (why, which file).
        unwritten: the run-level files that could not be written.
        writing: the output folder is in use, so the run-level files are written.
        gallery: ``index.html``, once written.
        ranks: per-rank summaries (torchrun, rank 0).
        previous: the run.json an earlier run left in the output folder (``None``: none).
        changes: the output settings changed since ``previous``
            (:func:`segment.run.job.rerun.setting_changes`).
        stale_removed: the level folders this run removed as stale
            (:func:`segment.run.job.rerun.remove_stale`).
        stale_kept: the possibly stale level folders it kept (``{"folder", "reason"}``).
    """

    files: list[ImageFile] = field(default_factory=list)
    ignored: list[tuple[str, str]] = field(default_factory=list)
    input_root: Path | None = None
    mine: list[ImageFile] = field(default_factory=list)
    statuses: dict[str, ImageStatus] = field(default_factory=dict)
    records: dict[str, ImageRecord] = field(default_factory=dict)
    known_bad: int = 0
    too_large: int = 0
    timings: Timings = field(default_factory=Timings)
    device: torch.device | None = None
    started: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    interrupted: bool = False
    error: str | None = None
    fault: str | None = None
    unwritten: list[str] = field(default_factory=list)
    writing: bool = False
    gallery: Path | None = None
    ranks: list[dict[str, Any]] | None = None
    previous: dict[str, Any] | None = None
    changes: list[Any] = field(default_factory=list)
    stale_removed: list[str] = field(default_factory=list)
    stale_kept: list[dict[str, str]] = field(default_factory=list)

    def count(self, *status: str) -> int:
        """How many images have one of these statuses."""
        return sum(s.status in status for s in self.statuses.values())
