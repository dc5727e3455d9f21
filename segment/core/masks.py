"""From a method's output on the token grid to image-sized heatmaps and masks (protocol §3).

The binary rule of the published protocol: the heatmap ``R`` over the patch grid is
upsampled bilinearly (``align_corners=False``) to the target size, min-max normalised to
``[0, 1]`` per image, and **foreground = R > mean(R)**. Region methods (several labelled
regions with a foreground decision) give the mask as the union of their foreground
regions instead, and keep a continuous heatmap for AP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from segment.core.hierarchy import Hierarchy


@dataclass
class MethodOutput:
    """What a segmentation method returns for a batch.

    Attributes:
        heatmap: ``(B, h, w)`` foreground score (any scale; min-max normalised later), on the
            token grid or any resolution.
        labels: ``(B, h', w')`` integer region ids (multi-region methods), or ``None``.
        foreground: ``(B, K)`` bool, whether region id ``k`` is foreground; with ``labels``.
        converged: ``(B,)`` bool, whether every iterative solve behind an image's heatmap
            met its tolerance (TokenRank's power iteration); ``None`` for methods without one.
        escape: per image, ``(K_b,)`` the escape probability of every region of the
            method's partition of the tokens (the chance that the stationary walk leaves it
            in one step, :func:`segment.core.cuts.escape_probabilities`), or ``None``.
        hierarchy: per image, the :class:`segment.core.hierarchy.Hierarchy` of a method
            that gives every level (``cuts``), or ``None``.
        leaves: ``(B, h', w')`` int64 with ``hierarchy``: every pixel's leaf of its image's
            hierarchy, at the resolution of ``labels`` (the finest level at the pixels:
            ``hierarchy[i].pixel_labels_at(leaves[i], t)`` is the level at ``t``).
    """

    heatmap: Tensor
    labels: Tensor | None = None
    foreground: Tensor | None = None
    converged: Tensor | None = None
    escape: list[Tensor] | None = None
    hierarchy: list[Hierarchy] | None = None
    leaves: Tensor | None = None

    def __post_init__(self) -> None:
        if self.heatmap.dim() != 3:
            raise ValueError(f"heatmap must be (B, h, w), got {tuple(self.heatmap.shape)}")
        if (self.labels is None) != (self.foreground is None):
            raise ValueError("labels and foreground come together")
        if self.escape is not None and len(self.escape) != self.heatmap.shape[0]:
            raise ValueError(f"escape must hold one tensor per image ({self.heatmap.shape[0]}),"
                             f" got {len(self.escape)}")
        if (self.hierarchy is None) != (self.leaves is None):
            raise ValueError("hierarchy and leaves come together")
        if self.hierarchy is not None:
            b = self.heatmap.shape[0]
            if len(self.hierarchy) != b:
                raise ValueError(f"hierarchy must hold one tree per image ({b}), got"
                                 f" {len(self.hierarchy)}")
            if self.labels is None or tuple(self.leaves.shape) != tuple(self.labels.shape):
                raise ValueError(f"leaves must be (B, h', w') as the labels, got"
                                 f" {tuple(self.leaves.shape)}")


def concat_outputs(parts: Sequence[MethodOutput]) -> MethodOutput:
    """The outputs of consecutive parts of a batch as one batch's output: heatmaps and
    labels stacked, ``foreground`` padded with ``False`` to the widest part (ids a part
    does not use are background, as in any padded batch)."""
    heat = torch.cat([p.heatmap for p in parts])
    conv = (None if any(p.converged is None for p in parts)
            else torch.cat([p.converged for p in parts]))
    if any(p.labels is None for p in parts):
        return MethodOutput(heatmap=heat, converged=conv)
    k = max(p.foreground.shape[1] for p in parts)
    fg = torch.cat([F.pad(p.foreground, (0, k - p.foreground.shape[1])) for p in parts])
    escape = None
    if all(p.escape is not None for p in parts):
        escape = [e for p in parts for e in p.escape]
    tree = leaves = None
    if all(p.hierarchy is not None for p in parts):
        tree = [t for p in parts for t in p.hierarchy]
        leaves = torch.cat([p.leaves for p in parts])
    return MethodOutput(heatmap=heat, labels=torch.cat([p.labels for p in parts]), foreground=fg,
                        converged=conv, escape=escape, hierarchy=tree, leaves=leaves)


def upsample(heatmap: Tensor, size: tuple[int, int]) -> Tensor:
    """``(B, h, w)`` -> ``(B, H, W)`` bilinear, ``align_corners=False`` (fp32)."""
    x = heatmap.float().unsqueeze(1)
    if tuple(x.shape[-2:]) != tuple(size):
        x = F.interpolate(x, size=tuple(size), mode="bilinear", align_corners=False)
    return x.squeeze(1)


def minmax(heatmap: Tensor, eps: float = 1e-12) -> Tensor:
    """Per-image min-max normalisation of ``(B, H, W)`` to ``[0, 1]`` (constant maps -> 0)."""
    flat = heatmap.flatten(1)
    lo = flat.min(1, keepdim=True).values
    hi = flat.max(1, keepdim=True).values
    return ((flat - lo) / (hi - lo).clamp_min(eps)).view_as(heatmap)


def heatmap_at(heatmap: Tensor, size: tuple[int, int]) -> Tensor:
    """The protocol's ``R``: upsampled to ``size`` and min-max normalised, ``(B, H, W)``."""
    return minmax(upsample(heatmap, size))


def threshold_mean(r: Tensor) -> Tensor:
    """Foreground = ``R > mean(R)`` per image; ``r`` is ``(B, H, W)``."""
    return r > r.flatten(1).mean(1).view(-1, 1, 1)


LABEL_UPSAMPLING = ("nearest", "smooth")


def label_upsampling_setting(value: str | None) -> str:
    """The run setting ``label_upsampling`` (``configs/segment.yaml``, :class:`segment.run.api.
    Segmenter`): ``smooth`` when unset, else one of :data:`LABEL_UPSAMPLING`."""
    mode = "smooth" if value is None else value
    if mode not in LABEL_UPSAMPLING:
        raise ValueError(f"label_upsampling must be one of {LABEL_UPSAMPLING}, got {value!r}")
    return str(mode)


def labels_at(labels: Tensor, size: tuple[int, int], mode: str = "nearest") -> Tensor:
    """Resize ``(B, h, w)`` integer labels to ``size``.

    ``nearest``: nearest neighbour (the evaluation's rule). ``smooth``: every pixel takes
    the region whose one-hot map, upsampled bilinearly (``align_corners=False``), is
    largest there (ties: the smaller id), as the reference rows of ``camvid-dev`` upsample
    their grids; region boundaries follow the bilinear interpolation instead of steps
    ``H / h`` pixels wide (:func:`smooth_labels_at`).
    """
    if mode == "smooth":
        return smooth_labels_at(labels, size)
    if mode != "nearest":
        raise ValueError(f"label upsampling must be one of {LABEL_UPSAMPLING}, got {mode!r}")
    x = labels.unsqueeze(1).float()
    if tuple(x.shape[-2:]) != tuple(size):
        x = F.interpolate(x, size=tuple(size), mode="nearest")
    return x.squeeze(1).long()


def _linear_taps(n_in: int, n_out: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Bilinear (``align_corners=False``) taps along one axis, exactly: source indices
    ``i0, i1`` and integer weights ``l0, l1`` summing to ``2 n_out``. PyTorch's rule: the
    source coordinate ``(i + 0.5) n_in / n_out - 0.5``, clamped at 0, here as the integer
    ``(2 i + 1) n_in - n_out`` over ``2 n_out``."""
    num = ((2 * torch.arange(n_out, dtype=torch.long) + 1) * n_in - n_out).clamp_min(0)
    den = 2 * n_out
    i0 = (num // den).clamp_max(n_in - 1)
    i1 = torch.where(i0 < n_in - 1, i0 + 1, i0)
    l1 = torch.where(i0 < n_in - 1, num % den, 0)  # the last row or column: all weight on i0
    return i0.to(device), i1.to(device), (den - l1).to(device), l1.to(device)


def smooth_labels_at(labels: Tensor, size: tuple[int, int]) -> Tensor:
    """``(B, h, w)`` integer labels -> ``(B, H, W)``: argmax over the regions' bilinearly
    upsampled one-hot maps (ties: the smaller id), without forming those maps.

    Only the four source pixels around an output pixel carry weight, so a pixel whose four
    agree takes their label; the others (near region boundaries) compare the summed
    weights of their at most four candidate labels. The weights are exact integers (the
    bilinear weights times ``4 H W``): an exact tie, e.g. two labels with half the weight
    each, goes to the smaller id (float one-hot maps would break it by rounding). Cost:
    one gather over the output plus work on the boundary pixels, whatever the number of
    regions (224 -> 600 x 400 px: ~3 ms on one core, nearest neighbour ~0.4 ms).
    """
    lab = labels.long()
    b, h, w = lab.shape
    if (h, w) == tuple(size):
        return lab.clone()
    H, W = int(size[0]), int(size[1])
    dev = lab.device
    ty, tx = _linear_taps(h, H, dev), _linear_taps(w, W, dev)
    right = torch.cat([lab[:, :, 1:], lab[:, :, -1:]], 2)  # the neighbour a cell reads (clamped)
    below = torch.cat([lab[:, 1:], lab[:, -1:]], 1)
    diag = torch.cat([right[:, 1:], right[:, -1:]], 1)
    mixed = (lab != right) | (lab != below) | (lab != diag)  # (B, h, w): cells with a boundary
    code = torch.where(mixed, -1, lab)  # a cell's label where its four agree, else -1
    if dev.type == "cpu" and _NUMPY_ON_CPU:  # numpy: 2-5x faster gathers at 0.2-12 megapixels
        return torch.from_numpy(_smooth_fix(
            lab.numpy(), np.take(np.take(code.numpy(), ty[0].numpy(), 1), tx[0].numpy(), 2),
            [t.numpy() for t in ty], [t.numpy() for t in tx], np))
    out = code.index_select(1, ty[0]).index_select(2, tx[0])
    return _smooth_fix(lab, out, ty, tx, torch)


_NUMPY_ON_CPU = True  # False: the torch path of other devices, on the CPU (tests)


def _smooth_fix(lab, out, ty, tx, xp):
    """Fill the ``-1`` pixels of ``out`` (``(B, H, W)``; numpy or torch, ``xp``) with the
    label of the largest interpolated one-hot value among their four source pixels."""
    b, h, w = lab.shape
    H, W = out.shape[1:]
    flat = out.reshape(-1)
    neg = flat < 0
    pos = neg.nonzero()[0] if xp is np else neg.nonzero(as_tuple=True)[0]
    if not len(pos):
        return out
    bi, rem = pos // (H * W), pos % (H * W)
    yi, xi = rem // W, rem % W
    y0, y1, wy0, wy1 = (t[yi] for t in ty)
    x0, x1, wx0, wx1 = (t[xi] for t in tx)
    src = lab.reshape(-1)
    base = bi * (h * w)
    a, bb, c, d = (src[base + r * w + q] for r, q in ((y0, x0), (y0, x1), (y1, x0), (y1, x1)))
    wa, wb, wc, wd = wy0 * wx0, wy0 * wx1, wy1 * wx0, wy1 * wx1  # integers, sum 4 H W
    ab, ac, ad, bc, bd, cd = a == bb, a == c, a == d, bb == c, bb == d, c == d
    # one integer key per candidate: its score, then the smaller id (m > every id)
    m = int(src.max()) + 1
    best = None
    for k, score in ((a, wa + wb * ab + wc * ac + wd * ad), (bb, wb + wa * ab + wc * bc + wd * bd),
                     (c, wc + wa * ac + wb * bc + wd * cd), (d, wd + wa * ad + wb * bd + wc * cd)):
        key = score * m + (m - 1 - k)
        best = key if best is None else xp.maximum(best, key)
    flat[pos] = m - 1 - best % m
    return out


def to_masks(out: MethodOutput, size: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Image-sized ``(R, mask)`` for a batch: ``R`` in ``[0, 1]`` and a bool mask.

    Heatmap methods threshold ``R`` at its mean; region methods take the union of their
    foreground regions.
    """
    r, mask, _ = to_masks_and_labels(out, size)
    return r, mask


def to_masks_and_labels(out: MethodOutput, size: tuple[int, int],
                        label_upsampling: str = "nearest") -> tuple[Tensor, Tensor, Tensor | None]:
    """:func:`to_masks` and the image-sized labels it read (:func:`labels_at` with mode
    ``label_upsampling``: ``nearest``, the evaluation's rule, or ``smooth``; ``None`` for
    heatmap methods)."""
    r = heatmap_at(out.heatmap, size)
    if out.labels is None:
        return r, threshold_mean(r), None
    lab = labels_at(out.labels, size, label_upsampling)
    fg = out.foreground.to(lab.device)
    k = fg.shape[1]
    if int(lab.max()) >= k or int(lab.min()) < 0:
        raise ValueError(f"labels must lie in [0, {k}) to index foreground (B, {k})")
    mask = torch.gather(fg, 1, lab.flatten(1)).view_as(lab)
    return r, mask, lab
