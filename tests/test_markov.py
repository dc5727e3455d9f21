"""Markov-chain core: hand-built chains with known answers, float64 references, properties."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from segment.core import markov
from segment.core.noise import Noise


def clustered_attention(batch: int, n: int, *, clusters: int = 4, sharp: float = 6.0,
                        seed: int = 0, dtype=torch.float64) -> torch.Tensor:
    """Attention-like chains: softmax of scaled similarities of clustered token features."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(batch, clusters, 16, generator=g, dtype=dtype)
    assign = torch.randint(0, clusters, (batch, n), generator=g)
    feats = centers.gather(1, assign[..., None].expand(-1, -1, 16))
    feats = feats + 0.5 * torch.randn(batch, n, 16, generator=g, dtype=dtype)
    feats = torch.nn.functional.normalize(feats, dim=-1)
    return torch.softmax(sharp * feats @ feats.transpose(1, 2), -1)


def stationary_reference(a: np.ndarray, alpha: float, e: np.ndarray | None = None) -> np.ndarray:
    """``pi^T = (1 - alpha) e^T (I - alpha A)^{-1}`` in float64."""
    n = a.shape[0]
    e = np.full(n, 1.0 / n) if e is None else e / e.sum()
    if alpha == 1.0:  # left null vector of (A - I) with the normalisation as extra row
        m = np.vstack([a.T - np.eye(n), np.ones((1, n))])
        rhs = np.zeros(n + 1)
        rhs[-1] = 1
        return np.linalg.lstsq(m, rhs, rcond=None)[0]
    return (1 - alpha) * np.linalg.solve((np.eye(n) - alpha * a).T, e)


def second_modulus_reference(a: np.ndarray) -> float:
    ev = scipy.linalg.eigvals(a.astype(np.float64))
    ev = np.delete(ev, np.argmin(np.abs(ev - 1)))
    return float(np.abs(ev).max())


# --------------------------------------------------------------------------- known chains


def test_two_state_chain_known_answers():
    p, q = 0.3, 0.1
    a = torch.tensor([[1 - p, p], [q, 1 - q]], dtype=torch.float64)
    res = markov.tokenrank(a, alpha=1.0, tol=1e-12, max_iter=2000, return_info=True)
    assert torch.allclose(res.pi, torch.tensor([q, p], dtype=torch.float64) / (p + q), atol=1e-9)
    assert bool(res.converged)
    assert float(markov.lambda2(a)) == pytest.approx(abs(1 - p - q), abs=1e-12)
    assert float(markov.lambda2(a, method="dense")) == pytest.approx(0.6, abs=1e-12)


def metastable_chain(sizes: list[int], eps: float) -> torch.Tensor:
    """``(1 - eps) blockdiag(J_k / k) + eps 11^T / N``: spectrum {1, 1-eps (x blocks-1), 0...}."""
    n = sum(sizes)
    b = torch.zeros(n, n, dtype=torch.float64)
    i = 0
    for k in sizes:
        b[i:i + k, i:i + k] = 1.0 / k
        i += k
    return (1 - eps) * b + eps / n


@pytest.mark.parametrize("method", ["krylov", "auto", "dense"])
def test_block_diagonal_metastable_chain(method):
    a = metastable_chain([40, 25, 60, 35], eps=0.02)  # N = 160, three eigenvalues 0.98
    lam = markov.lambda2(a, method=method, return_info=True)
    assert float(lam.value) == pytest.approx(0.98, abs=1e-8)
    # stationary vector of this chain is uniform
    pi = markov.tokenrank(a, alpha=0.99, tol=1e-12)
    assert torch.allclose(pi, torch.full((160,), 1 / 160, dtype=torch.float64), atol=1e-10)


def test_periodic_chain_needs_damping():
    # 0 -> 1 -> {0, 2} -> 1: period 2, stationary (1/4, 1/2, 1/4), eigenvalues {1, -1, 0}
    a = torch.tensor([[0, 1, 0], [0.5, 0, 0.5], [0, 1, 0]], dtype=torch.float64)
    undamped = markov.tokenrank(a, alpha=1.0, tol=1e-10, max_iter=50, return_info=True)
    assert not bool(undamped.converged)  # oscillates between two vectors forever
    for alpha in (0.85, 0.99):
        res = markov.tokenrank(a, alpha=alpha, tol=1e-13, max_iter=20000, return_info=True)
        assert bool(res.converged)
        ref = stationary_reference(a.numpy(), alpha)
        np.testing.assert_allclose(res.pi.numpy(), ref, atol=1e-10)
    # damping barely moves the stationary distribution (the power iteration would need
    # ~3e5 steps at this alpha: the library's exact solve)
    close = markov.exact_stationary(a, alpha=0.9999)
    np.testing.assert_allclose(close.numpy(), [0.25, 0.5, 0.25], atol=1e-4)
    # |lambda_2| = |-1| = 1; damping bounds it by alpha
    assert float(markov.lambda2(a, method="dense")) == pytest.approx(1.0, abs=1e-12)
    assert float(markov.lambda2(markov.damp(a, 0.9), method="dense")) == pytest.approx(0.9, abs=1e-12)


def test_exact_stationary_batches_on_several_threads():
    """A batch of chains at the size where torch's batched CPU solve fails on two threads
    (MKL's DLASWP error, pytorch/pytorch#142815): every chain's exact stationary
    distribution equals the float64 reference, damped and undamped, and a reducible chain
    in the batch is refused."""
    g = torch.Generator().manual_seed(3)
    a = torch.softmax(4 * torch.randn(2, 3, 151, 151, generator=g, dtype=torch.float64), -1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for alpha in (1.0, 0.85):
            pi = markov.exact_stationary(a, alpha=alpha)
            assert pi.shape == (2, 3, 151) and pi.dtype == torch.float64
            for i in range(2):
                for h in range(3):
                    ref = stationary_reference(a[i, h].numpy(), alpha)
                    np.testing.assert_allclose(pi[i, h].numpy(), ref, rtol=1e-9, atol=1e-14)
        stuck = a.clone()
        stuck[1, 2] = torch.eye(151, dtype=torch.float64)  # every token its own class
        with pytest.raises(ValueError, match="no unique stationary distribution"):
            markov.exact_stationary(stuck)
    finally:
        torch.set_num_threads(threads)


def test_periodic_chain_krylov_path():
    n = 64  # a cycle with self-loops is aperiodic; a bipartite "ping-pong" of two halves is not
    a = torch.zeros(n, n, dtype=torch.float64)
    a[: n // 2, n // 2:] = 2.0 / n
    a[n // 2:, : n // 2] = 2.0 / n
    lam = markov.lambda2(a, method="krylov", return_info=True)
    assert float(lam.value) == pytest.approx(1.0, abs=1e-8)
    assert abs(complex(lam.eigenvalue) - (-1)) < 1e-8


def test_rank_one_chain_has_zero_lambda2():
    row = torch.softmax(torch.randn(200, dtype=torch.float64), 0)
    a = row.expand(200, 200).clone()
    lam = markov.lambda2(a, method="krylov", return_info=True)
    assert float(lam.value) < 1e-8
    assert bool(lam.converged)


# --------------------------------------------------------------------- float64 references


@pytest.mark.parametrize("n", [64, 300])
def test_tokenrank_matches_linear_solve(n):
    a = clustered_attention(3, n, seed=n)
    for alpha in (0.85, 0.99):
        pi = markov.tokenrank(a, alpha=alpha, tol=1e-13, max_iter=5000)
        for b in range(3):
            ref = stationary_reference(a[b].numpy(), alpha)
            np.testing.assert_allclose(pi[b].numpy(), ref, atol=1e-10)


def test_tokenrank_personalization_and_outgoing():
    a = clustered_attention(2, 50, seed=3)
    e = torch.rand(2, 50, dtype=torch.float64)
    pi = markov.tokenrank(a, alpha=0.85, tol=1e-14, max_iter=5000, personalization=e)
    for b in range(2):
        np.testing.assert_allclose(
            pi[b].numpy(), stationary_reference(a[b].numpy(), 0.85, e[b].numpy()), atol=1e-10
        )
    out = markov.tokenrank(a, alpha=0.85, tol=1e-14, max_iter=5000, direction="outgoing")
    rev = (a / a.sum(-2, keepdim=True)).transpose(-1, -2)
    for b in range(2):
        np.testing.assert_allclose(
            out[b].numpy(), stationary_reference(rev[b].numpy(), 0.85), atol=1e-10
        )


def test_tokenrank_stops_per_batch_element():
    slow = metastable_chain([10, 10], eps=0.001)  # mixes slowly
    fast = torch.full((20, 20), 1 / 20, dtype=torch.float64)  # uniform: converged at once
    e = torch.zeros(20, dtype=torch.float64)
    e[0] = 1  # teleport to one token: the slow chain must walk its way to equilibrium
    res = markov.tokenrank(torch.stack([slow, fast]), alpha=0.999, tol=1e-12, max_iter=100000,
                           personalization=e, return_info=True)
    assert res.iterations[1] < res.iterations[0]
    assert bool(res.converged.all())
    assert (res.residual < 1e-12).all()


def test_bounce_matches_matrix_powers():
    a = clustered_attention(2, 40, seed=1)
    res = markov.bounce(a, 5, steps=4)
    assert res.steps.shape == (2, 4, 40)
    for k in range(1, 5):
        ref = torch.linalg.matrix_power(a, k)[:, 5]
        torch.testing.assert_close(res.steps[:, k - 1], ref, rtol=0, atol=1e-12)
    # steps=1 is row selection
    torch.testing.assert_close(markov.bounce(a, 7, 1).steps[:, 0], a[:, 7])
    # batched starts: indices and distributions
    idx = markov.bounce(a, torch.tensor([1, 2, 3]), steps=2)
    assert idx.steps.shape == (2, 3, 2, 40)
    v0 = torch.rand(2, 3, 40, dtype=torch.float64)
    dist = markov.bounce(a, v0, steps=3)
    torch.testing.assert_close(dist.last, v0 @ torch.linalg.matrix_power(a, 3))
    # the source direction walks the column-normalised transpose
    src = markov.bounce(a, 0, 2, direction="source").last
    rev = (a / a.sum(-2, keepdim=True)).transpose(-1, -2)
    torch.testing.assert_close(src, (rev @ rev)[:, 0])


def test_lambda2_against_dense_float64_on_structured_chains():
    a = clustered_attention(6, 400, clusters=5, sharp=8.0, seed=7)
    fast = markov.lambda2(a.float(), method="auto", return_info=True)
    for b in range(6):
        ref = second_modulus_reference(a[b].numpy())
        assert abs(float(fast.value[b]) - ref) < 1e-4, (b, float(fast.value[b]), ref)
    assert not bool(fast.dense.any())  # the fast path sufficed


@pytest.mark.parametrize("case", ["random", "in_span", "zero", "mixed"])
def test_orth_rows_one_row_is_unit_sum_zero_and_orthogonal_to_the_basis(case):
    """The one-row Gram-Schmidt (two projections, one check; the general loop when a row
    lost more than half its norm or is zero): unit rows, sum zero, orthogonal to the basis."""
    g = torch.Generator().manual_seed(1)
    m, d, n = 3, 6, 50
    q = torch.linalg.qr(torch.randn(m, n, d + 1, generator=g, dtype=torch.float64)).Q
    q = q - q.mean(1, keepdim=True)  # sum-zero columns, then orthonormal again
    basis = torch.linalg.qr(q).Q.transpose(1, 2)[:, :d].contiguous()
    z = torch.randn(m, 1, n, generator=g, dtype=torch.float64)
    if case == "in_span":  # all in the span: only rounding noise is left after projecting
        z = basis[:, 2:3] + 0.5 * basis[:, 4:5]
    elif case == "zero":
        z = torch.zeros(m, 1, n, dtype=torch.float64)
    elif case == "mixed":  # one row in the span, the others random
        z[1] = basis[1, :1] * 3 + 1e-14
    out = markov._orth_rows(z, basis, Noise(1))
    assert out.shape == (m, 1, n) and bool(torch.isfinite(out).all())
    torch.testing.assert_close(out.norm(dim=-1), torch.ones(m, 1, dtype=torch.float64))
    assert float(out.sum(-1).abs().max()) < 1e-12
    assert float(torch.bmm(out, basis.transpose(1, 2)).abs().max()) < 1e-10
    if case == "random":  # the projection of z, normalised
        p = z - z.mean(-1, keepdim=True)
        p = p - torch.bmm(torch.bmm(p, basis.transpose(1, 2)), basis)
        torch.testing.assert_close(out, p / p.norm(dim=-1, keepdim=True))


def test_lambda2_degenerate_uniform_random_falls_back():
    g = torch.Generator().manual_seed(0)
    a = torch.rand(2, 300, 300, generator=g, dtype=torch.float64)
    a = a / a.sum(-1, keepdim=True)  # no spectral gap: bulk on a circle ~ 1/sqrt(N)
    kry = markov.lambda2(a, method="krylov", max_cycles=2, return_info=True)
    auto = markov.lambda2(a, method="auto", max_cycles=2, return_info=True)
    for b in range(2):
        ref = second_modulus_reference(a[b].numpy())
        assert abs(float(auto.value[b]) - ref) < 1e-10
        if abs(float(kry.value[b]) - ref) > 1e-4:  # the fast path is honest when it is off
            assert not bool(kry.converged[b])
    assert bool(auto.dense[~kry.converged].all())


def _planted_ritz(kinds: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Ritz values sorted by decreasing modulus (``r``: real, ``p``: a conjugate pair) with
    random coefficient vectors; a pair's two vectors are conjugates, as eig returns them."""
    g = torch.Generator().manual_seed(seed)
    vals, d = [], sum(1 if c == "r" else 2 for c in kinds)
    for i, c in enumerate(kinds):
        mod = 0.99 - 0.05 * i
        if c == "r":
            vals.append(complex(mod, 0.0))
        else:
            vals += [complex(0.6 * mod, 0.8 * mod), complex(0.6 * mod, -0.8 * mod)]
    re = torch.randn(d, d, generator=g, dtype=torch.float64)
    im = torch.randn(d, d, generator=g, dtype=torch.float64)
    vecs, j = torch.zeros(d, d, dtype=torch.complex128), 0
    for c in kinds:
        if c == "r":
            vecs[:, j] = torch.complex(re[:, j], torch.zeros(d, dtype=torch.float64))
            j += 1
        else:
            vecs[:, j] = torch.complex(re[:, j], im[:, j])
            vecs[:, j + 1] = vecs[:, j].conj()
            j += 2
    return torch.tensor(vals, dtype=torch.complex128)[None], vecs[None]


@pytest.mark.parametrize("kinds, k, kept", [
    ("rprpr", 6, [0, 1, 2, 3, 4, 5]),  # whole groups fill k exactly
    ("rrprpr", 4, [0, 1, 2, 3]),  # ... also after two real values
    ("rprr", 2, [0, 3]),  # the pair straddles the cut: the next real value takes the slot
    ("rpprr", 4, [0, 1, 2, 5]),  # ... also behind another pair
    # no real value behind it (only possible for an odd basis size): the last real value
    # taken makes room for the pair
    ("rrrpp", 4, [0, 1, 3, 4]),
])
def test_restart_coefficients_keep_whole_conjugate_pairs(kinds, k, kept):
    theta, vecs = _planted_ritz(kinds)
    q = markov._restart_coefficients(theta, vecs, k)[0]  # (d, k)
    torch.testing.assert_close(q.T @ q, torch.eye(k, dtype=torch.float64))
    want = torch.cat([vecs[0][:, kept].real, vecs[0][:, kept].imag], 1)  # the real span
    assert torch.linalg.matrix_rank(want).item() == k
    torch.testing.assert_close(q @ (q.T @ want), want)  # span(q) is exactly that span


def _rotating_chain(n: int, period: int, eps: float, seed: int) -> torch.Tensor:
    """A noisy directed ring of ``period`` blocks: the leading non-unit eigenvalues are
    complex pairs near the ``period``-th roots of unity, with a non-normal bulk."""
    g = torch.Generator().manual_seed(seed)
    block = torch.arange(n) * period // n
    ring = (block[None, :] == (block[:, None] + 1) % period).double()
    ring = ring / ring.sum(-1, keepdim=True)
    noise = torch.softmax(3 * torch.randn(n, n, generator=g, dtype=torch.float64), -1)
    return (1 - eps) * ring + eps * noise


@pytest.mark.parametrize("keep", [2, 6, 10, 16])
def test_lambda2_thick_restart_on_complex_leading_spectra(keep):
    chains = torch.stack([_rotating_chain(300, p, e, s) for s, (p, e) in
                          enumerate([(3, 0.3), (5, 0.4), (7, 0.5), (4, 0.6)])])
    res = markov.lambda2(chains, method="krylov", keep=keep, return_info=True)
    assert bool(res.converged.all())
    for b in range(chains.shape[0]):
        ref = second_modulus_reference(chains[b].numpy())
        assert abs(float(res.value[b]) - ref) < 1e-6, (keep, b, float(res.value[b]), ref)
        assert abs(complex(res.eigenvalue[b]).imag) > 0.05  # a pair led: the case under test


def test_lambda2_rejects_bad_krylov_settings():
    a = clustered_attention(1, 200)
    for kw, msg in [(dict(keep=5), "keep must be even"), (dict(keep=40, passes=20), "keep must be"),
                    (dict(passes=2), "passes >= 3"), (dict(block=0), "block >= 1")]:
        with pytest.raises(ValueError, match=msg):
            markov.lambda2(a, **kw)
    with pytest.raises(ValueError, match="method='dense'"):
        markov.lambda2(clustered_attention(1, 3), method="krylov")  # 2 sum-zero directions


def test_head_weights_and_fusion():
    lam = torch.tensor([[0.2, 0.6, 0.2], [0.0, 0.0, 0.0]])
    w = markov.head_weights(lam, "lambda2")
    torch.testing.assert_close(w[0], torch.tensor([0.2, 0.6, 0.2]))
    torch.testing.assert_close(w[1], torch.full((3,), 1 / 3))  # all zero -> uniform
    torch.testing.assert_close(markov.head_weights(lam, "uniform"), torch.full((2, 3), 1 / 3))
    sm = markov.head_weights(lam, "softmax", temperature=0.1)
    torch.testing.assert_close(sm.sum(-1), torch.ones(2))
    assert sm[0, 1] > w[0, 1]  # sharper than proportional
    top = markov.head_weights(lam[:1], "top_k", k=1)
    torch.testing.assert_close(top, torch.tensor([[0.0, 1.0, 0.0]]))
    heads = clustered_attention(3, 20, seed=2).unsqueeze(0)  # (1, H=3, N, N)
    fused = markov.fuse_heads(heads, w[:1])
    ref = 0.2 * heads[0, 0] + 0.6 * heads[0, 1] + 0.2 * heads[0, 2]
    torch.testing.assert_close(fused[0], ref)
    markov.validate_stochastic(fused)


def test_damp_and_strip_prefix():
    a = clustered_attention(2, 30, seed=4)
    t = markov.damp(a, 0.9)
    torch.testing.assert_close(t, 0.9 * a + 0.1 / 30)
    e = torch.zeros(30, dtype=torch.float64)
    e[:3] = 1
    tp = markov.damp(a, 0.5, personalization=e)
    torch.testing.assert_close(tp[..., :3], 0.5 * a[..., :3] + 0.5 / 3)
    s = markov.strip_prefix(a, 5)
    assert s.shape == (2, 25, 25)
    torch.testing.assert_close(s, a[:, 5:, 5:] / a[:, 5:, 5:].sum(-1, keepdim=True))
    z = torch.zeros(4, 4)
    z[:, 0] = 1  # every row attends only to the prefix token
    with pytest.raises(ValueError, match="no mass left"):
        markov.strip_prefix(z, 1)
    torch.testing.assert_close(markov.strip_prefix(z, 1, zero_rows="uniform"), torch.full((3, 3), 1 / 3))


def test_low_precision_inputs_compute_in_fp32():
    a = clustered_attention(2, 64, seed=5)
    ref = markov.tokenrank(a, tol=1e-10)
    for dt in (torch.float16, torch.bfloat16):
        x = a.to(dt)
        x = x / x.float().sum(-1, keepdim=True).to(dt)  # renormalised in low precision
        pi = markov.tokenrank(x, tol=1e-7)
        assert pi.dtype == torch.float32
        torch.testing.assert_close(pi.double(), ref, atol=2e-3, rtol=0.05)
        assert markov.bounce(x, 0, 2).steps.dtype == torch.float32
        lam = markov.lambda2(x)
        assert torch.isfinite(lam).all()


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "bad, match",
    [
        (torch.full((3, 3), float("nan")), "NaN/inf"),
        (torch.tensor([[0.5, float("inf")], [0.5, 0.5]]), "NaN/inf"),
        (torch.tensor([[1.5, -0.5], [0.5, 0.5]]), "negative"),
        (torch.tensor([[0.0, 0.0], [0.5, 0.5]]), "sum to 0"),
        (torch.tensor([[0.7, 0.7], [0.5, 0.5]]), "sum to 1"),
        (torch.full((3, 4), 0.25), "square"),
        (torch.tensor([1.0]), r"\(\.\.\., N, N\)"),
        (torch.ones(2, 2, dtype=torch.long), "floating-point"),
    ],
)
def test_bad_input_raises_clear_errors(bad, match):
    for fn in (markov.tokenrank, markov.lambda2, lambda x: markov.bounce(x, 0, 2), markov.validate_stochastic):
        with pytest.raises(ValueError, match=match):
            fn(bad)


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5, float("nan"), "x"])
def test_alpha_outside_unit_interval(alpha):
    a = clustered_attention(1, 5)
    with pytest.raises(ValueError, match="alpha"):
        markov.tokenrank(a, alpha=alpha)
    with pytest.raises(ValueError, match="alpha"):
        markov.damp(a, alpha)


def test_other_argument_errors():
    a = clustered_attention(1, 5)
    with pytest.raises(ValueError, match="steps"):
        markov.bounce(a, 0, 0)
    with pytest.raises(ValueError, match="start indices"):
        markov.bounce(a, 9, 1)
    with pytest.raises(ValueError, match="personalization"):
        markov.tokenrank(a, personalization=-torch.ones(5))
    with pytest.raises(ValueError, match="scheme"):
        markov.head_weights(torch.rand(3), "nope")
    with pytest.raises(ValueError, match="direction"):
        markov.tokenrank(a, direction="sideways")


# ----------------------------------------------------------------------------- properties


@settings(max_examples=25, deadline=None)
@given(
    batch=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    n=st.integers(2, 40),
    alpha=st.floats(0.5, 0.999),
    seed=st.integers(0, 10_000),
)
def test_properties_random_shapes(batch, n, alpha, seed):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(*batch, n, n, generator=g, dtype=torch.float64)
    a = torch.softmax(logits, -1)
    res = markov.tokenrank(a, alpha=alpha, tol=1e-12, max_iter=3000, return_info=True)
    assert res.pi.shape == (*batch, n)
    assert res.iterations.shape == tuple(batch)
    assert (res.pi >= 0).all()
    torch.testing.assert_close(res.pi.sum(-1), torch.ones(batch, dtype=torch.float64))
    # stationarity of the damped chain
    t = markov.damp(a, alpha)
    torch.testing.assert_close((res.pi.unsqueeze(-2) @ t).squeeze(-2), res.pi, atol=1e-9, rtol=0)
    lam = markov.lambda2(a)
    assert lam.shape == tuple(batch)
    assert ((lam >= 0) & (lam <= 1 + 1e-9)).all()
    flat = a.reshape(-1, n, n)
    for i in range(min(flat.shape[0], 2)):
        assert abs(float(lam.reshape(-1)[i]) - second_modulus_reference(flat[i].numpy())) < 1e-6
    steps = markov.bounce(a, 0, 3).steps
    assert steps.shape == (*batch, 3, n)
    torch.testing.assert_close(steps.sum(-1), torch.ones(*batch, 3, dtype=torch.float64))


@pytest.mark.shared
@pytest.mark.slow
def test_lambda2_on_real_dinov2_heads_at_448(dinov2_weights):
    """Real patch chains (N = 1024) of the shared DINOv2 ViT-S/14 on a bundled example:
    the fast path agrees with dense float64 to 1e-4, early grid-like layers included."""
    from segment.eval.bench.common import example_image as _example_image
    from segment.models.vit import TimmViT

    from segment.core.record import Capture

    model = TimmViT(name="dinov2_vits14", arch="vit_small_patch14_dinov2.lvd142m", pretrained=False,
                    checkpoint=str(dinov2_weights), image_size=448, device="cpu")
    rec = model.extract(model.collate([_example_image()]), Capture(layers=(0, 1, 6, 11), heads="keep"))
    heads = torch.cat([rec.attn[i][0, :3] for i in (0, 1, 6, 11)])  # 12 heads, (12, 1025, 1025)
    # six of them span the spectrum (|lambda_2| 0.38 to 0.9999; a dense float64 eig of
    # N = 1024 takes ~1.2 s per head on one core)
    heads = heads[[0, 1, 3, 7, 9, 11]]
    chains = markov.strip_prefix(heads, 1, zero_rows="uniform")
    fast = markov.lambda2(chains, return_info=True)
    ref = markov.lambda2_dense(chains)
    assert (fast.value - ref).abs().max() < 1e-4
    assert float(ref.min()) < 0.9 and float(ref.max()) > 0.95  # a spread of spectra was tested


# --------------------------------------------------------------------------------------
# the damped walk and the source direction of the damped chain (joint chain of bounce and
# tokenrank): dense float64 matrices built by hand
# --------------------------------------------------------------------------------------


def _damped_dense(a: torch.Tensor, alpha: float, source: bool) -> torch.Tensor:
    n = a.shape[-1]
    t = alpha * a + (1 - alpha) / n  # every row of T gets (1 - alpha) / N
    if source:  # rows of the column-normalised transpose
        t = (t / t.sum(-2, keepdim=True)).transpose(-1, -2)
    return t


@pytest.mark.parametrize("source", [False, True])
@pytest.mark.parametrize("alpha", [1.0, 0.9])
def test_damped_bounce_matches_dense_matrix_powers(alpha, source):
    a = clustered_attention(2, 30, seed=4)
    direction = "source" if source else "forward"
    t = _damped_dense(a, alpha, source)
    res = markov.bounce(a, 3, steps=3, direction=direction, alpha=alpha)
    for k in range(1, 4):
        want = torch.linalg.matrix_power(t, k)[:, 3]
        torch.testing.assert_close(res.steps[:, k - 1], want, rtol=0, atol=1e-12)
    v0 = torch.rand(2, 2, 30, dtype=torch.float64)
    got = markov.bounce(a, v0, steps=2, direction=direction, alpha=alpha).last
    torch.testing.assert_close(got, v0 @ t @ t, rtol=0, atol=1e-12)
    # linear in the start mass, and damping really changes the walk
    torch.testing.assert_close(markov.bounce(a, 3 * v0, 2, direction=direction, alpha=alpha).last,
                               3 * got, rtol=0, atol=1e-12)
    if alpha < 1:
        plain = markov.bounce(a, v0, steps=2, direction=direction).last
        assert (plain - got).abs().max() > 1e-4


def test_tokenrank_source_is_the_reverse_of_the_damped_chain():
    a = clustered_attention(2, 40, seed=5)
    pi = markov.tokenrank(a, alpha=0.9, tol=1e-14, max_iter=5000, direction="source")
    s = _damped_dense(a, 0.9, True)
    for b in range(2):
        np.testing.assert_allclose(pi[b].numpy(), stationary_reference(s[b].numpy(), 1.0), atol=1e-10)
    # not the damped reverse chain ("outgoing")
    out = markov.tokenrank(a, alpha=0.9, tol=1e-14, max_iter=5000, direction="outgoing")
    assert (out - pi).abs().max() > 1e-4
    e = torch.rand(2, 40, dtype=torch.float64)
    pers = markov.tokenrank(a, alpha=0.8, tol=1e-14, max_iter=5000, personalization=e,
                            direction="source")
    t = 0.8 * a + 0.2 * (e / e.sum(-1, keepdim=True)).unsqueeze(-2)
    s = (t / t.sum(-2, keepdim=True)).transpose(-1, -2)
    for b in range(2):
        np.testing.assert_allclose(pers[b].numpy(), stationary_reference(s[b].numpy(), 1.0), atol=1e-10)


def test_source_direction_refuses_tokens_nobody_attends_to():
    a = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    with pytest.raises(ValueError, match="columns sum to 0"):
        markov.bounce(a, 0, 2, direction="source")
    ok = markov.bounce(a, 0, 2, direction="source", alpha=0.9).last  # damping fixes it
    assert torch.isfinite(ok).all() and abs(float(ok.sum()) - 1) < 1e-12


def test_noise_depends_on_coordinates_not_on_the_batch():
    # a draw is the same for every batch row and its leading columns do not depend on the
    # number asked for; successive draws differ; the values are standard normal
    z = Noise(7).normal((3, 4, 500), dtype=torch.float64, device="cpu")
    assert torch.equal(z[0], z[2])
    assert torch.equal(Noise(7).normal((4, 200), dtype=torch.float64, device="cpu"), z[0, :, :200])
    n = Noise(7)
    first, second = (n.normal((4, 500), dtype=torch.float64, device="cpu") for _ in range(2))
    assert not torch.equal(first, second)
    big = Noise(3).normal((64, 4096), dtype=torch.float64, device="cpu").flatten()
    assert abs(float(big.mean())) < 0.02 and abs(float(big.std()) - 1) < 0.02
    assert abs(float((big[1:] * big[:-1]).mean())) < 0.02  # neighbours uncorrelated


def test_lambda2_of_a_chain_does_not_depend_on_its_batch():
    g = torch.Generator().manual_seed(2)
    a = torch.softmax(torch.randn(5, 120, 120, generator=g, dtype=torch.float64) * 3, -1)
    alone = markov.lambda2(a[3:4], method="krylov")
    batched = markov.lambda2(a, method="krylov")
    assert torch.equal(alone[0], batched[3])
