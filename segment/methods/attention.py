"""Methods that read the query rows: CLS attention, its key-chain step, rollout."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from segment.core.masks import MethodOutput
from segment.core.record import AttentionRecord, Capture, TokenLayout
from segment.methods.base import (
    AveragesLayers,
    FusesHeads,
    Method,
    as_compute,
    grid_part,
    knob,
    start_distribution,
)


def _rows_fused(method: Method, attn: Tensor, layout: TokenLayout) -> Tensor:
    """The attention the CLS row is read from: with ``heads: mean`` every head (the mean of
    the heads' rows, not of their whole chains), else the method's fused chain."""
    if method.head_fusion == "mean":
        return as_compute(attn)
    return Method._fused(method, attn, layout)


@dataclass(frozen=True)
class ClsAttention(AveragesLayers):
    """CLS attention: the query tokens' attention row over the patches (``[s^T A]_grid``).

    Heads are fused by ``heads`` (equal to fusing the rows, selection being linear).
    """

    name: str = knob("cls_attention", "the method's name in tables, manifests and file records")

    def _fused(self, attn: Tensor, layout: TokenLayout) -> Tensor:
        return _rows_fused(self, attn, layout)

    def _heat(self, attn: Tensor, record: AttentionRecord) -> Tensor:
        return query_rows(attn, record)


def query_rows(attn: Tensor, record: AttentionRecord) -> Tensor:
    """``(B, h*w)`` the query tokens' attention row over the grid, ``[s^T A]_grid``, the mean
    over the ``H'`` heads of ``attn`` ``(B, H', N, N)`` (``s``: :func:`start_distribution`)."""
    s = start_distribution(record, attn.shape[-1], attn.dtype, attn.device)
    rows = (s[:, None, None, :] @ attn)[:, :, 0]  # (B, H', N)
    return grid_part(rows.mean(1), record.layout)


def keychain_step(record: AttentionRecord, heat: Tensor, layers: Sequence[int], temperature: float,
                  name: str = "cls_keychain") -> Tensor:
    """One step of the key chain over a grid map, averaged over ``layers``.

    ``s_i <- sum_j P_ij s_j`` with ``P = softmax_j(cos(k_i, k_j) / temperature)`` on each
    layer's grid-token keys, the heads' keys concatenated (:func:`segment.core.regions.key_chain`).

    Args:
        record: holds the keys of ``layers`` (``Capture.keys``).
        heat: ``(B, h, w)`` the map to smooth.
        layers: captured layer indices whose chains are averaged.
        temperature: the key chain's softmax temperature (> 0).
        name: the calling method, for the error.

    Returns:
        ``(B, h, w)`` float32.
    """
    from segment.core.regions import key_chain

    b, h, w = heat.shape
    out = []
    for i in layers:
        if i not in record.keys:
            raise ValueError(
                f"{name}: needs the keys of layer {i}; capture with method.capture(num_layers)"
                " (Capture.keys)"
            )
        k = as_compute(record.keys[i][:, :, record.layout.patches])  # (B, H, n, D)
        chain = key_chain(k.transpose(1, 2).flatten(2), temperature)  # (B, n, n)
        out.append(torch.einsum("bij,bj->bi", chain.to(heat), heat.flatten(1)))
    return torch.stack(out).mean(0).view(b, h, w)


@dataclass(frozen=True)
class ClsKeyChain(FusesHeads):
    """CLS attention smoothed by one step of the key chain (``cls_keychain`` of the dev
    sets' REFERENCE.md, the strongest simple peer there).

    The CLS map of the selected layers (heads fused by ``heads``, layers averaged) takes one
    step of each layer's key chain ``softmax_j(cos(k_i, k_j) / key_temperature)`` (heads'
    keys concatenated); the layers' results are averaged (:func:`keychain_step`). It is the
    foreground score of ``regions`` with ``score: keychain``.
    """

    name: str = knob("cls_keychain", "the method's name in tables, manifests and file records")
    key_temperature: float = knob(0.05, "T of the key chain softmax_j(cos(k_i, k_j) / T)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not float(self.key_temperature) > 0:
            raise ValueError(f"{self.name}: key_temperature must be > 0, got {self.key_temperature!r}")

    def _fused(self, attn: Tensor, layout: TokenLayout) -> Tensor:
        return _rows_fused(self, attn, layout)

    def _heat(self, attn: Tensor, record: AttentionRecord) -> Tensor:
        return query_rows(attn, record)

    def capture(self, num_layers: int) -> Capture:
        c = super().capture(num_layers)
        return Capture(layers=c.layers, heads=c.heads, keys=True)

    def __call__(self, record: AttentionRecord) -> MethodOutput:
        cls = super().__call__(record).heatmap.float()  # (B, h, w) mean over the layers
        heat = keychain_step(record, cls, self._resolve(record), float(self.key_temperature), self.name)
        return MethodOutput(heatmap=heat)


@dataclass(frozen=True)
class Rollout(FusesHeads):
    """Attention rollout (baseline): ``[s^T Â_{L-1} ... Â_0]_grid``."""

    name: str = knob("rollout", "the method's name in tables, manifests and file records")
    layers: Sequence[int] | int | None = knob(None, "the layers multiplied, ascending; null ="
                                              " all")
    residual: float = knob(0.5, "r, the weight of the identity (the skip connection) in"
                           " rownorm((1 - r) A + r I)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= float(self.residual) < 1.0:
            raise ValueError(f"rollout: residual must lie in [0, 1), got {self.residual}")

    def __call__(self, record: AttentionRecord) -> MethodOutput:
        mats = self._inputs(record)  # ascending layers, each (B, 1, N, N)
        layout = record.layout
        n = mats[0].shape[-1]
        v = start_distribution(record, n, mats[0].dtype, mats[0].device)  # (B, N)
        r = float(self.residual)
        for a in reversed(mats):  # s^T Â_{L-1} first, down to Â_0
            a = a[:, 0]
            hat = (1 - r) * a + r * torch.eye(n, dtype=a.dtype, device=a.device)
            hat = hat / hat.sum(-1, keepdim=True)
            v = torch.einsum("bn,bnm->bm", v, hat)
        h, w = layout.grid
        return MethodOutput(heatmap=grid_part(v, layout).reshape(v.shape[0], h, w))
