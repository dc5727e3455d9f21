"""Every level of the escape cuts as the API returns it (``Result.hierarchy``,
``Result.labels_at``, ``Result.regions_at``) and as ``segment`` writes it
(``hierarchy/<name>.npz``, :mod:`segment.run.job.hierarchy_files`), on the fixed tiny model
of ``tests/test_golden_tiny.py`` (no shared assets)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import segment_in_process
from test_golden import EXAMPLES
from test_golden_tiny import NAMES, WEIGHTS

from segment.run.job import hierarchy_files


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


def test_segment_writes_the_hierarchy_and_it_round_trips(tmp_path, results):
    out = tmp_path / "seg"
    assert segment_in_process(f"output={out}", "model=vit_tiny_random",
                              f"model.checkpoint={WEIGHTS}", "device=cpu",
                              "progress=false") == 0
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
        import segment

        escape = segment.create_method("cuts").escape
        rebuilt = hierarchy_files.mask_at(path, escape)
        assert (rebuilt == mask).mean() > 0.95
        # the record: each label id's token region's height and escape, index-aligned
        rec = json.loads((out / "records" / f"{name}.json").read_text())
        labels = np.asarray(Image.open(out / "labels" / f"{name}.png")).astype(np.int64)
        assert np.array_equal(labels, res.labels)
        assert len(rec["region_height"]) == len(rec["region_escape"]) == labels.max() + 1
        lev = tree.level(escape)
        region = tree.leaf_labels_at(escape).numpy()[leaves]
        for k in range(labels.max() + 1):
            own = region[labels == k]
            if not own.size:
                assert rec["region_height"][k] is None
                continue
            r = np.bincount(own).argmax()
            assert rec["region_height"][k] == round(float(lev.height[r]), 6) < escape
            assert rec["region_escape"][k] == round(float(lev.escape[r]), 6)
        assert len(set(rec["region_escape"])) > 1
    # a method without a tree writes no hierarchy/ (and removes an old one on a redo)
    assert segment_in_process(f"output={out}", "model=vit_tiny_random", "method=regions",
                              f"model.checkpoint={WEIGHTS}", "device=cpu",
                              "progress=false") == 0
    assert not any((out / "hierarchy").glob("*.npz"))
    rec = json.loads((out / "records" / f"{NAMES[0]}.json").read_text())
    assert rec["region_height"] is None and rec["region_escape"] is None
