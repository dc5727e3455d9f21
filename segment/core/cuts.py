"""Regions as metastable sets of a reversible chain: recursive normalized cuts (protocol §4c).

For a reversible chain ``P = D^-1 W`` (``W`` symmetric, ``D = diag(W 1)``, stationary
distribution ``pi = d / sum(d)``) the probability that the stationary walk leaves a set
``A`` in one step is its *escape probability*

    ``esc(A) = P(X_1 notin A | X_0 in A) = W(A, A^c) / vol(A)``,  ``vol(A) = sum_{i in A} d_i``,

and the normalized cut of a two-way split is ``NCut(A, B) = esc(A) + esc(B)`` (Meila and
Shi, AISTATS 2001). A region is *metastable* when the walk rarely leaves it. The partition
is built top-down: a region is cut in two along the best sweep cut of the second
eigenvector of its own (restricted) chain, and the cut is kept only while the walk crosses
it rarely, ``NCut < tau``; a region none of whose cuts satisfies this stays whole. ``tau``
is thus a probability with a meaning: the largest per-step chance that the walk, started
in one of the two halves, crosses into the other (summed over the two halves).

Two reversible chains are provided: the key-similarity chain
``W_ij = exp((cos(k_i, k_j) - 1) / T)`` of the tokens' keys with their mean over the
tokens removed (:func:`key_affinity`; DINOv2 keys share a large common component that
otherwise makes every pair alike), and any chain made reversible as
``W = (Pi P + P^T Pi) / 2`` with ``pi`` its stationary distribution (:func:`reversibilise`).

Pure functions over tensors (torch and numpy only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from segment.core import markov

__all__ = [
    "Partition",
    "best_cut",
    "escape_probabilities",
    "key_affinity",
    "recursive_ncut",
    "reversibilise",
]


def key_affinity(keys: Tensor, temperature: float = 0.2, center: bool = True) -> Tensor:
    """The symmetric affinity of the key-similarity chain.

    Args:
        keys: ``(B, H, n, D)`` per-head keys of the grid tokens (heads are concatenated).
        temperature: ``T > 0``; ``W_ij = exp((cos_ij - 1) / T)`` lies in ``(0, 1]``.
        center: remove the keys' mean over the tokens of each image first.

    Returns:
        ``(B, n, n)`` symmetric positive affinity (float32 unless ``keys`` is float64).
    """
    if keys.dim() != 4:
        raise ValueError(f"keys must be (B, H, n, D), got {tuple(keys.shape)}")
    if not float(temperature) > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    dtype = torch.float64 if keys.dtype == torch.float64 else torch.float32
    k = keys.to(dtype).transpose(1, 2).flatten(2)  # (B, n, H*D)
    if center:
        k = k - k.mean(1, keepdim=True)
    k = F.normalize(k, dim=-1)
    cos = torch.bmm(k, k.transpose(1, 2)).clamp_(-1.0, 1.0)
    return cos.sub_(1.0).div_(float(temperature)).exp_()


def reversibilise(chain: Tensor, pi: Tensor | None = None) -> Tensor:
    """``W = (Pi P + P^T Pi) / 2``: the symmetric flow of a chain's reversible part.

    ``P_rev = D^-1 W`` (``D = diag(W 1) = Pi``) is reversible and has the same stationary
    distribution ``pi`` as ``P``; ``W_ij`` is the stationary probability of seeing the
    step ``i -> j`` or ``j -> i`` (each counted half).

    Args:
        chain: ``(..., n, n)`` row-stochastic.
        pi: ``(..., n)`` its stationary distribution; ``None``: the exact one
            (:func:`segment.core.markov.exact_stationary`).

    Returns:
        ``(..., n, n)`` symmetric, non-negative, summing to 1 per matrix (chain's dtype,
        float32 at least).
    """
    dtype = chain.dtype if chain.dtype == torch.float64 else torch.float32
    p = chain.to(dtype)
    pi = (markov.exact_stationary(p) if pi is None else pi).to(p)
    flow = pi.unsqueeze(-1) * p  # (..., n, n) Pi P
    return (flow + flow.transpose(-1, -2)) / 2


def escape_probabilities(affinity: Tensor, labels: Tensor, num: int | None = None) -> Tensor:
    """Per region, the probability that the stationary walk leaves it in one step.

    Args:
        affinity: ``(B, n, n)`` symmetric ``W`` (the chain ``D^-1 W``).
        labels: ``(B, n)`` region ids in ``[0, K)``.
        num: ``K``; ``None`` = ``labels.max() + 1``.

    Returns:
        ``(B, K)`` ``W(A, A^c) / vol(A)`` (NaN for ids an image does not use).
    """
    k = int(labels.max()) + 1 if num is None else int(num)
    w = affinity.to(torch.float64)
    one = F.one_hot(labels.long(), k).to(w)  # (B, n, K)
    flow = one.transpose(1, 2) @ w @ one  # (B, K, K) W(A_a, A_b)
    vol = flow.sum(-1)
    stay = flow.diagonal(dim1=1, dim2=2)
    return ((vol - stay) / vol).to(torch.float32)


def best_cut(affinity: Tensor) -> tuple[float, Tensor]:
    """The best two-way normalized cut of one chain along its second eigenvector.

    The relaxed NCut is solved by the second eigenvector of ``P = D^-1 W``, i.e.
    ``D^-1/2 u`` with ``u`` the second largest eigenvector of the symmetric
    ``D^-1/2 W D^-1/2`` (``torch.linalg.eigh`` in float32: it only orders the tokens); the
    split is the threshold of that vector (a *sweep*: every prefix of the sorted tokens)
    with the smallest exact NCut.

    Args:
        affinity: ``(m, m)`` symmetric, non-negative, every row sum > 0, ``m >= 2``.

    Returns:
        ``(ncut, side)``: the NCut of the best split (``esc(A) + esc(B)``, in ``[0, 2]``)
        and ``(m,)`` bool, the tokens of one side.
    """
    m = affinity.shape[0]
    if m < 2:
        raise ValueError("a cut needs at least 2 tokens")
    w = affinity.to(torch.float64)
    d = w.sum(1)
    s = d.rsqrt()
    # the eigenvector only orders the tokens (the cut itself is scored exactly in float64
    # below): float32 is enough for it and is the fast path of every device
    sym = (s[:, None] * w * s[None, :]).to(torch.float32)
    _, vecs = torch.linalg.eigh(sym)  # ascending: the last is sqrt(d) / |sqrt(d)|
    v = vecs[:, -2].to(torch.float64) * s
    order = torch.argsort(v)
    wp = w[order][:, order]
    inside = wp.cumsum(0).cumsum(1).diagonal()  # W(S_k, S_k) for the prefixes S_k
    vol = d[order].cumsum(0)
    total = vol[-1]
    cut = vol - inside
    ncut = cut / vol + cut / (total - vol).clamp_min(1e-300)
    ncut[-1] = float("inf")  # the whole set is no split
    j = int(torch.argmin(ncut))
    side = torch.zeros(m, dtype=torch.bool, device=affinity.device)
    side[order[: j + 1]] = True
    return float(ncut[j]), side


@dataclass
class Partition:
    """A partition of each image's tokens into metastable regions.

    Attributes:
        labels: ``(B, n)`` region ids ``0 .. K_b - 1`` per image.
        counts: ``(B,)`` the number of regions ``K_b``.
        escape: per image, ``(K_b,)`` each region's escape probability on the whole chain.
    """

    labels: Tensor
    counts: Tensor
    escape: list[Tensor]


def recursive_ncut(affinity: Tensor, tau: float = 0.3, max_regions: int | None = None
                   ) -> Partition:
    """Cut each image's chain in two while the best cut is crossed with probability < ``tau``.

    A region ``R`` is split into the two sides of :func:`best_cut` of its own chain (``W``
    restricted to ``R``: the walk conditioned to stay in it) when their NCut, the sum of
    the two escape probabilities, is below ``tau``; the halves are split in turn, largest
    first. A region of one token, or whose best cut is crossed too often, stays whole.

    Args:
        affinity: ``(B, n, n)`` symmetric non-negative ``W`` with positive row sums.
        tau: in ``(0, 2]``.
        max_regions: stop splitting at this many regions (``None``: no limit).

    Returns:
        :class:`Partition` (labels on ``affinity.device``; regions numbered in the order
        they were completed, then by size).
    """
    if affinity.dim() != 3 or affinity.shape[-1] != affinity.shape[-2]:
        raise ValueError(f"affinity must be (B, n, n), got {tuple(affinity.shape)}")
    if not 0 < float(tau) <= 2:
        raise ValueError(f"tau must lie in (0, 2], got {tau}")
    if bool((affinity < 0).any()):
        raise ValueError("affinity must be non-negative")
    b, n, _ = affinity.shape
    labels = torch.zeros(b, n, dtype=torch.long, device=affinity.device)
    counts = []
    for i in range(b):
        w = affinity[i]
        done: list[Tensor] = []
        todo = [torch.arange(n, device=w.device)]
        while todo:
            if max_regions is not None and len(done) + len(todo) >= int(max_regions):
                done += todo
                break
            todo.sort(key=len)
            idx = todo.pop()  # the largest open region first
            if idx.numel() < 2:
                done.append(idx)
                continue
            sub = w[idx][:, idx]
            if bool((sub.sum(1) <= 0).any()):  # a token isolated inside: no spectral cut
                done.append(idx)
                continue
            ncut, side = best_cut(sub)
            if ncut < float(tau):
                todo += [idx[side], idx[~side]]
            else:
                done.append(idx)
        done.sort(key=lambda t: int(t.min()))  # ids in reading order of the first token
        for r, idx in enumerate(done):
            labels[i, idx] = r
        counts.append(len(done))
    counts_t = torch.tensor(counts, dtype=torch.long)
    esc = escape_probabilities(affinity, labels, int(counts_t.max()))
    return Partition(labels=labels, counts=counts_t,
                     escape=[esc[i, : counts[i]] for i in range(b)])
