"""The README's Python: every ``python`` code block runs (with the tiny random ViT in place
of the hub's weights, on a bundled example), and its inline ``segment.load`` example sets
what the text says, so an example cannot go stale."""

from __future__ import annotations

import re
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
EXAMPLE = ROOT / "datasets" / "examples" / "astronaut.png"


def _tiny_load(monkeypatch):
    import segment

    real = segment.load

    def load(model=None, method="cuts", checkpoint=None, device="cpu", **overrides):
        return real("vit_tiny_random", method, device="cpu", **overrides)

    monkeypatch.setattr(segment, "load", load)


def test_every_python_block_of_the_readme_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"^```python\n(.*?)^```", README, re.S | re.M)
    assert blocks, "the README has no python block"
    Image.open(EXAMPLE).convert("RGB").save(tmp_path / "photo.jpg")  # the blocks' photo.jpg
    monkeypatch.chdir(tmp_path)
    _tiny_load(monkeypatch)
    for i, code in enumerate(blocks):
        exec(compile(code, f"README.md python block {i + 1}", "exec"), {"__name__": "readme"})
    assert Image.open(tmp_path / "overlay.jpg").size == Image.open(EXAMPLE).size


def test_the_inline_load_example_sets_what_it_says(monkeypatch):
    m = re.search(r"`segment\.load\((image_size=(\d+), (\w+)=([\d.]+))\)` sets\s+"
                  r"`model\.image_size` and `method\.(\w+)`", README)
    assert m, "the README's overrides example is gone or reworded"
    size, key, value, named = int(m.group(2)), m.group(3), float(m.group(4)), m.group(5)
    assert key == named
    _tiny_load(monkeypatch)
    import segment

    seg = segment.load(**{"image_size": size, key: value})
    assert getattr(seg.method, key) == value
    assert seg.config.model.image_size == size
