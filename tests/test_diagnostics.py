"""Attention diagnostics (segment/core/diagnostics.py): hand-built chains with known answers,
and the real DINOv2 heads against an independent float64 computation (scipy)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
import scipy.stats
import torch

from segment.core import diagnostics as dg
from segment.core import markov


def block_chain(sizes: list[int], eps: float) -> torch.Tensor:
    """``(1 - eps) blockdiag(J_k / k) + eps 11^T / N``: k weakly coupled blocks."""
    n = sum(sizes)
    a = torch.zeros(n, n, dtype=torch.float64)
    i = 0
    for s in sizes:
        a[i:i + s, i:i + s] = 1.0 / s
        i += s
    return (1 - eps) * a + eps / n


def with_prefix(chain: torch.Tensor, prefix: int, mass: float) -> torch.Tensor:
    """A ``(prefix + n)`` attention whose rows send ``mass`` uniformly into the prefix and
    ``1 - mass`` along ``chain`` (prefix rows: uniform)."""
    n = chain.shape[-1]
    big = torch.full((prefix + n, prefix + n), 1.0 / (prefix + n), dtype=torch.float64)
    big[prefix:, :prefix] = mass / prefix
    big[prefix:, prefix:] = (1 - mass) * chain
    return big


# ------------------------------------------------------------------------ known answers


def test_uniform_chain():
    n = 50
    a = torch.full((n, n), 1.0 / n, dtype=torch.float64)
    d = dg.diagnose_heads(a, 0)
    assert float(d.entropy) == pytest.approx(math.log(n), abs=1e-12)
    assert float(d.entropy_frac) == pytest.approx(1.0, abs=1e-12)
    assert float(d.kl_uniform) == pytest.approx(0.0, abs=1e-12)
    assert float(d.stable_rank) == pytest.approx(1.0, abs=1e-10)
    assert float(d.lambda2) == pytest.approx(0.0, abs=1e-7)  # rank one: lambda_2 = 0
    assert float(d.metastable) == 1
    torch.testing.assert_close(d.tokenrank, torch.full((n,), 1.0 / n, dtype=torch.float64))
    assert float(d.tokenrank_entropy_frac) == pytest.approx(1.0, abs=1e-12)
    assert float(d.prefix_mass) == 0.0
    assert float(d.sink_mass) == pytest.approx(1.0 / n, abs=1e-12)  # top 1% of 50 = 1 token


def test_permutation_chain():
    n = 40
    perm = torch.roll(torch.arange(n), 1)
    a = torch.eye(n, dtype=torch.float64)[perm]
    d = dg.diagnose_heads(a, 0)
    assert float(d.entropy) == 0.0
    assert float(d.kl_uniform) == pytest.approx(math.log(n), abs=1e-12)
    assert float(d.stable_rank) == pytest.approx(n, abs=1e-8)
    # an n-cycle: every eigenvalue is an n-th root of unity, modulus 1
    assert float(d.lambda2) == pytest.approx(1.0, abs=1e-9)
    assert float(d.metastable) == n
    # doubly stochastic: the damped chain's stationary vector is uniform
    torch.testing.assert_close(d.tokenrank, torch.full((n,), 1.0 / n, dtype=torch.float64))


@pytest.mark.parametrize("k", [2, 3, 5])
def test_k_weakly_coupled_blocks_give_k_moduli_near_one(k):
    eps = 0.02
    a = block_chain([7 + 3 * i for i in range(k)], eps)
    d = dg.diagnose_heads(a, 0)
    mod = d.moduli.numpy()
    # spectrum {1, 1 - eps (k - 1 times), 0, ...}
    np.testing.assert_allclose(mod[:k], [1.0] + [1 - eps] * (k - 1), atol=1e-10)
    assert mod[k] < 1e-6
    assert int(d.metastable) == k
    assert float(d.lambda2) == pytest.approx(1 - eps, abs=1e-10)
    assert float(d.gap) == pytest.approx(eps, abs=1e-10)
    assert 1.0 <= float(d.stable_rank) <= k + 1e-9  # rank k (plus the tiny coupling)


def test_prefix_and_sink_mass():
    n, prefix = 200, 2
    chain = torch.full((n, n), 0.5 / (n - 2), dtype=torch.float64)
    chain[:, :2] = 0.25  # every grid row sends half its mass to the first two grid tokens
    a = with_prefix(chain, prefix, 0.3)
    rows = n + prefix
    want_prefix = (prefix * prefix / rows + n * 0.3) / rows
    assert float(dg.prefix_mass(a, prefix)) == pytest.approx(want_prefix, abs=1e-12)
    # top 1% of 200 grid tokens = the 2 sinks; column mass = rows' mass into them / rows
    want_sink = (prefix * 2 / rows + n * 0.7 * 0.5) / rows
    assert float(dg.sink_mass(a, prefix)) == pytest.approx(want_sink, abs=1e-12)
    # the grid chain is `chain` again, its TokenRank puts the top-1% mass on the sinks
    d = dg.diagnose_heads(a, prefix)
    torch.testing.assert_close(dg.grid_chain(a, prefix), chain)
    assert float(d.tokenrank_top) == pytest.approx(float(d.tokenrank[:2].sum()), abs=1e-15)
    assert float(d.tokenrank_top) > 0.45


def test_exact_tokenrank_is_stationary_and_matches_tight_power_iteration():
    g = torch.Generator().manual_seed(0)
    a = torch.softmax(3 * torch.randn(4, 3, 60, 60, generator=g, dtype=torch.float64), -1)
    pi = dg.exact_tokenrank(a, 0.9)
    t = markov.damp(a, 0.9)
    torch.testing.assert_close(torch.einsum("...n,...nm->...m", pi, t), pi, atol=1e-14, rtol=0)
    ref = markov.tokenrank(a, alpha=0.9, tol=1e-14, max_iter=5000)
    torch.testing.assert_close(pi, ref, atol=1e-12, rtol=0)


def test_batched_shapes_and_ranges():
    g = torch.Generator().manual_seed(1)
    a = torch.softmax(4 * torch.randn(3, 2, 21, 21, generator=g), -1)  # float32, (L, H, N, N)
    d = dg.diagnose_heads(a, 1)
    for name, v in d.measures().items():
        assert v.shape == (3, 2), name
        assert v.dtype == torch.float64, name
    assert d.moduli.shape == (3, 2, 20) and d.tokenrank.shape == (3, 2, 20)
    assert ((d.lambda2 >= 0) & (d.lambda2 <= 1)).all()
    assert ((d.entropy >= 0) & (d.entropy <= math.log(21))).all()
    assert (d.stable_rank >= 1 - 1e-9).all()
    # per-head results equal the batched ones
    one = dg.diagnose_heads(a[2, 1], 1)
    for name, v in one.measures().items():
        assert float(v) == pytest.approx(float(d.measures()[name][2, 1]), abs=1e-12), name


def test_bad_input_raises():
    with pytest.raises(ValueError, match="negative"):
        dg.diagnose_heads(torch.tensor([[1.5, -0.5], [0.5, 0.5]]), 0)
    with pytest.raises(ValueError, match="square"):
        dg.row_entropy(torch.full((3, 4), 0.25))
    with pytest.raises(ValueError, match="alpha < 1"):
        dg.exact_tokenrank(torch.eye(3, dtype=torch.float64), 1.0)
    with pytest.raises(ValueError, match="prefix"):
        dg.prefix_mass(torch.full((3, 3), 1 / 3), 3)
    with pytest.raises(ValueError, match="top"):
        dg.top_mass(torch.ones(4), 0.0)


# ------------------------------------------------------------------------ real heads


def _reference(head: np.ndarray, prefix: int, alpha: float, top: float) -> dict[str, float]:
    """Every measure of one head from scipy, in float64, written independently."""
    big_n = head.shape[0]
    rows = head / head.sum(1, keepdims=True)
    ent = float(scipy.stats.entropy(rows, axis=1).mean())
    kl = float(scipy.stats.entropy(rows, np.full_like(rows, 1.0 / big_n), axis=1).mean())
    sv = scipy.linalg.svdvals(rows)
    grid = rows[prefix:, prefix:]
    grid = grid / grid.sum(1, keepdims=True)
    n = grid.shape[0]
    ev = np.sort(np.abs(scipy.linalg.eigvals(grid)))[::-1]
    t = alpha * grid + (1 - alpha) / n
    w, vl = scipy.linalg.eig(t, left=True, right=False)
    pi = np.real(vl[:, np.argmin(np.abs(w - 1))])
    pi = pi / pi.sum()
    k = math.ceil(top * n)
    recv = rows[:, prefix:].mean(0)
    return {
        "entropy": ent, "entropy_frac": ent / math.log(big_n), "kl_uniform": kl,
        "prefix_mass": float(rows[:, :prefix].sum(1).mean()),
        "sink_mass": float(np.sort(recv)[::-1][:k].sum()),
        "stable_rank": float((sv ** 2).sum() / sv[0] ** 2),
        "lambda2": float(ev[1]), "gap": float(1 - ev[1]), "metastable": float((ev > 0.9).sum()),
        "tokenrank_entropy": float(scipy.stats.entropy(pi)),
        "tokenrank_entropy_frac": float(scipy.stats.entropy(pi) / math.log(n)),
        "tokenrank_top": float(np.sort(pi)[::-1][:k].sum()),
    }


@pytest.mark.shared
@pytest.mark.slow
def test_real_dinov2_heads_match_float64_reference(dinov2_weights):
    """The shared DINOv2 ViT-S/14 on a bundled example at 224 px, all 72 heads measured in one
    batch: on one head per layer (every head index twice) every measure agrees with scipy's
    float64 computation (a per-head reference of all 72 costs 25 s; the batch computes every
    head with the same code), and the exact TokenRank is right where the methods' power
    iteration (tol 1e-6, 200 steps) stops short."""
    from segment.core.record import Capture
    from segment.eval.bench.common import example_image
    from segment.models.vit import TimmViT

    model = TimmViT(name="dinov2_vits14", arch="vit_small_patch14_dinov2.lvd142m",
                    pretrained=False, checkpoint=str(dinov2_weights), image_size=224, device="cpu")
    rec = model.extract(model.collate([example_image()]), Capture(layers=None, heads="keep"))
    attn = torch.stack([rec.attn[i][0] for i in range(model.num_layers)])  # (12, 6, 257, 257)
    assert attn.shape == (12, 6, 257, 257)
    d = dg.diagnose_heads(attn, 1)
    heads = attn.double().numpy()
    worst = {name: 0.0 for name in dg.MEASURES}
    for layer, h in ((layer, layer % 6) for layer in range(12)):
        ref = _reference(heads[layer, h], 1, 0.99, 0.01)
        for name in dg.MEASURES:
            got = float(d.measures()[name][layer, h])
            if name == "metastable":  # a count: moduli within 1e-9 of 0.9 could flip it
                ev = d.moduli[layer, h]
                if bool(((ev - 0.9).abs() < 1e-9).any()):
                    continue
            worst[name] = max(worst[name], abs(got - ref[name]))
    for name, err in worst.items():
        assert err < 1e-10, (name, err)  # measured: <= 2e-12 (stable rank), most ~1e-15
    # in range on every head
    assert ((d.lambda2 >= 0) & (d.lambda2 <= 1)).all()
    assert ((d.entropy >= 0) & (d.entropy <= math.log(257))).all()
    assert (d.stable_rank >= 1).all()
    # the power iteration at its defaults leaves slow heads unconverged, and reports it
    pw = markov.tokenrank(dg.grid_chain(attn, 1), alpha=0.99, return_info=True)
    slow = ~pw.converged
    assert int(slow.sum()) > 0
    err = (pw.pi - d.tokenrank).abs().sum(-1)
    assert float(err[~slow].max()) < 1e-3
