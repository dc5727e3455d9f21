"""Build docs/img/gallery_slider.png: a `segment` run's index.html in headless Chromium with
the scale control moved off the default level and the pointer over one region.

    segment input=PATH/examples output=/tmp/examples model.checkpoint=PATH/dinov2_vits14.safetensors
    python docs/make_gallery_shot.py /tmp/examples docs/img/gallery_slider.png [T] [IMAGE X Y]

A copy of the page (``shot.html``, next to it) gets a script that sets the slider to ``T``
(an ``input`` event) and moves the pointer to pixel ``(X, Y)`` of image number ``IMAGE``'s
canvas (a ``mousemove``); Chromium renders it once to read where that pixel is
(``--dump-dom``) and once to take the screenshot (at twice the pixel density), on which an
arrow is drawn there (a headless screenshot shows no pointer). The picture is cropped to
the table's header and first row from the overlay column to the regions at t, and saved
as a 256-colour PNG.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image, ImageDraw

WIDTH, HEIGHT = 1280, 1000
SCALE = 2  # device pixels per CSS pixel: text stays sharp in the crop

SCRIPT = r"""
<script>
window.addEventListener('load', () => {
  const D = JSON.parse(document.getElementById('lv-data').textContent);
  const slider = document.getElementById('lv-slider');
  slider.value = D.t.indexOf(__T__);
  slider.dispatchEvent(new Event('input'));
  const c = document.querySelectorAll('canvas.lvc')[__IMAGE__], b = c.getBoundingClientRect();
  const x = b.left + (__X__ + 0.5) * b.width / c.width, y = b.top + (__Y__ + 0.5) * b.height / c.height;
  c.dispatchEvent(new MouseEvent('mousemove', {bubbles: true, clientX: x, clientY: y}));
  // the crop: the columns from the overlay to the regions at t, the header and the first row
  const th = [...document.querySelectorAll('table.images th')], row = document.querySelector('table.images tbody tr');
  const from = th.find(h => h.textContent === 'overlay') || th[1];
  const box = [from.getBoundingClientRect().left, th[0].getBoundingClientRect().top,
               th[th.length - 1].getBoundingClientRect().right, row.getBoundingClientRect().bottom];
  document.body.setAttribute('data-pointer', JSON.stringify([x, y, box]));
});
</script>
"""

# a pointer arrow, tip at (0, 0)
ARROW = [(0, 0), (0, 17), (4, 13), (7, 20), (10, 19), (7, 12), (12, 12)]


def _chromium(*args: str) -> str:
    exe = next(p for p in (shutil.which("chromium"), shutil.which("chromium-browser"),
                           shutil.which("google-chrome")) if p)
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        r = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                            "--disable-background-networking", "--disable-component-update",
                            "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
                            "--virtual-time-budget=5000", f"--window-size={WIDTH},{HEIGHT}",
                            f"--force-device-scale-factor={SCALE}", *args],
                           capture_output=True, text=True, timeout=120)
    return r.stdout


def main(out_dir: str, dest: str, t: float = 0.6, image: int = 0, x: int = 150,
         y: int = 95) -> None:
    index = Path(out_dir) / "index.html"
    page = index.read_text()
    if 'id="lv-data"' not in page:
        raise SystemExit(f"{index}: no scale control (a method without a hierarchy?)")
    script = (SCRIPT.replace("__T__", repr(float(t))).replace("__IMAGE__", str(int(image)))
              .replace("__X__", str(int(x))).replace("__Y__", str(int(y))))
    shot = index.with_name("shot.html")
    shot.write_text(page.replace("</body>", script + "</body>"))
    dom = _chromium("--dump-dom", shot.as_uri())
    m = re.search(r'data-pointer="([^"]*)"', dom)
    if m is None:
        raise SystemExit("the page's script did not run (is T one of the slider's thresholds?)")
    px, py, box = json.loads(html.unescape(m.group(1)))
    with tempfile.TemporaryDirectory() as tmp:
        png = Path(tmp) / "shot.png"
        _chromium(f"--screenshot={png}", shot.as_uri())
        im = Image.open(png).convert("RGB")
    draw = ImageDraw.Draw(im)
    draw.polygon([(SCALE * (px + a), SCALE * (py + b)) for a, b in ARROW], fill="black",
                 outline="white", width=SCALE)
    im = im.crop(tuple(round(SCALE * v) for v in box))
    im.quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(dest, optimize=True)
    shot.unlink()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(float(a) if i == 0 else int(a) for i, a in enumerate(sys.argv[3:])))
