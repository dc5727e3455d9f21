"""Early refusals: a file with more pixels than ``max_pixels`` (Pillow's limit when null) is
refused from its header, before the model loads, with the reader's one line; the run goes
on with the other images and a rerun skips it again without reading it."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import segment.run.job.pipeline as pipeline_mod
import segment.run.job.stages as stages_mod
from segment.run.io import ImageReadError, read_image, too_many_pixels
from segment.run.job.pipeline import run_segment
from test_io import png_header_only
from test_pipeline import compose_cfg

pytestmark = pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")


def _photo(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    a = np.full((h, w, 3), 40, np.uint8)
    a[h // 4: 3 * h // 4, w // 4: 3 * w // 4] = rng.integers(150, 255, 3)
    return Image.fromarray(a)


def _manifest(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


def _watch(monkeypatch, caplog) -> tuple[list[int], list[Path]]:
    """Record the model builds (with the log lines before each) and the files the loader reads."""
    builds, reads = [], []
    real_build, real_read = pipeline_mod.SegmentRun._build, stages_mod.read_image

    def build(self) -> None:
        builds.append(len(caplog.records))  # how many lines came before the model
        real_build(self)

    monkeypatch.setattr(pipeline_mod.SegmentRun, "_build", build)
    monkeypatch.setattr(stages_mod, "read_image", lambda path, **kw: reads.append(Path(path)) or real_read(path, **kw))
    return builds, reads


def test_the_header_gives_the_readers_refusal(tmp_path):
    """too_many_pixels says what read_image says, from the header alone (nothing decoded);
    nothing for an image within the limit or a file Pillow cannot open."""
    p = tmp_path / "big.png"
    _photo(40, 60, 0).save(p)
    assert too_many_pixels(p, max_pixels=2400) is None
    why = too_many_pixels(p, max_pixels=1000)
    assert why == ("image is 60x40 = 2,400 pixels, above the limit of 1,000 (decompression-bomb guard); "
                   "if the file is trusted, raise the limit with max_pixels=N")
    with pytest.raises(ImageReadError) as e:
        read_image(p, max_pixels=1000)
    assert e.value.reason == why
    (tmp_path / "text.png").write_text("not an image")
    (tmp_path / "empty.png").write_bytes(b"")
    for other in ("text.png", "empty.png", "gone.png"):  # the reader's reasons, later
        assert too_many_pixels(tmp_path / other, max_pixels=1) is None
    for side, words in ((10_000, "above the limit of"), (30_000, "too large to decode safely")):
        (tmp_path / "bomb.png").write_bytes(png_header_only(side, side))
        t0 = time.perf_counter()
        why = too_many_pixels(tmp_path / "bomb.png")  # Pillow's limit (its guard above twice it)
        assert time.perf_counter() - t0 < 1.0 and words in why and why.endswith("max_pixels=N")
        with pytest.raises(ImageReadError) as e:
            read_image(tmp_path / "bomb.png")
        assert e.value.reason == why


def test_an_image_over_max_pixels_is_refused_before_the_model_loads(tmp_path, monkeypatch, caplog):
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    _photo(20, 30, 1).save(src / "a.png")
    _photo(40, 60, 0).save(src / "big.png")  # 2,400 pixels
    _photo(30, 20, 2).save(src / "c.jpg")
    builds, reads = _watch(monkeypatch, caplog)
    caplog.set_level(logging.INFO)
    assert run_segment(compose_cfg(src, out, "max_pixels=1000")) == 0  # the others are segmented
    line = (f"skipped {src / 'big.png'}: image is 60x40 = 2,400 pixels, above the limit of 1,000 "
            "(decompression-bomb guard); if the file is trusted, raise the limit with max_pixels=N")
    messages = [r.getMessage() for r in caplog.records]
    assert len(builds) == 1 and line in messages[:builds[0]]  # before the model was built
    assert "3 images under" in caplog.text and "0 already done, 2 to segment, 1 skipped as too large" in caplog.text
    assert src / "big.png" not in reads and len(reads) == 2  # the loader never read it
    assert "done: 2 segmented, 0 resumed, 1 skipped (reasons above and in run.json)" in caplog.text
    man = _manifest(out)
    assert man["counts"] == {"found": 3, "segmented": 2, "resumed": 0, "skipped": 1, "ignored": 0}
    big = next(s for s in man["images"] if s["source"] == "big.png")
    assert big["status"] == "skipped" and big["unreadable"] and big["reason"] == line.split(": ", 1)[1]
    assert big["source_bytes"] == (src / "big.png").stat().st_size
    assert not (out / "masks" / "big.png").exists() and "big.png" in (out / "index.html").read_text()
    # a rerun skips it again without reading it (known-bad), and loads no model
    caplog.clear()
    assert run_segment(compose_cfg(src, out, "max_pixels=1000")) == 0
    assert len(builds) == 1 and "2 already done, 0 to segment, 1 known-bad file skipped again" in caplog.text
    # a higher limit admits it
    caplog.clear()
    assert run_segment(compose_cfg(src, out, "max_pixels=2400")) == 0
    assert len(builds) == 2 and (out / "masks" / "big.png").is_file()


def test_only_too_large_images_load_no_model(tmp_path, monkeypatch, caplog):
    """With max_pixels null, Pillow's limit: a 100-megapixel header is refused in one line
    naming the file and max_pixels, no model is built, and the run ends as when nothing
    could be segmented (exit 1, run.json lists why)."""
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    (src / "huge.png").write_bytes(png_header_only(10_000, 10_000))
    builds, reads = _watch(monkeypatch, caplog)
    caplog.set_level(logging.INFO)
    t0 = time.perf_counter()
    assert run_segment(compose_cfg(src, out)) == 1
    assert time.perf_counter() - t0 < 10 and builds == [] and reads == []
    limit = f"{Image.MAX_IMAGE_PIXELS:,}"
    assert (f"skipped {src / 'huge.png'}: image is 10000x10000 = 100,000,000 pixels, above the limit of {limit} "
            "(decompression-bomb guard); if the file is trusted, raise the limit with max_pixels=N") in caplog.text
    assert "the one image could not be segmented; see the reasons above and in run.json" in caplog.text
    man = _manifest(out)
    assert man["exit_code"] == 1 and man["counts"]["skipped"] == 1 and man["images"][0]["unreadable"]
