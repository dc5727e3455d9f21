"""On-the-fly reduction of captured attention, shared by every backbone.

A backbone hands each selected layer's probabilities to :class:`AttentionReducer` as soon
as they are computed; the reducer keeps only what the :class:`~segment.core.record.Capture`
asks for (all heads, fused heads, or a running average over layers), so a run never holds
more than one layer's raw matrices plus the reduced state.
"""

from __future__ import annotations

import torch
from torch import Tensor

from segment.core import markov
from segment.core.record import AttentionRecord, Capture, TokenLayout


def fuse_layer(attn: Tensor, heads: str, layout: TokenLayout) -> tuple[Tensor, Tensor | None]:
    """Fuse the heads of one layer ``(B, H, N, N)`` -> ``(B, 1, N, N)``.

    ``"lambda2"`` weights each head by ``|lambda_2|`` of its prefix-free grid chain
    (protocol §1), normalised over heads; ``"mean"`` is the uniform mean.

    Returns:
        The fused attention and the ``(B, H)`` weights (``None`` for ``"keep"``).
    """
    if heads == "keep":
        return attn, None
    b, h = attn.shape[:2]
    if heads == "mean":
        w = torch.full((b, h), 1.0 / h, dtype=attn.dtype, device=attn.device)
    elif heads == "lambda2":
        grid = attn[..., layout.patches, layout.patches]
        chain = markov.strip_prefix(grid, 0, zero_rows="uniform")
        lam = markov.lambda2(chain).to(attn.dtype)  # (B, H)
        w = markov.head_weights(lam, "lambda2")
    else:
        raise ValueError(f"heads must be keep/mean/lambda2, got {heads!r}")
    return markov.fuse_heads(attn, w).unsqueeze(1), w


class AttentionReducer:
    """Accumulates the attention of the layers a :class:`Capture` selects.

    Args:
        capture: what to keep.
        num_layers: layers of the backbone (to resolve negative indices).
        layout: token layout of the batch (needed for lambda_2 on the grid chain).
    """

    def __init__(self, capture: Capture, num_layers: int, layout: TokenLayout) -> None:
        self.capture = capture
        self.layout = layout
        self.num_layers = num_layers
        self.layers = capture.resolve(num_layers)
        self.attn: dict[int, Tensor] = {}
        self.keys: dict[int, Tensor] = {}
        self.weights: dict[int, Tensor] = {}
        self._sum: Tensor | None = None
        self._count = 0

    def wants(self, layer: int) -> bool:
        return layer in self.layers

    def update(self, layer: int, attn: Tensor, keys: Tensor | None = None) -> None:
        """Take layer ``layer``'s probabilities ``(B, H, N, N)`` (and keys ``(B, H, N, D)``)."""
        if not self.wants(layer):
            return
        attn = attn.detach().float()
        fused, w = fuse_layer(attn, self.capture.heads, self.layout)
        if w is not None:
            self.weights[layer] = w
        if self.capture.keys and keys is not None:
            self.keys[layer] = keys.detach().float()
        if self.capture.average_layers:
            self._sum = fused.clone() if self._sum is None else self._sum.add_(fused)
            self._count += 1
        else:
            self.attn[layer] = fused

    def record(self, image_size: tuple[int, int], **kwargs) -> AttentionRecord:
        """The :class:`AttentionRecord` of everything received so far."""
        attn = dict(self.attn)
        averaged = None
        if self.capture.average_layers:
            if self._sum is None:
                raise RuntimeError("no layer reached the reducer")
            averaged = self.layers
            attn = {self.layers[0]: self._sum / self._count}
        missing = [i for i in self.layers if i not in attn and averaged is None]
        if missing:
            raise RuntimeError(f"layers {missing} were selected but never captured")
        kwargs.setdefault("num_layers", self.num_layers)
        return AttentionRecord(
            attn=attn,
            layout=self.layout,
            image_size=image_size,
            keys=self.keys,
            head_weights=self.weights,
            head_fusion=self.capture.heads if self.weights else None,
            averaged_layers=averaged,
            **kwargs,
        )
