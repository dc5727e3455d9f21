"""The backbone contract: every model (timm ViT or diffusers DiT) implements this.

Adding a backbone = one file in ``models/`` implementing :class:`Backbone` + one config in
``configs/model/`` whose ``_target_`` builds it.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch
from PIL import Image
from torch import Tensor

from segment.core.record import AttentionRecord, Capture


class Backbone(abc.ABC):
    """A model whose attention is read as Markov chains.

    Attributes:
        name: short name for tables and manifests.
        num_layers: number of attention layers (blocks) that can be captured.
        num_heads: attention heads per layer.
        device: where the model runs.
    """

    name: str
    num_layers: int
    num_heads: int
    device: torch.device

    @abc.abstractmethod
    def preprocess(self, image: Image.Image) -> Tensor:
        """One RGB PIL image -> ``(3, H, W)`` model input (resized and normalised)."""

    def collate(self, images: Sequence[Image.Image]) -> Tensor:
        """A list of RGB images -> ``(B, 3, H, W)`` batch (same size after preprocessing)."""
        return torch.stack([self.preprocess(im) for im in images])

    @abc.abstractmethod
    def extract(
        self,
        pixels: Tensor,
        capture: Capture,
        *,
        prompts: Sequence[str] | None = None,
    ) -> AttentionRecord:
        """Run the model on ``(B, 3, H, W)`` pixels and capture attention per ``capture``.

        Args:
            pixels: a preprocessed batch.
            capture: which layers to keep and how to reduce them while running.
            prompts: per-image class names (text-conditioned backbones; ViTs ignore them).
        """

    @abc.abstractmethod
    def forward_plain(self, pixels: Tensor) -> Tensor:
        """The bare forward pass (fused attention, nothing captured): the speed baseline."""
