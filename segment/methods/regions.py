"""Seed and grow: regions as metastable states of a token chain (segment.core.regions)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from segment.core import markov
from segment.core.masks import MethodOutput
from segment.core.record import AttentionRecord, Capture, TokenLayout
from segment.core.stages import HEATS, Components, Refinement
from segment.methods.base import (
    FusesHeads,
    as_compute,
    fused_patch_chain,
    grid_weights,
    knob,
    layer_tuple,
    refuse_inactive,
)
from segment.methods.stages import ForegroundScore, foreground_score, pixel_regions

_CHAINS = ("attention", "keys", "mix")
_SEEDS = ("auto", "all", "grid", "tokenrank")
_KEY_FUSE = ("similarity", "chain", "concat")
_SCORES = ("cls", "keychain")


@dataclass(frozen=True)
class RegionGrow(FusesHeads):
    """Seed and grow: regions as metastable states of a token chain (:mod:`segment.core.regions`).

    1. the chain ``P`` over grid tokens of the selected layer(s): the patch chain of the
       attention (``chain: attention``), the key-similarity chain
       ``softmax(cos(k_i, k_j) / key_temperature)`` (``keys``), or their mixture
       ``(1 - key_weight) P_attn + key_weight P_keys`` (``mix``); heads fused by ``heads``
       (``mean`` or ``lambda2``: weights from ``|lambda_2|`` of each head's chain); with
       several ``layers`` their chains are averaged;
    2. seeds: every token (``all``), a grid every ``seed_stride`` tokens (``grid``, the
       DiffSeg baseline), the ``num_seeds`` top TokenRank tokens of ``P`` with a
       suppression window of ``seed_radius`` tokens (``tokenrank``), or ``auto``: every
       token up to ``max_seeds`` tokens, else the densest grid with at most that many;
    3. ``steps``-bounce propagation from every seed, merged while the symmetric KL is below
       ``tau`` (``iterations`` rounds);
    4. soft assignment of tokens to proposals, upsampled to the backbone input, refined by
       ``refine_steps`` bounces of the edge-aware pixel chain (needs ``record.pixels``;
       run at ``refine_scale`` of the input resolution:
       :func:`segment.core.stages.refine_assignment`), argmax;
       regions split into connected components, components under
       ``min_area`` (fraction of the image) absorbed;
    5. foreground (binary tasks): a region takes the decision of the merged proposal most
       of its pixels took, a proposal being foreground when its mean score over its grid
       tokens exceeds the score map's mean; the score is the CLS attention of
       ``score_layers`` (mean of heads, ``score: cls``) or that map after one step of the layers' key chain (``score:
       keychain``, :func:`segment.methods.stages.foreground_score`). The heatmap (for AP) is every pixel's expected
       region score ``sum_k p_k score_k`` (``heat: expected``) or the mean of that map
       (min-maxed), the score map (min-maxed) and the mask (``heat: blend``): the mask
       ranks the foreground first, the maps rank the pixels inside each side;
    6. regions for scenes: with ``label_tau < tau`` the labels are the seeds merged at the
       finer ``label_tau``, cut along the mask of step 5 (:meth:`_finer_regions`), so the
       mask and heatmap stay those of ``tau`` while the regions are finer.

    Returns ``MethodOutput(heatmap, labels, foreground)`` at the backbone input resolution.
    """

    name: str = knob("regions", "the method's name in tables, manifests and file records")
    gives_labels: ClassVar[bool] = True
    layers: Sequence[int] | int | None = knob(
        (-1,), "the layers whose chains are averaged; null = all")
    chain: str = knob("mix", "the chain the regions grow on: attention (the patch chain),"
                      " keys (softmax(sim(k_i, k_j) / key_temperature)) or mix ((1 - key_weight)"
                      " P_attention + key_weight P_keys)")
    key_temperature: float = knob(0.05, "T of the key chains (the one the regions grow on and"
                                  " the foreground score's with score=keychain)")
    key_fuse: str = knob("similarity", "how the heads' keys make one chain: similarity (sim ="
                         " sum_h w_h cos_h), chain (sum_h w_h softmax(cos_h / T)) or concat"
                         " (the cosine of the concatenated keys of all heads)")
    key_weight: float = knob(0.5, "chain=mix: the weight w of the key chain, in [0, 1]")
    seeds: str = knob("auto", "auto (every token up to max_seeds, else the densest grid with at"
                      " most that many), all, grid (every seed_stride tokens, the DiffSeg"
                      " baseline) or tokenrank (the num_seeds top TokenRank tokens)")
    max_seeds: int = knob(256, "seeds=auto: the seed budget (224 px: all 256 tokens; 448 px:"
                          " every 2nd)")
    seed_stride: int = knob(2, "seeds=grid: a seed every seed_stride tokens")
    num_seeds: int = knob(64, "seeds=tokenrank: the number of top TokenRank tokens")
    seed_radius: int = knob(1, "seeds=tokenrank: the suppression window's radius (tokens)")
    steps: int = knob(2, "bounces from every seed (two-bounce propagation)")
    tau: float = knob(0.2, "proposals closer than this symmetric KL are merged: the foreground"
                      " decision")
    iterations: int = knob(3, "merge rounds")
    score_layers: Sequence[int] | int | None = knob(
        (-1,), "the layers whose CLS attention (mean of heads) decides the foreground")
    refine_steps: int = knob(3, "bounces of the edge-aware pixel chain (0 = off)")
    refine_radius: int = knob(8, "the pixel chain's window half-size (px at the backbone input)")
    refine_dilation: int = knob(4, "the pixel chain's window is sampled every N px")
    refine_scale: float = knob(0.5, "the pixel chain runs at this fraction of the input"
                               " resolution (1: full; 0.5: a quarter of the pixels, the window"
                               " scaled to cover the same part of the image)")
    sigma_space: float = knob(5.0, "the pixel chain's spatial bandwidth (px)")
    sigma_color: float = knob(0.08, "the pixel chain's colour bandwidth (RGB in [0, 1])")
    min_area: float = knob(0.002, "components smaller than this fraction of the image are"
                           " absorbed by their neighbours (specks)")
    connectivity: bool = knob(True, "split the regions into connected components")
    score: str = knob("keychain", "the foreground score: cls (the CLS attention of"
                      " score_layers) or keychain (that map after one step of their key chain)")
    heat: str = knob("blend", "the AP heatmap: blend ((mask + expected region score + score"
                     " map) / 3) or expected (every pixel's expected region score)")
    label_tau: float | None = knob(0.03, "the regions (labels, scenes): the seeds merged at"
                                   " this finer KL, cut along the mask of tau; null = the"
                                   " regions of tau")

    def __post_init__(self) -> None:
        super().__post_init__()
        for setting, allowed in (("chain", _CHAINS), ("key_fuse", _KEY_FUSE), ("seeds", _SEEDS)):
            if getattr(self, setting) not in allowed:
                raise ValueError(
                    f"{self.name}: {setting} must be one of {allowed}, got {getattr(self, setting)!r}"
                )
        for setting, low in (("steps", 1), ("max_seeds", 1), ("seed_stride", 1), ("num_seeds", 1),
                          ("seed_radius", 0), ("iterations", 1)):
            value = getattr(self, setting)
            if isinstance(value, bool) or int(value) != value or value < low:
                raise ValueError(f"{self.name}: {setting} must be an integer >= {low}, got {value!r}")
        for setting in ("tau", "key_temperature"):
            if not float(getattr(self, setting)) > 0:
                raise ValueError(f"{self.name}: {setting} must be > 0, got {getattr(self, setting)!r}")
        object.__setattr__(self, "score_layers",
                           layer_tuple(self.score_layers, self.name, "score_layers"))
        try:  # the stages' settings validate their own knobs
            self.refinement, self.components, self.scoring  # noqa: B018
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None
        if not 0.0 <= float(self.key_weight) <= 1.0:
            raise ValueError(f"{self.name}: key_weight must lie in [0, 1], got {self.key_weight}")
        if self.label_tau is not None and not 0 < float(self.label_tau) <= float(self.tau):
            raise ValueError(
                f"{self.name}: label_tau must lie in (0, tau = {self.tau}] or be null, got"
                f" {self.label_tau}"
            )
        if self.score not in _SCORES:
            raise ValueError(f"{self.name}: score must be one of {_SCORES}, got {self.score!r}")
        if self.heat not in HEATS:
            raise ValueError(f"{self.name}: heat must be one of {HEATS}, got {self.heat!r}")
        refuse_inactive(self, self._conditional_knobs())

    # the stages' settings ------------------------------------------------------------------

    @property
    def refinement(self) -> Refinement:
        """The pixel refinement's settings (``refine_*``, ``sigma_*``)."""
        return Refinement(steps=self.refine_steps, radius=self.refine_radius,
                          dilation=self.refine_dilation, scale=self.refine_scale,
                          sigma_space=self.sigma_space, sigma_color=self.sigma_color)

    @property
    def components(self) -> Components:
        """The connected-components stage's settings (``connectivity``, ``min_area``)."""
        return Components(connectivity=self.connectivity, min_area=self.min_area)

    @property
    def scoring(self) -> ForegroundScore:
        """The foreground score's settings (``score_layers``, ``score``, ``key_temperature``)."""
        return ForegroundScore(layers=self.score_layers, keychain=self.score == "keychain",
                               key_temperature=self.key_temperature)

    def _conditional_knobs(self) -> list[tuple[str, bool, str]]:
        """The knobs that act only with other settings: ``(knob, acts now, with what)``
        (:func:`refuse_inactive`)."""
        return [
            # chain=keys with key_fuse=concat is one chain from all heads' keys: nothing to weigh
            ("heads", not (self.chain == "keys" and self.key_fuse == "concat"),
             "chain=attention or chain=mix, or key_fuse=similarity or key_fuse=chain (with"
             " chain=keys and key_fuse=concat one chain comes from the concatenated keys of all"
             " heads)"),
            ("key_weight", self.chain == "mix", "chain=mix"),
            ("key_fuse", self._needs_keys, "chain=keys or chain=mix"),
            ("key_temperature", self._needs_keys or self.score == "keychain",
             "chain=keys, chain=mix or score=keychain"),
            ("max_seeds", self.seeds == "auto", "seeds=auto"),
            ("seed_stride", self.seeds == "grid", "seeds=grid"),
            ("num_seeds", self.seeds == "tokenrank", "seeds=tokenrank"),
            ("seed_radius", self.seeds == "tokenrank", "seeds=tokenrank"),
            *((knob, int(self.refine_steps) > 0, "refine_steps >= 1 (the pixel chain)")
              for knob in ("refine_radius", "refine_dilation", "refine_scale", "sigma_space",
                           "sigma_color")),
            ("min_area", bool(self.connectivity), "connectivity=true"),
        ]

    @property
    def _needs_keys(self) -> bool:
        return self.chain in ("keys", "mix")

    def capture(self, num_layers: int) -> Capture:
        mine = Capture(
            layers=Capture(layers=self.layers).resolve(num_layers),
            heads="keep" if self._needs_keys or self.heads == "lambda2" else "mean",
            keys=self._needs_keys,
        )
        return mine.union(self.scoring.capture(num_layers), num_layers)

    def score_map(self, record: AttentionRecord) -> Tensor:
        """``(B, h, w)`` the foreground score on the grid
        (:func:`segment.methods.stages.foreground_score` with :attr:`scoring`)."""
        return foreground_score(record, self.scoring, self.name)

    # the chain over grid tokens ----------------------------------------------------------

    def _key_chain(self, keys: Tensor, layout: TokenLayout) -> Tensor:
        from segment.core.regions import key_chain

        k = as_compute(keys[:, :, layout.patches])  # (B, H, n, D)
        t = float(self.key_temperature)
        if self.key_fuse == "concat":  # cosine of the whole key vectors (all heads)
            return key_chain(k.transpose(1, 2).flatten(2), t)
        b, h = k.shape[:2]
        if self.heads == "mean" and self.key_fuse == "similarity":
            w = torch.full((b, h), 1.0 / h, dtype=k.dtype, device=k.device)
        else:  # per-head chains: fused directly, or for their lambda_2
            per_head = key_chain(k, t)  # (B, H, n, n)
            w = grid_weights(per_head, self.heads)  # (B, H)
            if self.key_fuse == "chain":  # sum_h w_h softmax(cos_h / T)
                return markov.fuse_heads(per_head, w)
        # similarity: softmax_j(sum_h w_h cos_h(k_i, k_j) / T)
        kn = F.normalize(k, dim=-1)
        sim = torch.einsum("bh,bhid,bhjd->bij", w, kn, kn)
        return torch.softmax(sim.div_(t), dim=-1)

    def grid_chain(self, record: AttentionRecord) -> Tensor:
        """``(B, n, n)`` the chain the regions grow on (layers averaged)."""
        layers = self._resolve(record)
        layout = record.layout
        chains = []
        for i in layers:
            if self.chain in ("attention", "mix"):
                if i not in record.attn:
                    raise ValueError(f"{self.name}: layer {i} was not captured ({record.layers})")
                self._check_heads(record, i, record.attn[i])
                pa = fused_patch_chain(record.attn[i], layout, self.heads)
            if self.chain in ("keys", "mix"):
                if i not in record.keys:
                    raise ValueError(
                        f"{self.name}: chain={self.chain} needs the keys of layer {i}; capture"
                        " with method.capture(num_layers) (Capture.keys)"
                    )
                pk = self._key_chain(record.keys[i], layout)
            if self.chain == "attention":
                chains.append(pa)
            elif self.chain == "keys":
                chains.append(pk)
            else:  # (1 - w) P_attention + w P_keys; pk is this call's own tensor
                wk = float(self.key_weight)
                chains.append(pk.mul_(wk).add_(pa * (1 - wk)))
        return chains[0] if len(chains) == 1 else torch.stack(chains).mean(0)

    # the stage -----------------------------------------------------------------------------

    def __call__(self, record: AttentionRecord) -> MethodOutput:
        from segment.core import regions as rg

        layout = record.layout
        h, w = layout.grid
        chain = self.grid_chain(record)  # (B, n, n)
        b, n, _ = chain.shape
        if self.seeds == "all":
            seeds = torch.arange(n, device=chain.device)
        elif self.seeds == "auto":  # every token up to max_seeds, else the densest grid below
            stride = max(1, math.ceil(math.sqrt(n / max(1, int(self.max_seeds)))))
            seeds = rg.grid_seeds((h, w), stride, chain.device)
        elif self.seeds == "grid":
            seeds = rg.grid_seeds((h, w), int(self.seed_stride), chain.device)
        else:
            rank = markov.tokenrank(chain, alpha=0.99)
            seeds = rg.tokenrank_seeds(rank, (h, w), min(int(self.num_seeds), n),
                                       int(self.seed_radius))
        dist = rg.propagate(chain, seeds, int(self.steps))  # (B, S, n)
        kl = rg.symmetric_kl(dist, dist)  # the first round of both merges (tau, label_tau)
        props = rg.merge_proposals(dist, float(self.tau), int(self.iterations), kl=kl)
        grid_prob = rg.soft_assign(props).view(b, -1, h, w)  # (B, K, h, w)
        heat, labels, foreground = self.decide(record, grid_prob)
        if self.label_tau is not None and float(self.label_tau) < float(self.tau):
            labels, foreground = self._finer_regions(dist, kl, labels, foreground, (h, w))
        return MethodOutput(heatmap=heat, labels=labels, foreground=foreground)

    def decide(self, record: AttentionRecord, grid_prob: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Steps 4-5: a soft assignment ``(B, K, h, w)`` of the grid tokens to ``K`` regions
        -> ``(heat, labels, foreground)`` at the backbone input
        (:func:`segment.methods.stages.pixel_regions` with this method's stages)."""
        return pixel_regions(record, grid_prob, score=self.scoring, refine=self.refinement,
                             components=self.components, heat=self.heat, name=self.name)

    def pixel_knobs(self) -> tuple[str, ...]:
        """``refine_steps`` when the pixel chain runs (``>= 1``): it walks the input image."""
        return (f"refine_steps={int(self.refine_steps)}",) if int(self.refine_steps) >= 1 else ()

    def _finer_regions(self, dist: Tensor, kl: Tensor, labels: Tensor, foreground: Tensor,
                       grid: tuple[int, int]) -> tuple[Tensor, Tensor]:
        """The regions of ``label_tau`` (finer than ``tau``), split along the mask.

        The seeds' distributions merged at ``label_tau`` give finer proposals; every pixel
        takes its most likely one (bilinear on the image, no pixel refinement); with
        ``connectivity`` they are split into components and specks under ``min_area``
        absorbed; then each region is cut along the mask decided at ``tau``, so the mask
        is exactly the one of ``tau``. A region is foreground when its pixels are in the
        mask.

        Returns:
            ``(B, H, W)`` labels and ``(B, K')`` foreground.
        """
        from segment import backends
        from segment.core import regions as rg

        b, size = labels.shape[0], tuple(labels.shape[-2:])
        fine = rg.merge_proposals(dist, float(self.label_tau), int(self.iterations), kl=kl)
        grid_prob = rg.soft_assign(fine).view(b, -1, *grid)
        mask = torch.gather(foreground, 1, labels.flatten(1)).view_as(labels)
        # every pixel's most likely proposal, over the image's own proposals (they come
        # first); components and specks before the cut: the mask stays exact
        area = self.components.min_pixels(size)
        hard = backends.argmax_regions(grid_prob, fine.count.tolist(), size, area).to(labels.device)
        new = rg.relabel(hard * 2 + mask.long())  # each region cut along the mask
        # every region lies on one side of the mask: its pixels write that side (ids an
        # image does not use stay background)
        fg = torch.zeros(b, int(new.max()) + 1, dtype=torch.bool, device=new.device)
        return new, fg.scatter_(1, new.flatten(1), mask.flatten(1))
