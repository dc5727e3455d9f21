"""Escape cuts: regions as the metastable sets of a reversible token chain (segment.core.cuts)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from segment.core.masks import MethodOutput
from segment.core.record import AttentionRecord, Capture
from segment.methods.base import as_compute
from segment.methods.regions import RegionGrow

_CUT_CHAINS = ("keys", "attention")


@dataclass
class EscapeCuts(RegionGrow):
    """Regions = metastable sets of a reversible chain, found by recursive normalized cuts.

    The foreground mask and the heatmap are those of :class:`RegionGrow` (proposals merged
    at ``tau``, the key-chain-smoothed CLS score); the *regions* are a partition of the
    grid tokens into the sets the walk rarely leaves (:mod:`segment.core.cuts`):

    1. the reversible chain ``D^-1 W`` over the grid tokens of ``layers`` (several layers:
       their ``W`` averaged): ``cut_chain: keys``, ``W_ij = exp((cos(k_i, k_j) - 1) /
       cut_temperature)`` of the keys (heads concatenated) with their mean over the
       tokens removed; or ``cut_chain: attention``, the reversible part
       ``(Pi P + P^T Pi) / 2`` of the patch chain (heads by ``heads``), ``pi`` its exact
       stationary distribution;
    2. cut in two along the chain's second eigenvector while the best cut is crossed by
       the stationary walk with probability (the sum of the two escape probabilities,
       = the normalized cut) below ``escape``, each half in turn
       (:func:`segment.core.cuts.recursive_ncut`);
    3. the one-hot regions on the grid refined by the edge-aware pixel chain as the
       proposals are (``refine_*``), argmax; with ``connectivity`` split into components,
       specks under ``min_area`` absorbed by their neighbours;
    4. every region cut along the mask, so the mask is exactly the union of the
       foreground regions.

    Per image, each region's escape probability on the whole chain (of the token
    partition, before refinement and the cut along the mask) is ``MethodOutput.escape``;
    ``segment`` writes it into the image's record and the API's ``Result.escape``.
    """

    name: str = "cuts"
    escape: float = 0.5
    cut_chain: str = "attention"
    cut_temperature: float = 0.2
    mask: str = "regions"

    def __post_init__(self) -> None:
        if self.label_tau is not None:
            raise ValueError(
                f"{self.name}: label_tau is not a knob of cuts: the regions come from the"
                " escape cuts (set escape instead)"
            )
        super().__post_init__()
        if not 0 < float(self.escape) <= 2:
            raise ValueError(f"{self.name}: escape must lie in (0, 2] (a sum of two escape"
                             f" probabilities), got {self.escape!r}")
        if self.cut_chain not in _CUT_CHAINS:
            raise ValueError(f"{self.name}: cut_chain must be one of {_CUT_CHAINS}, got"
                             f" {self.cut_chain!r}")
        if not float(self.cut_temperature) > 0:
            raise ValueError(f"{self.name}: cut_temperature must be > 0, got"
                             f" {self.cut_temperature!r}")

    def _conditional_knobs(self) -> list[tuple[str, bool, str]]:
        return [*super()._conditional_knobs(),
                ("cut_temperature", self.cut_chain == "keys", "cut_chain=keys")]

    def capture(self, num_layers: int) -> Capture:
        mine = Capture(layers=Capture(layers=self.layers).resolve(num_layers), heads="keep",
                       keys=self.cut_chain == "keys")
        return super().capture(num_layers).union(mine, num_layers)

    def cut_affinity(self, record: AttentionRecord) -> Tensor:
        """``(B, n, n)`` the symmetric ``W`` of the reversible chain the regions are cut on."""
        from segment.core import cuts

        layout = record.layout
        ws = []
        for i in self._resolve(record):
            if self.cut_chain == "keys":
                if i not in record.keys:
                    raise ValueError(
                        f"{self.name}: cut_chain=keys needs the keys of layer {i}; capture with"
                        " method.capture(num_layers) (Capture.keys)"
                    )
                ws.append(cuts.key_affinity(as_compute(record.keys[i][:, :, layout.patches]),
                                            float(self.cut_temperature)))
            else:
                if i not in record.attn:
                    raise ValueError(f"{self.name}: layer {i} was not captured ({record.layers})")
                chain = self._attention_chain(record.attn[i], layout)  # (B, n, n)
                ws.append(cuts.reversibilise(chain))
        return ws[0] if len(ws) == 1 else torch.stack(ws).mean(0)

    def __call__(self, record: AttentionRecord) -> MethodOutput:
        from segment import backends
        from segment.core import cuts
        from segment.core import regions as rg

        if self.mask == "cuts":
            part = cuts.recursive_ncut(self.cut_affinity(record), float(self.escape))
            h, w = record.layout.grid
            grid_prob = F.one_hot(part.labels, int(part.counts.max())).to(torch.float32)
            grid_prob = grid_prob.transpose(1, 2).reshape(part.labels.shape[0], -1, h, w)
            heat, labels, fg = self._decide(record, grid_prob)
            return MethodOutput(heatmap=heat, labels=labels, foreground=fg,
                                escape=[e.to(labels.device) for e in part.escape])
        out = super().__call__(record)  # mask and heatmap of the tau merge
        mask = torch.gather(out.foreground, 1, out.labels.flatten(1)).view_as(out.labels)
        h, w = record.layout.grid
        part = cuts.recursive_ncut(self.cut_affinity(record), float(self.escape))
        b = part.labels.shape[0]
        k = int(part.counts.max())
        grid_prob = F.one_hot(part.labels, k).to(torch.float32).transpose(1, 2)
        grid_prob = grid_prob.reshape(b, k, h, w)
        size = tuple(record.image_size)
        if int(self.refine_steps) > 0 and record.pixels is not None:
            prob = self._refine(grid_prob, record.pixels, size)
        else:
            prob = F.interpolate(grid_prob, size=size, mode="bilinear", align_corners=False)
        hard = prob.max(1).indices.to(mask.device)
        if self.connectivity:
            area = int(round(float(self.min_area) * size[0] * size[1]))
            hard = backends.connected_regions(hard, min_area=area)
        labels = rg.relabel(hard * 2 + mask.long())  # each region cut along the mask
        fg = torch.zeros(b, int(labels.max()) + 1, dtype=torch.bool, device=labels.device)
        fg.scatter_(1, labels.flatten(1), mask.flatten(1))
        return MethodOutput(heatmap=out.heatmap, labels=labels, foreground=fg,
                            escape=[e.to(labels.device) for e in part.escape])
