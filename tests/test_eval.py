"""`segment-eval` end to end on tiny random ViTs and small synthetic sets (CPU, seconds):
one backbone pass per batch for all methods, tables and files, resume, distributed merge,
multi-class scoring, config composition, and the ecssd-dev reference (shared assets)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import socket
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import segment.eval.runner as runner
import torch
from hydra import compose, initialize_config_module
from PIL import Image
from segment.eval.metrics import BinaryState, binary_states, total
from segment.eval.runner import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_OK, run_eval
from segment.eval.scoring import method_maps, region_labels, score_regions
from segment.eval.specs import (
    ConfigError,
    MethodSpec,
    instantiate_method,
    method_key,
    module_source,
    resolve_methods,
    union_capture,
)

from segment.core.masks import MethodOutput, to_masks
from segment.methods import ClsAttention

TINY = ["model=vit_tiny_random", "device=cpu", "progress=false", "num_workers=0"]
REPO = Path(__file__).resolve().parents[1]


def make_folder(root: Path, n: int = 5, seed: int = 0) -> Path:
    """``n`` random photos of assorted sizes with blob masks (0/255 PNG)."""
    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    for i in range(n):
        h, w = int(rng.integers(24, 48)), int(rng.integers(24, 48))
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        yy, xx = np.mgrid[:h, :w]
        cy, cx, r = rng.integers(4, h - 4), rng.integers(4, w - 4), rng.integers(4, 12)
        mask = ((yy - cy) ** 2 + (xx - cx) ** 2) < r**2
        img[mask] = (img[mask] // 4 + 180).astype(np.uint8)
        Image.fromarray(img).save(root / "images" / f"im{i:02d}.png")
        Image.fromarray(mask.astype(np.uint8) * 255).save(root / "masks" / f"im{i:02d}.png")
    return root


def cfg_for(*overrides: str):
    """The eval config; these tests are written against CLS attention as the first row, so
    it is pinned unless a test chooses another `method=` (the shipped default is `cuts`)."""
    overrides = list(overrides)
    if not any(o.startswith("method=") or o.startswith("experiment=") for o in overrides):
        overrides.insert(0, "method=cls_attention")
    with initialize_config_module("segment.configs", version_base="1.3"):
        return compose("eval", overrides=overrides)


@pytest.fixture
def folder(tmp_path):
    return make_folder(tmp_path / "set")


class CountingBackbone:
    """Wraps the real backbone: counts extract() calls and records their captures."""

    def __init__(self, inner):
        self.inner = inner
        self.captures = []
        self.batches = []
        self.fail_on: int | None = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def extract(self, pixels, capture, prompts=None):
        if self.fail_on is not None and len(self.captures) == self.fail_on:
            raise KeyboardInterrupt
        self.captures.append(capture)
        self.batches.append(pixels.shape[0])
        return self.inner.extract(pixels, capture, prompts=prompts)


@pytest.fixture
def counting(monkeypatch):
    made: list[CountingBackbone] = []
    real = runner.instantiate_model

    def build(cfg, device):
        b = CountingBackbone(real(cfg, device))
        made.append(b)
        return b

    monkeypatch.setattr(runner, "instantiate_model", build)
    return made


def read_rows(out: Path, timing: bool = False) -> list[dict]:
    """The rows of results.json; without the run's timing fields unless ``timing``."""
    rows = json.loads((out / "results.json").read_text())
    if not timing:
        for r in rows:
            for k in runner.TIMING_KEYS:
                r.pop(k)
    return rows


# ------------------------------------------------------------------------------ configs


@pytest.mark.parametrize("name", ["imagenet_seg", "folder", "coco", "cocostuff27", "cityscapes27", "labels", "camvid", "bsds"])
def test_every_dataset_config_composes(name):
    cfg = cfg_for(f"dataset={name}", *TINY)
    assert cfg.dataset._target_.startswith("segment.datasets.")
    target = cfg.dataset._target_
    mod, cls = target.rsplit(".", 1)
    __import__(mod)
    assert hasattr(sys.modules[mod], cls)


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "configs" / "experiment").glob("*.yaml")))
def test_every_experiment_composes_and_resolves_methods(name):
    cfg = cfg_for(f"experiment={name}", *TINY)
    specs = resolve_methods(cfg)
    assert len(specs) >= 1
    labels = [s.label for s in specs]
    assert len(set(labels)) == len(labels)
    for s in specs:
        instantiate_method(s)


def test_resolve_methods_forms():
    cfg = cfg_for(*TINY, "methods=[rollout,bounce,{config:bounce,name:bounce3,steps:3},{config:tokenrank,heads:lambda2}]")
    specs = resolve_methods(cfg)
    assert [s.label for s in specs] == [
        "cls_attention", "rollout", "bounce", "bounce3", "tokenrank(heads=lambda2)"
    ]
    methods = [instantiate_method(s) for s in specs]
    assert methods[3].steps == 3 and methods[3].name == "bounce3"
    assert methods[4].heads == "lambda2"
    # the default method repeated in the list is one row; include_default=false drops it
    assert [s.label for s in resolve_methods(cfg_for(*TINY, "methods=[cls_attention,rollout]"))] == [
        "cls_attention", "rollout"
    ]
    assert [s.label for s in resolve_methods(cfg_for(*TINY, "methods=[rollout]", "include_default=false"))] == [
        "rollout"
    ]
    # dict form, as experiment files build it (defaults-list packaging + knobs)
    cfg = cfg_for(*TINY, "+method@methods.two=bounce", "methods.two.steps=2", "+methods.four={config:bounce,steps:4}")
    specs = resolve_methods(cfg)
    assert [s.label for s in specs] == ["cls_attention", "two", "four"]
    assert instantiate_method(specs[2]).steps == 4
    with pytest.raises(ConfigError, match="no_such_method"):
        resolve_methods(cfg_for(*TINY, "methods=[no_such_method]"))
    # a typo: one line with the closest name and the choices (no Hydra search-path dump)
    with pytest.raises(ConfigError) as e:
        resolve_methods(cfg_for(*TINY, "methods=[regionz]"))
    assert "did you mean 'regions'?" in str(e.value) and "\n" not in str(e.value)
    # a knob the method config does not have, in either form: named, with the closest one
    with pytest.raises(ConfigError, match=r"methods \(x\): method config 'regions' has"
                       r" no setting 'label_taw' \(did you mean 'label_tau'\?\)"):
        resolve_methods(cfg_for(*TINY, "methods=[{config:regions,name:x,label_taw:0.1}]"))
    with pytest.raises(ConfigError, match=r"methods.four: method config 'bounce' has no"
                       r" setting 'stepz' \(did you mean 'steps'\?\)"):
        resolve_methods(cfg_for(*TINY, "+methods.four={config:bounce,stepz:4}"))
    with pytest.raises(ConfigError, match="labelled 'bounce'"):
        resolve_methods(cfg_for(*TINY, "methods=[bounce,{config:bounce,name:bounce,steps:5}]"))


# ------------------------------------------------------------------------------ end to end


def _reference_rows(folder: Path, cfg, labels: list[str], backbone, batch: int = 2) -> dict[str, BinaryState]:
    """Independent scoring: each method on its own capture (same batches as the run)."""
    from segment.datasets.folder import FolderPairs

    ds = FolderPairs(folder)
    specs = {s.label: s for s in resolve_methods(cfg)}
    out = {}
    for label in labels:
        m = instantiate_method(specs[label])
        states = []
        for start in range(0, len(ds), batch):
            items = [ds[i] for i in range(start, min(start + batch, len(ds)))]
            rec = backbone.extract(backbone.collate([s.image for s in items]), m.capture(backbone.num_layers))
            r, mask = to_masks(m(rec), (224, 224))
            gt = torch.from_numpy(np.stack([s.target for s in items]))
            states += binary_states(r, mask, gt)
        out[label] = total(states, BinaryState())
    return out


def test_end_to_end_one_pass_per_batch(folder, tmp_path, counting, capsys):
    out = tmp_path / "out"
    cfg = cfg_for(*TINY, "dataset=folder", f"dataset.root={folder}", f"output={out}",
                  "batch_size=2", "methods=[rollout,bounce,{config:tokenrank,heads:lambda2,name:tr_l2}]")
    assert run_eval(cfg) == EXIT_OK
    (bb,) = counting
    assert bb.batches == [2, 2, 1]  # the backbone ran once per batch for all four methods
    specs = resolve_methods(cfg)
    methods = [instantiate_method(s) for s in specs]
    assert bb.captures[0] == union_capture(methods, bb.num_layers)
    assert bb.captures[0].heads == "keep" and bb.captures[0].layers == tuple(range(bb.num_layers))

    rows = read_rows(out)
    assert [r["method"] for r in rows] == ["cls_attention", "rollout", "bounce", "tr_l2"]
    ref = _reference_rows(folder, cfg, [r["method"] for r in rows], bb.inner)
    for i, r in enumerate(rows):
        base = {"method", "pixAcc", "mIoU", "mIoU_CA", "mAP", "fgIoU", "acc", "maxF", "maxF_img", "images", "ci95"}
        assert set(r) == (base if i == 0 else base | {"delta"})  # bootstrap intervals (default)
        assert r["images"] == 5
        for k in ("pixAcc", "mIoU", "mAP"):
            lo, hi = r["ci95"][k]
            assert 0 <= lo <= hi <= 100
            if i:  # paired differences to the first row
                d, dlo, dhi = r["delta"][k]
                assert d == pytest.approx(r[k] - rows[0][k], abs=1e-4) and dlo <= dhi
        assert i == 0 or r["delta"]["vs"] == "cls_attention"
        sc = ref[r["method"]].scores()
        for k in ("pixAcc", "mIoU", "mIoU_CA", "mAP"):
            assert r[k] == pytest.approx(100 * getattr(sc, k), abs=1e-3), (r["method"], k)  # fused/manual SDPA float noise
        assert r["mIoU_CA"] == pytest.approx(100 * (r["pixAcc"] / 100) / (2 - r["pixAcc"] / 100))
    with open(out / "results.csv") as f:
        got = list(csv.DictReader(f))
    assert [g["method"] for g in got] == [r["method"] for r in rows]
    assert float(got[1]["mIoU"]) == pytest.approx(rows[1]["mIoU"])
    printed = capsys.readouterr().out
    assert "| method | pixAcc | mIoU | mIoU_CA | mAP | fgIoU | acc | maxF | maxF_img | images |" in printed
    assert "| tr_l2 |" in printed
    panels = sorted((out / "panels").glob("*.png"))
    assert [p.stem for p in panels] == ["im00", "im01", "im02", "im03"]
    w, h = Image.open(panels[0]).size
    assert w > 4 * 224 and h > 4 * 224  # 4 method rows of image | heatmap | mask | gt


def test_resume_after_interrupt_and_new_methods(folder, tmp_path, counting):
    out = tmp_path / "out"
    base = [*TINY, "dataset=folder", f"dataset.root={folder}", f"output={out}", "batch_size=2"]
    fresh_out = tmp_path / "fresh"
    assert run_eval(cfg_for(*base[:-2], f"output={fresh_out}", "batch_size=2", "methods=[rollout]")) == EXIT_OK
    fresh = read_rows(fresh_out)

    # interrupted during the second batch: the first batch's images are in the cache
    runner_build = runner.instantiate_model

    def failing(cfg, device):
        b = runner_build(cfg, device)
        b.fail_on = 1
        return b

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "instantiate_model", failing)
        assert run_eval(cfg_for(*base, "methods=[rollout]")) == EXIT_INTERRUPTED
    assert not (out / "results.json").exists()
    cached = list((out / "cache").glob("*/*.json"))
    assert len(cached) == 2

    counting.clear()
    assert run_eval(cfg_for(*base, "methods=[rollout]")) == EXIT_OK
    assert counting[-1].batches == [2, 1]  # only the 3 images not cached
    assert read_rows(out) == fresh  # same numbers as an uninterrupted run
    (row,) = [r for r in read_rows(out, timing=True) if r["method"] == "rollout"]
    assert row["images_per_s"] > 0 and row["method_ms_per_image"] > 0  # measured on 3 images

    # nothing left to do: the backbone is not even built
    counting.clear()
    assert run_eval(cfg_for(*base, "methods=[rollout]")) == EXIT_OK
    assert counting == []
    assert read_rows(out) == fresh
    assert all(r["images_per_s"] is None and r["method_ms_per_image"] is None
               for r in read_rows(out, timing=True))  # nothing measured: all from the cache

    # a new method: only it is computed, from a capture of just what it needs
    assert run_eval(cfg_for(*base, "methods=[rollout,bounce]")) == EXIT_OK
    (bb,) = counting
    assert bb.batches == [2, 2, 1]
    bounce = instantiate_method(resolve_methods(cfg_for(*base, "methods=[bounce]"))[1])
    assert bb.captures[0] == bounce.capture(bb.num_layers)
    rows = read_rows(out)
    assert [r["method"] for r in rows] == ["cls_attention", "rollout", "bounce"]
    assert rows[:2] == fresh


def _poison_cache(out: Path) -> None:
    """Overwrite every cached binary state with a perfect score (pixAcc 100)."""
    for f in (out / "cache").glob("*/*.json"):
        data = json.loads(f.read_text())
        for st in data["methods"].values():
            st["correct"] = st["labeled"]
        f.write_text(json.dumps(data))


def test_metric_cache_is_keyed_by_version_and_code(folder, tmp_path, monkeypatch, caplog):
    """A rerun into the same output after an upgrade or a code change rescoring everything
    (never old numbers), and the log says how many results were reused."""
    import logging

    out = tmp_path / "out"
    cfg = cfg_for(*TINY, "dataset=folder", f"dataset.root={folder}", f"output={out}",
                  "limit=3", "methods=[rollout]")
    assert run_eval(cfg) == EXIT_OK
    fresh = read_rows(out)
    assert all(r["pixAcc"] < 100 for r in fresh)
    _poison_cache(out)
    caplog.set_level(logging.INFO, logger="segment.eval.runner")
    assert run_eval(cfg) == EXIT_OK  # same code: the (poisoned) cache is used
    assert all(r["pixAcc"] == 100 for r in read_rows(out))
    assert "reused 6 of 6 (image, method) results" in caplog.text

    caplog.clear()
    monkeypatch.setattr("segment.__version__", "99.0")  # an upgrade
    assert run_eval(cfg) == EXIT_OK
    assert read_rows(out) == fresh
    assert "reused 0 of 6 (image, method) results" in caplog.text
    assert "1 other cache folder" in caplog.text

    # a change to the source of the module a method lives in rescored it
    _poison_cache(out)
    real = module_source
    edited = lambda name: real(name) + (b"# edited" if name == "segment.methods.attention" else b"")  # noqa: E731
    monkeypatch.setattr("segment.eval.specs.module_source", edited)
    caplog.clear()
    assert run_eval(cfg) == EXIT_OK
    assert read_rows(out) == fresh
    assert "reused 0 of 6" in caplog.text
    rollout = MethodSpec("rollout", resolve_methods(cfg)[1].cfg)
    rollout.method = instantiate_method(rollout)
    before = method_key(rollout)
    monkeypatch.setattr("segment.eval.specs.module_source", real)
    assert method_key(rollout) != before
    assert method_key(rollout).startswith(rollout.key + "-")  # config hash + code hash


def test_limit_and_errors(folder, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_eval(cfg_for(*TINY, f"dataset.root={folder}", f"output={out}", "limit=2")) == EXIT_OK
    assert read_rows(out)[0]["images"] == 2
    assert run_eval(cfg_for(*TINY, f"dataset.root={tmp_path / 'nope'}", f"output={out}")) == EXIT_BAD_INPUT
    assert "nope" in capsys.readouterr().err
    assert run_eval(cfg_for(*TINY, f"output={out}")) == EXIT_BAD_INPUT  # dataset.root=???
    assert "dataset.root" in capsys.readouterr().err
    assert run_eval(cfg_for(*TINY, f"dataset.root={folder}", f"output={out}", "methods=[nope]")) == EXIT_BAD_INPUT
    assert "nope" in capsys.readouterr().err
    assert run_eval(cfg_for(*TINY, f"dataset.root={folder}", f"output={out}",
                            "methods=[{config:bounce,stepz:2}]")) == EXIT_BAD_INPUT
    assert "no setting 'stepz'" in capsys.readouterr().err
    for knob in ("batch_size=0", "num_workers=-1"):
        assert run_eval(cfg_for(*TINY, f"dataset.root={folder}", f"output={out}", knob)) == EXIT_BAD_INPUT
        assert knob.split("=")[0] + " must be an integer" in capsys.readouterr().err
    # a knob value the method refuses: its message on one line, exit 2, no output folder
    bad = tmp_path / "bad"
    for knobs, why in ((["method=regions", "method.tau=-1"], "'regions': regions: tau must be > 0"),
                       (["methods=[{config:regions,name:r2,refine_scale:2}]"],
                        "'r2': r2: refine_scale must lie in (0, 1]")):
        assert run_eval(cfg_for(*TINY, f"dataset.root={folder}", f"output={bad}", *knobs)) == EXIT_BAD_INPUT
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"segment-eval: cannot build method {why}"), err
        assert not bad.exists()


def test_bootstrap_knob(folder, tmp_path, capsys):
    """``bootstrap=N`` resamples for the intervals (the same seed: the same intervals, a
    paired difference of a row with its twin is exactly 0); ``0`` turns them off; a bad
    value stops before any scoring, in one line."""
    twins = "methods=[{config:cls_attention,name:twin}]"
    out = tmp_path / "on"
    assert run_eval(cfg_for(*TINY, f"dataset.root={folder}", f"output={out}", twins, "bootstrap=200")) == EXIT_OK
    first, twin = read_rows(out)
    assert twin["delta"] == {"vs": "cls_attention", **{k: [0.0, 0.0, 0.0] for k in (
        "pixAcc", "mIoU", "mAP", "fgIoU", "acc", "maxF", "maxF_img")}}
    assert twin["ci95"] == first["ci95"]
    lines = list(csv.reader((out / "results.csv").read_text().splitlines()))
    scored = ("mIoU", "mAP", "fgIoU", "maxF")  # after method, 8 scores, images
    assert lines[0][10:] == [f"{s}_ci95_{e}" for s in scored for e in ("low", "high")] + [
        f"delta_{s}{e}" for s in scored for e in ("", "_ci95_low", "_ci95_high")]
    assert lines[1][18:] == [""] * 12 and [float(x) for x in lines[2][18:]] == [0.0] * 12
    md = (out / "results.md").read_text().splitlines()
    assert md[0].endswith("| images | mIoU 95% CI | ΔmIoU vs cls_attention (95% CI) |")
    assert md[3].endswith("| +0.00 (+0.00, +0.00) |") and md[2].endswith(" | - |")
    again = tmp_path / "again"  # a fresh run with the same seed
    assert run_eval(cfg_for(*TINY, f"dataset.root={folder}", f"output={again}", twins, "bootstrap=200")) == EXIT_OK
    assert read_rows(again)[0]["ci95"] == first["ci95"]
    other = tmp_path / "other"
    assert run_eval(cfg_for(*TINY, f"dataset.root={folder}", f"output={other}", "bootstrap=200", "seed=1")) == EXIT_OK
    assert read_rows(other)[0]["ci95"] != first["ci95"]
    off = tmp_path / "off"
    assert run_eval(cfg_for(*TINY, f"dataset.root={folder}", f"output={off}", twins, "bootstrap=0")) == EXIT_OK
    assert all("ci95" not in r and "delta" not in r for r in read_rows(off))
    assert "95% CI" not in (off / "results.md").read_text()
    assert "ci95" not in (off / "results.csv").read_text()
    capsys.readouterr()
    for bad in ("bootstrap=-1", "bootstrap=2.5", "bootstrap=true"):
        bad_out = tmp_path / "bad"
        assert run_eval(cfg_for(*TINY, f"dataset.root={folder}", f"output={bad_out}", bad)) == EXIT_BAD_INPUT
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "bootstrap must be a whole number of resamples >= 0" in err[0]
        assert not bad_out.exists()


def test_mask_at_image_and_grid():
    heat = torch.tensor([[[0.0, 1.0], [0.6, 0.7]]])  # mean 0.575 on the grid
    out = MethodOutput(heatmap=heat)
    ((r_img, m_img),) = method_maps(out, [(4, 4)], "image")
    ((r_grid, m_grid),) = method_maps(out, [(4, 4)], "grid")
    torch.testing.assert_close(r_img, r_grid)  # R (for AP) is the bilinear one either way
    r, m = to_masks(out, (4, 4))
    assert torch.equal(m_img, m[0])
    expected = torch.tensor([[False, True], [True, True]]).repeat_interleave(2, 0).repeat_interleave(2, 1)
    assert torch.equal(m_grid, expected)  # grid threshold, nearest upsampling: whole 2x2 cells
    assert not torch.equal(m_img, m_grid)  # the bilinear ramp moves the boundary


# ------------------------------------------------------------------------------ prompts


def _prompt_spy(tmp_path, monkeypatch, synsets: list[str]) -> list:
    """Three random images of the given synsets in a gtsegs file; returns the list that
    collects the prompts of every backbone call."""
    from test_datasets import write_gtsegs

    rng = np.random.default_rng(0)
    ims = [rng.integers(0, 256, (30, 30, 3), dtype=np.uint8) for _ in range(3)]
    masks = [rng.random((30, 30)) > 0.5 for _ in range(3)]
    write_gtsegs(tmp_path / "gtsegs_ijcv.mat", ims, masks, synsets)
    seen = []
    orig = CountingBackbone.extract

    def spy(self, pixels, capture, prompts=None):
        seen.append(prompts)
        return orig(self, pixels, capture, prompts=prompts)

    monkeypatch.setattr(CountingBackbone, "extract", spy)
    return seen


def test_class_names_reach_the_backbone_as_prompts(tmp_path, counting, monkeypatch):
    seen = _prompt_spy(tmp_path, monkeypatch, ["n02084071", "n01443537", "n07747607"])
    out = tmp_path / "out"
    cfg = cfg_for(*TINY, "dataset=imagenet_seg", f"dataset.root={tmp_path}", f"output={out}", "batch_size=3")
    assert run_eval(cfg) == EXIT_OK
    assert seen == [["dog", "goldfish", "orange"]]
    assert read_rows(out)[0]["images"] == 3


def test_unknown_class_falls_back_per_image_and_is_counted(tmp_path, counting, monkeypatch):
    """One image with an unknown synset: only that image is prompted with the default class
    (the others keep theirs), and results.json counts the fallback."""
    seen = _prompt_spy(tmp_path, monkeypatch, ["n02084071", "n00000042", "n07747607"])
    monkeypatch.setattr(CountingBackbone, "text_conditioned", True, raising=False)  # as FLUX
    monkeypatch.setattr(CountingBackbone, "default_class", "object", raising=False)
    out = tmp_path / "out"
    cfg = cfg_for(*TINY, "dataset=imagenet_seg", f"dataset.root={tmp_path}", f"output={out}",
                  "batch_size=3")
    with pytest.warns(UserWarning, match="unknown synset"):
        assert run_eval(cfg) == EXIT_OK
    assert seen == [["dog", "object", "orange"]]
    rows = read_rows(out)
    assert rows[0]["prompt_fallbacks"] == 1 and rows[0]["images"] == 3
    assert run_eval(cfg) == EXIT_OK  # everything from the cache: still counted
    assert seen == [["dog", "object", "orange"]] and read_rows(out)[0]["prompt_fallbacks"] == 1
    # without a default class the image cannot be prompted: a clear error, not a silent guess
    assert runner.batch_prompts(["dog", None], "object", ["a", "b"]) == ["dog", "object"]
    assert runner.batch_prompts([None, None], "object", ["a", "b"]) is None
    with pytest.raises(ConfigError, match="b: no class name"):
        runner.batch_prompts(["dog", None], None, ["a", "b"])


# ------------------------------------------------------------------------------ multi-class


@dataclass(frozen=True)
class QuantileRegions(ClsAttention):
    """Test region method: CLS attention split into 3 quantile bins (labels), top bin = fg."""

    name: str = "regions"

    def __call__(self, record):
        heat = super().__call__(record).heatmap  # (B, h, w)
        flat = heat.flatten(1)
        q = torch.quantile(flat, torch.tensor([1 / 3, 2 / 3]), dim=1).T  # (B, 2)
        lab = (flat[:, :, None] > q[:, None, :]).sum(-1).view_as(heat)
        fg = torch.tensor([[False, False, True]]).expand(heat.shape[0], 3)
        return MethodOutput(heatmap=heat, labels=lab, foreground=fg)


@pytest.fixture
def quantile_methods(monkeypatch):
    """``segment_test_methods.QuantileRegions`` importable as a config ``_target_``."""
    mod = types.ModuleType("segment_test_methods")
    mod.QuantileRegions = QuantileRegions
    monkeypatch.setitem(sys.modules, "segment_test_methods", mod)


def test_multiclass_end_to_end(tmp_path, quantile_methods, counting):
    root = tmp_path / "cityscapes"
    rng = np.random.default_rng(0)
    for i in range(3):
        d = root / "leftImg8bit" / "val" / "city"
        g = root / "gtFine" / "val" / "city"
        d.mkdir(parents=True, exist_ok=True)
        g.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (32, 64, 3), dtype=np.uint8)).save(d / f"c_{i}_leftImg8bit.png")
        Image.fromarray(rng.integers(0, 36, (32, 64), dtype=np.uint8)).save(g / f"c_{i}_gtFine_labelIds.png")
    out = tmp_path / "out"
    cfg = cfg_for(*TINY, "dataset=cityscapes27", f"dataset.root={root}", "dataset.size=[32,32]", "batch_size=1", f"output={out}",
                  "include_default=false", "+methods.regions._target_=segment_test_methods.QuantileRegions")
    assert run_eval(cfg) == EXIT_OK
    (row,) = read_rows(out)
    assert row["method"] == "regions" and row["images"] == 3
    assert 0 <= row["pixAcc"] <= 100 and 0 <= row["mIoU"] <= 100 and len(row["iou"]) == 27
    # the same from the metric directly, with the run's backbone
    from segment.datasets.multiclass import Cityscapes27
    from segment.eval.metrics import MulticlassState, hungarian_state

    from segment.core.masks import labels_at

    bb = counting[0].inner
    m = QuantileRegions()
    ds = Cityscapes27(root, size=(32, 32))
    st = MulticlassState.zero(27)
    for i in range(3):
        s = ds[i]
        o = m(bb.extract(bb.collate([s.image]), m.capture(bb.num_layers)))  # one image per batch
        st = st + hungarian_state(labels_at(o.labels, (32, 32))[0], s.target, 27)
    assert row["pixAcc"] == pytest.approx(100 * st.scores().ACC)
    assert row["mIoU"] == pytest.approx(100 * st.scores().mIoU)
    assert row["regions"] == pytest.approx(st.scores().regions) and 1 <= row["regions"] <= 3
    assert list(row["iou"]) == list(Cityscapes27.class_names)
    # a heatmap-only method cannot be scored on a multi-class set
    cfg = cfg_for(*TINY, "dataset=cityscapes27", f"dataset.root={root}", f"output={tmp_path / 'o2'}")
    assert run_eval(cfg) == EXIT_BAD_INPUT


def test_label_folder_tables_and_panels(tmp_path, quantile_methods, counting, capsys):
    """dataset=labels end to end: pixAcc, mIoU, regions and per-class IoU (named) in
    results.json / .csv / .md, equal to the metric on the same predictions; class panels."""
    root = tmp_path / "set"
    rng = np.random.default_rng(1)
    for i in range(3):
        _save_png(root / "images" / f"s{i}.png", rng.integers(0, 256, (30, 40, 3), dtype=np.uint8))
        lab = rng.integers(0, 3, (30, 40)).astype(np.uint8)
        lab[:4] = 9  # void
        _save_png(root / "labels" / f"s{i}.png", lab)
    out = tmp_path / "out"
    cfg = cfg_for(*TINY, "dataset=labels", f"dataset.root={root}", "dataset.num_classes=3", "dataset.ignore_index=9",
                  "dataset.class_names=[road,sky,car]", "model.image_size=[28,42]", "batch_size=2", f"output={out}",
                  "include_default=false", "+methods.quant._target_=segment_test_methods.QuantileRegions", "panels=1")
    assert run_eval(cfg) == EXIT_OK
    (row,) = read_rows(out)
    assert set(row) == {"method", "pixAcc", "mIoU", "regions", "regions_median", "small_px", "escape_median",
                        "iou", "images", "ci95"}
    assert row["escape_median"] is None  # a method that does not cut by escape
    assert set(row["ci95"]) == {"pixAcc", "mIoU"} and row["ci95"]["mIoU"][0] <= row["ci95"]["mIoU"][1]
    assert list(row["iou"]) == ["road", "sky", "car"] and row["images"] == 3
    # the same from the metric on the method's own labels at the label resolution (30 x 40)
    from segment.datasets.multiclass import LabelFolder
    from segment.eval.metrics import MulticlassState, hungarian_state

    from segment.core.masks import labels_at

    bb, m = counting[0].inner, QuantileRegions()
    ds = LabelFolder(root, num_classes=3, ignore_index=9)
    st = MulticlassState.zero(3)
    for i in range(3):
        s = ds[i]
        assert s.target.shape == (30, 40)
        o = m(bb.extract(bb.collate([s.image]), m.capture(bb.num_layers)))
        st = st + hungarian_state(labels_at(o.labels, (30, 40))[0], s.target, 3)
    sc = st.scores()
    assert row["pixAcc"] == pytest.approx(100 * sc.ACC) and row["mIoU"] == pytest.approx(100 * sc.mIoU)
    assert row["regions"] == pytest.approx(sc.regions) and row["regions"] == 3.0
    assert row["regions_median"] == sc.regions_median == 3.0
    assert row["small_px"] == pytest.approx(100 * sc.small_share)
    assert [row["iou"][c] for c in ("road", "sky", "car")] == pytest.approx([100 * x for x in sc.iou])
    lines = list(csv.reader((out / "results.csv").read_text().splitlines()))
    # one row: its interval, no difference columns
    assert lines[0] == ["method", "pixAcc", "mIoU", "regions", "regions_median", "small_px", "escape_median",
                        "IoU_road", "IoU_sky", "IoU_car", "images", "mIoU_ci95_low", "mIoU_ci95_high"]
    assert lines[1][6] == "" and float(lines[1][9]) == pytest.approx(row["iou"]["car"], abs=0.006)
    assert [float(x) for x in lines[1][11:13]] == row["ci95"]["mIoU"]
    md = (out / "results.md").read_text().splitlines()
    assert md[0] == ("| method | pixAcc | mIoU | regions | regions_median | small_px | escape_median | road | sky"
                     " | car | images | mIoU 95% CI |")
    assert md[2].startswith(f"| quant | {row['pixAcc']:.2f} | {row['mIoU']:.2f} | 3.00 | 3.0 | {row['small_px']:.2f} | - |")
    lo, hi = row["ci95"]["mIoU"]
    assert md[2].endswith(f"| 3 | {lo:.2f}-{hi:.2f} |")
    panel = np.asarray(Image.open(out / "panels" / "s0.png").convert("RGB"))
    assert panel.shape[1] == 3 * (40 + 4)  # image | labels | ground truth
    from segment.eval.panels import class_palette

    colours = {tuple(c) for c in panel.reshape(-1, 3).tolist()}
    assert all(tuple(c) in colours for c in class_palette(3).tolist())  # class colours (and the key)
    # a label value that is neither a class nor the ignore index: a one-line error naming the file
    bad = np.zeros((30, 40), np.uint8)
    bad[5, 5] = 4
    _save_png(root / "labels" / "s1.png", bad)
    cfg = cfg_for(*TINY, "dataset=labels", f"dataset.root={root}", "dataset.num_classes=3", "dataset.ignore_index=9",
                  f"output={tmp_path / 'o2'}", "include_default=false",
                  "+methods.quant._target_=segment_test_methods.QuantileRegions", "cache=false")
    capsys.readouterr()
    assert run_eval(cfg) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "s1.png: expected a label PNG with class ids 0..2 and 9" in err[0] and "[4]" in err[0]
    # mask_at makes binary masks from heatmaps: on a multi-class set it is refused
    cfg = cfg_for(*TINY, "dataset=labels", f"dataset.root={root}", "dataset.num_classes=3",
                  "dataset.ignore_index=9", f"output={tmp_path / 'o3'}", "mask_at=grid")
    capsys.readouterr()
    assert run_eval(cfg) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mask_at=grid has no effect on LabelFolder (multiclass)" in err[0]
    assert not (tmp_path / "o3").exists()


def _save_png(path: Path, arr: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)


# ------------------------------------------------------------------------------ distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_torchrun_two_ranks_equal_one(folder, tmp_path):
    """2 gloo ranks on CPU: sharded, merged numbers equal the single-process run."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun not installed next to this Python")
    args = [*TINY, f"dataset.root={folder}", "batch_size=1", "methods=[rollout,bounce]"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = tmp_path / "one"
    two = tmp_path / "two"
    # the single process: this one (the config composed as the command composes it), at the
    # ranks' thread count, so that the test compares sharding and nothing else
    from segment.run.front.compose import compose as compose_command
    from segment.utils import torch_threads

    with torch_threads(1):
        assert run_eval(compose_command("segment-eval", [*args, f"output={one}"])) == EXIT_OK
    r2 = subprocess.run(
        [torchrun, "--nnodes=1", "--nproc_per_node=2", f"--master_port={_free_port()}",
         "-m", "segment.eval", *args, f"output={two}"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert r2.returncode == 0, r2.stderr[-3000:]
    logs = r2.stdout + r2.stderr  # Hydra's job logging writes to stdout
    assert "rank 0/2: 3 images" in logs and "rank 1/2: 2 images" in logs  # strided shards
    a, b = read_rows(one), read_rows(two)
    assert [r["method"] for r in a] == [r["method"] for r in b] == ["cuts", "rollout", "bounce"]
    for x, y in zip(a, b):
        assert x["images"] == y["images"] == 5
        for k in ("pixAcc", "mIoU", "mIoU_CA", "mAP"):
            assert x[k] == pytest.approx(y[k], abs=1e-9), k
    assert "| method | pixAcc |" in r2.stdout and r2.stdout.count("| bounce |") == 1  # rank 0 prints


@pytest.mark.slow
def test_torchrun_a_method_the_model_cannot_run_stops_every_rank(folder, tmp_path):
    """A rank without images (limit=1 over 2 ranks) checks the methods against the model
    too, so both ranks stop with exit 2 instead of one waiting for the other's results."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun not installed next to this Python")
    r = subprocess.run(
        [torchrun, "--nnodes=1", "--nproc_per_node=2", f"--master_port={_free_port()}", "-m", "segment.eval",
         *TINY, f"dataset.root={folder}", "method.layers=[20]", "limit=1", f"output={tmp_path / 'out'}"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240,
    )
    logs = r.stdout + r.stderr
    assert r.returncode != 0 and logs.count("cannot run on this model: layer 20 out of range") == 2, logs[-3000:]
    assert "exitcode  : 2" in logs and not (tmp_path / "out").exists(), logs[-3000:]


# ------------------------------------------------------------------------------ shared assets

# ecssd-dev's protocol-fidelity rows (cls_attention, rollout, cls_keychain against
# REFERENCE.md) are checked in tests/test_golden.py, on the same run as the byte-identity check
# (one pass of the real backbone over the 100 images instead of two).


def test_panel_has_column_headers(tmp_path):
    """A header band names the columns (image | heatmap | mask | ground truth) above the
    first method row: text over each of the four columns, then the method label band."""
    from segment.eval.panels import write_panel

    h, w, pad = 40, 64, 4
    target = np.zeros((h, w), bool)
    target[10:30, 20:40] = True
    tile = np.full((h, w, 3), 255, np.uint8)
    img = Image.fromarray(np.full((h, w, 3), 255, np.uint8))
    write_panel(tmp_path / "p.png", img, target, [("m1", [tile, tile]), ("m2", [tile, tile])])
    a = np.asarray(Image.open(tmp_path / "p.png").convert("L"))
    assert a.shape == (18 + 2 * (18 + h + pad), 4 * (w + pad))
    header = a[:18]
    for c in range(4):  # some dark text over every column
        assert (header[:, c * (w + pad) : c * (w + pad) + w] < 128).sum() > 20, c
    label = a[18:36]  # then the first method's label band: text at the left only
    assert (label[:, :w] < 128).sum() > 10 and (label[:, 2 * (w + pad) :] < 128).sum() == 0
def test_eval_benchmark_runs_and_reports_both_ratios(folder, tmp_path, monkeypatch, capsys):
    # `python -m segment.eval.bench eval` on a tiny random model: 9 methods, ratios printed
    from segment.eval.bench.evaluator import main

    monkeypatch.delenv("SEGMENT_SHARED", raising=False)
    out = tmp_path / "bench.json"
    assert main(["--root", str(folder), "--images", "3", "--batch", "2", "--repeats", "1",
                 "--size", "56", "--json", str(out), "model=vit_tiny_random"]) == 0
    res = json.loads(out.read_text())
    assert res["methods"] == 9 and res["images"] == 3
    assert res["eval_median"] > 0 and res["bare_forward_median"] > 0 and res["cpu_ratio"] > 0
    assert res["ratio"] == pytest.approx(res["eval_median"] / res["bare_forward_median"], abs=1e-3)
    assert all(v is not None and v >= 0 for v in res["method_ms_per_image"].values())
    printed = capsys.readouterr().out
    assert "ratio" in printed and "target >= 0.5" in printed


def test_sweep_table_margins_and_worst_set(tmp_path):
    """sweep_table: the best REFERENCE row of the first mIoU table is the bar; binary sets
    need +2 mIoU and the best mAP, scenes +3 mIoU; the worst set is the smallest slack."""
    import json

    from segment.eval import sweep_table

    (tmp_path / "REF_B.md").write_text(
        "intro\n\n| method | pixAcc | mIoU | mAP |\n|---|---|---|---|\n| a | 1 | 70.00 | 90.00 |\n"
        "| b | 1 | 72.50 | 89.00 |\n\nat 448:\n\n| method | mIoU | mAP |\n|---|---|---|\n| c | 99.0 | 99.0 |\n")
    (tmp_path / "REF_S.md").write_text("| method | pixAcc | mIoU |\n|---|---|---|\n| k8 | 60 | 36.00 |\n")
    assert sweep_table.best_reference(tmp_path / "REF_B.md") == {"mIoU": 72.5, "mAP": 90.0}
    for name, rows in {
        "bin": [{"method": "x", "pixAcc": 90, "mIoU": 75.0, "mAP": 89.5},
                {"method": "y", "pixAcc": 90, "mIoU": 74.0, "mAP": 91.0}],
        "scene": [{"method": "x", "pixAcc": 60, "mIoU": 40.0, "regions": 12.0},
                  {"method": "y", "pixAcc": 60, "mIoU": 39.5, "regions": 9.0}],
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(rows))
    assert sweep_table.main([f"bin={tmp_path / 'bin'}:{tmp_path / 'REF_B.md'}",
                             f"scene={tmp_path / 'scene'}:{tmp_path / 'REF_S.md'}",
                             "--out", str(tmp_path / "t")]) == 0
    rows = (tmp_path / "t.md").read_text().splitlines()
    # x: bin +2.50 over (slack min(0.5, mAP -0.5) = -0.50), scene +4.00 (slack +1.00)
    assert rows[2].endswith("| +2.50 / +4.00 | bin (-0.50) |")
    # y: bin +1.50 (slack -0.50; mAP +1.0), scene +3.50 (slack +0.50)
    assert rows[3].endswith("| +1.50 / +3.50 | bin (-0.50) |")
    assert "scene regions/img" in rows[0] and "bin mAP" in rows[0]
    assert "ΔmIoU" not in rows[0]  # runs without intervals
    assert (tmp_path / "t.csv").read_text().count("\n") == 3
    # a run with intervals: the paired difference to its first row, per recipe
    scene = json.loads((tmp_path / "scene" / "results.json").read_text())
    scene[0]["ci95"] = {"mIoU": [39.0, 41.0]}
    scene[1]["ci95"] = {"mIoU": [38.4, 40.6]}
    scene[1]["delta"] = {"vs": "x", "mIoU": [-0.5, -1.25, 0.25]}
    (tmp_path / "scene" / "results.json").write_text(json.dumps(scene))
    assert sweep_table.main([f"bin={tmp_path / 'bin'}:{tmp_path / 'REF_B.md'}",
                             f"scene={tmp_path / 'scene'}:{tmp_path / 'REF_S.md'}",
                             "--out", str(tmp_path / "t2")]) == 0
    rows = (tmp_path / "t2.md").read_text().splitlines()
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    col = header.index("scene ΔmIoU vs x (95% CI)")
    assert header[col - 1] == "scene regions/img" and "bin ΔmIoU vs x (95% CI)" not in header
    assert [c.strip() for c in rows[2].strip("|").split("|")][col] == "-"
    assert [c.strip() for c in rows[3].strip("|").split("|")][col] == "-0.50 (-1.25, +0.25)"


# ------------------------------------------------------------------------------ BSDS500 regions


def _bsds(root: Path, seed: int = 0) -> Path:
    """A BSDS500 layout: val with 2 landscape and 2 portrait photos (28 x 42 / 42 x 28), 2-4
    human segmentations of 2-4 blocky regions each."""
    import scipy.io

    rng = np.random.default_rng(seed)
    for stem, (h, w) in (("a", (28, 42)), ("b", (42, 28)), ("c", (28, 42)), ("d", (42, 28))):
        _save_png(root / "images" / "val" / f"{stem}.png", np.zeros((1, 1, 3), np.uint8))  # not read (.jpg only)
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        img[: h // 2] //= 3
        Image.fromarray(img).save(root / "images" / "val" / f"{stem}.jpg", quality=95)
        k = int(rng.integers(2, 5))
        cell = np.empty((1, k), dtype=object)
        for j in range(k):
            seg = 1 + (np.arange(h)[:, None] * (j + 2) // h) + 0 * np.arange(w)[None, :]
            cell[0, j] = {"Segmentation": seg.astype(np.uint16)}
        (root / "groundTruth" / "val").mkdir(parents=True, exist_ok=True)
        scipy.io.savemat(str(root / "groundTruth" / "val" / f"{stem}.mat"), {"groundTruth": cell})
    return root


def test_bsds_end_to_end_region_metrics_and_orientation(tmp_path, quantile_methods, counting):
    """dataset=bsds: Covering / PRI / VI / regions per image of every region method equal the
    metric on the label maps `segment` writes (smooth upsampling to the photo), with intervals
    and paired deltas; portrait photos get the transposed input under match_orientation (one
    backbone pass per input size); heatmap-only methods are refused."""
    from segment.datasets.bsds import BSDS500
    from segment.eval.metrics import RegionState, region_state, total

    from segment.core.masks import labels_at

    root = _bsds(tmp_path / "bsds")
    out = tmp_path / "out"
    cfg = cfg_for(*TINY, "dataset=bsds", f"dataset.root={root}", "model.image_size=[28,42]",
                  "model.match_orientation=true", "batch_size=4", f"output={out}", "include_default=false",
                  "+methods.quant._target_=segment_test_methods.QuantileRegions",
                  "+methods.km={config:kmeans,k:3}", "panels=1", "bootstrap=200")
    assert run_eval(cfg) == EXIT_OK
    bb = counting[0]
    # one batch of 4 photos, two input sizes: landscape 28 x 42, portrait 42 x 28 (a then b, c, d)
    assert bb.batches == [2, 2]
    rows = read_rows(out)
    assert [r["method"] for r in rows] == ["quant", "km"]
    ds = BSDS500(root)
    assert ds.names() == ["val/a", "val/b", "val/c", "val/d"]
    for r, m in zip(rows, [QuantileRegions(), instantiate_method(resolve_methods(cfg)[1])]):
        states = []
        for i in range(4):
            s = ds[i]
            x = bb.inner.collate([s.image])
            assert tuple(x.shape[-2:]) == ((28, 42) if s.image.size == (42, 28) else (42, 28))
            o = m(bb.inner.extract(x, m.capture(bb.num_layers)))
            lab = labels_at(o.labels, s.target.shape[1:], "smooth")[0]
            states.append(region_state(lab, s.target))
        sc = total(states, RegionState()).scores()
        assert set(r) >= {"Covering", "PRI", "VI", "regions_median", "regions", "small_px", "images", "ci95"}
        assert r["Covering"] == pytest.approx(sc.Covering) and r["PRI"] == pytest.approx(sc.PRI)
        assert r["VI"] == pytest.approx(sc.VI) and r["regions_median"] == sc.regions_median
        assert r["small_px"] == pytest.approx(100 * sc.small_share) and r["images"] == 4
        for k in ("Covering", "PRI", "VI"):
            lo, hi = r["ci95"][k]
            assert lo <= r[k] + 1e-6 and r[k] <= hi + 1e-6
    assert rows[0]["regions_median"] <= 3 and rows[1]["regions_median"] <= 3
    d = rows[1]["delta"]
    assert d["vs"] == "quant" and d["Covering"][0] == pytest.approx(rows[1]["Covering"] - rows[0]["Covering"], abs=1e-6)
    assert d["Covering"][1] <= d["Covering"][0] <= d["Covering"][2]
    lines = list(csv.reader((out / "results.csv").read_text().splitlines()))
    assert lines[0][:9] == ["method", "Covering", "PRI", "VI", "regions_median", "regions", "small_px",
                            "escape_median", "images"]
    assert "delta_VI_ci95_high" in lines[0] and "Covering_ci95_low" in lines[0]
    md = (out / "results.md").read_text().splitlines()
    assert md[0].startswith("| method | Covering | PRI | VI | regions_median | regions | small_px | escape_median | images |"
                            " Covering 95% CI | PRI 95% CI | VI 95% CI | ΔCovering vs quant (95% CI) |")
    assert md[2].startswith(f"| quant | {rows[0]['Covering']:.3f} | {rows[0]['PRI']:.3f} | {rows[0]['VI']:.3f} |")
    panel = np.asarray(Image.open(out / "panels" / "val_a.png").convert("RGB"))
    assert panel.shape[1] == 3 * (42 + 4)  # image | labels | human 1
    # the rerun reads every image from the metric cache
    assert run_eval(cfg) == EXIT_OK and len(counting) == 1 and read_rows(out) == rows
    # the split only selects photos (names carry it): split=all in the same output reuses val
    import shutil as _sh

    _sh.copytree(root / "images" / "val", root / "images" / "train")
    _sh.copytree(root / "groundTruth" / "val", root / "groundTruth" / "train")
    cfg_all = cfg_for(*TINY, "dataset=bsds", f"dataset.root={root}", "dataset.split=all", "model.image_size=[28,42]",
                      "model.match_orientation=true", "batch_size=4", f"output={out}", "include_default=false",
                      "+methods.quant._target_=segment_test_methods.QuantileRegions",
                      "+methods.km={config:kmeans,k:3}", "panels=0", "bootstrap=0")
    assert run_eval(cfg_all) == EXIT_OK
    assert len(counting) == 2 and counting[1].batches == [2, 2]  # only the 4 train photos are scored
    assert [r["images"] for r in read_rows(out)] == [8, 8]
    # a heatmap-only method cannot be scored against human segmentations
    cfg = cfg_for(*TINY, "dataset=bsds", f"dataset.root={root}", f"output={tmp_path / 'o2'}")
    assert run_eval(cfg) == EXIT_BAD_INPUT


def test_bsds_bad_ground_truth_is_one_line(tmp_path, quantile_methods, capsys):
    root = _bsds(tmp_path / "bsds")
    (root / "groundTruth" / "val" / "c.mat").write_bytes(b"not a mat file")
    cfg = cfg_for(*TINY, "dataset=bsds", f"dataset.root={root}", "model.image_size=[28,42]", f"output={tmp_path / 'o'}",
                  "include_default=false", "+methods.quant._target_=segment_test_methods.QuantileRegions")
    capsys.readouterr()
    assert run_eval(cfg) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "c.mat: expected a BSDS500 ground-truth .mat" in err[0]
    (root / "groundTruth" / "val" / "c.mat").unlink()
    cfg = cfg_for(*TINY, "dataset=bsds", f"dataset.root={root}", f"output={tmp_path / 'o2'}")
    assert run_eval(cfg) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "c.mat: expected the ground truth of" in err[0]


def test_bsds_scores_the_labels_segment_writes():
    """score_regions reads the label map `segment` writes for a photo (render.postprocess,
    default label_upsampling) at the human segmentations' size."""
    from segment.eval.metrics import region_state
    from segment.run.api.render import postprocess

    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 5, (2, 4, 6), generator=g)
    out = MethodOutput(heatmap=torch.rand(2, 4, 6, generator=g), labels=labels,
                       foreground=torch.tensor([[True, False, True, False, True]] * 2))
    gts = [torch.randint(1, 4, (3, 21, 31), generator=g), torch.randint(1, 3, (2, 31, 21), generator=g)]
    states = score_regions(out, gts, "x")
    for i, t in enumerate(gts):
        written = postprocess(out, i, tuple(t.shape[-2:])).labels
        assert np.array_equal(region_labels(out, i, tuple(t.shape[-2:])).numpy(), written)
        assert states[i] == region_state(written, t.numpy())
