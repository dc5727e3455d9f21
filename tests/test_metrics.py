"""Metrics against hand-computed cases and independent re-implementations of the published
definitions (Chefer et al.'s ImageNet-segmentation code, ConceptAttention's stacked-channel
IoU, DiffSeg's Hungarian matching)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from segment.eval.metrics import (
    BinaryState,
    MulticlassState,
    average_precision,
    binary_states,
    bootstrap,
    hungarian_state,
    matched_classes,
    miou_ca,
    pooled_average_precision,
    pooled_average_precisions,
    resample_counts,
    state_from_dict,
    total,
)

from segment.core.masks import heatmap_at, threshold_mean


def _t(x, dtype=torch.bool):
    return torch.as_tensor(np.asarray(x)).to(dtype)


# ------------------------------------------------------------------ binary, hand-computed


def test_binary_hand_computed_single_image():
    gt = [[1, 1], [0, 0]]
    pred = [[1, 0], [0, 0]]
    score = [[0.9, 0.2], [0.1, 0.0]]
    (s,) = binary_states(_t([score], torch.float32), _t([pred]), _t([gt]))
    assert (s.correct, s.labeled) == (3, 4)
    assert s.inter == [2, 1] and s.union == [3, 2]  # [bg, fg]
    sc = s.scores()
    assert sc.pixAcc == pytest.approx(0.75)
    assert sc.mIoU == pytest.approx((2 / 3 + 1 / 2) / 2)
    assert sc.mIoU_CA == pytest.approx(0.75 / 1.25)
    # pooled scores [0.1, 0.8, 0.9, 1.0 | 0.9, 0.2, 0.1, 0.0] vs targets [0 0 1 1 | 1 1 0 0]:
    # ranks 1.0(1) 0.9(1) 0.9(1) 0.8(0) 0.2(1) 0.1(0) 0.1(0) 0.0(0); the tie at 0.9 is one
    # threshold with 2 positives: P=1 at R=3/4 (the three top), then 0.2 adds R=1 at P=4/5.
    assert sc.mAP == pytest.approx(0.75 * 1.0 + 0.25 * 4 / 5)


def test_pooled_ap_hand_computed():
    # R = [0.8, 0.3], G = [1, 0]: pooled [0.2, 0.7, 0.8, 0.3] vs [0, 1, 1, 0] -> perfect ranking
    assert pooled_average_precision(np.array([0.8, 0.3]), np.array([True, False])) == pytest.approx(1.0)
    # R = [0.3, 0.8], G = [1, 0]: ranking 0.8(0) 0.7(0) 0.3(1) 0.2(1): P = 1/3 at R = 1/2,
    # P = 2/4 at R = 1 -> AP = 1/2 * 1/3 + 1/2 * 1/2
    assert pooled_average_precision(np.array([0.3, 0.8]), np.array([True, False])) == pytest.approx(5 / 12)


def _ap_reference(y_true: np.ndarray, y_score: np.ndarray) -> float:
    """Step-wise AP = sum_n (R_n - R_{n-1}) P_n over distinct thresholds (no interpolation)."""
    order = np.argsort(-y_score, kind="stable")
    t, s = y_true[order], y_score[order]
    tp = np.cumsum(t)
    last = np.r_[np.nonzero(np.diff(s))[0], len(s) - 1]  # last index of each distinct score
    prec = tp[last] / (last + 1)
    rec = tp[last] / t.sum()
    return float(np.sum(np.diff(np.r_[0.0, rec]) * prec))


def test_pooled_ap_matches_definition_on_random_maps():
    rng = np.random.default_rng(0)
    for _ in range(5):
        r = rng.random((7, 9)).astype(np.float32)
        g = rng.random((7, 9)) > 0.6
        ref = _ap_reference(
            np.r_[~g.ravel(), g.ravel()].astype(int), np.r_[np.float32(1) - r.ravel(), r.ravel()]
        )
        assert pooled_average_precision(r, g) == pytest.approx(ref, abs=1e-12)


def _sklearn_ap(y_true: np.ndarray, y_score: np.ndarray) -> float:
    import warnings

    from sklearn.metrics import average_precision_score

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(np.nan_to_num(average_precision_score(y_true, y_score)))


@pytest.mark.parametrize("levels", [None, 2, 5, 50])
def test_torch_ap_equals_sklearn_on_random_and_tied_scores(levels):
    # levels=None: continuous scores; otherwise scores quantised to a few values (many ties)
    rng = np.random.default_rng(levels or 0)
    b, m = 6, 3001
    s = rng.random((b, m)).astype(np.float32)
    if levels:
        s = np.floor(s * levels).astype(np.float32) / levels
    t = rng.random((b, m)) < rng.uniform(0.05, 0.95, (b, 1))
    got = average_precision(torch.from_numpy(s), torch.from_numpy(t))
    assert got.dtype == torch.float64 and got.shape == (b,)
    for i in range(b):
        assert got[i].item() == pytest.approx(_sklearn_ap(t[i].astype(int), s[i]), abs=1e-6)


def test_torch_ap_edge_cases_match_sklearn():
    cases = [
        ([0, 0, 0], [0.2, 0.5, 0.1]),  # no positive: sklearn returns 0 (with a warning)
        ([1, 1, 1], [0.2, 0.5, 0.1]),  # all positive: 1
        ([0, 1, 1, 0], [0.5, 0.5, 0.5, 0.5]),  # one threshold: P = 1/2 at R = 1
        ([1, 0, 0, 1, 0], [0.9, 0.9, 0.3, 0.3, 0.1]),
        ([1], [0.7]),
    ]
    for y, s in cases:
        got = average_precision(torch.tensor(s, dtype=torch.float32), torch.tensor(y).bool()).item()
        assert got == pytest.approx(_sklearn_ap(np.array(y), np.array(s, np.float32)), abs=1e-12), (y, s)
    # batch dimensions are kept, and mismatched shapes are refused
    x = torch.rand(2, 3, 10)
    assert average_precision(x, x > 0.5).shape == (2, 3)
    with pytest.raises(ValueError, match="same"):
        average_precision(torch.rand(3, 4), torch.rand(3, 5) > 0.5)


def test_pooled_aps_batched_equal_sklearn_per_image():
    rng = np.random.default_rng(3)
    r = rng.random((5, 13, 11)).astype(np.float32)
    r[1] = np.round(r[1] * 4) / 4  # ties, across the two channels too (0.5 and 1 - 0.5)
    r[2] = 0.0  # constant heatmap
    g = rng.random((5, 13, 11)) > 0.5
    got = pooled_average_precisions(torch.from_numpy(r), torch.from_numpy(g))
    for i in range(5):
        y = np.r_[~g[i].ravel(), g[i].ravel()].astype(int)
        sc = np.r_[np.float32(1) - r[i].ravel(), r[i].ravel()]
        assert got[i].item() == pytest.approx(_sklearn_ap(y, sc), abs=1e-6)


def test_pooled_ap_key_path_equals_general_path():
    # the CPU path (numpy sort + merge of packed keys, sparse tie corrections) against the
    # general sort-based average_precision that other devices run
    from segment.eval.metrics import _ap_of_sorted_keys, _pooled_keys

    rng = np.random.default_rng(5)
    r = torch.from_numpy(rng.random((4, 700)).astype(np.float32))
    r[1] = torch.round(r[1] * 3) / 3
    r[2, :50] = 0.5  # exact ties between the channels: 1 - 0.5 == 0.5
    g = torch.from_numpy(rng.random((4, 700)) > 0.4)
    kr = (r.view(torch.int32) << 1) | g.to(torch.int32)
    ku = ((1.0 - r).view(torch.int32) << 1) | (~g).to(torch.int32)
    keys = torch.sort(torch.cat([kr, ku], 1), dim=-1).values
    assert np.array_equal(keys.numpy(), _pooled_keys(r, g))  # the merge gives the same order
    cpu = torch.from_numpy(_ap_of_sorted_keys(keys.numpy()))
    ref = average_precision(torch.cat([1.0 - r, r], 1), torch.cat([~g, g], 1))
    assert torch.allclose(cpu, ref, atol=1e-12)
    assert torch.allclose(pooled_average_precisions(r, g), ref, atol=1e-12)
    # scores outside [0, 1] take the general path and still equal scikit-learn
    big = r * 3 - 1
    got = pooled_average_precisions(big, g)
    for i in range(4):
        y = np.r_[~g[i].numpy(), g[i].numpy()].astype(int)
        sc = np.r_[np.float32(1) - big[i].numpy(), big[i].numpy()]
        assert got[i].item() == pytest.approx(_sklearn_ap(y, sc), abs=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_ap_on_cuda_equals_cpu():
    s = torch.rand(4, 5000)
    t = torch.rand(4, 5000) > 0.4
    assert torch.allclose(average_precision(s.cuda(), t.cuda()).cpu(), average_precision(s, t), atol=1e-9)
    r = torch.rand(3, 40, 30)
    r[0] = torch.round(r[0] * 4) / 4
    g = torch.rand(3, 40, 30) > 0.5
    got = pooled_average_precisions(r.cuda(), g.cuda())
    assert got.device.type == "cuda"
    assert torch.allclose(got.cpu(), pooled_average_precisions(r, g), atol=1e-9)


def test_ap_of_constant_heatmap_is_finite():
    # a constant map (min-max gives 0 everywhere): channel 0 scores 1, channel 1 scores 0
    g = np.array([[True, False, False, False]])
    r = np.zeros((1, 4), np.float32)
    ref = _ap_reference(np.r_[~g.ravel(), g.ravel()].astype(int), np.r_[1 - r.ravel(), r.ravel()])
    assert pooled_average_precision(r, g) == pytest.approx(ref)
    assert np.isfinite(ref)


def _sklearn_pooled_ap(r: torch.Tensor, g: torch.Tensor) -> float:
    """Protocol §3 AP straight from scikit-learn: pooled scores ``[1-R, R]`` against targets
    ``[1-G, G]``, NaN -> 0 (independent of the code under test)."""
    from sklearn.metrics import average_precision_score

    r = r.float().flatten().numpy()  # the heatmap's own precision (float32)
    g = g.flatten().numpy().astype(np.int64)
    ap = average_precision_score(np.r_[1 - g, g], np.r_[np.float32(1) - r, r])
    return 0.0 if np.isnan(ap) else float(ap)


def _chefer_reference(heat: torch.Tensor, gt: torch.Tensor):
    """Re-implementation of the published evaluation loop (two channels, argmax, sums)."""
    tot_correct = tot_label = 0
    tot_inter = np.zeros(2)
    tot_union = np.zeros(2)
    aps = []
    for r, g in zip(heat, gt):
        res1 = (r > r.mean()).float()
        res0 = (r <= r.mean()).float()
        output = torch.stack([res0, res1])  # (2, H, W)
        predict = output.argmax(0)
        target = g.long()
        tot_correct += int((predict == target).sum())
        tot_label += target.numel()
        for c in range(2):
            tot_inter[c] += int(((predict == c) & (target == c)).sum())
            tot_union[c] += int(((predict == c) | (target == c)).sum())
        aps.append(_sklearn_pooled_ap(r, g))
    acc = tot_correct / tot_label
    iou = tot_inter / tot_union
    return acc, iou.mean(), float(np.mean(aps))


def _conceptattention_miou(pred: torch.Tensor, gt: torch.Tensor) -> float:
    """ConceptAttention-style IoU: both classes' one-hot channels stacked into one histogram."""
    p = torch.stack([~pred, pred], 1).flatten()  # (B*2*H*W,)
    g = torch.stack([~gt, gt], 1).flatten()
    inter = (p & g).sum().item()
    union = (p | g).sum().item()
    return inter / union


def test_binary_set_sums_match_reference_definitions():
    torch.manual_seed(0)
    raw = torch.rand(5, 4, 4)
    heat = heatmap_at(raw, (16, 12))  # protocol's R: bilinear + min-max
    pred = threshold_mean(heat)
    gt = torch.rand(5, 16, 12) > 0.55
    states = binary_states(heat, pred, gt)
    sc = total(states, BinaryState()).scores()
    acc, miou, mAP = _chefer_reference(heat, gt)
    assert sc.pixAcc == pytest.approx(acc, abs=1e-12)
    assert sc.mIoU == pytest.approx(miou, abs=1e-12)
    assert sc.mAP == pytest.approx(mAP, abs=1e-12)
    assert sc.mIoU_CA == pytest.approx(_conceptattention_miou(pred, gt), abs=1e-12)
    assert sc.mIoU_CA == pytest.approx(miou_ca(acc), abs=1e-12)
    assert sc.images == 5


def test_binary_accumulates_sums_not_image_means():
    # image A: 1 pixel, wrong; image B: 3 pixels, right -> set accuracy 3/4, image mean 1/2
    a = binary_states(_t([[[0.0]]], torch.float32), _t([[[True]]]), _t([[[False]]]))[0]
    b = binary_states(
        _t([[[1.0, 0.0, 0.0]]], torch.float32), _t([[[True, False, False]]]), _t([[[True, False, False]]])
    )[0]
    sc = (a + b).scores()
    assert sc.pixAcc == pytest.approx(3 / 4)
    # IoU bg: inter 2, union 3; fg: inter 1, union 2
    assert sc.mIoU == pytest.approx((2 / 3 + 1 / 2) / 2)


def test_binary_state_is_additive_and_serialisable():
    torch.manual_seed(1)
    heat = torch.rand(6, 5, 5)
    states = binary_states(heat, heat > 0.5, torch.rand(6, 5, 5) > 0.5)
    whole = total(states, BinaryState())
    left = total(states[:2], BinaryState())
    right = total(states[2:], BinaryState())
    merged = left + right
    assert (merged.correct, merged.labeled, merged.inter, merged.union, merged.images) == (
        whole.correct, whole.labeled, whole.inter, whole.union, whole.images
    )
    assert merged.ap_sum == pytest.approx(whole.ap_sum, abs=1e-12)  # float sums: order only
    assert state_from_dict(whole.to_dict()) == whole
    with pytest.raises(ValueError, match="binary"):
        BinaryState.from_dict({"kind": "multiclass"})


def test_binary_states_shape_mismatch():
    with pytest.raises(ValueError, match=r"\(B, H, W\)"):
        binary_states(torch.rand(1, 4, 4), torch.rand(1, 4, 4) > 0.5, torch.rand(1, 4, 5) > 0.5)


# ------------------------------------------------------------------ multi-class


def test_hungarian_permuted_ids_are_perfect():
    gt = np.array([[0, 0, 1], [2, 2, 1]])
    pred = np.array([[7, 7, 3], [5, 5, 3]])  # a relabelling of gt
    s = hungarian_state(pred, gt, 3)
    assert s.tp == [2, 2, 2] and s.fp == [0, 0, 0] and s.fn == [0, 0, 0]
    sc = s.scores()
    assert sc.ACC == 1.0 and sc.mIoU == 1.0


def test_hungarian_hand_computed_with_unmatched_segment_and_ignore():
    # classes K = 2; gt row-major: 0 0 0 1 1 255;  pred: a a b c c c (3 segments > K)
    gt = np.array([0, 0, 0, 1, 1, 255])
    pred = np.array([0, 0, 1, 2, 2, 2])
    s = hungarian_state(pred, gt, 2)
    # hist[class, segment] = [[2, 1, 0], [0, 0, 2]]; matching 0->a, 1->c; segment b unmatched
    assert s.tp == [2, 2]
    assert s.fn == [1, 0]  # the pixel of unmatched segment b is an FN of class 0 only
    assert s.fp == [0, 0]  # the ignored pixel (255) predicted as c is not counted
    assert s.labeled == 5
    sc = s.scores()
    assert sc.ACC == pytest.approx(4 / 5)
    assert sc.mIoU == pytest.approx((2 / 3 + 1) / 2)


def test_hungarian_hand_computed_three_classes_ignore_unmatched_and_regions():
    # K = 3 classes, ignore 255, 4 segments (ids 3, 5, 7, 9): one segment must stay unmatched
    gt = np.array([[0, 0, 0, 1],
                   [0, 0, 1, 1],
                   [255, 2, 2, 1]])
    pred = np.array([[7, 7, 3, 5],
                     [7, 7, 7, 5],
                     [9, 9, 9, 5]])
    # hist[class, segment] over labelled pixels, segments sorted (3, 5, 7, 9):
    #   class 0: [1, 0, 4, 0]    class 1: [0, 3, 1, 0]    class 2: [0, 0, 0, 2]
    # the only best matching: 0 -> 7 (4), 1 -> 5 (3), 2 -> 9 (2); segment 3 unmatched
    s = hungarian_state(pred, gt, 3)
    assert s.tp == [4, 3, 2]
    assert s.fn == [1, 1, 0]  # class 0: its pixel in unmatched segment 3 (FN only); class 1: in 7
    assert s.fp == [1, 0, 0]  # segment 7 holds a class-1 pixel; the 255 pixel in 9 counts nowhere
    assert s.labeled == 11 and s.regions == 4
    sc = s.scores()
    assert sc.ACC == pytest.approx(9 / 11)
    assert sc.iou == pytest.approx((4 / 6, 3 / 4, 1.0))
    assert sc.mIoU == pytest.approx((4 / 6 + 3 / 4 + 1) / 3)
    assert sc.percent()["regions"] == 4 and sc.percent()["pixAcc"] == pytest.approx(900 / 11)
    # the same matching paints the panels: matched segments take their class, others < 0
    cls = matched_classes(pred, gt, 3)
    assert cls[0, 0] == 0 and cls[0, 3] == 1 and cls[2, 0] == 2 and cls[0, 2] == -1
    # two images: the regions count adds up, the mean is per image
    two = s + hungarian_state(np.zeros((2, 2), int), np.zeros((2, 2), int), 3)
    assert two.regions == 5 and two.scores().regions == 2.5
    assert state_from_dict(two.to_dict()) == two


def test_hungarian_fewer_segments_than_classes():
    gt = np.array([0, 1, 2, 2])
    pred = np.array([0, 0, 0, 0])  # one segment: matched to class 2 (2 pixels)
    s = hungarian_state(pred, gt, 3)
    assert s.tp == [0, 0, 2]
    assert s.fp == [0, 0, 2]
    assert s.fn == [1, 1, 0]


def test_hungarian_matches_brute_force():
    rng = np.random.default_rng(3)
    k = 3
    for _ in range(10):
        gt = rng.integers(0, k + 1, size=40)  # value k is ignored (outside [0, K))
        pred = rng.integers(0, 4, size=40)
        s = hungarian_state(pred, gt, k)
        valid = gt < k
        best = 0
        segs = list(range(max(k, 4)))
        for assign in itertools.permutations(segs, k):  # injective class -> segment maps
            best = max(best, sum(int(((gt == c) & (pred == assign[c]) & valid).sum()) for c in range(k)))
        assert sum(s.tp) == best
        assert sum(s.tp) + sum(s.fn) == int(valid.sum()) == s.labeled


def test_multiclass_miou_is_nanmean_over_seen_classes():
    s = MulticlassState(tp=[2, 0, 0], fp=[2, 0, 1], fn=[0, 0, 0], labeled=2, images=1)
    sc = s.scores()
    assert np.isnan(sc.iou[1])
    assert sc.mIoU == pytest.approx((0.5 + 0.0) / 2)
    assert sc.ACC == 1.0


def test_multiclass_state_additive_and_serialisable():
    rng = np.random.default_rng(0)
    states = [hungarian_state(rng.integers(0, 5, (6, 6)), rng.integers(0, 4, (6, 6)), 4) for _ in range(4)]
    whole = total(states, MulticlassState.zero(4))
    assert total(states[:1], MulticlassState.zero(4)) + total(states[1:], MulticlassState.zero(4)) == whole
    assert state_from_dict(whole.to_dict()) == whole
    with pytest.raises(ValueError, match="classes"):
        whole + MulticlassState.zero(3)


def test_hungarian_rejects_negative_segments():
    with pytest.raises(ValueError, match="non-negative"):
        hungarian_state(np.array([-1, 0]), np.array([0, 1]), 2)


# ------------------------------------------------------------------ bootstrap intervals


def _random_binary_states(rng, n):
    out = []
    for _ in range(n):
        labeled = int(rng.integers(50, 200))
        inter = [int(rng.integers(0, 40)), int(rng.integers(0, 40))]
        union = [i + int(rng.integers(0, 30)) for i in inter]
        if rng.random() < 0.2:
            inter[1], union[1] = 0, 0  # an image with no foreground at all
        out.append(BinaryState(correct=int(rng.integers(0, labeled + 1)), labeled=labeled, inter=inter,
                               union=union, ap_sum=float(rng.random()), images=1))
    return out


def _random_multiclass_states(rng, n, k=4):
    out = []
    for _ in range(n):
        present = rng.random(k) < 0.6  # classes absent from an image add nothing
        tp = np.where(present, rng.integers(0, 50, k), 0)
        fp = np.where(present, rng.integers(0, 20, k), 0)
        fn = np.where(present, rng.integers(0, 20, k), 0)
        out.append(MulticlassState(tp=tp.tolist(), fp=fp.tolist(), fn=fn.tolist(),
                                   labeled=int(tp.sum() + fn.sum()), images=1, regions=3))
    return out


@pytest.mark.parametrize("kind", ["binary", "multiclass"])
def test_bootstrap_draws_are_the_scores_of_resampled_sets(kind):
    """Every resample's scores equal ``scores()`` of the summed states of the drawn images
    (each drawn as often as the draw says), so the intervals use the set-level definitions."""
    rng = np.random.default_rng(3)
    states = _random_binary_states(rng, 9) if kind == "binary" else _random_multiclass_states(rng, 9)
    empty = BinaryState() if kind == "binary" else MulticlassState.zero(4)
    boot = bootstrap({"m": states}, reps=25, seed=7)
    counts = resample_counts(9, 25, seed=7).astype(int)  # the draws bootstrap made
    assert counts.shape == (25, 9) and (counts.sum(1) == 9).all() and len(np.unique(counts, axis=0)) > 20
    for r, row in enumerate(counts):
        sc = total((s for s, c in zip(states, row) for _ in range(c)), empty).scores()
        acc = sc.pixAcc if kind == "binary" else sc.ACC
        assert boot.draws["m"]["pixAcc"][r] == pytest.approx(acc, abs=1e-12)
        assert boot.draws["m"]["mIoU"][r] == pytest.approx(sc.mIoU, abs=1e-12)
        if kind == "binary":
            assert boot.draws["m"]["mAP"][r] == pytest.approx(sc.mAP, abs=1e-12)
    # the whole set (every image once) through the same summed rows
    from segment.eval.metrics import _additive, _headline

    k, v = _additive(states)
    assert _headline(k, v.sum(0))["mIoU"] == total(states, empty).scores().mIoU


def test_bootstrap_interval_of_a_known_binomial():
    """Images that are all right or all wrong (100 pixels each), 30 of 100 right: a
    resample's pixAcc is Binomial(100, 0.3) / 100, whose 2.5% and 97.5% quantiles are 0.21
    and 0.39."""
    right = BinaryState(correct=100, labeled=100, inter=[50, 50], union=[50, 50], ap_sum=1.0, images=1)
    wrong = BinaryState(correct=0, labeled=100, inter=[0, 0], union=[100, 100], ap_sum=0.0, images=1)
    states = [right] * 30 + [wrong] * 70
    boot = bootstrap({"m": states}, reps=20000, seed=0)
    lo, hi = boot.interval("m", "pixAcc")
    assert lo == pytest.approx(0.21, abs=0.0051) and hi == pytest.approx(0.39, abs=0.0051)
    assert boot.interval("m", "mAP") == pytest.approx((lo, hi), abs=1e-12)  # AP 1 / 0 per image


def test_bootstrap_paired_differences():
    rng = np.random.default_rng(0)
    a = _random_multiclass_states(rng, 30)
    better = [MulticlassState(tp=[t + 5 for t in s.tp], fp=s.fp, fn=[max(f - 5, 0) for f in s.fn],
                              labeled=s.labeled, images=1, regions=s.regions) for s in a]
    boot = bootstrap({"a": a, "a_again": a, "better": better}, reps=500, seed=1)
    assert boot.difference("a_again", "a", "mIoU") == (0.0, 0.0)  # paired: the same draws
    lo, hi = boot.difference("better", "a", "mIoU")
    assert 0 < lo <= hi  # better on every image: better on every resample
    # identical images: no spread at all
    same = bootstrap({"m": [a[0]] * 12}, reps=50)
    lo, hi = same.interval("m", "mIoU")
    assert lo == pytest.approx(hi) == pytest.approx(a[0].scores().mIoU)
    # the same seed gives the same intervals; another seed other ones
    again = bootstrap({"a": a, "better": better}, reps=500, seed=1)
    assert again.interval("a", "mIoU") == boot.interval("a", "mIoU")
    assert bootstrap({"a": a}, reps=500, seed=2).interval("a", "mIoU") != boot.interval("a", "mIoU")


def test_bootstrap_rejects_bad_input():
    st = _random_binary_states(np.random.default_rng(0), 3)
    with pytest.raises(ValueError, match="reps"):
        bootstrap({"m": st}, reps=0)
    with pytest.raises(ValueError, match="level"):
        bootstrap({"m": st}, level=1.0)
    with pytest.raises(ValueError, match="same images"):
        bootstrap({"m": st, "n": st[:2]})
    with pytest.raises(ValueError, match="binary or all multi-class"):
        bootstrap({"m": [st[0], MulticlassState.zero(2)]})
    with pytest.raises(ValueError, match="no states"):
        bootstrap({"m": []})


# ------------------------------------------------------------------ regions (BSDS)


def test_multiclass_regions_median_and_small_share():
    # 10 x 20 image: one segment of 199 pixels and one of 1 pixel (0.5% < 1% of the image)
    pred = np.zeros((10, 20), int)
    pred[0, 0] = 4
    a = hungarian_state(pred, np.zeros((10, 20), int), 2)
    assert a.region_counts == [2] and a.small_px == 1 and a.pixels == 200
    # exactly 1% is not under 1%
    pred = np.zeros((10, 10), int)
    pred[0, 0] = 4
    assert hungarian_state(pred, np.zeros((10, 10), int), 2).small_px == 0
    # a second image with 4 segments of 25 pixels (none small)
    b = hungarian_state(np.arange(100).reshape(10, 10) // 25, np.zeros((10, 10), int), 2)
    c = hungarian_state(np.zeros((5, 5), int), np.zeros((5, 5), int), 2)  # 1 region
    sc = (a + b + c).scores()
    assert sc.regions == pytest.approx(7 / 3) and sc.regions_median == 2.0
    assert sc.small_share == pytest.approx(1 / 325)
    assert (a + b).scores().regions_median == 3.0  # median of [2, 4]
    assert sc.percent()["small_px"] == pytest.approx(100 / 325)


def _hand_images():
    """Two images worked out by hand (see test_region_metrics_hand_computed)."""
    pred1 = np.array([[0, 0, 1],
                      [0, 1, 1]])
    g1a = np.array([[1, 1, 1],
                    [2, 2, 2]])
    g1b = np.array([[5, 5, 7],
                    [5, 7, 7]])  # the prediction, renamed
    pred2 = np.array([[3, 3, 3, 3]])
    g2 = np.array([[1, 1, 2, 2]])
    return (pred1, [g1a, g1b]), (pred2, [g2])


def test_region_metrics_hand_computed():
    from segment.eval.metrics import RegionState, region_state

    (p1, gts1), (p2, gts2) = _hand_images()
    # image 1, annotator a: n = [[2, 1], [1, 2]] (rows S0 = {(0,0),(0,1),(1,0)}, S1)
    #   IoU = 2 / (3 + 3 - 2) = 1/2 (diagonal), 1/5 off it: each 3-pixel human region adds
    #   3 * 1/2; RI: disagreeing pairs 9 + 9 - 10 = 8 of 15 -> 7/15;
    #   VI = H(S) + H(G) - 2 I = 1 + 1 - 2 ((2/3) log2(4/3) + (1/3) log2(2/3)) = 2 log2(3) - 4/3
    # annotator b = the prediction renamed: covering 3 + 3, RI 1, VI 0
    s1 = region_state(p1, np.stack(gts1))
    assert s1.covering_num == pytest.approx(3 * 0.5 * 2 + 6) and s1.covering_den == 12
    assert s1.pri_sum == pytest.approx((7 / 15 + 1) / 2)
    assert s1.vi_sum == pytest.approx((2 * np.log2(3) - 4 / 3) / 2)
    # image 2 (1 x 4): one predicted region vs two halves: IoU 1/2 each -> 2 of 4;
    #   RI: a = [4], b = [2, 2], n = [[2, 2]]: disagree 8 + 4 - 8 = 4 of 6 -> 1/3; VI = 0 + 1 - 0
    s2 = region_state(p2, gts2)
    assert s2.covering_num == pytest.approx(2.0) and s2.covering_den == 4
    assert s2.pri_sum == pytest.approx(1 / 3) and s2.vi_sum == pytest.approx(1.0)
    sc = (s1 + s2).scores()
    # Covering is pooled over the regions of all annotators of all images: (9 + 2) / (12 + 4),
    # not the mean of the per-image coverings (9/12 + 2/4) / 2 = 0.625
    assert sc.Covering == pytest.approx(11 / 16)
    assert (s1.scores().Covering + s2.scores().Covering) / 2 == pytest.approx(0.625)
    # PRI and VI: the annotator means, averaged over images
    assert sc.PRI == pytest.approx(((7 / 15 + 1) / 2 + 1 / 3) / 2)
    assert sc.VI == pytest.approx(((2 * np.log2(3) - 4 / 3) / 2 + 1) / 2)
    assert sc.images == 2 and sc.regions_median == 1.5 and sc.regions == 1.5
    whole = s1 + s2
    assert state_from_dict(whole.to_dict()) == whole and isinstance(whole, RegionState)
    # a list of maps is the same as the stacked array; a single (H, W) map is one annotator
    assert region_state(p1, gts1) == s1 and region_state(p2, g2 := gts2[0]) == region_state(p2, g2[None])


def test_region_metrics_human_id_zero_is_not_a_region():
    """regionBench's match_segmentations leaves human id 0 out of the covering (regionprops
    counts ids from 1) while its pixels count in the predicted regions' areas; PRI and VI
    (compare_segmentations) treat 0 as a label like any other."""
    from segment.eval.metrics import region_state

    pred = np.array([[0, 0, 1, 1]])
    gt = np.array([[0, 1, 1, 1]])
    s = region_state(pred, gt)
    # human region 1 = pixels 1..3: IoU with S1 = 2 / (2 + 3 - 2) = 2/3 (best) -> 3 * 2/3 of 3
    assert s.covering_num == pytest.approx(2.0) and s.covering_den == 3
    # RI: a = [2, 2], b = [1, 3], n = [[1, 1], [0, 2]]: disagree 4 + 5 - 6 = 3 of 6
    assert s.pri_sum == pytest.approx(0.5)


def _brute(pred, gts):
    """Pair counting and region loops, no contingency tables."""
    p = pred.ravel()
    num = den = 0.0
    ris, vis = [], []
    for g in gts:
        g = g.ravel()
        for r in np.unique(g):
            if r < 1:
                continue
            rm = g == r
            best = max((rm & (p == s)).sum() / (rm | (p == s)).sum() for s in np.unique(p))
            num += rm.sum() * best
            den += rm.sum()
        agree = total_pairs = 0
        for i, j in itertools.combinations(range(p.size), 2):
            agree += (p[i] == p[j]) == (g[i] == g[j])
            total_pairs += 1
        ris.append(agree / total_pairs)
        # VI = H(S | G) + H(G | S) from the joint frequencies, by dictionary counting
        joint: dict = {}
        for a, b in zip(p.tolist(), g.tolist()):
            joint[(a, b)] = joint.get((a, b), 0) + 1
        ns = {a: (p == a).sum() for a in set(p.tolist())}
        ng = {b: (g == b).sum() for b in set(g.tolist())}
        n = p.size
        vi = -sum(c / n * (np.log2(c / ns[a]) + np.log2(c / ng[b])) for (a, b), c in joint.items())
        vis.append(vi)
    return num, den, float(np.mean(ris)), float(np.mean(vis))


def test_region_metrics_match_brute_force_pair_counting():
    from segment.eval.metrics import region_state

    rng = np.random.default_rng(7)
    for trial in range(6):
        h, w = int(rng.integers(3, 8)), int(rng.integers(3, 8))
        k = int(rng.integers(1, 5))
        pred = rng.integers(0, int(rng.integers(1, 6)), (h, w)) * 10  # sparse, non-contiguous ids
        gts = rng.integers(1, int(rng.integers(2, 6)), (k, h, w))
        if trial == 0:
            gts[0, 0, 0] = 0  # a pixel without a human region
        s = region_state(torch.from_numpy(pred), gts)
        num, den, ri, vi = _brute(pred, gts)
        assert s.covering_num == pytest.approx(num) and s.covering_den == den
        assert s.pri_sum == pytest.approx(ri, abs=1e-12) and s.vi_sum == pytest.approx(vi, abs=1e-9)
        assert s.region_counts == [len(np.unique(pred))]


def test_region_metrics_identities_and_errors():
    from segment.eval.metrics import contingency, rand_index, region_state, variation_of_information

    rng = np.random.default_rng(1)
    g = rng.integers(1, 9, (40, 30))
    perfect = region_state(g * 3 + 100, np.stack([g, g]))  # renamed ids: perfect on every metric
    sc = perfect.scores()
    assert sc.Covering == pytest.approx(1.0) and sc.PRI == pytest.approx(1.0) and sc.VI == pytest.approx(0.0, abs=1e-12)
    # one region against a human segmentation: RI = sum_b C(b, 2) / C(N, 2); VI = H(G)
    one = np.zeros_like(g)
    n, s_ids, g_ids = contingency(one, g)
    b = np.bincount(g.ravel())[1:].astype(float)
    assert n.shape == (1, 8) and list(s_ids) == [0] and list(g_ids) == list(range(1, 9))
    assert rand_index(n) == pytest.approx((b * (b - 1) / 2).sum() / (g.size * (g.size - 1) / 2))
    pg = b / b.sum()
    assert variation_of_information(n) == pytest.approx(-(pg * np.log2(pg)).sum())
    # symmetric in its arguments
    p = rng.integers(0, 5, (40, 30))
    assert rand_index(contingency(p, g)[0]) == pytest.approx(rand_index(contingency(g, p)[0]))
    assert variation_of_information(contingency(p, g)[0]) == pytest.approx(variation_of_information(contingency(g, p)[0]))
    with pytest.raises(ValueError, match=r"\(H, W\) prediction and \(K, H, W\)"):
        region_state(p, g[:, :29])
    with pytest.raises(ValueError, match="differ in size"):
        contingency(p, g[:, :29])


def test_region_bootstrap_recomputes_the_pooled_covering():
    from segment.eval.metrics import RegionState, region_state, resample_counts

    rng = np.random.default_rng(2)
    gts = [rng.integers(1, 4, (3, 9, 12)) for _ in range(5)]
    a = [region_state(rng.integers(0, 3, (9, 12)), g) for g in gts]
    b = [region_state(rng.integers(0, 6, (9, 12)), g) for g in gts]
    boot = bootstrap({"a": a, "b": b}, reps=50, level=0.9, seed=3)
    counts = resample_counts(5, 50, seed=3)
    for r in (0, 17, 49):  # one draw, summed by hand: the pooled ratio of the drawn images
        num = sum(c * s.covering_num for c, s in zip(counts[r], a))
        den = sum(c * s.covering_den for c, s in zip(counts[r], a))
        pri = sum(c * s.pri_sum for c, s in zip(counts[r], a)) / 5
        assert boot.draws["a"]["Covering"][r] == pytest.approx(num / den)
        assert boot.draws["a"]["PRI"][r] == pytest.approx(pri)
    whole = total(a, RegionState()).scores()
    lo, hi = boot.interval("a", "Covering")
    assert lo <= whole.Covering <= hi
    d_lo, d_hi = boot.difference("b", "a", "VI")
    diff = boot.draws["b"]["VI"] - boot.draws["a"]["VI"]
    assert d_lo == pytest.approx(np.percentile(diff, 5)) and d_hi == pytest.approx(np.percentile(diff, 95))
    with pytest.raises(ValueError, match="one kind"):
        bootstrap({"a": [a[0], hungarian_state(np.zeros((2, 2), int), np.zeros((2, 2), int), 2)]})


def test_escape_probabilities_reach_the_region_and_multiclass_rows():
    """Issue 46: the escape probability of every kept region goes into the eval rows. Per
    image the method's ``escape`` list is kept in the state (through the cache's dict), the
    row shows their median pooled over the images; a method without them shows nothing."""
    from segment.core.masks import MethodOutput
    from segment.eval.metrics import MulticlassState, RegionState, total
    from segment.eval.scoring import score_multiclass, score_regions
    from segment.eval.tables import Results, table_row

    labels = torch.tensor([[[0, 0, 1, 1]] * 4, [[0, 1, 2, 2]] * 4])
    fg = torch.ones(2, 3, dtype=torch.bool)
    out = MethodOutput(heatmap=torch.zeros(2, 4, 4), labels=labels, foreground=fg,
                       escape=[torch.tensor([0.10, 0.30]), torch.tensor([0.05, 0.20, 0.40])])
    bare = MethodOutput(heatmap=torch.zeros(2, 4, 4), labels=labels, foreground=fg)
    gts = [torch.zeros(1, 4, 4, dtype=torch.long), torch.zeros(1, 4, 4, dtype=torch.long)]
    states = score_regions(out, gts, "cuts")
    assert [s.escapes for s in states] == [pytest.approx([0.10, 0.30]), pytest.approx([0.05, 0.20, 0.40])]
    whole = total(states, RegionState())
    assert state_from_dict(whole.to_dict()) == whole
    # median of 0.05, 0.10, 0.20, 0.30, 0.40 (pooled, not a median of per-image medians 0.2, 0.2)
    assert whole.scores().escape_median == pytest.approx(0.20)
    legacy = {k: v for k, v in whole.to_dict().items() if k != "escapes"}
    assert state_from_dict(legacy).escapes == []
    none = total(score_regions(bare, gts, "km"), RegionState())
    assert none.escapes == [] and none.scores().escape_median is None
    res = Results("regions", [table_row("cuts", whole), table_row("km", none)])
    md = res.markdown().splitlines()
    assert md[0].split(" | ")[7] == "escape_median"
    assert md[2].split(" | ")[7] == "0.200" and md[3].split(" | ")[7] == "-"
    assert res.csv().splitlines()[2].split(",")[7] == ""
    mc = total(score_multiclass(out, [g[0] for g in gts], 3, "cuts"), MulticlassState.zero(3))
    assert mc.scores().escape_median == pytest.approx(0.20)
    assert table_row("cuts", mc)["escape_median"] == pytest.approx(0.20)
