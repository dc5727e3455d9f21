"""The record-reading stages of the region methods: the foreground score, and the pixel stages
of :mod:`segment.core.stages` composed on a record.

``regions``, ``cuts`` and ``kmeans`` call these functions with their own settings; no method
holds another method.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from segment.core.record import AttentionRecord, Capture
from segment.core.stages import Components, Refinement, decide_regions, refine_assignments
from segment.methods.attention import keychain_step, query_rows
from segment.methods.base import as_compute, check_fused_heads, layer_tuple, resolve_layers

__all__ = ["ForegroundScore", "PixelRegions", "foreground_score", "pixel_regions",
           "pixel_regions_with"]


@dataclass(frozen=True)
class ForegroundScore:
    """The foreground score of the region methods (:func:`foreground_score`).

    Attributes:
        layers: the layers whose CLS attention (the query tokens' row, mean of heads) is
            averaged (negative from the end; ``None`` = all).
        keychain: smooth that map by one step of the same layers' key chain
            ``softmax_j(cos(k_i, k_j) / key_temperature)`` (heads' keys concatenated:
            :func:`segment.methods.attention.keychain_step`, ``cls_keychain``).
        key_temperature: the key chain's temperature (> 0; used with ``keychain``).
    """

    layers: Sequence[int] | int | None = (-1,)
    keychain: bool = False
    key_temperature: float = 0.05

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", layer_tuple(self.layers, "score", "score_layers"))
        object.__setattr__(self, "keychain", bool(self.keychain))
        if not float(self.key_temperature) > 0:
            raise ValueError(f"key_temperature must be > 0, got {self.key_temperature!r}")
        object.__setattr__(self, "key_temperature", float(self.key_temperature))

    def capture(self, num_layers: int) -> Capture:
        """What the score reads: the layers' attention with heads fused by the mean (and their
        keys, all heads, with ``keychain``)."""
        layers = Capture(layers=self.layers).resolve(num_layers)
        if self.keychain:  # the smoothing chain needs the layers' keys
            return Capture(layers=layers, heads="keep", keys=True)
        return Capture(layers=layers, heads="mean", average_layers=False)


def foreground_score(record: AttentionRecord, score: ForegroundScore, name: str) -> Tensor:
    """``(B, h, w)`` float32 the foreground score on the grid.

    The CLS attention of ``score.layers`` (mean of heads, the layers' maps averaged: the
    ``cls_attention`` method with ``heads: mean``); with ``score.keychain`` that map after one
    step of the key chain of the same layers (:func:`keychain_step`, ``cls_keychain`` of
    ecssd-dev/REFERENCE.md): every token takes the mean score of the tokens whose keys
    resemble its own, so a whole object lights up, not only its most attended parts.

    Args:
        record: holds the layers as :meth:`ForegroundScore.capture` asks.
        score: the settings.
        name: the calling method, for errors.
    """
    layers = resolve_layers(record, score.layers, name)
    if record.averaged_layers is not None:
        got = tuple(record.averaged_layers)
        if got != layers or len(got) > 1:
            raise ValueError(
                f"{name}: the record holds layers {got} averaged into one; the foreground score"
                f" needs layers {layers} separately"
            )
        attn = {got[0]: record.attn[got[0]]}
    else:
        missing = [i for i in layers if i not in record.attn]
        if missing:
            raise ValueError(
                f"{name}: layers {missing} were not captured (record has {record.layers});"
                " capture with method.capture(num_layers)"
            )
        attn = {i: record.attn[i] for i in layers}
    heats = []
    for i, a in attn.items():
        check_fused_heads(record, i, a, heads="mean", fuse_first=True, name=name)
        heats.append(query_rows(as_compute(a), record))
    heat = torch.stack(heats).mean(0)  # (B, h*w)
    h, w = record.layout.grid
    cls = heat.reshape(heat.shape[0], h, w).float()
    if not score.keychain:
        return cls
    return keychain_step(record, cls, layers, score.key_temperature, name)


def pixel_regions(record: AttentionRecord, grid_prob: Tensor, *, score: ForegroundScore,
                  refine: Refinement, components: Components, heat: str, name: str
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """A soft assignment ``(B, K, h, w)`` of the grid tokens to ``K`` regions -> ``(heat,
    labels, foreground)`` at the backbone input (``record.image_size``): the foreground
    score (:func:`foreground_score`), the pixel refinement (:func:`refine_assignment`; a
    record without pixels is upsampled bilinearly only: a backbone whose records carry none
    is refused with ``refine.steps >= 1`` before it runs, ``segment.run.api.check_method``),
    every pixel's most likely region, its connected components
    (:func:`segment.backends.component_regions`) and the decision and heatmap
    (:func:`decide_regions` with ``heat``)."""
    return pixel_regions_with(record, grid_prob, None, score=score, refine=refine,
                              components=components, heat=heat, name=name).decided


class PixelRegions(NamedTuple):
    """What :func:`pixel_regions_with` gives: ``decided`` = ``(heat, labels, foreground)``
    as :func:`pixel_regions`; ``prob`` ``(B, K, H, W)`` the refined assignment; ``hard``
    ``(B, H, W)`` every pixel's most likely region of it (before the components);
    ``extra`` the extra maps refined alongside (``(B, E, H, W)``; ``None`` without them)."""

    decided: tuple[Tensor, Tensor, Tensor]
    prob: Tensor
    hard: Tensor
    extra: Tensor | None


def pixel_regions_with(record: AttentionRecord, grid_prob: Tensor, extra: Tensor | None, *,
                       score: ForegroundScore, refine: Refinement, components: Components,
                       heat: str, name: str) -> PixelRegions:
    """:func:`pixel_regions`, with ``extra`` ``(B, E, h, w)`` maps on the grid refined by the
    same pixel chain alongside the assignment (one call; ``None``: none).

    The refinement treats every map on its own (:func:`refine_assignments`: bilinear
    upsampling per group, the chain's bounces ``x <- P x`` with ``P`` from the image alone,
    zero maps skipped), so the assignment's refined maps, and everything decided from them,
    are the very numbers :func:`pixel_regions` computes without ``extra``."""
    from segment import backends

    s = foreground_score(record, score, name)  # (B, h, w)
    size = tuple(record.image_size)
    groups = [grid_prob] if extra is None else [grid_prob, extra.to(grid_prob)]
    if refine.steps > 0 and record.pixels is not None:
        refined = refine_assignments(groups, record.pixels, size, refine)
    else:
        refined = [F.interpolate(g, size=size, mode="bilinear", align_corners=False)
                   for g in groups]
    prob = refined[0]
    hard = prob.max(1).indices  # (B, H, W) (max: faster than argmax)
    labels = backends.component_regions(hard, components)
    decided = decide_regions(grid_prob, s, prob, hard, labels, heat=heat)
    return PixelRegions(decided, prob, hard, None if extra is None else refined[1])
