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

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class MethodOutput:
    """What a segmentation method returns for a batch.

    Attributes:
        heatmap: ``(B, h, w)`` foreground score (any scale; min-max normalised later), on the
            token grid or any resolution.
        labels: ``(B, h', w')`` integer region ids (multi-region methods), or ``None``.
        foreground: ``(B, K)`` bool, whether region id ``k`` is foreground; with ``labels``.
    """

    heatmap: Tensor
    labels: Tensor | None = None
    foreground: Tensor | None = None

    def __post_init__(self) -> None:
        if self.heatmap.dim() != 3:
            raise ValueError(f"heatmap must be (B, h, w), got {tuple(self.heatmap.shape)}")
        if (self.labels is None) != (self.foreground is None):
            raise ValueError("labels and foreground come together")


def concat_outputs(parts: Sequence[MethodOutput]) -> MethodOutput:
    """The outputs of consecutive parts of a batch as one batch's output: heatmaps and
    labels stacked, ``foreground`` padded with ``False`` to the widest part (ids a part
    does not use are background, as in any padded batch)."""
    heat = torch.cat([p.heatmap for p in parts])
    if any(p.labels is None for p in parts):
        return MethodOutput(heatmap=heat)
    k = max(p.foreground.shape[1] for p in parts)
    fg = torch.cat([F.pad(p.foreground, (0, k - p.foreground.shape[1])) for p in parts])
    return MethodOutput(heatmap=heat, labels=torch.cat([p.labels for p in parts]), foreground=fg)


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


def labels_at(labels: Tensor, size: tuple[int, int]) -> Tensor:
    """Nearest-neighbour resize of ``(B, h, w)`` integer labels to ``size``."""
    x = labels.unsqueeze(1).float()
    if tuple(x.shape[-2:]) != tuple(size):
        x = F.interpolate(x, size=tuple(size), mode="nearest")
    return x.squeeze(1).long()


def to_masks(out: MethodOutput, size: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Image-sized ``(R, mask)`` for a batch: ``R`` in ``[0, 1]`` and a bool mask.

    Heatmap methods threshold ``R`` at its mean; region methods take the union of their
    foreground regions.
    """
    r, mask, _ = to_masks_and_labels(out, size)
    return r, mask


def to_masks_and_labels(out: MethodOutput, size: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor | None]:
    """:func:`to_masks` and the image-sized labels it read (nearest, :func:`labels_at`;
    ``None`` for heatmap methods)."""
    r = heatmap_at(out.heatmap, size)
    if out.labels is None:
        return r, threshold_mean(r), None
    lab = labels_at(out.labels, size)
    fg = out.foreground.to(lab.device)
    k = fg.shape[1]
    if int(lab.max()) >= k or int(lab.min()) < 0:
        raise ValueError(f"labels must lie in [0, {k}) to index foreground (B, {k})")
    mask = torch.gather(fg, 1, lab.flatten(1)).view_as(lab)
    return r, mask, lab
