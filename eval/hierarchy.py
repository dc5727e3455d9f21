"""Hierarchies scored as the field scores them: ODS and OIS at a list of thresholds (protocol §4d).

A hierarchical method returns, per image, every partition at once: anything with
``labels_at(t) -> (H, W)`` integer labels and ``heights`` (the sorted exact values of ``t``
at which the partition changes) is a :class:`HierarchyLike`: the tree of escape cuts (finer as
``t`` grows) and a BSDS ``ucm2`` map (:class:`UCM`, coarser as ``t`` grows) alike.

Per image and threshold (:func:`score_image`):

- sets of human segmentations (BSDS500, ``task="regions"``): the
  :class:`~segment.eval.metrics.RegionState` of ``labels_at(t)`` against every annotator
  (Covering sums, PRI, VI, the region count), the very sums
  :func:`~segment.eval.metrics.region_state` gives for that label map;
- multi-class sets (CamVid, label folders, ``task="multiclass"``): the Hungarian
  :class:`~segment.eval.metrics.MulticlassState` of ``labels_at(t)``.

Over the set (:func:`hierarchy_table`), per metric:

- **ODS**: the one threshold best for the whole set (Covering pooled over the images at that
  threshold, PRI and VI averaged; VI lower is better; mIoU from the summed counts), reported
  with its threshold (the first best, as the official ``collect_eval_reg.m``);
- **OIS** (regions only): every image at its own best threshold (Covering: each image's
  partition best by its own covering, the sums then pooled; PRI: the mean of the per-image
  maxima; VI: of the minima);
- **OIS (exact heights)** (regions only): the same over every distinct partition of each
  image's hierarchy (:func:`exact_thresholds`), not only those the threshold grid reaches;
- optionally the **default** level (one fixed threshold).

Intervals: the images are resampled with replacement (:func:`segment.eval.metrics.resample_counts`,
the draws of ``segment-eval``'s bootstrap); every draw is scored like the set, so the ODS of
a draw picks its threshold again from the draw's own curve (and the 95% range of those
thresholds is reported), the OIS of a draw pools the drawn images' own best partitions.

The curve of every metric against the threshold: :meth:`HierarchyResults.write` writes
``curves.csv`` and ``curves.png`` beside ``hierarchy.{json,csv,md}``.

BSDS500's ``ucm2`` files (gPb-owt-ucm and every method of its bench): :func:`segment.eval.ucm2.read_ucm2`,
thresholded as ``bench/benchmarks/evaluation_reg_image.m`` does (``bwlabel(ucm2 <= t)``,
8-connected, read at ``[1::2, 1::2]``) at its 99 thresholds (:data:`BENCH_THRESHOLDS`)::

    python -m segment.eval.hierarchy ucm2 /data/bsds-dev [--split val] [--out DIR] [--exact]

reproduces the ODS / OIS table of ``bsds-dev/REFERENCE.md`` (``tests/test_eval_hierarchy.py``).
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
from segment.eval.figures import write_figure
from segment.eval.metrics import (
    MulticlassState,
    RegionState,
    _contiguous,
    _np,
    hungarian_state,
    median_count,
    percentile_interval,
    region_state_of_tables,
    resample_counts,
    total,
)

from segment.eval.ucm2 import UCM, read_ucm2  # noqa: F401  (UCM: re-exported for callers)

from segment.utils import EXIT_BAD_INPUT, atomic_write_json, atomic_write_text

BENCH_NTHRESH = 99
BENCH_THRESHOLDS = np.linspace(1.0 / (BENCH_NTHRESH + 1), 1.0 - 1.0 / (BENCH_NTHRESH + 1), BENCH_NTHRESH)
"""The official region bench's thresholds of a ``ucm2`` (``evaluation_reg_image.m``,
``nthresh = 99``: ``linspace(1/(n+1), 1 - 1/(n+1), n)``, i.e. 0.01, 0.02, ..., 0.99)."""

TREE_THRESHOLDS = np.round(0.02 * np.arange(1, 101), 2)
"""The thresholds of the project's hierarchies (split heights in ``(0, 2]``): 0.02, 0.04, ..., 2.00."""

TASKS = ("regions", "multiclass")
LEVELS = ("default", "ODS", "OIS", "OIS exact")


@runtime_checkable
class HierarchyLike(Protocol):
    """What the evaluator needs of a hierarchy of one image.

    Attributes:
        heights: ``(M,)`` float64, ascending: the thresholds at which the partition changes;
            every distinct partition is ``labels_at(t)`` for some ``t`` in
            :func:`exact_thresholds` ``(heights)`` (true of a tree whose split is kept when
            its height is below ``t``, and of a UCM read as ``ucm2 <= t`` whose heights hold
            its every value, 0 included).
    """

    heights: np.ndarray

    def labels_at(self, t: float) -> np.ndarray:
        """``(H, W)`` integer region ids of the partition at threshold ``t`` (any ids; a
        numpy array or a torch tensor)."""
        ...


class OnLeafMap:
    """A tree whose levels are given on its leaves, as a :class:`HierarchyLike` at the
    resolution of a leaf map: ``labels_at(t) = tree.leaf_labels_at(t)[leaves]``.

    Upsample (or refine) the finest level once to the ground truth's size and every level
    follows by this lookup: the levels nest exactly at that size (each threshold upsampled on
    its own need not), and the evaluator scores them from the finest level's tables.

    Args:
        tree: anything with ``heights`` (ascending thresholds where the partition changes)
            and ``leaf_labels_at(t)`` (``(L,)`` the region of each leaf at ``t``; numpy or
            torch), e.g. the tree of escape cuts.
        leaves: ``(H, W)`` the leaf (``0 .. L-1``) of every pixel.
    """

    def __init__(self, tree: Any, leaves: np.ndarray) -> None:
        self.tree = tree
        self.leaves = _np(leaves).astype(np.int64)
        if self.leaves.ndim != 2:
            raise ValueError(f"leaves must be an (H, W) map of leaf ids, got shape {self.leaves.shape}")
        self.heights = _np(tree.heights).astype(np.float64)

    def labels_at(self, t: float) -> np.ndarray:
        per_leaf = _np(self.tree.leaf_labels_at(t)).ravel()
        if per_leaf.size <= int(self.leaves.max()):
            raise ValueError(f"leaf_labels_at({t}) gives {per_leaf.size} leaves; the leaf map uses ids up to"
                             f" {int(self.leaves.max())}")
        return per_leaf[self.leaves]


def exact_thresholds(heights: Sequence[float] | np.ndarray) -> np.ndarray:
    """The thresholds that reach every distinct partition of a hierarchy with these
    ``heights``: each height and the next float above the largest (a split of height ``h``
    kept for ``t > h`` appears there); ``[0.0]`` for a hierarchy without a height (one
    partition)."""
    h = np.unique(_np(heights).astype(np.float64).ravel())
    if h.size == 0:
        return np.zeros(1)
    if not np.isfinite(h).all():
        raise ValueError("hierarchy heights must be finite")
    return np.append(h, np.nextafter(h[-1], np.inf))


def _check_thresholds(thresholds: Sequence[float] | np.ndarray) -> np.ndarray:
    t = np.asarray(thresholds, dtype=np.float64)
    if t.ndim != 1 or t.size == 0 or not np.isfinite(t).all():
        raise ValueError(f"thresholds must be a non-empty 1-D list of finite numbers, got shape {t.shape}")
    if np.unique(t).size != t.size:
        raise ValueError("thresholds must be distinct")
    return t


# ---------------------------------------------------------------------------------------
# one image
# ---------------------------------------------------------------------------------------


@dataclass
class ExactBest:
    """One image's best partitions over every distinct partition of its hierarchy.

    Attributes:
        covering_num, covering_den: the covering sums of the partition best by its own
            covering (``den`` is the image's human area, the same at every level).
        regions: that partition's region count.
        pri: the largest PRI of any partition.
        vi: the smallest VI of any partition.
        partitions: how many thresholds were scored (:func:`exact_thresholds`).
    """

    covering_num: float
    covering_den: int
    regions: int
    pri: float
    vi: float
    partitions: int

    def to_dict(self) -> dict:
        return {"covering_num": self.covering_num, "covering_den": self.covering_den, "regions": self.regions,
                "pri": self.pri, "vi": self.vi, "partitions": self.partitions}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ExactBest:
        return cls(covering_num=float(d["covering_num"]), covering_den=int(d["covering_den"]),
                   regions=int(d["regions"]), pri=float(d["pri"]), vi=float(d["vi"]),
                   partitions=int(d["partitions"]))


@dataclass
class ImageScores:
    """One image's scores of a hierarchy at every threshold.

    Attributes:
        task: ``"regions"`` or ``"multiclass"``.
        thresholds: ``(T,)`` the thresholds scored.
        states: per threshold, the image's metric state of ``labels_at(t)`` (its
            ``region_counts`` hold the region count).
        exact: regions only, with ``exact=True``: the best partitions over every distinct
            partition (:class:`ExactBest`).
    """

    task: str
    thresholds: np.ndarray
    states: list[RegionState] | list[MulticlassState]
    exact: ExactBest | None = None

    def state_at(self, t: float) -> RegionState | MulticlassState:
        """The state at threshold ``t`` (one of :attr:`thresholds`)."""
        hit = np.flatnonzero(self.thresholds == float(t))
        if hit.size == 0:
            raise KeyError(f"threshold {t} was not scored (scored: {self.thresholds.min()} to {self.thresholds.max()})")
        return self.states[int(hit[0])]

    def to_dict(self) -> dict:
        """JSON-ready (for a per-image metric cache)."""
        return {"kind": "hierarchy", "task": self.task, "thresholds": self.thresholds.tolist(),
                "states": [s.to_dict() for s in self.states],
                "exact": None if self.exact is None else self.exact.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ImageScores:
        if d.get("kind") != "hierarchy" or d.get("task") not in TASKS:
            raise ValueError(f"not the scores of a hierarchy: kind {d.get('kind')!r}, task {d.get('task')!r}")
        state = RegionState.from_dict if d["task"] == "regions" else MulticlassState.from_dict
        return cls(task=str(d["task"]), thresholds=np.asarray(d["thresholds"], dtype=np.float64),
                   states=[state(s) for s in d["states"]],
                   exact=None if d.get("exact") is None else ExactBest.from_dict(d["exact"]))


class _Levels:
    """The partitions of one hierarchy against its finest one: ``labels_at(t)`` of a nested
    hierarchy is a merge of the finest partition's regions, so a level's contingency
    tables are sums of the finest's rows and a level is known by that merge (identical
    partitions are scored once)."""

    def __init__(self, h: HierarchyLike, shape: tuple[int, int], thresholds: np.ndarray) -> None:
        self.h, self.shape = h, shape
        ends = [self.labels(float(thresholds.min())), self.labels(float(thresholds.max()))]
        fine = max(ends, key=lambda lab: int(np.unique(lab).size))
        self.fine_ids, self.fine = _contiguous(fine)  # (P,) ids 0 .. F-1 of the finest level

    def labels(self, t: float) -> np.ndarray:
        lab = _np(self.h.labels_at(t))
        if lab.shape != self.shape or lab.dtype.kind not in "iu":
            raise ValueError(f"{type(self.h).__name__}.labels_at({t}) returned {lab.dtype} {lab.shape}; expected"
                             f" integer labels of the ground truth's size {self.shape}")
        return lab

    def merge(self, lab: np.ndarray) -> np.ndarray | None:
        """``(F,)`` the level's region of every finest region, numbered in order of first
        appearance (so one partition has one merge whatever its ids); ``None`` when the level
        is not a merge of the finest regions (not nested)."""
        c = lab.ravel()
        m = np.zeros(len(self.fine_ids), dtype=c.dtype)
        m[self.fine] = c
        if not np.array_equal(m[self.fine], c):
            return None
        _, first, inv = np.unique(m, return_index=True, return_inverse=True)
        rank = np.empty(first.size, dtype=np.int64)
        rank[np.argsort(first)] = np.arange(first.size)
        return rank[inv.ravel()]


def _copy(state: RegionState | MulticlassState) -> Any:
    """A state of its own (a partition reached at several thresholds is scored once; its
    states must not share their lists)."""
    return type(state).from_dict(state.to_dict())


def _merged_rows(table: np.ndarray, merge: np.ndarray) -> np.ndarray:
    """``(C, G)`` sums of the rows of ``table`` (``(F, G)``) by ``merge`` (``(F,)``, every
    value of ``0 .. C-1`` present)."""
    order = np.argsort(merge, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(merge[order]) != 0])
    return np.add.reduceat(table[order], starts, axis=0)


class _RegionScorer:
    """Region states of the levels of one hierarchy against ``K`` human segmentations,
    from the finest level's contingency tables."""

    def __init__(self, levels: _Levels, gts: np.ndarray) -> None:
        self.levels = levels
        f, nf = levels.fine, len(levels.fine_ids)
        cols, self.g_ids, self.bounds = [], [], [0]
        for gk in gts:
            g_ids, gi = _contiguous(gk)
            cols.append(np.bincount(f * len(g_ids) + gi, minlength=nf * len(g_ids)).reshape(nf, len(g_ids)))
            self.g_ids.append(g_ids)
            self.bounds.append(self.bounds[-1] + len(g_ids))
        self.table = np.concatenate(cols, axis=1)  # (F, sum_k G_k)
        self.gts = gts
        self.seen: dict[bytes, RegionState] = {}

    def state(self, t: float) -> RegionState:
        lab = self.levels.labels(t)
        merge = self.levels.merge(lab)
        if merge is None:  # not nested in the finest level: scored on its own
            from segment.eval.metrics import region_state

            return region_state(lab, self.gts)
        key = merge.tobytes()
        if key not in self.seen:
            agg = _merged_rows(self.table, merge)
            b = self.bounds
            self.seen[key] = region_state_of_tables(
                [(agg[:, b[k]: b[k + 1]], self.g_ids[k]) for k in range(len(self.g_ids))])
        return _copy(self.seen[key])


class _MulticlassScorer:
    def __init__(self, levels: _Levels, target: np.ndarray, num_classes: int) -> None:
        self.levels, self.target, self.k = levels, target, int(num_classes)
        self.seen: dict[bytes, MulticlassState] = {}

    def state(self, t: float) -> MulticlassState:
        lab = self.levels.labels(t)
        merge = self.levels.merge(lab)
        key = None if merge is None else merge.tobytes()
        if key is None or key not in self.seen:
            st = hungarian_state(lab.astype(np.int64) - int(lab.min()), self.target, self.k)
            if key is None:
                return st
            self.seen[key] = st
        return _copy(self.seen[key])


def score_image(h: HierarchyLike, target: np.ndarray, thresholds: Sequence[float] | np.ndarray = TREE_THRESHOLDS,
                task: str = "regions", num_classes: int = 0, exact: bool = True) -> ImageScores:
    """One image's states of a hierarchy at every threshold.

    Args:
        h: the image's hierarchy; ``labels_at(t)`` must be of the ground truth's size.
        target: ``task="regions"``: ``(K, H, W)`` human segmentations (ids from 1, 0 =
            unlabelled); ``"multiclass"``: ``(H, W)`` classes in ``[0, num_classes)``, others
            ignored.
        thresholds: the thresholds to score (:data:`TREE_THRESHOLDS` for the project's
            hierarchies, :data:`BENCH_THRESHOLDS` for a ``ucm2``).
        task: ``"regions"`` or ``"multiclass"``.
        num_classes: the classes of a multi-class set.
        exact: regions only: also the best partitions over every distinct partition of the
            hierarchy (:func:`exact_thresholds` of ``h.heights``; :attr:`ImageScores.exact`).

    Every state equals the existing metric of ``labels_at(t)`` computed directly
    (:func:`~segment.eval.metrics.region_state`, :func:`~segment.eval.metrics.hungarian_state`);
    levels that nest in the finest one are scored from its contingency tables, once per
    distinct partition.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    ts = _check_thresholds(thresholds)
    target = np.asarray(target)
    if task == "regions":
        gts = target[None] if target.ndim == 2 else target
        if gts.ndim != 3 or gts.shape[0] < 1:
            raise ValueError(f"regions: expected (K, H, W) human segmentations, got shape {target.shape}")
        shape = tuple(gts.shape[1:])
    else:
        if target.ndim != 2:
            raise ValueError(f"multiclass: expected an (H, W) class map, got shape {target.shape}")
        shape = tuple(target.shape)
    ex = exact_thresholds(h.heights) if exact and task == "regions" else np.zeros(0)
    levels = _Levels(h, shape, np.concatenate([ts, ex]))  # type: ignore[arg-type]
    if task == "regions":
        scorer: _RegionScorer | _MulticlassScorer = _RegionScorer(levels, gts)
    else:
        scorer = _MulticlassScorer(levels, target, num_classes)
    states = [scorer.state(float(t)) for t in ts]
    best = None
    if ex.size:
        ex_states = [scorer.state(float(t)) for t in ex]
        cov = [s.covering_num / s.covering_den if s.covering_den else 0.0 for s in ex_states]  # type: ignore[union-attr]
        top = ex_states[int(np.argmax(cov))]
        best = ExactBest(covering_num=top.covering_num, covering_den=top.covering_den,  # type: ignore[union-attr]
                         regions=int(top.region_counts[0]), pri=max(s.pri_sum for s in ex_states),  # type: ignore[union-attr]
                         vi=min(s.vi_sum for s in ex_states), partitions=int(ex.size))  # type: ignore[union-attr]
    return ImageScores(task=task, thresholds=ts, states=states, exact=best)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# the set: ODS, OIS, intervals, curves
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _RegionArrays:
    """Per image (rows) and threshold (columns) sums of a region set."""

    thresholds: np.ndarray  # (T,)
    num: np.ndarray  # (n, T) covering numerators
    den: np.ndarray  # (n, T) covering denominators
    pri: np.ndarray  # (n, T)
    vi: np.ndarray  # (n, T)
    regions: np.ndarray  # (n, T) region counts


def _same_thresholds(images: Sequence[ImageScores], task: str) -> np.ndarray:
    if not images:
        raise ValueError("no images to score")
    t0 = images[0].thresholds
    for im in images:
        if im.task != task:
            raise ValueError(f"images of different tasks: {im.task} and {task}")
        if not np.array_equal(im.thresholds, t0):
            raise ValueError("every image must be scored at the same thresholds")
    return t0


def _region_arrays(images: Sequence[ImageScores]) -> _RegionArrays:
    t = _same_thresholds(images, "regions")
    get = lambda f: np.array([[f(s) for s in im.states] for im in images], dtype=np.float64)  # noqa: E731
    return _RegionArrays(t, get(lambda s: s.covering_num), get(lambda s: s.covering_den), get(lambda s: s.pri_sum),
                         get(lambda s: s.vi_sum), get(lambda s: s.region_counts[0]))


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)


def _pick(curve: np.ndarray, lower: bool) -> np.ndarray:
    """Index of the best threshold along the last axis (the first of equals, as the
    official bench's ``max``/``min``)."""
    return np.argmin(curve, axis=-1) if lower else np.argmax(curve, axis=-1)


def _percentiles(x: np.ndarray, level: float = 0.95) -> list[float]:
    return list(percentile_interval(x, level))


def _t_range(picked: np.ndarray) -> list[float]:
    """The 95% range of the thresholds the draws picked (percentiles, rounded to 1e-9 so
    that a grid's 0.15 does not print as 0.15000000000000002)."""
    return [round(v, 9) for v in _percentiles(picked)]


def _region_rows(label: str, images: Sequence[ImageScores], default: float | None, reps: int,
                 seed: int) -> tuple[list[dict], list[dict]]:
    a = _region_arrays(images)
    n, ts = a.num.shape[0], a.thresholds
    curves = {"Covering": _ratio(a.num.sum(0), a.den.sum(0)), "PRI": a.pri.mean(0), "VI": a.vi.mean(0)}
    counts = resample_counts(n, reps, seed) if reps and n > 1 else None
    draws = None
    if counts is not None:
        draws = {"Covering": _ratio(counts @ a.num, counts @ a.den), "PRI": counts @ a.pri / n,
                 "VI": counts @ a.vi / n}  # (reps, T)
    lower = {"Covering": False, "PRI": False, "VI": True}
    rows = []

    def row(level: str, values: dict, at: dict | None, ci: dict | None, t_ci: dict | None, regions: np.ndarray) -> None:
        r: dict[str, Any] = {"method": label, "level": level}
        for m in ("Covering", "PRI", "VI"):
            r[m] = float(values[m])
            r[f"{m}_t"] = None if at is None else float(at[m])
        r["regions_median"] = median_count(regions)
        r["regions"] = float(np.mean(regions))
        r["images"] = n
        if ci is not None:
            r["ci95"] = ci
        if t_ci is not None:
            r["t_ci95"] = t_ci
        rows.append(r)

    if default is not None:
        j = np.flatnonzero(ts == float(default))
        if j.size == 0:
            raise ValueError(f"the default level {default} is not among the thresholds scored")
        j0 = int(j[0])
        ci = None if draws is None else {m: _percentiles(draws[m][:, j0]) for m in lower}
        row("default", {m: curves[m][j0] for m in lower}, {m: ts[j0] for m in lower}, ci, None, a.regions[:, j0])
    best = {m: int(_pick(curves[m], lower[m])) for m in lower}
    ci = t_ci = None
    if draws is not None:
        ci = {m: _percentiles(draws[m].min(1) if lower[m] else draws[m].max(1)) for m in lower}
        t_ci = {m: _t_range(ts[_pick(draws[m], lower[m])]) for m in lower}
    row("ODS", {m: curves[m][best[m]] for m in lower}, {m: ts[best[m]] for m in lower}, ci, t_ci,
        a.regions[:, best["Covering"]])
    # OIS: each image at its own best threshold
    cov_img = _ratio(a.num, a.den)
    jc = _pick(cov_img, False)
    idx = np.arange(n)
    b_num, b_den = a.num[idx, jc], a.den[idx, jc]
    b_pri, b_vi = a.pri.max(1), a.vi.min(1)

    def ois(num, den, pri, vi):
        vals = {"Covering": float(_ratio(num.sum(), den.sum())), "PRI": float(pri.mean()), "VI": float(vi.mean())}
        ci = None
        if counts is not None:
            ci = {"Covering": _percentiles(_ratio(counts @ num, counts @ den)), "PRI": _percentiles(counts @ pri / n),
                  "VI": _percentiles(counts @ vi / n)}
        return vals, ci

    vals, ci = ois(b_num, b_den, b_pri, b_vi)
    row("OIS", vals, None, ci, None, a.regions[idx, jc])
    exact = [im.exact for im in images]
    if all(e is not None for e in exact):
        e_num = np.array([e.covering_num for e in exact])  # type: ignore[union-attr]
        e_den = np.array([e.covering_den for e in exact], dtype=np.float64)  # type: ignore[union-attr]
        vals, ci = ois(e_num, e_den, np.array([e.pri for e in exact]), np.array([e.vi for e in exact]))  # type: ignore[union-attr]
        row("OIS exact", vals, None, ci, None, np.array([e.regions for e in exact]))  # type: ignore[union-attr]
        rows[-1]["partitions_median"] = median_count([e.partitions for e in exact])  # type: ignore[union-attr]
    curve_rows = [{"method": label, "threshold": float(t), "Covering": float(curves["Covering"][j]),
                   "PRI": float(curves["PRI"][j]), "VI": float(curves["VI"][j]),
                   "regions_median": median_count(a.regions[:, j]), "regions": float(a.regions[:, j].mean())}
                  for j, t in enumerate(ts)]
    return rows, curve_rows


def miou_of_sums(tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> np.ndarray:
    """``(...)`` mIoU of summed per-class counts ``(..., K)``, as
    :meth:`segment.eval.metrics.MulticlassState.scores` computes it (the mean IoU of the
    classes with ``TP + FP + FN > 0``; 0 where there is none)."""
    den = tp + fp + fn
    seen = den > 0
    iou = np.where(seen, tp / np.where(seen, den, 1), 0.0)
    k = seen.sum(-1)
    return np.where(k > 0, iou.sum(-1) / np.maximum(k, 1), 0.0)


def _multiclass_rows(label: str, images: Sequence[ImageScores], default: float | None, reps: int,
                     seed: int) -> tuple[list[dict], list[dict]]:
    ts = _same_thresholds(images, "multiclass")
    n = len(images)
    tp = np.array([[s.tp for s in im.states] for im in images], dtype=np.float64)  # (n, T, K)
    fp = np.array([[s.fp for s in im.states] for im in images], dtype=np.float64)
    fn = np.array([[s.fn for s in im.states] for im in images], dtype=np.float64)
    regions = np.array([[s.regions for s in im.states] for im in images], dtype=np.float64)  # (n, T)
    sums = [total([im.states[j] for im in images], MulticlassState.zero(tp.shape[-1])).scores()
            for j in range(len(ts))]  # type: ignore[misc]
    miou = np.array([s.mIoU for s in sums])
    draws = None
    if reps and n > 1:
        c = resample_counts(n, reps, seed)
        draws = miou_of_sums(*(np.einsum("rn,ntk->rtk", c, x) for x in (tp, fp, fn)))  # (reps, T)
    rows = []

    def row(level: str, j: int, ci: list[float] | None, t_ci: list[float] | None) -> None:
        r: dict[str, Any] = {"method": label, "level": level, "mIoU": 100.0 * float(miou[j]), "mIoU_t": float(ts[j]),
                             "pixAcc": 100.0 * sums[j].ACC, "regions_median": median_count(regions[:, j]),
                             "regions": float(regions[:, j].mean()), "images": n}
        if ci is not None:
            r["ci95"] = {"mIoU": [100.0 * v for v in ci]}
        if t_ci is not None:
            r["t_ci95"] = {"mIoU": t_ci}
        rows.append(r)

    if default is not None:
        hit = np.flatnonzero(ts == float(default))
        if hit.size == 0:
            raise ValueError(f"the default level {default} is not among the thresholds scored")
        j = int(hit[0])
        row("default", j, None if draws is None else _percentiles(draws[:, j]), None)
    j = int(np.argmax(miou))
    row("ODS", j, None if draws is None else _percentiles(draws.max(1)),
        None if draws is None else _t_range(ts[np.argmax(draws, axis=1)]))
    curve_rows = [{"method": label, "threshold": float(t), "mIoU": 100.0 * float(miou[j]),
                   "pixAcc": 100.0 * sums[j].ACC, "regions_median": median_count(regions[:, j]),
                   "regions": float(regions[:, j].mean())} for j, t in enumerate(ts)]
    return rows, curve_rows


_SCORES = {"regions": ("Covering", "PRI", "VI"), "multiclass": ("mIoU",)}
_FMT = {"regions": ".4f", "multiclass": ".2f"}


@dataclass
class HierarchyResults:
    """The hierarchy table and curves of one or more methods on one set.

    Attributes:
        task: ``"regions"`` (BSDS500: Covering and PRI as fractions, VI in bits) or
            ``"multiclass"`` (mIoU and pixAcc in percent).
        rows: per method and level (``default``, ``ODS``, ``OIS``, ``OIS exact``): each
            score, ``SCORE_t`` its threshold (ODS and default; ``None`` for OIS, where each
            image has its own), ``ci95`` (score -> 95% bootstrap interval; for ODS each draw
            picks its threshold again), ``t_ci95`` (ODS: the 95% range of the thresholds the
            draws picked), ``regions_median`` / ``regions`` (median / mean regions per image
            at the Covering's (regions) or mIoU's (multi-class) level), ``images``;
            ``multiclass`` rows also ``pixAcc`` at the mIoU's threshold; ``OIS exact`` rows
            ``partitions_median`` (distinct partitions per image).
        curves: per method and threshold the set's scores (``curves.csv``).
        thresholds: the thresholds scored.
    """

    task: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    curves: list[dict[str, Any]] = field(default_factory=list)
    thresholds: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def row(self, method: str, level: str) -> dict[str, Any]:
        for r in self.rows:
            if r["method"] == method and r["level"] == level:
                return r
        raise KeyError(f"no row {level} of {method}")

    def markdown(self) -> str:
        scores, fmt = _SCORES[self.task], _FMT[self.task]
        extra = ("pixAcc",) if self.task == "multiclass" else ()
        cols = ("method", "level", *scores, *extra, "regions (median)", "images")
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in self.rows:
            cells = [r["method"], r["level"]]
            for s in scores:
                txt = f"{r[s]:{fmt}}"
                if r.get(f"{s}_t") is not None:
                    txt += f" (t {r[f'{s}_t']:.3g})"
                if "ci95" in r:
                    lo, hi = r["ci95"][s]
                    txt += f" [{lo:{fmt}}, {hi:{fmt}}]"
                cells.append(txt)
            cells += [f"{r[e]:.2f}" for e in extra]
            cells += [f"{r['regions_median']:.1f}", str(r["images"])]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"

    def csv(self) -> str:
        scores = _SCORES[self.task]
        extra = ("pixAcc",) if self.task == "multiclass" else ()
        head = ["method", "level"]
        for s in scores:
            head += [s, f"{s}_t", f"{s}_ci95_low", f"{s}_ci95_high", f"{s}_t_ci95_low", f"{s}_t_ci95_high"]
        head += [*extra, "regions_median", "regions", "images"]
        buf = io.StringIO()
        wr = csv.writer(buf, lineterminator="\n")
        wr.writerow(head)
        for r in self.rows:
            vals: list[Any] = [r["method"], r["level"]]
            for s in scores:
                ci = (r.get("ci95") or {}).get(s, ["", ""])
                tci = (r.get("t_ci95") or {}).get(s, ["", ""])
                vals += [r[s], "" if r.get(f"{s}_t") is None else r[f"{s}_t"], *ci, *tci]
            vals += [*(r[e] for e in extra), r["regions_median"], r["regions"], r["images"]]
            wr.writerow(vals)
        return buf.getvalue()

    def curves_csv(self) -> str:
        if not self.curves:
            return ""
        buf = io.StringIO()
        wr = csv.DictWriter(buf, fieldnames=list(self.curves[0]), lineterminator="\n")
        wr.writeheader()
        wr.writerows(self.curves)
        return buf.getvalue()

    def plot(self, path: Path, title: str = "") -> None:
        """``curves.png``: each metric (and the median region count) against the threshold,
        one line per method, its ODS marked."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        metrics = (*_SCORES[self.task], "regions_median")
        methods = list(dict.fromkeys(c["method"] for c in self.curves))
        fig, axes = plt.subplots(1, len(metrics), figsize=(4.0 * len(metrics), 3.4), squeeze=False)
        colours = plt.get_cmap("tab10")
        for i, m in enumerate(metrics):
            ax = axes[0, i]
            for k, meth in enumerate(methods):
                pts = [c for c in self.curves if c["method"] == meth]
                ax.plot([c["threshold"] for c in pts], [c[m] for c in pts], color=colours(k % 10), lw=1.5, label=meth)
                if m in _SCORES[self.task]:
                    ods = [r for r in self.rows if r["method"] == meth and r["level"] == "ODS"]
                    if ods:
                        ax.plot([ods[0][f"{m}_t"]], [ods[0][m]], "o", color=colours(k % 10), ms=5)
            ax.set_xlabel("threshold t")
            ax.set_title(m + (" (lower is better)" if m == "VI" else ""), fontsize=9)
            if m == "regions_median":
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
        axes[0, 0].legend(fontsize=7)
        if title:
            fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        write_figure(path, fig, dpi=100)

    def write(self, out: Path, title: str = "") -> None:
        """``hierarchy.{json,csv,md}``, ``curves.csv`` and ``curves.png`` in ``out``."""
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / "hierarchy.json", {"task": self.task, "thresholds": self.thresholds.tolist(),
                                                   "rows": self.rows})
        atomic_write_text(out / "hierarchy.csv", self.csv())
        atomic_write_text(out / "hierarchy.md", self.markdown())
        atomic_write_text(out / "curves.csv", self.curves_csv())
        self.plot(out / "curves.png", title)


def hierarchy_table(per_method: Mapping[str, Sequence[ImageScores]],
                    default: float | Mapping[str, float | None] | None = None,
                    reps: int = 1000, seed: int = 0) -> HierarchyResults:
    """The ODS / OIS table and curves of every method's per-image scores.

    Args:
        per_method: method label -> its :class:`ImageScores`, one per image (the same
            thresholds for every image; the same images for every method, so the
            resamples are paired).
        default: a threshold (among those scored) to report as the ``default`` level, or
            one per method (by label; ``None``: no ``default`` row for that method).
        reps: bootstrap resamples (0: no intervals; none either for a single image).
        seed: seed of the resamples (:func:`segment.eval.metrics.resample_counts`).

    Regions sets get ``default``, ``ODS``, ``OIS`` and (when scored) ``OIS exact`` rows;
    multi-class sets ``default`` and ``ODS`` (mIoU).
    """
    if not per_method:
        raise ValueError("no method to tabulate")
    sizes = {len(v) for v in per_method.values()}
    if len(sizes) != 1:
        raise ValueError(f"every method needs the same images, got counts {sorted(sizes)}")
    first = next(iter(per_method.values()))
    task = first[0].task if first else "regions"
    res = HierarchyResults(task=task, thresholds=_same_thresholds(first, task))
    for label, images in per_method.items():
        fn = _region_rows if task == "regions" else _multiclass_rows
        own = default.get(label) if isinstance(default, Mapping) else default
        rows, curves = fn(label, images, own, int(reps), int(seed))
        res.rows += rows
        res.curves += curves
    return res


def score_hierarchies(hierarchies: Iterable[HierarchyLike], ground_truth: Iterable[np.ndarray],
                      thresholds: Sequence[float] | np.ndarray = TREE_THRESHOLDS, *, task: str = "regions",
                      num_classes: int = 0, label: str = "hierarchy", default: float | None = None,
                      exact: bool = True, reps: int = 1000, seed: int = 0) -> HierarchyResults:
    """Score one method's per-image hierarchies: :func:`score_image` on every image, then
    :func:`hierarchy_table` (see both for the arguments)."""
    images = [score_image(h, gt, thresholds, task, num_classes, exact) for h, gt in zip(hierarchies, ground_truth,
                                                                                         strict=True)]
    return hierarchy_table({label: images}, default=default, reps=reps, seed=seed)


def states_at(images: Sequence[ImageScores], t: float) -> list[RegionState] | list[MulticlassState]:
    """The per-image states at one threshold: a flat level, for
    :func:`segment.eval.tables.results_table` (paired intervals against other methods)."""
    return [im.state_at(t) for im in images]  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------
# python -m segment.eval.hierarchy ucm2 ROOT
# ---------------------------------------------------------------------------------------


def score_ucm2_folder(root: Path, split: str = "val", ucm_dir: str = "ucm2", limit: int | None = None,
                      exact: bool = False, reps: int = 1000, seed: int = 0, label: str = "gPb-owt-ucm",
                      progress: bool = False) -> HierarchyResults:
    """The bench's ODS / OIS table of the ``ucm2`` maps ``root/ucm_dir/split/*.mat`` against
    ``root/groundTruth/split/*.mat`` at :data:`BENCH_THRESHOLDS`."""
    from segment.datasets.bsds import read_segmentations

    folder = root / ucm_dir / split
    files = sorted(folder.glob("*.mat"), key=lambda p: p.stem)
    if not files:
        raise FileNotFoundError(f"{folder}: no ucm2 files (*.mat)")
    if limit is not None:
        files = files[: int(limit)]
    images = []
    t0 = time.perf_counter()
    for i, f in enumerate(files):
        gt_path = root / "groundTruth" / split / f.name
        gts = read_segmentations(gt_path)
        ucm = read_ucm2(f)
        if ucm.shape != gts.shape[1:]:
            raise ValueError(f"{f}: a ucm2 of an image of {ucm.shape[1]}x{ucm.shape[0]} pixels, the ground truth"
                             f" {gt_path} is {gts.shape[2]}x{gts.shape[1]}")
        images.append(score_image(ucm, gts, BENCH_THRESHOLDS, "regions", exact=exact))
        if progress:
            print(f"\r{i + 1}/{len(files)} ({time.perf_counter() - t0:.0f} s)", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return hierarchy_table({label: images}, reps=reps, seed=seed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m segment.eval.hierarchy",
                                description="Score hierarchies as the BSDS500 bench does: ODS and OIS.")
    sub = p.add_subparsers(dest="command", required=True)
    u = sub.add_parser("ucm2", help="BSDS ucm2 maps (ROOT/ucm2/SPLIT/*.mat) against ROOT/groundTruth/SPLIT")
    u.add_argument("root", type=Path, help="the folder holding ucm2/ and groundTruth/ (e.g. bsds-dev)")
    u.add_argument("--split", default="val")
    u.add_argument("--ucm-dir", default="ucm2", help="the ucm2 folder under ROOT (default ucm2)")
    u.add_argument("--label", default="gPb-owt-ucm", help="the method's name in the table")
    u.add_argument("--limit", type=int, default=None, help="only the first N images")
    u.add_argument("--exact", action="store_true",
                   help="also the OIS over every distinct partition of each map (about 1000 per gPb map: slow)")
    u.add_argument("--reps", type=int, default=1000, help="bootstrap resamples (0: none)")
    u.add_argument("--seed", type=int, default=0)
    u.add_argument("--out", type=Path, default=None,
                   help="write hierarchy.{json,csv,md}, curves.csv and curves.png here")
    args = p.parse_args(argv)
    try:
        res = score_ucm2_folder(args.root, args.split, args.ucm_dir, args.limit, args.exact, args.reps, args.seed,
                                args.label, progress=sys.stderr.isatty())
    except (ValueError, FileNotFoundError) as e:
        print(f"segment.eval.hierarchy: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.out is not None:
        res.write(args.out, title=f"{args.label}, {args.root.name} {args.split}")
    print(res.markdown(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
