"""Attention as a discrete-time Markov chain: the math at the heart of ``segment``.

A softmax attention matrix ``A`` of shape ``(..., N, N)`` has non-negative entries and rows
that sum to one, so row ``i`` is the distribution of where token ``i`` sends its attention:
``A`` is the transition matrix of a Markov chain over tokens (protocol §1).

Every function here is a pure function of tensors:

* batch dimensions lead (``...``) and are kept in the outputs;
* fp16 / bf16 inputs are computed in fp32, float64 inputs stay float64 (references);
* the same code runs on CPU and CUDA (the device of the input is used);
* bad input (NaN/inf, negative entries, zero rows, non-square matrices, ``alpha`` outside
  ``(0, 1]``) raises a :class:`ValueError` that names the problem, never a silent NaN.

Shape letters: ``N`` tokens, ``H`` heads, ``S`` start distributions, ``K`` steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from segment.core.noise import Noise

__all__ = [
    "BounceResult",
    "Lambda2Result",
    "TokenRankResult",
    "bounce",
    "compute_dtype",
    "damp",
    "exact_stationary",
    "stationary",
    "fuse_heads",
    "head_weights",
    "inverse_column_sums",
    "lambda2",
    "lambda2_dense",
    "reverse_chain",
    "row_times",
    "strip_prefix",
    "tokenrank",
    "validate_alpha",
    "validate_stochastic",
]


# --------------------------------------------------------------------------------------
# validation and small helpers
# --------------------------------------------------------------------------------------


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the chain math runs in: float64 stays float64, everything else is fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as_compute(x: Tensor) -> Tensor:
    return x.to(compute_dtype(x.dtype)) if x.is_floating_point() else x.float()


def validate_alpha(alpha: float) -> float:
    """Checks that a damping factor lies in ``(0, 1]``.

    Raises:
        ValueError: if ``alpha`` is not a finite number in ``(0, 1]``.
    """
    try:
        a = float(alpha)
    except (TypeError, ValueError):
        raise ValueError(f"alpha must be a number in (0, 1], got {alpha!r}") from None
    if not (0.0 < a <= 1.0) or math.isnan(a):
        raise ValueError(f"alpha must lie in (0, 1] (damping factor), got {alpha!r}")
    return a


_ROW_ATOL = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def exact_stationary(chain: Tensor, alpha: float = 1.0) -> Tensor:
    """The exact stationary distribution of a (damped) chain: a dense float64 solve.

    ``alpha < 1``: the damped chain ``alpha P + (1 - alpha) 11^T / n`` (TokenRank),
    ``(I - alpha P^T) pi = (1 - alpha) 1 / n``. ``alpha = 1``: ``P`` itself,
    ``(P^T - I) pi = 0`` with its last equation replaced by ``sum(pi) = 1``; the chain must
    then have a unique stationary distribution (irreducible). ``torch.linalg.solve_ex`` on
    the chain's device: one batched call on CUDA, one call per matrix on the CPU (torch's
    batched CPU solve with MKL fails on two or more threads, "Parameter 6 was incorrect on
    entry to DLASWP", pytorch/pytorch#142815, reproduced with torch 2.14.1). Slow-mixing
    chains get the same accuracy as fast ones, unlike the power iteration of
    :func:`tokenrank`, which stops on its L1 change.

    Args:
        chain: ``(..., n, n)`` row-stochastic chains.
        alpha: damping in ``(0, 1]``.

    Returns:
        ``(..., n)`` float64 stationary distributions (non-negative, sum 1) on
        ``chain.device``.

    Raises:
        ValueError: bad input (:func:`validate_stochastic`, :func:`validate_alpha`), or an
            undamped chain without a unique stationary distribution.
    """
    a = validate_alpha(alpha)
    validate_stochastic(chain)
    batch, n = chain.shape[:-2], chain.shape[-1]
    p = chain.detach().to(torch.float64).reshape(-1, n, n)
    eye = torch.eye(n, dtype=torch.float64, device=p.device)
    if a < 1.0:
        lhs = eye - a * p.transpose(1, 2)
        rhs = torch.full((n, 1), (1.0 - a) / n, dtype=torch.float64, device=p.device)
    else:
        lhs = p.transpose(1, 2) - eye
        lhs[:, -1, :] = 1.0  # the normalisation replaces the last balance equation
        rhs = torch.zeros((n, 1), dtype=torch.float64, device=p.device)
        rhs[-1] = 1.0
    if p.is_cuda:
        pi, info = torch.linalg.solve_ex(lhs, rhs.expand(p.shape[0], n, 1).contiguous())
    else:
        solved = [torch.linalg.solve_ex(m, rhs) for m in lhs]
        pi = torch.stack([x for x, _ in solved])
        info = torch.stack([i for _, i in solved])
    if bool((info != 0).any()):
        raise ValueError(
            "the chain has no unique stationary distribution (reducible): damp it first"
            " (alpha < 1)"
        )
    pi = pi[..., 0].clamp_min(0.0)
    return (pi / pi.sum(-1, keepdim=True)).reshape(*batch, n)


STATIONARY_DENSE_UP_TO = 256  # :func:`stationary`: chains this small are solved densely
STATIONARY_TOL = 1e-6  # :func:`stationary`: the L1 residual |pi P - pi|_1 of the iteration


def row_times(v: Tensor, mats: Tensor) -> Tensor:
    """``(M, n)`` each row vector times its matrix, ``v[i] @ mats[i]`` (``mats`` (M, n, m)).

    On the CPU one ``torch.mv`` per matrix: torch's batched ``bmm`` of ``(M, 1, n)`` by
    ``(M, n, n)`` runs there about 10x slower than the matrix-vector products it batches
    (measured with torch 2.x on this project's CPU, n = 1024); elsewhere one ``bmm``.
    """
    if v.device.type == "cpu":
        return torch.stack([torch.mv(a.T, x) for a, x in zip(mats, v)])
    return torch.bmm(v.unsqueeze(1), mats).squeeze(1)


def stationary(chain: Tensor, tol: float = STATIONARY_TOL, max_iter: int = 1000,
               dense_up_to: int = STATIONARY_DENSE_UP_TO) -> Tensor:
    """The stationary distribution of each chain, by power iteration to a stated residual.

    ``O(n^2)`` per step instead of the ``O(n^3)`` dense solve of :func:`exact_stationary`
    (at 4,096 tokens a 4.6e10-flop LU per chain): the undamped power iteration
    ``pi <- pi P`` from the uniform vector, in float64 (the chain's products in its own
    dtype), each chain stopping when its residual ``|pi P - pi|_1`` is at most ``tol``; the
    distance to the exact distribution is then at most about ``tol / (1 - |lambda_2|)``
    (the attention chains of the cuts mix in tens of steps: ``|lambda_2|`` 0.7-0.85 at
    448 px). Chains of at most ``dense_up_to`` tokens, and any chain that has not converged
    after ``max_iter`` steps (slow-mixing or periodic), get the exact dense solve.

    Args:
        chain: ``(..., n, n)`` row-stochastic, irreducible.
        tol: the L1 residual at which a chain's iteration stops (at least a few float32
            roundings of a distribution, ``1e-6``, for float32 chains).
        max_iter: power steps before the dense fallback.
        dense_up_to: the largest ``n`` solved densely.

    Returns:
        ``(..., n)`` float64 stationary distributions (non-negative, sum 1).
    """
    n = chain.shape[-1]
    if n <= int(dense_up_to):
        return exact_stationary(chain)
    if max_iter < 1:
        raise ValueError(f"max_iter must be >= 1, got {max_iter}")
    x = _chain(chain)
    batch = x.shape[:-2]
    flat = x.reshape(-1, n, n)
    pi = torch.full(flat.shape[:1] + (n,), 1.0 / n, dtype=torch.float64, device=x.device)
    done = torch.zeros(flat.shape[0], dtype=torch.bool, device=x.device)
    active = torch.arange(flat.shape[0], device=x.device)
    mats = flat
    for _ in range(int(max_iter)):
        cur = pi[active]
        new = row_times(cur.to(x.dtype), mats).to(torch.float64)
        new = new / new.sum(-1, keepdim=True)
        ok = (new - cur).abs().sum(-1) <= float(tol)
        pi[active] = new
        done[active] = ok
        if bool(ok.all()):
            break
        if bool(ok.any()):
            left = (~ok).nonzero().squeeze(-1)
            active, mats = active[left], mats.index_select(0, left)
    if not bool(done.all()):
        pi[~done] = exact_stationary(flat[~done])
    pi = pi.clamp_min(0.0)
    return (pi / pi.sum(-1, keepdim=True)).reshape(*batch, n)


def validate_stochastic(
    attn: Tensor,
    *,
    atol: float | None = None,
    name: str = "attention",
    check_rows: bool = True,
) -> None:
    """Checks that ``attn`` is a batch of row-stochastic square matrices.

    Args:
        attn: ``(..., N, N)`` transition matrices.
        atol: tolerance on ``|row sum - 1|``; ``None`` picks one for the dtype (1e-6 for
            float64, 1e-3 for float32, 1e-2 for fp16, 2e-2 for bf16).
        name: what to call the tensor in error messages.
        check_rows: also check that rows sum to one (not only non-negative and finite).

    Raises:
        ValueError: naming the first problem found: wrong rank, non-square (cross)
            attention, NaN/inf, negative entries, rows summing to zero (masked tokens), or
            rows that do not sum to one.
    """
    if not isinstance(attn, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(attn).__name__}")
    if attn.dim() < 2:
        raise ValueError(f"{name} must have shape (..., N, N), got {tuple(attn.shape)}")
    n_rows, n_cols = attn.shape[-2:]
    if n_rows != n_cols:
        raise ValueError(
            f"{name} must be square (..., N, N) to be a Markov chain; got {n_rows} x {n_cols}"
            " (cross attention between two token sets is not a chain over one set)"
        )
    if n_rows == 0:
        raise ValueError(f"{name} has no tokens (N = 0)")
    if not attn.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {attn.dtype}")
    # two passes over the data: row sums (NaN/+inf propagate into them) and the minimum
    sums = attn.sum(-1, dtype=compute_dtype(attn.dtype))
    lowest = attn.amin()
    if not bool(torch.isfinite(sums).all()) or not bool(torch.isfinite(lowest)):
        bad = int((~torch.isfinite(attn)).sum())
        raise ValueError(f"{name} contains {bad} NaN/inf entries")
    if lowest < 0:
        raise ValueError(
            f"{name} has negative entries (min {lowest.item():.3g}); a transition matrix"
            " must be non-negative (pass softmax probabilities, not logits)"
        )
    if check_rows:
        zero = sums <= 0
        if bool(zero.any()):
            raise ValueError(
                f"{name} has {int(zero.sum())} rows that sum to 0 (masked or removed tokens);"
                " renormalise them (strip_prefix(..., zero_rows='uniform')) or drop those tokens"
            )
        if atol is None:
            atol = _ROW_ATOL.get(attn.dtype, 1e-3)
        err = (sums - 1).abs().max().item()
        if err > atol:
            raise ValueError(
                f"{name} rows must sum to 1 (row-stochastic); the largest deviation is"
                f" {err:.3g} > atol={atol:g}"
            )


def _chain(attn: Tensor) -> Tensor:
    """Validated chain in the compute dtype; fp16/bf16 rows are renormalised in fp32."""
    validate_stochastic(attn)
    x = _as_compute(attn)
    if attn.dtype in (torch.float16, torch.bfloat16):
        x = x / x.sum(-1, keepdim=True)
    return x


def _check_square(attn: Tensor, name: str = "attention") -> None:
    if attn.dim() < 2 or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(
            f"{name} must have shape (..., N, N); got {tuple(attn.shape)}"
        )


def _row_normalise(x: Tensor, zero_rows: str, name: str) -> Tensor:
    sums = x.sum(-1, keepdim=True)
    zero = sums <= 0
    if bool(zero.any()):
        if zero_rows == "error":
            raise ValueError(
                f"{name}: {int(zero.sum())} rows have no mass left after normalisation"
                " (they attended only to removed tokens); pass zero_rows='uniform' to"
                " replace them by the uniform distribution"
            )
        if zero_rows != "uniform":
            raise ValueError(f"zero_rows must be 'error' or 'uniform', got {zero_rows!r}")
        n = x.shape[-1]
        x = torch.where(zero, torch.full_like(x, 1.0 / n), x)
        sums = torch.where(zero, torch.ones_like(sums), sums)
    return x / sums


def strip_prefix(
    attn: Tensor,
    num_prefix: int,
    *,
    zero_rows: Literal["error", "uniform"] = "error",
) -> Tensor:
    """Removes prefix tokens (CLS, registers, text) and renormalises the rows.

    Args:
        attn: ``(..., N, N)`` attention over ``[prefix; rest]``.
        num_prefix: number of leading tokens to remove (``0 <= num_prefix < N``).
        zero_rows: what to do with rows that put all their mass on the prefix:
            ``"error"`` raises, ``"uniform"`` replaces them by the uniform distribution.

    Returns:
        ``(..., N - num_prefix, N - num_prefix)`` row-stochastic chain over the remaining
        tokens, in the compute dtype.
    """
    _check_square(attn)
    n = attn.shape[-1]
    if not (0 <= int(num_prefix) < n):
        raise ValueError(f"num_prefix must be in [0, {n}), got {num_prefix}")
    sub = _as_compute(attn[..., num_prefix:, num_prefix:])
    return _row_normalise(sub, zero_rows, "strip_prefix")


def reverse_chain(attn: Tensor, *, zero_rows: Literal["error", "uniform"] = "error") -> Tensor:
    """The source ("outgoing") direction: the column-normalised transpose.

    ``S[i, j] = A[j, i] / sum_k A[k, i]``: row ``i`` of ``S`` says which tokens the attention
    that token ``i`` receives comes from.

    Args:
        attn: ``(..., N, N)`` row-stochastic attention.
        zero_rows: tokens that receive no attention at all give zero rows in ``S``;
            ``"error"`` raises, ``"uniform"`` replaces them by the uniform distribution.

    Returns:
        ``(..., N, N)`` row-stochastic chain.
    """
    _check_square(attn)
    return _row_normalise(_as_compute(attn).transpose(-1, -2), zero_rows, "reverse_chain")


def damp(attn: Tensor, alpha: float = 0.99, personalization: Tensor | None = None) -> Tensor:
    """The damped (PageRank-corrected) chain ``T = alpha * A + (1 - alpha) * 1 e^T``.

    Args:
        attn: ``(..., N, N)`` row-stochastic attention.
        alpha: damping factor in ``(0, 1]``; ``1`` returns ``A`` unchanged.
        personalization: ``(..., N)`` teleport distribution ``e`` (non-negative, normalised
            here); ``None`` means uniform ``1/N``.

    Returns:
        ``(..., N, N)`` irreducible, aperiodic row-stochastic chain (for ``alpha < 1``).
    """
    a = validate_alpha(alpha)
    x = _chain(attn)
    e = _teleport(x, personalization)
    return a * x + (1 - a) * e.unsqueeze(-2)


def _teleport(x: Tensor, personalization: Tensor | None) -> Tensor:
    """``(..., N)`` teleport distribution matching the chain ``x`` (``(M..., N, N)``)."""
    n = x.shape[-1]
    if personalization is None:
        return torch.full(x.shape[:-1], 1.0 / n, dtype=x.dtype, device=x.device)
    e = _as_compute(personalization).to(device=x.device, dtype=x.dtype)
    if e.shape[-1] != n:
        raise ValueError(f"personalization must have shape (..., {n}), got {tuple(e.shape)}")
    if not bool(torch.isfinite(e).all()) or bool((e < 0).any()):
        raise ValueError("personalization must be finite and non-negative")
    s = e.sum(-1, keepdim=True)
    if bool((s <= 0).any()):
        raise ValueError("personalization must have positive mass")
    return torch.broadcast_to(e / s, x.shape[:-1])


def inverse_column_sums(x: Tensor, alpha: float, e: Tensor | None = None) -> Tensor:
    """``(..., N)`` ``1 / c`` with ``c`` the column sums of the damped chain
    ``alpha x + (1 - alpha) 1 e^T`` (``e`` uniform when ``None``): the normaliser of its
    source (reverse) chain. Raises when a column is zero (only possible for ``alpha = 1``)."""
    n = x.shape[-1]
    c = alpha * x.sum(-2)
    if alpha < 1:
        c = c + (1 - alpha) * (n * e if e is not None else 1.0)
    if bool((c <= 0).any()):
        raise ValueError(
            f"the source direction needs every token to receive attention, but {int((c <= 0).sum())}"
            " columns sum to 0; damp the chain (alpha < 1) or drop those tokens"
        )
    return 1.0 / c


# --------------------------------------------------------------------------------------
# TokenRank
# --------------------------------------------------------------------------------------


@dataclass
class TokenRankResult:
    """Stationary distribution of the damped chain and how the iteration went.

    Attributes:
        pi: ``(..., N)`` stationary distribution (sums to 1).
        iterations: ``(...)`` power steps used by each batch element.
        residual: ``(...)`` final L1 change ``|pi_k - pi_{k-1}|_1``.
        converged: ``(...)`` whether the residual fell below ``tol``.
    """

    pi: Tensor
    iterations: Tensor
    residual: Tensor
    converged: Tensor


def tokenrank(
    attn: Tensor,
    alpha: float = 0.99,
    tol: float = 1e-6,
    max_iter: int = 200,
    personalization: Tensor | None = None,
    *,
    direction: Literal["incoming", "outgoing", "source"] = "incoming",
    return_info: bool = False,
) -> Tensor | TokenRankResult:
    """TokenRank: the stationary distribution ``pi^T T = pi^T`` of the damped chain.

    Batched power iteration from the uniform vector, ``pi <- alpha * pi A + (1 - alpha) e``,
    renormalised each step; each batch element stops as soon as its L1 change falls below
    ``tol`` (the others go on, on a copy of their chains). The damped matrix is never formed.

    Args:
        attn: ``(..., N, N)`` row-stochastic attention.
        alpha: damping factor in ``(0, 1]`` (reference 0.99; classic PageRank 0.85).
        tol: L1 convergence threshold per batch element.
        max_iter: maximum number of power steps.
        personalization: ``(..., N)`` teleport distribution (default uniform).
        direction: ``"incoming"`` (sink view: who receives attention in the long run),
            ``"outgoing"`` (source view: the damped :func:`reverse_chain` of ``A``,
            ``alpha S + (1 - alpha) 1 e^T``) or ``"source"`` (the reverse of the damped
            chain, ``reverse_chain(alpha A + (1 - alpha) 1 e^T)``, the reference code's
            ``tokenrank_src``; computed from ``A`` without forming either matrix).
        return_info: also return iterations, residuals and convergence flags.

    Returns:
        ``(..., N)`` stationary distribution, or a :class:`TokenRankResult`.
    """
    a = validate_alpha(alpha)
    if max_iter < 1:
        raise ValueError(f"max_iter must be >= 1, got {max_iter}")
    x = _chain(attn)
    if direction == "outgoing":
        x = reverse_chain(x)
    elif direction not in ("incoming", "source"):
        raise ValueError(
            f"direction must be 'incoming', 'outgoing' or 'source', got {direction!r}"
        )
    batch, n = x.shape[:-2], x.shape[-1]
    flat = x.reshape(-1, n, n)
    m = flat.shape[0]
    e = _teleport(x, personalization).reshape(m, n)
    source = direction == "source"
    # source: S = rownorm(T^T), T = a A + (1 - a) 1 e^T; pi S = a (pi / c) A^T + (1 - a)
    # ((pi / c) . e) 1 with c = column sums of T (positive for a < 1)
    inv_c = inverse_column_sums(flat, a, e) if source else None

    pi = torch.full((m, n), 1.0 / n, dtype=x.dtype, device=x.device)
    iters = torch.zeros(m, dtype=torch.long, device=x.device)
    resid = torch.full((m,), float("inf"), dtype=x.dtype, device=x.device)
    active = torch.arange(m, device=x.device)
    mats, tele, inv = flat, e, inv_c
    for it in range(1, max_iter + 1):
        cur = pi[active]
        if source:
            u = cur * inv
            new = a * torch.bmm(u.unsqueeze(1), mats.transpose(-1, -2)).squeeze(1)
            new = new + (1 - a) * (u * tele).sum(-1, keepdim=True)
        else:
            new = a * torch.bmm(cur.unsqueeze(1), mats).squeeze(1) + (1 - a) * tele
        new = new / new.sum(-1, keepdim=True)
        change = (new - cur).abs().sum(-1)
        pi[active] = new
        resid[active] = change
        iters[active] = it
        still = change >= tol
        if not bool(still.any()):
            break
        if not bool(still.all()):  # keep iterating the others only (a copy of their chains)
            active, mats, tele = active[still], mats[still], tele[still]
            inv = inv[still] if source else None
    pi = pi.reshape(*batch, n)
    if not return_info:
        return pi
    return TokenRankResult(
        pi=pi,
        iterations=iters.reshape(batch),
        residual=resid.reshape(batch),
        converged=(resid < tol).reshape(batch),
    )


# --------------------------------------------------------------------------------------
# multi-bounce propagation
# --------------------------------------------------------------------------------------


@dataclass
class BounceResult:
    """Every intermediate distribution of a multi-bounce propagation.

    Attributes:
        steps: ``(..., S, K, N)`` ``v_1 .. v_K`` for each start (``S`` dropped for a single
            integer start).
    """

    steps: Tensor

    @property
    def last(self) -> Tensor:
        """``(..., S, N)`` the final distribution ``v_K``."""
        return self.steps[..., -1, :]


def bounce(
    attn: Tensor,
    start: int | Tensor,
    steps: int = 2,
    *,
    direction: Literal["forward", "source"] = "forward",
    alpha: float = 1.0,
) -> BounceResult:
    """Multi-bounce propagation ``v_{n+1}^T = v_n^T A``, keeping ``v_1 .. v_steps``.

    ``steps = 1`` from a token index is row selection (``v_1 = A[i]``); ``steps = 2`` adds
    the indirect paths ``i -> k -> j``; ``steps -> inf`` tends to the stationary vector.

    With ``alpha < 1`` the walk runs on the damped chain ``T = alpha A + (1 - alpha) 11^T / N``
    (the reference code's ``prep_for_power_method``), applied implicitly:
    ``v^T T = alpha v^T A + (1 - alpha) (sum v) / N``, so nothing larger than ``attn`` is
    formed. The source direction walks ``reverse_chain(T)`` the same way:
    ``v^T S = alpha (v / c)^T A^T + (1 - alpha) sum(v / c) / N`` with ``c`` the column sums
    of ``T``.

    Args:
        attn: ``(..., N, N)`` row-stochastic attention.
        start: where the mass starts: an ``int`` token index, a ``LongTensor`` of ``S`` token
            indices, or a float tensor ``(..., S, N)`` of non-negative start masses (not
            necessarily normalised: propagation is linear), broadcast against the batch.
        steps: number of bounces ``K >= 1``.
        direction: ``"forward"`` follows attention (rows of ``T``); ``"source"`` walks back
            along where attention comes from (rows of :func:`reverse_chain` of ``T``).
        alpha: damping factor in ``(0, 1]``; ``1`` walks ``A`` itself.

    Returns:
        :class:`BounceResult` with ``steps`` of shape ``(..., S, K, N)`` (or ``(..., K, N)``
        for an ``int`` start).
    """
    if int(steps) < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    a = validate_alpha(alpha)
    if direction not in ("forward", "source"):
        raise ValueError(f"direction must be 'forward' or 'source', got {direction!r}")
    x = _chain(attn)
    n = x.shape[-1]
    inv_c = inverse_column_sums(x, a).unsqueeze(-2) if direction == "source" else None

    def step(v: Tensor) -> Tensor:  # (..., S, N) -> (..., S, N)
        if inv_c is not None:
            v = v * inv_c
            out = torch.matmul(v, x.transpose(-1, -2))
        else:
            out = torch.matmul(v, x)  # (..., S, N) @ (..., N, N)
        if a < 1:
            out = a * out + (1 - a) / n * v.sum(-1, keepdim=True)
        return out

    single = False
    if isinstance(start, int) or (isinstance(start, Tensor) and not start.is_floating_point()):
        idx = torch.as_tensor(start, device=x.device).long()
        single = idx.dim() == 0
        idx = idx.reshape(-1)
        if bool(((idx < 0) | (idx >= n)).any()):
            raise ValueError(f"start indices must lie in [0, {n}), got {idx.tolist()}")
        if inv_c is None and a == 1:
            v = x.index_select(-2, idx)  # (..., S, N): the first bounce is row selection
        else:
            one_hot = torch.zeros(idx.numel(), n, dtype=x.dtype, device=x.device)
            one_hot[torch.arange(idx.numel(), device=x.device), idx] = 1.0
            v = step(one_hot)
    else:
        v0 = _as_compute(start).to(device=x.device, dtype=x.dtype)
        if v0.dim() == 1:
            v0, single = v0.unsqueeze(0), True
        if v0.shape[-1] != n:
            raise ValueError(f"start must have shape (..., S, {n}), got {tuple(start.shape)}")
        if not bool(torch.isfinite(v0).all()) or bool((v0 < 0).any()):
            raise ValueError("start distributions must be finite and non-negative")
        v = step(v0)
    out = [v]
    for _ in range(int(steps) - 1):
        v = step(v)
        out.append(v)
    res = torch.stack(out, dim=-2)  # (..., S, K, N)
    if single:
        res = res.squeeze(-3)
    return BounceResult(steps=res)


# --------------------------------------------------------------------------------------
# lambda_2
# --------------------------------------------------------------------------------------


@dataclass
class Lambda2Result:
    """Second largest eigenvalue modulus of a batch of chains.

    Attributes:
        value: ``(...)`` ``|lambda_2|`` (float64).
        eigenvalue: ``(...)`` the eigenvalue itself (complex128; conjugate pairs share
            the modulus).
        residual: ``(...)`` norm of the Ritz residual ``|y P - theta y|`` for the Krylov
            estimate (0 where the dense path was used).
        converged: ``(...)`` whether the Krylov estimate met its tolerance (always true for
            the dense path).
        matvecs: ``(...)`` matrix-vector products spent (0 for the dense path).
        dense: ``(...)`` whether the value comes from the dense float64 fallback.
    """

    value: Tensor
    eigenvalue: Tensor
    residual: Tensor
    converged: Tensor
    matvecs: Tensor
    dense: Tensor


def lambda2_dense(attn: Tensor) -> Tensor:
    """Reference ``|lambda_2|`` by a dense float64 eigendecomposition (``O(N^3)``).

    The eigenvalue 1 is removed as the one closest to 1 (not by sorting moduli), so that
    chains with several eigenvalues of modulus one (periodic or reducible) report them.

    Args:
        attn: ``(..., N, N)`` row-stochastic attention, ``N >= 2``.

    Returns:
        ``(...)`` float64 ``|lambda_2|``.
    """
    return _lambda2_dense_full(attn).abs()


def _lambda2_dense_full(attn: Tensor) -> Tensor:
    x = attn.to(torch.float64)
    ev = torch.linalg.eigvals(x)  # (..., N) complex128
    unit = (ev - 1).abs().argmin(-1, keepdim=True)
    mod = ev.abs().scatter(-1, unit, -1.0)
    j = mod.argmax(-1, keepdim=True)
    return ev.gather(-1, j).squeeze(-1)


def lambda2(
    attn: Tensor,
    *,
    method: Literal["auto", "krylov", "dense"] = "auto",
    tol: float = 1e-5,
    block: int = 1,
    passes: int = 20,
    keep: int = 10,
    max_cycles: int = 60,
    return_info: bool = False,
    seed: int = 0,
) -> Tensor | Lambda2Result:
    """``|lambda_2|``: the second largest eigenvalue modulus of each chain.

    ``lambda_1 = 1`` always (``A 1 = 1``). The fast path never forms a dense
    eigendecomposition. The sum-zero row vectors ``{y : y 1 = 0}`` form an *invariant*
    subspace of ``y -> y A`` (``(y A) 1 = y (A 1) = y 1 = 0``) on which the operator has
    exactly the eigenvalues ``lambda_2 .. lambda_N``: no deflation error, no need to know
    the stationary vector. A thick-restarted block Krylov iteration runs there: each cycle
    extends an orthonormal basis to ``passes`` blocks of ``block`` rows with batched
    ``(block x N) @ (N x N)`` products, takes the Rayleigh-Ritz values of the small
    projected matrix in float64, and restarts from the ``keep`` leading Ritz vectors plus
    the next Krylov block (Krylov-Schur). All of it is batched matmuls and small QR / eig,
    on CPU or CUDA.

    ``method="auto"`` (default) is a cascade that keeps the answer within ``1e-4`` of a
    dense float64 eigendecomposition: fp32 Krylov for every element; float64 Krylov for
    the elements that did not converge (strongly non-normal chains, whose eigenvalues
    fp32 rounding moves by ``~sqrt(eps_32)``); dense float64 ``eigvals`` for any that still
    did not (reported in ``Lambda2Result.dense``).

    Degenerate spectra:

    * several eigenvalues near 1 (nearly decomposable, metastable chains): they are
      exterior and separated from the bulk, so Krylov resolves them quickly; the value is
      the largest modulus among them;
    * no gap at all (uniformly random stochastic matrices: every non-unit eigenvalue lies
      on a circle of radius ~``1/sqrt(N)``): the largest modulus among many nearly equal
      ones is not resolved within ``max_cycles``; those elements are flagged
      ``converged=False`` and ``"auto"`` computes them densely;
    * exactly rank-deficient chains (all rows equal): the spectrum is numerically zero and
      the value 0 is returned after one cycle.

    Args:
        attn: ``(..., N, N)`` row-stochastic attention (remove prefix tokens first with
            :func:`strip_prefix` for the patch chain of protocol §1).
        method: ``"auto"``, ``"krylov"`` (fast path in the input's compute dtype only) or
            ``"dense"`` (float64 ``eigvals``).
        tol: relative residual and modulus-change tolerance of the fast path.
        block: rows per Krylov block (1: Arnoldi, the fewest products on real heads).
        passes: blocks per cycle (the basis has ``block * passes`` rows).
        keep: Ritz vectors kept at a restart: even (whole conjugate pairs always fit), a
            multiple of ``block`` and ``<= (passes - 1) * block``.
        max_cycles: restart cycles per precision before giving up (a thick restart adds
            ``passes * block - keep`` products, so 60 cycles of the defaults are 600).
        return_info: return a :class:`Lambda2Result` instead of the values.
        seed: seed of the random start block (results are deterministic).

    Returns:
        ``(...)`` float64 ``|lambda_2|`` or a :class:`Lambda2Result`.
    """
    if method not in ("auto", "krylov", "dense"):
        raise ValueError(f"method must be 'auto', 'krylov' or 'dense', got {method!r}")
    if block < 1 or passes < 3:
        raise ValueError(f"lambda2 needs block >= 1 and passes >= 3, got block={block}, passes={passes}")
    if keep % 2 or keep % block or not 2 <= keep <= (passes - 1) * block:
        raise ValueError(
            f"keep must be even, a multiple of block ({block}) and in [2, (passes - 1) * block]"
            f" = [2, {(passes - 1) * block}], got {keep}"
        )
    x = _chain(attn)
    batch, n = attn.shape[:-2], attn.shape[-1]
    if n < 2:
        raise ValueError(f"lambda2 needs at least 2 tokens, got N = {n}")
    x = x.reshape(-1, n, n)
    m, dev = x.shape[0], x.device
    small = n <= 4 * block * passes  # block >= 1 and passes >= 3 were checked above
    if method == "dense" or (method == "auto" and small):
        ev = _lambda2_dense_full(x)
        res = Lambda2Result(
            value=ev.abs(),
            eigenvalue=ev,
            residual=torch.zeros(m, dtype=torch.float64, device=dev),
            converged=torch.ones(m, dtype=torch.bool, device=dev),
            matvecs=torch.zeros(m, dtype=torch.long, device=dev),
            dense=torch.ones(m, dtype=torch.bool, device=dev),
        )
    else:
        kw = dict(tol=tol, block=block, passes=passes, keep=keep, max_cycles=max_cycles, seed=seed)
        res = _lambda2_krylov(x, **kw)
        if method == "auto":
            bad = (~res.converged).nonzero().squeeze(-1)
            if bad.numel() and x.dtype != torch.float64:
                sub = _lambda2_krylov(x.index_select(0, bad).double(), **kw)
                for f in ("value", "eigenvalue", "residual", "converged"):
                    getattr(res, f)[bad] = getattr(sub, f)
                res.matvecs[bad] += sub.matvecs
                bad = bad[~sub.converged]
            if bad.numel():
                ev = _lambda2_dense_full(x[bad])
                res.eigenvalue[bad] = ev
                res.value[bad] = ev.abs()
                res.dense[bad] = True
    out = Lambda2Result(
        **{f: getattr(res, f).reshape(batch) for f in Lambda2Result.__dataclass_fields__}
    )
    return out if return_info else out.value


def _orth_rows(z: Tensor, basis: Tensor | None, noise: Noise) -> Tensor:
    """Orthonormal, sum-zero rows spanning ``z`` (M, b, N) minus its part in ``basis``.

    Block Gram-Schmidt + QR (a normalisation for one row), repeated while a round still
    removes more than half of some row ("twice is enough" unless cancellation is severe,
    DGKS criterion). A row that lies in the span of ``basis`` (an invariant subspace was
    reached) leaves only rounding noise after projection; QR turns it into some unit
    direction and the further rounds make it orthogonal, so the subspace still grows. Rows
    still failing after a few rounds, and exact zeros, are replaced by random directions
    (``noise``: the same for every chain of the batch).
    """

    bt = basis.transpose(1, 2) if basis is not None else None

    def project(v: Tensor) -> Tensor:
        if basis is not None:  # v - (v B^T) B in one fused call
            v = torch.baddbmm(v, torch.bmm(v, bt), basis, alpha=-1)
        return v - v.mean(-1, keepdim=True)

    one = z.shape[1] == 1
    if one:  # the common case in two projections, one check (the loop below when it fails)
        p1 = project(z)
        n1 = torch.linalg.vector_norm(p1, dim=-1, keepdim=True)
        p2 = project(p1)
        n2 = torch.linalg.vector_norm(p2, dim=-1, keepdim=True)
        # the check on the host in one transfer (a few small operations cost more here)
        tiny = torch.finfo(z.dtype).tiny
        norms = torch.cat([n1, n2], -1).flatten(0, 1).tolist()
        if not any(a <= tiny or b < 0.5 * a for a, b in norms):
            return p2 / n2
    before = z.norm(dim=-1)
    for rnd in range(6):
        p = project(z)
        after = p.norm(dim=-1)
        ok = after >= 0.5 * before
        if rnd == 5 and not bool(ok.all()):  # give up on those rows: fresh directions
            p = p.clone()
            bad = ~ok
            p[bad] = project(noise.normal(p.shape, dtype=p.dtype, device=p.device))[bad]
            after = p.norm(dim=-1)
        if one:  # one row: QR is a normalisation (an exact zero: a fresh direction)
            zero = after <= torch.finfo(p.dtype).tiny
            if bool(zero.any()):
                fresh = project(noise.normal(p.shape, dtype=p.dtype, device=p.device))
                p = torch.where(zero.unsqueeze(-1), fresh, p)
                after = p.norm(dim=-1)
            z = p / after.unsqueeze(-1)
        else:
            q, _ = torch.linalg.qr(p.transpose(1, 2))
            z = q.transpose(1, 2)
        before = torch.ones_like(after)  # the rows are unit vectors now
        if rnd >= 1 and bool(ok.all()):
            break
    return z


def _top_ritz(
    basis: Tensor, images: Tensor, prev: int, tol: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Rayleigh-Ritz on row space ``basis`` (M, d, N) with ``images = basis @ A``.

    A row vector ``y = c @ basis`` maps to ``y A = c @ images``, whose projection back onto
    the span is ``c @ G`` with ``G = images @ basis^T``: the Ritz pairs are the left
    eigenpairs of ``G`` (eigendecomposed in float64). The projection onto the first
    ``prev`` rows alone is the leading ``prev x prev`` block of the same ``G``.

    Returns:
        Ritz values sorted by decreasing modulus ``(M, d)`` (complex128), their coefficient
        vectors as columns ``(M, d, d)``, the relative residual ``|y A - theta y| / |y|``
        of the top pair ``(M,)``, and the largest Ritz modulus on the first ``prev`` rows
        ``(M,)``, computed only where the residual is within ``tol`` (elsewhere the element
        is not converged whatever it is, and the value is ``inf``).
    """
    # products in the basis' own dtype: its rounding is already in basis and images, and
    # converting both to float64 cost more than the eigendecompositions
    g = torch.bmm(images, basis.transpose(1, 2)).double()
    theta, vecs = torch.linalg.eig(g.transpose(1, 2))
    order = theta.abs().argsort(-1, descending=True)
    theta = theta.gather(1, order)
    vecs = vecs.gather(2, order.unsqueeze(1).expand_as(vecs))
    cdt = torch.complex128 if basis.dtype == torch.float64 else torch.complex64
    c = vecs[:, :, :1].transpose(1, 2).to(cdt)  # (M, 1, d)
    y = torch.complex(torch.bmm(c.real, basis), torch.bmm(c.imag, basis))
    ya = torch.complex(torch.bmm(c.real, images), torch.bmm(c.imag, images))
    r = (ya - theta[:, :1, None].to(y.dtype) * y).abs().norm(dim=(-1, -2)).double()
    r = r / y.abs().norm(dim=(-1, -2)).double().clamp_min(1e-300)
    prev_mod = torch.full_like(r, float("inf"))
    near = (r <= tol).nonzero().squeeze(-1)
    if near.numel():
        sub = g.index_select(0, near)[:, :prev, :prev]
        prev_mod[near] = torch.linalg.eigvals(sub).abs().amax(-1)
    return theta, vecs, r, prev_mod


def _restart_coefficients(theta: Tensor, vecs: Tensor, k: int) -> Tensor:
    """Orthonormal real coefficients ``(M, d, k)`` spanning whole leading Ritz pairs.

    ``theta`` (M, d) are Ritz values sorted by decreasing modulus and ``vecs`` (M, d, d) their
    coefficient vectors. A real Ritz value gives one real column, a conjugate pair the real
    and imaginary parts of its first member (the pair's real span). The kept span must be
    a union of whole Ritz pairs: only then is every residual inside the next Krylov block
    (see :func:`_lambda2_krylov`). Columns are taken in order while they fit into ``k``
    (even); when a pair would straddle the cut (an odd number of real values taken), the
    free slot goes to the next real Ritz vector, or, when there is none, the last real one
    taken makes room for the pair. QR keeps the leading columns' span in order.
    """
    im = theta.imag
    size = torch.where(im > 0, 2, torch.where(im < 0, 0, 1))  # real: 1; a pair counts once: 2
    inc = size.cumsum(-1) <= k
    short = (size * inc).sum(-1) < k
    if bool(short.any()):
        real = size == 1
        spare = real & ~inc
        fill = short & spare.any(-1)
        inc[fill, spare.int().argmax(-1)[fill]] = True
        swap = short & ~fill  # k even: an odd count has a real value to give up its slot
        if bool(swap.any()):
            pos = torch.arange(size.shape[-1], device=size.device)
            last_real = torch.where(inc & real, pos, -1).amax(-1)
            pair = ((~inc) & (size == 2)).int().argmax(-1)
            rows = swap.nonzero().squeeze(-1)
            inc[rows, last_real[rows]] = False
            inc[rows, pair[rows]] = True
    take = torch.stack([inc & (size > 0), inc & (size == 2)], -1).flatten(-2)  # (M, 2d)
    cols = torch.stack([vecs.real, vecs.imag], -1).flatten(-2)  # Re c0, Im c0, Re c1, ...
    order = (~take).to(torch.int8).argsort(dim=-1, stable=True)[:, :k]
    sel = cols.gather(2, order.unsqueeze(1).expand(-1, cols.shape[1], -1))
    return torch.linalg.qr(sel).Q


def _lambda2_krylov(
    x: Tensor, *, tol: float, block: int, passes: int, keep: int, max_cycles: int, seed: int
) -> Lambda2Result:
    """Thick-restarted block Krylov on the sum-zero rows of ``x`` (M, N, N), in ``x.dtype``.

    A cycle extends ``basis`` to ``passes`` blocks of ``block`` rows, each block the previous
    block's image ``@ A``, orthogonalised; ``images`` holds every row's image, so the
    Rayleigh-Ritz matrix is exact (:func:`_top_ritz`). An element is converged when its top
    Ritz pair has a relative residual below ``tol`` and adding the last block changed the top
    modulus by less than ``tol``.

    Otherwise the next cycle restarts thick (Krylov-Schur style): the real span ``U`` of the
    ``keep`` leading Ritz vectors (whole conjugate pairs, :func:`_restart_coefficients`)
    and the next Krylov block ``f`` (the last block's images orthogonalised against the
    basis). Ritz residuals are orthogonal to the basis (Galerkin) and inside the span of
    the last images, so ``U A`` lies in ``span(U, f)``: the restarted basis ``[U; f]`` is
    again a Krylov basis, and extending it from ``f`` keeps everything the cycle learnt
    about the ``keep`` leading eigenvectors. ``U A`` costs no product (linear combinations
    of known images); ``f A`` costs one block.
    """
    m, n, _ = x.shape
    dev, dt = x.device, x.dtype
    b = int(block)
    s = min(int(passes), (n - 1) // b)  # at most N - 1 sum-zero directions exist
    if s < 3:
        raise ValueError(
            f"the Krylov path needs N - 1 >= 3 * block sum-zero directions, got N = {n} with"
            f" block = {b}; use method='dense' (or 'auto') for so few tokens"
        )
    d = s * b
    step = b * (2 // math.gcd(b, 2))  # whole blocks and an even count
    k = min(int(keep), d - b) // step * step
    noise = Noise(seed)  # a chain's start does not depend on its place in the batch

    value = torch.zeros(m, dtype=torch.float64, device=dev)
    eig = torch.zeros(m, dtype=torch.complex128, device=dev)
    resid = torch.full((m,), float("inf"), dtype=torch.float64, device=dev)
    conv = torch.zeros(m, dtype=torch.bool, device=dev)
    matvecs = torch.full((m,), b, dtype=torch.long, device=dev)

    active = torch.arange(m, device=dev)
    # the basis rows and their images live in two preallocated buffers (no concatenation)
    basis = torch.empty(m, d, n, dtype=dt, device=dev)
    images = torch.empty(m, d, n, dtype=dt, device=dev)
    basis[:, :b] = _orth_rows(noise.normal((m, b, n), dtype=dt, device=dev), None, noise)
    filled = b  # a cycle starts with the images of rows [filled - b, filled) to compute
    mats = x  # the active chains (gathered once per cycle in which some converged)
    for cycle in range(max_cycles):
        images[:, filled - b:filled] = torch.bmm(basis[:, filled - b:filled], mats)
        for lo in range(filled, d, b):
            basis[:, lo:lo + b] = _orth_rows(images[:, lo - b:lo], basis[:, :lo], noise)
            # assigned, not out=: bmm into a strided slice of images is 1.5x slower
            images[:, lo:lo + b] = torch.bmm(basis[:, lo:lo + b], mats)  # (Ma, b, N) @ (Ma, N, N)
        matvecs[active] += d - filled
        theta, vecs, r, prev_mod = _top_ritz(basis, images, d - b, tol)
        mod = theta[:, 0].abs()
        change = (mod - prev_mod).abs()
        done = (r <= tol) & (change <= tol)
        done |= mod <= 1e3 * torch.finfo(dt).eps  # the spectrum is numerically zero
        value[active], eig[active], resid[active], conv[active] = mod, theta[:, 0], r, done
        if bool(done.all()) or cycle == max_cycles - 1:
            break
        # index_select, not boolean indexing: the latter copies the chains 5x slower here
        left = (~done).nonzero().squeeze(-1)
        if left.numel() < active.numel():  # one copy per cycle, cheaper than products on all
            active = active[left]
            mats = mats.index_select(0, left)
            basis, images = basis.index_select(0, left), images.index_select(0, left)
            theta, vecs = theta.index_select(0, left), vecs.index_select(0, left)
        f = _orth_rows(images[:, d - b:], basis, noise)  # the next Krylov block
        ut = _restart_coefficients(theta, vecs, k).transpose(1, 2).to(dt)  # (Ma, k, d)
        start, start_img = torch.bmm(ut, basis), torch.bmm(ut, images)
        q, rr = torch.linalg.qr(start.transpose(1, 2))  # re-orthonormalise (rounding)
        basis[:, :k] = q.transpose(1, 2)
        images[:, :k] = torch.linalg.solve_triangular(rr.transpose(1, 2), start_img, upper=False)
        basis[:, k:k + b] = f  # its images: the next cycle's first product
        matvecs[active] += b
        filled = k + b
    return Lambda2Result(
        value=value, eigenvalue=eig, residual=resid, converged=conv, matvecs=matvecs,
        dense=torch.zeros(m, dtype=torch.bool, device=dev),
    )


# --------------------------------------------------------------------------------------
# head fusion
# --------------------------------------------------------------------------------------


def head_weights(
    lam2: Tensor,
    scheme: Literal["lambda2", "uniform", "softmax", "top_k"] = "lambda2",
    *,
    temperature: float = 0.1,
    k: int = 1,
) -> Tensor:
    """Head fusion weights from ``|lambda_2|`` per head (last dimension = heads).

    Schemes (all sum to 1 over heads):

    * ``"lambda2"`` (reference): ``w_h = |lambda_2,h| / sum_g |lambda_2,g|``;
    * ``"uniform"``: ``w_h = 1 / H``, the head mean baseline;
    * ``"softmax"``: ``softmax(|lambda_2| / temperature)``, sharper than proportional;
    * ``"top_k"``: uniform over the ``k`` heads with the largest ``|lambda_2|``.

    Args:
        lam2: ``(..., H)`` second eigenvalue moduli in ``[0, 1]``.
        scheme: one of the schemes above.
        temperature: for ``"softmax"``.
        k: for ``"top_k"``.

    Returns:
        ``(..., H)`` non-negative weights summing to 1.
    """
    lam2 = _as_compute(lam2)
    if lam2.dim() < 1 or lam2.shape[-1] < 1:
        raise ValueError(f"lam2 must have shape (..., H) with H >= 1, got {tuple(lam2.shape)}")
    if not bool(torch.isfinite(lam2).all()) or bool((lam2 < 0).any()):
        raise ValueError("lam2 must be finite and non-negative")
    h = lam2.shape[-1]
    if scheme == "uniform":
        return torch.full_like(lam2, 1.0 / h)
    if scheme == "lambda2":
        s = lam2.sum(-1, keepdim=True)
        uniform = torch.full_like(lam2, 1.0 / h)
        return torch.where(s > 0, lam2 / s.clamp_min(torch.finfo(lam2.dtype).tiny), uniform)
    if scheme == "softmax":
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        return torch.softmax(lam2 / temperature, dim=-1)
    if scheme == "top_k":
        if not 1 <= int(k) <= h:
            raise ValueError(f"k must be in [1, {h}], got {k}")
        idx = lam2.topk(int(k), dim=-1).indices
        return torch.zeros_like(lam2).scatter(-1, idx, 1.0 / int(k))
    raise ValueError(
        f"scheme must be 'lambda2', 'uniform', 'softmax' or 'top_k', got {scheme!r}"
    )


def fuse_heads(attn: Tensor, weights: Tensor, *, head_dim: int = -3) -> Tensor:
    """Weighted sum of heads: ``sum_h w_h A_h``, still row-stochastic if ``sum_h w_h = 1``.

    Args:
        attn: ``(..., H, N, N)`` per-head chains (heads at ``head_dim``, default ``-3``).
        weights: ``(..., H)`` weights (broadcast against the leading dims).

    Returns:
        ``(..., N, N)`` fused chain.
    """
    x = _as_compute(attn)
    x = x.movedim(head_dim, -3)
    w = _as_compute(weights).to(device=x.device, dtype=x.dtype)
    if w.shape[-1] != x.shape[-3]:
        raise ValueError(f"weights have {w.shape[-1]} heads, attention has {x.shape[-3]}")
    return torch.einsum("...hij,...h->...ij", x, w)  # no (..., H, N, N) temporary
