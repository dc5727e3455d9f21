"""What the README promises: its install agrees with pyproject.toml, its links resolve, and
its Python runs: every ``python`` code block (with the tiny random ViT in place of the
hub's weights, on a bundled example), and its inline ``segment.load`` example sets what
the text says, so an example cannot go stale."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
from PIL import Image
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
EXAMPLE = REPO / "datasets" / "examples" / "astronaut.png"

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def test_install_lines_and_torch_constraint_agree():
    block = re.search(r"## Install and run\n+```bash\n(.*?)```", README, re.S).group(1).splitlines()
    pair = r"pip install torch==([0-9.]+) torchvision==([0-9.]+)"
    cpu = [i for i, ln in enumerate(block) if "--index-url https://download.pytorch.org/whl/cpu" in ln]
    default = [i for i, ln in enumerate(block) if re.search(pair + r"\s*(#|$)", ln)]
    assert cpu and default and abs(cpu[0] - default[0]) == 1  # side by side
    assert re.search(pair + r" --index-url https://download.pytorch.org/whl/cpu", block[cpu[0]])
    pins = {re.search(pair, block[i]).groups() for i in (cpu[0], default[0])}
    (claimed,) = pins  # both lines install the same pair
    assert re.search(rf"Tested pair: torch {re.escape(claimed[0])} / torchvision {re.escape(claimed[1])}", README)
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    assert f">={claimed[0]}" in str(req.specifier).split(",")  # the range starts at the tested pair
    assert Version(torch.__version__.split("+")[0]) in req.specifier


def test_readme_is_a_manual_and_its_links_resolve():
    """The README stays a manual (at most 300 lines) and every relative link of it and of
    docs/ names a file of the checkout (a renamed doc or picture fails here)."""
    readme = REPO / "README.md"
    assert len(readme.read_text().splitlines()) <= 300
    docs = sorted((REPO / "docs").glob("*.md"))
    assert docs, "docs/ holds the manual's chapters"
    missing = []
    for page in [readme, *docs]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                missing.append(f"{page.relative_to(REPO)} -> {target}")
    assert not missing, missing


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
