"""k-means of the keys (segment.core.clusters, segment.backends, segment.methods.KMeansKeys) on planted clusters,
and the method on a tiny random ViT through its config."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate

from segment.backends import kmeans_labels
from segment.core.clusters import token_features
from segment.core.record import AttentionRecord, TokenLayout
from segment.methods import KMeansKeys


def same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two labelings are equal up to a renaming of the ids."""
    a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
    pairs = set(zip(a.tolist(), b.tolist()))
    return len(pairs) == len(set(a.tolist())) == len(set(b.tolist()))


def planted(h: int = 4, w: int = 6, heads: int = 2, d: int = 3, noise: float = 0.05, seed: int = 0):
    """Keys ``(1, H, 1 + h*w, D)`` of three planted clusters on an ``h x w`` grid: left half,
    top right, bottom right. The right clusters share the same direction in head 0 and differ
    only in head 1; the left cluster has a large norm (normalisation must not split it)."""
    g = torch.Generator().manual_seed(seed)
    truth = np.zeros((h, w), dtype=np.int64)
    truth[: h // 2, w // 2 :] = 1
    truth[h // 2 :, w // 2 :] = 2
    centres = torch.tensor([
        [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]],
        [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]],
        [[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]],
    ], dtype=torch.float64)  # (cluster, head, D)
    t = torch.from_numpy(truth).flatten()
    keys = centres[t].transpose(0, 1)  # (H, n, D)
    scale = torch.where(t == 0, 5.0, 1.0).to(torch.float64)[None, :, None] * (1 + torch.rand(1, h * w, 1, generator=g, dtype=torch.float64))
    keys = keys * scale + noise * torch.randn(heads, h * w, d, generator=g, dtype=torch.float64)
    cls = torch.randn(heads, 1, d, generator=g, dtype=torch.float64)
    return torch.cat([cls, keys], 1)[None].float(), truth


def test_token_features_concatenate_heads_then_normalise():
    k = torch.randn(2, 3, 5, 4)
    f = token_features(k)
    want = k.permute(0, 2, 1, 3).reshape(2, 5, 12).double()
    want = want / want.norm(dim=-1, keepdim=True)
    assert f.shape == (2, 5, 12)
    torch.testing.assert_close(f.double(), want, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="B, H, n, D"):
        token_features(k[0])


def test_kmeans_recovers_planted_clusters():
    rng = np.random.default_rng(1)
    centres = rng.normal(size=(4, 8)) * 4
    truth = rng.integers(0, 4, size=(2, 300))
    x = torch.from_numpy(centres[truth] + rng.normal(size=(2, 300, 8)) * 0.3)
    lab = kmeans_labels(x, 4, seed=0)
    assert lab.shape == (2, 300) and lab.dtype == torch.int64
    for i in range(2):
        assert same_partition(lab[i].numpy(), truth[i])
    assert torch.equal(lab, kmeans_labels(x, 4, seed=0))  # deterministic
    with pytest.raises(ValueError, match="k must lie in 1..300"):
        kmeans_labels(x, 301)


def test_kmeans_keys_method_finds_the_planted_regions():
    keys, truth = planted()
    h, w = truth.shape
    layout = TokenLayout(num_tokens=1 + h * w, prefix=1, grid=(h, w))
    attn = torch.full((1, 1, layout.num_tokens, layout.num_tokens), 1.0 / layout.num_tokens)
    attn[0, 0, 0, 1:] = torch.from_numpy(np.where(truth.ravel() == 1, 3.0, 0.5)).float()  # CLS likes cluster 1
    attn[0, 0, 0] /= attn[0, 0, 0].sum()
    rec = AttentionRecord(attn={1: attn}, layout=layout, image_size=(8 * h, 8 * w), keys={1: keys},
                          num_layers=2)
    m = KMeansKeys(k=3)
    assert m.capture(2).keys and m.capture(2).layers == (1,)
    out = m(rec)
    assert out.labels.shape == (1, 8 * h, 8 * w) and out.foreground.shape == (1, 3)
    centres = out.labels[0, 4::8, 4::8].numpy()  # the pixel at each token's centre
    assert same_partition(centres, truth)
    fg = out.foreground[0][out.labels[0]]  # the foreground is the cluster CLS attends to
    assert torch.equal(fg[4::8, 4::8], torch.from_numpy(truth == 1))
    # without normalisation the big-norm cluster would split and the two right ones merge
    two = KMeansKeys(k=2)(rec).labels[0]
    assert same_partition(two[4::8, 4::8].numpy(), np.minimum(truth, 1))
    # bilinear one-hot upsampling + argmax: a two-region boundary falls between the tokens
    assert same_partition(two.numpy(), np.kron(np.minimum(truth, 1), np.ones((8, 8), dtype=np.int64)))
    with pytest.raises(ValueError, match="keys of layer 0"):
        KMeansKeys(k=3, layers=[0])(rec)


@pytest.mark.parametrize("kw", [dict(k=0), dict(max_iter=0), dict(n_init=0)])
def test_kmeans_bad_knobs(kw):
    with pytest.raises(ValueError):
        KMeansKeys(**kw)


@pytest.mark.parametrize("kw", [dict(heads="lambda2"), dict(average_layers=True)])
def test_kmeans_has_no_head_or_layer_averaging_settings(kw):
    """k-means clusters the keys of every head concatenated: neither is a setting."""
    with pytest.raises(TypeError, match="unexpected keyword"):
        KMeansKeys(**kw)


def test_kmeans_config_on_a_tiny_vit_every_knob_counts():
    from segment.models.vit import TimmViT

    with initialize_config_module(version_base="1.3", config_module="segment.configs"):
        cfg = compose(config_name="segment", overrides=["method=kmeans"])
    m = instantiate(cfg.method)
    assert isinstance(m, KMeansKeys) and (m.k, m.max_iter, m.seed, m.layers) == (8, 20, 0, (-1,))
    torch.manual_seed(0)
    model = TimmViT("vit_small_patch14_dinov2", pretrained=False, device="cpu",
                    model_kwargs=dict(embed_dim=64, depth=2, num_heads=2), image_size=(112, 168))
    pixels = torch.randn(2, 3, 112, 168, generator=torch.Generator().manual_seed(0))
    cap = m.capture(model.num_layers).union(KMeansKeys(layers=[0]).capture(2), 2)
    rec = model.extract(pixels, cap)  # keys of both layers, one pass
    out = m(rec)
    assert out.labels.shape == (2, 112, 168) and int(out.labels.max()) < 8
    assert out.heatmap.shape == (2, 112, 168) and bool(torch.isfinite(out.heatmap).all())
    assert torch.equal(out.labels, m(model.extract(pixels, m.capture(2))).labels)
    for knob in [dict(k=3), dict(seed=1), dict(max_iter=1), dict(n_init=5), dict(layers=[0])]:
        other = KMeansKeys(**knob)
        assert not torch.equal(other(rec).labels, out.labels), knob
    assert not torch.equal(KMeansKeys(score_layers=[0])(rec).heatmap, out.heatmap)


@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
def test_segment_writes_kmeans_labels(tmp_path):
    """`segment method=kmeans` writes labels/ (one id per cluster, at the image's size) and
    one COCO annotation per region, like the region-growing method."""
    import json

    from PIL import Image

    from segment.run.job.pipeline import run_segment

    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):
        Image.fromarray(rng.integers(0, 256, (45, 60, 3), dtype=np.uint8)).save(src / f"p{i}.png")
    with initialize_config_module(version_base="1.3", config_module="segment.configs"):
        cfg = compose("segment", overrides=[f"input='{src}'", f"output='{out}'", "model=vit_tiny_random",
                                            "device=cpu", "progress=false", "render.fsync=false",
                                            "method=kmeans", "method.k=4"])
    assert run_segment(cfg) == 0
    coco = json.loads((out / "annotations.json").read_text())
    for i in range(2):
        lab = np.asarray(Image.open(out / "labels" / f"p{i}.png"))
        assert lab.shape == (45, 60) and set(np.unique(lab).tolist()) <= set(range(4))
        img_id = next(im["id"] for im in coco["images"] if im["file_name"].startswith(f"p{i}"))
        anns = [a for a in coco["annotations"] if a["image_id"] == img_id]
        assert len(anns) == len(np.unique(lab)) >= 2
