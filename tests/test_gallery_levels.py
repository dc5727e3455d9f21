"""The gallery's scale control (segment.run.job.gallery_levels): the leaf-map code, the data
the page inlines, and the page itself in headless Chromium: the regions it draws at several
thresholds are those of ``hierarchy_files.labels_at`` on the thumbnail, and the values it
shows under the pointer are the Hierarchy's. The runs use the committed tiny weights (as
tests/test_golden_tiny.py), and the Chromium test once more with the real DINOv2 ViT-S/14
when SEGMENT_SHARED is set (marked slow). The Chromium tests are skipped with a reason
without Chromium (`apt-get install chromium`)."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from conftest import segment_in_process
from test_gallery_browser import CHROMIUM, _chromium, probe_result
from test_golden import GOLDEN

from segment.core.hierarchy import Hierarchy
from segment.run.api.render import thumb_shape, thumbnail
from segment.run.job import hierarchy_files
from segment.run.job.gallery import render_gallery
from segment.run.job.gallery_levels import (
    GRID,
    decode_leaf_map,
    encode_leaf_map,
    image_levels,
    thresholds,
)

TINY = GOLDEN / "vit_tiny_fixed.safetensors"


# ----------------------------------------------------------------------------- the code


def _b64(tokens: list[int]) -> str:
    return base64.b64encode(bytes(tokens)).decode()


def test_leaf_map_code_of_hand_built_maps():
    """Runs as the module docstring defines them, token by token."""
    # row 0: two 0s (kind 2, id 0), a 1 (kind 2: the pixel before is 0); rows 1-2: as above
    # but a 2 at (2, 0) (kind 2: the pixel before is 1), then two as above
    m = np.array([[0, 0, 1], [0, 0, 1], [2, 0, 1]])
    assert encode_leaf_map(m) == _b64([3 * 2 + 2, 0, 3 * 1 + 2, 1, 3 * 3, 3 * 1 + 2, 2, 3 * 2])
    # (1, 1) differs from the pixel above but repeats the pixel before it: kind 1
    m = np.array([[0, 1], [0, 0]])
    assert encode_leaf_map(m) == _b64([3 + 2, 0, 3 + 2, 1, 3, 3 + 1])
    # a run of one value across the end of a row is one run
    m = np.array([[0, 1], [1, 1]])
    assert encode_leaf_map(m) == _b64([3 + 2, 0, 3 * 2 + 2, 1, 3])
    # a long run and a large id take several bytes each (LEB128)
    m = np.full((1, 50), 300)
    assert encode_leaf_map(m) == _b64([(152 & 127) | 128, 152 >> 7, (300 & 127) | 128, 300 >> 7])


def _smooth_regions(h: int, w: int, k: int, seed: int) -> np.ndarray:
    """Regions as the gallery sees them: a coarse grid of ids upsampled (nearest) to (h, w)."""
    rng = np.random.default_rng(seed)
    grid = rng.integers(0, k, (max(1, h // 16), max(1, w // 16))).astype(np.uint16)
    return cv2.resize(grid, (w, h), interpolation=cv2.INTER_NEAREST).astype(np.int64)


@pytest.mark.parametrize("leaves", [
    np.zeros((7, 5), np.int64),                                # one run
    np.arange(12).reshape(3, 4),                               # every pixel its own run
    np.random.default_rng(0).integers(0, 70000, (9, 11)),      # ids past 16 bits, noise
    np.random.default_rng(1).integers(0, 3, (1, 40)),          # one row: nothing above
    np.random.default_rng(2).integers(0, 3, (40, 1)),          # one column
    _smooth_regions(192, 256, 40, 3),
    _smooth_regions(256, 171, 300, 4),
], ids=["constant", "distinct", "noise", "row", "column", "regions", "regions-300"])
def test_leaf_map_code_round_trips(leaves):
    code = encode_leaf_map(leaves)
    assert np.array_equal(decode_leaf_map(code, leaves.shape), leaves)


def test_leaf_map_code_is_small_for_regions():
    """Boundaries that move little from row to row cost a few bytes a row: well under the
    run-length code's two bytes per run, and far under a byte per pixel."""
    m = _smooth_regions(256, 256, 40, 5)
    runs = 1 + int((np.diff(m.reshape(-1)) != 0).sum())
    assert len(base64.b64decode(encode_leaf_map(m))) < runs < m.size / 10


def test_leaf_map_decoder_refuses_bad_codes():
    m = _smooth_regions(64, 64, 9, 6)
    code = base64.b64decode(encode_leaf_map(m))
    with pytest.raises(ValueError, match="ends inside a run|bad run"):
        decode_leaf_map(base64.b64encode(code[:-3]).decode(), m.shape)
    with pytest.raises(ValueError, match="past"):
        decode_leaf_map(base64.b64encode(code + bytes([3])).decode(), m.shape)
    with pytest.raises(ValueError, match="bad run"):  # "as above" in the first row
        decode_leaf_map(_b64([3]), (2, 2))
    with pytest.raises(ValueError, match="encode|non-negative"):
        encode_leaf_map(np.array([[0, -1]]))


@pytest.mark.parametrize("h, w, size", [(300, 500, 64), (500, 300, 256), (100, 100, 256),
                                        (257, 256, 256), (3000, 20, 256), (31, 97, 30)])
def test_thumb_shape_is_the_thumbnails(h, w, size):
    assert thumb_shape(h, w, size) == thumbnail(np.zeros((h, w), np.uint8), size).shape


def test_thresholds_hold_the_grid_and_the_default():
    assert GRID[0] == 0.02 and GRID[-1] == 2.0 and len(GRID) == 100
    assert thresholds(0.5) == list(GRID)
    ts = thresholds(0.333)
    assert len(ts) == 101 and 0.333 in ts and ts == sorted(ts)
    assert thresholds(None) == list(GRID)


def test_page_data_is_the_hierarchy_file(tmp_path):
    """The inlined data of a hand-built tree: exact heights, the merge table, the escape
    probabilities to the printed precision, the leaf map shrunk by nearest neighbour."""
    tree = Hierarchy(leaves=torch.arange(4), children=torch.tensor([[0, 1], [2, 3], [4, 5]]),
                     height=torch.tensor([0.6123456789, 0.3, 0.2], dtype=torch.float64),
                     ncut=torch.tensor([0.6, 0.25, 0.2], dtype=torch.float64),
                     escape=torch.tensor([0.1234, 0.2, 0.3, 0.4, 0.05, 0.06, 0.0],
                                         dtype=torch.float64))
    leaves = np.zeros((40, 60), np.int64)
    leaves[:, 30:] = 1
    leaves[20:, :20] = 2
    leaves[25:, 50:] = 3
    path = tmp_path / "x.npz"
    path.write_bytes(hierarchy_files.encode_hierarchy(tree, leaves, leaves > 1))
    d = image_levels(path, (20, 30))
    assert (d["w"], d["h"]) == (30, 20)
    assert d["children"] == [0, 1, 2, 3, 4, 5] and d["height"] == [0.6123456789, 0.3, 0.2]
    assert d["escape"] == [0.123, 0.2, 0.3, 0.4, 0.05, 0.06, 0.0]
    want = cv2.resize(leaves.astype(np.uint16), (30, 20), interpolation=cv2.INTER_NEAREST)
    assert np.array_equal(decode_leaf_map(d["leaves"], (20, 30)), want)
    json.dumps(d)  # plain JSON


# ----------------------------------------------------------------------------- the runs


def _segment(out: Path, *args: str, weights: Path | None = None) -> Path:
    """``segment`` on the bundled examples on the CPU: DINOv2 ViT-S/14 with ``weights``, or
    the tiny ViT with the committed weights."""
    model = ([f"model.checkpoint={weights}"] if weights is not None
             else ["model=vit_tiny_random", f"model.checkpoint={TINY}"])
    assert segment_in_process(f"output={out}", *model, "device=cpu", "progress=false",
                              "render.fsync=false", *args) == 0
    return out / "index.html"


def test_heatmap_methods_get_no_slider(tmp_path):
    """A method without a hierarchy: no column, no canvas, no script."""
    text = _segment(tmp_path / "o", "method=cls_attention").read_text()
    assert "hierarchy" not in text and "<canvas" not in text and "<script" not in text
    assert "regions at t" not in text and "lv-" not in text


def test_the_slider_starts_at_the_methods_level(tmp_path):
    """The slider starts at (and marks) ``method.escape``, also when a resumed run builds no
    method; the page's data are the run's hierarchy files."""
    index = _segment(tmp_path / "o", "method.escape=0.45")
    first = index.read_text()
    _segment(tmp_path / "o", "method.escape=0.45")  # every image done: no method built
    assert index.read_text() == first
    assert 'id="lv-t" data-t="0.45">0.45</output>' in first and "default 0.45" in first
    data = json.loads(re.search(r'<script type="application/json" id="lv-data">(.*?)</script>',
                                first).group(1))
    # 0.45 is off the 0.02 grid: one more stop, exactly the default
    assert data["t"] == sorted([*GRID, 0.45]) and data["t"][data["start"]] == 0.45
    names = re.findall(r'alt="regions of ([^"]+)"', first)
    assert names == ["astronaut", "chelsea", "coffee"] and len(data["images"]) == 3
    for name, d in zip(names, data["images"]):
        tree, _, _ = hierarchy_files.load_hierarchy(index.parent / "hierarchy" / f"{name}.npz")
        assert d["height"] == tree.height.tolist()


# ----------------------------------------------------------------------------- in Chromium

PROBE = r"""
<script>
window.addEventListener('load', () => {
  const PLAN = __PLAN__;
  const out = {levels: [], hovers: [], err: null};
  try {
    const D = JSON.parse(document.getElementById('lv-data').textContent);
    const slider = document.getElementById('lv-slider'), tOut = document.getElementById('lv-t');
    out.start = {value: +slider.value, t: +tOut.dataset.t};
    const canvases = [...document.querySelectorAll('canvas.lvc')];
    const name = c => c.parentElement.querySelector('img').alt.replace(/^regions of /, '');
    const setT = t => {
      const i = D.t.indexOf(t);
      if (i < 0) throw new Error('no threshold ' + t);
      slider.value = i;
      slider.dispatchEvent(new Event('input', {bubbles: true}));
      return +tOut.dataset.t;
    };
    for (const t of PLAN.ts) {
      const shown = setT(t);
      for (const c of canvases) {
        const lab = c.segLabels, w = c.width, h = c.height;
        const runs = [];
        for (let p = 0; p < lab.length;) {
          let q = p;
          while (q < lab.length && lab[q] === lab[p]) q++;
          runs.push(lab[p], q - p);
          p = q;
        }
        // what was drawn: a boundary exactly where a neighbour differs, one colour per region
        const px = c.getContext('2d').getImageData(0, 0, w, h).data, colour = new Map();
        let bad = 0;
        for (let y = 0, p = 0; y < h; y++) for (let x = 0; x < w; x++, p++) {
          const r = lab[p];
          const edge = (x > 0 && lab[p - 1] !== r) || (x < w - 1 && lab[p + 1] !== r) ||
                       (y > 0 && lab[p - w] !== r) || (y < h - 1 && lab[p + w] !== r);
          const a = px[4 * p + 3];
          if (edge) { if (a !== 235) bad++; continue; }
          if (a !== 120) { bad++; continue; }
          const k = (px[4 * p] << 16) | (px[4 * p + 1] << 8) | px[4 * p + 2];
          if (!colour.has(r)) colour.set(r, k); else if (colour.get(r) !== k) bad++;
        }
        out.levels.push({name: name(c), t: shown, w, h, runs, distinct: new Set(lab).size,
                         shown: +c.dataset.regions, bad, filled: colour.size,
                         colours: new Set(colour.values()).size,
                         line: document.getElementById('lv-info-' + c.dataset.i).textContent});
      }
    }
    for (const t of PLAN.hoverTs) {
      const shown = setT(t);
      for (const c of canvases) for (const [x, y] of PLAN.points[name(c)]) {
        const b = c.getBoundingClientRect();
        c.dispatchEvent(new MouseEvent('mousemove', {bubbles: true,
          clientX: b.left + (x + 0.5) * b.width / c.width, clientY: b.top + (y + 0.5) * b.height / c.height}));
        const info = document.getElementById('lv-info-' + c.dataset.i);
        const q = s => { const e = info.querySelector(s); return e ? e.textContent : null; };
        const alpha = c.getContext('2d').getImageData(x, y, 1, 1).data[3];
        out.hovers.push({name: name(c), t: shown, x, y, at: [+info.dataset.x, +info.dataset.y],
                         region: q('.lv-r'), height: q('.lv-h'), escape: q('.lv-e'), alpha});
      }
    }
    document.getElementById('lv-default').click();
    out.back = {value: +slider.value, t: +tOut.dataset.t};
  } catch (e) { out.err = String(e.stack || e); }
  document.body.setAttribute('data-probe', JSON.stringify(out));
});
</script>
"""


def _small(a: np.ndarray, w: int, h: int) -> np.ndarray:
    """A full-size id map at the canvas size, nearest neighbour (the thumbnail's pixels)."""
    return cv2.resize(a.astype(np.uint16), (w, h), interpolation=cv2.INTER_NEAREST).astype(np.int64)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install chromium)")
@pytest.mark.parametrize("model", ["tiny", pytest.param("dinov2", marks=pytest.mark.slow)])
def test_slider_and_pointer_in_chromium(tmp_path, request, model):
    """The probe moves the slider over several thresholds ('input' events) and points at
    pixels ('mousemove'): per image and threshold the canvas draws exactly the regions of
    ``hierarchy_files.labels_at`` on the thumbnail (the ids pixel by pixel, so their count),
    a boundary where they change and one colour each; the counts never grow as t goes coarse;
    under the pointer the page shows the region there with its height and escape, equal to
    the Hierarchy's to the printed 3 decimals; the default button goes back to the start.
    ``dinov2``: the real model (SEGMENT_SHARED), else the committed tiny weights."""
    weights = request.getfixturevalue("dinov2_weights") if model == "dinov2" else None
    index = _segment(tmp_path / "o", weights=weights)
    ts = [2.0, 1.0, 0.7, 0.5, 0.4, 0.3, 0.2, 0.1, 0.02]  # fine to coarse
    hover_ts = [0.5, 0.3, 1.0]
    data = json.loads(re.search(r'id="lv-data">(.*?)</script>', index.read_text()).group(1))
    names = re.findall(r'alt="regions of ([^"]+)"', index.read_text())
    points = {n: [[d["w"] // 2, d["h"] // 2], [d["w"] // 5, d["h"] // 4], [4 * d["w"] // 5, 3 * d["h"] // 4],
                  [d["w"] - 1, d["h"] - 1]] for n, d in zip(names, data["images"])}
    plan = json.dumps({"ts": ts, "hoverTs": hover_ts, "points": points})
    probe = index.with_name("probe.html")
    probe.write_text(index.read_text().replace("</body>", PROBE.replace("__PLAN__", plan) + "</body>"))
    r = _chromium(["--window-size=1280,900", "--dump-dom", probe.as_uri()])
    got = probe_result(r.stdout)
    assert got["err"] is None, got["err"]
    assert got["start"] == {"value": GRID.index(0.5), "t": 0.5}  # method.escape's default
    assert got["back"] == got["start"]

    trees = {n: hierarchy_files.load_hierarchy(index.parent / "hierarchy" / f"{n}.npz") for n in names}
    counts: dict[str, list[int]] = {n: [] for n in names}
    assert len(got["levels"]) == len(ts) * len(names)
    for lev in got["levels"]:
        name, t, w, h = lev["name"], lev["t"], lev["w"], lev["h"]
        want = _small(hierarchy_files.labels_at(index.parent / "hierarchy" / f"{name}.npz", t), w, h)
        drawn = np.repeat(lev["runs"][0::2], lev["runs"][1::2]).reshape(h, w)
        assert np.array_equal(drawn, want), (name, t)
        k = len(np.unique(want))
        assert (lev["distinct"], lev["shown"]) == (k, k), (name, t)
        # a colour per region (a region thinner than 3 pixels is all boundary)
        assert lev["colours"] == lev["filled"] and k - 2 <= lev["filled"] <= k, (name, t, lev["filled"], k)
        assert lev["bad"] == 0, (name, t, lev["bad"])
        assert lev["line"].startswith(f"{k} region{'' if k == 1 else 's'} at t = {t:.2f}"), lev["line"]
        counts[name].append(k)
    for name, c in counts.items():  # ts run fine to coarse
        assert all(a >= b for a, b in zip(c, c[1:])), (name, c)
    assert any(c[0] > c[-1] for c in counts.values()) and max(max(c) for c in counts.values()) >= 3, counts

    seen = set()
    assert len(got["hovers"]) == len(hover_ts) * sum(len(p) for p in points.values())
    for hv in got["hovers"]:
        name, t, (x, y) = hv["name"], hv["t"], hv["at"]
        # the pixel the page resolved the pointer to: the one aimed at, up to the events'
        # whole CSS pixels (the thumbnail is shown smaller than the canvas)
        assert abs(x - hv["x"]) <= 2 and abs(y - hv["y"]) <= 2, hv
        tree, leaves, _ = trees[name]
        d = data["images"][names.index(name)]
        leaf = int(_small(leaves, d["w"], d["h"])[y, x])
        region = int(tree.leaf_labels_at(t)[leaf])
        level = tree.level(t)
        assert int(hv["region"]) == region, hv
        assert abs(float(hv["height"]) - float(level.height[region])) <= 5e-4 + 1e-12, (hv, level.height)
        assert abs(float(hv["escape"]) - float(level.escape[region])) <= 5e-4 + 1e-12, (hv, level.escape)
        assert hv["alpha"] in (30, 235), hv  # the region under the pointer drawn lighter
        seen.add((hv["height"], hv["escape"]))
    assert len(seen) >= 4, seen  # the pointer met several regions
