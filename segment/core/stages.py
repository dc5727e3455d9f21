"""The stages the region methods share, each a unit with its own settings (torch only).

``regions`` (:class:`segment.methods.RegionGrow`) and ``cuts``
(:class:`segment.methods.EscapeCuts`) find a soft assignment ``(B, K, h, w)`` of the grid
tokens to ``K`` regions in their own way, then turn it into pixels with the same stages:

1. **pixel refinement** (:class:`Refinement`, :func:`refine_assignment`): the assignment
   upsampled to the backbone input and refined by a few bounces of the edge-aware pixel
   chain (:func:`segment.core.regions.pixel_chain_refine`), run at a fraction of the input
   resolution;
2. **connected components** (:class:`Components`; the library call is
   :func:`segment.backends.component_regions`): every pixel's most likely region split into
   connected components, specks under ``min_area`` absorbed by their neighbours;
3. **the decision** (:func:`decide_regions`): each region foreground when the region of the
   assignment most of its pixels took scores above the image's mean score, and the heatmap
   (``heat``: the expected region score, or its blend with the score map and the mask).

The foreground score itself reads the attention record:
:func:`segment.methods.stages.foreground_score`.

Settings errors name the settings as the method configs do (``refine_scale``, ``min_area``),
without the method's name, which the methods add.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from segment.core.masks import minmax
from segment.core.regions import pixel_chain_refine, region_scores

__all__ = ["HEATS", "Components", "Refinement", "decide_regions", "refine_assignment",
           "refine_assignments"]

HEATS = ("expected", "blend")


def _whole(value: object, low: int, knob: str) -> int:
    if isinstance(value, bool) or int(value) != value or value < low:  # type: ignore[call-overload, operator]
        raise ValueError(f"{knob} must be an integer >= {low}, got {value!r}")
    return int(value)  # type: ignore[call-overload]


@dataclass(frozen=True)
class Refinement:
    """The edge-aware pixel chain that refines a soft assignment (:func:`refine_assignment`).

    Attributes:
        steps: bounces of the pixel chain (0 = no refinement: bilinear upsampling only);
            the ``refine_steps`` knob.
        radius: window half-size in pixels of the backbone input (``refine_radius``).
        dilation: the window is sampled every ``dilation`` input pixels (``refine_dilation``).
        scale: the chain runs at this fraction of the input resolution, in ``(0, 1]``
            (``refine_scale``); ``radius * scale`` and ``dilation * scale`` must be whole
            numbers >= 1.
        sigma_space: spatial bandwidth in input pixels.
        sigma_color: colour bandwidth (RGB in ``[0, 1]``).
    """

    steps: int = 3
    radius: int = 8
    dilation: int = 4
    scale: float = 0.5
    sigma_space: float = 5.0
    sigma_color: float = 0.08

    def __post_init__(self) -> None:
        for knob, label, low in (("steps", "refine_steps", 0), ("radius", "refine_radius", 1),
                                 ("dilation", "refine_dilation", 1)):
            object.__setattr__(self, knob, _whole(getattr(self, knob), low, label))
        for knob in ("sigma_space", "sigma_color"):
            if not float(getattr(self, knob)) > 0:
                raise ValueError(f"{knob} must be > 0, got {getattr(self, knob)!r}")
            object.__setattr__(self, knob, float(getattr(self, knob)))
        s = self.scale
        if isinstance(s, bool) or not 0.0 < float(s) <= 1.0:
            raise ValueError(f"refine_scale must lie in (0, 1], got {s!r}")
        object.__setattr__(self, "scale", float(s))
        self.window()

    def window(self) -> tuple[int, int, float]:
        """``(radius, dilation, sigma_space)`` in pixels of the grid the chain runs on (the
        settings are in pixels of the backbone input, scaled by ``scale``)."""
        px = []
        for knob, value in (("refine_radius", self.radius), ("refine_dilation", self.dilation)):
            v = value * self.scale
            if abs(v - round(v)) > 1e-6 or round(v) < 1:
                raise ValueError(
                    f"refine_scale={self.scale} turns {knob}={value} px into {v:g} px on the"
                    " refined grid; choose values whose product with refine_scale is a whole"
                    " number >= 1"
                )
            px.append(int(round(v)))
        return px[0], px[1], self.sigma_space * self.scale


def refine_assignment(grid_prob: Tensor, pixels: Tensor, size: tuple[int, int],
                      refine: Refinement) -> Tensor:
    """Soft assignment ``(B, K, h, w)`` on the grid -> refined ``(B, K, H, W)`` at ``size``.

    ``refine.steps`` 0: bilinear upsampling to ``size`` only. ``refine.scale`` 1: bilinear
    upsampling to ``size``, then the pixel chain there. Below 1 the chain runs on
    ``round(s H) x round(s W)`` pixels: the assignment is upsampled bilinearly to that size,
    the image area-averaged to it, the window (:meth:`Refinement.window`) scaled by ``s`` so
    it covers the same part of the image, and the refined maps upsampled bilinearly to
    ``size``. The pixel chain's cost falls with ``s^2`` (the joint bilateral upsampling
    idea: edges found at a lower resolution, then interpolated).

    Args:
        grid_prob: ``(B, K, h, w)`` soft assignment (or any maps) on the token grid; a map
            that is zero everywhere stays zero (and is skipped).
        pixels: ``(B, 3, H', W')`` the input image, RGB in ``[0, 1]``
            (``AttentionRecord.pixels``); area-averaged to the chain's size.
        size: ``(H, W)`` the output size (the backbone input).
        refine: the pixel chain's settings.

    Returns:
        ``(B, K, H, W)`` float32 on ``grid_prob``'s device; each pixel's maps are convex
        combinations of the bilinearly upsampled ones.
    """
    return refine_assignments([grid_prob], pixels, size, refine)[0]


def refine_assignments(groups: Sequence[Tensor], pixels: Tensor, size: tuple[int, int],
                       refine: Refinement) -> list[Tensor]:
    """:func:`refine_assignment` of several groups of maps ``(B, K_g, h, w)`` of the same
    images, by one pixel chain: each group's result is bit for bit
    :func:`refine_assignment` of that group alone.

    Every map is refined on its own (the refinement is linear per map: bilinear
    upsampling, bounces ``x <- P x`` with ``P`` from the image alone). The bounces are
    elementwise per map, so the groups share one call; the bilinear upsamplings are done
    per group and in each group's own memory layout, as PyTorch's CPU kernel rounds
    differently with the number of maps (from 8) and the layout.
    """
    size = (int(size[0]), int(size[1]))
    if refine.steps == 0:
        return [F.interpolate(g, size=size, mode="bilinear", align_corners=False)
                for g in groups]
    radius, dilation, sigma_space = refine.window()
    s = refine.scale
    small = size if s == 1.0 else (max(1, round(size[0] * s)), max(1, round(size[1] * s)))
    first = [F.interpolate(g, size=small, mode="bilinear", align_corners=False) for g in groups]
    image = pixels.to(first[0].device)
    if small != size:
        image = F.adaptive_avg_pool2d(image, small)
    prob = pixel_chain_refine(
        first[0] if len(first) == 1 else torch.cat(first, 1), image, radius=radius,
        dilation=dilation, sigma_space=sigma_space, sigma_color=refine.sigma_color,
        steps=refine.steps,
        nonzero=torch.cat([g.flatten(2).any(2) for g in groups], 1),  # zero maps stay zero
    )
    out = [prob]
    if len(groups) > 1:
        # each group's maps in the memory layout of its own upsampled maps (as refined alone:
        # the bilinear kernel's rounding depends on the layout too)
        out = [torch.empty_like(f).copy_(part) for f, part in
               zip(first, torch.split(prob, [g.shape[1] for g in groups], 1))]
    if small != size:
        out = [F.interpolate(p, size=size, mode="bilinear", align_corners=False) for p in out]
    return out


@dataclass(frozen=True)
class Components:
    """How regions are split into connected components
    (:func:`segment.backends.component_regions`).

    Attributes:
        connectivity: split every region into its 8-connected components (``False``: the
            regions as they are, renumbered ``0 .. K - 1``).
        min_area: with ``connectivity``, components smaller than this fraction of the image,
            in ``[0, 1)``, are absorbed by their neighbours (specks).
    """

    connectivity: bool = True
    min_area: float = 0.002

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.min_area) < 1.0:
            raise ValueError(f"min_area is a fraction of the image in [0, 1), got {self.min_area!r}")
        object.__setattr__(self, "connectivity", bool(self.connectivity))
        object.__setattr__(self, "min_area", float(self.min_area))

    def min_pixels(self, size: tuple[int, int]) -> int | None:
        """``min_area`` in pixels of an image of ``size``; ``None`` without ``connectivity``."""
        if not self.connectivity:
            return None
        return int(round(self.min_area * size[0] * size[1]))


def decide_regions(grid_prob: Tensor, score: Tensor, prob: Tensor, hard: Tensor, labels: Tensor,
                   *, heat: str = "expected") -> tuple[Tensor, Tensor, Tensor]:
    """The foreground decision and the heatmap of regions found on a soft assignment.

    The ``K`` regions of the assignment (each token's most likely one) are scored by the mean
    of ``score`` over their tokens; one is foreground when that mean exceeds the score map's
    mean over the image. Every pixel region (``labels``) takes the decision of the
    assignment's region most of its pixels took (``hard``). The heatmap is every pixel's
    expected region score ``sum_k prob_k score_k`` (``heat="expected"``), or the mean of
    that map and the score map (both min-maxed) and the mask (``"blend"``: the mask ranks
    the foreground first, the maps rank the pixels inside each side). An image whose regions
    all fall on one side has no split: its heatmap is the score map (bilinear) and its
    labels and mask the protocol's pixel rule on it (above its mean), region 1 foreground.

    Args:
        grid_prob: ``(B, K, h, w)`` the soft assignment on the grid.
        score: ``(B, h, w)`` the foreground score on the grid.
        prob: ``(B, K, H, W)`` the assignment at the output size (refined or upsampled).
        hard: ``(B, H, W)`` long, every pixel's region of ``prob`` (its max over ``K``).
        labels: ``(B, H, W)`` long pixel regions ``0 .. K' - 1`` (e.g. ``hard``'s connected
            components).
        heat: ``"expected"`` or ``"blend"``.

    Returns:
        ``(heat, labels, foreground)``: ``(B, H, W)`` heatmap, ``(B, H, W)`` labels and
        ``(B, K'')`` which labels are foreground (ids absent from an image are not).
    """
    if heat not in HEATS:
        raise ValueError(f"heat must be one of {HEATS}, got {heat!r}")
    b, kp = grid_prob.shape[:2]
    size = tuple(prob.shape[-2:])
    score_img = F.interpolate(score.unsqueeze(1), size=size, mode="bilinear",
                              align_corners=False)[:, 0]
    # mean score over each region's tokens, on the grid
    prop_score = region_scores(grid_prob.max(1).indices, score, kp)
    prop_fg = prop_score > score.flatten(1).mean(1, keepdim=True)
    k = int(labels.max()) + 1
    score_img = score_img.to(labels.device)
    # every region inherits the decision of the assignment's region most of its pixels took
    votes = torch.zeros(b, k, kp, device=labels.device)
    votes.view(b, -1).scatter_add_(
        1, (labels * kp + hard).flatten(1), torch.ones_like(hard.flatten(1), dtype=votes.dtype)
    )
    foreground = torch.gather(prop_fg.to(labels.device), 1, votes.argmax(-1))
    present = torch.zeros(b, k, dtype=torch.bool, device=labels.device)
    present.scatter_(1, labels.flatten(1), True)
    foreground &= present
    # heatmap (AP): every pixel's expected region score under the soft assignment
    out = torch.bmm(prop_score.to(prob).unsqueeze(1), prob.flatten(2)).view_as(score_img)
    fg_px = torch.gather(foreground, 1, labels.flatten(1))
    if heat == "blend":  # rank by the mask, then by the scores inside it
        out = (minmax(out) + minmax(score_img.to(out)) + fg_px.view_as(out).to(out)) / 3
    # an image whose regions all fell on one side (one region, or a uniform decision) has
    # no foreground/background split: fall back to the protocol's pixel rule on the score
    # (heatmap and mask), the method's floor
    flat = fg_px.all(1) | ~fg_px.any(1)
    if bool(flat.any()):
        r = score_img.flatten(1)
        out = torch.where(flat.view(b, 1, 1), score_img.to(out), out)
        split = (r > r.mean(1, keepdim=True)).view_as(labels).long()
        labels = torch.where(flat.view(b, 1, 1), split, labels)
        if foreground.shape[1] < 2:
            foreground = F.pad(foreground, (0, 1))
        two = torch.zeros_like(foreground)
        two[:, 1] = True
        foreground = torch.where(flat.view(b, 1), two, foreground)
    return out, labels, foreground
