"""k-means of the keys: the unsupervised-segmentation baseline."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from segment.core.masks import MethodOutput
from segment.core.record import AttentionRecord, Capture
from segment.methods.base import Method, knob, layer_tuple
from segment.methods.stages import ForegroundScore, foreground_score


@dataclass(frozen=True)
class KMeansKeys(Method):
    """k-means of the patch keys: the baseline of unsupervised segmentation papers.

    1. features: per grid token, the keys of every head of a selected layer concatenated and
       L2-normalised (:func:`segment.core.clusters.token_features`); several ``layers`` are
       concatenated (each normalised);
    2. ``k`` clusters by scikit-learn's ``KMeans`` (k-means++ seeding, ``max_iter`` Lloyd
       steps, ``n_init`` restarts, ``random_state = seed``), per image;
    3. the one-hot cluster map on the grid is upsampled bilinearly to the backbone input and
       every pixel takes its argmax (region ids ``0 .. k-1``, as :class:`RegionGrow` gives);
    4. foreground (binary tasks): a cluster whose mean CLS attention (``score_layers``, mean
       of heads, on the grid) exceeds the grid mean; the heatmap is every pixel's cluster
       score under the bilinear soft assignment.

    Returns ``MethodOutput(heatmap, labels, foreground)`` at the backbone input resolution.
    """

    name: str = knob("kmeans", "the method's name in tables, manifests and file records")
    gives_labels: ClassVar[bool] = True
    layers: Sequence[int] | int | None = knob(
        (-1,), "the layers whose keys are clustered (several: their features concatenated)")
    k: int = knob(8, "clusters per image")
    max_iter: int = knob(20, "Lloyd iterations at most")
    n_init: int = knob(1, "k-means++ restarts (the lowest inertia wins)")
    seed: int = knob(0, "scikit-learn's random_state (the same for every image: deterministic)")
    score_layers: Sequence[int] | int | None = knob(
        (-1,), "the layers whose CLS attention (mean of heads) decides the foreground")

    def __post_init__(self) -> None:
        super().__post_init__()
        if int(self.k) < 1 or int(self.max_iter) < 1 or int(self.n_init) < 1:
            raise ValueError(
                f"{self.name}: k, max_iter and n_init must be >= 1, got {self.k}, {self.max_iter},"
                f" {self.n_init}"
            )
        object.__setattr__(self, "score_layers",
                           layer_tuple(self.score_layers, self.name, "score_layers"))

    @property
    def scoring(self) -> ForegroundScore:
        """The foreground score: the CLS attention of ``score_layers`` (mean of heads)."""
        return ForegroundScore(layers=self.score_layers)

    def capture(self, num_layers: int) -> Capture:
        mine = Capture(layers=Capture(layers=self.layers).resolve(num_layers), heads="mean",
                       keys=True)
        return mine.union(self.scoring.capture(num_layers), num_layers)

    def features(self, record: AttentionRecord) -> Tensor:
        """``(B, n, F)`` the clustered token features."""
        from segment.core.clusters import token_features

        feats = []
        for i in self._resolve(record):
            if i not in record.keys:
                raise ValueError(
                    f"{self.name}: needs the keys of layer {i}; capture with"
                    " method.capture(num_layers) (Capture.keys)"
                )
            feats.append(token_features(record.keys[i][:, :, record.layout.patches]))
        return torch.cat(feats, -1)

    def __call__(self, record: AttentionRecord) -> MethodOutput:
        from segment.backends import kmeans_labels
        from segment.core import regions as rg

        h, w = record.layout.grid
        feats = self.features(record)  # (B, n, F)
        b = feats.shape[0]
        k = int(self.k)
        grid = kmeans_labels(feats, k, int(self.max_iter), int(self.n_init), int(self.seed))
        onehot = F.one_hot(grid, k).to(torch.float32).transpose(1, 2).reshape(b, k, h, w)
        cls = foreground_score(record, self.scoring, self.name).to(onehot.device)  # (B, h, w)
        score = rg.region_scores(grid.view(b, h, w), cls, k)  # (B, k) mean CLS per cluster
        prob = F.interpolate(onehot, size=tuple(record.image_size), mode="bilinear",
                             align_corners=False)
        labels = prob.argmax(1)  # (B, H, W)
        present = torch.zeros(b, k, dtype=torch.bool, device=labels.device)
        present.scatter_(1, labels.flatten(1), True)
        foreground = (score > cls.flatten(1).mean(1, keepdim=True)) & present
        heat = torch.einsum("bkhw,bk->bhw", prob, score.to(prob))
        return MethodOutput(heatmap=heat, labels=labels, foreground=foreground)

