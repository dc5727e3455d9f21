"""segment.eval.hierarchy: hierarchies scored at thresholds (ODS, OIS); segment.eval.ucm2: the ucm2 reader.

Hand-built hierarchies with known answers; every state against the existing metric of the
level computed directly; the bootstrap against resampled sets scored one by one; the ucm2
reading against bwlabel of the doubled grid; REFERENCE.md's gPb-owt-ucm table (shared)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import scipy.io
from segment.eval.hierarchy import (
    BENCH_THRESHOLDS,
    TREE_THRESHOLDS,
    HierarchyLike,
    ImageScores,
    OnLeafMap,
    exact_thresholds,
    hierarchy_table,
    main,
    miou_of_sums,
    score_hierarchies,
    score_image,
    states_at,
)
from segment.eval.metrics import (
    MulticlassState,
    RegionState,
    hungarian_state,
    region_state,
    resample_counts,
    total,
)
from segment.eval.ucm2 import UCM, read_ucm2


class Levels:
    """A hand-built tree: ``partitions[i]`` holds once the ``i`` smallest split heights are
    kept; a split is kept at ``t`` when its height is below ``t`` (the tree's convention)."""

    def __init__(self, heights, partitions):
        self.heights = np.asarray(heights, dtype=np.float64)
        self.partitions = [np.asarray(p) for p in partitions]
        assert len(self.partitions) == len(self.heights) + 1

    def labels_at(self, t):
        return self.partitions[int(np.searchsorted(self.heights, t, side="left"))]


def random_tree(rng, shape=(12, 10), leaves=12, levels=5):
    """A random nested hierarchy: a random finest map, merged step by step (one split per
    height, coarse to fine as t grows)."""
    fine = rng.integers(0, leaves, size=shape)
    parts = [fine]
    groups = np.arange(leaves)
    for _ in range(levels):  # merge two groups per level, going coarser
        ids = np.unique(groups)
        if ids.size < 2:
            break
        a, b = rng.choice(ids, 2, replace=False)
        groups = np.where(groups == b, a, groups)
        parts.append(groups[fine] * 7 + 3)  # other ids than the finest's: any ids are fine
    parts.append(np.zeros(shape, dtype=np.int64))
    parts = parts[::-1]  # root first
    heights = np.sort(rng.choice(np.arange(1, 100), len(parts) - 1, replace=False) * 0.02)
    return Levels(heights, parts)


def random_gts(rng, shape=(12, 10), k=3):
    return np.stack([rng.integers(0 if j == 0 else 1, 4 + j, size=shape) for j in range(k)])  # annotator 0 has id 0


def _close_region(a: RegionState, b: RegionState) -> None:
    assert a.covering_num == pytest.approx(b.covering_num, rel=1e-12)
    assert a.covering_den == b.covering_den
    assert a.pri_sum == pytest.approx(b.pri_sum, rel=1e-12)
    assert a.vi_sum == pytest.approx(b.vi_sum, rel=1e-12, abs=1e-12)
    assert a.region_counts == b.region_counts and a.small_px == b.small_px and a.pixels == b.pixels


# ---------------------------------------------------------------------------------------


def test_every_level_equals_the_metric_of_its_labels():
    rng = np.random.default_rng(0)
    for _ in range(4):
        h = random_tree(rng)
        assert isinstance(h, HierarchyLike)
        gts = random_gts(rng)
        ts = TREE_THRESHOLDS[::3]
        im = score_image(h, gts, ts, "regions")
        for t, st in zip(ts, im.states):
            _close_region(st, region_state(h.labels_at(t), gts))
        cls = rng.integers(0, 5, size=gts.shape[1:])
        cls[0, 0] = 255  # ignored
        mc = score_image(h, cls, ts, "multiclass", num_classes=5)
        for t, st in zip(ts, mc.states):
            ref = hungarian_state(h.labels_at(t), cls, 5)
            assert (st.tp, st.fp, st.fn, st.regions, st.labeled) == (ref.tp, ref.fp, ref.fn, ref.regions, ref.labeled)


def test_levels_that_do_not_nest_are_scored_on_their_own():
    rng = np.random.default_rng(1)
    parts = [rng.integers(0, k, size=(9, 8)) for k in (1, 3, 5, 4)]  # unrelated partitions
    h = Levels([0.5, 1.0, 1.5], parts)
    gts = random_gts(rng, (9, 8))
    im = score_image(h, gts, [0.2, 0.7, 1.2, 1.7], "regions")
    for t, st in zip([0.2, 0.7, 1.2, 1.7], im.states):
        _close_region(st, region_state(h.labels_at(t), gts))


def test_exact_thresholds_reach_every_partition():
    rng = np.random.default_rng(2)
    h = random_tree(rng)
    seen = {h.labels_at(t).tobytes() for t in exact_thresholds(h.heights)}
    assert seen == {p.tobytes() for p in h.partitions}
    assert exact_thresholds([]).tolist() == [0.0]


def test_ois_no_worse_than_ods():
    rng = np.random.default_rng(3)
    images = []
    for i in range(6):  # people who draw each image at another level of its tree
        h = random_tree(rng)
        level = h.partitions[1 + i % (len(h.partitions) - 1)]
        noisy = np.where(rng.random(level.shape) < 0.1, 99, level)
        images.append(score_image(h, np.stack([level + 1, noisy + 1]), TREE_THRESHOLDS))
    res = hierarchy_table({"m": images}, reps=50)
    ods, ois, exact = res.row("m", "ODS"), res.row("m", "OIS"), res.row("m", "OIS exact")
    assert ois["Covering"] >= ods["Covering"] and ois["PRI"] >= ods["PRI"] and ois["VI"] <= ods["VI"]
    # the grid's partitions are among the exact ones
    assert exact["Covering"] >= ois["Covering"] - 1e-12 and exact["PRI"] >= ois["PRI"] - 1e-12
    assert exact["VI"] <= ois["VI"] + 1e-12
    # strictly better somewhere on random trees (the test can fail)
    assert ois["Covering"] > ods["Covering"] or ois["VI"] < ods["VI"]


def test_one_level_hierarchy_scores_its_partition():
    rng = np.random.default_rng(4)
    parts = [rng.integers(0, 4, size=(10, 9)) for _ in range(3)]
    gts = [random_gts(rng, (10, 9)) for _ in range(3)]
    hs = [Levels([], [p]) for p in parts]
    res = score_hierarchies(hs, gts, TREE_THRESHOLDS, label="flat", reps=0)
    ref = total([region_state(p, g) for p, g in zip(parts, gts)], RegionState()).scores()
    for level in ("ODS", "OIS", "OIS exact"):
        row = res.row("flat", level)
        assert row["Covering"] == pytest.approx(ref.Covering, rel=1e-12)
        assert row["PRI"] == pytest.approx(ref.PRI, rel=1e-12)
        assert row["VI"] == pytest.approx(ref.VI, rel=1e-12)
    assert res.row("flat", "ODS")["Covering_t"] == TREE_THRESHOLDS[0]  # the first of equals


def _two_scale():
    """4 quadrants (split at height 0.3), each in 4 blocks (split at 0.7)."""
    y, x = np.mgrid[:16, :16]
    quads = (y // 8) * 2 + x // 8
    blocks = (y // 4) * 4 + x // 4
    return Levels([0.3, 0.7], [np.zeros((16, 16), int), quads, blocks]), quads, blocks


def test_planted_two_scales_peak_at_their_threshold():
    h, quads, blocks = _two_scale()
    for gt, best in ((quads + 1, 0.32), (blocks + 1, 0.72)):
        gts = np.stack([gt, gt])
        res = score_hierarchies([h], [gts], TREE_THRESHOLDS, reps=0)
        ods = res.row("hierarchy", "ODS")
        assert ods["Covering"] == pytest.approx(1.0) and ods["PRI"] == pytest.approx(1.0)
        assert ods["VI"] == pytest.approx(0.0, abs=1e-12)
        assert ods["Covering_t"] == ods["PRI_t"] == ods["VI_t"] == best
        curve = [c for c in res.curves]
        assert [c["threshold"] for c in curve] == TREE_THRESHOLDS.tolist()
        assert {c["regions_median"] for c in curve if c["threshold"] <= 0.3} == {1.0}
        assert {c["regions_median"] for c in curve if 0.3 < c["threshold"] <= 0.7} == {4.0}
        assert {c["regions_median"] for c in curve if c["threshold"] > 0.7} == {16.0}


def test_default_level_is_the_flat_metric_with_its_interval():
    rng = np.random.default_rng(5)
    images = [score_image(random_tree(rng), random_gts(rng), TREE_THRESHOLDS) for _ in range(5)]
    res = hierarchy_table({"m": images}, default=0.5, reps=100, seed=3)
    row = res.row("m", "default")
    from segment.eval.tables import results_table

    flat = results_table("regions", [("m", states_at(images, 0.5))], reps=100, seed=3).rows[0]
    for s in ("Covering", "PRI", "VI"):
        assert row[s] == pytest.approx(flat[s], rel=1e-12)
        assert row["ci95"][s] == pytest.approx(flat["ci95"][s], abs=2e-6)  # the table rounds to 1e-6
        assert row[f"{s}_t"] == 0.5
    with pytest.raises(ValueError, match="not among the thresholds"):
        hierarchy_table({"m": images}, default=0.51)


def test_bootstrap_draws_pick_the_ods_threshold_again():
    rng = np.random.default_rng(6)
    images = [score_image(random_tree(rng), random_gts(rng), TREE_THRESHOLDS[::5]) for _ in range(4)]
    reps, seed = 40, 7
    res = hierarchy_table({"m": images}, reps=reps, seed=seed)
    counts = resample_counts(len(images), reps, seed).astype(int)
    by = {"ODS": {s: [] for s in ("Covering", "PRI", "VI")}, "OIS": {s: [] for s in ("Covering", "PRI", "VI")}}
    ts = []
    for c in counts:  # each draw scored as a set of its own, images repeated
        drawn = [im for im, k in zip(images, c) for _ in range(k)]
        one = hierarchy_table({"m": drawn}, reps=0)
        for level in by:
            for s in by[level]:
                by[level][s].append(one.row("m", level)[s])
        ts.append(one.row("m", "ODS")["Covering_t"])
    for level in by:
        for s, v in by[level].items():
            assert res.row("m", level)["ci95"][s] == pytest.approx(np.percentile(v, [2.5, 97.5]).tolist(), rel=1e-9)
    assert res.row("m", "ODS")["t_ci95"]["Covering"] == pytest.approx(np.percentile(ts, [2.5, 97.5]).tolist())


def test_multiclass_ods_is_the_best_threshold_of_the_summed_mIoU():
    rng = np.random.default_rng(7)
    hs = [random_tree(rng) for _ in range(4)]
    cls = [rng.integers(0, 4, size=(12, 10)) for _ in range(4)]
    ts = TREE_THRESHOLDS[::4]
    res = score_hierarchies(hs, cls, ts, task="multiclass", num_classes=4, reps=30, default=ts[3])
    direct = [total([hungarian_state(h.labels_at(t), c, 4) for h, c in zip(hs, cls)], MulticlassState.zero(4)).scores()
              for t in ts]
    miou = [d.mIoU for d in direct]
    ods = res.row("hierarchy", "ODS")
    assert ods["mIoU"] == pytest.approx(100 * max(miou)) and ods["mIoU_t"] == ts[int(np.argmax(miou))]
    assert ods["pixAcc"] == pytest.approx(100 * direct[int(np.argmax(miou))].ACC)
    assert res.row("hierarchy", "default")["mIoU"] == pytest.approx(100 * miou[3])
    assert [r["level"] for r in res.rows] == ["default", "ODS"]  # no OIS on multi-class sets
    # the vectorised mIoU of the draws is the states' own
    st = MulticlassState(tp=[3, 0, 0, 2], fp=[1, 0, 4, 0], fn=[0, 0, 1, 5])
    assert float(miou_of_sums(np.array(st.tp), np.array(st.fp), np.array(st.fn))) == pytest.approx(st.scores().mIoU)
    assert float(miou_of_sums(np.zeros(3), np.zeros(3), np.zeros(3))) == 0.0


def test_image_scores_round_trip_and_files(tmp_path):
    rng = np.random.default_rng(8)
    images = [score_image(random_tree(rng), random_gts(rng), TREE_THRESHOLDS) for _ in range(3)]
    back = [ImageScores.from_dict(im.to_dict()) for im in images]
    a, b = hierarchy_table({"m": images}, reps=20), hierarchy_table({"m": back}, reps=20)
    assert a.rows == b.rows
    a.write(tmp_path, title="t")
    lines = (tmp_path / "curves.csv").read_text().splitlines()
    assert lines[0] == "method,threshold,Covering,PRI,VI,regions_median,regions" and len(lines) == 101
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    md = (tmp_path / "hierarchy.md").read_text()
    assert "| m | ODS |" in md and "| m | OIS exact |" in md
    with pytest.raises(ValueError, match="same thresholds"):
        hierarchy_table({"m": [images[0], score_image(random_tree(rng), random_gts(rng), [0.5])]})


class LeafTree:
    """The tree's side of :class:`OnLeafMap`: torch ``heights`` and per-leaf labels."""

    def __init__(self, levels: Levels):
        import torch

        self.levels = levels
        self.heights = torch.tensor(levels.heights)

    def leaf_labels_at(self, t):
        import torch

        return torch.from_numpy(self.levels.labels_at(t))


def test_tree_levels_on_a_leaf_map():
    rng = np.random.default_rng(12)
    leaf_tree = random_tree(rng, shape=(12,), leaves=12)  # levels over 12 leaves
    leaves = np.kron(rng.integers(0, 12, size=(6, 5)), np.ones((3, 3), dtype=np.int64))  # (18, 15) pixels
    h = OnLeafMap(LeafTree(leaf_tree), leaves)
    assert isinstance(h, HierarchyLike) and h.heights.dtype == np.float64
    gts = random_gts(rng, (18, 15))
    im = score_image(h, gts, TREE_THRESHOLDS[::4])
    for t, st in zip(TREE_THRESHOLDS[::4], im.states):
        ref = region_state(leaf_tree.labels_at(t)[leaves], gts)
        _close_region(st, ref)
    with pytest.raises(ValueError, match="leaf ids"):
        OnLeafMap(LeafTree(leaf_tree), np.zeros(5, dtype=int))
    with pytest.raises(ValueError, match="gives 12 leaves"):
        OnLeafMap(LeafTree(leaf_tree), leaves + 1).labels_at(1.0)


def test_labels_of_the_wrong_size_are_refused():
    h = Levels([], [np.zeros((4, 4), int)])
    with pytest.raises(ValueError, match="ground truth's size"):
        score_image(h, np.ones((2, 5, 5), int), [0.5])


# ---------------------------------------------------------------------------------------
# ucm2


def random_ucm2(rng, h=9, w=11):
    u = rng.choice([0.0, 0.1, 0.25, 0.4, 0.7, 0.9], size=(2 * h + 1, 2 * w + 1), p=[0.3, 0.1, 0.2, 0.1, 0.2, 0.1])
    u[1::2, 1::2] = 0
    return u


def _same_partition(a, b):
    pairs = np.unique(np.stack([a.ravel(), b.ravel()]), axis=1)
    return pairs.shape[1] == np.unique(a).size == np.unique(b).size


def test_ucm_labels_equal_bwlabel_of_the_doubled_grid():
    rng = np.random.default_rng(9)
    for _ in range(20):
        u = UCM(random_ucm2(rng))
        for t in [-1.0, *u.heights, *(u.heights + 0.05), *BENCH_THRESHOLDS[::7]]:
            assert _same_partition(u.labels_at(t), u.labels_at_bwlabel(t)), t


def test_ucm_diagonal_junction_joins_pixels():
    # 2 x 2 pixels, every boundary high, only the centre junction low: bwlabel (8-connected)
    # joins all four through it
    u = np.ones((5, 5))
    u[1::2, 1::2] = 0
    u[2, 2] = 0.1
    lab = UCM(u).labels_at(0.2)
    assert np.unique(lab).size == 1 and np.unique(UCM(u).labels_at(0.05)).size == 4


def test_ucm_format_is_checked(tmp_path):
    with pytest.raises(ValueError, match="doubled grid"):
        UCM(np.zeros((4, 5)))
    u = np.zeros((5, 5))
    u[1, 1] = 0.5
    with pytest.raises(ValueError, match="must be 0"):
        UCM(u)
    scipy.io.savemat(tmp_path / "x.mat", {"segs": np.zeros(3)})
    with pytest.raises(ValueError, match="expected a variable ucm2"):
        read_ucm2(tmp_path / "x.mat")


def test_read_ucm2_v73(tmp_path):
    import h5py

    u = random_ucm2(np.random.default_rng(10), 3, 4)
    p = tmp_path / "v73.mat"
    with h5py.File(p, "w", userblock_size=512) as f:
        f["ucm2"] = u.T  # MATLAB stores columns first
    with open(p, "r+b") as f:
        f.write(b"MATLAB 7.3 MAT-file".ljust(116, b" ") + b"\x00" * 8 + b"\x00\x02" + b"IM")
    np.testing.assert_array_equal(read_ucm2(p).ucm2, u)


def test_ucm2_command_on_a_small_folder(tmp_path, capsys):
    rng = np.random.default_rng(11)
    for split in ("val",):
        (tmp_path / "ucm2" / split).mkdir(parents=True)
        (tmp_path / "groundTruth" / split).mkdir(parents=True)
        for i in range(3):
            u = random_ucm2(rng, 6, 8)
            scipy.io.savemat(tmp_path / "ucm2" / split / f"{i}.mat", {"ucm2": u})
            gt = np.empty((1, 2), dtype=object)
            for k in range(2):
                gt[0, k] = {"Segmentation": rng.integers(1, 4, size=(6, 8)).astype(np.uint16),
                            "Boundaries": np.zeros((6, 8), dtype=bool)}
            scipy.io.savemat(tmp_path / "groundTruth" / split / f"{i}.mat", {"groundTruth": gt})
    out = tmp_path / "out"
    assert main(["ucm2", str(tmp_path), "--reps", "20", "--out", str(out), "--exact"]) == 0
    printed = capsys.readouterr().out
    assert "| gPb-owt-ucm | ODS |" in printed and "| gPb-owt-ucm | OIS exact |" in printed
    assert len((out / "curves.csv").read_text().splitlines()) == 100
    assert main(["ucm2", str(tmp_path / "nothing")]) == 2


# ---------------------------------------------------------------------------------------
# REFERENCE.md: gPb-owt-ucm on bsds-dev val


def _reference_table(text: str) -> dict[str, list[float]]:
    """``{"ODS": [Cov, t, PRI, t, VI, t], "OIS": [Cov, PRI, VI]}`` from REFERENCE.md's table."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\|\s*(ODS \(threshold\)|OIS)\s*\|(.*)\|\s*$", line)
        if m:
            rows[m.group(1).split()[0]] = [float(x) for x in re.findall(r"\d+\.\d+", m.group(2))]
    return rows


@pytest.mark.shared
@pytest.mark.slow
def test_reproduces_reference_gpb_owt_ucm_val(shared_dir: Path):
    root = shared_dir / "data" / "bsds-dev"
    if not (root / "ucm2" / "val").is_dir():
        pytest.skip(f"{root / 'ucm2' / 'val'} is missing")
    ref = _reference_table((root / "REFERENCE.md").read_text())
    assert len(ref["ODS"]) == 6 and len(ref["OIS"]) == 3, ref
    from segment.eval.hierarchy import score_ucm2_folder

    res = score_ucm2_folder(root, "val", reps=0)
    ods, ois = res.row("gPb-owt-ucm", "ODS"), res.row("gPb-owt-ucm", "OIS")
    assert ods["images"] == 100
    # REFERENCE.md: "reproduces ... to the fourth decimal": within half a unit of it
    for i, s in enumerate(("Covering", "PRI", "VI")):
        assert ods[s] == pytest.approx(ref["ODS"][2 * i], abs=5e-5), s
        assert ods[f"{s}_t"] == pytest.approx(ref["ODS"][2 * i + 1], abs=1e-9), s
        assert ois[s] == pytest.approx(ref["OIS"][i], abs=5e-5), s


# --------------------------------------------------------------------------- segment-eval


def test_segment_eval_scores_every_level_of_cuts_from_one_pass(tmp_path):
    """method=cuts on BSDS (the tiny ViT): besides its row, segment-eval writes hierarchy/
    (table, curves) from the same pass; the default level is the tree's level at escape on
    the leaf map brought to the photo as segment brings labels there (Hierarchy.pixel_labels_at,
    computed here by hand), ODS is the best threshold of the curve, OIS no worse; a rerun
    takes every image from the metric cache."""
    import csv as _csv
    import json

    from test_eval import TINY, _bsds, cfg_for

    from segment.core.masks import labels_at
    from segment.datasets.bsds import BSDS500
    from segment.eval.runner import EXIT_OK, run_eval
    from segment.eval.specs import instantiate_method, resolve_methods

    root = _bsds(tmp_path / "bsds")
    out = tmp_path / "out"
    cfg = cfg_for(*TINY, "method=cuts", "dataset=bsds", f"dataset.root={root}", "model.image_size=[56,84]",
                  "model.match_orientation=true", "batch_size=4", f"output={out}", "panels=0", "bootstrap=50")
    assert run_eval(cfg) == EXIT_OK
    got = json.loads((out / "hierarchy" / "hierarchy.json").read_text())
    rows = {r["level"]: r for r in got["rows"]}
    assert set(rows) == {"default", "ODS", "OIS", "OIS exact"} and rows["default"]["Covering_t"] == 0.5
    for name in ("hierarchy.csv", "hierarchy.md", "curves.csv", "curves.png"):
        assert (out / "hierarchy" / name).is_file(), name
    # the default level by hand: the method's tree at escape on its leaf map at the photo's size
    from segment.models.base import Backbone  # noqa: F401

    from hydra.utils import instantiate

    model = instantiate(cfg.model, device="cpu")
    method = instantiate_method(resolve_methods(cfg)[0])
    ds = BSDS500(root)
    states = []
    for i in range(len(ds)):
        s = ds[i]
        o = method(model.extract(model.collate([s.image]), method.capture(model.num_layers)))
        leaves = labels_at(o.leaves, s.target.shape[1:], "smooth")[0]
        states.append(region_state(o.hierarchy[0].pixel_labels_at(leaves, 0.5).numpy(), s.target))
    want = total(states, RegionState()).scores()
    assert rows["default"]["Covering"] == pytest.approx(want.Covering)
    assert rows["default"]["PRI"] == pytest.approx(want.PRI) and rows["default"]["VI"] == pytest.approx(want.VI)
    curve = list(_csv.DictReader((out / "hierarchy" / "curves.csv").read_text().splitlines()))
    assert len(curve) == len(TREE_THRESHOLDS)
    best = max(curve, key=lambda c: float(c["Covering"]))
    assert rows["ODS"]["Covering"] == pytest.approx(float(best["Covering"]))
    assert rows["ODS"]["Covering"] >= rows["default"]["Covering"] - 1e-12
    assert rows["OIS"]["Covering"] >= rows["ODS"]["Covering"] - 1e-12
    assert rows["OIS"]["VI"] <= rows["ODS"]["VI"] + 1e-12
    lo, hi = rows["ODS"]["ci95"]["Covering"]
    assert lo <= rows["ODS"]["Covering"] + 1e-9 and rows["ODS"]["Covering"] <= hi + 1e-9
    # the rerun: every image's states (the tree's included) from the cache, the same table
    assert run_eval(cfg) == EXIT_OK
    assert json.loads((out / "hierarchy" / "hierarchy.json").read_text()) == got


def _label_folder(root, seed):
    """Three random 30 x 40 photos with 3-class label maps of 10-px blocks (a label folder)."""
    from test_eval import _save_png

    rng = np.random.default_rng(seed)
    for i in range(3):
        _save_png(root / "images" / f"s{i}.png", rng.integers(0, 256, (30, 40, 3), dtype=np.uint8))
        lab = np.repeat(rng.integers(0, 3, (3, 4)), 10, 0).repeat(10, 1).astype(np.uint8)
        _save_png(root / "labels" / f"s{i}.png", lab)
    return root


def test_segment_eval_scores_the_levels_of_cuts_on_a_label_folder(tmp_path):
    """dataset=labels (multi-class): the hierarchy table holds the default level and the ODS
    (mIoU) only, the default level's mIoU that of the tree's level at escape by hand."""
    import json

    from test_eval import TINY, cfg_for

    from segment.core.masks import labels_at
    from segment.eval.runner import EXIT_OK, run_eval
    from segment.eval.specs import instantiate_method, resolve_methods

    root = _label_folder(tmp_path / "set", seed=1)
    out = tmp_path / "out"
    cfg = cfg_for(*TINY, "method=cuts", "dataset=labels", f"dataset.root={root}", "dataset.num_classes=3",
                  "model.image_size=[56,84]", "batch_size=2", f"output={out}", "panels=0", "bootstrap=0")
    assert run_eval(cfg) == EXIT_OK
    rows = {r["level"]: r for r in json.loads((out / "hierarchy" / "hierarchy.json").read_text())["rows"]}
    assert set(rows) == {"default", "ODS"}
    from hydra.utils import instantiate

    from segment.datasets.multiclass import LabelFolder

    model = instantiate(cfg.model, device="cpu")
    method = instantiate_method(resolve_methods(cfg)[0])
    ds = LabelFolder(root, num_classes=3)
    states = []
    for i in range(len(ds)):
        s = ds[i]
        o = method(model.extract(model.collate([s.image]), method.capture(model.num_layers)))
        leaves = labels_at(o.leaves, s.target.shape, "smooth")[0]
        states.append(hungarian_state(o.hierarchy[0].pixel_labels_at(leaves, 0.5).numpy(), s.target, 3))
    summed = total(states[1:], states[0])
    tp, fp, fn = (np.asarray(x) for x in (summed.tp, summed.fp, summed.fn))
    assert rows["default"]["mIoU"] == pytest.approx(100 * float(miou_of_sums(tp, fp, fn)))
    assert rows["ODS"]["mIoU"] >= rows["default"]["mIoU"] - 1e-9


def test_each_cuts_row_reports_the_level_at_its_own_escape(tmp_path):
    """Two `cuts` rows with another `escape` each (one pass): each gets its `default` row at
    its own threshold, equal to its curve's value there; ODS rows for both."""
    import json

    from test_eval import TINY, cfg_for

    from segment.eval.runner import EXIT_OK, run_eval

    root = _label_folder(tmp_path / "set", seed=2)
    out = tmp_path / "out"
    cfg = cfg_for(*TINY, "method=cuts", "methods=[{config:cuts,name:cuts_e0.8,escape:0.8}]",
                  "dataset=labels", f"dataset.root={root}", "dataset.num_classes=3",
                  "model.image_size=[56,84]", "batch_size=3", f"output={out}", "panels=0",
                  "bootstrap=0")
    assert run_eval(cfg) == EXIT_OK
    got = json.loads((out / "hierarchy" / "hierarchy.json").read_text())["rows"]
    rows = {(r["method"], r["level"]): r for r in got}
    assert set(rows) == {(m, lv) for m in ("cuts", "cuts_e0.8") for lv in ("default", "ODS")}
    assert rows["cuts", "default"]["mIoU_t"] == pytest.approx(0.5)
    assert rows["cuts_e0.8", "default"]["mIoU_t"] == pytest.approx(0.8)
