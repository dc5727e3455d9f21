"""Token masking (segment.eval.masking, TimmViT.forward_kept) on the tiny random ViT of
configs/model/vit_tiny_random.yaml."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf

from segment.eval import masking
from segment.models.base import Backbone
from segment.models.vit import TimmViT

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "model" / "vit_tiny_random.yaml"


def tiny_vit(**kw) -> TimmViT:
    """The tiny random ViT of the config (on the CPU), with extra model_kwargs, its weights
    redrawn larger (timm's init, std 0.02 and DINOv2's LayerScale 1e-5, leaves the CLS token nearly blind to the patches,
    which would let a wrong token selection pass unnoticed)."""
    cfg = OmegaConf.load(CONFIG)
    cfg.device = "cpu"
    for k, v in kw.items():
        cfg.model_kwargs[k] = v
    torch.manual_seed(0)
    vit = instantiate(cfg)
    return scramble(vit)


def scramble(vit: TimmViT, std: float = 0.3) -> TimmViT:
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in vit.model.named_parameters():
            if p.dim() >= 2 or name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif name.endswith("gamma"):  # DINOv2's LayerScale starts at 1e-5
                p.fill_(1.0)
        vit._pos_cache.clear()  # the position table is resampled from the (unchanged) source
        vit._grid = None
    return vit


def pixels(b: int = 1, size: int = 56, seed: int = 1) -> torch.Tensor:
    return torch.randn(b, 3, size, size, generator=torch.Generator().manual_seed(seed))


def manual_kept(vit: TimmViT, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The final normalised CLS token of the model run on CLS/registers + the kept patches,
    built by hand: the patch projection as a convolution, the position table of the grid
    added, the prefix tokens prepended, then the timm blocks one by one and the final norm."""
    m = vit.model
    vit._set_grid(x)  # the position table of this grid
    proj = m.patch_embed.proj
    tok = F.conv2d(x, proj.weight, proj.bias, stride=proj.stride)  # (B, C, h, w)
    tok = tok.flatten(2).transpose(1, 2)  # (B, n, C), row-major
    pos = m.pos_embed  # (1, 1 + n, C): CLS entry, then the grid; (1, n, C) without a CLS entry
    cls = m.cls_token.expand(x.shape[0], -1, -1)
    if m.no_embed_class:  # DINOv2 with registers: the prefix tokens carry no position
        prefix, tok = [cls], tok + pos
    else:
        prefix, tok = [cls + pos[:, :1]], tok + pos[:, 1:]
    if m.reg_token is not None:
        prefix.append(m.reg_token.expand(x.shape[0], -1, -1))
    rows = []
    for i in range(keep.shape[0]):
        seq = torch.cat([p[i: i + 1] if p.shape[0] > 1 else p[:1] for p in prefix]
                        + [tok[i if x.shape[0] > 1 else 0, keep[i]].unsqueeze(0)], dim=1)
        for blk in m.blocks:
            seq = blk(seq)
        rows.append(m.norm(seq)[:, 0])
    return torch.cat(rows)


# --------------------------------------------------------------------------------------
# the backbone: forward on the kept tokens
# --------------------------------------------------------------------------------------


def test_forward_kept_all_tokens_is_the_plain_forward():
    vit = tiny_vit()
    x = pixels(2)
    n = vit.grid_size((56, 56))[0] * vit.grid_size((56, 56))[1]
    out = vit.forward_kept(x, torch.arange(n).expand(2, -1))
    plain = vit.forward_plain(x)[:, 0]  # (B, C): normalised final CLS
    assert out.logits is None and out.num_tokens == 1 + n
    torch.testing.assert_close(out.embedding, plain, rtol=1e-5, atol=1e-5)


def test_forward_kept_equals_the_model_on_the_kept_tokens():
    vit = tiny_vit()
    x = pixels(1)
    n = 16  # 56 px / patch 14 = 4 x 4
    g = torch.Generator().manual_seed(3)
    keep = torch.stack([torch.sort(torch.randperm(n, generator=g)[:9]).values for _ in range(3)])
    out = vit.forward_kept(x, keep)
    with torch.no_grad():
        ref = manual_kept(vit, x, keep)
    assert out.num_tokens == 1 + 9
    torch.testing.assert_close(out.embedding, ref, rtol=1e-5, atol=1e-5)
    full = vit.forward_kept(x, torch.arange(n)[None]).embedding
    # the drop matters: each kept set gives another embedding than the full image
    assert (out.embedding - full).abs().amax(-1).min() > 1e-3
    # one row per image too: (B, 3, H, W) with (B, K)
    xb = pixels(3, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(vit.forward_kept(xb, keep).embedding, manual_kept(vit, xb, keep),
                                   rtol=1e-5, atol=1e-5)


def test_forward_kept_with_registers_keeps_them():
    torch.manual_seed(0)
    vit = scramble(TimmViT("vit_small_patch14_reg4_dinov2", pretrained=False, device="cpu",
                           model_kwargs={"embed_dim": 64, "depth": 2, "num_heads": 2}))
    x = pixels(1)
    keep = torch.tensor([[0, 3, 5, 6, 10, 15]])
    out = vit.forward_kept(x, keep)
    with torch.no_grad():
        ref = manual_kept(vit, x, keep)
    assert out.num_tokens == 5 + 6
    torch.testing.assert_close(out.embedding, ref, rtol=1e-5, atol=1e-5)


def test_forward_kept_refuses_bad_indices():
    vit = tiny_vit()
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        vit.forward_kept(pixels(1), torch.tensor([[0, 16]]))
    with pytest.raises(ValueError, match="rows of keep"):
        vit.forward_kept(pixels(2), torch.tensor([[0], [1], [2]]))


def test_a_backbone_that_cannot_drop_tokens_says_so():
    class NoDrop(Backbone):  # e.g. FLUX: the contract's default
        name = "flux_like"

        def preprocess(self, image):
            raise AssertionError

        def extract(self, pixels, capture, *, prompts=None):
            raise AssertionError

        def forward_plain(self, pixels):
            raise AssertionError

    assert not NoDrop.can_drop_tokens and TimmViT.can_drop_tokens
    with pytest.raises(NotImplementedError, match="cannot drop tokens"):
        NoDrop().forward_kept(pixels(1), torch.tensor([[0]]))


# --------------------------------------------------------------------------------------
# rankings, curves, AUC
# --------------------------------------------------------------------------------------


def test_kept_patches_drop_the_top_or_the_bottom():
    scores = torch.tensor([0.1, 0.9, 0.5, 0.7, 0.3, 0.0, 0.2, 0.8, 0.6, 0.4])
    order = masking.ranking(scores)
    assert order.tolist() == [1, 7, 3, 8, 2, 9, 4, 6, 0, 5]
    assert masking.kept_patches(order, 0.3, "most").tolist() == [0, 2, 4, 5, 6, 8, 9]
    assert masking.kept_patches(order, 0.3, "least").tolist() == [1, 2, 3, 4, 7, 8, 9]
    assert masking.kept_patches(order, 0.0, "most").tolist() == list(range(10))
    assert masking.drop_count(256, 0.3) == 77 and masking.drop_count(256, 0.9) == 230
    assert masking.drop_count(3, 0.9) == 2  # at least one patch stays


def test_auc_of_hand_built_curves():
    p = masking.FRACTIONS
    assert masking.auc(np.ones(10), p) == pytest.approx(1.0)
    # y = 1 - p is linear: the trapezoid is exact, mean height over [0, 0.9] = 1 - 0.45
    assert masking.auc(1.0 - np.array(p), p) == pytest.approx(0.55)
    # a drop to 0 after the first step: one triangle of area 0.1 * 1 / 2, over the span 0.9
    assert masking.auc(np.array([1.0] + [0.0] * 9), p) == pytest.approx(0.05 / 0.9)
    # by hand, uneven values: sum of 0.1 * (y_k + y_k+1) / 2, / 0.9
    y = np.array([1.0, 0.9, 0.9, 0.6, 0.5, 0.5, 0.2, 0.1, 0.1, 0.0])
    by_hand = sum(0.1 * (y[k] + y[k + 1]) / 2 for k in range(9)) / 0.9
    assert masking.auc(y, p) == pytest.approx(by_hand)
    assert masking.auc(np.stack([y, np.ones(10)]), p) == pytest.approx([by_hand, 1.0])
    with pytest.raises(ValueError, match="increase"):
        masking.auc(np.ones(3), [0.0, 0.2, 0.1])


def test_cosine_is_exactly_one_for_the_same_vector():
    v = torch.randn(5, 384, generator=torch.Generator().manual_seed(0))
    assert bool((masking.cosine(v, v) == 1.0).all())
    assert masking.cosine(v[:1], -v[:1]).item() == -1.0


def test_mask_image_zero_drop_is_exactly_one_and_drops_degrade():
    vit = tiny_vit(num_classes=7)
    x = pixels(1)
    n = 16
    scores = {"a": torch.arange(n, dtype=torch.float32), "b": torch.rand(n, generator=torch.Generator().manual_seed(2))}
    c = masking.mask_image(vit, x, scores, label=3)
    assert c.rows == [("a", "most"), ("a", "least"), ("b", "most"), ("b", "least")]
    assert c.similarity.shape == (4, 10)
    assert (c.similarity[:, 0] == 1.0).all()  # exactly
    assert (c.agreement[:, 0] == 1.0).all()
    assert (c.similarity[:, 1:] < 1.0).all()
    ref_top = vit.forward_kept(x, torch.arange(n)[None]).logits.argmax().item()
    assert (c.correct[:, 0] == float(ref_top == 3)).all()
    # each entry is the model on that kept set: row ("a", "most") at p = 0.5 drops the top 8
    full = vit.forward_kept(x, torch.arange(n)[None]).embedding
    kept = vit.forward_kept(x, torch.arange(8)[None]).embedding  # scores a: 0..15, top = 8..15
    assert c.similarity[0, 5] == pytest.approx(masking.cosine(kept, full).item(), abs=1e-6)


def test_summarise_intervals_and_paired_differences():
    rng = np.random.default_rng(0)
    rows = [("tr", "most"), ("random", "most")]
    per = []
    for _ in range(30):
        y_tr = np.clip(1 - np.array(masking.FRACTIONS) * (0.9 + 0.1 * rng.random()), 0, 1)
        y_rd = np.clip(1 - np.array(masking.FRACTIONS) * (0.3 + 0.1 * rng.random()), 0, 1)
        per.append(masking.ImageCurves(rows=rows, similarity=np.stack([y_tr, y_rd])))
    s = masking.summarise(per, masking.FRACTIONS, reps=200, seed=0)
    tr, rd = s.rows
    expect = masking.auc(np.stack([c.similarity[0] for c in per]), masking.FRACTIONS).mean()
    assert tr["AUC_similarity"] == pytest.approx(expect, abs=1e-6)
    lo, hi = tr["ci95"]["similarity"]
    assert lo <= tr["AUC_similarity"] <= hi
    d, dlo, dhi = tr["delta"]["random"]["similarity"]
    assert d < 0 and dhi < 0  # tr degrades faster than random, with an interval clear of 0
    assert "delta" not in rd
    # against several references: each other row, paired; row minus reference
    s2 = masking.summarise(per, masking.FRACTIONS, reps=200, seed=0, references=("random", "tr", "nope"))
    assert set(s2.rows[0]["delta"]) == {"random"} and set(s2.rows[1]["delta"]) == {"tr"}
    assert s2.rows[1]["delta"]["tr"]["similarity"][0] == pytest.approx(-d, abs=1e-6)
    assert s2.rows[1]["delta"]["tr"]["similarity"][1] == pytest.approx(-dhi, abs=1e-6)
    assert {c["metric"] for c in s.curves} == {"similarity"} and len(s.curves) == 2 * 10
    md = masking.markdown(s)
    assert "| tr | most |" in md and "Δ vs random" in md


# --------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------

EVAL = Path(sys.executable).with_name("segment-eval")


def tiny_folder(root: Path, k: int = 3) -> Path:
    from PIL import Image

    d = root / "imgs"
    (d / "sub").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(k):
        Image.fromarray(rng.integers(0, 255, (40 + 7 * i, 60, 3), dtype=np.uint8)).save(
            d / ("sub" if i == 0 else "") / f"im{i}.png")
    (d / "notes.txt").write_text("not an image")
    return d


def eval_cmd(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    if not EVAL.is_file():
        pytest.fail(f"the segment-eval command is not installed next to {sys.executable}")
    env = dict(os.environ, OMP_NUM_THREADS="2")
    return subprocess.run([str(EVAL), *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_command_end_to_end_on_a_tiny_folder(tmp_path):
    folder = tiny_folder(tmp_path)
    out = tmp_path / "out"
    r = eval_cmd("experiment=token_masking", f"masking.input={folder}", "model=vit_tiny_random",
                 "model.image_size=56", "device=cpu", "bootstrap=40", f"output={out}", "progress=false",
                 "masking.write_every=2")
    assert r.returncode == 0, r.stderr[-2000:]
    for f in ("results.md", "results.json", "results.csv", "curves.csv", "curves.png", "per_image.csv"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f
    res = json.loads((out / "results.json").read_text())
    assert res["images"] == 3 and res["partial"] is False and res["fractions"][0] == 0.0 and res["fractions"][-1] == 0.9
    rows = {(r["method"], r["order"]): r for r in res["rows"]}
    methods = {"tokenrank_last", "tokenrank_all", "tokenrank_l2w", "cls_attention", "cls_2bounce", "random"}
    assert set(rows) == {(m, o) for m in methods for o in ("most", "least")}
    for (m, o), row in rows.items():
        lo, hi = row["ci95"]["similarity"]
        assert lo - 1e-9 <= row["AUC_similarity"] <= hi + 1e-9
        assert set(row["delta"]) == {"random", "cls_attention"} - {m}
        assert "AUC_agreement" not in row  # no head
    curves = list(csv.DictReader(io.StringIO((out / "curves.csv").read_text())))
    assert len(curves) == 12 * 10
    assert all(float(c["mean"]) == 1.0 for c in curves if float(c["p"]) == 0.0)
    cost = res["cost"]
    assert cost["masked_forwards_per_image"] == 12 * 9 and cost["batches_per_image"] == 9
    assert cost["bare_ms_per_image"] > 0 and cost["masked_vs_bare"] > 0
    assert "| tokenrank_last | most |" in r.stdout and "bare forward" in r.stdout
    assert "Δ vs cls_attention (95% CI)" in r.stdout


@pytest.mark.slow
def test_command_with_a_head_and_labels(tmp_path):
    folder = tiny_folder(tmp_path, k=2)
    labels = tmp_path / "labels.txt"
    labels.write_text("# stem class\nim0 n01440764\nim1, 3\n")
    out = tmp_path / "out"
    r = eval_cmd("experiment=token_masking", f"masking.input={folder}", "model=vit_tiny_random",
                 "model.image_size=56", "device=cpu", "bootstrap=20", f"output={out}", "progress=false",
                 "+model.model_kwargs.num_classes=10", f"masking.labels={labels}",
                 "masking.orders=[most]", "masking.fractions=[0,0.5,0.9]")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((out / "results.json").read_text())
    assert res["fractions"] == [0.0, 0.5, 0.9] and res["head_classes"] == 10
    for row in res["rows"]:
        assert row["order"] == "most"
        assert 0.0 <= row["AUC_agreement"] <= 1.0 and 0.0 <= row["AUC_accuracy"] <= 1.0


@pytest.mark.parametrize("args, msg", [
    ([], "masking.input"),
    (["masking.input=/no/such/folder"], "does not exist"),
    (["masking.input={folder}", "masking.fractions=[0.1,0.5]"], "masking.fractions"),
    (["masking.input={folder}", "masking.orders=[up]"], "masking.orders"),
    (["masking.input={folder}", "masking.compare=[nope]"], "masking.compare"),
    (["masking.input={folder}", "masking.labels={folder}/notes.txt"], "masking.labels"),
    (["masking.input={folder}", "model=flux_tiny"], "cannot drop tokens"),
])
def test_command_refuses_with_one_line_and_exit_2(tmp_path, args, msg):
    from omegaconf import OmegaConf as OC

    from segment.eval.cli import run

    folder = tiny_folder(tmp_path, k=1)
    overrides = ["experiment=token_masking", "model=vit_tiny_random", "device=cpu",
                 f"output={tmp_path / 'out'}", "progress=false"]
    overrides += [a.format(folder=folder) for a in args]
    from hydra import compose, initialize_config_module

    with initialize_config_module(version_base="1.3", config_module="segment.configs"):
        cfg = compose(config_name="eval", overrides=overrides)
    OC.set_struct(cfg, False)
    import contextlib
    import io as _io

    err = _io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run(cfg)
    lines = [ln for ln in err.getvalue().splitlines() if ln.startswith("segment-eval:")]
    assert code == 2, err.getvalue()
    assert len(lines) == 1 and msg in lines[0], err.getvalue()
