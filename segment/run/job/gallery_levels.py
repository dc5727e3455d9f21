"""The gallery's scale control: each image's regions at any threshold, drawn in the page.

For a method that gives a hierarchy (``hierarchy/<name>.npz``,
:mod:`segment.run.job.hierarchy_files`), ``index.html`` gets a column "regions at t": the
image's thumbnail under a canvas that draws its regions at the threshold ``t`` of one slider
(the escape cuts keeping the splits of height below ``t``: small ``t`` coarse, large ``t``
fine; a mark and a button for the method's default level), and under the pointer the region
there with its height and escape probability. Everything the page needs is inlined (one
``<script type="application/json">``), so it works opened from disk (``file://``): the
script never reads a local file or the pixels of an ``<img>``.

Per image the page holds (:func:`image_levels`):

    w, h       the canvas size: the thumbnail's (``render.thumb_size``,
               :func:`segment.run.api.render.thumb_shape`)
    leaves     every thumbnail pixel's leaf: the ``.npz``'s ``leaves`` resized to ``(h, w)``
               by nearest neighbour (OpenCV's rule, as ``gallery/labels/`` is), coded by
               :func:`encode_leaf_map`
    children   the merge table, flattened row by row (``2 (L-1)`` node ids)
    height     ``(L-1,)`` the splits' heights, exact (JSON's shortest round-trip form of the
               float64), so the page keeps a split exactly when ``height < t`` as
               :meth:`segment.core.hierarchy.Hierarchy.leaf_labels_at` does
    escape     ``(2L-1,)`` every node's escape probability, rounded to 3 decimals (the
               precision the page prints)

**The leaf-map code** (base64 of a byte string of unsigned LEB128 varints): the pixels in
raster order as runs; each run starts with ``v = 3 * length + kind``:

- kind 0: ``length`` pixels each equal to the pixel one row above;
- kind 1: ``length`` pixels equal to the pixel before the run (raster order);
- kind 2: one more varint follows, the leaf id; ``length`` pixels of it.

The regions' boundaries move little from row to row, so most pixels fall in kind-0 runs: on
the 100 photos of ecssd-dev (256-px thumbnails, 31 leaves on average) the code takes 3.7 KB
an image, against 5.2 KB for plain run lengths.
"""

from __future__ import annotations

import base64
import html
import json
import os
from collections.abc import Sequence
from typing import Any

import cv2
import numpy as np

from segment.run.job.hierarchy_files import load_hierarchy

__all__ = ["GRID", "decode_leaf_map", "encode_leaf_map", "image_levels", "levels_script",
           "levels_cell", "levels_header", "start_index", "thresholds", "LEVELS_CSS",
           "LEVELS_LEGEND"]

# the slider's thresholds: 0.02 .. 2.00 in steps of 0.02 (segment-eval's grid)
GRID = tuple(round(0.02 * k, 2) for k in range(1, 101))


def _varints(values: Sequence[int]) -> bytes:
    out = bytearray()
    for v in values:
        v = int(v)
        while v >= 128:
            out.append((v & 127) | 128)
            v >>= 7
        out.append(v)
    return bytes(out)


def encode_leaf_map(leaves: np.ndarray) -> str:
    """The base64 code of an ``(h, w)`` map of non-negative integer ids (module docstring)."""
    if leaves.ndim != 2 or leaves.size == 0 or leaves.dtype.kind not in "iu" \
            or int(leaves.min()) < 0:
        raise ValueError(f"leaves must be a non-empty (h, w) map of non-negative integers, "
                         f"got {leaves.shape} {leaves.dtype}")
    w = leaves.shape[1]
    flat = leaves.reshape(-1).astype(np.int64)
    above = np.concatenate([np.full(w, -1, np.int64), flat[:-w]])
    key = np.where(flat == above, -1, flat)  # -1: as the pixel above
    start = np.flatnonzero(np.concatenate([[True], key[1:] != key[:-1]]))
    length = np.diff(np.concatenate([start, [flat.size]]))
    before = np.concatenate([[-1], flat[:-1]])[start]
    tokens: list[int] = []
    for s, n, b in zip(key[start].tolist(), length.tolist(), before.tolist()):
        if s < 0:
            tokens.append(3 * n)
        elif s == b:
            tokens.append(3 * n + 1)
        else:
            tokens += [3 * n + 2, s]
    return base64.b64encode(_varints(tokens)).decode("ascii")


def decode_leaf_map(code: str, shape: tuple[int, int]) -> np.ndarray:
    """The ``(h, w)`` int64 map of :func:`encode_leaf_map`'s ``code`` (the page's decoder,
    in Python).

    Raises:
        ValueError: a code that does not fill ``shape`` exactly.
    """
    h, w = shape
    data = base64.b64decode(code)
    out = np.empty(h * w, np.int64)
    i = p = 0

    def varint() -> int:
        nonlocal i
        v = shift = 0
        while True:
            if i >= len(data):
                raise ValueError("the leaf-map code ends inside a run")
            b = data[i]
            i += 1
            v |= (b & 127) << shift
            shift += 7
            if b < 128:
                return v

    while p < h * w:
        v = varint()
        kind, n = v % 3, v // 3
        if n < 1 or p + n > h * w or (kind == 0 and p < w) or (kind == 1 and p == 0):
            raise ValueError(f"the leaf-map code has a bad run (kind {kind}, length {n}) at "
                             f"pixel {p} of {h} x {w}")
        if kind == 2:
            out[p:p + n] = varint()
        elif kind == 1:
            out[p:p + n] = out[p - 1]
        else:
            for a in range(p, p + n, w):  # a row at a time: the source may be this run
                b = min(a + w, p + n)
                out[a:b] = out[a - w:b - w]
        p += n
    if i != len(data):
        raise ValueError(f"the leaf-map code has {len(data) - i} bytes past {h} x {w} pixels")
    return out.reshape(h, w)


def image_levels(path: str | os.PathLike, shape: tuple[int, int]) -> dict[str, Any]:
    """The page's data of one image (module docstring) from its ``hierarchy/<name>.npz``, the
    leaf map shrunk to ``shape = (h, w)`` (the thumbnail's size)."""
    tree, leaves, _ = load_hierarchy(path)
    h, w = shape
    small = cv2.resize(leaves.astype(np.uint16 if tree.num_leaves <= 65536 else np.float32),
                       (w, h), interpolation=cv2.INTER_NEAREST).astype(np.int64)
    return {"w": w, "h": h, "leaves": encode_leaf_map(small),
            "children": tree.children.reshape(-1).tolist(),
            "height": tree.height.tolist(),
            "escape": [round(float(e), 3) for e in tree.escape.tolist()]}


def thresholds(default: float | None) -> list[float]:
    """The slider's thresholds, ascending: :data:`GRID` and the default level."""
    return sorted(set(GRID) | ({float(default)} if default is not None else set()))


LEVELS_CSS = """
.lvh input{width:100%}
.lvh output{font-variant-numeric:tabular-nums}
.lvbar{position:relative;height:1.2em}
.lvbar input{position:absolute;left:0;right:0;top:0;margin:.2em 0 0}
.lvmark{position:absolute;top:1.05em;width:2px;height:.45em;background:#c00;margin-left:-1px}
.lvends{display:flex;justify-content:space-between;align-items:center;font-weight:normal;font-size:80%;color:#444}
.lvends button{font-size:100%;padding:0 .4em;cursor:pointer}
.lv{position:relative;max-width:THUMBpx}
.lv img{position:relative}
.lv canvas{position:absolute;left:0;top:0;width:100%;height:100%;cursor:crosshair;image-rendering:pixelated}
.lvinfo{font-size:80%;color:#444;margin-top:2px;min-height:2.4em;font-variant-numeric:tabular-nums}
.lvinfo b{color:#000}
"""

LEVELS_LEGEND = (
    "<div><b>regions at t</b>: the escape cuts keeping every split of height below t "
    "(slider: coarse left, fine right; the default level is the method's escape); point at a "
    "region for its height (the split that made it) and its escape probability (how often "
    "the walk leaves it in one step)</div>")


def start_index(ts: Sequence[float], default: float | None) -> int:
    """The slider's start in ``ts``: the default level (0.5 when it is not known)."""
    return list(ts).index(float(default) if default is not None else 0.5)


def levels_header(ts: Sequence[float], default: float | None) -> str:
    """The ``<th>`` of the regions column: the slider (one step per threshold of ``ts``), the
    value of ``t`` and the default level's mark and button."""
    start = start_index(ts, default)
    t = _show(ts[start])
    button = "" if default is None else (
        f'<button type="button" id="lv-default" title="the method\'s default level">'
        f"default {t}</button>")
    # the default's mark under the track (the thumb's centre runs 8 px inside either end)
    frac = start / max(1, len(ts) - 1)
    mark = "" if default is None else (
        f'<span class="lvmark" title="default level" style="left:calc(8px + (100% - 16px) * {frac:.4f})">'
        "</span>")
    return (f'<th class="lvh">regions at t = <output id="lv-t" data-t="{ts[start]!r}">{t}</output>'
            f'<div class="lvbar"><input type="range" id="lv-slider" min="0" max="{len(ts) - 1}" '
            f'step="1" value="{start}" aria-label="threshold t">{mark}</div>'
            f'<div class="lvends"><span>coarse</span>{button}<span>fine</span></div></th>')


def levels_cell(index: int, thumb: str, shape: tuple[int, int], alt: str) -> str:
    """The ``<td>`` of image ``index``: its thumbnail (``thumb``, an escaped relative link)
    under the canvas, and the line under them."""
    h, w = shape
    return (f'<td><div class="lv"><img loading="lazy" src="{thumb}" width="{w}" height="{h}" '
            f'alt="{html.escape(alt)}"><canvas class="lvc" data-i="{index}" width="{w}" '
            f'height="{h}"></canvas></div><div class="lvinfo" id="lv-info-{index}"></div></td>')


def _show(t: float) -> str:
    """A threshold as the page prints it (up to 3 decimals, no trailing zeros past 2)."""
    return f"{t:.3f}".rstrip("0") if round(t, 2) != t else f"{t:.2f}"


_LEVELS_JS = r"""
(function () {
  'use strict';
  const D = JSON.parse(document.getElementById('lv-data').textContent);
  const T = D.t, slider = document.getElementById('lv-slider'), tOut = document.getElementById('lv-t');
  const show = t => (Math.round(t * 100) / 100 === t ? t.toFixed(2) : String(+t.toFixed(3)));
  function colour(f) {  // golden-ratio hues, alternating value (as labels/)
    const h = (f * 0.618033988749895) % 1, s = 0.75, v = f % 2 ? 0.75 : 0.95;
    const i = Math.floor(h * 6), x = h * 6 - i, p = v * (1 - s), q = v * (1 - s * x), u = v * (1 - s * (1 - x));
    return [[v, u, p], [q, v, p], [p, v, u], [p, q, v], [u, p, v], [v, p, q]][i % 6].map(c => Math.round(255 * c));
  }
  function decode(code, w, n) {  // the leaf-map code (segment/run/job/gallery_levels.py)
    const s = atob(code), out = new Int32Array(n);
    let i = 0, p = 0;
    const varint = () => { let v = 0, m = 1, b; do { b = s.charCodeAt(i++); v += (b & 127) * m; m *= 128; } while (b & 128); return v; };
    while (p < n) {
      const v = varint(), kind = v % 3, len = (v - kind) / 3, end = p + len;
      if (kind === 2) out.fill(varint(), p, end);
      else if (kind === 1) out.fill(out[p - 1], p, end);
      else for (; p < end; p++) out[p] = out[p - w];
      p = end;
    }
    return out;
  }
  const images = [];
  for (const canvas of document.querySelectorAll('canvas.lvc')) {
    const d = D.images[+canvas.dataset.i], L = d.height.length + 1, N = 2 * L - 1;
    const parent = new Int32Array(N).fill(-1), own = new Float64Array(N).fill(Infinity), first = new Int32Array(N);
    for (let k = 0; k < L; k++) first[k] = k;
    for (let r = 0; r < L - 1; r++) {
      const a = d.children[2 * r], b = d.children[2 * r + 1];
      parent[a] = parent[b] = L + r; own[L + r] = d.height[r]; first[L + r] = Math.min(first[a], first[b]);
    }
    const g = {canvas, d, L, parent, own, first, hover: -1, info: document.getElementById('lv-info-' + canvas.dataset.i),
               leaves: decode(d.leaves, d.w, d.w * d.h), labels: new Int32Array(d.w * d.h)};
    canvas.segLabels = g.labels;
    canvas.addEventListener('mousemove', e => point(g, e));
    canvas.addEventListener('pointerdown', e => point(g, e));
    canvas.addEventListener('mouseleave', () => { g.hover = -1; draw(g); say(g, null); });
    images.push(g);
  }
  function level(g, t) {  // the regions at t: nodes in the reading order of their first leaf
    const node = new Int32Array(g.L);
    for (let k = 0; k < g.L; k++) {
      let n = k;
      while (g.parent[n] >= 0 && g.own[g.parent[n]] >= t) n = g.parent[n];
      node[k] = n;
    }
    const nodes = [...new Set(node)].sort((a, b) => g.first[a] - g.first[b]);
    const id = new Map(nodes.map((n, k) => [n, k]));
    return {t, nodes, region: Int32Array.from(node, n => id.get(n))};
  }
  // a pixel as one 32-bit word of the canvas's RGBA bytes (whatever the byte order)
  const little = new Uint8Array(new Uint32Array([1]).buffer)[0] === 1;
  const pack = (c, a) => (little ? (a << 24 | c[2] << 16 | c[1] << 8 | c[0])
                                 : (c[0] << 24 | c[1] << 16 | c[2] << 8 | a)) >>> 0;
  const WHITE = pack([255, 255, 255], 235), YELLOW = pack([255, 230, 0], 235);
  function draw(g) {  // boundaries where a 4-neighbour differs; the pointer's region lighter
    const {w, h} = g.d, lab = g.labels, region = g.lv.region, leaves = g.leaves, K = g.lv.nodes.length;
    for (let p = 0; p < lab.length; p++) lab[p] = region[leaves[p]];
    const fill = Uint32Array.from(g.lv.nodes, (n, r) => pack(colour(g.first[n]), r === g.hover ? 30 : 120));
    if (!g.image) {
      g.ctx = g.canvas.getContext('2d');
      g.image = g.ctx.createImageData(w, h);
      g.px = new Uint32Array(g.image.data.buffer);
    }
    const px = g.px, seen = new Uint8Array(K);
    for (let y = 0, p = 0; y < h; y++) for (let x = 0; x < w; x++, p++) {
      const r = lab[p]; seen[r] = 1;
      const edge = (x > 0 && lab[p - 1] !== r) || (x < w - 1 && lab[p + 1] !== r) ||
                   (y > 0 && lab[p - w] !== r) || (y < h - 1 && lab[p + w] !== r);
      px[p] = edge ? (r === g.hover ? YELLOW : WHITE) : fill[r];
    }
    g.ctx.putImageData(g.image, 0, 0);
    g.drawn = seen.reduce((a, b) => a + b, 0);
    g.canvas.dataset.regions = g.drawn;
  }
  function say(g, at) {
    const head = `<b>${g.drawn}</b> region${g.drawn === 1 ? '' : 's'} at t = ${show(g.lv.t)}`;
    if (!at) { g.info.innerHTML = head + '<br>point at a region'; return; }
    const node = g.lv.nodes[at.r], up = g.parent[node];
    const height = up >= 0 ? g.own[up] : 0, until = g.own[node];
    g.info.dataset.x = at.x; g.info.dataset.y = at.y;
    g.info.innerHTML = head + `<br>region <b class="lv-r">${at.r}</b>: height <b class="lv-h">${height.toFixed(3)}</b>` +
      `, escape <b class="lv-e">${g.d.escape[node].toFixed(3)}</b>`;
    g.info.title = `region ${at.r} exists for ${height.toFixed(3)} < t <= ` +
      (until === Infinity ? 'any t (a leaf)' : until.toFixed(3)) + '; escape: the probability that the stationary walk leaves it in one step';
  }
  function point(g, e) {
    const b = g.canvas.getBoundingClientRect(), {w, h} = g.d;
    const x = Math.min(w - 1, Math.max(0, Math.floor((e.clientX - b.left) * w / b.width)));
    const y = Math.min(h - 1, Math.max(0, Math.floor((e.clientY - b.top) * h / b.height)));
    const r = g.labels[y * w + x];
    if (r !== g.hover) { g.hover = r; draw(g); }
    say(g, {x, y, r});
  }
  function setLevel() {
    const t = T[+slider.value];
    tOut.textContent = show(t); tOut.dataset.t = String(t);
    for (const g of images) {  // an image whose regions did not change is not redrawn
      const lv = level(g, t), same = g.lv && g.hover < 0 && lv.region.every((r, k) => r === g.lv.region[k]);
      g.lv = lv;
      if (!same) { g.hover = -1; draw(g); }
      say(g, null);
    }
  }
  slider.addEventListener('input', setLevel);
  const button = document.getElementById('lv-default');
  if (button) button.addEventListener('click', () => { slider.value = D.start; setLevel(); });
  setLevel();
})();
"""


def levels_script(ts: Sequence[float], start: int, images: Sequence[dict[str, Any]]) -> str:
    """The inlined data (``ts``: the thresholds; ``start``: the default's index; ``images``:
    :func:`image_levels` in the order of the canvases' ``data-i``) and the page's script."""
    data = json.dumps({"t": list(ts), "start": start, "images": list(images)},
                      separators=(",", ":")).replace("</", "<\\/")
    return (f'<script type="application/json" id="lv-data">{data}</script>\n'
            f"<script>{_LEVELS_JS}</script>")
