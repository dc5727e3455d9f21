"""The Python API (segment.run.api.segmenter): load, Segmenter, Result, show; and that the `segment`
command computes through the same object (masks bit-identical)."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

import segment
from segment.run.api.segmenter import Result, Segmenter, compose_config, to_image
from segment.run.io import read_image

from conftest import assert_results_equal_files

REPO = Path(__file__).resolve().parents[1]
SEGMENT = Path(sys.executable).with_name("segment")


def _img(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    a = np.full((h, w, 3), 40, np.uint8)
    a[h // 4 : 3 * h // 4, w // 4 : 3 * w // 4] = rng.integers(150, 255, 3)
    a += rng.integers(0, 20, a.shape, dtype=np.uint8)
    return Image.fromarray(a)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """Weights of the tiny random ViT in a file, so that two processes use the same ones."""
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(0)
    m = timm.create_model("vit_small_patch14_dinov2", pretrained=False, num_classes=0,
                          embed_dim=64, depth=2, num_heads=2)
    p = tmp_path_factory.mktemp("ckpt") / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(p))
    return p


# ----------------------------------------------------------------------------- load


def test_overrides_are_routed_and_checked():
    cfg = compose_config("vit_tiny_random", "regions", image_size=112, steps=3, batch_size=2)
    assert cfg.model.image_size == 112 and cfg.method.steps == 3 and cfg.batch_size == 2
    cfg = compose_config("vit_tiny_random", "bounce", checkpoint="~/w.pt", **{"method.name": "b3"})
    assert cfg.method.name == "b3" and cfg.model.checkpoint == str(Path("~/w.pt").expanduser())
    with pytest.raises(ValueError, match=r"unknown setting 'batchsize' \(did you mean 'batch_size'\?\)"):
        compose_config("vit_tiny_random", batchsize=4)
    with pytest.raises(ValueError, match=r"did you mean 'checkpoint'"):
        compose_config("vit_tiny_random", checkpont="x")
    with pytest.raises(ValueError, match=r"did you mean 'method.steps'"):
        compose_config("vit_tiny_random", "regions", **{"method.stpes": 3})
    with pytest.raises(ValueError, match=r"unknown model 'dinov2_vits41' \(did you mean 'dinov2_vits14'\?\)"):
        compose_config("dinov2_vits41")
    with pytest.raises(ValueError, match=r"unknown method 'regoins' \(did you mean 'regions'\?\)"):
        compose_config("vit_tiny_random", "regoins")
    with pytest.raises(ValueError, match="both the model and the method"):
        compose_config("vit_tiny_random", name="x")  # `name` is a key of both configs


def test_load_builds_what_the_overrides_say():
    seg = segment.load("vit_tiny_random", "bounce", device="cpu", image_size=56, steps=3)
    assert isinstance(seg, Segmenter)
    assert seg.backbone.image_size == (56, 56) and seg.method.steps == 3
    assert str(seg.backbone.device) == "cpu"
    with pytest.raises(ValueError, match="multiple of the patch size"):  # the constructor's own error
        segment.load("vit_tiny_random", device="cpu", image_size=50)
    # the method is built first: a setting it refuses is reported before any weights load
    # (here a checkpoint that does not exist would be the other error)
    with pytest.raises(ValueError, match="num_seeds=10 has no effect"):
        segment.load("dinov2_vits14", "regions", device="cpu", checkpoint="/no/such/weights.safetensors",
                     num_seeds=10)
    # label_upsampling only moves region labels: refused for a heatmap method
    with pytest.raises(ValueError, match="label_upsampling=nearest has no effect with method"
                                         " cls_attention"):
        segment.load("vit_tiny_random", "cls_attention", device="cpu", label_upsampling="nearest")
    assert segment.load("vit_tiny_random", "kmeans", device="cpu",
                        label_upsampling="nearest").label_upsampling == "nearest"
    # the model is a Backbone (models/base.py: every name callers use), not any object
    with pytest.raises(TypeError, match="backbone must be a segment.models.base.Backbone, got"
                                        " SimpleNamespace"):
        Segmenter(SimpleNamespace(num_layers=2, name="x"), seg.method)
    assert repr(seg) == "Segmenter(vit_tiny_random/bounce, device=cpu)"


def test_label_upsampling_setting():
    """``label_upsampling`` decides how the regions reach the image's size: ``smooth`` (the
    default) and ``nearest`` are the two rules of :func:`segment.core.masks.labels_at` on the
    method's own output, the mask follows the labels, a bad value is refused, and the
    command's fingerprint changes with it (a rerun redoes the images)."""
    from segment.core.masks import labels_at
    from segment.run.job.pipeline import config_fingerprint

    im = _img(150, 210, 3)  # 4 x 4 tokens of a 56 px input: ~3x larger
    smooth = segment.load("vit_tiny_random", device="cpu", image_size=56)
    assert smooth.label_upsampling == "smooth"
    assert segment.load("vit_tiny_random", device="cpu", image_size=56,
                        label_upsampling="nearest").label_upsampling == "nearest"
    near = Segmenter(smooth.backbone, smooth.method, label_upsampling="nearest")  # same weights
    a, b = smooth(im), near(im)
    out = smooth.method(a.record)
    np.testing.assert_array_equal(a.labels, labels_at(out.labels, (150, 210), "smooth")[0].numpy())
    np.testing.assert_array_equal(b.labels, labels_at(out.labels, (150, 210), "nearest")[0].numpy())
    assert (a.labels != b.labels).any() and a.labels.max() > 0
    for r in (a, b):
        np.testing.assert_array_equal(r.mask, r.foreground[r.labels])
    np.testing.assert_array_equal(a.heatmap, b.heatmap)
    with pytest.raises(ValueError, match="label_upsampling must be one of"):
        segment.load("vit_tiny_random", device="cpu", image_size=56, label_upsampling="cubic")
    base = compose_config("vit_tiny_random")
    other = compose_config("vit_tiny_random", label_upsampling="nearest")
    assert config_fingerprint(base) != config_fingerprint(other)


# ----------------------------------------------------------------------------- inputs


def test_every_input_form_gives_the_same_result(tmp_path):
    seg = segment.load("vit_tiny_random", device="cpu", image_size=56)
    im = _img(37, 51, 0)
    path = tmp_path / "a.png"
    im.save(path)
    arr = np.array(im)
    forms = [str(path), path, im, im.convert("RGBA"), arr, torch.from_numpy(arr).permute(2, 0, 1).float() / 255]
    results = [seg(x) for x in forms]
    ref = results[0]
    assert isinstance(ref, Result) and ref.size == (37, 51)
    assert ref.mask.dtype == bool and ref.mask.shape == (37, 51)
    assert ref.heatmap.dtype == np.float32 and ref.heatmap.shape == (37, 51)
    assert 0.0 <= ref.heatmap.min() and ref.heatmap.max() <= 1.0
    assert ref.labels.dtype == np.int32 and ref.labels.shape == (37, 51)
    assert ref.foreground.dtype == bool and ref.labels.max() < len(ref.foreground)
    np.testing.assert_array_equal(ref.mask, ref.foreground[ref.labels])  # union of fg regions
    assert ref.record.batch_size == 1 and ref.record.layout.grid == (4, 4)
    for r in results[1:]:
        np.testing.assert_array_equal(r.mask, ref.mask)
        np.testing.assert_array_equal(r.heatmap, ref.heatmap)
        np.testing.assert_array_equal(r.labels, ref.labels)
    # a list is a batch: same results, in order, whatever the image sizes
    many = seg([im, _img(20, 30, 1), arr, _img(60, 40, 2)])
    assert [r.size for r in many] == [(37, 51), (20, 30), (37, 51), (60, 40)]
    np.testing.assert_array_equal(many[2].mask, ref.mask)
    for r, single in zip(many, [seg(x) for x in [im, _img(20, 30, 1), arr, _img(60, 40, 2)]]):
        np.testing.assert_array_equal(r.mask, single.mask)


def test_bad_inputs_say_what_came(tmp_path):
    seg = segment.load("vit_tiny_random", "cls_attention", device="cpu", image_size=56)
    for bad in (np.zeros((10, 10, 2), np.uint8), np.zeros((2, 10, 10, 3), np.uint8), torch.zeros(8, 8, 5)):
        with pytest.raises(ValueError, match=r"cannot read a (numpy array|tensor) of shape .* as an image: .*\(3, H, W\)"):
            seg(bad)
    with pytest.raises(ValueError, match=r"uint8 \(0..255\) or float \(\[0, 1\]\) to be an image, got \(10, 10, 3\) int64"):
        seg(np.zeros((10, 10, 3), np.int64))
    with pytest.raises(ValueError, match=r"values in \[0, 1\]"):
        seg(torch.full((3, 8, 8), 2.0))
    with pytest.raises(ValueError, match="image 1: cannot segment a dict"):
        seg([_img(20, 20, 0), {}])
    (tmp_path / "bad.png").write_text("nope")
    with pytest.raises(Exception, match="bad.png: not a readable image"):
        seg(tmp_path / "bad.png")
    r = seg(_img(30, 20, 0))
    assert r.labels is None and r.foreground is None and r.mask.shape == (30, 20)


def test_grey_and_rgba_arrays_are_read_like_files(tmp_path):
    """A (H, W) uint8 array is the grey image, a (H, W, 4) one RGBA composited on white: the
    same pixels as the PNG files of those arrays, read by the command's reader."""
    rng = np.random.default_rng(0)
    grey = rng.integers(0, 256, (20, 30), dtype=np.uint8)
    rgba = rng.integers(0, 256, (20, 30, 4), dtype=np.uint8)
    for a, name in ((grey, "grey.png"), (rgba, "rgba.png")):
        Image.fromarray(a).save(tmp_path / name)
        got = to_image(a)
        assert got.mode == "RGB" and got.size == (30, 20)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(read_image(tmp_path / name).image))
    np.testing.assert_array_equal(np.asarray(to_image(grey))[..., 1], grey)
    opaque = rgba.copy()
    opaque[..., 3] = 255
    np.testing.assert_array_equal(np.asarray(to_image(opaque)), rgba[..., :3])
    seg = segment.load("vit_tiny_random", device="cpu", image_size=56)
    np.testing.assert_array_equal(seg(grey).mask, seg(np.repeat(grey[..., None], 3, 2)).mask)


def test_show_draws_the_overlay():
    seg = segment.load("vit_tiny_random", device="cpu", image_size=56)
    im = _img(40, 60, 3)
    r = seg(im)
    ov = segment.show(r)
    assert isinstance(ov, Image.Image) and ov.size == (60, 40) and ov.mode == "RGB"
    a, o = np.asarray(im).astype(int), np.asarray(ov).astype(int)
    assert np.abs(a - o).mean() > 5  # tinted
    assert r._repr_png_()[:4] == b"\x89PNG"
    r2 = Result(mask=r.mask, heatmap=r.heatmap, labels=r.labels, foreground=r.foreground)
    with pytest.raises(ValueError, match="carries no image"):
        segment.show(r2)
    np.testing.assert_array_equal(np.asarray(segment.show(r2, im)), np.asarray(ov))


def test_a_result_prints_as_a_short_summary():
    seg = segment.load("vit_tiny_random", device="cpu", image_size=56)
    r = seg(_img(40, 60, 3))
    text = repr(r)
    assert len(text) < 120 and "\n" not in text, text
    regions = np.unique(r.labels)
    assert text == (f"Result(60x40, foreground {100 * r.mask.mean():.1f}%, {len(regions)} regions "
                    f"({int(r.foreground[regions].sum())} foreground), record kept)")
    binary = Result(mask=np.array([[True, False]]), heatmap=np.zeros((1, 2), np.float32), labels=None, foreground=None)
    assert repr(binary) == "Result(2x1, foreground 50.0%, no record)"


# ----------------------------------------------------------------------------- the command


def test_pipeline_computes_through_the_segmenter(tmp_path, monkeypatch):
    """run_segment's batches go through the stages of Segmenter.forward (extract, apply) and
    Segmenter.postprocess (one code path)."""
    from hydra import compose, initialize_config_module

    from segment.run.job.pipeline import run_segment

    calls = {"extract": 0, "apply": 0, "post": 0}
    ext, app, post = Segmenter.extract, Segmenter.apply, Segmenter.postprocess

    def extract(self, pixels):
        calls["extract"] += 1
        return ext(self, pixels)

    def apply(self, record):
        calls["apply"] += 1
        return app(self, record)

    def postprocess(self, out, index, size):
        calls["post"] += 1
        return post(self, out, index, size)

    monkeypatch.setattr(Segmenter, "extract", extract)
    monkeypatch.setattr(Segmenter, "apply", apply)
    monkeypatch.setattr(Segmenter, "postprocess", postprocess)
    src = tmp_path / "in"
    src.mkdir()
    for i in range(5):
        _img(30 + i, 40, i).save(src / f"{i}.png")
    with initialize_config_module(version_base="1.3", config_module="segment.configs"):
        cfg = compose("segment", overrides=[f"input={src}", f"output={tmp_path / 'o'}", "model=vit_tiny_random",
                                            "device=cpu", "batch_size=2", "progress=false", "render.fsync=false"])
    assert run_segment(cfg) == 0
    assert calls == {"extract": 3, "apply": 3, "post": 5}


@pytest.mark.parametrize("method", ["regions", "cls_attention", "kmeans"])
def test_apply_is_the_method_on_the_whole_batch(method):
    """Segmenter.apply runs the method once on the whole batch, on this thread's torch
    threads, and hands its output to the CPU unchanged."""
    torch.manual_seed(103)
    seg = segment.load("vit_tiny_random", method=method, device="cpu", image_size=112)
    record = seg.extract(torch.stack([seg.preprocess(_img(40 + 3 * i, 56, i)) for i in range(5)]))
    with torch.no_grad():
        whole = seg.method(record)
    got = seg.apply(record)
    assert torch.equal(got.heatmap, whole.heatmap.float())
    for a, b in ((got.labels, whole.labels), (got.foreground, whole.foreground)):
        assert (a is None and b is None) or torch.equal(a, b)



def test_concat_outputs_and_record_images():
    from segment.core.masks import MethodOutput, concat_outputs
    from segment.core.record import AttentionRecord, TokenLayout

    a = MethodOutput(heatmap=torch.zeros(2, 3, 3), labels=torch.zeros(2, 6, 6, dtype=torch.long),
                     foreground=torch.tensor([[True, False], [False, True]]))
    b = MethodOutput(heatmap=torch.ones(1, 3, 3), labels=torch.ones(1, 6, 6, dtype=torch.long),
                     foreground=torch.tensor([[False, True, True]]))
    c = concat_outputs([a, b])
    assert c.heatmap.shape == (3, 3, 3) and c.labels.shape == (3, 6, 6)
    assert c.foreground.tolist() == [[True, False, False], [False, True, False], [False, True, True]]
    assert concat_outputs([MethodOutput(heatmap=torch.zeros(1, 2, 2))] * 2).labels is None
    layout = TokenLayout(num_tokens=5, prefix=1, grid=(2, 2))
    attn = torch.rand(4, 2, 5, 5)
    rec = AttentionRecord(attn={11: attn}, layout=layout, image_size=(28, 28), keys={11: attn[..., :3]},
                          query=[(0,), (1,), (2,), (3,)], pixels=torch.rand(4, 3, 28, 28))
    part = rec.images(1, 3)
    assert part.batch_size == 2 and part.query == [(1,), (2,)]
    assert torch.equal(part.attn[11], attn[1:3]) and part.attn[11].data_ptr() == attn[1].data_ptr()
    assert torch.equal(part.keys[11], attn[1:3, ..., :3]) and torch.equal(part.pixels, rec.pixels[1:3])
    with pytest.raises(ValueError, match="extras"):
        AttentionRecord(attn={0: attn}, layout=layout, image_size=(28, 28),
                        extras={"concept": attn}).images(0, 1)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="2")
    return subprocess.run([str(SEGMENT), *args], capture_output=True, text=True, timeout=300, env=env)


def test_api_masks_equal_cli_masks(tmp_path, tiny_checkpoint):
    """The command (a subprocess) and the API, same weights and settings: identical files."""
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    sizes = [(40, 60), (50, 30), (33, 47), (64, 64), (45, 45)]
    for i, (h, w) in enumerate(sizes):
        _img(h, w, 10 + i).save(src / f"{i}.png")
    _img(44, 52, 20).convert("L").save(src / "5.png")  # a grey file: read the same way
    r = _cli(f"input={src}", f"output={out}", "model=vit_tiny_random", f"model.checkpoint={tiny_checkpoint}",
             "model.image_size=112", "device=cpu", "batch_size=4", "progress=false", "render.fsync=false")
    assert r.returncode == 0, r.stderr
    seg = segment.load("vit_tiny_random", checkpoint=tiny_checkpoint, device="cpu", image_size=112, batch_size=4)
    names = [f"{i}" for i in range(6)]
    results = seg([src / f"{n}.png" for n in names])
    assert any(res.mask.any() and not res.mask.all() for res in results)
    assert_results_equal_files(results, out, names)


# the real weights on the bundled examples (the README's first command, the API beside it):
# tests/test_golden.py::test_segment_examples_byte_identical, on the same run as the manifest


def test_readme_snippet_runs(tmp_path, monkeypatch, dinov2_weights):
    """The first ```python block of the README, run as written in a folder with photo.jpg;
    `segment.load` gets the shared weights as its checkpoint default (no network here)."""
    text = (REPO / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    assert "segment.load(" in snippet and "segment.show(" in snippet
    src = read_image(REPO / "datasets" / "examples" / "chelsea.png").image
    src.save(tmp_path / "photo.jpg", quality=95)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(segment.run.api.segmenter, "load", functools.partial(segment.run.api.segmenter.load, checkpoint=dinov2_weights,
                                                                device="cpu"))
    ns: dict = {}
    exec(compile(snippet, "README.md", "exec"), ns)
    res = ns["res"]
    assert res.mask.shape == (src.height, src.width)
    assert Image.open(tmp_path / "overlay.jpg").size == src.size
    np.testing.assert_array_equal(to_image(tmp_path / "photo.jpg").size, src.size)


def test_tokenrank_convergence_reaches_the_api():
    """``Segmenter.apply`` keeps the method's ``converged`` flags (``None`` for methods
    without an iteration)."""
    from segment.run.api.segmenter import to_image

    px = None
    for method, want in (("tokenrank", [True]), ("cls_attention", None)):
        seg = segment.load(model="vit_tiny_random", method=method, device="cpu")
        px = seg.preprocess(to_image(np.full((64, 64, 3), 100, np.uint8)))
        out = seg.forward([px]).out
        assert (out.converged.tolist() if out.converged is not None else None) == want
    seg = segment.load(model="vit_tiny_random", method="tokenrank", device="cpu", max_iter=1,
                       tol=1e-30)
    assert seg.forward([px]).out.converged.tolist() == [False]
