"""Build docs/img/examples.jpg from a `segment` output folder: per bundled example, the
photo, the heatmap, the mask, the overlay and the region labels, side by side.

    segment output=/tmp/examples model.checkpoint=PATH/dinov2_vits14.safetensors
    python docs/make_figure.py /tmp/examples docs/img/examples.jpg
"""

from __future__ import annotations

import sys
from pathlib import Path

from PIL import Image, ImageOps

EXAMPLES = Path(__file__).resolve().parents[1] / "datasets" / "examples"
COLUMNS = (("photo", None), ("heatmap", "heatmaps/{}.png"), ("mask", "masks/{}.png"),
           ("overlay", "overlays/{}.jpg"), ("regions", "labels/{}.png"))


def main(out_dir: str, dest: str, width: int = 232, height: int = 174) -> None:
    out = Path(out_dir)
    rows = []
    for photo in sorted(EXAMPLES.glob("*.png")):
        tiles = []
        for _, pattern in COLUMNS:
            path = photo if pattern is None else out / pattern.format(photo.stem)
            if not path.is_file():
                raise SystemExit(f"{path}: missing (run `segment output={out_dir}` first)")
            im = Image.open(path).convert("RGB")
            tiles.append(ImageOps.pad(im, (width, height), Image.BICUBIC, color="white"))
        rows.append(tiles)
    gap = 4
    total = len(COLUMNS) * (width + gap) - gap
    canvas = Image.new("RGB", (total, len(rows) * height + gap * (len(rows) - 1)), "white")
    for i, r in enumerate(rows):
        x = 0
        for t in r:
            canvas.paste(t, (x, i * (height + gap)))
            x += t.width + gap
    canvas.save(dest, quality=85, optimize=True)
    print(f"{dest}: {canvas.width} x {canvas.height}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
