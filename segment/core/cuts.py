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

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from segment.core import markov

__all__ = [
    "Partition",
    "best_cut",
    "best_cuts",
    "cut_peak_bytes",
    "escape_probabilities",
    "key_affinity",
    "recursive_ncut",
    "reversibilise",
    "second_eigenvectors",
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
        pi: ``(..., n)`` its stationary distribution; ``None``: the exact one for chains of
            at most 256 tokens, the power iteration to the L1 residual ``1e-6`` above
            (:func:`segment.core.markov.stationary`).

    Returns:
        ``(..., n, n)`` symmetric, non-negative, summing to 1 per matrix (chain's dtype,
        float32 at least).
    """
    dtype = chain.dtype if chain.dtype == torch.float64 else torch.float32
    p = chain.to(dtype)
    pi = (markov.stationary(p) if pi is None else pi).to(p)
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


def second_eigenvectors(sym: Tensor) -> Tensor:
    """``(R, m)`` the eigenvector of the second largest eigenvalue of each symmetric
    ``(R, m, m)`` matrix (unit norm, sign arbitrary): one batched ``torch.linalg.eigh``."""
    return torch.linalg.eigh(sym)[1][..., -2]


def best_cuts(affinity: Tensor, size: Tensor,
              eigvec: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """The best two-way normalized cut of each of a batch of chains along its second eigenvector.

    The relaxed NCut is solved by the second eigenvector of ``P = D^-1 W``, i.e.
    ``D^-1/2 u`` with ``u`` the second largest eigenvector of the symmetric
    ``D^-1/2 W D^-1/2`` (in float32: the vector only orders the tokens; by ``eigvec``,
    :func:`second_eigenvectors` unless given); the split is the threshold of that vector
    (a *sweep*: every prefix of the sorted tokens) with the smallest exact NCut (float64).

    Chains of different sizes share the batch padded: chain ``r`` occupies the leading
    ``size[r]`` rows and columns of ``affinity[r]`` (the rest is ignored). A padded token is
    decoupled from the chain with eigenvalue ``-2`` in the symmetric matrix, below every
    eigenvalue of a chain (``[-1, 1]``), so it never enters the two largest eigenvectors,
    and it sorts after every real token in the sweep.

    Args:
        affinity: ``(R, m, m)`` symmetric, non-negative, every real row sum > 0.
        size: ``(R,)`` the number of real tokens of each chain, ``2 <= size[r] <= m``.
        eigvec: ``(R, m, m) float32 -> (R, m)`` the second largest eigenvector of each
            symmetric matrix (:func:`segment.backends.second_eigenvectors` chooses a library
            by device); ``None``: :func:`second_eigenvectors`.

    Returns:
        ``(ncut, side)``: ``(R,)`` float64 NCut of each best split (``esc(A) + esc(B)``, in
        ``[0, 2]``) and ``(R, m)`` bool, the tokens of one side (``False`` on padding).
    """
    r, m, _ = affinity.shape
    dev = affinity.device
    size = size.to(dev)
    if bool((size < 2).any()) or bool((size > m).any()):
        raise ValueError("a cut needs at least 2 tokens")
    real = torch.arange(m, device=dev)[None, :] < size[:, None]  # (R, m)
    both = real[:, :, None] & real[:, None, :]
    w = torch.where(both, affinity.to(torch.float64), 0.0)
    d = w.sum(-1)
    s = torch.where(real, d.clamp_min(1e-300).rsqrt(), 0.0)
    sym = (s[:, :, None] * w * s[:, None, :]).to(torch.float32)
    sym.diagonal(dim1=1, dim2=2).masked_fill_(~real, -2.0)  # padding: eigenvalue -2
    # the largest eigenvector is sqrt(d) / |sqrt(d)|; the second orders the tokens
    u = (second_eigenvectors if eigvec is None else eigvec)(sym)
    v = torch.where(real, u.to(device=dev, dtype=torch.float64) * s, float("inf"))
    order = torch.argsort(v, dim=1)  # padding last
    # W(S_k, S_k) of the prefixes S_k (the first k + 1 tokens of the order): with each
    # token's weight to the tokens before it, b_i = sum_{rank j < rank i} W_ij, and W
    # symmetric, W(S_k, S_k) = sum over the first k + 1 tokens of 2 b_i + W_ii (one masked
    # pass over W instead of permuting it and two running sums over it)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(m, device=dev).expand(r, m))
    earlier = rank[:, None, :] < rank[:, :, None]  # (R, m, m): token j comes before token i
    b = torch.where(earlier, w, 0.0).sum(-1)
    inside = (2 * b + w.diagonal(dim1=1, dim2=2)).gather(1, order).cumsum(1)
    vol = d.gather(1, order).cumsum(1)
    total = vol[:, -1:]
    cut = vol - inside
    ncut = cut / vol.clamp_min(1e-300) + cut / (total - vol).clamp_min(1e-300)
    # the whole set (and any prefix reaching into the padding) is no split
    ncut = ncut.masked_fill(torch.arange(m, device=dev)[None, :] >= (size[:, None] - 1),
                            float("inf"))
    j = ncut.argmin(1)
    side = torch.zeros(r, m, dtype=torch.bool, device=dev)
    side.scatter_(1, order, torch.arange(m, device=dev)[None, :] <= j[:, None])
    return ncut.gather(1, j[:, None])[:, 0], side


# bytes per entry of a padded (R, m, m) batch at the peak of best_cuts, the normalisation
# s W s: the input (4, float32), the padding mask (1), W in float64 (8) and the two float64
# products (2 x 8): 29; the sweep after it holds less (W, S in float32, a mask and one
# float64 pass: 26). eval/bench/cutmem.py: 1.00-1.05 of 29 at 2,304 and 4,096 tokens; 30
# leaves the rounding of the allocator a margin
CUT_BYTES_PER_ENTRY = 30


def cut_peak_bytes(m: int, regions: int = 1) -> int:
    """The predicted peak memory (bytes) of :func:`best_cuts` on ``regions`` chains padded to
    ``m`` tokens (the dense eigensolvers add their ``(m, m)`` workspace per matrix on top;
    the Krylov one ``O(m)`` per matrix)."""
    return CUT_BYTES_PER_ENTRY * int(regions) * int(m) ** 2


def _fitting(group: list, memory_limit: int | None) -> list[list]:
    """``group`` (regions of one padded size) in chunks whose :func:`best_cuts` fits
    ``memory_limit`` bytes; refuses a region that does not fit alone."""
    if memory_limit is None:
        return [group]
    m = max(len(idx) for _, idx in group)
    per = cut_peak_bytes(m)
    if per > memory_limit:
        raise MemoryError(
            f"recursive_ncut: one region of {m} tokens needs {per / 2**30:.2f} GiB to cut"
            f" (cut_peak_bytes), over the memory limit {memory_limit / 2**30:.2f} GiB:"
            f" batch_size=1 does not fit; use a smaller input or a device with more memory")
    k = max(1, int(memory_limit // per))
    return [group[i: i + k] for i in range(0, len(group), k)]


def best_cut(affinity: Tensor) -> tuple[float, Tensor]:
    """:func:`best_cuts` of one ``(m, m)`` chain: ``(ncut, (m,) bool side)``."""
    m = affinity.shape[0]
    if m < 2:
        raise ValueError("a cut needs at least 2 tokens")
    ncut, side = best_cuts(affinity[None], torch.tensor([m], device=affinity.device))
    return float(ncut[0]), side[0]


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


def recursive_ncut(affinity: Tensor, tau: float = 0.3, max_regions: int | None = None,
                   bucket: int = 64,
                   eigvec: Callable[[Tensor], Tensor] | None = None,
                   memory_limit: int | None = None) -> Partition:
    """Cut each image's chain in two while the best cut is crossed with probability < ``tau``.

    A region ``R`` is split into the two sides of :func:`best_cuts` of its own chain (``W``
    restricted to ``R``: the walk conditioned to stay in it) when their NCut, the sum of
    the two escape probabilities, is below ``tau``; the halves are split in turn. A region
    of one token, or whose best cut is crossed too often, stays whole. Whether a region is
    cut depends on that region alone, so the regions are cut level by level: every open
    region of every image at once, in batched eigensolves (regions of similar size padded
    to a common size, a multiple of ``bucket``), one host sync per level.

    Args:
        affinity: ``(B, n, n)`` symmetric non-negative ``W`` with positive row sums.
        tau: in ``(0, 2]``.
        max_regions: per image, stop splitting at this many regions, the largest regions
            cut first (``None``: no limit).
        bucket: the size granularity of the padded batches (compute, not results).
        eigvec: the eigensolver of :func:`best_cuts` (``None``: batched ``torch.linalg.eigh``).
        memory_limit: bytes the cuts of a level may use at once (``None``: no limit); a
            level whose padded batch would need more (:func:`cut_peak_bytes`) is cut in
            chunks that fit (same partition), and a region that does not fit alone raises
            :class:`MemoryError` (one image of ``n`` tokens needs ``cut_peak_bytes(n)``).

    Returns:
        :class:`Partition` (labels on ``affinity.device``; regions numbered in the reading
        order of their first token).
    """
    if affinity.dim() != 3 or affinity.shape[-1] != affinity.shape[-2]:
        raise ValueError(f"affinity must be (B, n, n), got {tuple(affinity.shape)}")
    if not 0 < float(tau) <= 2:
        raise ValueError(f"tau must lie in (0, 2], got {tau}")
    if bool((affinity < 0).any()):
        raise ValueError("affinity must be non-negative")
    b, n, _ = affinity.shape
    dev = affinity.device
    done: list[list[Tensor]] = [[] for _ in range(b)]
    todo: list[tuple[int, Tensor]] = [(i, torch.arange(n, device=dev)) for i in range(b)]
    self_loops = (affinity.diagonal(dim1=1, dim2=2) > 0).all(1).tolist()
    while todo:
        # one level: the open regions that can be cut, largest first (max_regions keeps them)
        todo.sort(key=lambda t: -len(t[1]))
        count = [len(d) for d in done]
        for i, _ in todo:
            count[i] += 1
        cand = []
        for i, idx in todo:
            if idx.numel() < 2 or (max_regions is not None and count[i] >= int(max_regions)):
                done[i].append(idx)
                continue
            # a token isolated inside the region: no spectral cut (with a positive diagonal,
            # as an attention chain's, no token can be)
            if not self_loops[i] and bool((affinity[i][idx[:, None], idx].sum(1) <= 0).any()):
                done[i].append(idx)
                continue
            count[i] += 1  # tentatively cut: the budget of the next regions
            cand.append((i, idx))
        todo = []
        groups: dict[int, list[tuple[int, Tensor]]] = {}
        for c in cand:
            groups.setdefault(-(-len(c[1]) // bucket), []).append(c)
        for group in [c for g in groups.values() for c in _fitting(g, memory_limit)]:
            m = max(len(idx) for _, idx in group)
            pad = torch.zeros(len(group), m, m, dtype=affinity.dtype, device=dev)
            for g, (i, idx) in enumerate(group):
                pad[g, : len(idx), : len(idx)] = affinity[i][idx[:, None], idx]
            sizes = torch.tensor([len(idx) for _, idx in group], device=dev)
            ncut, side = best_cuts(pad, sizes, eigvec)
            keep = (ncut < float(tau)).tolist()  # the level's host sync
            for g, (i, idx) in enumerate(group):
                if keep[g]:
                    one = side[g, : len(idx)]
                    todo += [(i, idx[one]), (i, idx[~one])]
                else:
                    done[i].append(idx)
    labels = torch.zeros(b, n, dtype=torch.long, device=dev)
    counts = []
    for i in range(b):
        regions = sorted(done[i], key=lambda t: int(t.min()))  # reading order of the first token
        for r, idx in enumerate(regions):
            labels[i, idx] = r
        counts.append(len(regions))
    counts_t = torch.tensor(counts, dtype=torch.long)
    esc = escape_probabilities(affinity, labels, int(counts_t.max()))
    return Partition(labels=labels, counts=counts_t,
                     escape=[esc[i, : counts[i]] for i in range(b)])
