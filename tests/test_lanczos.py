"""The cuts' Krylov eigensolver (segment.core.lanczos, backend "krylov"): its vector against
float64 eigh, and the cuts it gives against the dense solver's on planted block chains."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from segment import backends
from segment.core import cuts, lanczos
from tests.test_cuts import padded_batch, planted_affinity, same_partition


def normalized(w: torch.Tensor) -> torch.Tensor:
    s = w.sum(-1).rsqrt()
    return s[..., :, None] * w * s[..., None, :]


def angle_to(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``(R,)`` sin of the angle between each row of ``got`` and of ``ref`` (float64)."""
    g, r = got.double(), ref.double()
    cos = (g * r).sum(-1).abs() / (g.norm(dim=-1) * r.norm(dim=-1))
    return (1 - cos.clamp(max=1) ** 2).clamp_min(0).sqrt()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_vector_meets_its_residual_and_the_float64_eigenvector(dtype):
    # a planted chain with a clear gap: the angle to the exact vector is at most
    # residual / gap (Davis-Kahan), and the residual is the one reported
    w = torch.cat([planted_affinity(3, 70, 0.05, noise=0.3, seed=s) for s in range(3)])
    sym = normalized(w)
    ev, vecs = torch.linalg.eigh(sym)
    ref = vecs[..., -2]
    tol = 1e-3 if dtype == torch.float32 else 1e-8
    got, info = lanczos.second_eigenvectors(sym.to(dtype), tol=tol, return_info=True)
    assert got.dtype == dtype and got.shape == (3, 210)
    assert bool(info.converged.all())
    assert torch.allclose(got.double().norm(dim=-1), torch.ones(3, dtype=torch.float64), atol=1e-5)
    res = (sym @ got.double()[..., None])[..., 0] - info.value[:, None] * got.double()
    assert bool((res.norm(dim=-1) <= tol * 1.01 + 1e-5).all())
    assert torch.allclose(info.value, ev[..., -2], atol=tol)
    gap = (ev[..., -2] - ev[..., -3]).min()
    assert bool((angle_to(got, ref) <= tol / gap + 1e-4).all())
    assert int(info.matvecs.max()) < 210  # fewer products than a dense decomposition's size


def test_planted_blocks_krylov_vector_gives_the_dense_cut():
    # block chains of different sizes, padded together as recursive_ncut batches them
    ws = [planted_affinity(2, 90, 0.05, noise=0.5, seed=1)[0],
          planted_affinity(3, 50, 0.1, noise=0.5, seed=2)[0],
          planted_affinity(4, 40, 0.02, noise=0.5, seed=3)[0]]
    pad, size = padded_batch(ws)
    nd, sd = cuts.best_cuts(pad, size)
    nk, sk = cuts.best_cuts(pad, size, eigvec=lanczos.second_eigenvectors)
    for r in range(len(ws)):
        assert torch.equal(sd[r], sk[r]) or torch.equal(sd[r, : size[r]], ~sk[r, : size[r]])
    assert torch.allclose(nd, nk, rtol=0, atol=1e-12)  # the same cut: the same exact NCut


def test_recursive_ncut_with_the_krylov_backend_finds_the_planted_blocks():
    w = torch.cat([planted_affinity(4, 60, 0.05, noise=0.3, seed=4),
                   planted_affinity(3, 80, 0.08, noise=0.3, seed=5)])
    eig = {b: partial(backends.second_eigenvectors, backend=b) for b in ("scipy", "krylov")}
    parts = {b: cuts.recursive_ncut(w, 0.3, eigvec=f) for b, f in eig.items()}
    forced = cuts.recursive_ncut(w, 0.3, eigvec=lanczos.second_eigenvectors)
    assert parts["krylov"].counts.tolist() == [4, 3]
    assert same_partition(parts["krylov"].labels[0], torch.arange(240) // 60)
    assert torch.equal(parts["krylov"].labels, parts["scipy"].labels)
    assert torch.equal(forced.labels, parts["scipy"].labels)


def test_krylov_backend_keeps_the_dense_solver_for_small_matrices():
    up = backends.KRYLOV_DENSE_UP_TO
    small = normalized(planted_affinity(2, up // 2, 0.1, noise=0.5, seed=6)).float()
    assert torch.equal(backends.second_eigenvectors(small, "krylov"),
                       backends.second_eigenvectors(small, "scipy"))
    big = normalized(planted_affinity(2, up // 2 + 1, 0.1, noise=0.5, seed=6)).float()
    assert torch.equal(backends.second_eigenvectors(big, "krylov"),
                       lanczos.second_eigenvectors(big))


def test_warm_start_and_cold_start_give_the_same_cut():
    # the parent's vector restricted to one half as the start of the half's own solve
    w = planted_affinity(4, 50, 0.03, noise=0.5, seed=8)[0]
    n = w.shape[0]
    sym = normalized(w)[None].float()
    u = lanczos.second_eigenvectors(sym)
    _, side = cuts.best_cuts(w[None], torch.tensor([n]), eigvec=lambda s, size=None: u)
    idx = side[0].nonzero()[:, 0]
    assert len(idx) == 100  # two of the four blocks
    sub = w[idx][:, idx][None]
    d = w.sum(-1)
    start = (u[0].double() / d.sqrt())[idx] * sub[0].sum(-1).sqrt()  # the chain's vector, restricted
    cold, ic = lanczos.second_eigenvectors(normalized(sub).float(), return_info=True)
    warm, iw = lanczos.second_eigenvectors(normalized(sub).float(), start=start[None],
                                           return_info=True)
    assert bool(ic.converged.all()) and bool(iw.converged.all())
    a = cuts.best_cuts(sub, torch.tensor([100]), eigvec=lambda s, size=None: cold)
    b = cuts.best_cuts(sub, torch.tensor([100]), eigvec=lambda s, size=None: warm)
    assert abs(float(a[0]) - float(b[0])) <= 1e-12  # the same cut, summed in either side's order
    assert torch.equal(a[1], b[1]) or torch.equal(a[1], ~b[1])
    assert same_partition(a[1][0].long(), torch.arange(100) // 50)


def test_an_invariant_krylov_space_is_extended_and_tiny_matrices_are_exact():
    # three uniform blocks of equal size, weakly coupled (blocks 0 and 1 more strongly):
    # the Krylov space of a block-constant start (the block-constant vectors) is invariant
    # after three steps; the basis must still grow (fresh directions), without NaN
    n = 150
    block = torch.arange(n) // 50
    w = (block[:, None] == block[None, :]).double() + 1e-3
    w[:100, :100] += 1e-2  # lambda_2 separates block 2, lambda_3 blocks 0 and 1
    sym = normalized(w)[None]
    start = torch.ones(1, n, dtype=torch.float64)
    for st in (None, start):
        got = lanczos.second_eigenvectors(sym, tol=1e-8, start=st)
        assert bool(torch.isfinite(got).all())
        ref = torch.linalg.eigh(sym)[1][..., -2]
        assert float(angle_to(got, ref)[0]) < 1e-5
    for m in (2, 3, 5):  # the basis spans the whole space: exact in one cycle
        a = torch.rand(1, m, m, dtype=torch.float64, generator=torch.Generator().manual_seed(m))
        s = a + a.transpose(1, 2)
        got = lanczos.second_eigenvectors(s)
        assert float(angle_to(got, torch.linalg.eigh(s)[1][..., -2])[0]) < 1e-7


def test_bad_arguments_are_refused():
    sym = torch.eye(4)[None]
    with pytest.raises(ValueError, match=r"\(R, m, m\)"):
        lanczos.second_eigenvectors(sym[0])
    with pytest.raises(ValueError, match="tol must be > 0"):
        lanczos.second_eigenvectors(sym, tol=0)
    with pytest.raises(ValueError, match="keep < steps"):
        lanczos.second_eigenvectors(sym, keep=16, steps=16)
    with pytest.raises(ValueError, match=r"start must be \(R, m\)"):
        lanczos.second_eigenvectors(sym, start=torch.ones(4))


def test_a_near_tie_is_reported_not_hidden():
    # three blocks left alike: lambda_2 = lambda_3 up to the jitter, so the second and the
    # third eigenvector isolate different blocks with nearly equal NCuts; the check names it
    from segment.eval.bench.cutcheck import first_differences

    w = planted_affinity(3, 20, 0.05, noise=1e-3, seed=9)[0]
    second = partial(backends.second_eigenvectors, backend="torch")

    def third(sym, size=None):
        return torch.linalg.eigh(sym)[1][..., -3]

    assert first_differences(w, 0.3, second, second) == []
    diffs = first_differences(w, 0.3, second, third, tie=0.01)
    assert len(diffs) == 1
    d = diffs[0]
    assert (d.size, d.kind, d.near_tie) == (60, "cut", True)
    assert abs(d.ncut_a - d.ncut_b) <= 0.01 and d.ncut_a != d.ncut_b
    assert first_differences(w, 0.3, second, third, tie=abs(d.ncut_a - d.ncut_b) / 2)[0].near_tie \
        is False

    def scrambled(sym, size=None):  # a vector that orders the tokens at random: a real failure
        g = torch.Generator().manual_seed(0)
        return torch.randn(sym.shape[:2], generator=g, dtype=sym.dtype)

    bad = first_differences(w, 0.3, second, scrambled)
    assert len(bad) == 1 and bad[0].kind == "escape" and not bad[0].near_tie
    assert bad[0].ncut_a < 0.3 <= bad[0].ncut_b


def random_chain(b: int, n: int, seed: int, sharp: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(b, n, n, generator=g, dtype=torch.float64) ** sharp
    return a / a.sum(-1, keepdim=True)


def test_stationary_by_power_iteration_meets_the_exact_solve():
    from segment.core import markov

    p = random_chain(3, 300, 1, sharp=8.0)  # above the dense size: the iteration runs
    ex = markov.exact_stationary(p)
    got = markov.stationary(p, tol=1e-12)
    assert got.shape == (3, 300) and got.dtype == torch.float64
    assert torch.allclose(got, ex, rtol=1e-9, atol=0)
    res = (markov.row_times(got, p) - got).abs().sum(-1)
    assert bool((res <= 1e-12).all())
    # float32 chains: the iteration to 1e-6, within the rounding of the chain itself
    got32 = markov.stationary(p.float())
    assert float(((got32 - ex).abs() / ex).max()) < 1e-4
    small = random_chain(2, 50, 2)
    assert torch.equal(markov.stationary(small), markov.exact_stationary(small))
    # batch dimensions are kept
    assert markov.stationary(p.reshape(3, 1, 300, 300), tol=1e-12).shape == (3, 1, 300)


def test_stationary_falls_back_to_the_dense_solve_when_the_iteration_does_not_converge():
    from segment.core import markov

    # two blocks joined by rare transitions: |lambda_2| close to 1, slow power iteration
    n = 300
    block = torch.arange(n) // 150
    p = (block[:, None] == block[None, :]).double() + 1e-6
    p[:150] *= torch.linspace(1, 2, n, dtype=torch.float64)  # not doubly stochastic
    p = p / p.sum(-1, keepdim=True)
    ex = markov.exact_stationary(p[None])
    got = markov.stationary(p[None], tol=1e-12, max_iter=5)
    assert torch.allclose(got, ex, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="max_iter must be >= 1"):
        markov.stationary(p[None], max_iter=0)


def test_row_times_is_each_row_vector_times_its_matrix():
    from segment.core import markov

    g = torch.Generator().manual_seed(3)
    m = torch.rand(3, 5, 7, generator=g, dtype=torch.float64)
    v = torch.rand(3, 5, generator=g, dtype=torch.float64)
    assert torch.allclose(markov.row_times(v, m), torch.einsum("bi,bij->bj", v, m))


def test_a_level_that_does_not_fit_is_chunked_and_one_image_that_does_not_is_refused():
    w = torch.cat([planted_affinity(3, 40, 0.05, noise=0.3, seed=s) for s in range(3)])
    n = w.shape[-1]
    assert cuts.cut_peak_bytes(n, 3) == 3 * cuts.cut_peak_bytes(n) == 3 * cuts.CUT_BYTES_PER_ENTRY * n * n
    batches = []

    def eig(sym, size=None):
        batches.append(sym.shape[0])
        return backends.second_eigenvectors(sym, "scipy", size=size)

    whole = cuts.recursive_ncut(w, 0.3, eigvec=eig)
    assert batches[0] == 3  # the first level: the three images in one batch
    batches.clear()
    chunked = cuts.recursive_ncut(w, 0.3, eigvec=eig, memory_limit=cuts.cut_peak_bytes(n) + 1)
    assert batches[:3] == [1, 1, 1]  # one image at a time
    assert torch.equal(chunked.labels, whole.labels) and chunked.counts.tolist() == [3, 3, 3]
    with pytest.raises(MemoryError, match=r"one region of 120 tokens needs .* GiB to cut"
                       r" .*batch_size=1 does not fit"):
        cuts.recursive_ncut(w, 0.3, eigvec=eig, memory_limit=cuts.cut_peak_bytes(n) - 1)


def test_memory_budget_is_a_positive_byte_count_below_the_machine_total():
    import os

    got = backends.memory_budget("cpu")
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < got <= total


def test_bench_growth_exponent_is_the_log_log_slope():
    from segment.eval.bench.regions import growth

    assert growth([(256, 3 * 256.0 ** 2), (1024, 3 * 1024.0 ** 2), (4096, 3 * 4096.0 ** 2)]) \
        == pytest.approx(2.0)
    assert growth([(256, 0.02), (1024, 0.02 * 4 ** 1.5)]) == pytest.approx(1.5)


def test_a_matrix_gets_its_vector_whatever_batch_it_shares():
    # the same chain alone, or third in a batch padded 40 rows further: the Krylov start
    # and fresh directions depend on the coordinates only and never touch the padding, so
    # the vectors agree to rounding (the old batch-wide random start differed by ~tol)
    w = planted_affinity(2, 90, 0.05, noise=0.3, seed=3)[0]  # two blocks: a clear gap
    others = [planted_affinity(2, 110, 0.05, noise=0.3, seed=s)[0] for s in (4, 5)]
    alone = lanczos.second_eigenvectors(normalized(w)[None].float(), tol=1e-3)
    pad, size = padded_batch(others + [w])
    sym = normalized(pad + torch.diag_embed((pad.sum(-1) == 0).double())).float()
    for r in range(3):
        sym[r].diagonal()[size[r]:] = -2.0
    shared = lanczos.second_eigenvectors(sym, size=size, tol=1e-3)
    k = w.shape[0]
    assert float(shared[2, k:].abs().max()) == 0.0  # nothing on the padding
    assert float(angle_to(shared[2:, :k], alone)[0]) < 1e-5
    # the dense solver on the real rows only: the same vector as alone, bit for bit
    dense_alone = backends.second_eigenvectors(normalized(w)[None].float(), "scipy")
    dense_shared = backends.second_eigenvectors(sym, "scipy", size=size)
    assert torch.equal(dense_shared[2, :k], dense_alone[0])
    assert float(dense_shared[2, k:].abs().max()) == 0.0
    # and the cuts through the backends, batched or not
    solver = partial(backends.second_eigenvectors, backend="krylov")
    one = cuts.best_cuts(w[None], torch.tensor([k]), eigvec=solver)
    many = cuts.best_cuts(pad, size, eigvec=solver)
    assert torch.equal(one[1][0], many[1][2, :k]) or torch.equal(one[1][0], ~many[1][2, :k])


def test_size_is_checked_and_a_spanned_matrix_is_exact():
    w = planted_affinity(2, 6, 0.05, noise=0.3, seed=1)[0]  # 12 real rows, padded to 20
    sym = torch.full((1, 20, 20), 0.0)
    sym[0, :12, :12] = normalized(w).float()
    sym[0].diagonal()[12:] = -2.0
    with pytest.raises(ValueError, match="size must be"):
        lanczos.second_eigenvectors(sym, size=torch.tensor([1]))
    with pytest.raises(ValueError, match="size must be"):
        lanczos.second_eigenvectors(sym, size=torch.tensor([21]))
    # a 16-row basis on 12 real rows: it spans them after one cycle, the vector is exact
    got, info = lanczos.second_eigenvectors(sym, size=torch.tensor([12]), return_info=True)
    ref = torch.linalg.eigh(sym[:, :12, :12].double())[1][..., -2]
    assert bool(info.converged.all()) and int(info.matvecs[0]) == 12
    assert float(angle_to(got[:, :12], ref)[0]) < 1e-5 and float(got[0, 12:].abs().max()) == 0
