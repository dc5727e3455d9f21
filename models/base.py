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

    def input_size(self, image: Image.Image) -> tuple[int, int] | None:
        """``(H, W)`` of :meth:`preprocess` for ``image``; ``None`` when every image gets the
        same size (callers batch images of one input size together)."""
        return None

    def collate(self, images: Sequence[Image.Image]) -> Tensor:
        """A list of RGB images -> ``(B, 3, H, W)`` batch (same size after preprocessing;
        images of different input sizes are refused in one line)."""
        pixels = [self.preprocess(im) for im in images]
        sizes = sorted({tuple(x.shape[-2:]) for x in pixels})
        if len(sizes) > 1:
            raise ValueError(
                f"{self.name}: one batch needs one input size, got {' and '.join(f'{h}x{w}' for h, w in sizes)}"
                " (model.match_orientation gives portrait photos the transposed size: batch them"
                " apart, grouped by input_size)"
            )
        return torch.stack(pixels)

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
