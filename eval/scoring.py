"""From a method's output to per-image metric states: the evaluator's post-processing.

Binary sets are scored with the protocol's scores at the evaluation size (``mask_at``:
:func:`method_maps`) and the peer metrics of the saliency literature at the ground truth's
original resolution, with the maps ``segment`` writes there (:func:`peer_maps`); multi-class
sets with the DiffSeg protocol's Hungarian matching (:func:`score_multiclass`); sets of human
segmentations (BSDS500) with the label maps ``segment`` writes at the photo's size
(:func:`score_regions`). The states and their definitions: :mod:`segment.eval.metrics`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from segment.eval.metrics import (
    BinaryState,
    MulticlassState,
    PeerCurves,
    RegionState,
    binary_states,
    hungarian_state,
    peer_curves,
    region_state,
)
from segment.eval.specs import ConfigError
from torch import Tensor

from segment.core.masks import (
    MethodOutput,
    label_upsampling_setting,
    labels_at,
    minmax,
    threshold_mean,
    to_masks,
    to_masks_and_labels,
)


def batch_targets(batch: Sequence[Any]) -> list[Tensor]:
    """The ground truths of a batch of samples (``Sample.target``) as tensors."""
    return [torch.from_numpy(np.ascontiguousarray(s.target)) for s in batch]


def batch_originals(batch: Sequence[Any]) -> list[Tensor]:
    """The binary ground truths at their original resolution (``Sample.original``; the
    target itself where the set gives none)."""
    return [torch.from_numpy(np.ascontiguousarray(s.target if s.original is None else s.original))
            for s in batch]


def peer_maps(out: MethodOutput, sizes: list[tuple[int, int]]) -> list[tuple[Tensor, Tensor]]:
    """Per image ``(R, mask)`` at ``sizes`` exactly as ``segment`` writes them there (the maps
    the peer metrics score, whatever ``mask_at``).

    ``R``: the method's heatmap upsampled bilinearly to the size and min-max normalised per
    image (:func:`segment.core.masks.heatmap_at`; the map ``maxF`` thresholds). The mask:
    ``R > mean(R)`` for heatmap methods; for region methods the union of the foreground
    regions with the labels upsampled by ``segment``'s default ``label_upsampling``
    (``smooth``), not a resized 224 px mask (:func:`segment.run.api.render.postprocess`).
    """
    mode = label_upsampling_setting(None)
    return _maps_by_size(out, sizes, lambda sub, size: to_masks_and_labels(sub, size, mode)[:2])


def method_maps(out: MethodOutput, sizes: list[tuple[int, int]], mask_at: str) -> list[tuple[Tensor, Tensor]]:
    """Per image ``(R, mask)`` at its target size (protocol §3 post-processing).

    ``mask_at="image"``: upsample bilinearly, min-max, threshold at the mean (ViT protocol);
    ``"grid"``: threshold at the mean on the method's own grid, then nearest to the target
    size (ConceptAttention's FLUX protocol); ``R`` for AP is the bilinear one in both.
    """
    def maps(sub: MethodOutput, size: tuple[int, int]) -> tuple[Tensor, Tensor]:
        r, mask = to_masks(sub, size)
        if mask_at == "grid" and sub.labels is None:
            grid_mask = threshold_mean(minmax(sub.heatmap.float()))
            mask = labels_at(grid_mask.long(), size).bool()
        return r, mask

    return _maps_by_size(out, sizes, maps)


def _maps_by_size(out: MethodOutput, sizes: list[tuple[int, int]],
                  maps: Callable[[MethodOutput, tuple[int, int]], tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]]:
    """Per image ``maps(sub, size)[j]``: the images of one size go through ``maps`` together
    as the sub-output ``sub`` (their heatmaps, labels and foreground)."""
    b = out.heatmap.shape[0]
    if len(sizes) != b:
        raise ValueError(f"method returned {b} heatmaps for a batch of {len(sizes)}")
    groups: dict[tuple[int, int], list[int]] = {}
    for i, s in enumerate(sizes):
        groups.setdefault(s, []).append(i)
    res: list[tuple[Tensor, Tensor] | None] = [None] * b
    for size, idx in groups.items():
        sub = MethodOutput(
            heatmap=out.heatmap[idx],
            labels=None if out.labels is None else out.labels[idx],
            foreground=None if out.foreground is None else out.foreground[idx],
        )
        r, mask = maps(sub, size)
        for j, i in enumerate(idx):
            res[i] = (r[j], mask[j])
    return res  # type: ignore[return-value]


def score_binary(out: MethodOutput, targets: list[Tensor], mask_at: str,
                 originals: list[Tensor] | None = None) -> list[BinaryState]:
    return score_binary_many([out], targets, mask_at, originals)[0]


def _size_groups(sizes: Sequence[tuple[int, ...]], methods: int) -> list[list[tuple[int, int]]]:
    groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for m in range(methods):
        for i, size in enumerate(sizes):
            groups.setdefault(size, []).append((m, i))
    return list(groups.values())


def score_binary_many(outs: Sequence[MethodOutput], targets: list[Tensor], mask_at: str,
                      originals: list[Tensor] | None = None) -> list[list[BinaryState]]:
    """Per method, per image states of several methods' outputs on one batch.

    The maps stay on the methods' device; every (method, image) pair of one target size is
    scored in one batched call (AP by one sort per row, :func:`binary_states`). The peer
    metrics are scored against ``originals`` (the ground truths at their original
    resolution; ``None``: the targets) with :func:`peer_maps` at their sizes.
    """
    originals = targets if originals is None else originals
    if len(originals) != len(targets):
        raise ValueError(f"{len(originals)} original ground truths for {len(targets)} targets")
    sizes = [tuple(t.shape) for t in targets]
    maps = [method_maps(out, sizes, mask_at) for out in outs]
    osizes = [tuple(t.shape) for t in originals]
    omaps = [peer_maps(out, osizes) for out in outs]
    peer: dict[tuple[int, int], PeerCurves] = {}
    for pairs in _size_groups(osizes, len(outs)):
        r = torch.stack([omaps[m][i][0] for m, i in pairs])
        pred = torch.stack([omaps[m][i][1] for m, i in pairs])
        gt = torch.stack([originals[i] for _, i in pairs]).to(r.device).bool()
        curves = peer_curves(r, pred, gt)
        for k, pair in enumerate(pairs):
            peer[pair] = curves.rows([k])
    res: list[list[BinaryState | None]] = [[None] * len(targets) for _ in outs]
    for pairs in _size_groups(sizes, len(outs)):
        r = torch.stack([maps[m][i][0] for m, i in pairs])
        pred = torch.stack([maps[m][i][1] for m, i in pairs])
        gt = torch.stack([targets[i] for _, i in pairs]).to(r.device).bool()
        curves = PeerCurves.stack([peer[p] for p in pairs])
        for (m, i), st in zip(pairs, binary_states(r, pred, gt, curves)):
            res[m][i] = st
    return res  # type: ignore[return-value]


def score_multiclass(out: MethodOutput, targets: list[Tensor], num_classes: int, label: str) -> list[MulticlassState]:
    _need_labels(out, label, "multi-class sets")
    states = []
    for i, t in enumerate(targets):
        lab = labels_at(out.labels[i : i + 1], tuple(t.shape))[0].cpu()
        st = hungarian_state(lab, t, num_classes)
        st.escapes = _escapes(out, i)
        states.append(st)
    return states


def _escapes(out: MethodOutput, i: int) -> list[float]:
    """Image ``i``'s region escape probabilities (``MethodOutput.escape``; ``[]`` for a method
    that does not report them)."""
    return [] if out.escape is None else [float(e) for e in out.escape[i].detach().cpu().reshape(-1)]


def _need_labels(out: MethodOutput, label: str, what: str) -> None:
    if out.labels is None:
        raise ConfigError(
            f"method {label!r} returns only a heatmap; {what} need a region method"
            " (MethodOutput.labels), e.g. the region-growing methods"
        )


def region_labels(out: MethodOutput, i: int, size: tuple[int, int]) -> Tensor:
    """Image ``i``'s label map at ``size`` exactly as ``segment`` writes it (``labels/``, with
    the default ``label_upsampling``: ``smooth``, :func:`segment.core.masks.labels_at`)."""
    return labels_at(out.labels[i : i + 1], size, label_upsampling_setting(None))[0]


def score_regions(out: MethodOutput, targets: list[Tensor], label: str) -> list[RegionState]:
    """Per image :func:`segment.eval.metrics.region_state` of the method's label map, at the
    size of the human segmentations (``targets[i]``: ``(K, H, W)``) as ``segment`` writes it
    (:func:`region_labels`), against every one of them; with the escape probabilities of the
    method's regions where it reports them."""
    _need_labels(out, label, "sets of human segmentations")
    states = []
    for i, t in enumerate(targets):
        st = region_state(region_labels(out, i, tuple(t.shape[-2:])).cpu(), t)
        st.escapes = _escapes(out, i)
        states.append(st)
    return states
