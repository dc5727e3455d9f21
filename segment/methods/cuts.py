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
from segment.core.hierarchy import descend
from segment.methods.base import FusesHeads, fused_patch_chain, knob, refuse_inactive
from segment.methods.stages import ForegroundScore, foreground_score, pixel_regions_with

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
    before refinement and components; the tree's ``Level.escape``) is
    ``MethodOutput.escape`` (``segment-eval``'s ``escape_median``). What ``segment`` writes
    per label id (records, ``run.json``, ``annotations.json``, ``Result.region_escape`` and
    ``region_height``) is each component's token region's values
    (:meth:`segment.core.hierarchy.Hierarchy.label_values`).

    **Every level** (``MethodOutput.hierarchy``, ``MethodOutput.leaves``): the cuts go on
    past ``escape`` down to a floor (:func:`segment.core.cuts.cut_tree`: a region of fewer
    than ``min_leaf`` of the grid's tokens is a leaf), giving per image a
    :class:`segment.core.hierarchy.Hierarchy` whose level at ``escape`` is the partition of
    step 2. The finest level is refined with the default one, by the same pixel chain, in
    one call: the refinement is linear per map (bilinear upsampling, bounces ``x <- P x``
    with ``P`` from the image alone, zero maps skipped; ``tests/test_cuts.py`` checks it),
    so a node's refined map is the sum of its leaves'. Besides the ``K`` default regions'
    maps, the first child of each of the ``L - K`` splits below the default level is
    refined (``L`` maps in all, as many as the leaves), and every pixel of a default
    region (step 3's argmax, before the components) descends the tree below it to the
    child of larger refined mass (:func:`segment.core.hierarchy.descend`; the second
    child's mass is the parent's minus the first's). So the default level's labels, mask
    and heatmap are the very numbers without the tree, every pixel's leaf lies under its
    default region, and the pixels of a region at any threshold are the union of its
    leaves' (``Hierarchy.pixel_labels_at(leaves, t)``): the levels nest at the pixel level.
    The floor is a fraction of the grid, not a token count, so the tree has about as many
    leaves (maps to refine) at any input size and its finest level covers the same share
    of the image.
    """

    name: str = knob("cuts", "the method's name in tables, manifests and file records")
    gives_labels: ClassVar[bool] = True
    gives_hierarchy: ClassVar[bool] = True
    takes_eigen: ClassVar[bool] = True
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
    min_leaf: float = knob(0.094, "the tree's floor: a region with fewer than this fraction of"
                           " the grid's tokens is a leaf (not cut further), in (0, 1]")

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.escape, bool) or not 0 < float(self.escape) <= 2:
            raise ValueError(f"{self.name}: escape must lie in (0, 2] (a sum of two escape"
                             f" probabilities), got {self.escape!r}")
        if isinstance(self.min_leaf, bool) or not 0 < float(self.min_leaf) <= 1:
            raise ValueError(f"{self.name}: min_leaf is a fraction of the token grid in (0, 1],"
                             f" got {self.min_leaf!r}")
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

    @property
    def default_level(self) -> float:
        """The tree's level the labels are: ``escape``."""
        return float(self.escape)

    def min_tokens(self, num_tokens: int) -> int:
        """The tree's floor on a grid of ``num_tokens``: ``round(min_leaf * num_tokens)``,
        at least 2 (24 of the 256 tokens at 224 px, 96 of 1024 at 448 px)."""
        return max(2, round(float(self.min_leaf) * int(num_tokens)))

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
                ``"krylov"``, ``"scipy"`` or ``"torch"``); ``None``: the device's (Krylov on
                the CPU, torch's ``eigh`` elsewhere). Not a setting: they order the tokens
                alike up to near-ties (``python -m segment.eval.bench cutcheck``;
                ``bench regions --eigen ...`` times them in the same rounds).
        """
        from functools import partial

        from segment import backends
        from segment.core import cuts

        eigvec = partial(backends.second_eigenvectors, backend=eigen)
        tau = float(self.escape)
        w_aff = self.cut_affinity(record)
        # a level that would not fit in memory is cut in chunks; one image that does not
        # fit is refused (MemoryError naming batch_size)
        trees = cuts.cut_tree(w_aff, min_tokens=self.min_tokens(w_aff.shape[-1]),
                              tau=tau, eigvec=eigvec,
                              memory_limit=backends.memory_budget(w_aff.device))
        # the level at escape: recursive_ncut(W, escape)'s partition, numbering included,
        # with its regions' escape probabilities (the tree's, float64: no pass over W)
        levels = [t.level(tau) for t in trees]
        part_labels = torch.stack([lv.labels for lv in levels])  # (B, n)
        counts = [len(lv.nodes) for lv in levels]
        k = max(counts)
        b = part_labels.shape[0]
        h, w = record.layout.grid
        grid_prob = F.one_hot(part_labels, k).to(torch.float32)
        grid_prob = grid_prob.transpose(1, 2).reshape(b, -1, h, w)  # (B, K, h, w)
        # below the level: the first child of every split, as a one-hot map on the grid
        below = [t.splits_below(tau) for t in trees]
        extra = torch.zeros(b, max(len(r) for r in below), h * w, device=grid_prob.device)
        for i, (t, rows) in enumerate(zip(trees, below)):
            if len(rows):
                first = t.members()[t.children[rows, 0]].to(grid_prob.device)  # (S, L)
                extra[i, : len(rows)] = first[:, t.leaves.to(grid_prob.device)].float()
        got = pixel_regions_with(
            record, grid_prob, extra.reshape(b, -1, h, w) if extra.shape[1] else None,
            score=self.scoring, refine=self.refinement, components=self.components,
            heat=HEAT, name=self.name)
        heat, labels, foreground = got.decided
        leaves = torch.empty_like(got.hard)
        for i, t in enumerate(trees):
            region = got.hard[i].flatten()
            own = got.prob[i].flatten(1).gather(0, region[None])[0]
            first = (got.extra[i, : len(below[i])].flatten(1) if got.extra is not None
                     else own.new_zeros(0, region.numel()))
            leaves[i] = descend(t, tau, region, own, first).view_as(got.hard[i])
        return MethodOutput(heatmap=heat, labels=labels, foreground=foreground,
                            escape=[lv.escape.to(device=labels.device, dtype=torch.float32)
                                    for lv in levels],
                            hierarchy=trees, leaves=leaves)
