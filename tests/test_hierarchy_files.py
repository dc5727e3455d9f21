"""Every level of the escape cuts as the API returns it (``Result.hierarchy``,
``Result.labels_at``, ``Result.regions_at``, ``Result.region_height`` / ``region_escape``)
and as ``segment`` writes it (``hierarchy/<name>.npz``, each region's ``height`` and
``escape`` in the records, run.json and annotations.json, and the level command of
:mod:`segment.run.job.levels`), on the fixed tiny model of
``tests/test_golden_tiny.py`` (no shared assets)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import segment_in_process
from test_golden import EXAMPLES
from test_golden_tiny import NAMES, WEIGHTS

from segment.run.job import hierarchy_files, levels
from segment.run.job.coco import json_floats

ESCAPE = 0.5  # configs/method/cuts.yaml's escape: the default level (checked below)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """``segment`` with the defaults (method=cuts) on the bundled examples, tiny model."""
    out = tmp_path_factory.mktemp("run") / "seg"
    assert segment_in_process(f"output={out}", "model=vit_tiny_random",
                              f"model.checkpoint={WEIGHTS}", "device=cpu",
                              "progress=false") == 0
    return out


@pytest.fixture(scope="module")
def results():
    import segment

    seg = segment.load("vit_tiny_random", checkpoint=WEIGHTS, device="cpu")
    return seg([EXAMPLES / f"{n}.png" for n in NAMES])


def _thresholds(tree) -> list[float]:
    """Below the root's split, at and between every distinct height, above the last."""
    h = tree.heights.tolist()
    mids = [(a + b) / 2 for a, b in zip(h, h[1:])]
    return sorted({0.0, *h, *mids, h[-1] + 1e-9, 2.5})


def _nests(coarse: np.ndarray, fine: np.ndarray) -> bool:
    """Every region of ``fine`` lies inside one region of ``coarse``."""
    pairs = np.unique(np.stack([fine.ravel(), coarse.ravel()]), axis=1)
    return len(np.unique(pairs[0])) == pairs.shape[1]


def test_levels_nest_at_every_height(results):
    for res in results:
        tree = res.hierarchy
        assert tree is not None and res.leaves.shape == res.size and res.leaves.dtype == np.int32
        ts = _thresholds(tree)
        assert len(tree.heights) >= 3  # the fixture has teeth: several distinct levels
        levels = [res.labels_at(t) for t in ts]
        assert levels[0].max() == 0  # below every height: one region
        assert np.array_equal(levels[-1], tree.leaf_labels_at(3.0).numpy()[res.leaves])
        for t, lab in zip(ts, levels):
            assert lab.shape == res.size and lab.dtype == np.int32
            assert len(np.unique(lab)) <= tree.count_at(t)
        for coarse, fine in zip(levels, levels[1:]):
            assert _nests(coarse, fine)
        counts = [len(np.unique(x)) for x in levels]
        assert counts == sorted(counts) and counts[-1] > counts[0]


def test_labels_at_the_escape_level_is_the_trees_own(results):
    import segment

    escape = segment.create_method("cuts").escape
    for res in results:
        want = res.hierarchy.pixel_labels_at(torch.from_numpy(res.leaves), escape).numpy()
        assert np.array_equal(res.labels_at(escape), want)
        # the token regions at escape hold the default level's components (labels/) on most
        # pixels (the two are upsampled separately: boundary pixels may differ)
        pairs = np.unique(np.stack([res.labels.ravel(), want.ravel()]), axis=1)
        best = {}
        for comp, reg in pairs.T:
            n = int(((res.labels == comp) & (want == reg)).sum())
            best[comp] = max(best.get(comp, 0), n)
        assert sum(best.values()) / res.labels.size > 0.97


def test_regions_at_run_coarse_to_fine(results):
    rng = np.random.default_rng(0)
    for res in results:
        h, w = res.size
        for x, y in zip(rng.integers(0, w, 5), rng.integers(0, h, 5)):
            regions = res.regions_at(int(x), int(y))
            assert regions[0].mask.all() and regions[0].height == 0.0
            assert regions[-1].until == float("inf")
            leaf = res.leaves[y, x]
            assert np.array_equal(regions[-1].mask, res.leaves == leaf)
            for a, b in zip(regions, regions[1:]):
                assert a.until == b.height and a.height < a.until
                assert not (b.mask & ~a.mask).any() and b.mask.sum() < a.mask.sum()
            for r in regions:
                assert r.mask[y, x] and 0.0 <= r.escape <= 1.0
                assert r.escape == float(res.hierarchy.escape[r.node])
                # the region is the pixel's region of the level at any t it lives at
                t = r.height + 1e-12 if np.isinf(r.until) else r.until
                lab = res.labels_at(t)
                assert np.array_equal(r.mask, lab == lab[y, x])
        with pytest.raises(ValueError, match="outside"):
            res.regions_at(w, 0)


def test_methods_without_a_tree_give_none():
    import segment

    seg = segment.load("vit_tiny_random", method="regions", checkpoint=WEIGHTS, device="cpu")
    res = seg(EXAMPLES / "coffee.png")
    assert res.hierarchy is None and res.leaves is None
    with pytest.raises(ValueError, match="no hierarchy"):
        res.labels_at(0.5)


def test_segment_writes_the_hierarchy_and_it_round_trips(run, results):
    import segment

    assert segment.create_method("cuts").escape == ESCAPE
    out = run
    for name, res in zip(NAMES, results):
        path = out / "hierarchy" / f"{name}.npz"
        tree, leaves, share = hierarchy_files.load_hierarchy(path)
        with np.load(path) as z:
            assert z["leaves"].dtype == np.uint16 and z["height"].dtype == np.float64
        assert np.array_equal(leaves, res.leaves)
        for key in ("children", "height", "ncut", "escape"):
            assert torch.equal(getattr(tree, key), getattr(res.hierarchy, key))
        for t in _thresholds(tree):
            assert np.array_equal(hierarchy_files.labels_at(path, t), res.labels_at(t))
        mask = np.asarray(Image.open(out / "masks" / f"{name}.png")) > 0
        # the same arrays give the same bytes (no time stamps: tests/test_golden.py)
        assert hierarchy_files.encode_hierarchy(res.hierarchy, res.leaves, mask) \
            == path.read_bytes()
        size = np.bincount(leaves.ravel(), minlength=tree.num_leaves)
        fg = np.bincount(leaves.ravel(), weights=mask.ravel(), minlength=tree.num_leaves)
        assert np.allclose(share[size > 0], (fg / np.maximum(size, 1))[size > 0])
        # the default level's mask, rebuilt by region majority, is the written one nearly
        assert (hierarchy_files.mask_at(path, ESCAPE) == mask).mean() > 0.95


def test_every_region_carries_its_height_and_escape_aligned_with_the_ids(run, results):
    """records, run.json, annotations.json and Result: one entry per label id of labels/,
    the values of the token region of the default level each id is a piece of."""
    man = json.loads((run / "run.json").read_text())
    entries = {im["name"]: im for im in man["images"]}
    coco = json.loads((run / "annotations.json").read_text())
    image_id = {im["segment_name"]: im["id"] for im in coco["images"]}
    for name, res in zip(NAMES, results):
        labels = np.asarray(Image.open(run / "labels" / f"{name}.png")).astype(np.int64)
        k = int(labels.max()) + 1
        rec = json.loads((run / "records" / f"{name}.json").read_text())
        # one name, one meaning: the token partition's list is gone from the user's outputs
        assert "escape" not in rec and "escape" not in entries[name]
        assert not hasattr(res, "escape")
        assert res.region_height.shape == res.region_escape.shape == (k,)
        assert res.region_height.dtype == np.float64
        for where in (rec, entries[name]):
            assert len(where["region_height"]) == len(where["region_escape"]) == k
            assert where["region_height"] == json_floats(res.region_height)
            assert where["region_escape"] == json_floats(res.region_escape)
        anns = [a for a in coco["annotations"] if a["image_id"] == image_id[name]]
        assert sorted(a["region_id"] for a in anns) == np.unique(labels).tolist()
        for a in anns:
            assert a["height"] == rec["region_height"][a["region_id"]] is not None
            assert a["escape"] == rec["region_escape"][a["region_id"]] is not None
        # an id present in labels/ has both numbers; an absent one (if any) has neither
        present = np.bincount(labels.ravel(), minlength=k) > 0
        assert np.isfinite(res.region_height[present]).all()
        assert np.isnan(res.region_height[~present]).all()
        lev = res.hierarchy.level(ESCAPE)
        assert set(res.region_height[present]) <= set(lev.height.tolist())
        assert (res.region_height[present] < ESCAPE).all()  # each exists at the default level
        assert ((0 <= res.region_escape[present]) & (res.region_escape[present] <= 1)).all()
    # the tiny model's regions have teeth: distinct values, more ids than token regions
    assert any(len(set(r.region_escape.tolist())) > 2 for r in results)


def test_each_component_takes_its_token_regions_values(results):
    """On the method's grid, where every pixel's leaf lies under its token region at escape:
    each label (a connected component, specks absorbed) lies in one token region up to its
    specks, and its values are that region's in the tree's level."""
    import segment

    seg = segment.load("vit_tiny_random", checkpoint=WEIGHTS, device="cpu")
    for name, res in zip(NAMES, results):
        im = Image.open(EXAMPLES / f"{name}.png").convert("RGB")
        batch = seg.forward([seg.preprocess(im)])
        got = seg.postprocess(batch.out, 0, (im.height, im.width))
        tree = batch.out.hierarchy[0]
        lab = batch.out.labels[0].numpy()
        region = tree.pixel_labels_at(batch.out.leaves[0], ESCAPE).numpy()
        lev = tree.level(ESCAPE)
        for k in np.unique(got.labels).tolist():
            own = np.bincount(region[lab == k], minlength=tree.count_at(ESCAPE))
            r = int(own.argmax())
            assert own[r] >= 0.5 * own.sum()  # a piece of one region (specks are smaller)
            assert got.region_height[k] == float(lev.height[r])
            assert got.region_escape[k] == float(lev.escape[r])
            assert lev.height[r] < ESCAPE <= lev.until[r]
        # a batch of one gives what the API's batch gave
        np.testing.assert_array_equal(got.region_escape, res.region_escape)


def _level_png(run: Path, kind: str, t: str, name: str) -> np.ndarray:
    return np.asarray(Image.open(run / f"{kind}_t{t}" / f"{name}.png"))


def test_the_level_command_writes_labels_and_masks_at_any_threshold(run, capsys):
    for t, tag in ((0.3, "0.30"), (ESCAPE, "0.50"), (0.8, "0.80")):
        assert levels.main([str(run), "--t", str(t), "--no-progress"]) == 0
        last = capsys.readouterr().out.strip().splitlines()[-1]
        assert last.startswith(f"3 images at t={t:g} -> {run / f'labels_t{tag}'}")
        for name in NAMES:
            path = run / "hierarchy" / f"{name}.npz"
            labels = Image.open(run / f"labels_t{tag}" / f"{name}.png")
            mask = Image.open(run / f"masks_t{tag}" / f"{name}.png")
            # the formats of labels/ and masks/: an indexed PNG, a 0/255 grey one
            assert labels.mode == Image.open(run / "labels" / f"{name}.png").mode == "P"
            assert mask.mode == Image.open(run / "masks" / f"{name}.png").mode == "L"
            assert np.array_equal(np.asarray(labels), hierarchy_files.labels_at(path, t))
            assert np.array_equal(np.asarray(mask), hierarchy_files.mask_at(path, t) * 255)
    assert not list(run.rglob("*.tmp"))  # atomic writes leave nothing behind
    # t = escape: the token regions of the default level; labels/ splits each into its
    # connected components (specks absorbed into a neighbour), numbered anew, and the two
    # maps are upsampled to the image separately: labels/ is not the level's ids, but every
    # component lies in the level's region whose values its record gives, up to specks and
    # boundary pixels
    for name in NAMES:
        level = _level_png(run, "labels", "0.50", name).astype(np.int64)
        comp = np.asarray(Image.open(run / "labels" / f"{name}.png")).astype(np.int64)
        rec = json.loads((run / "records" / f"{name}.json").read_text())
        tree = hierarchy_files.load_hierarchy(run / "hierarchy" / f"{name}.npz")[0]
        lev = tree.level(ESCAPE)
        r = int(level.max()) + 1
        votes = np.bincount(comp.ravel() * r + level.ravel(),
                            minlength=(comp.max() + 1) * r).reshape(-1, r)
        assert votes.max(1).sum() / comp.size > 0.97
        for k in np.unique(comp).tolist():
            best = int(votes[k].argmax())
            assert rec["region_height"][k] == round(float(lev.height[best]), 6)
            assert rec["region_escape"][k] == round(float(lev.escape[best]), 6)
        masks = np.asarray(Image.open(run / "masks" / f"{name}.png"))
        assert (_level_png(run, "masks", "0.50", name) == masks).mean() > 0.95
    # as a user runs it: python -m, with its progress bar
    r = subprocess.run([sys.executable, "-m", "segment.run.job.levels", str(run),
                        "--t", "0.605"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "3/3" in r.stderr and (run / "labels_t0.605" / f"{NAMES[0]}.png").is_file()


def _one_line_error(capsys, code: int, *args: str) -> str:
    assert levels.main([*args, "--no-progress"]) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(levels.PROG), err
    return err


def test_the_level_command_refuses_what_is_not_a_finished_run_with_a_tree(run, tmp_path,
                                                                         capsys):
    assert "not a folder" in _one_line_error(capsys, 2, str(tmp_path / "nope"), "--t", "0.5")
    assert "no run.json" in _one_line_error(capsys, 2, str(tmp_path), "--t", "0.5")
    (tmp_path / "run.json").write_text("{not json")
    assert "run.json unreadable" in _one_line_error(capsys, 2, str(tmp_path), "--t", "0.5")
    for manifest in ('{"counts": {}}', '{"images": [1]}'):  # JSON, but not a run's manifest
        (tmp_path / "run.json").write_text(manifest)
        assert "run.json unreadable" in _one_line_error(capsys, 2, str(tmp_path), "--t", "0.5")
    for bad in ("x", "nan", "0", "-0.2", "2.5", "inf"):
        assert "t must" in _one_line_error(capsys, 2, str(run), "--t", bad)
    assert "--t" in _one_line_error(capsys, 2, str(run))
    assert not (run / "labels_tnan").exists()
    # a method without a tree: no hierarchy/ (and a redo into a cuts run's folder removes it)
    other = tmp_path / "regions"
    shutil.copytree(run, other)
    assert segment_in_process(f"output={other}", "model=vit_tiny_random", "method=regions",
                              f"model.checkpoint={WEIGHTS}", "device=cpu",
                              "progress=false") == 0
    assert not any((other / "hierarchy").glob("*.npz"))
    rec = json.loads((other / "records" / f"{NAMES[0]}.json").read_text())
    assert rec["region_height"] is None and rec["region_escape"] is None
    coco = json.loads((other / "annotations.json").read_text())
    assert all(a["height"] is None and a["escape"] is None for a in coco["annotations"])
    shutil.rmtree(other / "hierarchy")
    assert "no hierarchy/: method regions" in _one_line_error(capsys, 2, str(other), "--t", "0.5")


def test_the_level_command_goes_on_past_a_corrupt_file(run, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    data = (bad / "hierarchy" / f"{NAMES[0]}.npz").read_bytes()
    (bad / "hierarchy" / f"{NAMES[0]}.npz").write_bytes(data[: len(data) // 2])  # truncated
    (bad / "hierarchy" / f"{NAMES[1]}.npz").unlink()
    assert levels.main([str(bad), "--t", "0.4", "--no-progress"]) == 0
    cap = capsys.readouterr()
    assert f"skipped {NAMES[0]}: " in cap.err and "not a hierarchy file" in cap.err
    assert f"skipped {NAMES[1]}: " in cap.err and "missing" in cap.err
    assert "1 images at t=0.4" in cap.out and "2 skipped" in cap.out
    assert sorted(p.stem for p in (bad / "labels_t0.40").glob("*.png")) == [NAMES[2]]
    assert sorted(p.stem for p in (bad / "masks_t0.40").glob("*.png")) == [NAMES[2]]
    # a file whose arrays do not make a tree is refused with its reason
    path = bad / "hierarchy" / f"{NAMES[2]}.npz"
    with np.load(path) as z:
        arrays = dict(z)
    np.savez(path, **{**arrays, "leaves": arrays["leaves"] + 1000})
    with pytest.raises(ValueError, match="leaves must be"):
        hierarchy_files.load_hierarchy(path)
    # nothing usable: exit 1
    assert levels.main([str(bad), "--t", "0.4", "--no-progress"]) == 1
    assert capsys.readouterr().err.count("skipped") == 3
    # a write the file system refuses stops the batch with one line, exit 1
    (run / "labels_t0.70").write_text("a file where the folder would be")
    try:
        assert "could not write" in _one_line_error(capsys, 1, str(run), "--t", "0.7")
    finally:
        (run / "labels_t0.70").unlink()
