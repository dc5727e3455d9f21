"""The backbone contract: every model (timm ViT or diffusers DiT) implements this.

Adding a backbone = one file in ``models/`` implementing :class:`Backbone` + one config in
``configs/model/`` whose ``_target_`` builds it.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

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

    #: whether :meth:`forward_kept` can run the model on a subset of its image tokens
    can_drop_tokens: bool = False

    def forward_kept(self, pixels: Tensor, keep: Tensor) -> KeptForward:
        """Run the model on its prefix tokens and the image tokens ``keep`` only (token
        masking, :mod:`segment.eval.masking`).

        Args:
            pixels: ``(B, 3, H, W)`` preprocessed images.
            keep: ``(B, K)`` indices of the grid tokens to keep (row-major, in ``[0, h*w)``).

        Raises:
            NotImplementedError: for a backbone whose sequence cannot lose tokens.
        """
        raise NotImplementedError(
            f"{type(self).__name__} ({getattr(self, 'name', '?')}) cannot drop tokens from its"
            " sequence: token masking needs a backbone that runs on any subset of its image"
            " tokens (timm ViTs: segment.models.vit.TimmViT)"
        )


@dataclass
class KeptForward:
    """The outputs of a forward pass on a subset of the tokens (:meth:`Backbone.forward_kept`).

    Attributes:
        embedding: ``(B, C)`` float32, the model's final image embedding: the pooled,
            normalised output its classifier head reads (the final CLS token for CLS-pooled
            ViTs such as DINOv2 and ImageNet ViTs).
        logits: ``(B, K)`` float32 classifier logits, ``None`` for a backbone without a head.
        num_tokens: tokens in each sequence that ran (prefix + kept grid tokens).
    """

    embedding: Tensor
    logits: Tensor | None
    num_tokens: int
