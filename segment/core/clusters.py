"""Clustering of token features: the k-means baseline of unsupervised segmentation.

k-means runs through scikit-learn (``sklearn.cluster.KMeans``: greedy k-means++ seeding,
Lloyd iterations, a fixed ``random_state``), per image, on the CPU in float64.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["kmeans_labels", "token_features"]


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


def kmeans_labels(
    features: Tensor,
    k: int,
    max_iter: int = 20,
    n_init: int = 1,
    seed: int = 0,
) -> Tensor:
    """k-means cluster of every point, per batch element.

    Args:
        features: ``(B, n, D)`` points.
        k: number of clusters, ``1 <= k <= n``.
        max_iter: Lloyd iterations at most (scikit-learn's ``max_iter``).
        n_init: k-means++ restarts; the lowest inertia wins.
        seed: ``random_state`` (the same for every image: deterministic).

    Returns:
        ``(B, n)`` int64 cluster ids in ``[0, k)`` (on ``features.device``).
    """
    from sklearn.cluster import KMeans

    if features.dim() != 3:
        raise ValueError(f"features must be (B, n, D), got {tuple(features.shape)}")
    b, n, _ = features.shape
    k = int(k)
    if not 1 <= k <= n:
        raise ValueError(f"k must lie in 1..{n} (the number of tokens), got {k}")
    if int(max_iter) < 1 or int(n_init) < 1:
        raise ValueError(f"max_iter and n_init must be >= 1, got {max_iter}, {n_init}")
    x = features.detach().to("cpu", torch.float64).numpy()
    out = np.empty((b, n), dtype=np.int64)
    for i in range(b):
        km = KMeans(n_clusters=k, init="k-means++", n_init=int(n_init), max_iter=int(max_iter),
                    random_state=int(seed))
        out[i] = km.fit_predict(x[i])
    return torch.from_numpy(out).to(features.device)
