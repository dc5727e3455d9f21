"""Heatmap methods on hand-built attention records with known answers (float64), and on a
tiny random ViT's record captured once for several methods (Capture.union)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate

from segment.core.masks import MethodOutput
from segment.core.record import AttentionRecord, Capture, TokenLayout
from segment.core.reduce import AttentionReducer
from segment.methods import Bounce, ClsAttention, Method, Rollout, TokenRank

DT = torch.float64


def stochastic(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(*shape, generator=g, dtype=DT) ** 3 + 1e-3
    return x / x.sum(-1, keepdim=True)


def record(attn: dict[int, torch.Tensor], layout: TokenLayout, num_layers: int | None = None,
           **kw) -> AttentionRecord:
    return AttentionRecord(attn=attn, layout=layout, image_size=(28, 42),
                           num_layers=num_layers if num_layers is not None else max(attn) + 1, **kw)


VIT = TokenLayout(num_tokens=1 + 2 * 3, prefix=1, grid=(2, 3))
REG = TokenLayout(num_tokens=3 + 2 * 3, prefix=3, grid=(2, 3), num_registers=2)
G = slice(1, 7)


def np_patch_chain(a: np.ndarray, g: slice) -> np.ndarray:
    p = a[..., g, g]
    return p / p.sum(-1, keepdims=True)


def np_lambda2(p: np.ndarray) -> float:
    ev = np.linalg.eigvals(p)
    ev = np.delete(ev, np.argmin(np.abs(ev - 1)))
    return float(np.abs(ev).max())


def two_block_head(eps: float, c: float, cls_row: np.ndarray) -> np.ndarray:
    """A head whose patch chain is ``(1-eps) blockdiag(J3/3, J3/3) + eps J6/6``:
    ``|lambda_2| = 1 - eps`` exactly; every patch row gives mass ``c`` to CLS."""
    b = np.zeros((6, 6))
    b[:3, :3] = b[3:, 3:] = 1 / 3
    p = (1 - eps) * b + eps / 6
    a = np.zeros((7, 7))
    a[0] = cls_row
    a[1:, 0] = c
    a[1:, 1:] = (1 - c) * p
    return a


# --------------------------------------------------------------------------------------
# single methods, known answers
# --------------------------------------------------------------------------------------


def test_cls_attention_selects_the_cls_row_over_patches():
    a = stochastic(2, 3, 9, 9)
    out = ClsAttention()(record({0: a}, REG))
    assert isinstance(out, MethodOutput) and out.heatmap.shape == (2, 2, 3)
    want = a.mean(1)[:, 0, 3:].reshape(2, 2, 3)  # registers are prefix, not patches
    assert torch.allclose(out.heatmap, want, atol=1e-14)


def test_query_tokens_replace_cls():
    """FLUX-style records: no CLS, the start is uniform over each image's query tokens."""
    lay = TokenLayout(num_tokens=4 + 6, prefix=4, grid=(2, 3), cls_index=None, kind="dit")
    a = stochastic(2, 2, 10, 10, seed=1)
    out = ClsAttention()(record({0: a}, lay, query=[(1,), (2, 3)]))
    m = a.mean(1)
    want = torch.stack([m[0, 1, 4:], (m[1, 2, 4:] + m[1, 3, 4:]) / 2]).reshape(2, 2, 3)
    assert torch.allclose(out.heatmap, want, atol=1e-14)
    with pytest.raises(ValueError, match="no CLS"):
        ClsAttention()(record({0: a}, lay))


def test_lambda2_weighted_fusion_known_weights():
    rng = np.random.default_rng(0)
    eps, heads = [0.1, 0.5, 0.8], []
    for i, e in enumerate(eps):
        row = rng.random(7)
        heads.append(two_block_head(e, c=0.2 + 0.1 * i, cls_row=row / row.sum()))
    a = torch.from_numpy(np.stack(heads))[None]  # (1, 3, 7, 7)
    for h in range(3):  # the construction has the eigenvalue it claims
        assert abs(np_lambda2(np_patch_chain(a[0, h].numpy(), G)) - (1 - eps[h])) < 1e-12
    w = np.array([1 - e for e in eps]) / sum(1 - e for e in eps)
    out = ClsAttention(heads="lambda2")(record({0: a}, VIT))
    want = sum(w[h] * heads[h][0, 1:] for h in range(3)).reshape(1, 2, 3)
    assert np.allclose(out.heatmap.numpy(), want, atol=1e-10)
    mean = ClsAttention(heads="mean")(record({0: a}, VIT))
    assert not np.allclose(mean.heatmap.numpy(), want, atol=1e-3)


def _np_bounce(a: np.ndarray, steps: int, fuse: str, w: np.ndarray | None = None) -> np.ndarray:
    """Hand reference of Bounce for one image ``a`` (H, N, N) with VIT's layout."""
    h = a.shape[0]
    w = np.full(h, 1 / h) if w is None else w
    if fuse == "attention":
        a, w, h = (w[:, None, None] * a).sum(0, keepdims=True), np.ones(1), 1
    v1 = a[:, 0, G] / a[:, 0, G].sum(-1, keepdims=True)
    p = np_patch_chain(a, G)
    if fuse == "chain":
        v1, p = (w[:, None] * v1).sum(0, keepdims=True), (w[:, None, None] * p).sum(0, keepdims=True)
        w = np.ones(1)
    v = v1
    for _ in range(steps - 1):
        v = np.einsum("hn,hnm->hm", v, p)
    return (w[:, None] * v).sum(0)


@pytest.mark.parametrize("fuse", ["output", "chain", "attention"])
@pytest.mark.parametrize("steps", [1, 2, 3])
def test_bounce_equals_matrix_products_by_hand(fuse, steps):
    a = stochastic(2, 3, 7, 7, seed=2)
    out = Bounce(steps=steps, fuse=fuse)(record({0: a}, VIT)).heatmap
    for b in range(2):
        assert np.allclose(out[b].numpy().ravel(), _np_bounce(a[b].numpy(), steps, fuse), atol=1e-13)


def test_two_bounce_explicit_numbers():
    """One head, CLS + 2 patches: v1 = (.2, .6)/.8, P = [[.5,.3],[.1,.1]] renormalised."""
    a = torch.tensor([[[[0.2, 0.2, 0.6], [0.2, 0.5, 0.3], [0.8, 0.1, 0.1]]]], dtype=DT)
    lay = TokenLayout(num_tokens=3, prefix=1, grid=(1, 2))
    out = Bounce(steps=2)(record({0: a}, lay)).heatmap
    v1 = np.array([0.25, 0.75])
    p = np.array([[0.5 / 0.8, 0.3 / 0.8], [0.5, 0.5]])
    assert np.allclose(out.numpy().ravel(), v1 @ p, atol=1e-15)  # (0.53125, 0.46875)
    assert np.allclose(out.numpy().ravel(), [0.53125, 0.46875], atol=1e-15)


def test_bounce_lambda2_output_fusion_weights():
    rng = np.random.default_rng(1)
    heads = [two_block_head(e, 0.3, rng.dirichlet(np.ones(7))) for e in (0.2, 0.6)]
    a = torch.from_numpy(np.stack(heads))[None]
    w = np.array([0.8, 0.4]) / 1.2
    for fuse in ["output", "chain"]:
        out = Bounce(steps=2, heads="lambda2", fuse=fuse)(record({0: a}, VIT)).heatmap
        want = _np_bounce(a[0].numpy(), 2, fuse, w)
        assert np.allclose(out.numpy().ravel(), want, atol=1e-10)
        other = _np_bounce(a[0].numpy(), 2, fuse)  # mean weights: a different answer
        assert not np.allclose(out.numpy().ravel(), other, atol=1e-4)


def test_rollout_two_layers_by_hand():
    """Â = rownorm(0.5 A + 0.5 I); heat = [e_cls^T Â_1 Â_0]_grid = (.625, .125)."""
    a0 = torch.tensor([[0, 0.5, 0.5], [0, 1, 0], [0, 0, 1]], dtype=DT)
    a1 = torch.tensor([[0, 1, 0], [0, 1, 0], [0, 0, 1]], dtype=DT)
    lay = TokenLayout(num_tokens=3, prefix=1, grid=(1, 2))
    rec = record({0: a0[None, None], 1: a1[None, None]}, lay)
    out = Rollout()(rec).heatmap
    assert torch.allclose(out.ravel(), torch.tensor([0.625, 0.125], dtype=DT), atol=1e-15)
    # the other multiplication order, e^T Â_0 Â_1, would give (.5, .25)
    only_last = Rollout(layers=[-1])(rec).heatmap  # one layer: e^T Â_1
    assert torch.allclose(only_last.ravel(), torch.tensor([0.5, 0.0], dtype=DT), atol=1e-15)


def test_rollout_matches_dense_product_with_heads():
    a = {i: stochastic(2, 3, 9, 9, seed=10 + i) for i in range(4)}
    out = Rollout(residual=0.3)(record(a, REG)).heatmap
    eye = torch.eye(9, dtype=DT)
    r = eye.expand(2, 9, 9)
    for i in range(4):  # R = Â_3 Â_2 Â_1 Â_0
        hat = 0.7 * a[i].mean(1) + 0.3 * eye
        r = hat @ r
    assert torch.allclose(out, r[:, 0, 3:].reshape(2, 2, 3), atol=1e-14)


def np_stationary(p: np.ndarray, alpha: float) -> np.ndarray:
    n = p.shape[-1]
    t = alpha * p + (1 - alpha) / n
    ev, vec = np.linalg.eig(t.T)
    v = np.real(vec[:, np.argmin(np.abs(ev - 1))])
    return v / v.sum()


@pytest.mark.parametrize("fuse", ["chain", "output", "attention"])
def test_tokenrank_is_the_stationary_vector(fuse):
    a = stochastic(2, 3, 7, 7, seed=4)
    m = TokenRank(fuse=fuse, alpha=0.9, tol=1e-14, max_iter=5000)
    out = m(record({0: a}, VIT)).heatmap
    for b in range(2):
        x = a[b].numpy()
        if fuse == "chain":
            want = np_stationary(np_patch_chain(x, G).mean(0), 0.9)
        elif fuse == "output":
            want = np.mean([np_stationary(np_patch_chain(x[h], G), 0.9) for h in range(3)], 0)
        else:
            want = np_stationary(np_patch_chain(x.mean(0), G), 0.9)
        assert np.allclose(out[b].numpy().ravel(), want, atol=1e-11)
        pi = out[b].numpy().ravel()
        if fuse != "output":  # a fixed point of its own damped chain
            p = np_patch_chain(x, G).mean(0) if fuse == "chain" else np_patch_chain(x.mean(0), G)
            assert np.allclose(pi @ (0.9 * p + 0.1 / 6), pi, atol=1e-12)


@pytest.mark.parametrize("fuse", ["chain", "output"])
def test_tokenrank_reports_whether_its_power_iteration_converged(fuse):
    """``converged`` is per image: False when a head of that image stops at ``max_iter``
    short of ``tol``; the heatmap is the same as before (return_info changes nothing)."""
    a = stochastic(2, 3, 7, 7, seed=4)
    # image 1: head 2's patch chain mixes slowly (one block drains into the other)
    slow = torch.zeros(7, 7, dtype=a.dtype)
    slow[:, 0] = 0.5
    slow[1:3, 1:3] = 0.5 * 0.999 / 2  # block {1, 2} leaks slowly into block {3..6}
    slow[1:3, 3:] = 0.5 * 0.001 / 4
    slow[3:, 3:] = 0.5 / 4
    slow[0, 1:] = 0.5 / 6
    a[1, 2] = slow
    rec = record({0: a}, VIT)
    tight = TokenRank(fuse=fuse, alpha=0.999, tol=1e-12, max_iter=3)(rec)
    assert tight.converged.tolist() == [False, False]
    loose = TokenRank(fuse=fuse, alpha=0.999, tol=1e-6, max_iter=200)(rec)
    if fuse == "output":
        assert loose.converged.tolist() == [True, False]
    else:  # the fused chain of image 1 mixes slowly too
        assert loose.converged[0].item() is True
    ref = np.stack([np_stationary(np_patch_chain(a[b].numpy()[h], G), 0.999)
                    for b in range(2) for h in range(3)]).reshape(2, 3, 6)
    if fuse == "output":
        assert np.allclose(loose.heatmap[0].numpy().ravel(), ref[0].mean(0), atol=1e-5)
    # the method returns exactly what the core function returns
    m = TokenRank(fuse="output", alpha=0.999, tol=1e-6, max_iter=200)
    chain = np_patch_chain(a[0].numpy(), G)
    from segment.core import markov
    pi = markov.tokenrank(torch.from_numpy(chain), alpha=0.999, tol=1e-6, max_iter=200)
    torch.testing.assert_close(m(rec).heatmap[0].ravel(), pi.mean(0), atol=1e-15, rtol=0)


def test_tokenrank_lambda2_chain_weights():
    rng = np.random.default_rng(3)
    heads = [two_block_head(e, 0.4, rng.dirichlet(np.ones(7))) for e in (0.1, 0.7)]
    # make the heads' patch chains differ beyond their block structure
    heads[1][1:, 1:] = heads[1][1:, 1:] @ np.diag(np.linspace(0.5, 1.5, 6))
    heads[1][1:, 1:] *= 0.6 / heads[1][1:, 1:].sum(-1, keepdims=True)
    a = torch.from_numpy(np.stack(heads))[None]
    p = [np_patch_chain(h, G) for h in heads]
    lam = np.array([np_lambda2(q) for q in p])
    w = lam / lam.sum()
    out = TokenRank(heads="lambda2", alpha=0.99, tol=1e-14, max_iter=10000)(record({0: a}, VIT))
    want = np_stationary(w[0] * p[0] + w[1] * p[1], 0.99)
    assert np.allclose(out.heatmap.numpy().ravel(), want, atol=1e-9)


# --------------------------------------------------------------------------------------
# layers, captures, pre-reduced records
# --------------------------------------------------------------------------------------


def test_layer_selection_and_averaging():
    a = {i: stochastic(1, 2, 7, 7, seed=20 + i) for i in range(4)}
    rec = record(a, VIT)
    last = ClsAttention()(rec).heatmap
    assert torch.allclose(last.ravel(), a[3].mean(1)[0, 0, 1:], atol=1e-15)
    two = ClsAttention(layers=[0, -1])(rec).heatmap
    assert torch.allclose(two.ravel(), (a[0] + a[3]).mean(1)[0, 0, 1:] / 2, atol=1e-15)
    # bounce is not linear: averaging chains != averaging heatmaps
    per_layer = Bounce(layers=[1, 2], fuse="chain")(rec).heatmap
    averaged = Bounce(layers=[1, 2], fuse="chain", average_layers=True)(rec).heatmap
    x = ((a[1] + a[2]) / 2)[0].numpy()
    assert np.allclose(averaged.numpy().ravel(), _np_bounce(x, 2, "chain"), atol=1e-13)
    want = (_np_bounce(a[1][0].numpy(), 2, "chain") + _np_bounce(a[2][0].numpy(), 2, "chain")) / 2
    assert np.allclose(per_layer.numpy().ravel(), want, atol=1e-13)
    assert not np.allclose(per_layer.numpy(), averaged.numpy(), atol=1e-6)


def test_capture_says_what_each_method_needs():
    assert ClsAttention(layers=[-1], heads="lambda2").capture(12) == Capture(
        layers=(11,), heads="lambda2", average_layers=False)
    assert Rollout().capture(4) == Capture(layers=(0, 1, 2, 3), heads="mean")
    assert Bounce().capture(12).heads == "keep"
    assert Bounce(fuse="attention").capture(12).heads == "mean"
    assert TokenRank().capture(12).heads == "keep"
    c = TokenRank(layers=[-2, -1], average_layers=True).capture(12)
    assert c.layers == (10, 11) and c.average_layers
    assert not ClsAttention().capture(12).average_layers
    with pytest.raises(ValueError, match="no effect with one layer"):  # nothing to average
        ClsAttention(average_layers=True)


@pytest.mark.parametrize("heads", ["mean", "lambda2"])
def test_records_reduced_while_capturing_give_the_same_heatmaps(heads):
    layers = {i: stochastic(2, 3, 9, 9, seed=30 + i) for i in range(3)}
    full = record(layers, REG)

    def reduced(capture: Capture) -> AttentionRecord:
        r = AttentionReducer(capture, 3, REG)
        for i, x in layers.items():
            r.update(i, x)
        return r.record(image_size=(28, 42))

    for m in [ClsAttention(heads=heads), Rollout(heads=heads),
              ClsAttention(heads=heads, layers=[0, 1], average_layers=True),
              Bounce(heads=heads, fuse="attention", layers=[1, 2], average_layers=True),
              TokenRank(heads=heads, layers=[-1, 0], average_layers=True),
              Bounce(heads=heads, layers=[-1, -2], average_layers=True)]:
        got = m(reduced(m.capture(3))).heatmap
        assert torch.allclose(got.double(), m(full).heatmap, atol=1e-6), m


def test_records_that_cannot_serve_a_method_are_refused():
    a = {i: stochastic(1, 3, 7, 7, seed=40 + i) for i in range(2)}

    def reduced(capture: Capture) -> AttentionRecord:
        r = AttentionReducer(capture, 2, VIT)
        for i, x in a.items():
            r.update(i, x)
        return r.record(image_size=(28, 42))

    fused = reduced(Capture(layers=None, heads="mean"))
    with pytest.raises(ValueError, match="needs every head"):
        Bounce()(fused)
    with pytest.raises(ValueError, match="heads=lambda2"):
        ClsAttention(heads="lambda2")(fused)
    # heads whose |lambda_2| are equal get equal weights: the record still knows they were
    # fused by lambda2 (not read back from the weights), so the method that asked accepts it
    same = {i: x[:, :1].expand(1, 3, 7, 7).contiguous() for i, x in a.items()}
    r = AttentionReducer(Capture(layers=None, heads="lambda2"), 2, VIT)
    for i, x in same.items():
        r.update(i, x)
    twins = r.record(image_size=(28, 42))
    assert twins.head_fusion == "lambda2" and torch.allclose(twins.head_weights[0], torch.full((1, 3), 1 / 3))
    got = ClsAttention(heads="lambda2", layers=[0])(twins).heatmap
    torch.testing.assert_close(got, same[0][:, 0, 0, 1:].reshape(1, 2, 3).float(), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="captured with heads fused by lambda2"):
        ClsAttention(layers=[0])(twins)  # the mean-heads method is refused it, by name
    with pytest.raises(ValueError, match="averaged"):
        ClsAttention(layers=[0, 1])(reduced(Capture(layers=None, average_layers=True)))
    with pytest.raises(ValueError, match="not captured"):
        ClsAttention(layers=[0])(record({1: a[1]}, VIT, num_layers=2))
    with pytest.raises(ValueError, match="num_layers"):
        ClsAttention()(AttentionRecord(attn={1: a[1]}, layout=VIT, image_size=(28, 42)))
    # without num_layers, non-negative layer indices still work: the CLS row of layer 1
    got = ClsAttention(layers=[1])(AttentionRecord(attn={1: a[1]}, layout=VIT, image_size=(1, 1)))
    want = a[1].mean(1)[:, 0, 1:].reshape(1, 2, 3)
    torch.testing.assert_close(got.heatmap, want, atol=1e-15, rtol=0)


@pytest.mark.parametrize("kw", [
    dict(heads="max"), dict(layers=[]), dict(fuse="heads"), dict(steps=0),
])
def test_bad_knobs(kw):
    cls = Bounce if ("fuse" in kw or "steps" in kw) else ClsAttention
    with pytest.raises(ValueError):
        cls(**kw)
    with pytest.raises(TypeError, match="average_layers"):  # rollout multiplies its layers
        Rollout(average_layers=True)
    with pytest.raises(ValueError, match="alpha"):
        TokenRank(alpha=1.5)


# --------------------------------------------------------------------------------------
# configs and a tiny random ViT
# --------------------------------------------------------------------------------------


def _configs() -> dict[str, Method]:
    out = {}
    with initialize_config_module(version_base="1.3", config_module="segment.configs"):
        for name in ["cls_attention", "rollout", "bounce", "tokenrank"]:
            cfg = compose(config_name="segment", overrides=[f"method={name}"])
            out[name] = instantiate(cfg.method)
        cfg = compose(config_name="segment", overrides=[
            "method=bounce", "method.steps=3", "method.heads=lambda2", "method.layers=[0,-1]"])
        out["bounce3_l2"] = instantiate(cfg.method)
    return out


def test_method_configs():
    ms = _configs()
    assert isinstance(ms["cls_attention"], ClsAttention) and ms["cls_attention"].layers == (-1,)
    assert isinstance(ms["rollout"], Rollout) and ms["rollout"].layers is None
    assert isinstance(ms["bounce"], Bounce) and (ms["bounce"].steps, ms["bounce"].fuse) == (2, "output")
    assert isinstance(ms["tokenrank"], TokenRank) and ms["tokenrank"].fuse == "chain"
    b = ms["bounce3_l2"]
    assert (b.steps, b.heads, b.layers) == (3, "lambda2", (0, -1))


def test_all_methods_on_one_union_record_of_a_tiny_vit():
    from segment.models.vit import TimmViT

    torch.manual_seed(0)
    model = TimmViT("vit_small_patch14_reg4_dinov2", pretrained=False, device="cpu",
                    model_kwargs=dict(embed_dim=64, depth=2, num_heads=2), image_size=(224, 308))
    pixels = torch.randn(2, 3, 224, 308)
    methods = list(_configs().values()) + [
        TokenRank(heads="lambda2", fuse="output"), Bounce(fuse="attention", heads="lambda2"),
        ClsAttention(layers=[0, 1], average_layers=True),
    ]
    cap = methods[0].capture(model.num_layers)
    for m in methods[1:]:
        cap = cap.union(m.capture(model.num_layers), model.num_layers)
    assert cap.heads == "keep" and cap.layers == (0, 1)
    shared = model.extract(pixels, cap)
    for m in methods:
        own = model.extract(pixels, m.capture(model.num_layers))
        a, b = m(shared).heatmap, m(own).heatmap
        assert a.shape == (2, 16, 22) and bool(torch.isfinite(a).all()) and bool((a >= 0).all())
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), m


# --------------------------------------------------------------------------------------
# chain (grid | joint) and direction (forward | source) of bounce and tokenrank
# --------------------------------------------------------------------------------------


def _np_damped(a: np.ndarray, alpha: float, source: bool) -> np.ndarray:
    t = alpha * a + (1 - alpha) / a.shape[-1]
    if source:
        t = np.swapaxes(t / t.sum(-2, keepdims=True), -1, -2)
    return t


def _np_outgoing(a: np.ndarray, alpha: float) -> np.ndarray:
    """Protocol §1's outgoing view: damping applied to the column-normalised transpose."""
    s = np.swapaxes(a / a.sum(-2, keepdims=True), -1, -2)
    return alpha * s + (1 - alpha) / a.shape[-1]


@pytest.mark.parametrize("direction", ["forward", "source"])
@pytest.mark.parametrize("fuse", ["output", "attention"])
def test_joint_bounce_walks_every_token_by_hand(direction, fuse):
    a = stochastic(2, 3, 7, 7, seed=6)
    src = direction == "source"
    for steps in (1, 2, 3):
        m = Bounce(steps=steps, fuse=fuse, chain="joint", direction=direction, alpha=0.8)
        out = m(record({0: a}, VIT)).heatmap.reshape(2, 6).numpy()
        for b in range(2):
            x = a[b].numpy()
            heads = [x.mean(0)] if fuse == "attention" else list(x)
            want = np.mean([np.linalg.matrix_power(_np_damped(h, 0.8, src), steps)[0, 1:]
                            for h in heads], 0)  # from CLS, grid slice, not renormalised
            assert np.allclose(out[b], want, atol=1e-13), (steps, b)


@pytest.mark.parametrize("fuse", ["output", "chain"])
def test_grid_source_bounce_by_hand(fuse):
    a = stochastic(2, 3, 7, 7, seed=7)
    out = Bounce(steps=3, fuse=fuse, direction="source")(record({0: a}, VIT)).heatmap
    for b in range(2):
        x = a[b].numpy()
        v1 = x[:, 1:, 0] / x[:, 1:, 0].sum(-1, keepdims=True)  # the CLS column over patches
        p = np_patch_chain(x, G)
        if fuse == "chain":
            v1, p = v1.mean(0, keepdims=True), p.mean(0, keepdims=True)
        s = np.swapaxes(p / p.sum(-2, keepdims=True), -1, -2)  # reverse of each patch chain
        want = np.einsum("hn,hnm->hm", v1, s @ s).mean(0)
        assert np.allclose(out[b].numpy().ravel(), want, atol=1e-13)


@pytest.mark.parametrize("chain", ["grid", "joint"])
def test_tokenrank_chain_and_direction_by_hand(chain):
    a = stochastic(2, 3, 7, 7, seed=8)
    outs = {}
    for direction in ("forward", "source", "outgoing"):
        m = TokenRank(fuse="attention", chain=chain, direction=direction, alpha=0.9,
                      tol=1e-14, max_iter=5000)
        out = outs[direction] = m(record({0: a}, VIT)).heatmap.reshape(2, 6).numpy()
        for b in range(2):
            x = a[b].numpy().mean(0)
            base = np_patch_chain(x, G) if chain == "grid" else x
            t = _np_outgoing(base, 0.9) if direction == "outgoing" else _np_damped(base, 0.9, direction == "source")
            w, v = np.linalg.eig(t.T)
            pi = np.real(v[:, np.argmin(np.abs(w - 1))])
            pi = pi / pi.sum()
            want = pi if chain == "grid" else pi[1:]
            assert np.allclose(out[b], want, atol=1e-10), (direction, b)
    assert np.abs(outs["outgoing"] - outs["source"]).max() > 1e-4  # two different chains
    with pytest.raises(ValueError, match=r"direction must be one of \('forward', 'source'\).*source was: outgoing"):
        Bounce(direction="outgoing")  # a bounce has no damping to place: source only


def test_chain_knobs_change_the_heatmap_or_are_refused():
    a = stochastic(1, 3, 7, 7, seed=9)
    rec = record({0: a}, VIT)

    def heat(**kw):
        return Bounce(**kw)(rec).heatmap

    base = heat()
    for kw in (dict(chain="joint"), dict(direction="source"), dict(chain="joint", alpha=0.5)):
        assert (heat(**kw) - base).abs().max() > 1e-6, kw
    assert (heat(chain="joint", alpha=0.5) - heat(chain="joint")).abs().max() > 1e-6
    tr = TokenRank()(rec).heatmap
    for kw in (dict(chain="joint", fuse="attention"), dict(direction="source")):
        assert (TokenRank(**kw)(rec).heatmap - tr).abs().max() > 1e-6, kw
    with pytest.raises(ValueError, match="joint chain only"):
        Bounce(alpha=0.9)
    with pytest.raises(ValueError, match="fuse=chain"):
        Bounce(chain="joint", fuse="chain")
    with pytest.raises(ValueError, match="chain must be one of"):
        TokenRank(chain="full")
    with pytest.raises(ValueError, match="was: incoming"):
        TokenRank(direction="incoming")
    with pytest.raises(ValueError, match="source was: outgoing"):
        Bounce(direction="outgoing")
def test_lambda2_weights_shared_by_methods_of_one_record(monkeypatch):
    # the lambda2-weighted methods of one record compute |lambda_2| of its heads once;
    # another attention tensor (even with equal contents) is computed anew
    import segment.methods as methods_mod
    from segment.core import markov

    calls = []
    real = markov.lambda2

    def counting(chain, *a, **kw):
        calls.append(chain.shape)
        return real(chain, *a, **kw)

    monkeypatch.setattr(markov, "lambda2", counting)
    a = stochastic(2, 3, 7, 7, seed=4)
    rec = record({0: a}, VIT)
    ms = [ClsAttention(name="c", layers=[0], heads="lambda2"),
          TokenRank(name="t", layers=[0], heads="lambda2"),
          Bounce(name="b", layers=[0], heads="lambda2", steps=2)]
    outs = [m(rec) for m in ms]
    assert len(calls) == 1  # one |lambda_2| computation for the three methods
    # ClsAttention's attention fusion equals the capture-time fusion (reduce.fuse_layer)
    from segment.core.reduce import fuse_layer

    fused = fuse_layer(a, "lambda2", VIT)[0]
    ref = ClsAttention(name="c", layers=[0], heads="mean")(record({0: fused}, VIT))
    torch.testing.assert_close(outs[0].heatmap, ref.heatmap)
    rec2 = record({0: a.clone()}, VIT)
    again = [m(rec2) for m in ms]
    assert len(calls) == 3  # the fuse_layer call above, then one for the new tensor
    for o, p in zip(outs, again):
        assert torch.equal(o.heatmap, p.heatmap)
    # the memo is keyed on the tensor object: the chain equals a fresh computation
    chain = methods_mod.patch_chain(a, VIT)
    assert chain is methods_mod.patch_chain(a, VIT)
    np.testing.assert_allclose(chain.numpy(), np_patch_chain(a.numpy(), G))


def test_mean_patch_chain_equals_float64_per_head_chains():
    """The one-pass mean of the heads' patch chains (RegionGrow, heads=mean) equals
    renormalising every head's grid block in float64 and averaging, zero rows included."""
    from segment.methods.base import mean_patch_chain

    g = torch.Generator().manual_seed(3)
    layout = TokenLayout(num_tokens=1 + 12 + 2, prefix=1, grid=(3, 4))
    attn = torch.softmax(torch.randn(2, 5, 15, 15, generator=g) * 3, -1)
    attn[0, 2, 4, 1:13] = 0.0  # a row with no grid mass: uniform in that head's chain
    attn[1, :, 7, 1:13] = 0.0  # ... in every head
    attn[1, 3, 2, 1:13] = 1e-41  # a row whose grid mass is denormal: still renormalised
    got = mean_patch_chain(attn, layout)
    a = attn.double()[..., 1:13, 1:13]
    s = a.sum(-1, keepdim=True)
    per_head = torch.where(s > 0, a / s.clamp_min(1e-300), torch.full_like(a, 1 / 12))
    want = per_head.mean(1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got.sum(-1), torch.ones(2, 12), rtol=0, atol=1e-6)
    assert torch.allclose(got[1, 6], torch.full((12,), 1 / 12))
