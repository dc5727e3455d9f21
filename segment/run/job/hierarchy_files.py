"""The ``hierarchy/<name>.npz`` file of a ``segment`` run: one image's regions at every
threshold, rebuilt without the model.

Written per image by methods that give a hierarchy (``method=cuts``: the tree of the escape
cuts, :mod:`segment.core.hierarchy`); ``labels/`` keeps the default level. The file is a
numpy ``.npz`` (``np.load``) holding:

    leaves            (H, W) uint16 (int32 past 65535 leaves): every pixel's leaf, at the
                      image's own size (upsampled as labels/ is, ``label_upsampling``)
    children          (L-1, 2) int64: the two nodes each split ``L + r`` makes (leaves are
                      nodes 0 .. L-1); rows bottom-up, the last one the root
    height            (L-1,) float64: each split's height (the largest normalized cut on its
                      path from the root), non-increasing down the rows
    ncut              (L-1,) float64: each split's own normalized cut
    escape            (2L-1,) float64: every node's escape probability on the whole chain
                      (leaves, then splits)
    leaf_foreground   (L,) float64: the share of each leaf's pixels in the image's mask
                      (masks/), NaN for a leaf with no pixel at this size

The level at a threshold ``t`` keeps the splits of height below ``t``:
:func:`labels_at` rebuilds its ``(H, W)`` labels (the ids of
:meth:`segment.core.hierarchy.Hierarchy.labels_at`) and :func:`mask_at` a mask (the regions
most of whose pixels are foreground).

From the command line, ``python -m segment.run.job.levels RUN_DIR --t 0.6`` writes the
labels and masks of every image of a finished run at another threshold
(:mod:`segment.run.job.levels`).
"""

from __future__ import annotations

import io
import os
import zipfile

import numpy as np
import torch

from segment.core.hierarchy import Hierarchy

__all__ = ["encode_hierarchy", "labels_at", "level_labels", "level_mask", "load_hierarchy",
           "mask_at"]


def encode_hierarchy(tree: Hierarchy, leaves: np.ndarray, mask: np.ndarray) -> bytes:
    """The ``.npz`` bytes of one image's hierarchy (module docstring).

    Args:
        tree: the image's hierarchy.
        leaves: ``(H, W)`` integer every pixel's leaf at the image size.
        mask: ``(H, W)`` bool the image's foreground (for ``leaf_foreground``).
    """
    num = tree.num_leaves
    if leaves.shape != mask.shape or int(leaves.min()) < 0 or int(leaves.max()) >= num:
        raise ValueError(f"leaves must be (H, W) ids in [0, {num}) shaped as the mask "
                         f"{mask.shape}, got {leaves.shape} in [{leaves.min()}, {leaves.max()}]")
    flat = leaves.reshape(-1).astype(np.int64)
    size = np.bincount(flat, minlength=num)
    fg = np.bincount(flat, weights=mask.reshape(-1).astype(np.float64), minlength=num)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(size > 0, fg / np.maximum(size, 1), np.nan)
    buf = io.BytesIO()
    np.savez_compressed(
        buf, leaves=leaves.astype(np.uint16 if num <= 65536 else np.int32),
        children=tree.children.numpy(), height=tree.height.numpy(), ncut=tree.ncut.numpy(),
        escape=tree.escape.numpy(), leaf_foreground=share)
    return buf.getvalue()


def load_hierarchy(path: str | os.PathLike) -> tuple[Hierarchy, np.ndarray, np.ndarray]:
    """A written ``hierarchy/<name>.npz`` -> ``(tree, leaves (H, W) int64,
    leaf_foreground (L,) float64)``; the tree is checked as when it was built.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a hierarchy file (not an ``.npz``, an array missing, or arrays
            that do not make a tree), naming the file.
    """
    try:
        with np.load(path) as z:
            leaves = z["leaves"].astype(np.int64)
            share = z["leaf_foreground"].astype(np.float64)
            tree = Hierarchy(
                leaves=torch.arange(int(z["children"].shape[0]) + 1),  # each leaf its own token
                children=torch.from_numpy(z["children"].astype(np.int64)),
                height=torch.from_numpy(z["height"].astype(np.float64)),
                ncut=torch.from_numpy(z["ncut"].astype(np.float64)),
                escape=torch.from_numpy(z["escape"].astype(np.float64)))
    except (KeyError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{os.fspath(path)} is not a hierarchy file: {e}") from None
    num = tree.num_leaves
    if leaves.ndim != 2 or leaves.size == 0 or int(leaves.min()) < 0 \
            or int(leaves.max()) >= num or share.shape != (num,):
        raise ValueError(f"{os.fspath(path)} is not a hierarchy file: leaves must be (H, W) ids "
                         f"in [0, {num}) and leaf_foreground ({num},), got {leaves.shape} and "
                         f"{share.shape}")
    return tree, leaves, share


def labels_at(path: str | os.PathLike, t: float) -> np.ndarray:
    """``(H, W)`` int32 the regions at threshold ``t`` from a written hierarchy file, without
    the model: the ids ``Result.labels_at(t)`` gives (the escape cuts keeping the splits of
    height below ``t``; small ``t`` coarse, ``t`` above every height the leaves)."""
    tree, leaves, _ = load_hierarchy(path)
    return level_labels(tree, leaves, t)


def mask_at(path: str | os.PathLike, t: float) -> np.ndarray:
    """``(H, W)`` bool a foreground mask at threshold ``t``: the regions of :func:`labels_at`
    more than half of whose pixels are in the image's mask (at the default level this is
    the written mask up to the pixels where a region's majority differs)."""
    return level_mask(*load_hierarchy(path), t)


def level_labels(tree: Hierarchy, leaves: np.ndarray, t: float) -> np.ndarray:
    """:func:`labels_at` of a loaded file (:func:`load_hierarchy`): ``(H, W)`` int32."""
    return tree.leaf_labels_at(float(t)).numpy().astype(np.int32)[leaves]


def level_mask(tree: Hierarchy, leaves: np.ndarray, share: np.ndarray, t: float) -> np.ndarray:
    """:func:`mask_at` of a loaded file (:func:`load_hierarchy`): ``(H, W)`` bool."""
    region = tree.leaf_labels_at(float(t)).numpy()
    size = np.bincount(leaves.reshape(-1), minlength=tree.num_leaves).astype(np.float64)
    fg = np.nan_to_num(share) * size
    k = int(region.max()) + 1
    frac = np.bincount(region, weights=fg, minlength=k) / np.maximum(
        np.bincount(region, weights=size, minlength=k), 1.0)
    return (frac > 0.5)[region][leaves]
