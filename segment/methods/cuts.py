"""Escape cuts: regions as the metastable sets of the attention chain (segment.core.cuts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from segment.core.masks import MethodOutput
from segment.core.record import AttentionRecord, Capture
from segment.methods.base import Method
from segment.methods.regions import RegionGrow

# What `cuts` fixes (docs/methods.md, "Removed knobs", gives the measured effect of each):
# the foreground score is the CLS attention of the chain's layers after one step of their key
# chain, the heatmap blends the mask with the scores, regions are split into connected
# components, and the pixel chain uses the window and bandwidths of `regions`.
FIXED = dict(chain="attention", score="keychain", heat="blend", connectivity=True,
             refine_radius=8, refine_dilation=4, sigma_space=5.0, sigma_color=0.08)


@dataclass
class EscapeCuts(Method):
    """Regions = metastable sets of the attention chain, found by recursive normalized cuts.

    1. the chain: the last layer's attention over the grid tokens, rows renormalised, heads
       fused by ``heads``, made reversible as ``W = (Pi P + P^T Pi) / 2`` with ``pi`` its
       stationary distribution (TokenRank: exact up to 256 tokens, to the L1 residual 1e-6
       above, :func:`segment.core.markov.stationary`; several ``layers``: their ``W`` averaged);
    2. cut in two along the chain's second eigenvector while the best cut is crossed by the
       stationary walk with probability (the sum of the two halves' escape probabilities,
       = the normalized cut) below ``escape``, each half in turn
       (:func:`segment.core.cuts.recursive_ncut`);
    3. the one-hot regions on the grid refined by ``refine_steps`` bounces of the edge-aware
       pixel chain (run at ``refine_scale`` of the input resolution), argmax, split into
       connected components, components under ``min_area`` (fraction of the image)
       absorbed by their neighbours;
    4. foreground (binary tasks): a region is foreground when the cut region most of its
       pixels took scores above the image's mean score; the score is the CLS attention of
       ``layers`` after one step of their key chain ``softmax(cos(k_i, k_j) /
       key_temperature)`` (``cls_keychain``). The heatmap (for AP) is the mean of the
       mask, every pixel's expected region score and the score map (min-maxed). The mask
       is thus the union of the foreground regions.

    Per image, each region's escape probability on the whole chain (of the token partition,
    before refinement) is ``MethodOutput.escape``; ``segment`` writes it into the image's
    record and the API's ``Result.escape``.
    """

    name: str = "cuts"
    gives_labels: ClassVar[bool] = True
    # the cuts' eigensolver (segment.backends.second_eigenvectors); None: by the device.
    # Not a knob (both give the same vectors up to rounding): the benchmark sets it
    eigen_backend: ClassVar[str | None] = None
    _averages_layers: ClassVar[bool] = False  # refused below
    escape: float = 0.5
    key_temperature: float = 0.05
    refine_steps: int = 3
    refine_scale: float = 0.5
    min_area: float = 0.002

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.average_layers:
            raise ValueError(
                f"{self.name}: average_layers is not a knob of cuts: the chains of the selected"
                " layers are always averaged (set layers instead)"
            )
        if isinstance(self.escape, bool) or not 0 < float(self.escape) <= 2:
            raise ValueError(f"{self.name}: escape must lie in (0, 2] (a sum of two escape"
                             f" probabilities), got {self.escape!r}")
        # the refinement, the components and the foreground score are those of seed and
        # grow with the settings FIXED; it validates the shared knobs
        self._stage = RegionGrow(
            name=self.name, layers=self.layers, heads=self.heads, score_layers=self.layers,
            key_temperature=self.key_temperature, refine_steps=self.refine_steps,
            refine_scale=self.refine_scale, min_area=self.min_area, **FIXED)

    def capture(self, num_layers: int) -> Capture:
        return self._stage.capture(num_layers)

    def pixel_knobs(self) -> tuple[str, ...]:
        return self._stage.pixel_knobs()

    def cut_affinity(self, record: AttentionRecord) -> Tensor:
        """``(B, n, n)`` the symmetric ``W`` of the reversible chain the regions are cut on."""
        from segment.core import cuts

        ws = []
        for i in self._resolve(record):
            if i not in record.attn:
                raise ValueError(f"{self.name}: layer {i} was not captured ({record.layers})")
            self._check_heads(record, i, record.attn[i])
            ws.append(cuts.reversibilise(self._stage.attention_chain(record.attn[i],
                                                                      record.layout)))
        return ws[0] if len(ws) == 1 else torch.stack(ws).mean(0)

    def __call__(self, record: AttentionRecord) -> MethodOutput:
        from functools import partial

        from segment import backends
        from segment.core import cuts

        eigvec = partial(backends.second_eigenvectors, backend=self.eigen_backend)
        w = self.cut_affinity(record)
        # a level that would not fit in memory is cut in chunks; one image that does not
        # fit is refused (MemoryError naming batch_size)
        part = cuts.recursive_ncut(w, float(self.escape), eigvec=eigvec,
                                   memory_limit=backends.memory_budget(w.device))
        b = part.labels.shape[0]
        h, w = record.layout.grid
        grid_prob = F.one_hot(part.labels, int(part.counts.max())).to(torch.float32)
        grid_prob = grid_prob.transpose(1, 2).reshape(b, -1, h, w)  # (B, K, h, w)
        heat, labels, foreground = self._stage.decide(record, grid_prob)
        return MethodOutput(heatmap=heat, labels=labels, foreground=foreground,
                            escape=[e.to(labels.device) for e in part.escape])
