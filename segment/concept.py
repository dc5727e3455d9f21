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

Unlike the Markov methods this reads attention *outputs*, not probabilities: the attention
probabilities the capture also requests are fused and averaged on the fly (one ``(B, 1, N,
N)`` matrix) and not used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from segment.masks import MethodOutput
from segment.methods import Method
from segment.record import AttentionRecord, Capture

__all__ = ["ConceptAttention", "concept_heatmaps"]


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
    """

    name: str = "concept_attention"
    layers: Sequence[int] | int | None = (14, 15, 16, 17)
    heads: str = "mean"
    average_layers: bool = True
    softmax: bool = True
    concept: int = 0

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

    def capture(self, num_layers: int) -> Capture:
        """The scored layers, attention fused and averaged on the fly (not read here)."""
        layers = Capture(layers=self.layers).resolve(num_layers)
        return Capture(layers=layers, heads="mean", average_layers=len(layers) > 1)

    def __call__(self, record: AttentionRecord) -> MethodOutput:
        scores = record.extras.get("concept_scores")
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
        return MethodOutput(heatmap=maps[:, self.concept].reshape(maps.shape[0], h, w))
