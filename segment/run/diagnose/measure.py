"""``segment-diagnose`` and ``segment.diagnose``: attention diagnostics as a report.

Every head of every layer of a backbone is read as a Markov chain and measured
(:mod:`segment.core.diagnostics`): row entropy, prefix and sink mass, ``|lambda_2|``, the
spectral gap and the number of metastable states, the exact TokenRank's entropy and top
mass, the stable rank, the KL of the rows from uniform. The measures are averaged over the
images (with their standard deviation); a second model (``compare``) is measured on the
same images, and the report shows the two side by side with the per-measure difference.

Files written by the command (``output=DIR``, :mod:`segment.run.diagnose.command`):
``diagnostics.json`` (settings, one row per model, layer and head, per-image rows when
``per_image=true``, the difference of the models), ``diagnostics.csv`` (the head rows),
``per_image.csv`` (with ``per_image=true``) and ``report.html``
(:mod:`segment.run.diagnose.report`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from PIL import Image

from segment.core import diagnostics as dg
from segment.core.record import Capture
from segment.models.base import Backbone
from segment.run.front.build import build
from segment.run.front.compose import config_names, suggest
from segment.run.io import find_images

__all__ = ["DESCRIPTIONS", "Diagnosis", "ModelDiagnostics", "diagnose", "measure_model"]

log = logging.getLogger(__name__)

#: what each measure means, for the files and the report
DESCRIPTIONS = {
    "entropy": "mean row entropy of the attention (nats), 0 .. log N",
    "entropy_frac": "mean row entropy / log N, 0 .. 1",
    "kl_uniform": "mean KL of the rows from uniform (nats)",
    "prefix_mass": "share of attention into the prefix tokens (CLS, registers)",
    "sink_mass": "share of attention into the top 1% of grid tokens",
    "stable_rank": "||A||_F^2 / ||A||_2^2, >= 1",
    "lambda2": "|lambda_2| of the grid chain, 0 .. 1 (near 1: metastable)",
    "gap": "spectral gap 1 - |lambda_2|",
    "metastable": "eigenvalue moduli above 0.9: estimated metastable states",
    "tokenrank_entropy": "entropy of the exact TokenRank (nats)",
    "tokenrank_entropy_frac": "TokenRank entropy / log n, 0 .. 1",
    "tokenrank_top": "TokenRank mass of the top 1% of grid tokens",
}


@dataclass
class ModelDiagnostics:
    """The measures of one model over a set of images.

    Attributes:
        name: the model's name (its config's ``name``).
        config: the model config it was built from (``None`` for a model passed in built).
        num_layers, num_heads: ``L``, ``H``.
        num_tokens: ``N`` (prefix + grid); prefix: prefix tokens; grid: ``(h, w)``.
        images: the images' names, in order.
        mean, std: measure -> ``(L, H)`` mean and standard deviation over the images
            (population std; 0 for one image).
        per_image: measure -> ``(I, L, H)``.
        moduli: ``(L, H, n)`` the grid chains' eigenvalue moduli on the first image.
        tokenrank: ``(L, H, n)`` the exact TokenRank on the first image.
        image: the first image as the backbone saw it (RGB, the input size).
        seconds: ``forward`` (attention capture) and ``measures`` seconds, summed.
        settings: ``alpha``, ``threshold``, ``top``.
    """

    name: str
    config: dict[str, Any] | None
    num_layers: int
    num_heads: int
    num_tokens: int
    prefix: int
    grid: tuple[int, int]
    images: list[str]
    mean: dict[str, np.ndarray]
    std: dict[str, np.ndarray]
    per_image: dict[str, np.ndarray]
    moduli: np.ndarray
    tokenrank: np.ndarray
    image: Image.Image
    seconds: dict[str, float] = field(default_factory=dict)
    settings: dict[str, float] = field(default_factory=dict)

    def rows(self) -> list[dict[str, Any]]:
        """One row per layer and head: every measure's mean and ``<measure>_std``."""
        out = []
        for li in range(self.num_layers):
            for h in range(self.num_heads):
                row: dict[str, Any] = {"model": self.name, "layer": li, "head": h}
                for m in dg.MEASURES:
                    row[m] = float(self.mean[m][li, h])
                    row[f"{m}_std"] = float(self.std[m][li, h])
                out.append(row)
        return out

    def image_rows(self) -> list[dict[str, Any]]:
        """One row per image, layer and head."""
        out = []
        for i, name in enumerate(self.images):
            for li in range(self.num_layers):
                for h in range(self.num_heads):
                    row: dict[str, Any] = {"model": self.name, "image": name, "layer": li, "head": h}
                    row.update({m: float(self.per_image[m][i, li, h]) for m in dg.MEASURES})
                    out.append(row)
        return out

    def summary(self) -> dict[str, float]:
        """Each measure's mean over every head, layer and image."""
        return {m: float(self.mean[m].mean()) for m in dg.MEASURES}


@dataclass
class Diagnosis:
    """What :func:`diagnose` returns: one :class:`ModelDiagnostics` per model (the second
    is the ``compare`` model), measured on the same images."""

    models: list[ModelDiagnostics]

    def difference(self) -> list[dict[str, Any]]:
        """Per measure: the model means over all heads and ``compare - first`` (empty for one
        model)."""
        if len(self.models) < 2:
            return []
        a, b = self.models[0].summary(), self.models[1].summary()
        return [{"measure": m, self.models[0].name: a[m], self.models[1].name: b[m],
                 "difference": b[m] - a[m]} for m in dg.MEASURES]

    def same_shape(self) -> bool:
        """Whether the two models have the same layers x heads (a per-head difference)."""
        return len(self.models) == 2 and (
            (self.models[0].num_layers, self.models[0].num_heads)
            == (self.models[1].num_layers, self.models[1].num_heads)
        )


# --------------------------------------------------------------------------- measuring


def _names(images: Sequence[Any]) -> list[str]:
    out = []
    for k, x in enumerate(images):
        out.append(Path(x).name if isinstance(x, (str, os.PathLike)) else f"image {k}")
    return out


def measure_model(
    backbone: Backbone,
    images: Sequence[Image.Image],
    names: Sequence[str],
    *,
    alpha: float = 0.99,
    threshold: float = 0.9,
    top: float = 0.01,
    progress: bool = False,
    config: dict[str, Any] | None = None,
) -> ModelDiagnostics:
    """Every measure of every head of ``backbone`` on ``images`` (one forward each).

    Args:
        backbone: a built :class:`segment.models.base.Backbone`.
        images: RGB images.
        names: one name per image.
        alpha, threshold, top: see :func:`segment.core.diagnostics.diagnose_heads`.
        progress: a tqdm bar on stderr.
        config: the model config, recorded in the files.
    """
    from tqdm import tqdm

    if not images:
        raise ValueError("no images to diagnose")
    capture = Capture(layers=None, heads="keep")
    per: dict[str, list[np.ndarray]] = {m: [] for m in dg.MEASURES}
    first: dg.HeadDiagnostics | None = None
    layout = None
    seen: Image.Image | None = None
    t_fwd = t_meas = 0.0
    bar = tqdm(total=len(images), unit="img", desc=f"diagnose {backbone.name}",
               disable=not progress, dynamic_ncols=True)
    try:
        for im in images:
            t0 = time.perf_counter()
            px = backbone.preprocess(im).unsqueeze(0)
            with torch.no_grad():
                rec = backbone.extract(px, capture)
            attn = torch.stack([rec.attn[i][0] for i in rec.layers])  # (L, H, N, N)
            t1 = time.perf_counter()
            d = dg.diagnose_heads(attn, rec.layout.prefix, alpha=alpha, threshold=threshold, top=top)
            t_meas += time.perf_counter() - t1
            t_fwd += t1 - t0
            for m, v in d.measures().items():
                per[m].append(v.cpu().numpy())
            if first is None:
                first, layout = d, rec.layout
                if rec.pixels is not None:
                    rgb = (rec.pixels[0].float().cpu().permute(1, 2, 0).numpy() * 255).round()
                    seen = Image.fromarray(rgb.astype(np.uint8))
                else:
                    seen = im
            bar.update(1)
    finally:
        bar.close()
    assert first is not None and layout is not None and seen is not None
    stacked = {m: np.stack(v) for m, v in per.items()}  # (I, L, H)
    num_layers, num_heads = stacked["entropy"].shape[1:]
    return ModelDiagnostics(
        name=str(backbone.name), config=config, num_layers=int(num_layers),
        num_heads=int(num_heads), num_tokens=int(layout.num_tokens), prefix=int(layout.prefix),
        grid=tuple(layout.grid), images=list(names),
        mean={m: v.mean(0) for m, v in stacked.items()},
        std={m: v.std(0) for m, v in stacked.items()},
        per_image=stacked, moduli=first.moduli.cpu().numpy(),
        tokenrank=first.tokenrank.cpu().numpy(), image=seen,
        seconds={"forward": t_fwd, "measures": t_meas},
        settings={"alpha": float(alpha), "threshold": float(threshold), "top": float(top)},
    )


def model_config(name: str, checkpoint: str | os.PathLike | None, device: str,
                  overrides: dict[str, Any], what: str = "model") -> DictConfig:
    from segment.run.api.segmenter import compose_config

    names = config_names("model")
    if name not in names:
        raise ValueError(f"unknown {what} {name!r}{suggest(name, names)}; choose one of: {', '.join(names)}")
    cfg = compose_config(name, checkpoint=checkpoint, device=device,
                         **{f"model.{k}" if not k.startswith("model.") else k: v
                            for k, v in overrides.items()})
    return cfg.model


def build_model(model_cfg: DictConfig, device: str) -> Backbone:
    """The backbone of a model config on ``device`` (``${device}`` in the config resolves to it).

    Raises:
        BuildError: (a ``ValueError``) one line naming the model and the problem.
    """
    cfg = OmegaConf.create({"device": device, "model": model_cfg})
    return build(cfg.model, Backbone, f"the model {model_cfg.get('name')}")


def diagnose(
    images: Any,
    model: str = "dinov2_vits14",
    checkpoint: str | os.PathLike | None = None,
    *,
    compare: str | None = None,
    compare_checkpoint: str | os.PathLike | None = None,
    device: str = "auto",
    alpha: float = 0.99,
    threshold: float = 0.9,
    top: float = 0.01,
    progress: bool = False,
    **overrides: Any,
) -> Diagnosis:
    """The attention diagnostics of a model (and optionally a second one) on images.

    Args:
        images: one image or a list: paths, PIL images, uint8 arrays, ``(3, H, W)`` tensors
            in ``[0, 1]`` (as :func:`segment.load`'s segmenter takes them), or a folder path
            (every image under it).
        model: a ``configs/model`` name.
        checkpoint: local weights of ``model`` (``model.checkpoint``).
        compare: a second ``configs/model`` name measured on the same images.
        compare_checkpoint: local weights of ``compare``.
        device: ``auto``, ``cpu``, ``cuda``...
        alpha, threshold, top: see :func:`segment.core.diagnostics.diagnose_heads`.
        progress: tqdm bars on stderr.
        **overrides: keys of the model config (``image_size=448``), for both models.

    Returns:
        :class:`Diagnosis`; ``.models[0].rows()`` gives one row per layer and head.

    Raises:
        ValueError: an unknown model or key (with a suggestion), or no images.
        ImageReadError: a file that cannot be read.
    """
    from segment.run.api.segmenter import to_image

    if isinstance(images, (str, os.PathLike)) and Path(images).expanduser().is_dir():
        listing = find_images(images)
        if not listing.files:
            raise ValueError(f"no images under {str(listing.root)!r}")
        images = [f.path for f in listing.files]
    items = list(images) if isinstance(images, (list, tuple)) else [images]
    if not items:
        raise ValueError("no images to diagnose")
    names = _names(items)
    pil = [to_image(x) for x in items]
    cfgs = [model_config(model, checkpoint, device, overrides)]
    if compare is not None:
        cfgs.append(model_config(compare, compare_checkpoint, device, overrides, "compare model"))
    out = []
    for cfg in cfgs:
        backbone = build_model(cfg, device)
        out.append(measure_model(
            backbone, pil, names, alpha=alpha, threshold=threshold, top=top, progress=progress,
            config=OmegaConf.to_container(cfg, resolve=False),
        ))
        del backbone
    return Diagnosis(models=out)


# --------------------------------------------------------------------------- files
