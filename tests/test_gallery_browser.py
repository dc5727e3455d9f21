"""The gallery (index.html) rendered by a real headless Chromium at 1,280 and 1,920 px:
no horizontal overflow, every column visible, names wrapped only after separators, the
legend there. Skipped with a reason when Chromium is not installed
(`apt-get install chromium`). Set SEGMENT_SCREENSHOTS=DIR to keep the screenshots."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_module
from PIL import Image

from segment.run.job.pipeline import run_segment

CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"),
                             shutil.which("google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install chromium)")

PROBE = r"""
<script>
window.addEventListener('load', () => {
  const seps = '/_- ';
  const names = [];
  for (const td of document.querySelectorAll('td.name')) {
    const chars = [];
    const walk = document.createTreeWalker(td, NodeFilter.SHOW_TEXT);
    for (let n = walk.nextNode(); n; n = walk.nextNode()) {
      if (n.parentElement.closest('.small')) continue;
      for (let i = 0; i < n.length; i++) {
        const r = document.createRange(); r.setStart(n, i); r.setEnd(n, i + 1);
        const b = r.getBoundingClientRect();
        chars.push([n.data[i], b.top, b.right]);
      }
    }
    const bad = [];
    for (let i = 1; i < chars.length; i++)
      if (chars[i][1] > chars[i - 1][1] + 2 && !seps.includes(chars[i - 1][0])) bad.push(i);
    const cell = td.getBoundingClientRect();
    names.push({text: chars.map(c => c[0]).join(''), badBreaks: bad,
                overflow: Math.max(0, ...chars.map(c => c[2])) - cell.right});
  }
  const table = document.querySelector('table.images').getBoundingClientRect();
  const imgs = [...document.querySelectorAll('table.images img')].map(i => i.getBoundingClientRect().width);
  const out = {inner: window.innerWidth, scroll: document.documentElement.scrollWidth,
               tableRight: table.right, minImg: Math.min(...imgs), maxImg: Math.max(...imgs), names,
               legend: !!document.querySelector('.legend .bar'), keys: document.querySelectorAll('.key').length};
  document.body.setAttribute('data-probe', JSON.stringify(out));
});
</script>
"""


def _gallery(tmp_path: Path) -> Path:
    src = tmp_path / "in"
    names = ["astronaut_on_the_moon_with_a_flag_2024-07-20_final", "sub-folder/cat-sleeping-on-a-very-long-sofa",
             "x", "photos/2026/holiday/beach_sunset_panorama"]
    rng = np.random.default_rng(0)
    for i, n in enumerate(names):
        p = src / f"{n}.jpg"
        p.parent.mkdir(parents=True, exist_ok=True)
        h, w = [(300, 400), (400, 300), (200, 200), (250, 800)][i]
        a = np.full((h, w, 3), 40, np.uint8)
        a[h // 4 : 3 * h // 4, w // 4 : 3 * w // 4] = rng.integers(120, 255, 3)
        Image.fromarray(a).save(p)
    (src / "not_an_image_but_named_like_one.png").write_text("nope")
    out = tmp_path / "out"
    with initialize_config_module(version_base="1.3", config_module="segment.configs"):
        cfg = compose("segment", overrides=[f"input={src}", f"output={out}", "model=vit_tiny_random", "device=cpu",
                                            "progress=false", "render.fsync=false"])
    assert run_segment(cfg) == 0
    return out / "index.html"


def _chromium(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """Headless Chromium with a fresh profile (no network, updates or sync) on ``args``."""
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                "--disable-dev-shm-usage", "--allow-file-access-from-files", "--virtual-time-budget=5000",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--no-first-run", f"--user-data-dir={profile}"]
        return subprocess.run(base + args, capture_output=True, text=True, timeout=timeout)


def probe_result(stdout: str) -> dict:
    """The JSON a probe script left in ``<body data-probe="...">`` of ``--dump-dom``'s output."""
    m = re.search(r'data-probe="([^"]*)"', stdout)
    assert m, stdout[-2000:]
    return json.loads(html.unescape(m.group(1)))


@pytest.mark.parametrize("width", [1280, 1920])
def test_gallery_in_chromium(tmp_path, width):
    index = _gallery(tmp_path)
    html = index.read_text()
    probe = index.with_name("probe.html")
    probe.write_text(html.replace("</body>", PROBE + "</body>"))
    r = _chromium([f"--window-size={width},900", "--dump-dom", probe.as_uri()])
    m = re.search(r'data-probe="([^"]*)"', r.stdout)
    assert m, (r.returncode, r.stderr[-2000:])
    got = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    assert got["inner"] == width
    assert got["scroll"] <= width, got  # no horizontal scrolling
    assert got["tableRight"] <= width, got  # every column on screen
    assert got["minImg"] >= 100, got  # thumbnails stay readable
    assert got["maxImg"] <= 256 + 1, got  # ... and never upscaled past the thumbnail size
    assert got["legend"] and got["keys"] == 4, got  # colour bar; a region key per label map
    assert len(got["names"]) == 5
    for n in got["names"]:
        assert n["badBreaks"] == [], n  # wrapped only after / _ - or a space
        assert n["overflow"] <= 1, n  # and never out of its cell
    shot = tmp_path / f"gallery_{width}.png"
    r = _chromium([f"--window-size={width},900", f"--screenshot={shot}", index.as_uri()])
    assert shot.is_file(), r.stderr[-2000:]
    with Image.open(shot) as im:
        assert im.size == (width, 900)
    keep = os.environ.get("SEGMENT_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(keep) / shot.name)
