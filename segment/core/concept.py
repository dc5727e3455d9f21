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

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["concept_heatmaps", "gaussian_blur", "normalize_concepts"]


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
