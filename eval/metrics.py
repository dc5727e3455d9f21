"""Benchmark metrics, accumulated the published way (protocol §3 and §4).

Every metric is an additive *state* (a dataclass of sums) so that images, batches and
distributed shards merge with ``+``; the scores are computed from the summed state only.

Binary (ImageNet-segmentation protocol, Chefer et al.'s evaluation code):

- ``pixAcc = sum_i correct_i / sum_i labeled_i`` (sums over the set, not per-image means);
- ``mIoU = 1/2 * sum_{c in {bg, fg}} sum_i |P_c & G_c| / sum_i |P_c | G_c|`` (the standard
  two-class mean IoU, intersections and unions summed over the set);
- ``mIoU_CA``: ConceptAttention's variant (its stacked-channel histogram), which equals
  ``pixAcc / (2 - pixAcc)`` exactly; reported next to the standard one;
- ``mAP = mean_i AP_i``, ``AP_i`` = scikit-learn ``average_precision_score`` of the pooled
  two-channel scores ``[1 - R, R]`` against targets ``[1 - G, G]`` (``2 H W`` samples),
  NaN -> 0.

Peer metrics of binary sets (the saliency literature's, so the table can stand next to
TokenCut's and FOUND's; see the "peer metrics" section below): per-image foreground IoU
(``fgIoU``) and pixel accuracy (``acc``) averaged over images, and the max F-measure
(``maxF``, ``beta^2 = 0.3``, 255 thresholds), scored at the ground truth's original
resolution where the data set provides it.

Multi-class (DiffSeg protocol): per image, Hungarian matching (scipy
``linear_sum_assignment``, maximising matched pixels) between predicted segments and the
ground-truth classes; TP / FP / FN summed over the set (pixels of unmatched segments count
as FN of their true class only); ``ACC = sum TP / sum labeled`` (``pixAcc`` in the tables),
``mIoU = nanmean_c TP_c / (TP_c + FP_c + FN_c)``, the per-class IoU, and the mean number of
predicted segments per image (one-to-one matching penalises too few and too many), their
median, and the share of pixels in regions under 1% of the image (:func:`region_sizes`).

Regions against several human segmentations (BSDS500, protocol §4b), exactly as the official
``bench/benchmarks/regionBench.m`` (``evaluation_reg_image.m``, ``match_segmentations*.m``,
``compare_segmentations.m``) computes them, from one contingency table per annotator
(:func:`region_state`):

- **Covering** of the human segmentations by the prediction: for every region ``R`` of every
  annotator, its best IoU with a predicted region, weighted by ``|R|``; summed over all regions
  of all annotators of all images and divided by the summed areas (pooled, not a mean of
  per-image values);
- **PRI**: the Rand index of (prediction, annotator ``k``) from the table (Rand's eq. 2.2, as
  ``compare_segmentations.m``), averaged over ``k``, then over the images;
- **VI**: ``H(S) + H(G_k) - 2 I(S, G_k)`` in bits, averaged the same way (lower is better).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor


def _np(x: Tensor | np.ndarray) -> np.ndarray:
    if isinstance(x, Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


# ---------------------------------------------------------------------------- binary


@dataclass(frozen=True)
class BinaryScores:
    """Scores of a binary benchmark, as fractions in ``[0, 1]``.

    Attributes:
        pixAcc: pixel accuracy, summed over the set.
        mIoU: standard two-class mean IoU (intersections and unions summed over the set).
        mIoU_CA: ConceptAttention's mIoU variant, ``pixAcc / (2 - pixAcc)``.
        mAP: mean over images of the pooled two-channel average precision.
        images: number of images scored.
        fgIoU: peer metric: per-image foreground IoU, averaged over the images.
        acc: peer metric: per-image pixel accuracy, averaged over the images.
        maxF: peer metric: max over 255 thresholds of F_beta (beta^2 = 0.3) of the
            image-mean precision and recall (the saliency toolboxes' max F-measure).
        maxF_img: peer metric: max over the thresholds of the image-mean F_beta (TokenCut's
            ``F_max``). See the "peer metrics" section of this module.
    """

    pixAcc: float
    mIoU: float
    mIoU_CA: float
    mAP: float
    images: int
    fgIoU: float = 0.0
    acc: float = 0.0
    maxF: float = 0.0
    maxF_img: float = 0.0

    def percent(self) -> dict[str, float | int]:
        """The scores in percent (``images`` stays a count)."""
        return {
            "pixAcc": 100.0 * self.pixAcc,
            "mIoU": 100.0 * self.mIoU,
            "mIoU_CA": 100.0 * self.mIoU_CA,
            "mAP": 100.0 * self.mAP,
            "images": self.images,
            "fgIoU": 100.0 * self.fgIoU,
            "acc": 100.0 * self.acc,
            "maxF": 100.0 * self.maxF,
            "maxF_img": 100.0 * self.maxF_img,
        }


@dataclass
class BinaryState:
    """Additive sums of the binary metrics over a set of images.

    Attributes:
        correct: pixels whose prediction equals the ground truth.
        labeled: pixels with a ground truth (all pixels for binary masks).
        inter: ``[bg, fg]`` intersections ``|P_c & G_c|``.
        union: ``[bg, fg]`` unions ``|P_c | G_c|``.
        ap_sum: sum of the per-image average precisions.
        images: number of images.
        iou_sum: sum of the per-image foreground IoUs (peer metrics).
        acc_sum: sum of the per-image pixel accuracies (peer metrics).
        prec_sum: ``(255,)`` sum of the per-image precision curves (peer metrics).
        rec_sum: ``(255,)`` sum of the per-image recall curves.
        f_sum: ``(255,)`` sum of the per-image F_beta curves.
    """

    correct: int = 0
    labeled: int = 0
    inter: list[int] = field(default_factory=lambda: [0, 0])
    union: list[int] = field(default_factory=lambda: [0, 0])
    ap_sum: float = 0.0
    images: int = 0
    iou_sum: float = 0.0
    acc_sum: float = 0.0
    prec_sum: list[float] = field(default_factory=lambda: [0.0] * PEER_BINS)
    rec_sum: list[float] = field(default_factory=lambda: [0.0] * PEER_BINS)
    f_sum: list[float] = field(default_factory=lambda: [0.0] * PEER_BINS)

    def __add__(self, other: BinaryState) -> BinaryState:
        if not isinstance(other, BinaryState):
            return NotImplemented
        return BinaryState(
            correct=self.correct + other.correct,
            labeled=self.labeled + other.labeled,
            inter=[a + b for a, b in zip(self.inter, other.inter)],
            union=[a + b for a, b in zip(self.union, other.union)],
            ap_sum=self.ap_sum + other.ap_sum,
            images=self.images + other.images,
            iou_sum=self.iou_sum + other.iou_sum,
            acc_sum=self.acc_sum + other.acc_sum,
            prec_sum=(np.asarray(self.prec_sum) + np.asarray(other.prec_sum)).tolist(),
            rec_sum=(np.asarray(self.rec_sum) + np.asarray(other.rec_sum)).tolist(),
            f_sum=(np.asarray(self.f_sum) + np.asarray(other.f_sum)).tolist(),
        )

    def scores(self) -> BinaryScores:
        """The set's scores from the sums (a class with an empty union scores IoU 0, as the
        reference code's ``inter / (eps + union)`` does)."""
        acc = self.correct / self.labeled if self.labeled else 0.0
        ious = [i / u if u else 0.0 for i, u in zip(self.inter, self.union)]
        n = self.images
        return BinaryScores(
            pixAcc=acc,
            mIoU=float(np.mean(ious)),
            mIoU_CA=miou_ca(acc),
            mAP=self.ap_sum / n if n else 0.0,
            images=n,
            fgIoU=self.iou_sum / n if n else 0.0,
            acc=self.acc_sum / n if n else 0.0,
            maxF=max_f_of_means(self.prec_sum, self.rec_sum, n),
            maxF_img=max_mean_f(self.f_sum, n),
        )

    def to_dict(self) -> dict:
        return {
            "kind": "binary", "correct": self.correct, "labeled": self.labeled,
            "inter": list(self.inter), "union": list(self.union), "ap_sum": self.ap_sum,
            "images": self.images,
            "peer": {"iou_sum": self.iou_sum, "acc_sum": self.acc_sum,
                     "prec_sum": list(self.prec_sum), "rec_sum": list(self.rec_sum),
                     "f_sum": list(self.f_sum)},
        }

    @classmethod
    def from_dict(cls, d: dict) -> BinaryState:
        if d.get("kind") != "binary":
            raise ValueError(f"not a binary metric state: {d!r}")
        peer = d.get("peer")
        if not isinstance(peer, dict):
            raise ValueError("binary metric state without its peer metrics (an older cache format)")
        curves = {k: [float(x) for x in peer[k]] for k in ("prec_sum", "rec_sum", "f_sum")}
        if any(len(v) != PEER_BINS for v in curves.values()):
            raise ValueError(f"binary metric state: peer curves must have {PEER_BINS} thresholds")
        return cls(
            correct=int(d["correct"]), labeled=int(d["labeled"]),
            inter=[int(x) for x in d["inter"]], union=[int(x) for x in d["union"]],
            ap_sum=float(d["ap_sum"]), images=int(d["images"]),
            iou_sum=float(peer["iou_sum"]), acc_sum=float(peer["acc_sum"]), **curves,
        )


def miou_ca(pix_acc: float) -> float:
    """ConceptAttention's mIoU: ``acc / (2 - acc)``.

    Its IoU pools the two stacked one-hot channels: the intersection is the number of
    correct pixels and the union is ``2 * total - correct = total + wrong``, so the ratio is
    ``acc / (2 - acc)``.
    """
    return pix_acc / (2.0 - pix_acc)


def average_precision(scores: Tensor, targets: Tensor) -> Tensor:
    """scikit-learn's ``average_precision_score``, vectorised in torch, on the input's device.

    The step-wise definition ``AP = sum_n (R_n - R_{n-1}) P_n`` over the *distinct* score
    thresholds in decreasing order (no interpolation): samples with tied scores enter
    together, at the precision of the end of their tie group. One sort and one cumulative
    sum per row: each sample counts ``P`` at the last position of its tie group, found with
    a reversed running minimum of those positions.

    Args:
        scores: ``(..., M)`` scores (any float dtype; compared as given).
        targets: ``(..., M)`` bool (or 0/1) targets.

    Returns:
        ``(...)`` float64 AP per row; 0 where a row has no positive (scikit-learn also
        returns 0 then, with a warning).
    """
    if scores.shape != targets.shape or scores.dim() < 1:
        raise ValueError(f"scores and targets must have the same (..., M) shape; got "
                         f"{tuple(scores.shape)} and {tuple(targets.shape)}")
    batch, m = scores.shape[:-1], scores.shape[-1]
    s = scores.reshape(-1, m)
    t = targets.reshape(-1, m).to(torch.bool)
    if m == 0:
        return torch.zeros(batch, dtype=torch.float64, device=scores.device)
    s_sorted, order = torch.sort(s, dim=-1, descending=True)
    y = torch.gather(t, 1, order).to(torch.float64)
    tps = torch.cumsum(y, dim=-1)  # exact integers in float64 up to 2**53 samples
    pos = torch.arange(1, m + 1, dtype=torch.float64, device=s.device)
    last = torch.ones_like(t)  # last index of each tie group (distinct threshold)
    last[:, :-1] = s_sorted[:, :-1] != s_sorted[:, 1:]
    idx = torch.arange(m, device=s.device).expand_as(s)
    end = torch.where(last, idx, torch.full_like(idx, m - 1))
    end = torch.flip(torch.cummin(torch.flip(end, (1,)), dim=1).values, (1,))
    prec = tps / pos  # precision at every position; read at the end of each tie group
    num = (y * torch.gather(prec, 1, end)).sum(-1)
    npos = tps[:, -1]
    ap = torch.where(npos > 0, num / npos.clamp_min(1.0), torch.zeros_like(num))
    return ap.reshape(batch)


def _pooled_keys(r: Tensor, g: Tensor) -> np.ndarray:
    """The ``2 M`` pooled samples of each row as ascending int32 keys ``bits(score) << 1 | y``.

    Scores in ``[0, 1]`` are non-negative floats, whose IEEE bit patterns order like their
    values, so one values-only sort of packed integer keys orders the scores and carries the
    targets along (numpy: ~5x faster than ``torch.sort`` with its indices). The channel
    ``1 - R`` needs no sort of its own: ``fl(1 - r)`` is non-increasing in ``r``, so it is
    the reversed first run; the two runs are merged (timsort: linear).

    Args:
        r: ``(B, M)`` float32 CPU scores in ``[0, 1]`` (no negative zero).
        g: ``(B, M)`` bool targets of the ``R`` channel (``1 - R`` gets ``~g``).
    """
    kr = (r.view(torch.int32) << 1) | g.to(torch.int32)
    kr_np = np.sort(kr.numpy(), axis=-1)
    r_asc = torch.from_numpy(kr_np >> 1).view(torch.float32)
    ku = ((1.0 - r_asc).view(torch.int32) << 1) | (1 - torch.from_numpy(kr_np & 1))
    both = np.concatenate([kr_np, ku.numpy()[:, ::-1]], axis=1)
    return np.sort(both, axis=-1, kind="stable")


def _ap_of_sorted_keys(keys: np.ndarray) -> np.ndarray:
    """AP of pooled rows of ascending keys ``bits(score) << 1 | y`` (see
    :func:`_pooled_keys`; exactly ``n / 2`` positives per row), touching the full arrays
    only a few times.

    In ascending order a tie group starting at index ``s`` is, in decreasing order, the end
    of a threshold: ``n - s`` samples score ``>= v`` and ``P - C[s]`` of them are positive
    (``C`` the exclusive cumulative count of positives), so
    ``AP = 1/P sum_j y_j (P - C[s_j]) / (n - s_j)`` (scikit-learn's step-wise AP).
    Without ties, the ``r``-th positive (ascending index ``i_r``) has ``C = r`` positives
    before it, so its term is ``(P - r) / (n - i_r)``. Samples tied with their predecessor
    (found sparsely) are corrected to the term of their tie group's start.
    """
    b, n = keys.shape
    p = n // 2
    y = (keys & 1).astype(bool).ravel()
    pos = np.flatnonzero(y)  # global indices (row * n + i) of the positives, ascending
    if pos.size != b * p:
        raise ValueError("pooled keys must hold exactly n / 2 positives per row")
    row_off = (np.arange(b) * n)[:, None]
    i = pos.reshape(b, p) - row_off
    r = np.arange(p)
    total = ((p - r) / (n - i)).sum(1)
    v = (keys >> 1).ravel()
    eq = v[1:] == v[:-1]
    eq[n - 1:: n] = False  # no tie across rows
    tied = np.flatnonzero(eq) + 1  # global positions tied with their predecessor
    if tied.size:
        brk = np.ones(tied.size, bool)
        brk[1:] = tied[1:] != tied[:-1] + 1
        start = (tied[brk] - 1)[np.cumsum(brk) - 1]  # the group start of every tied sample
        q = y[tied]
        tq, sq = tied[q], start[q]
        row = tq // n
        rank = np.searchsorted(pos, tq) - row * p  # C at the sample itself (no ties)
        c_start = np.searchsorted(pos, sq) - row * p  # positives before the group start
        corr = (p - c_start) / (n - (sq - row * n)) - (p - rank) / (n - (tq - row * n))
        total += np.bincount(row, weights=corr, minlength=b)
    return total / p


def pooled_average_precisions(score: Tensor, gt: Tensor) -> Tensor:
    """Per-image AP of the pooled two-channel scores ``[1 - R, R]`` vs ``[1 - G, G]``.

    Args:
        score: ``(B, H, W)`` heatmaps ``R`` in ``[0, 1]`` (computed in float32, as the
            published evaluation feeds them to scikit-learn).
        gt: ``(B, H, W)`` bool ground truth ``G`` (same device).

    Returns:
        ``(B,)`` float64 AP over the ``2 H W`` samples of each image, NaN -> 0
        (scikit-learn's ``average_precision_score`` to rounding). On CPU, with scores in
        ``[0, 1]``: one numpy sort of packed keys (:func:`_pooled_keys`) and sparse tie
        corrections; on other devices, or for scores outside ``[0, 1]`` (or NaN), the
        general sort-based :func:`average_precision` on the pooled channels.
    """
    r = score.reshape(score.shape[0], -1).float() + 0.0  # + 0.0: no negative zero
    g = gt.reshape(gt.shape[0], -1).to(device=r.device, dtype=torch.bool)
    if r.device.type == "cpu" and r.numel() and bool(((r >= 0) & (r <= 1)).all()):
        ap = torch.from_numpy(_ap_of_sorted_keys(_pooled_keys(r.contiguous(), g)))
    else:
        ap = average_precision(torch.cat([1.0 - r, r], 1), torch.cat([~g, g], 1))
    return torch.nan_to_num(ap, nan=0.0)


def pooled_average_precision(score: Tensor | np.ndarray, gt: Tensor | np.ndarray) -> float:
    """AP of the pooled two-channel scores ``[1 - R, R]`` vs targets ``[1 - G, G]``.

    Args:
        score: ``(H, W)`` heatmap ``R`` in ``[0, 1]``.
        gt: ``(H, W)`` bool ground truth ``G``.

    Returns:
        scikit-learn's ``average_precision_score`` over the ``2 H W`` samples, NaN -> 0
        (computed by :func:`pooled_average_precisions`).
    """
    r = torch.as_tensor(_np(score).astype(np.float32, copy=False)).reshape(1, -1)
    g = torch.as_tensor(_np(gt).astype(bool)).reshape(1, -1)
    return float(pooled_average_precisions(r, g)[0])


def binary_states(score: Tensor, pred: Tensor, gt: Tensor, peer: PeerCurves | None = None) -> list[BinaryState]:
    """Per-image states of a batch.

    Args:
        score: ``(B, H, W)`` heatmaps ``R`` in ``[0, 1]`` (for AP).
        pred: ``(B, H, W)`` bool predicted foreground.
        gt: ``(B, H, W)`` bool ground truth.
        peer: the images' peer quantities (:func:`peer_curves`, ``B`` rows), computed where
            the caller chooses (``segment-eval``: at the ground truth's original resolution);
            ``None``: from ``score``, ``pred`` and ``gt`` themselves.

    Returns:
        One :class:`BinaryState` per image (AP computed on ``score``'s device).
    """
    if not (score.shape == pred.shape == gt.shape) or score.dim() != 3:
        raise ValueError(
            f"score, pred and gt must all be (B, H, W); got {tuple(score.shape)}, "
            f"{tuple(pred.shape)}, {tuple(gt.shape)}"
        )
    b = score.shape[0]
    if b == 0:
        return []
    if pred.device.type == "cpu":  # numpy: bool reductions are slow in torch on CPU
        p = _np(pred.bool()).reshape(b, -1)
        g = _np(gt.bool()).reshape(b, -1)
        inter_fg = np.count_nonzero(p & g, axis=1)
        union_fg = np.count_nonzero(p | g, axis=1)
    else:  # on the device: one small transfer of counts
        p, g = pred.bool().reshape(b, -1), gt.to(pred.device).bool().reshape(b, -1)
        counts = torch.stack([(p & g).sum(1), (p | g).sum(1)]).cpu().numpy()
        inter_fg, union_fg = counts[0], counts[1]
    n = score[0].numel()
    inter_bg = n - union_fg  # |~P & ~G| = |~(P | G)|
    union_bg = n - inter_fg  # |~P | ~G| = |~(P & G)|
    correct = inter_fg + inter_bg
    aps = pooled_average_precisions(score, gt.to(score.device)).cpu().tolist()
    if peer is None:
        peer = peer_curves(score, pred, gt)
    if peer.iou.shape[0] != b:
        raise ValueError(f"peer curves of {peer.iou.shape[0]} images for a batch of {b}")
    return [
        BinaryState(
            correct=int(correct[i]),
            labeled=int(n),
            inter=[int(inter_bg[i]), int(inter_fg[i])],
            union=[int(union_bg[i]), int(union_fg[i])],
            ap_sum=aps[i],
            images=1,
            iou_sum=float(peer.iou[i]),
            acc_sum=float(peer.acc[i]),
            prec_sum=peer.precision[i].tolist(),
            rec_sum=peer.recall[i].tolist(),
            f_sum=peer.f[i].tolist(),
        )
        for i in range(b)
    ]


# ---------------------------------------------------------------------------- peer metrics
#
# The saliency literature's numbers for binary sets, next to the protocol's (issue 39),
# per image, then averaged over images. ``segment-eval`` scores them at the ground truth's
# ORIGINAL resolution (folder sets keep the native mask, binarised at the set's threshold,
# 0.5 by default) with the method's mask and heatmap as ``segment`` writes them there
# (see ``segment.eval.runner.peer_maps``); these functions take whatever they are given.
#
# - fgIoU:    mean_i |P_i & G_i| / |P_i | G_i|   (1 where both are empty)
# - acc:      mean_i (pixels with P_i == G_i) / pixels_i
# - maxF:     max_k F_beta(mean_i prec_ik, mean_i rec_ik), beta^2 = 0.3: precision and recall
#             averaged over images at each of the 255 thresholds, F of those means, then the
#             maximum over thresholds (the PR-curve max F-measure of the saliency toolboxes);
# - maxF_img: max_k mean_i F_beta(prec_ik, rec_ik): every image's F curve averaged over the
#             images, then the maximum: TokenCut's ``F_max``
#             (github.com/YangtaoWANG95/TokenCut, unsupervised_saliency_detection/metric.py),
#             the definition behind its ECSSD anchors (maxF 80.3, 87.4 with the bilateral
#             solver). TokenCut thresholds its *binary* mask there, so all its thresholds give
#             the same mask and its maxF is the mean F_beta of that mask. FOUND's evaluation
#             (github.com/valeoai/FOUND, evaluation/metrics/f_measure.py, from SelfMask) also
#             averages per-image F curves but squares its ``beta_square = 0.3`` again
#             (``1 + beta_square**2``: beta^2 = 0.09 in effect), a quirk not reproduced here.
#
# Thresholds as in TokenCut: ``t_k = k / 255`` for ``k = 0 .. 254`` (``np.arange(0, 1, 1/255)``),
# foreground where ``R > t_k`` (strict, compared in float64). ``R`` is min-max normalised per
# image (``segment.core.masks.heatmap_at``), not quantised to 8 bits. Precision 0/0 (nothing
# predicted at ``t_k``) counts as 1 and recall 0/0 (an empty ground truth) as 1: TokenCut's
# ``precision_recall``. It can only happen at thresholds >= the map's maximum, so never for
# a min-max normalised map (maximum 1 > every ``t_k``) unless the map is constant; F 0/0
# (precision = recall = 0) counts as 0.

PEER_BINS = 255
BETA2 = 0.3


def peer_thresholds() -> np.ndarray:
    """``(255,)`` float64 thresholds ``k / 255``, ``k = 0 .. 254`` (TokenCut's)."""
    return np.arange(PEER_BINS, dtype=np.float64) / PEER_BINS


def f_beta(precision: np.ndarray, recall: np.ndarray, beta2: float = BETA2) -> np.ndarray:
    """``(1 + b2) P R / (b2 P + R)`` elementwise, 0 where ``P = R = 0``.

    Args:
        precision: ``(...)`` precisions in ``[0, 1]``.
        recall: ``(...)`` recalls, same shape.
        beta2: ``beta^2`` (0.3: precision weighs more, the saliency convention).
    """
    p = np.asarray(precision, dtype=np.float64)
    r = np.asarray(recall, dtype=np.float64)
    den = beta2 * p + r
    with np.errstate(invalid="ignore", divide="ignore"):
        f = (1.0 + beta2) * p * r / np.where(den > 0, den, 1.0)
    return np.where(den > 0, f, 0.0)


@dataclass(frozen=True)
class PeerCurves:
    """Per-image peer quantities of a batch (see the section comment for the definitions).

    Attributes:
        iou: ``(B,)`` foreground IoU of the mask.
        acc: ``(B,)`` pixel accuracy of the mask.
        precision: ``(B, 255)`` precision of ``R > t_k``.
        recall: ``(B, 255)`` recall of ``R > t_k``.
        f: ``(B, 255)`` F_beta (beta^2 = 0.3) of each image at each threshold.
    """

    iou: np.ndarray
    acc: np.ndarray
    precision: np.ndarray
    recall: np.ndarray
    f: np.ndarray

    @classmethod
    def stack(cls, parts: Sequence[PeerCurves]) -> PeerCurves:
        """The images of several :class:`PeerCurves` as one batch, in order (e.g. images of
        different sizes scored one by one)."""
        if not parts:
            raise ValueError("no peer curves to stack")
        return cls(**{k: np.concatenate([getattr(p, k) for p in parts])
                      for k in ("iou", "acc", "precision", "recall", "f")})

    def rows(self, index: Sequence[int]) -> PeerCurves:
        """The images ``index`` (in that order) as a batch."""
        idx = np.asarray(index, dtype=np.int64)
        return PeerCurves(iou=self.iou[idx], acc=self.acc[idx], precision=self.precision[idx],
                          recall=self.recall[idx], f=self.f[idx])


def peer_curves(score: Tensor, pred: Tensor, gt: Tensor) -> PeerCurves:
    """Per-image IoU, accuracy and precision / recall / F curves of a batch.

    The curves come from one histogram per image: a pixel with score ``r`` is foreground at
    the thresholds ``t_k < r``, i.e. at ``k < b(r)`` with ``b(r)`` the number of thresholds
    below ``r`` (``searchsorted``), so the predicted and true positives at ``t_k`` are suffix
    sums of the histograms of ``b`` over all pixels and over the ground truth's.

    Args:
        score: ``(B, H, W)`` heatmaps ``R`` (compared in float64; any range).
        pred: ``(B, H, W)`` bool masks.
        gt: ``(B, H, W)`` bool ground truth (at the resolution to score at).

    Returns:
        A :class:`PeerCurves` (float64 numpy).
    """
    if not (score.shape == pred.shape == gt.shape) or score.dim() != 3:
        raise ValueError(
            f"score, pred and gt must all be (B, H, W); got {tuple(score.shape)}, "
            f"{tuple(pred.shape)}, {tuple(gt.shape)}"
        )
    b = score.shape[0]
    r = _np(score).reshape(b, -1).astype(np.float64)
    p = _np(pred).reshape(b, -1).astype(bool)
    g = _np(gt).reshape(b, -1).astype(bool)
    n = r.shape[1]
    inter = np.count_nonzero(p & g, axis=1)
    union = np.count_nonzero(p | g, axis=1)
    iou = np.where(union > 0, inter / np.maximum(union, 1), 1.0)
    acc = (n - np.count_nonzero(p ^ g, axis=1)) / n if n else np.ones(b)
    bins = np.searchsorted(peer_thresholds(), r, side="left")  # thresholds t_k < r
    width = PEER_BINS + 1
    offs = (np.arange(b) * width)[:, None]
    hist_all = np.bincount((bins + offs).ravel(), minlength=b * width).reshape(b, width)
    hist_fg = np.bincount((bins + offs)[g], minlength=b * width).reshape(b, width)
    # positives at t_k: pixels with b(r) > k = suffix sums from k + 1
    pos = np.cumsum(hist_all[:, ::-1], axis=1)[:, ::-1][:, 1:].astype(np.float64)
    tp = np.cumsum(hist_fg[:, ::-1], axis=1)[:, ::-1][:, 1:].astype(np.float64)
    npos = g.sum(1).astype(np.float64)[:, None]
    precision = np.where(pos > 0, tp / np.maximum(pos, 1.0), 1.0)
    recall = np.where(npos > 0, tp / np.maximum(npos, 1.0), 1.0)
    recall = np.broadcast_to(recall, precision.shape).copy()
    return PeerCurves(iou=iou, acc=acc, precision=precision, recall=recall, f=f_beta(precision, recall))


def max_f_of_means(precision_sum: np.ndarray, recall_sum: np.ndarray, images: float) -> float:
    """``maxF``: ``max_k F(mean_i P_ik, mean_i R_ik)`` from the summed curves (0 without
    images)."""
    if not images:
        return 0.0
    return float(f_beta(np.asarray(precision_sum) / images, np.asarray(recall_sum) / images).max())


def max_mean_f(f_sum: np.ndarray, images: float) -> float:
    """``maxF_img``: ``max_k mean_i F_ik`` from the summed per-image F curves (TokenCut's
    ``F_max``; 0 without images)."""
    if not images:
        return 0.0
    return float((np.asarray(f_sum, dtype=np.float64) / images).max())


# ---------------------------------------------------------------------------- multi-class


@dataclass(frozen=True)
class MulticlassScores:
    """Scores of a multi-class benchmark (fractions).

    Attributes:
        ACC: matched pixel accuracy ``sum TP / sum labeled``.
        mIoU: ``nanmean_c`` of the per-class IoU (classes never seen nor predicted excluded).
        iou: per-class IoU (NaN where ``TP + FP + FN = 0``).
        images: number of images scored.
        regions: mean number of predicted segments per image.
        regions_median: median number of predicted segments per image.
        small_share: fraction of all pixels that lie in segments under 1% of their image.
        escape_median: median escape probability of the predicted regions, pooled over the
            images (``None`` for a method that does not report one: :func:`median_escape`).
    """

    ACC: float
    mIoU: float
    iou: tuple[float, ...]
    images: int
    regions: float = 0.0
    regions_median: float = 0.0
    small_share: float = 0.0
    escape_median: float | None = None

    def percent(self) -> dict[str, float | int]:
        """``pixAcc`` (= ``ACC``) and ``mIoU`` in percent, ``regions`` per image (mean),
        ``regions_median`` (median per image), ``small_px`` (percent of the pixels in regions
        under 1% of their image), ``escape_median``, ``images``."""
        return {"pixAcc": 100.0 * self.ACC, "mIoU": 100.0 * self.mIoU, "regions": self.regions,
                "regions_median": self.regions_median, "small_px": 100.0 * self.small_share,
                "escape_median": self.escape_median, "images": self.images}


@dataclass
class MulticlassState:
    """Additive per-class TP / FP / FN sums after per-image Hungarian matching.

    Attributes:
        tp, fp, fn: per-class counts, length ``K``.
        labeled: pixels with a valid ground-truth class.
        images: number of images.
        regions: predicted segments, summed over the images.
        region_counts: the predicted segments of every image (concatenated by ``+``, for the
            median).
        small_px: pixels in segments under 1% of their image (:func:`region_sizes`), summed.
        pixels: all pixels of the predictions, summed.
        escapes: the escape probability of every predicted region of every image (empty
            for a method that does not report them; concatenated by ``+``).
    """

    tp: list[int]
    fp: list[int]
    fn: list[int]
    labeled: int = 0
    images: int = 0
    regions: int = 0
    region_counts: list[int] = field(default_factory=list)
    small_px: int = 0
    pixels: int = 0
    escapes: list[float] = field(default_factory=list)

    @classmethod
    def zero(cls, num_classes: int) -> MulticlassState:
        return cls(tp=[0] * num_classes, fp=[0] * num_classes, fn=[0] * num_classes)

    def __add__(self, other: MulticlassState) -> MulticlassState:
        if not isinstance(other, MulticlassState):
            return NotImplemented
        if len(self.tp) != len(other.tp):
            raise ValueError(f"cannot merge states of {len(self.tp)} and {len(other.tp)} classes")
        return MulticlassState(
            tp=[a + b for a, b in zip(self.tp, other.tp)],
            fp=[a + b for a, b in zip(self.fp, other.fp)],
            fn=[a + b for a, b in zip(self.fn, other.fn)],
            labeled=self.labeled + other.labeled,
            images=self.images + other.images,
            regions=self.regions + other.regions,
            region_counts=[*self.region_counts, *other.region_counts],
            small_px=self.small_px + other.small_px,
            pixels=self.pixels + other.pixels,
            escapes=[*self.escapes, *other.escapes],
        )

    def scores(self) -> MulticlassScores:
        tp, fp, fn = (np.asarray(x, dtype=np.float64) for x in (self.tp, self.fp, self.fn))
        den = tp + fp + fn
        with np.errstate(invalid="ignore", divide="ignore"):
            iou = np.where(den > 0, tp / np.where(den > 0, den, 1), np.nan)
        miou = float(np.nanmean(iou)) if np.isfinite(iou).any() else 0.0
        return MulticlassScores(
            ACC=float(tp.sum() / self.labeled) if self.labeled else 0.0,
            mIoU=miou,
            iou=tuple(float(x) for x in iou),
            images=self.images,
            regions=self.regions / self.images if self.images else 0.0,
            regions_median=median_count(self.region_counts),
            small_share=self.small_px / self.pixels if self.pixels else 0.0,
            escape_median=median_escape(self.escapes),
        )

    def to_dict(self) -> dict:
        return {
            "kind": "multiclass", "tp": list(self.tp), "fp": list(self.fp), "fn": list(self.fn),
            "labeled": self.labeled, "images": self.images, "regions": self.regions,
            "region_counts": list(self.region_counts), "small_px": self.small_px, "pixels": self.pixels,
            "escapes": list(self.escapes),
        }

    @classmethod
    def from_dict(cls, d: dict) -> MulticlassState:
        if d.get("kind") != "multiclass":
            raise ValueError(f"not a multi-class metric state: {d!r}")
        return cls(
            tp=[int(x) for x in d["tp"]], fp=[int(x) for x in d["fp"]], fn=[int(x) for x in d["fn"]],
            labeled=int(d["labeled"]), images=int(d["images"]), regions=int(d["regions"]),
            region_counts=[int(x) for x in d["region_counts"]], small_px=int(d["small_px"]),
            pixels=int(d["pixels"]), escapes=[float(x) for x in d.get("escapes", [])],
        )


@dataclass
class _Matching:
    k: int
    hist: np.ndarray  # (K, S) pixels of class c in segment s
    rows: np.ndarray  # matched classes
    cols: np.ndarray  # their segments (contiguous ids)
    valid: np.ndarray  # (P,) pixels with a class in [0, K)
    segments: np.ndarray  # (S,) the segment ids present
    inverse: np.ndarray  # (P,) contiguous segment id of every pixel


def _match(pred: Tensor | np.ndarray, gt: Tensor | np.ndarray, num_classes: int) -> _Matching:
    from scipy.optimize import linear_sum_assignment

    p = _np(pred).astype(np.int64).ravel()
    g = _np(gt).astype(np.int64).ravel()
    if p.shape != g.shape:
        raise ValueError(f"pred and gt differ in size: {_np(pred).shape} vs {_np(gt).shape}")
    if p.size and p.min() < 0:
        raise ValueError("predicted segment ids must be non-negative")
    k = int(num_classes)
    valid = (g >= 0) & (g < k)
    segs, p = np.unique(p, return_inverse=True)  # contiguous ids; empty ids change nothing
    p = p.ravel()
    n = len(segs)
    hist = np.bincount(n * g[valid] + p[valid], minlength=k * n).reshape(k, n)
    rows, cols = linear_sum_assignment(hist, maximize=True)  # min(K, S) pairs
    return _Matching(k, hist, rows, cols, valid, segs, p)


def matched_classes(pred: Tensor | np.ndarray, gt: Tensor | np.ndarray, num_classes: int) -> np.ndarray:
    """Every pixel's class under the image's Hungarian matching (for panels).

    Args:
        pred: ``(H, W)`` non-negative segment ids.
        gt: ``(H, W)`` classes in ``[0, K)``; anything else is ignored.
        num_classes: ``K``.

    Returns:
        ``(H, W)`` int64: the class matched to the pixel's segment, or ``-1 - j`` for pixels of
        the ``j``-th unmatched segment.
    """
    m = _match(pred, gt, num_classes)
    seg_class = np.full(len(m.segments), -1, dtype=np.int64)
    seg_class[m.cols] = m.rows
    unmatched = seg_class < 0
    seg_class[unmatched] = -1 - np.arange(int(unmatched.sum()))
    return seg_class[m.inverse].reshape(_np(pred).shape)


def hungarian_state(
    pred: Tensor | np.ndarray,
    gt: Tensor | np.ndarray,
    num_classes: int,
) -> MulticlassState:
    """One image's TP / FP / FN after Hungarian matching of segments to classes.

    The histogram ``hist[c, s]`` counts pixels of class ``c`` predicted as segment ``s``
    (pixels whose class lies outside ``[0, K)``, e.g. 255, are ignored); matching maximises
    the matched pixels. Per class: ``TP = hist[c, s(c)]``, ``FN = row sum - TP``
    (this includes pixels of segments left unmatched), ``FP = column sum of s(c) - TP``.
    The histogram is ``K x S`` (no padding), matched by scipy's ``linear_sum_assignment``
    as it is: ``min(K, S)`` pairs, so with ``S <= K`` every segment is matched, possibly to a
    class absent from the image (its pixels are then that class's FP), and with ``S > K``
    every class is (``camvid-dev/REFERENCE.md``: "the 11 classes present or not"); which
    absent class takes such a segment is the solver's tie-break.
    ``regions`` counts the distinct segment ids of the whole prediction; ``small_px`` the
    pixels of those under 1% of the image (:func:`small_pixels`).

    Args:
        pred: ``(H, W)`` non-negative integer segment ids (any ids, any count).
        gt: ``(H, W)`` integer classes in ``[0, K)``; anything else is ignored.
        num_classes: ``K``.
    """
    m = _match(pred, gt, num_classes)
    k, hist, rows, cols, valid, segs = m.k, m.hist, m.rows, m.cols, m.valid, m.segments
    tp = np.zeros(k, dtype=np.int64)
    tp[rows] = hist[rows, cols]
    fn = hist.sum(1) - tp
    fp = np.zeros(k, dtype=np.int64)
    fp[rows] = hist[:, cols].sum(0) - hist[rows, cols]
    areas = np.bincount(m.inverse, minlength=len(segs))
    return MulticlassState(
        tp=tp.tolist(), fp=fp.tolist(), fn=fn.tolist(), labeled=int(valid.sum()), images=1,
        regions=len(segs), region_counts=[len(segs)], small_px=small_pixels(areas),
        pixels=int(areas.sum()),
    )


# ---------------------------------------------------------------------------- regions (BSDS)

SMALL_REGION = 0.01  # a region under this fraction of its image is "small" (small_px)


def median_count(counts: Sequence[int]) -> float:
    """The median of per-image counts (0 without images)."""
    return float(np.median(np.asarray(counts, dtype=np.float64))) if len(counts) else 0.0


def median_escape(escapes: Sequence[float]) -> float | None:
    """The median of the regions' escape probabilities (``None`` without any: a method that
    does not partition by escape, e.g. k-means)."""
    return float(np.median(np.asarray(escapes, dtype=np.float64))) if len(escapes) else None


def small_pixels(areas: np.ndarray, fraction: float = SMALL_REGION) -> int:
    """Pixels in regions whose area is under ``fraction`` of the image (``areas``: the pixel
    count of every region of one image)."""
    areas = np.asarray(areas, dtype=np.int64)
    return int(areas[areas < fraction * areas.sum()].sum())


def _contiguous(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, inverse)``: the distinct values of ``x`` (ascending) and every element's index
    among them (``0 .. len(ids) - 1``)."""
    x = np.asarray(x, dtype=np.int64).ravel()
    lo = int(x.min())
    if int(x.max()) - lo < 4 * x.size:  # small ids: a lookup table (no sort)
        present = np.bincount(x - lo) > 0
        ids = np.flatnonzero(present) + lo
        lut = np.cumsum(present) - 1
        return ids, lut[x - lo]
    ids, inv = np.unique(x, return_inverse=True)
    return ids, inv.ravel()


def contingency(seg: np.ndarray, gt: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The contingency table of two label maps of the same shape.

    Returns:
        ``(n, seg_ids, gt_ids)``: ``n[i, j]`` counts the pixels with ``seg == seg_ids[i]`` and
        ``gt == gt_ids[j]`` (int64, only the ids present, in ascending order).
    """
    seg = np.asarray(seg)
    gt = np.asarray(gt)
    if seg.shape != gt.shape:
        raise ValueError(f"segmentation and ground truth differ in size: {seg.shape} vs {gt.shape}")
    s_ids, s = _contiguous(seg)
    g_ids, g = _contiguous(gt)
    n = np.bincount(s * len(g_ids) + g, minlength=len(s_ids) * len(g_ids))
    return n.reshape(len(s_ids), len(g_ids)), s_ids, g_ids


def rand_index(n: np.ndarray) -> float:
    """The Rand index of two labellings from their contingency table ``n``, as the official
    ``compare_segmentations.m`` computes it (Rand 1971, eq. 2.2):
    ``1 - (sum_u a_u^2 / 2 + sum_v b_v^2 / 2 - sum_uv n_uv^2) / (N (N - 1) / 2)``, the fraction
    of the ``N choose 2`` pixel pairs on which the two agree (same region in both or in
    neither). 1 for fewer than two pixels (no pair disagrees)."""
    n = np.asarray(n, dtype=np.float64)
    total = n.sum()
    if total < 2:
        return 1.0
    a, b = n.sum(1), n.sum(0)
    disagree = (a @ a) / 2.0 + (b @ b) / 2.0 - (n * n).sum()
    return float(1.0 - disagree / (total * (total - 1) / 2.0))


def _entropy_bits(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def variation_of_information(n: np.ndarray) -> float:
    """``H(S) + H(G) - 2 I(S, G)`` in bits from the contingency table ``n`` (the official
    ``compare_segmentations.m``); 0 when the two labellings are equal up to renaming."""
    n = np.asarray(n, dtype=np.float64)
    joint = n / n.sum()
    ps, pg = joint.sum(1), joint.sum(0)
    nz = joint > 0
    mi = float((joint[nz] * np.log2(joint[nz] / np.outer(ps, pg)[nz])).sum())
    return _entropy_bits(ps) + _entropy_bits(pg) - 2.0 * mi


@dataclass(frozen=True)
class RegionScores:
    """Scores of a prediction against several human segmentations per image (fractions;
    ``VI`` in bits).

    Attributes:
        Covering: pooled segmentation covering of the human regions by the predicted ones.
        PRI: probabilistic Rand index (mean over annotators, then images).
        VI: variation of information in bits (mean over annotators, then images; lower is
            better).
        images: number of images scored.
        regions: mean number of predicted regions per image.
        regions_median: median number of predicted regions per image.
        small_share: fraction of all pixels in predicted regions under 1% of their image.
        escape_median: median escape probability of the predicted regions, pooled over the
            images (``None`` for a method that does not report one).
    """

    Covering: float
    PRI: float
    VI: float
    images: int
    regions: float = 0.0
    regions_median: float = 0.0
    small_share: float = 0.0
    escape_median: float | None = None

    def percent(self) -> dict[str, float | int]:
        """The table's values: ``Covering``, ``PRI`` and ``VI`` as the field writes them
        (fractions, bits), ``regions_median`` and ``regions`` (mean) per image, ``small_px``
        in percent, ``images``."""
        return {"Covering": self.Covering, "PRI": self.PRI, "VI": self.VI,
                "regions_median": self.regions_median, "regions": self.regions,
                "small_px": 100.0 * self.small_share, "escape_median": self.escape_median,
                "images": self.images}


@dataclass
class RegionState:
    """Additive sums of the region metrics over a set of images.

    Attributes:
        covering_num: ``sum |R| * max_S IoU(R, S)`` over the regions ``R`` of every annotator.
        covering_den: ``sum |R|`` over the same regions (pixels times annotators).
        pri_sum: sum over images of the annotator-mean Rand index.
        vi_sum: sum over images of the annotator-mean variation of information (bits).
        images: number of images.
        region_counts: predicted regions of every image (concatenated by ``+``).
        small_px: pixels in predicted regions under 1% of their image, summed.
        pixels: pixels of the predictions, summed.
        escapes: the escape probability of every predicted region of every image (empty
            for a method that does not report them; concatenated by ``+``).
    """

    covering_num: float = 0.0
    covering_den: int = 0
    pri_sum: float = 0.0
    vi_sum: float = 0.0
    images: int = 0
    region_counts: list[int] = field(default_factory=list)
    small_px: int = 0
    pixels: int = 0
    escapes: list[float] = field(default_factory=list)

    def __add__(self, other: RegionState) -> RegionState:
        if not isinstance(other, RegionState):
            return NotImplemented
        return RegionState(
            covering_num=self.covering_num + other.covering_num,
            covering_den=self.covering_den + other.covering_den,
            pri_sum=self.pri_sum + other.pri_sum,
            vi_sum=self.vi_sum + other.vi_sum,
            images=self.images + other.images,
            region_counts=[*self.region_counts, *other.region_counts],
            small_px=self.small_px + other.small_px,
            pixels=self.pixels + other.pixels,
            escapes=[*self.escapes, *other.escapes],
        )

    def scores(self) -> RegionScores:
        n = self.images
        return RegionScores(
            Covering=self.covering_num / self.covering_den if self.covering_den else 0.0,
            PRI=self.pri_sum / n if n else 0.0,
            VI=self.vi_sum / n if n else 0.0,
            images=n,
            regions=float(np.sum(self.region_counts)) / n if n else 0.0,
            regions_median=median_count(self.region_counts),
            small_share=self.small_px / self.pixels if self.pixels else 0.0,
            escape_median=median_escape(self.escapes),
        )

    def to_dict(self) -> dict:
        return {
            "kind": "regions", "covering_num": self.covering_num, "covering_den": self.covering_den,
            "pri_sum": self.pri_sum, "vi_sum": self.vi_sum, "images": self.images,
            "region_counts": list(self.region_counts), "small_px": self.small_px,
            "pixels": self.pixels, "escapes": list(self.escapes),
        }

    @classmethod
    def from_dict(cls, d: dict) -> RegionState:
        if d.get("kind") != "regions":
            raise ValueError(f"not a region metric state: {d!r}")
        return cls(
            covering_num=float(d["covering_num"]), covering_den=int(d["covering_den"]),
            pri_sum=float(d["pri_sum"]), vi_sum=float(d["vi_sum"]), images=int(d["images"]),
            region_counts=[int(x) for x in d["region_counts"]], small_px=int(d["small_px"]),
            pixels=int(d["pixels"]), escapes=[float(x) for x in d.get("escapes", [])],
        )


def region_state(pred: Tensor | np.ndarray, gts: Tensor | np.ndarray | Sequence[np.ndarray]) -> RegionState:
    """One image's covering sums, Rand index and VI against its human segmentations, as the
    official ``regionBench`` computes them.

    Every distinct value of ``pred`` is one region (the official code takes a label map
    ``1 .. S``; any ids are renamed so). Per annotator ``k``, the contingency table ``n`` of
    (prediction, ``G_k``) gives:

    - covering: ``IoU(S_i, R_j) = n_ij / (|S_i| + |R_j| - n_ij)``; each human region ``R_j``
      (ids ``>= 1``: the official ``match_segmentations.m`` leaves id 0 out, though its
      pixels count in the predicted regions' areas) adds ``|R_j| max_i IoU`` to
      ``covering_num`` and ``|R_j|`` to ``covering_den``;
    - :func:`rand_index` and :func:`variation_of_information` of ``n``, averaged over the
      annotators (``match_segmentations2.m``).

    Args:
        pred: ``(H, W)`` integer region ids.
        gts: ``(K, H, W)`` human segmentations (integer region ids, the official ones from 1),
            or a sequence of ``K`` such maps.
    """
    p = _np(pred)
    if isinstance(gts, (list, tuple)):
        gts = np.stack([_np(g) for g in gts])
    g = _np(gts)
    if g.ndim == p.ndim:
        g = g[None]
    if p.ndim != 2 or g.ndim != 3 or g.shape[1:] != p.shape:
        raise ValueError(
            f"expected an (H, W) prediction and (K, H, W) human segmentations, got {p.shape} and {g.shape}"
        )
    if g.shape[0] < 1:
        raise ValueError("no human segmentation to score against")
    s_ids, s = _contiguous(p)
    tables = []
    for gk in g:
        g_ids, gi = _contiguous(gk)
        n = np.bincount(s * len(g_ids) + gi, minlength=len(s_ids) * len(g_ids)).reshape(len(s_ids), len(g_ids))
        tables.append((n, g_ids))
    return region_state_of_tables(tables)


def region_state_of_tables(tables: Sequence[tuple[np.ndarray, np.ndarray]]) -> RegionState:
    """One image's :class:`RegionState` from its contingency tables, one per annotator: the
    sums :func:`region_state` defines (covering with human id 0 left out, the annotator-mean
    Rand index and VI, the region count and the pixels of small regions).

    Args:
        tables: per annotator ``(n, g_ids)``: ``n`` the ``(S, G_k)`` integer table of the
            prediction's ``S`` regions (every row a region present in the image, the same
            rows in every table) against the annotator's regions ``g_ids`` (ascending ids,
            0 = unlabelled pixels).
    """
    if not tables:
        raise ValueError("no human segmentation to score against")
    areas_s = np.asarray(tables[0][0]).sum(1).astype(np.float64)
    num, den, ri, vi = 0.0, 0, 0.0, 0.0
    for n, g_ids in tables:
        n = np.asarray(n)
        nf = n.astype(np.float64)
        areas_g = n.sum(0)
        iou = nf / (areas_s[:, None] + areas_g[None, :] - nf)
        region = np.asarray(g_ids) >= 1
        num += float((areas_g * iou.max(0))[region].sum())
        den += int(areas_g[region].sum())
        ri += rand_index(n)
        vi += variation_of_information(n)
    k = len(tables)
    return RegionState(
        covering_num=num, covering_den=den, pri_sum=ri / k, vi_sum=vi / k, images=1,
        region_counts=[len(areas_s)], small_px=small_pixels(areas_s.astype(np.int64)),
        pixels=int(areas_s.sum()),
    )


# ---------------------------------------------------------------------------- helpers

State = BinaryState | MulticlassState | RegionState


def state_from_dict(d: dict) -> State:
    kind = d.get("kind")
    if kind == "binary":
        return BinaryState.from_dict(d)
    if kind == "multiclass":
        return MulticlassState.from_dict(d)
    if kind == "regions":
        return RegionState.from_dict(d)
    raise ValueError(f"unknown metric state kind {kind!r}")


def total(states: Iterable[State], empty: State) -> State:
    """Sum of states, in order (``empty`` when there are none)."""
    acc = empty
    for s in states:
        acc = acc + s
    return acc


# ---------------------------------------------------------------------------- intervals


def _additive(states: Sequence[State]) -> tuple[str, np.ndarray]:
    """``(kind, V)``: the states' additive sums, one float64 row per state.

    Binary rows: ``[correct, labeled, inter_bg, inter_fg, union_bg, union_fg, ap_sum,
    images, iou_sum, acc_sum, prec_sum (255), rec_sum (255), f_sum (255)]``; multi-class rows: ``[tp (K), fp (K), fn (K), labeled, images]``;
    region rows: ``[covering_num, covering_den, pri_sum, vi_sum, images]``. Counts stay
    exact in float64 (integers below 2^53).
    """
    if all(isinstance(s, BinaryState) for s in states):
        return "binary", np.array([[s.correct, s.labeled, *s.inter, *s.union, s.ap_sum, s.images,
                                    s.iou_sum, s.acc_sum, *s.prec_sum, *s.rec_sum, *s.f_sum]
                                   for s in states], dtype=np.float64)
    if all(isinstance(s, MulticlassState) for s in states):
        k = {len(s.tp) for s in states}
        if len(k) != 1:
            raise ValueError(f"multi-class states of different class counts: {sorted(k)}")
        return "multiclass", np.array([[*s.tp, *s.fp, *s.fn, s.labeled, s.images] for s in states],
                                      dtype=np.float64)
    if all(isinstance(s, RegionState) for s in states):
        return "regions", np.array([[s.covering_num, s.covering_den, s.pri_sum, s.vi_sum, s.images]
                                    for s in states], dtype=np.float64)
    raise ValueError("states to resample must all be binary or all multi-class or all regions (one kind)")


def _headline(kind: str, sums: np.ndarray) -> dict[str, float]:
    """The headline scores (fractions) of one summed row of :func:`_additive`, computed by
    the states' own :meth:`scores` (one definition of every metric)."""
    if kind == "binary":
        c, lab, i0, i1, u0, u1, ap, n, iou, acc = sums[:10].tolist()
        k = PEER_BINS
        sc = BinaryState(correct=c, labeled=lab, inter=[i0, i1], union=[u0, u1], ap_sum=ap, images=n,
                         iou_sum=iou, acc_sum=acc, prec_sum=sums[10: 10 + k], rec_sum=sums[10 + k: 10 + 2 * k],
                         f_sum=sums[10 + 2 * k: 10 + 3 * k]).scores()
        return {"pixAcc": sc.pixAcc, "mIoU": sc.mIoU, "mAP": sc.mAP, "fgIoU": sc.fgIoU,
                "acc": sc.acc, "maxF": sc.maxF, "maxF_img": sc.maxF_img}
    if kind == "regions":
        num, den, pri, vi, n = sums.tolist()
        sc = RegionState(covering_num=num, covering_den=den, pri_sum=pri, vi_sum=vi, images=n).scores()
        return {"Covering": sc.Covering, "PRI": sc.PRI, "VI": sc.VI}
    k = (sums.shape[-1] - 2) // 3
    row = sums.tolist()
    sc = MulticlassState(tp=row[:k], fp=row[k: 2 * k], fn=row[2 * k: 3 * k], labeled=row[3 * k],
                         images=row[3 * k + 1]).scores()
    return {"pixAcc": sc.ACC, "mIoU": sc.mIoU}


@dataclass(frozen=True)
class Bootstrap:
    """Percentile intervals of set-level scores from resampling the images.

    The images are drawn with replacement ``reps`` times (the same draws for every method,
    so differences between methods are paired); each draw's scores are the ``scores()`` of
    its summed additive state, exactly as the whole set's are (sums first, then ratios:
    pixAcc and mIoU over summed counts, mAP as the mean of per-image APs, Covering as the
    pooled ratio of the resampled images' sums, PRI and VI as their means).

    Attributes:
        level: the interval's coverage, e.g. ``0.95``.
        draws: method -> score name -> ``(reps,)`` resampled scores (fractions).
    """

    level: float
    draws: dict[str, dict[str, np.ndarray]]

    def interval(self, method: str, score: str) -> tuple[float, float]:
        """The ``level`` percentile interval of a method's score (fractions)."""
        return self._percentiles(self.draws[method][score])

    def difference(self, method: str, reference: str, score: str) -> tuple[float, float]:
        """The ``level`` percentile interval of ``score(method) - score(reference)`` over the
        same resampled images (paired)."""
        return self._percentiles(self.draws[method][score] - self.draws[reference][score])

    def _percentiles(self, x: np.ndarray) -> tuple[float, float]:
        return percentile_interval(x, self.level)


def percentile_interval(x: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The central ``level`` percentile interval of bootstrap draws ``x``: ``(low, high)``."""
    tail = 100.0 * (1.0 - level) / 2.0
    lo, hi = np.percentile(x, [tail, 100.0 - tail])
    return float(lo), float(hi)


def resample_counts(n: int, reps: int, seed: int = 0) -> np.ndarray:
    """``(reps, n)`` float64: how often each of ``n`` images is drawn in each resample (``n``
    draws with replacement, one multinomial draw per resample from numpy's
    ``default_rng(seed)``)."""
    if int(n) < 1:
        raise ValueError("no states to resample")
    rng = np.random.default_rng(int(seed))
    return rng.multinomial(int(n), np.full(int(n), 1.0 / int(n)), size=int(reps)).astype(np.float64)


def bootstrap(per_method: dict[str, Sequence[State]], reps: int = 1000, level: float = 0.95,
              seed: int = 0) -> Bootstrap:
    """Resample the images of every method's per-image states together (paired draws).

    Args:
        per_method: method -> its per-image states, the same images in the same order for
            every method.
        reps: number of resamples (>= 1).
        level: interval coverage in ``(0, 1)``.
        seed: seed of the draws (numpy ``default_rng``): the same seed gives the same
            intervals.

    Returns:
        A :class:`Bootstrap` holding every method's resampled scores (the draws are
        :func:`resample_counts` ``(n, reps, seed)``).
    """
    if int(reps) < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    if not 0.0 < float(level) < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    sizes = {len(v) for v in per_method.values()}
    if len(sizes) != 1:
        raise ValueError(f"every method needs the same images, got counts {sorted(sizes)}")
    counts = resample_counts(sizes.pop(), reps, seed)
    draws = {}
    for name, states in per_method.items():
        kind, v = _additive(states)
        scores = [_headline(kind, row) for row in counts @ v]  # one summed state per draw
        draws[name] = {key: np.array([sc[key] for sc in scores]) for key in scores[0]}
    return Bootstrap(level=float(level), draws=draws)
