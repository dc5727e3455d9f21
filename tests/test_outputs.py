"""The files of a `segment` run (segment.run.api.render, segment.run.job.records, coco, manifest, gallery): post-processing, per-image files, COCO, gallery, atomic writes."""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from PIL import Image
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO

import segment.utils
from segment.core.masks import MethodOutput, threshold_mean
from segment.run.api import render
from segment.run.job import coco, records
from segment.run.api.render import (
    RenderOptions,
    Segmentation,
    colorize,
    label_image,
    palette,
    postprocess,
)
from segment.run.job.coco import (
    BACKGROUND_ID,
    FOREGROUND_ID,
    build_coco,
    coco_annotations,
    write_coco,
)
from segment.run.job.gallery import render_gallery, write_gallery
from segment.run.job.records import load_record, record_is_current, rel_output, write_image

FAST = RenderOptions(fsync=False, thumb_size=32)


# pycocotools 2.0.11 + numpy 2: a deprecation warning inside annToMask, not ours
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

def _image(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _binary_seg(h: int = 30, w: int = 45) -> Segmentation:
    grid = torch.zeros(1, 3, 4)
    grid[0, 1, 1:3] = 1.0  # a blob in the middle of a 3 x 4 grid
    return postprocess(MethodOutput(heatmap=grid), 0, (h, w))


def _region_seg(h: int = 30, w: int = 40) -> Segmentation:
    labels = torch.tensor([[[0, 0, 1, 1], [0, 2, 2, 1], [3, 3, 2, 1]]])  # (1, 3, 4), 4 regions
    fg = torch.tensor([[False, True, True, False]])
    heat = torch.rand(1, 3, 4, generator=torch.Generator().manual_seed(0))
    return postprocess(MethodOutput(heatmap=heat, labels=labels, foreground=fg), 0, (h, w))


def _fields(name: str, **kw) -> dict:
    return dict(source=f"{name}.png", source_path=f"/nowhere/{name}.png", source_bytes=10,
                source_mtime_ns=5, fingerprint="fp", **kw)


# ----------------------------------------------------------------------------- post-processing


def test_single_threaded_rendering_restores_opencv_threads_on_error():
    cv2.setNumThreads(2)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            with render.single_threaded_rendering():
                assert cv2.getNumThreads() == 1
                raise RuntimeError("boom")
        assert cv2.getNumThreads() == 2
    finally:
        cv2.setNumThreads(-1)


def test_postprocess_follows_protocol_at_original_size():
    heat = torch.rand(2, 4, 6, generator=torch.Generator().manual_seed(1))
    out = MethodOutput(heatmap=heat)
    seg = postprocess(out, 1, (37, 53))
    assert seg.heatmap.shape == (37, 53) and seg.mask.dtype == bool
    # float64 reference: bilinear (align_corners=False), min-max, > mean
    ref = torch.nn.functional.interpolate(heat[1:2, None].double(), size=(37, 53), mode="bilinear",
                                          align_corners=False)[0, 0]
    ref = (ref - ref.min()) / (ref.max() - ref.min())
    np.testing.assert_allclose(seg.heatmap, ref.numpy(), atol=1e-6)
    np.testing.assert_array_equal(seg.mask, threshold_mean(torch.from_numpy(seg.heatmap)[None])[0].numpy())
    assert seg.labels is None


def test_postprocess_regions_union_of_foreground():
    seg = _region_seg(6, 8)  # grid 3 x 4 -> 6 x 8: each label becomes a 2 x 2 block
    want_labels = np.repeat(np.repeat(np.array([[0, 0, 1, 1], [0, 2, 2, 1], [3, 3, 2, 1]]), 2, 0), 2, 1)
    np.testing.assert_array_equal(seg.labels, want_labels)
    np.testing.assert_array_equal(seg.mask, np.isin(want_labels, [1, 2]))
    np.testing.assert_array_equal(seg.foreground, [False, True, True, False])


# ----------------------------------------------------------------------------- rendering


def test_palette_distinct_and_colorize():
    p = palette(40)
    assert p.shape == (40, 3) and len({tuple(c) for c in p}) == 40
    c = colorize(np.array([[0.0, 1.0]]), "inferno")
    assert c.shape == (1, 2, 3) and c.dtype == np.uint8 and c[0, 1].sum() > c[0, 0].sum()
    with pytest.raises(ValueError, match="unknown colormap"):
        RenderOptions(colormap="nope")


def test_quantize_rounds_half_to_even_and_saturates():
    # the one-pass OpenCV conversion equals the definition round(255 R) with numpy's
    # round-half-to-even, on exact float32 ties and their neighbours, and saturates
    ties = ((np.arange(256) + 0.5) / 255).astype(np.float32)
    near = [np.nextafter(ties, np.float32(d)) for d in (-1, 2)]
    rng = np.random.default_rng(0)
    r = np.concatenate([ties, *near, rng.random(20000, dtype=np.float32),
                        np.float32([0.0, 1.0, -0.3, 1.7])]).reshape(1, -1)
    assert (np.float32(255) * r == np.floor(np.float32(255) * r) + 0.5).sum() > 100  # real ties
    want = np.clip(np.rint(r * 255.0), 0, 255).astype(np.uint8)
    np.testing.assert_array_equal(render.quantize(r), want)


@pytest.mark.parametrize("k", [7, 256, 300])
def test_region_colors_are_the_palette_gather(k):
    lab = np.random.default_rng(k).integers(0, k, (23, 31)).astype(np.int32)
    got = render.region_colors(lab, k)
    assert got.dtype == np.uint8 and got.flags.c_contiguous
    np.testing.assert_array_equal(got, palette(k)[lab])


def test_label_image_indexed_png(tmp_path):
    lab = np.array([[0, 1], [2, 3]])
    im = label_image(lab, 4)
    im.save(tmp_path / "l.png")
    back = Image.open(tmp_path / "l.png")
    assert back.mode == "P"
    np.testing.assert_array_equal(np.asarray(back), lab)
    np.testing.assert_array_equal(np.asarray(back.convert("RGB"))[1, 1], palette(4)[3])
    big = label_image(np.array([[0, 300]]), 301)  # more than a palette holds: 16-bit
    big.save(tmp_path / "b.png")
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "b.png")), [[0, 300]])


# ----------------------------------------------------------------------------- per-image files


def test_write_image_binary_files_at_original_resolution(tmp_path):
    seg = _binary_seg(30, 45)
    img = _image(30, 45)
    rec = write_image(tmp_path, "sub/cat", img, seg, FAST, **_fields("sub/cat"))
    m = np.asarray(Image.open(tmp_path / "masks/sub/cat.png"))
    assert m.shape == (30, 45) and set(np.unique(m)) == {0, 255}
    np.testing.assert_array_equal(m == 255, seg.mask)
    h = Image.open(tmp_path / "heatmaps/sub/cat.png")
    assert h.size == (45, 30) and h.mode == "P"  # colours for viewers, R for programs
    np.testing.assert_array_equal(np.asarray(h.convert("RGB")), colorize(seg.heatmap, FAST.colormap))
    np.testing.assert_allclose(np.asarray(h) / 255.0, seg.heatmap, atol=0.5 / 255 + 1e-6)
    o = Image.open(tmp_path / "overlays/sub/cat.jpg")
    assert o.size == (45, 30) and o.format == "JPEG"
    for col in ("image", "heatmap", "mask", "overlay"):
        t = Image.open(tmp_path / f"gallery/{col}/sub/cat.jpg")
        assert max(t.size) <= 32
    assert not (tmp_path / "labels").exists()
    # the record is on disk and describes the files
    back = load_record(tmp_path, "sub/cat")
    assert back == rec and rec.width == 45 and rec.height == 30
    assert rec.outputs["mask"] == "masks/sub/cat.png" == rel_output("mask", "sub/cat")
    assert rec.outputs["thumb/overlay"] == "gallery/overlay/sub/cat.jpg" and rec.num_regions is None
    with pytest.raises(ValueError, match="unknown output kind"):
        rel_output("masks", "x")
    assert rec.mask_fraction == pytest.approx(seg.mask.mean())
    assert len(rec.annotations) == 1 and rec.annotations[0]["category_id"] == FOREGROUND_ID


def test_redoing_an_image_with_a_heatmap_method_removes_its_old_region_labels(tmp_path):
    # a region method, then a heatmap method into the same folder: labels/ and its thumbnail
    # of the first run must not stay next to the new masks as if they were this run's
    img = _image(30, 40, 1)
    first = write_image(tmp_path, "a", img, _region_seg(30, 40), FAST, **_fields("a"))
    assert (tmp_path / first.outputs["labels"]).is_file() and (tmp_path / first.outputs["thumb/labels"]).is_file()
    other = write_image(tmp_path, "b", img, _region_seg(30, 40), FAST, **_fields("b"))
    again = write_image(tmp_path, "a", img, _binary_seg(30, 40), FAST, **_fields("a"))
    assert "labels" not in again.outputs
    assert not (tmp_path / first.outputs["labels"]).exists()
    assert not (tmp_path / first.outputs["thumb/labels"]).exists()
    assert (tmp_path / other.outputs["labels"]).is_file()  # other images keep theirs
    assert load_record(tmp_path, "a") == again


def test_coco_roundtrip_binary_and_regions(tmp_path):
    seg_b, seg_r = _binary_seg(30, 45), _region_seg(30, 40)
    recs = [
        write_image(tmp_path, "a", _image(30, 45), seg_b, FAST, **_fields("a")),
        write_image(tmp_path, "b", _image(30, 40, 1), seg_r, FAST, **_fields("b")),
    ]
    write_coco(tmp_path / "annotations.json", recs, info={"description": "t"})
    coco = COCO(str(tmp_path / "annotations.json"))
    assert sorted(coco.getImgIds()) == [1, 2]
    assert {c["name"] for c in coco.loadCats(coco.getCatIds())} == {"foreground", "background"}
    (ann,) = coco.loadAnns(coco.getAnnIds(imgIds=[1]))
    np.testing.assert_array_equal(coco.annToMask(ann).astype(bool), seg_b.mask)
    assert ann["area"] == int(seg_b.mask.sum())
    ys, xs = np.nonzero(seg_b.mask)
    assert ann["bbox"] == [xs.min(), ys.min(), xs.max() - xs.min() + 1, ys.max() - ys.min() + 1]
    assert ann["score"] == pytest.approx(seg_b.heatmap[seg_b.mask].mean(), rel=1e-6)
    # one annotation per region, category from the foreground decision
    anns = coco.loadAnns(coco.getAnnIds(imgIds=[2]))
    assert sorted(a["region_id"] for a in anns) == [0, 1, 2, 3]
    for a in anns:
        k = a["region_id"]
        np.testing.assert_array_equal(coco.annToMask(a).astype(bool), seg_r.labels == k)
        assert a["category_id"] == (FOREGROUND_ID if seg_r.foreground[k] else BACKGROUND_ID)
    fg_union = np.zeros_like(seg_r.mask)
    for a in anns:
        if a["category_id"] == FOREGROUND_ID:
            fg_union |= coco.annToMask(a).astype(bool)
    np.testing.assert_array_equal(fg_union, seg_r.mask)
    # results format works with loadRes too (scores present)
    res = coco.loadRes([{k: v for k, v in a.items() if k != "id"} for a in coco.dataset["annotations"]])
    assert len(res.getAnnIds()) == len(coco.getAnnIds())


def test_region_outputs_labels_png_and_overlay(tmp_path):
    seg = _region_seg(30, 40)
    rec = write_image(tmp_path, "r", _image(30, 40), seg, FAST, **_fields("r"))
    lab = Image.open(tmp_path / "labels/r.png")
    assert lab.mode == "P" and lab.size == (40, 30)
    np.testing.assert_array_equal(np.asarray(lab), seg.labels)
    assert rec.num_regions == 4 and rec.outputs["labels"] == "labels/r.png"
    assert (tmp_path / "gallery/labels/r.jpg").is_file()
    # overlay pixels carry the region colour (tinted), not just the image
    over = np.asarray(Image.open(tmp_path / "overlays/r.jpg")).astype(int)
    plain = write_image(tmp_path / "p", "r", _image(30, 40), _binary_seg(30, 40), FAST, **_fields("r"))
    assert plain.num_regions is None
    assert np.abs(over - _image(30, 40).astype(int)).mean() > 20


def _coco_annotations_reference(seg: Segmentation) -> list[dict]:
    """One mask per region: the direct definition that coco_annotations must equal."""
    if seg.labels is None:
        parts = [(None, seg.mask, coco.FOREGROUND_ID)]
    else:
        parts = []
        for k in np.unique(seg.labels).tolist():
            fg = bool(seg.foreground[k]) if k < len(seg.foreground) else False
            parts.append((int(k), seg.labels == k, coco.FOREGROUND_ID if fg else coco.BACKGROUND_ID))
    anns = []
    for region, m, cat in parts:
        if not m.any():
            continue
        rle = mask_utils.encode(np.asfortranarray(m.astype(np.uint8)))
        ann = coco._annotation(rle, cat, float(seg.heatmap[m].mean()), region)
        if region is not None:  # a region's two numbers (null without a hierarchy)
            for key, values in (("height", seg.region_height), ("escape", seg.region_escape)):
                ann[key] = None if values is None else round(float(values[region]), 6)
        anns.append(ann)
    return anns


@pytest.mark.parametrize("case", ["blocks", "noise", "one", "edges", "many"])
def test_region_annotations_equal_one_mask_per_region(case):
    # the one-pass RLEs and grouped scores equal the direct definition, byte for byte
    rng = np.random.default_rng(len(case))
    h, w = 37, 53
    if case == "blocks":
        lab = np.kron(rng.integers(0, 6, (4, 6)), np.ones((10, 10), np.int64))[:h, :w]
    elif case == "noise":
        lab = rng.integers(0, 9, (h, w))
    elif case == "one":
        lab = np.zeros((h, w), np.int64)
    elif case == "edges":  # regions touching the first and the last pixel, ids with gaps
        lab = np.full((h, w), 7, np.int64)
        lab[0, 0] = 2
        lab[-1, -1] = 5
        lab[:, 10] = 2
    else:  # more ids than a palette holds
        lab = rng.integers(0, 300, (h, w))
    fg = rng.random(int(lab.max()) + 1) > 0.5
    heat = rng.random((h, w)).astype(np.float32)
    seg = Segmentation(heatmap=heat, mask=fg[lab], labels=lab, foreground=fg)
    if case in ("blocks", "edges"):  # with a hierarchy's values: NaN for the absent ids
        k = int(lab.max()) + 1
        absent = np.bincount(lab.ravel(), minlength=k) == 0
        seg.region_height = np.where(absent, np.nan, rng.random(k) * 2)
        seg.region_escape = np.where(absent, np.nan, rng.random(k))
    got, ref = coco_annotations(seg), _coco_annotations_reference(seg)
    assert [a["region_id"] for a in got] == sorted(np.unique(lab).tolist())
    assert json.dumps(got) == json.dumps(ref)
    assert all(("height" in a) and ("escape" in a) for a in got)
    if seg.region_height is not None:  # every present id has its values, rounded as written
        assert all(a["height"] == round(float(seg.region_height[a["region_id"]]), 6)
                   and a["height"] is not None for a in got)


def test_empty_mask_gives_no_annotation():
    seg = postprocess(MethodOutput(heatmap=torch.ones(1, 2, 2)), 0, (4, 4))  # constant map
    assert not seg.mask.any() and coco_annotations(seg) == []


def test_record_is_current(tmp_path):
    rec = write_image(tmp_path, "a", _image(8, 8), _binary_seg(8, 8), FAST, **_fields("a"))
    ok = dict(fingerprint="fp", source_bytes=10, source_mtime_ns=5)
    assert record_is_current(rec, tmp_path, **ok)
    assert not record_is_current(rec, tmp_path, **{**ok, "fingerprint": "other"})
    assert not record_is_current(rec, tmp_path, **{**ok, "source_mtime_ns": 6})
    assert not record_is_current(None, tmp_path, **ok)
    (tmp_path / "overlays/a.jpg").unlink()
    assert not record_is_current(rec, tmp_path, **ok)
    (tmp_path / "records/a.json").write_text("{broken")
    assert load_record(tmp_path, "a") is None


# ----------------------------------------------------------------------------- atomic writes


def _all_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


@pytest.mark.parametrize("fail_at", [1, 3, 6])
@pytest.mark.parametrize("exc", [KeyboardInterrupt, OSError])
def test_crash_mid_write_leaves_no_truncated_files(tmp_path, monkeypatch, fail_at, exc):
    """A crash (Ctrl-C, disk error) at any rename: old or complete files, no temp files, no
    record; the rerun completes."""
    old = write_image(tmp_path, "x", _image(20, 30, 1), _binary_seg(20, 30), FAST, **_fields("x"))
    assert load_record(tmp_path, "x") == old
    new_seg = _region_seg(20, 30)
    calls = {"n": 0}
    real_replace = os.replace

    def flaky_replace(src, dst):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise exc("simulated crash")
        return real_replace(src, dst)

    monkeypatch.setattr(segment.utils.os, "replace", flaky_replace)
    with pytest.raises(exc):
        write_image(tmp_path, "x", _image(20, 30, 2), new_seg, FAST, **_fields("x"))
    monkeypatch.setattr(segment.utils.os, "replace", real_replace)
    assert load_record(tmp_path, "x") is None  # not marked done
    files = _all_files(tmp_path)
    assert not [p for p in files if p.name.endswith(".tmp")]
    for p in files:  # every file present decodes completely
        if p.suffix in (".png", ".jpg"):
            with Image.open(p) as im:
                im.load()
    rec = write_image(tmp_path, "x", _image(20, 30, 2), new_seg, FAST, **_fields("x"))
    assert load_record(tmp_path, "x") == rec and rec.num_regions == 4


@pytest.mark.parametrize("fail_at", [1, 4, 9])
def test_a_full_disk_mid_image_leaves_none_of_its_files(tmp_path, monkeypatch, fail_at):
    """ENOSPC at the n-th file of an image: OutputWriteError (an OSError naming the file), and
    none of the image's files is left, neither new ones nor the ones an earlier record
    vouched for; another image's files are untouched; with room again the image is written."""
    other = write_image(tmp_path, "other", _image(12, 14, 3), _binary_seg(12, 14), FAST, **_fields("other"))
    write_image(tmp_path, "x", _image(20, 30, 1), _binary_seg(20, 30), FAST, **_fields("x"))
    before = {p: p.read_bytes() for p in _all_files(tmp_path)}
    calls = {"n": 0}
    real = records.atomic_write_bytes

    def filling(path, data, fsync=True):
        calls["n"] += 1
        if calls["n"] >= fail_at:
            raise OSError(28, "No space left on device", str(path))
        return real(path, data, fsync)

    monkeypatch.setattr(records, "atomic_write_bytes", filling)
    with pytest.raises(records.OutputWriteError) as got:
        write_image(tmp_path, "x", _image(20, 30, 2), _region_seg(20, 30), FAST, **_fields("x"))
    assert got.value.errno == 28 and isinstance(got.value, OSError)
    assert "No space left on device" in str(got.value) and str(got.value.path).startswith(str(tmp_path))
    monkeypatch.setattr(records, "atomic_write_bytes", real)
    left = _all_files(tmp_path)
    assert [p for p in left if "x" in p.stem] == [], left
    assert {p: p.read_bytes() for p in left} == {p: b for p, b in before.items() if "x" not in p.stem}
    assert load_record(tmp_path, "other") == other
    rec = write_image(tmp_path, "x", _image(20, 30, 2), _region_seg(20, 30), FAST, **_fields("x"))
    assert load_record(tmp_path, "x") == rec and all((tmp_path / r).is_file() for r in rec.outputs.values())


@pytest.mark.parametrize("fsync", [True, False])
def test_atomic_write_bytes_short_writes_full_disk_and_missing_folder(tmp_path, monkeypatch, fsync):
    """Short ``os.write``s are continued; a write that fails (disk full) leaves the old
    content and no temporary file; a missing folder is created."""
    from segment.utils import atomic_write_bytes

    target = tmp_path / "new" / "deeper" / "f.bin"
    real_write = os.write
    monkeypatch.setattr(segment.utils.os, "write", lambda fd, b: real_write(fd, bytes(b[:3])))
    atomic_write_bytes(target, b"0123456789", fsync)
    assert target.read_bytes() == b"0123456789"

    def full(fd, b):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(segment.utils.os, "write", full)
    with pytest.raises(OSError, match="No space"):
        atomic_write_bytes(target, b"other", fsync)
    monkeypatch.setattr(segment.utils.os, "write", real_write)
    assert target.read_bytes() == b"0123456789"
    assert [p.name for p in target.parent.iterdir()] == ["f.bin"]


def test_fsync_path_writes_same_bytes(tmp_path):
    seg = _binary_seg(10, 12)
    a = write_image(tmp_path / "a", "x", _image(10, 12), seg, RenderOptions(fsync=True), **_fields("x"))
    b = write_image(tmp_path / "b", "x", _image(10, 12), seg, RenderOptions(fsync=False), **_fields("x"))
    for kind in ("mask", "heatmap", "overlay"):
        assert (tmp_path / "a" / a.outputs[kind]).read_bytes() == (tmp_path / "b" / b.outputs[kind]).read_bytes()


# ----------------------------------------------------------------------------- gallery


def _links(html_text: str) -> list[str]:
    return [urllib.parse.unquote(v) for v in re.findall(r'(?:src|href)="([^"]+)"', html_text)]


def test_gallery_references_existing_files(tmp_path):
    out = tmp_path / "out"
    src = tmp_path / "in" / "we ird & <name>.png"
    src.parent.mkdir()
    Image.fromarray(_image(20, 30)).save(src)
    recs = [
        write_image(out, "we ird & <name>", _image(20, 30), _binary_seg(20, 30), FAST,
                    **{**_fields("x"), "source_path": str(src)}),
        write_image(out, "sub/r", _image(20, 30), _region_seg(20, 30), FAST, **_fields("sub/r")),
    ]
    write_gallery(out / "index.html", recs, skipped=[{"path": "bad.jpg", "reason": "empty file (0 bytes)"}],
                  ignored=[{"path": "notes.txt", "reason": "not an image extension"}])
    text = (out / "index.html").read_text()
    assert "<th>labels</th>" in text and "empty file (0 bytes)" in text and "bad.jpg" in text
    # one word for a file that could not be segmented, another for one that is not an image
    assert "<h2>Skipped (1)</h2>" in text and "<h2>Ignored (1)</h2>" in text and "Not processed" not in text
    assert text.index("bad.jpg") < text.index("<h2>Ignored") < text.index("notes.txt")
    assert "&lt;name&gt;" in text and "<name>" not in text  # escaped
    links = _links(text)
    assert len(links) == 2 * (5 * 2) - 2  # 2 rows x 5 columns (img + link); no labels thumb for binary
    for rel in links:
        assert not rel.startswith("/") and "://" not in rel, rel  # relative: opens from disk
        if "nowhere/" in rel:  # the second record's source does not exist, by design
            continue
        assert (out / rel).is_file(), rel
    assert any(Path(out / r).resolve() == src.resolve() for r in links)  # the image cell links the source


def test_build_coco_ids_and_json_serialisable(tmp_path):
    recs = [write_image(tmp_path, n, _image(8, 8), _binary_seg(8, 8), FAST, **_fields(n)) for n in ("b", "a")]
    d = build_coco(recs)
    assert [im["segment_name"] for im in d["images"]] == ["b", "a"]
    assert [a["id"] for a in d["annotations"]] == [1, 2] and [a["image_id"] for a in d["annotations"]] == [1, 2]
    json.dumps(d)
    assert render_gallery(tmp_path, []).count("<tr>") == 1  # header only


def test_thumbnails_are_small_for_big_images(tmp_path):
    seg = _binary_seg(300, 500)
    rec = write_image(tmp_path, "big", _image(300, 500), seg, RenderOptions(fsync=False, thumb_size=64), **_fields("big"))
    t = cv2.imread(str(tmp_path / rec.outputs["thumb/overlay"]))
    assert t.shape[:2] == (38, 64)


def test_gallery_legend_and_region_keys(tmp_path):
    """The colour bar is the run's colour map; under each label map, the regions the
    method called foreground are ringed, the others plain, in their palette colours."""
    from segment.run.api.render import colormap_lut, palette

    seg = _region_seg(20, 30)
    rec = write_image(tmp_path, "sub/long_name-with parts", _image(20, 30), seg, FAST, **_fields("r"))
    text = render_gallery(tmp_path, [rec], colormap="viridis")
    lut = colormap_lut("viridis")
    stops = re.search(r'class="bar" style="background:linear-gradient\(to right,([^)]*)\)"', text).group(1).split(",")
    assert len(stops) == 17 and stops[0] == "#%02x%02x%02x" % tuple(lut[0]) and stops[-1] == "#%02x%02x%02x" % tuple(lut[255])
    assert "<b>labels</b>" in text and "<b>mask</b>" in text
    key = re.search(r'<div class="key">(.*?)</div>', text).group(1)
    fg_part, bg_part = key.split("<br>")
    present = np.unique(seg.labels).tolist()
    pal = palette(max(present) + 1)
    for k in present:
        swatch = f'style="background:#{"".join(f"{int(c):02x}" for c in pal[k])}"'
        assert swatch in (fg_part if seg.foreground[k] else bg_part), k
    assert fg_part.count('class="sw fg"') == sum(bool(seg.foreground[k]) for k in present)
    assert "sub/<wbr>long_<wbr>name-<wbr>with <wbr>parts" in text  # breaks only after separators
    binary = write_image(tmp_path, "b", _image(20, 30), _binary_seg(20, 30), FAST, **_fields("b"))
    text = render_gallery(tmp_path, [binary])
    assert 'class="key"' not in text and "outlined in green" in text


# ----------------------------------------------------------------------------- label upsampling


def _onehot_bilinear(lab: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``(B, K, H, W)`` float64: the regions' one-hot maps upsampled bilinearly."""
    k = int(lab.max()) + 1
    oh = torch.nn.functional.one_hot(lab, k).permute(0, 3, 1, 2).double()
    return torch.nn.functional.interpolate(oh, size=size, mode="bilinear", align_corners=False)


@pytest.mark.parametrize("numpy_path", [True, False])  # False: the path of CUDA tensors
def test_smooth_labels_are_the_argmax_of_upsampled_one_hot_maps(monkeypatch, numpy_path):
    from segment.core import masks

    monkeypatch.setattr(masks, "_NUMPY_ON_CPU", numpy_path)
    g = torch.Generator().manual_seed(0)
    checked = 0
    for trial in range(120):
        h, w = torch.randint(2, 20, (2,), generator=g).tolist()
        size = tuple(torch.randint(2, 70, (2,), generator=g).tolist())  # up and down
        k = int(torch.randint(2, 6, (1,), generator=g))
        lab = torch.randint(0, k, (2, h, w), generator=g)
        if trial % 2:  # blocks: long boundaries, as regions have
            lab = torch.randint(0, k, (2, h // 3 + 1, w // 3 + 1), generator=g)
            lab = lab.repeat_interleave(3, 1).repeat_interleave(3, 2)[:, :h, :w]
        got = masks.smooth_labels_at(lab, size)
        assert got.dtype == torch.long and got.shape == (2, *size)
        maps = _onehot_bilinear(lab, size)
        top = maps.topk(2, 1).values
        clear = top[:, 0] - top[:, 1] > 1e-9  # exact ties: tested below
        torch.testing.assert_close(got[clear], maps.argmax(1)[clear], rtol=0, atol=0)
        checked += int(clear.sum())
    assert checked > 100_000
    # an exact tie (half the weight each) goes to the smaller id, whichever side it is on
    for row, want in (([0, 1], [0, 0, 1]), ([1, 0], [1, 0, 0]), ([2, 5], [2, 2, 5])):
        got = masks.smooth_labels_at(torch.tensor([[row]]), (1, 3))
        assert got.tolist() == [[want]]
    same = torch.tensor([[[4, 4], [4, 4]]])
    assert bool((masks.smooth_labels_at(same, (9, 7)) == 4).all())  # no boundary: no fix-up
    with pytest.raises(ValueError, match="label upsampling must be one of"):
        masks.labels_at(same, (9, 7), "cubic")


def _smooth(lab: torch.Tensor, size: tuple[int, int]) -> np.ndarray:
    from segment.core.masks import smooth_labels_at

    return smooth_labels_at(lab, size)[0].numpy()


def _nearest(lab: torch.Tensor, size: tuple[int, int]) -> np.ndarray:
    from segment.core.masks import labels_at

    return labels_at(lab, size)[0].numpy()


def test_postprocess_upsamples_labels_smoothly_and_the_mask_follows():
    """A diagonal boundary on an 8 x 8 grid at 64 x 64: nearest neighbour steps 8 px at a
    time; the written labels follow the bilinear interpolation (every row's boundary moves
    by at most 2 px from the row above), and the mask is their foreground union."""
    lab = (torch.arange(8)[None, :] > torch.arange(8)[:, None]).long()[None]  # 1 above the diagonal
    out = MethodOutput(heatmap=lab.float(), labels=lab, foreground=torch.tensor([[False, True]]))
    seg = postprocess(out, 0, (64, 64))
    np.testing.assert_array_equal(seg.labels, _smooth(lab, (64, 64)))
    np.testing.assert_array_equal(seg.mask, seg.labels == 1)
    first = [int(np.argmax(r == 1)) for r in seg.labels[:56]]  # the first column of region 1
    assert max(abs(a - b) for a, b in zip(first, first[1:])) <= 2
    steps = [int(np.argmax(r == 1)) for r in _nearest(lab, (64, 64))[:56]]
    assert max(abs(a - b) for a, b in zip(steps, steps[1:])) == 8  # what it replaces


def test_postprocess_is_the_same_at_any_torch_thread_count():
    """The command's writer threads post-process on one torch thread, the API on the
    caller's pool: the same files either way (heatmap, mask, smooth and nearest labels)."""
    g = torch.Generator().manual_seed(2)
    heat = torch.rand(1, 32, 32, generator=g)
    lab = torch.randint(0, 6, (1, 8, 8), generator=g).repeat_interleave(4, 1).repeat_interleave(4, 2)
    outs = [MethodOutput(heatmap=heat), MethodOutput(heatmap=heat, labels=lab,
                                                      foreground=torch.tensor([[1, 0, 1, 0, 0, 1]]).bool())]
    before = torch.get_num_threads()
    try:
        for out in outs:
            for up in ("smooth", "nearest"):
                got = []
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    got.append(postprocess(out, 0, (701, 933), up))
                a, b = got
                np.testing.assert_array_equal(a.heatmap, b.heatmap)
                np.testing.assert_array_equal(a.mask, b.mask)
                if out.labels is not None:
                    np.testing.assert_array_equal(a.labels, b.labels)
    finally:
        torch.set_num_threads(before)
