"""ConceptAttention (Helbling et al. 2025), the FLUX baseline of the ImageNet-segmentation table.

A DiT backbone with concept words (``model.concepts``; the class is concept 0) runs a separate
concept residual stream through its double-stream blocks and records, for each captured
layer ``l`` and noise seed ``s``, the dot products of the concept and image attention-output
vectors (before the output projections), ``S_{s,l} = O_c O_x^T`` of shape ``(C, P)``
(``AttentionRecord.extras["concept_scores"]``, see :mod:`segment.models.flux`). The heatmap
of concept ``c`` is

    ``R_c = mean_{s, l} softmax_c(S_{s,l})[c]``

(softmax over the concepts per layer and seed, then the mean, as the reference
implementation); the class's map ``R_0`` on the ``h x w`` token grid is the method's output
and goes through the usual protocol §3 post-processing. ``softmax: false`` averages the raw
dot products instead.

Two options of ConceptAttention's ImageNet-segmentation script:

* ``normalize_concepts`` (its ``--normalize_concepts``): per output dimension ``d`` the
  concept vectors are min-shifted and divided by their sum over the concepts,
  ``O'_{c,d} = (O_{c,d} - min_k O_{k,d}) / sum_k (O_{k,d} - min_k O_{k,d})`` (a dimension
  where all concepts agree gives zeros), before the dot products; the backbone scores both versions
  (``extras["concept_scores_normalized"]``, see :func:`normalize_concepts`).
* ``blur`` (its ``--apply_blur``: ``[3, 1.0]``): a ``k x k`` Gaussian of standard deviation
  ``sigma`` over the averaged ``h x w`` map, reflect-padded (torchvision's
  ``gaussian_blur``), before the threshold and the AP (:func:`gaussian_blur`).

Unlike the Markov methods this reads attention *outputs*, not probabilities: the attention
probabilities the capture also requests are fused and averaged on the fly (one ``(B, 1, N,
N)`` matrix) and not used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from segment.masks import MethodOutput
from segment.methods import Method
from segment.record import AttentionRecord, Capture

__all__ = ["ConceptAttention", "concept_heatmaps", "gaussian_blur", "normalize_concepts"]


def normalize_concepts(vectors: Tensor) -> Tensor:
    """ConceptAttention's concept normalisation, per output dimension over the concepts.

    Args:
        vectors: ``(..., C, D)`` concept vectors.

    Returns:
        ``(..., C, D)``: ``(x - min_c x) / sum_c (x - min_c x)`` per ``d``; a dimension where
        all concepts are equal (zero sum) becomes all zeros.
    """
    if vectors.dim() < 2:
        raise ValueError(f"concept vectors must be (..., C, D), got {tuple(vectors.shape)}")
    shifted = vectors - vectors.amin(-2, keepdim=True)
    total = shifted.sum(-2, keepdim=True)
    return shifted / torch.where(total == 0, torch.ones_like(total), total)


def gaussian_blur(maps: Tensor, kernel: int = 3, sigma: float = 1.0) -> Tensor:
    """A ``kernel x kernel`` Gaussian blur of ``(..., h, w)`` maps with reflect padding.

    The kernel is ``g g^T`` with ``g_i = exp(-x_i^2 / (2 sigma^2)) / sum``, ``x`` the
    ``kernel`` points of ``[-(kernel-1)/2, (kernel-1)/2]`` (torchvision's ``gaussian_blur``).

    Args:
        maps: ``(..., h, w)`` float maps, ``h, w > kernel // 2``.
        kernel: odd kernel size ``>= 3``.
        sigma: standard deviation in grid cells, ``> 0``.

    Returns:
        ``(..., h, w)`` blurred maps, same dtype.
    """
    k, sd = int(kernel), float(sigma)
    if k < 3 or k % 2 == 0 or not sd > 0 or not math.isfinite(sd):
        raise ValueError(f"blur needs an odd kernel >= 3 and sigma > 0, got {kernel}, {sigma}")
    h, w = maps.shape[-2:]
    pad = k // 2
    if min(h, w) <= pad:
        raise ValueError(f"a {k}x{k} blur needs maps larger than {pad} cells, got {h}x{w}")
    x = torch.arange(k, dtype=torch.float64) - (k - 1) / 2
    g = torch.exp(-0.5 * (x / sd) ** 2)
    g = (g / g.sum()).to(device=maps.device, dtype=maps.dtype)
    flat = maps.reshape(-1, 1, h, w)
    flat = F.pad(flat, (pad, pad, pad, pad), mode="reflect")
    flat = F.conv2d(flat, (g[:, None] * g[None, :])[None, None])
    return flat.reshape(maps.shape)


def concept_heatmaps(scores: Tensor, softmax: bool = True) -> Tensor:
    """ConceptAttention maps from per-run concept-image scores.

    Args:
        scores: ``(B, R, C, P)`` dot products of concept and image output vectors for ``R``
            runs (layers x seeds).
        softmax: softmax over the ``C`` concepts per run before averaging.

    Returns:
        ``(B, C, P)`` float32 mean over the runs.
    """
    if scores.dim() != 4:
        raise ValueError(f"concept scores must be (B, R, C, P), got {tuple(scores.shape)}")
    x = scores.float()
    if softmax:
        x = torch.softmax(x, dim=-2)
    return x.mean(1)


@dataclass
class ConceptAttention(Method):
    """ConceptAttention's heatmap of the class concept (concept 0).

    Attributes:
        layers: double-stream layers whose scores are averaged (protocol §3: 14-17 of 19).
        softmax: softmax over concepts per layer and seed before averaging.
        concept: index of the concept whose map is returned (0 = the class).
        normalize_concepts: score with the normalised concept vectors (module docstring).
        blur: ``None`` or ``[kernel, sigma]``: Gaussian blur of the averaged map
            (``[3, 1.0]`` = the script's ``--apply_blur``).
    """

    name: str = "concept_attention"
    layers: Sequence[int] | int | None = (14, 15, 16, 17)
    heads: str = "mean"
    average_layers: bool = True
    _averages_layers: ClassVar[bool] = False  # always true here, checked below
    softmax: bool = True
    concept: int = 0
    normalize_concepts: bool = False
    blur: Sequence[float] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.heads != "mean" or not self.average_layers:
            raise ValueError(
                f"{self.name}: heads and average_layers do not apply (the method reads attention"
                " outputs, averaged over layers and seeds); leave them unset"
            )
        if int(self.concept) < 0:
            raise ValueError(f"{self.name}: concept must be >= 0, got {self.concept}")
        self.concept = int(self.concept)
        self.normalize_concepts = bool(self.normalize_concepts)
        if self.blur is not None:
            vals = list(self.blur) if not isinstance(self.blur, (int, float, str)) else [self.blur]
            if len(vals) != 2:
                raise ValueError(
                    f"{self.name}: blur must be null or [kernel, sigma] (e.g. [3, 1.0]), got {self.blur!r}"
                )
            k, sd = vals
            if float(k) != int(float(k)) or int(float(k)) < 3 or int(float(k)) % 2 == 0 or not float(sd) > 0:
                raise ValueError(
                    f"{self.name}: blur needs an odd kernel >= 3 and sigma > 0, got {self.blur!r}"
                )
            self.blur = (int(float(k)), float(sd))

    def capture(self, num_layers: int) -> Capture:
        """The scored layers, attention fused and averaged on the fly (not read here)."""
        try:
            layers = Capture(layers=self.layers).resolve(num_layers)
        except ValueError as e:  # e.g. the protocol's layers 14-17 asked of a 12-block ViT
            raise ValueError(
                f"{self.name}: {e}; it scores concept words in a DiT's double-stream layers"
                " (model=flux_schnell or flux_dev: layers 14-17 of 19); set method.layers to"
                " double-stream layers this model has"
            ) from e
        return Capture(layers=layers, heads="mean", average_layers=len(layers) > 1)

    def __call__(self, record: AttentionRecord) -> MethodOutput:
        key = "concept_scores_normalized" if self.normalize_concepts else "concept_scores"
        scores = record.extras.get(key)
        tags = record.extras.get("concept_layers")
        if scores is None or tags is None:
            raise ValueError(
                f"{self.name}: the record has no concept scores; use a DiT backbone with concept"
                " words (model=flux_schnell, model.concepts=[...]) and capture its double-stream"
                " layers"
            )
        layers = self._resolve(record)
        tags = tags.to(scores.device)
        missing = [i for i in layers if not bool((tags == i).any())]
        if missing:
            have = sorted({int(t) for t in tags.tolist()})
            raise ValueError(
                f"{self.name}: no concept scores for layers {missing} (have {have}; concepts"
                " are scored on double-stream layers only)"
            )
        keep = torch.isin(tags, torch.as_tensor(layers, device=tags.device))
        maps = concept_heatmaps(scores[:, keep], softmax=self.softmax)  # (B, C, P)
        if self.concept >= maps.shape[1]:
            raise ValueError(f"{self.name}: concept {self.concept} of {maps.shape[1]} concepts")
        h, w = record.layout.grid
        if maps.shape[-1] != h * w:
            raise ValueError(f"{self.name}: {maps.shape[-1]} image tokens for a {h}x{w} grid")
        heat = maps[:, self.concept].reshape(maps.shape[0], h, w)
        if self.blur is not None:
            heat = gaussian_blur(heat, *self.blur)
        return MethodOutput(heatmap=heat)
