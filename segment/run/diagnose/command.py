"""The ``segment-diagnose`` command's work: read the images, measure each model
(:mod:`segment.run.diagnose.measure`), write ``diagnostics.json``, ``diagnostics.csv``,
``per_image.csv`` and ``report.html`` (:mod:`segment.run.diagnose.report`)."""

from __future__ import annotations

import csv
import io
import logging
import math
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from PIL import Image

from segment.run.diagnose.measure import DESCRIPTIONS, Diagnosis, build_model, measure_model, model_config
from segment.run.diagnose.report import write_report
from segment.run.front.build import BuildError
from segment.run.io import ImageReadError, InputError, bundled_examples, find_images, read_image
from segment.utils import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    atomic_write_json,
    atomic_write_text,
)

__all__ = ["run_diagnose", "to_json", "write_files"]

log = logging.getLogger(__name__)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def to_json(diag: Diagnosis, per_image: bool = False) -> dict[str, Any]:
    """``diagnostics.json`` as a dict."""
    models = []
    for m in diag.models:
        entry: dict[str, Any] = {
            "name": m.name, "config": m.config, "layers": m.num_layers, "heads": m.num_heads,
            "tokens": m.num_tokens, "prefix": m.prefix, "grid": list(m.grid),
            "images": m.images, "settings": m.settings,
            "seconds": {k: round(v, 3) for k, v in m.seconds.items()},
            "summary": m.summary(),
            "rows": [{k: (_finite(v) if isinstance(v, float) else v) for k, v in r.items()}
                     for r in m.rows()],
        }
        if per_image:
            entry["image_rows"] = m.image_rows()
        models.append(entry)
    return {"measures": DESCRIPTIONS, "models": models, "difference": diag.difference()}


def _csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: (f"{v:.9g}" if isinstance(v, float) else v) for k, v in r.items()})
    return buf.getvalue()


def write_files(diag: Diagnosis, out: str | os.PathLike, *, per_image: bool = False,
                report: bool = True) -> dict[str, Path]:
    """Write ``diagnostics.json``, ``diagnostics.csv`` (and ``per_image.csv``,
    ``report.html``) into ``out``; returns the paths by name."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"json": folder / "diagnostics.json", "csv": folder / "diagnostics.csv"}
    atomic_write_json(paths["json"], to_json(diag, per_image))
    atomic_write_text(paths["csv"], _csv([r for m in diag.models for r in m.rows()]))
    if per_image:
        paths["per_image"] = folder / "per_image.csv"
        atomic_write_text(paths["per_image"], _csv([r for m in diag.models for r in m.image_rows()]))
    if report:
        paths["report"] = write_report(diag, folder / "report.html")
    return paths


# --------------------------------------------------------------------------- the command


def _read_all(root: Path) -> tuple[list[Image.Image], list[str]]:
    listing = find_images(root)
    images, names = [], []
    for f in listing.files:
        try:
            images.append(read_image(f.path).image)
            names.append(f.rel)
        except ImageReadError as e:
            log.warning("skipped %s: %s", f.path, e.reason)
    if not listing.files:
        raise InputError(f"no images found under {str(listing.root)!r}")
    return images, names


def run_diagnose(cfg: DictConfig) -> int:
    """Run ``segment-diagnose`` with a composed config (``configs/diagnose.yaml``); returns
    the exit code: 0 done, 1 no image could be read, 2 unusable input or settings, 130
    interrupted."""
    try:
        with bundled_examples() as examples:
            root = examples if cfg.get("input") is None else Path(str(cfg.input)).expanduser()
            try:
                images, names = _read_all(root)
            except InputError as e:
                log.error("%s", e)
                return EXIT_BAD_INPUT
        if not images:
            log.error("no image under %s could be read", root)
            return EXIT_FAILED
        device = str(cfg.get("device", "auto"))
        models = [cfg.model]
        if cfg.get("compare"):
            # the compare model sees the images at the same input size
            same = {"image_size": OmegaConf.to_container(cfg.model, resolve=False)["image_size"]} \
                if "image_size" in cfg.model else {}
            try:
                compare = model_config(str(cfg.compare), cfg.get("compare_checkpoint"), device,
                                        same, "compare model")
            except ValueError as e:
                log.error("compare=%s: %s", cfg.compare, e)
                return EXIT_BAD_INPUT
            models.append(compare)
        elif cfg.get("compare_checkpoint"):
            log.error("compare_checkpoint=%s needs compare=MODEL", cfg.compare_checkpoint)
            return EXIT_BAD_INPUT
        results = []
        for mcfg in models:
            try:
                backbone = build_model(mcfg, device)
            except BuildError as e:  # one line naming the model
                log.error("%s", e)
                return EXIT_BAD_INPUT
            try:
                results.append(measure_model(
                    backbone, images, names, alpha=float(cfg.alpha),
                    threshold=float(cfg.threshold), top=float(cfg.top),
                    progress=bool(cfg.progress), config=OmegaConf.to_container(mcfg, resolve=True),
                ))
            except ValueError as e:  # e.g. attention that is not a chain (one line)
                log.error("cannot measure %s: %s", mcfg.get("name"), e)
                return EXIT_FAILED
            del backbone
        diag = Diagnosis(models=results)
        paths = write_files(diag, str(cfg.output), per_image=bool(cfg.per_image),
                            report=bool(cfg.report))
    except KeyboardInterrupt:
        log.warning("interrupted")
        return EXIT_INTERRUPTED
    m = diag.models[0]
    log.info("%s: %d layers x %d heads on %d images (forward %.2fs, measures %.2fs)",
             m.name, m.num_layers, m.num_heads, len(m.images), m.seconds["forward"],
             m.seconds["measures"])
    for p in paths.values():
        print(p, flush=True)
    return EXIT_OK
