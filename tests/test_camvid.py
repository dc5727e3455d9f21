"""CamVid (label folders) end to end on the shared camvid-dev split (SEGMENT_SHARED; a few
images): the labels `segment` writes, scored here by an independent few-line Hungarian
implementation, equal the default row of `segment-eval dataset=camvid` for the same settings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_module
from PIL import Image
from scipy.optimize import linear_sum_assignment

from segment.eval.runner import EXIT_OK, run_eval

from conftest import segment_in_process

NAMES = ("0016E5_07959", "0016E5_08085", "0016E5_08151")  # three camvid-dev scenes
VOID = 11


@pytest.fixture(scope="module")
def camvid_three(shared_dir: Path, tmp_path_factory) -> Path:
    src = shared_dir / "data" / "camvid-dev"
    if not (src / "images").is_dir():
        pytest.skip(f"{src} is missing")
    root = tmp_path_factory.mktemp("camvid3")
    for sub in ("images", "labels"):
        (root / sub).mkdir()
        for n in NAMES:
            shutil.copyfile(src / sub / f"{n}.png", root / sub / f"{n}.png")
    return root


def score_folder(pred_dir: Path, gt_dir: Path, k: int = 11) -> dict[str, float]:
    """Protocol §4 written out again: per image, one-to-one matching of segments to classes
    maximising matched pixels; unmatched segments' pixels are false negatives only."""
    tp, fp, fn = np.zeros(k), np.zeros(k), np.zeros(k)
    labelled = regions = 0
    for n in NAMES:
        pred = np.asarray(Image.open(pred_dir / f"{n}.png")).astype(np.int64)
        gt = np.asarray(Image.open(gt_dir / f"{n}.png")).astype(np.int64)
        assert pred.shape == gt.shape
        segs = np.unique(pred)
        regions += len(segs)
        valid = gt != VOID
        # overlap[c, s] = labelled pixels of class c in segment segs[s]
        overlap = np.array([[np.sum(valid & (gt == c) & (pred == s)) for s in segs] for c in range(k)])
        rows, cols = linear_sum_assignment(-overlap)
        tp_img = np.zeros(k)
        for c, s in zip(rows, cols):
            tp_img[c] = overlap[c, s]
            fp[c] += overlap[:, s].sum() - overlap[c, s]
        tp += tp_img
        fn += overlap.sum(1) - tp_img
        labelled += int(valid.sum())
    den = tp + fp + fn
    iou = np.where(den > 0, tp / np.maximum(den, 1), np.nan)
    return {"pixAcc": 100 * tp.sum() / labelled, "mIoU": 100 * np.nanmean(iou), "regions": regions / len(NAMES)}


@pytest.mark.shared
@pytest.mark.slow
def test_segment_labels_score_like_segment_eval(camvid_three, dinov2_weights, tmp_path):
    model = ["model=dinov2_vits14", f"model.checkpoint={dinov2_weights}", "model.image_size=[336,448]",
             "device=cpu"]
    seg_out = tmp_path / "seg"
    # `segment` (in this process, composed as the command composes it); nearest: the rule
    # segment-eval scores with (the default, smooth, is nicer on photos larger than the
    # input and scores a little differently)
    assert segment_in_process(f"input={camvid_three / 'images'}", f"output={seg_out}", *model,
                              "progress=false", "render.fsync=false", "label_upsampling=nearest") == 0
    assert json.loads((seg_out / "run.json").read_text())["counts"]["segmented"] == 3
    outside = score_folder(seg_out / "labels", camvid_three / "labels")

    ev_out = tmp_path / "eval"
    with initialize_config_module("segment.configs", version_base="1.3"):
        cfg = compose("eval", overrides=[*model, "dataset=camvid", f"dataset.root={camvid_three}",
                                         f"output={ev_out}", "panels=0", "progress=false"])
    assert run_eval(cfg) == EXIT_OK
    (row,) = json.loads((ev_out / "results.json").read_text())
    assert row["method"] == "cuts" and row["images"] == 3
    for key in ("pixAcc", "mIoU", "regions"):
        assert row[key] == pytest.approx(outside[key], abs=1e-9), key
    assert row["pixAcc"] > 40 and row["regions"] >= 2  # real segments of road scenes
