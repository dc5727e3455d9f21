"""Peer metrics of binary sets (eval/metrics.py, "peer metrics"): per-image fgIoU and pixel
accuracy averaged over images, maxF (F of the image-mean precision and recall, max over 255
thresholds) and maxF_img (TokenCut's max of the image-mean F) against hand-computed cases
and a float64 loop over the thresholds; `segment-eval` on a folder set reports them,
scored at the masks' original resolution with the maps `segment` writes there."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module
from PIL import Image
from segment.eval.metrics import (
    BETA2,
    PEER_BINS,
    BinaryState,
    PeerCurves,
    binary_states,
    bootstrap,
    f_beta,
    peer_curves,
    peer_thresholds,
    state_from_dict,
    total,
)
from segment.eval.runner import EXIT_OK, run_eval

from segment.core.masks import heatmap_at, threshold_mean

# the two hand-worked images: R = [[1, .5], [.25, 0]] (no value on a threshold k / 255)
R = [[1.0, 0.5], [0.25, 0.0]]
GT1, PRED1 = [[1, 0], [1, 0]], [[1, 1], [0, 0]]  # IoU 1/3, acc 1/2
GT2, PRED2 = [[0, 1], [0, 0]], [[0, 1], [0, 0]]  # IoU 1, acc 1


def _f(p, r):
    return (1 + BETA2) * p * r / (BETA2 * p + r) if p + r else 0.0


def _hand_states() -> list[BinaryState]:
    score = torch.tensor([R, R], dtype=torch.float32)
    pred = torch.tensor([PRED1, PRED2], dtype=torch.bool)
    gt = torch.tensor([GT1, GT2], dtype=torch.bool)
    return binary_states(score, pred, gt)


def test_thresholds_are_tokencuts():
    t = peer_thresholds()
    assert t.shape == (PEER_BINS,) == (255,) and t[0] == 0.0 and t[-1] == pytest.approx(254 / 255)
    np.testing.assert_allclose(t, np.arange(0.0, 1.0, 1.0 / 255))


def test_hand_computed_curves():
    """Image 1: thresholds k <= 63 (t < 1/4) keep {1, .5, .25}: P = 2/3, R = 1; 64..127
    keep {1, .5}: P = R = 1/2; 128..254 keep {1}: P = 1, R = 1/2."""
    c = peer_curves(torch.tensor([R, R]), torch.tensor([PRED1, PRED2]).bool(), torch.tensor([GT1, GT2]).bool())
    assert c.precision.shape == c.recall.shape == c.f.shape == (2, 255)
    blocks = (slice(0, 64), slice(64, 128), slice(128, 255))
    for (p1, r1, p2, r2), k in zip([(2 / 3, 1, 1 / 3, 1), (1 / 2, 1 / 2, 1 / 2, 1), (1, 1 / 2, 0, 0)], blocks):
        np.testing.assert_allclose(c.precision[0, k], p1)
        np.testing.assert_allclose(c.recall[0, k], r1)
        np.testing.assert_allclose(c.precision[1, k], p2)
        np.testing.assert_allclose(c.recall[1, k], r2)
        np.testing.assert_allclose(c.f[0, k], _f(p1, r1))
        np.testing.assert_allclose(c.f[1, k], _f(p2, r2))
    np.testing.assert_allclose(c.iou, [1 / 3, 1.0])
    np.testing.assert_allclose(c.acc, [1 / 2, 1.0])


def test_hand_computed_scores():
    """fgIoU (1/3 + 1) / 2; acc (1/2 + 1) / 2; maxF: the image-mean P, R per block are
    (1/2, 1), (1/2, 3/4), (1/2, 1/4), F = 13/23, 13/24, 13/32 -> 13/23; maxF_img: the mean F
    per block (13/18 + 13/33) / 2, (1/2 + 13/23) / 2, 13/32 -> the first. The two differ."""
    sc = total(_hand_states(), BinaryState()).scores()
    assert sc.fgIoU == pytest.approx(2 / 3, abs=1e-12)
    assert sc.acc == pytest.approx(3 / 4, abs=1e-12)
    assert _f(1 / 2, 1) == pytest.approx(13 / 23) and _f(1 / 2, 3 / 4) == pytest.approx(13 / 24)
    assert sc.maxF == pytest.approx(13 / 23, abs=1e-12)
    assert sc.maxF_img == pytest.approx((13 / 18 + 13 / 33) / 2, abs=1e-12)
    assert sc.maxF != pytest.approx(sc.maxF_img, abs=1e-3)
    pct = sc.percent()
    assert pct["maxF"] == pytest.approx(100 * 13 / 23) and pct["acc"] == pytest.approx(75.0)


def test_empty_predictions_and_ground_truths():
    """A constant map predicts nothing at any threshold (R > t is never true at t >= 0):
    precision 0/0 = 1, recall 0 -> F 0; an empty ground truth with an empty mask: IoU 1,
    recall 0/0 = 1, F 1 (TokenCut's conventions)."""
    zero = torch.zeros(1, 3, 3)
    c = peer_curves(zero, zero.bool(), torch.eye(3).bool()[None])
    np.testing.assert_array_equal(c.precision, 1.0)
    np.testing.assert_array_equal(c.recall, 0.0)
    np.testing.assert_array_equal(c.f, 0.0)
    assert c.iou[0] == 0.0 and c.acc[0] == pytest.approx(6 / 9)
    e = peer_curves(zero, zero.bool(), zero.bool())
    assert e.iou[0] == 1.0 and e.acc[0] == 1.0
    np.testing.assert_array_equal(e.f, 1.0)
    assert f_beta(np.array([0.0]), np.array([0.0]))[0] == 0.0


def _loop_reference(score: np.ndarray, pred: np.ndarray, gt: np.ndarray):
    """Float64 per image, per threshold: the definitions written out (TokenCut's metric.py
    conventions for 0/0)."""
    t = np.arange(0.0, 1.0, 1.0 / 255)
    prec = np.zeros((len(score), len(t)))
    rec = np.zeros_like(prec)
    for i in range(len(score)):
        for k, tk in enumerate(t):
            p = score[i] > tk
            tp = (p & gt[i]).sum()
            prec[i, k] = tp / p.sum() if p.sum() else 1.0
            rec[i, k] = tp / gt[i].sum() if gt[i].sum() else 1.0
    def fb(p, r):
        return np.where(BETA2 * p + r > 0, (1 + BETA2) * p * r / np.maximum(BETA2 * p + r, 1e-300), 0.0)

    f = fb(prec, rec)
    union = (pred | gt).sum((1, 2))
    iou = np.where(union > 0, (pred & gt).sum((1, 2)) / np.maximum(union, 1), 1.0)
    acc = (pred == gt).mean((1, 2))
    pm, rm = prec.mean(0), rec.mean(0)
    return prec, rec, iou.mean(), acc.mean(), fb(pm, rm).max(), f.mean(0).max()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_float64_loop_over_thresholds(seed):
    g = torch.Generator().manual_seed(seed)
    score = heatmap_at(torch.rand(5, 4, 6, generator=g), (13, 17))  # min-max, ties on 0 and 1
    gt = torch.rand(5, 13, 17, generator=g) > 0.6
    pred = threshold_mean(score)
    states = binary_states(score, pred, gt)
    c = peer_curves(score, pred, gt)
    prec, rec, iou, acc, max_f, max_f_img = _loop_reference(score.double().numpy(), pred.numpy(), gt.numpy())
    np.testing.assert_allclose(c.precision, prec, atol=1e-12)
    np.testing.assert_allclose(c.recall, rec, atol=1e-12)
    sc = total(states, BinaryState()).scores()
    assert sc.fgIoU == pytest.approx(iou, abs=1e-12) and sc.acc == pytest.approx(acc, abs=1e-12)
    assert sc.maxF == pytest.approx(max_f, abs=1e-12) and sc.maxF_img == pytest.approx(max_f_img, abs=1e-12)


def test_peer_state_is_additive_serialisable_and_bootstrapped():
    g = torch.Generator().manual_seed(3)
    score = torch.rand(6, 5, 5, generator=g)
    states = binary_states(score, score > 0.5, torch.rand(6, 5, 5, generator=g) > 0.5)
    whole = total(states, BinaryState())
    halves = total(states[:2], BinaryState()) + total(states[2:], BinaryState())
    for k in ("fgIoU", "acc", "maxF", "maxF_img"):
        assert getattr(halves.scores(), k) == pytest.approx(getattr(whole.scores(), k), abs=1e-12)
    back = state_from_dict(json.loads(json.dumps(whole.to_dict())))
    assert back.scores() == whole.scores()
    old = whole.to_dict()
    del old["peer"]
    with pytest.raises(ValueError, match="peer metrics"):
        state_from_dict(old)
    bad = whole.to_dict()
    bad["peer"]["f_sum"] = bad["peer"]["f_sum"][:10]
    with pytest.raises(ValueError, match="255 thresholds"):
        state_from_dict(bad)
    boot = bootstrap({"a": states, "b": states[::-1]}, reps=50, seed=0)
    for k in ("fgIoU", "acc", "maxF", "maxF_img"):
        lo, hi = boot.interval("a", k)
        assert 0 <= lo <= getattr(whole.scores(), k) + 1e-9 and lo <= hi <= 1
    # every draw's scores come from the same definition: a draw of all images once = whole
    from segment.eval.metrics import _additive, _headline

    kind, v = _additive(states)
    head = _headline(kind, v.sum(0))
    for k in ("fgIoU", "acc", "maxF", "maxF_img"):
        assert head[k] == pytest.approx(getattr(whole.scores(), k), abs=1e-12)


def test_peer_curves_stack_rows_and_errors():
    c = peer_curves(torch.tensor([R, R]), torch.tensor([PRED1, PRED2]).bool(), torch.tensor([GT1, GT2]).bool())
    swapped = PeerCurves.stack([c.rows([1]), c.rows([0])])
    np.testing.assert_array_equal(swapped.iou, c.iou[::-1])
    np.testing.assert_array_equal(swapped.f, c.f[::-1])
    with pytest.raises(ValueError, match="for a batch of 1"):
        binary_states(torch.tensor([R]), torch.tensor([PRED1]).bool(), torch.tensor([GT1]).bool(), c)
    with pytest.raises(ValueError, match=r"\(B, H, W\)"):
        peer_curves(torch.rand(1, 2, 2), torch.rand(1, 2, 3) > 0.5, torch.rand(1, 2, 2) > 0.5)


# ------------------------------------------------------------------------------ segment-eval


def _folder(root: Path) -> Path:
    """Three photos of assorted sizes (not 224) with graded blob masks (0/255 plus a 100
    ring that binarisation at 0.5 drops)."""
    rng = np.random.default_rng(5)
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    for i, (h, w) in enumerate([(30, 41), (37, 26), (45, 45)]):
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        yy, xx = np.mgrid[:h, :w]
        d = (yy - h / 2) ** 2 + (xx - w / 3) ** 2
        mask = np.where(d < 64, 255, np.where(d < 100, 100, 0)).astype(np.uint8)
        img[mask == 255] = (img[mask == 255] // 4 + 180).astype(np.uint8)
        Image.fromarray(img).save(root / "images" / f"im{i}.png")
        Image.fromarray(mask).save(root / "masks" / f"im{i}.png")
    return root


def test_segment_eval_folder_reports_peer_metrics_at_original_resolution(tmp_path, capsys):
    """The rows, CSV and Markdown carry fgIoU / acc / maxF / maxF_img with intervals and
    paired differences; their values equal an independent scoring against the masks read
    at their own size (> 127) with the maps `segment` writes at that size (its
    postprocess: heatmap methods R > mean(R), region methods smooth-upsampled labels)."""
    from segment.datasets.folder import FolderPairs
    from segment.eval.specs import instantiate_method, resolve_methods

    from segment.run.api.render import postprocess

    folder = _folder(tmp_path / "set")
    out = tmp_path / "out"
    with initialize_config_module("segment.configs", version_base="1.3"):
        cfg = compose("eval", overrides=[
            "model=vit_tiny_random", "device=cpu", "progress=false", "num_workers=0", "method=cls_attention",
            f"dataset.root={folder}", f"output={out}", "batch_size=2", "panels=0", "bootstrap=20",
            "methods=[regions]",
        ])
        assert run_eval(cfg) == EXIT_OK
        specs = resolve_methods(cfg)
    printed = capsys.readouterr().out
    assert "| method | pixAcc | mIoU | mIoU_CA | mAP | fgIoU | acc | maxF | maxF_img | images |" in printed
    rows = {r["method"]: r for r in json.loads((out / "results.json").read_text())}
    with open(out / "results.csv") as f:
        got = {r["method"]: r for r in csv.DictReader(f)}
    assert {"fgIoU", "acc", "maxF", "maxF_img", "fgIoU_ci95_low", "delta_maxF"} <= set(got["regions"])
    assert set(rows["regions"]["delta"]) >= {"fgIoU", "acc", "maxF", "maxF_img"}

    from hydra.utils import instantiate

    torch.manual_seed(int(cfg.seed))
    backbone = instantiate(cfg.model, device="cpu")
    ds = FolderPairs(folder)
    for spec in specs:
        method = instantiate_method(spec)
        per = []
        for idx in ([0, 1], [2]):
            items = [ds[i] for i in idx]
            rec = backbone.extract(backbone.collate([s.image for s in items]), method.capture(backbone.num_layers))
            res = method(rec)
            for j, s in enumerate(items):
                native = np.asarray(Image.open(folder / "masks" / f"{s.name}.png")) > 127
                assert s.original is not None and (s.original == native).all() and s.target.shape == (224, 224)
                seg = postprocess(res, j, native.shape)
                per.append((seg.heatmap.astype(np.float64), seg.mask, native))
        # the images differ in size: each scored on its own, then averaged here
        ious, accs, precs, recs, fs = [], [], [], [], []
        for r, m, g in per:
            p_, r_, i_, a_, _, _ = _loop_reference(r[None], m[None], g[None])
            ious.append(i_)
            accs.append(a_)
            precs.append(p_[0])
            recs.append(r_[0])
            fs.append(f_beta(p_[0], r_[0]))
        pm, rm = np.mean(precs, 0), np.mean(recs, 0)
        row = rows[spec.label]
        assert row["fgIoU"] == pytest.approx(100 * np.mean(ious), abs=1e-6), spec.label
        assert row["acc"] == pytest.approx(100 * np.mean(accs), abs=1e-6), spec.label
        assert row["maxF"] == pytest.approx(100 * f_beta(pm, rm).max(), abs=1e-6), spec.label
        assert row["maxF_img"] == pytest.approx(100 * np.mean(fs, 0).max(), abs=1e-6), spec.label
        assert float(got[spec.label]["maxF"]) == pytest.approx(row["maxF"])


def test_folder_original_is_none_at_native_size(tmp_path):
    from segment.datasets.folder import FolderPairs

    folder = _folder(tmp_path / "set")
    s = FolderPairs(folder, size=None)[0]
    assert s.original is None and s.target.shape == (30, 41)
    t = FolderPairs(folder)[0]
    assert t.original.shape == (30, 41) and t.original.dtype == bool
    assert (t.original == s.target).all()  # binarised at 0.5 at the native size (the 100 ring dropped)
    assert t.original.sum() < (np.asarray(Image.open(folder / "masks" / "im0.png")) > 0).sum()


# ------------------------------------------------------------------------------ tables


def _run(tmp_path: Path, name: str, rows: list[dict]) -> Path:
    (tmp_path / name).mkdir()
    (tmp_path / name / "results.json").write_text(json.dumps(rows))
    return tmp_path / name


def test_ablation_table_verdicts_and_peer_columns(tmp_path):
    from segment.eval import ablation_table

    ci = {"mIoU": [1.0, 2.0]}
    bin_rows = [
        {"method": "base", "pixAcc": 90.0, "mIoU": 80.0, "mAP": 95.0, "fgIoU": 70.0, "acc": 91.0,
         "maxF": 85.0, "maxF_img": 84.0, "ci95": ci},
        {"method": "up", "pixAcc": 91.0, "mIoU": 81.0, "mAP": 95.5, "fgIoU": 71.0, "acc": 92.0, "maxF": 84.0,
         "maxF_img": 83.0, "ci95": ci, "delta": {"vs": "base", "mIoU": [1.0, 0.2, 1.8], "maxF": [-1.0, -2.0, 0.1]}},
        {"method": "down", "pixAcc": 80.0, "mIoU": 70.0, "mAP": 90.0, "fgIoU": 60.0, "acc": 81.0, "maxF": 80.0,
         "maxF_img": 79.0, "ci95": ci, "delta": {"vs": "base", "mIoU": [-10.0, -12.0, -8.0], "maxF": [-5.0, -6.0, -4.0]}},
    ]
    scene_rows = [
        {"method": "base", "pixAcc": 60.0, "mIoU": 39.0, "regions": 43.25, "ci95": ci},
        {"method": "same", "pixAcc": 58.0, "mIoU": 39.1, "regions": 52.0, "ci95": ci,
         "delta": {"vs": "base", "mIoU": [0.1, -0.6, 0.7]}},
    ]
    pre = tmp_path / "pre.md"
    pre.write_text("# Claims\n\ncommands here\n")
    assert ablation_table.main([f"b={_run(tmp_path, 'b', bin_rows)}", f"s={_run(tmp_path, 's', scene_rows)}",
                                "--out", str(tmp_path / "t"), "--preamble", str(pre)]) == 0
    md = (tmp_path / "t.md").read_text()
    assert md.startswith("# Claims\n\ncommands here\n\n| set | method |")
    lines = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| set")]
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    head = ablation_table.HEADER
    col = {h: head.index(h) for h in head}
    assert [c[col["mIoU verdict"]] for c in cells] == ["-", "helps", "hurts", "-", "within noise"]
    assert [c[col["maxF verdict"]] for c in cells] == ["-", "within noise", "hurts", "", ""]
    assert cells[1][col["ΔmIoU (95% CI)"]] == "+1.00 (+0.20, +1.80)"
    assert cells[2][col["maxF"]] == "80.00" and cells[4][col["regions/img"]] == "52.0" and cells[4][col["maxF"]] == ""
    with open(tmp_path / "t.csv") as f:
        assert len(list(csv.reader(f))) == 6
    del bin_rows[0]["ci95"]
    with pytest.raises(SystemExit, match="no bootstrap intervals"):
        ablation_table.main([f"b={_run(tmp_path, 'b2', bin_rows)}", "--out", str(tmp_path / "u")])


def test_sweep_table_shows_peer_columns_of_binary_runs(tmp_path):
    from segment.eval import sweep_table

    ref = tmp_path / "REF.md"
    ref.write_text("| method | mIoU | mAP |\n|---|---|---|\n| a | 70.00 | 90.00 |\n")
    rows = [{"method": "x", "pixAcc": 90, "mIoU": 75.0, "mAP": 91.0, "fgIoU": 66.6, "maxF": 88.8}]
    old = [{"method": "x", "pixAcc": 90, "mIoU": 75.0, "mAP": 91.0}]
    assert sweep_table.main([f"p={_run(tmp_path, 'p', rows)}:{ref}", f"o={_run(tmp_path, 'o', old)}:{ref}",
                             "--out", str(tmp_path / "t")]) == 0
    header, _, row = (tmp_path / "t.md").read_text().splitlines()[:3]
    h = [c.strip() for c in header.strip("|").split("|")]
    r = [c.strip() for c in row.strip("|").split("|")]
    assert r[h.index("p fgIoU")] == "66.60" and r[h.index("p maxF")] == "88.80"
    assert "o maxF" not in h  # a run without the peer metrics (an older results.json)
