"""Token features for clustering: the k-means baseline of unsupervised segmentation.

The k-means itself runs through scikit-learn (``segment.backends.kmeans_labels``: greedy
k-means++ seeding, Lloyd iterations, a fixed ``random_state``, per image, on the CPU in
float64); the core stays torch/numpy only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["token_features"]


def token_features(keys: Tensor) -> Tensor:
    """Per-token feature from per-head keys: heads concatenated, then L2-normalised.

    Args:
        keys: ``(B, H, n, D)`` keys of the grid tokens.

    Returns:
        ``(B, n, H * D)`` unit vectors (float32).
    """
    if keys.dim() != 4:
        raise ValueError(f"keys must be (B, H, n, D), got {tuple(keys.shape)}")
    return F.normalize(keys.float().transpose(1, 2).flatten(2), dim=-1)
