"""Escape cuts: regions as the metastable sets of the attention chain (segment.core.cuts)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from segment.core.masks import MethodOutput
from segment.core.record import AttentionRecord, Capture
from segment.core.stages import Components, Refinement
from segment.methods.base import FusesHeads, fused_patch_chain, knob, refuse_inactive
from segment.methods.stages import ForegroundScore, foreground_score, pixel_regions

if TYPE_CHECKING:
    from segment.backends import EigenBackend

# What `cuts` fixes (docs/methods.md, "Removed knobs", gives the measured effect of each):
# the foreground score is the CLS attention of the chain's layers after one step of their key
# chain, the heatmap blends the mask with the scores, regions are split into connected
# components, and the pixel chain uses the window and bandwidths of `regions`' defaults.
HEAT = "blend"
WINDOW = dict(radius=8, dilation=4, sigma_space=5.0, sigma_color=0.08)


@dataclass(frozen=True)
class EscapeCuts(FusesHeads):
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

    name: str = knob("cuts", "the method's name in tables, manifests and file records")
    gives_labels: ClassVar[bool] = True
    layers: Sequence[int] | int | None = knob(
        (-1,), "the layers whose chains are averaged (and whose CLS attention scores); null ="
        " all")
    escape: float = knob(0.5, "cut while the stationary walk crosses the best cut with"
                         " probability (the normalized cut) below escape, in (0, 2]")
    key_temperature: float = knob(0.05, "T of the foreground score's key chain"
                                  " softmax_j(cos(k_i, k_j) / T)")
    refine_steps: int = knob(3, "bounces of the edge-aware pixel chain (0 = off)")
    refine_scale: float = knob(0.5, "the pixel chain runs at this fraction of the input"
                               " resolution")
    min_area: float = knob(0.002, "components smaller than this fraction of the image are"
                           " absorbed by their neighbours (specks)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.escape, bool) or not 0 < float(self.escape) <= 2:
            raise ValueError(f"{self.name}: escape must lie in (0, 2] (a sum of two escape"
                             f" probabilities), got {self.escape!r}")
        try:  # the stages' settings validate their own knobs
            self.refinement, self.components, self.scoring  # noqa: B018
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None
        refuse_inactive(self, [("refine_scale", int(self.refine_steps) > 0,
                                "refine_steps >= 1 (the pixel chain)")])

    # the stages' settings ------------------------------------------------------------------

    @property
    def refinement(self) -> Refinement:
        """The pixel refinement: ``refine_steps`` at ``refine_scale``, the window fixed."""
        return Refinement(steps=self.refine_steps, scale=self.refine_scale, **WINDOW)

    @property
    def components(self) -> Components:
        """Connected components, specks under ``min_area`` absorbed."""
        return Components(connectivity=True, min_area=self.min_area)

    @property
    def scoring(self) -> ForegroundScore:
        """The CLS attention of ``layers`` after one step of their key chain."""
        return ForegroundScore(layers=self.layers, keychain=True,
                               key_temperature=self.key_temperature)

    def capture(self, num_layers: int) -> Capture:
        mine = Capture(layers=Capture(layers=self.layers).resolve(num_layers),
                       heads="keep" if self.heads == "lambda2" else "mean")
        return mine.union(self.scoring.capture(num_layers), num_layers)

    def pixel_knobs(self) -> tuple[str, ...]:
        """``refine_steps`` when the pixel chain runs (``>= 1``): it walks the input image."""
        return (f"refine_steps={int(self.refine_steps)}",) if int(self.refine_steps) >= 1 else ()

    def score_map(self, record: AttentionRecord) -> Tensor:
        """``(B, h, w)`` the foreground score on the grid
        (:func:`segment.methods.stages.foreground_score` with :attr:`scoring`)."""
        return foreground_score(record, self.scoring, self.name)

    def cut_affinity(self, record: AttentionRecord) -> Tensor:
        """``(B, n, n)`` the symmetric ``W`` of the reversible chain the regions are cut on."""
        from segment.core import cuts

        ws = []
        for i in self._resolve(record):
            if i not in record.attn:
                raise ValueError(f"{self.name}: layer {i} was not captured ({record.layers})")
            self._check_heads(record, i, record.attn[i])
            ws.append(cuts.reversibilise(fused_patch_chain(record.attn[i], record.layout,
                                                           self.heads)))
        return ws[0] if len(ws) == 1 else torch.stack(ws).mean(0)

    def __call__(self, record: AttentionRecord, *, eigen: EigenBackend | None = None
                 ) -> MethodOutput:
        """The regions, mask and heatmap of the record (class docstring).

        Args:
            record: the attention record (:meth:`capture`).
            eigen: the cuts' eigensolver (:func:`segment.backends.second_eigenvectors`:
                ``"scipy"`` or ``"torch"``); ``None``: the device's. Not a setting: both give
                the same vectors up to rounding (``python -m segment.eval.bench regions
                --eigen torch scipy`` times them).
        """
        from functools import partial

        from segment import backends
        from segment.core import cuts

        eigvec = partial(backends.second_eigenvectors, backend=eigen)
        w = self.cut_affinity(record)
        # a level that would not fit in memory is cut in chunks; one image that does not
        # fit is refused (MemoryError naming batch_size)
        part = cuts.recursive_ncut(w, float(self.escape), eigvec=eigvec,
                                   memory_limit=backends.memory_budget(w.device))
        b = part.labels.shape[0]
        h, w = record.layout.grid
        grid_prob = F.one_hot(part.labels, int(part.counts.max())).to(torch.float32)
        grid_prob = grid_prob.transpose(1, 2).reshape(b, -1, h, w)  # (B, K, h, w)
        heat, labels, foreground = pixel_regions(
            record, grid_prob, score=self.scoring, refine=self.refinement,
            components=self.components, heat=HEAT, name=self.name)
        return MethodOutput(heatmap=heat, labels=labels, foreground=foreground,
                            escape=[e.to(labels.device) for e in part.escape])
