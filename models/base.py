"""The backbone contract: every model (timm ViT or diffusers DiT) implements this.

Adding a backbone = one file in ``models/`` implementing :class:`Backbone` + one config in
``configs/model/`` whose ``_target_`` builds it.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from PIL import Image
from torch import Tensor

from segment.core.record import AttentionRecord, Capture


class Backbone(abc.ABC):
    """A model whose attention is read as Markov chains: everything callers use of a model.

    ``segment``, ``segment-eval``, ``segment-diagnose``, the API and the benchmarks reach a
    model only through these names (no ``getattr``/``hasattr`` on a backbone).

    Attributes:
        name: short name for tables and manifests.
        num_layers: number of attention layers (blocks) that can be captured.
        num_heads: attention heads per layer.
        device: where the model runs.
        patch_size: ``(ph, pw)`` pixels of the preprocessed input per grid token (a ViT's
            patch; a DiT's input pixels per latent token): the smallest image worth one token.
        text_conditioned: whether :meth:`extract` is prompted with a class name per image
            (FLUX); a text-conditioned backbone falls back to :attr:`default_class`.
        default_class: the class word a text-conditioned backbone is prompted with when an
            image has none (``None`` = such images are refused); ``None`` for the others.
        num_classes: classes of the model's classifier head (token masking's top-1
            agreement); 0 for a backbone without a head.
        provides_pixels: whether :meth:`extract`'s records carry the input image
            (``AttentionRecord.pixels``, RGB in ``[0, 1]`` at the record's ``image_size``)
            that pixel-level method knobs read (``regions``' and ``cuts``' ``refine_steps``);
            every bundled backbone does; methods that need it are refused on a backbone
            without it, before the first batch (``segment.run.api.segmenter.check_method``).
        kind: ``"vit"`` (an image transformer) or ``"dit"`` (a diffusion transformer, text
            and image tokens): the kinds a method runs on are its ``Method.backbones``.
    """

    name: str
    num_layers: int
    num_heads: int
    device: torch.device
    patch_size: tuple[int, int]
    text_conditioned: ClassVar[bool] = False
    provides_pixels: ClassVar[bool] = False
    kind: ClassVar[str] = "vit"
    default_class: str | None = None
    num_classes: int = 0

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
            f"{type(self).__name__} ({self.name}) cannot drop tokens from its"
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
