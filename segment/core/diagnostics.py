"""Attention diagnostics: measures of each head's attention read as a Markov chain.

Pure functions of tensors, batched over any leading dimensions (layers, heads, images):
every input is ``(..., N, N)`` softmax attention over ``[prefix tokens][grid tokens]`` and
every measure is ``(...)``. Two families:

* **attention measures**, on the full matrix ``A`` (``N`` tokens, prefix included): row
  entropy, KL of the rows from uniform, prefix mass, sink mass, stable rank;
* **chain measures**, on the grid chain ``P`` (prefix tokens removed, rows renormalised,
  ``n`` tokens; protocol §1): the eigenvalue moduli (``|lambda_2|``, spectral gap, number of
  moduli above a threshold) and the exact TokenRank of the damped chain
  ``alpha P + (1 - alpha) 11^T / n`` (its entropy and top-1% mass).

The spectra, the stationary vectors and the spectral norms are dense float64 LAPACK calls
through numpy (``eigvals``, ``solve``, ``eigvalsh``), looped over the batch in chunks; every
result is float64 on the input's device. Exact TokenRank solves
``(I - alpha P^T) pi = (1 - alpha) / n`` (the damped chain's stationary vector, no iteration:
power iteration at ``alpha = 0.99`` leaves slow-mixing heads unconverged, docs/markov.md).

Shape letters: ``N`` tokens, ``n`` grid tokens, ``k = ceil(top * count)`` top tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from segment.core import markov

__all__ = [
    "HeadDiagnostics",
    "MEASURES",
    "diagnose_heads",
    "eigen_moduli",
    "exact_tokenrank",
    "grid_chain",
    "kl_from_uniform",
    "prefix_mass",
    "row_entropy",
    "sink_mass",
    "spectral_measures",
    "SpectralMeasures",
    "stable_rank",
    "top_mass",
]

_CHUNK = 64  # matrices per LAPACK call (bounds the float64 copies held at once)


def _to_numpy(x: Tensor) -> np.ndarray:
    return x.detach().to(device="cpu", dtype=torch.float64).numpy()


def _chunked(fn, x: np.ndarray) -> np.ndarray:
    """``fn`` over ``(M, N, N)`` in chunks of ``_CHUNK`` matrices, results concatenated."""
    return np.concatenate([fn(x[i:i + _CHUNK]) for i in range(0, x.shape[0], _CHUNK)])


def _rows(attn: Tensor) -> Tensor:
    """Validated attention in float64 with rows renormalised to sum exactly to one (fp32
    softmax rows are off by ~1e-7, which would leak into entropies at that level)."""
    markov.validate_stochastic(attn)
    a = attn.double()
    return a / a.sum(-1, keepdim=True)


def _top_k(count: int, top: float) -> int:
    if not 0.0 < float(top) <= 1.0:
        raise ValueError(f"top must be a fraction in (0, 1], got {top!r}")
    return max(1, math.ceil(float(top) * count))


# --------------------------------------------------------------------------------------
# attention measures (the full matrix)
# --------------------------------------------------------------------------------------


def row_entropy(attn: Tensor) -> Tensor:
    """Mean Shannon entropy (nats) of the rows.

    Args:
        attn: ``(..., N, N)`` row-stochastic attention.

    Returns:
        ``(...)`` float64 ``mean_i -sum_j A_ij log A_ij``, in ``[0, log N]`` (0 for a
        permutation, ``log N`` for the uniform chain).
    """
    a = _rows(attn)
    return -torch.xlogy(a, a).sum(-1).mean(-1)


def kl_from_uniform(attn: Tensor) -> Tensor:
    """Mean KL divergence of the rows from the uniform distribution.

    Args:
        attn: ``(..., N, N)`` row-stochastic attention.

    Returns:
        ``(...)`` float64 ``mean_i KL(A_i || 1/N) = mean_i sum_j A_ij log(N A_ij)``, in
        ``[0, log N]`` (equals ``log N`` minus the mean row entropy for exact rows).
    """
    a = _rows(attn)
    n = a.shape[-1]
    return (torch.xlogy(a, a) + a * math.log(n)).sum(-1).mean(-1)


def prefix_mass(attn: Tensor, prefix: int) -> Tensor:
    """Share of the attention that goes into the prefix tokens (CLS, registers, text).

    Args:
        attn: ``(..., N, N)`` row-stochastic attention over ``[prefix][rest]``.
        prefix: number of leading prefix tokens (``0 <= prefix < N``).

    Returns:
        ``(...)`` float64 ``mean_i sum_{j < prefix} A_ij`` over every query row, in ``[0, 1]``.
    """
    n = attn.shape[-1]
    if not 0 <= int(prefix) < n:
        raise ValueError(f"prefix must be in [0, {n}), got {prefix}")
    return _rows(attn)[..., :, : int(prefix)].sum(-1).mean(-1)


def top_mass(dist: Tensor, top: float = 0.01) -> Tensor:
    """Mass of the top ``top`` fraction of entries of distributions.

    Args:
        dist: ``(..., M)`` non-negative weights (distributions, or column masses).
        top: fraction of the entries, ``k = ceil(top * M)`` (at least one).

    Returns:
        ``(...)`` float64 sum of the ``k`` largest entries.
    """
    k = _top_k(dist.shape[-1], top)
    return dist.double().topk(k, dim=-1).values.sum(-1)


def sink_mass(attn: Tensor, prefix: int, top: float = 0.01) -> Tensor:
    """Share of the attention that goes into the top ``top`` fraction of grid tokens.

    The grid tokens are ranked by the attention they receive (column mass over every query
    row); the sink mass is the share of all attention that lands on the ``ceil(top * n)``
    most attended ones (at 224 px with a 16 x 16 grid: the top 3 of 256).

    Args:
        attn: ``(..., N, N)`` row-stochastic attention over ``[prefix][grid]``.
        prefix: number of leading prefix tokens.
        top: fraction of the grid tokens.

    Returns:
        ``(...)`` float64 in ``[0, 1]``.
    """
    n = attn.shape[-1]
    if not 0 <= int(prefix) < n:
        raise ValueError(f"prefix must be in [0, {n}), got {prefix}")
    received = _rows(attn)[..., :, int(prefix):].mean(-2)  # (..., n) column mass per row
    return top_mass(received, top)


def stable_rank(attn: Tensor) -> Tensor:
    """Stable rank ``||A||_F^2 / ||A||_2^2`` (float64 LAPACK: the largest eigenvalue of
    ``A A^T``).

    Args:
        attn: ``(..., N, N)`` matrices (attention; any real matrix works).

    Returns:
        ``(...)`` float64 in ``[1, rank A]`` (1 for a rank-one matrix such as the uniform
        chain, ``N`` for a permutation).
    """
    if attn.dim() < 2 or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(f"stable_rank needs (..., N, N) matrices, got {tuple(attn.shape)}")
    batch, n = attn.shape[:-2], attn.shape[-1]
    x = _to_numpy(attn).reshape(-1, n, n)
    fro = np.einsum("mij,mij->m", x, x)
    top = _chunked(lambda c: np.linalg.eigvalsh(c @ c.transpose(0, 2, 1))[:, -1], x)
    out = fro / np.maximum(top, np.finfo(np.float64).tiny)
    return torch.from_numpy(out.reshape(batch)).to(attn.device)


# --------------------------------------------------------------------------------------
# chain measures (the grid chain)
# --------------------------------------------------------------------------------------


def grid_chain(attn: Tensor, prefix: int) -> Tensor:
    """The grid chain: prefix tokens removed, rows renormalised (rows left with no mass
    become uniform), float64.

    Args:
        attn: ``(..., N, N)`` row-stochastic attention over ``[prefix][grid]``.
        prefix: number of leading prefix tokens.

    Returns:
        ``(..., n, n)`` float64 row-stochastic chain, ``n = N - prefix``.
    """
    return markov.strip_prefix(_rows(attn), int(prefix), zero_rows="uniform")


def eigen_moduli(chain: Tensor) -> Tensor:
    """All eigenvalue moduli of each chain, largest first (dense float64 ``eigvals``).

    Args:
        chain: ``(..., n, n)`` row-stochastic chains.

    Returns:
        ``(..., n)`` float64 ``|lambda_1| >= |lambda_2| >= ...`` (``|lambda_1| = 1``).
    """
    markov.validate_stochastic(chain)
    batch, n = chain.shape[:-2], chain.shape[-1]
    x = _to_numpy(chain).reshape(-1, n, n)
    mod = _chunked(lambda c: np.abs(np.linalg.eigvals(c)), x)
    mod = -np.sort(-mod, axis=-1)
    return torch.from_numpy(np.ascontiguousarray(mod).reshape(*batch, n)).to(chain.device)


@dataclass
class SpectralMeasures:
    """What the eigenvalue moduli of a chain say.

    Attributes:
        lambda2: ``(...)`` ``|lambda_2|``, the second largest modulus, in ``[0, 1]``.
        gap: ``(...)`` spectral gap ``1 - |lambda_2|``.
        metastable: ``(...)`` int64 number of moduli above ``threshold`` (``lambda_1``
            included): an estimate of the number of metastable states.
        moduli: ``(..., n)`` every modulus, largest first.
    """

    lambda2: Tensor
    gap: Tensor
    metastable: Tensor
    moduli: Tensor


def spectral_measures(moduli: Tensor, threshold: float = 0.9) -> SpectralMeasures:
    """``|lambda_2|``, the gap and the metastable-state count from sorted moduli.

    Args:
        moduli: ``(..., n)`` eigenvalue moduli, largest first (:func:`eigen_moduli`).
        threshold: moduli above it count as metastable states.

    Returns:
        :class:`SpectralMeasures`.
    """
    if moduli.shape[-1] < 2:
        raise ValueError(f"need at least 2 eigenvalues for lambda_2, got {moduli.shape[-1]}")
    lam2 = moduli[..., 1].clamp(0.0, 1.0)
    return SpectralMeasures(
        lambda2=lam2, gap=1.0 - lam2, metastable=(moduli > float(threshold)).sum(-1),
        moduli=moduli,
    )


def exact_tokenrank(chain: Tensor, alpha: float = 0.99) -> Tensor:
    """The exact stationary vector of the damped chain ``alpha P + (1 - alpha) 11^T / n``
    (:func:`segment.core.markov.exact_stationary`, a dense float64 solve), so slow-mixing
    heads get the same accuracy as fast ones (the power iteration of
    :func:`segment.core.markov.tokenrank` stops on its L1 change, docs/markov.md).

    Args:
        chain: ``(..., n, n)`` row-stochastic chains.
        alpha: damping in ``(0, 1)`` (``1`` has no unique solution in general).

    Returns:
        ``(..., n)`` float64 stationary distributions (non-negative, sum 1).
    """
    if markov.validate_alpha(alpha) >= 1.0:
        raise ValueError("exact_tokenrank needs alpha < 1 (the undamped chain may be reducible)")
    return markov.exact_stationary(chain, alpha)


def _entropy(dist: Tensor) -> Tensor:
    return -torch.xlogy(dist, dist).sum(-1)


# --------------------------------------------------------------------------------------
# every measure at once
# --------------------------------------------------------------------------------------

#: the scalar measures of :class:`HeadDiagnostics`, in report order
MEASURES = (
    "entropy", "entropy_frac", "kl_uniform", "prefix_mass", "sink_mass", "stable_rank",
    "lambda2", "gap", "metastable", "tokenrank_entropy", "tokenrank_entropy_frac",
    "tokenrank_top",
)


@dataclass
class HeadDiagnostics:
    """Every measure of a batch of heads; each field ``(...)`` float64 unless noted.

    Attributes:
        entropy: mean row entropy of ``A`` (nats), in ``[0, log N]``.
        entropy_frac: ``entropy / log N``, in ``[0, 1]``.
        kl_uniform: mean KL of the rows of ``A`` from uniform, in ``[0, log N]``.
        prefix_mass: share of attention into the prefix tokens.
        sink_mass: share of attention into the top ``top`` fraction of grid tokens.
        stable_rank: ``||A||_F^2 / ||A||_2^2`` of the full attention, ``>= 1``.
        lambda2: ``|lambda_2|`` of the grid chain, in ``[0, 1]``.
        gap: ``1 - |lambda_2|``.
        metastable: number of grid-chain eigenvalue moduli above ``threshold`` (float64 here
            so that averages over images stay in one dtype).
        tokenrank_entropy: entropy of the exact TokenRank of the damped grid chain (nats).
        tokenrank_entropy_frac: ``tokenrank_entropy / log n``.
        tokenrank_top: TokenRank mass of its top ``top`` fraction of grid tokens.
        moduli: ``(..., n)`` grid-chain eigenvalue moduli, largest first.
        tokenrank: ``(..., n)`` the exact TokenRank over the grid tokens (row-major).
        num_tokens: ``N``; grid_tokens: ``n``.
    """

    entropy: Tensor
    entropy_frac: Tensor
    kl_uniform: Tensor
    prefix_mass: Tensor
    sink_mass: Tensor
    stable_rank: Tensor
    lambda2: Tensor
    gap: Tensor
    metastable: Tensor
    tokenrank_entropy: Tensor
    tokenrank_entropy_frac: Tensor
    tokenrank_top: Tensor
    moduli: Tensor
    tokenrank: Tensor
    num_tokens: int
    grid_tokens: int

    def measures(self) -> dict[str, Tensor]:
        """The scalar measures by name (:data:`MEASURES` order)."""
        return {f: getattr(self, f) for f in MEASURES}


def diagnose_heads(
    attn: Tensor,
    prefix: int,
    *,
    alpha: float = 0.99,
    threshold: float = 0.9,
    top: float = 0.01,
) -> HeadDiagnostics:
    """Every diagnostic measure of each head (module docstring).

    Args:
        attn: ``(..., N, N)`` row-stochastic attention over ``[prefix][grid]`` (e.g.
            ``(L, H, N, N)`` for one image: a layer x head table).
        prefix: number of leading prefix tokens (ViT: 1 + registers).
        alpha: damping of the TokenRank chain (reference 0.99).
        threshold: eigenvalue modulus above which a state counts as metastable.
        top: fraction of tokens in the sink and TokenRank top masses.

    Returns:
        :class:`HeadDiagnostics` with ``(...)`` measures.
    """
    n_all = attn.shape[-1]
    if n_all - int(prefix) < 2:
        raise ValueError(f"need at least 2 grid tokens, got N={n_all} with prefix {prefix}")
    a = _rows(attn)
    ent = -torch.xlogy(a, a).sum(-1).mean(-1)
    log_n = math.log(n_all)
    chain = grid_chain(a, prefix)
    n = chain.shape[-1]
    spec = spectral_measures(eigen_moduli(chain), threshold)
    pi = exact_tokenrank(chain, alpha)
    tr_ent = _entropy(pi)
    return HeadDiagnostics(
        entropy=ent,
        entropy_frac=ent / log_n,
        kl_uniform=kl_from_uniform(a),
        prefix_mass=prefix_mass(a, prefix),
        sink_mass=sink_mass(a, prefix, top),
        stable_rank=stable_rank(a),  # of the renormalised rows
        lambda2=spec.lambda2,
        gap=spec.gap,
        metastable=spec.metastable.double(),
        tokenrank_entropy=tr_ent,
        tokenrank_entropy_frac=tr_ent / math.log(n),
        tokenrank_top=top_mass(pi, top),
        moduli=spec.moduli,
        tokenrank=pi,
        num_tokens=n_all,
        grid_tokens=n,
    )

