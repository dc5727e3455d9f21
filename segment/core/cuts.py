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
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from segment.core import markov
from segment.core.hierarchy import Hierarchy

__all__ = [
    "EigenSolver",
    "Partition",
    "best_cut",
    "best_cuts",
    "cut_tree",
    "cut_peak_bytes",
    "escape_probabilities",
    "key_affinity",
    "recursive_ncut",
    "reversibilise",
    "second_eigenvectors",
]

EigenSolver = Callable[..., Tensor]
"""``eigvec(sym, size=size) -> (R, m)``: the second largest eigenvector of each symmetric
``(R, m, m)`` matrix whose leading ``size[r]`` rows are real (the rest padding, decoupled
with a lower eigenvalue)."""


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
    return (flow + flow.transpose(-1, -2)).div_(2)


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


def second_eigenvectors(sym: Tensor, size: Tensor | None = None) -> Tensor:
    """``(R, m)`` the eigenvector of the second largest eigenvalue of each symmetric
    ``(R, m, m)`` matrix (unit norm, sign arbitrary): one batched ``torch.linalg.eigh``
    of the padded matrices (``size``, the real rows, is not needed: the padding's
    eigenvalue lies below the two largest)."""
    return torch.linalg.eigh(sym)[1][..., -2]


def best_cuts(affinity: Tensor, size: Tensor,
              eigvec: EigenSolver | None = None) -> tuple[Tensor, Tensor]:
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
        eigvec: ``eigvec(sym, size=size)``, ``(R, m, m) float32, (R,) -> (R, m)``: the
            second largest eigenvector of each symmetric matrix whose leading ``size[r]``
            rows are real (:func:`segment.backends.second_eigenvectors` chooses a library
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
    w = affinity.to(torch.float64, memory_format=torch.contiguous_format)
    if bool((size < m).any()):  # the padding zeroed (out of place: w may be the input)
        real = torch.arange(m, device=dev)[None, :] < size[:, None]
        w = torch.where(real[:, :, None] & real[:, None, :], w, 0.0)
    return _sweep_cuts(w, size, eigvec)


def _sweep_cuts(w: Tensor, size: Tensor, eigvec: EigenSolver | None
                ) -> tuple[Tensor, Tensor]:
    """:func:`best_cuts` of ``w``: ``(R, m, m)`` contiguous float64, zero outside each chain's
    leading ``size[r]`` block (what :func:`_cut_levels` builds); ``w`` is not changed.

    The float64 passes over the ``m x m`` entries: the degrees, the normalisation
    ``s W s`` (one float64 buffer, multiplied in place, then rounded to float32 for the
    eigensolver) and the sweep's masked pass (into the same buffer): no other ``(R, m, m)``
    float64 temporary."""
    r, m, _ = w.shape
    dev = w.device
    real = torch.arange(m, device=dev)[None, :] < size[:, None]  # (R, m)
    d = w.sum(-1)
    s = torch.where(real, d.clamp_min(1e-300).rsqrt(), 0.0)
    buf = torch.mul(s[:, :, None], w)
    sym = buf.mul_(s[:, None, :]).to(torch.float32)
    sym.diagonal(dim1=1, dim2=2).masked_fill_(~real, -2.0)  # padding: eigenvalue -2
    # the largest eigenvector is sqrt(d) / |sqrt(d)|; the second orders the tokens
    u = (second_eigenvectors if eigvec is None else eigvec)(sym, size=size)
    del sym
    v = torch.where(real, u.to(device=dev, dtype=torch.float64) * s, float("inf"))
    order = torch.argsort(v, dim=1)  # padding last
    # W(S_k, S_k) of the prefixes S_k (the first k + 1 tokens of the order): with each
    # token's weight to the tokens before it, b_i = sum_{rank j < rank i} W_ij, and W
    # symmetric, W(S_k, S_k) = sum over the first k + 1 tokens of 2 b_i + W_ii (one masked
    # pass over W instead of permuting it and two running sums over it)
    rank = torch.empty(r, m, dtype=torch.int32, device=dev).scatter_(
        1, order, torch.arange(m, dtype=torch.int32, device=dev).expand(r, m))
    earlier = rank[:, None, :] < rank[:, :, None]  # (R, m, m): token j comes before token i
    b = torch.where(earlier, w, w.new_zeros(()), out=buf).sum(-1)
    del buf, earlier
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


# bytes per entry of a padded (R, m, m) batch at the peak of the cuts, the normalisation
# s W s: the padded chains in float64 (8), the float64 buffer of s W s (8) and its float32
# copy for the eigensolver (4): 20; the sweep after it holds less (the chains, the buffer
# reused by the masked pass and its mask: 17). eval/bench/cutmem.py (2026-12-07): 18.0-21.8
# measured at 2,304 and 4,096 tokens (the Lanczos workspace and the allocator on top); 23
# leaves a margin. At 1,024 tokens the fixed workspace makes it 24.5-26 (a few MiB in all)
CUT_BYTES_PER_ENTRY = 23


def cut_peak_bytes(m: int, regions: int = 1) -> int:
    """The predicted peak memory (bytes) of one batch of the recursive cuts
    (:func:`recursive_ncut`, :func:`cut_tree`) of ``regions`` chains padded to ``m`` tokens,
    above the image's ``W`` (the dense eigensolvers add their ``(m, m)`` workspace per matrix on top;
    the Krylov one ``O(m)`` per matrix)."""
    return CUT_BYTES_PER_ENTRY * int(regions) * int(m) ** 2


def _fitting(group: list[_Open], memory_limit: int | None) -> list[list[_Open]]:
    """``group`` (regions of one padded size) in chunks whose :func:`best_cuts` fits
    ``memory_limit`` bytes; refuses a region that does not fit alone."""
    if memory_limit is None:
        return [group]
    m = max(len(c.tokens) for c in group)
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


class _Open(NamedTuple):
    """A region open for cutting at the current level: its image, its tokens, the batch it
    joins (regions of one ``batch`` value and size bucket share the eigensolves) and the
    caller's handle (the tree's node id)."""

    image: int
    tokens: Tensor
    batch: bool = True
    node: int = -1


def _isolated(affinity: Tensor, image: int, tokens: Tensor) -> bool:
    """Whether a token of the region has no weight inside it (its chain has no spectral cut)."""
    return bool((affinity[image][tokens[:, None], tokens].sum(1) <= 0).any())


def _cut_levels(affinity: Tensor, todo: list[_Open], bucket: int,
                eigvec: EigenSolver | None,
                select: Callable[[list[_Open]], list[_Open]],
                settle: Callable[[_Open, float, Tensor], list[_Open]],
                memory_limit: int | None = None) -> None:
    """The level loop of the recursive cuts (:func:`recursive_ncut`, :func:`cut_tree`).

    ``todo`` holds the open regions of the first level. Per level, ``select`` is given the
    open regions, largest first, and returns those to cut (it keeps the others); they are
    cut in batched
    :func:`best_cuts`, one padded batch per (``_Open.batch``, size bucket), and
    ``settle(region, ncut, side)`` is given each region's best split (float64 NCut, ``(m,)``
    bool side over ``region.tokens``) and returns the regions open at the next level. A
    batch that would need more than ``memory_limit`` bytes is cut in chunks (:func:`_fitting`).
    """
    dev = affinity.device
    n = affinity.shape[-1]
    while todo:
        todo.sort(key=lambda t: -len(t.tokens))
        cand = select(todo)
        todo = []
        groups: dict[tuple[bool, int], list[_Open]] = {}
        for c in cand:
            groups.setdefault((c.batch, -(-len(c.tokens) // bucket)), []).append(c)
        for group in [part for g in groups.values() for part in _fitting(g, memory_limit)]:
            m = max(len(c.tokens) for c in group)
            # the regions' chains in float64, zero-padded (what the sweep reads); a whole
            # image is its W as it is, no gather
            pad = torch.empty(len(group), m, m, dtype=torch.float64, device=dev)
            for g, c in enumerate(group):
                k = len(c.tokens)
                pad[g, :k, :k] = (affinity[c.image] if k == n else
                                  affinity[c.image][c.tokens[:, None], c.tokens])
                pad[g, :k, k:] = 0
                pad[g, k:] = 0
            sizes = torch.tensor([len(c.tokens) for c in group], device=dev)
            ncut, side = _sweep_cuts(pad, sizes, eigvec)
            values = ncut.tolist()  # the batch's host sync
            for g, c in enumerate(group):
                todo += settle(c, values[g], side[g, : len(c.tokens)])


def _check_affinity(affinity: Tensor) -> None:
    if affinity.dim() != 3 or affinity.shape[-1] != affinity.shape[-2]:
        raise ValueError(f"affinity must be (B, n, n), got {tuple(affinity.shape)}")
    if bool((affinity < 0).any()):
        raise ValueError("affinity must be non-negative")


def recursive_ncut(affinity: Tensor, tau: float = 0.3, max_regions: int | None = None,
                   bucket: int = 64,
                   eigvec: EigenSolver | None = None,
                   memory_limit: int | None = None) -> Partition:
    """Cut each image's chain in two while the best cut is crossed with probability < ``tau``.

    A region ``R`` is split into the two sides of :func:`best_cuts` of its own chain (``W``
    restricted to ``R``: the walk conditioned to stay in it) when their NCut, the sum of
    the two escape probabilities, is below ``tau``; the halves are split in turn. A region
    of one token, or whose best cut is crossed too often, stays whole. Whether a region is
    cut depends on that region alone, so the regions are cut level by level: every open
    region of every image at once, in batched eigensolves (regions of similar size padded
    to a common size, a multiple of ``bucket``), one host sync per batch.
    :func:`cut_tree` keeps cutting past ``tau`` and gives every level at once.

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
    _check_affinity(affinity)
    if not 0 < float(tau) <= 2:
        raise ValueError(f"tau must lie in (0, 2], got {tau}")
    b, n, _ = affinity.shape
    dev = affinity.device
    done: list[list[Tensor]] = [[] for _ in range(b)]
    self_loops = (affinity.diagonal(dim1=1, dim2=2) > 0).all(1).tolist()

    def select(todo: list[_Open]) -> list[_Open]:
        # the open regions that can be cut, largest first (max_regions keeps them)
        count = [len(d) for d in done]
        for c in todo:
            count[c.image] += 1
        cand = []
        for c in todo:
            full = max_regions is not None and count[c.image] >= int(max_regions)
            if len(c.tokens) < 2 or full:
                done[c.image].append(c.tokens)
                continue
            # a token isolated inside the region: no spectral cut (with a positive diagonal,
            # as an attention chain's, no token can be)
            if not self_loops[c.image] and _isolated(affinity, c.image, c.tokens):
                done[c.image].append(c.tokens)
                continue
            count[c.image] += 1  # tentatively cut: the budget of the next regions
            cand.append(c)
        return cand

    def settle(c: _Open, ncut: float, side: Tensor) -> list[_Open]:
        if ncut < float(tau):
            return [_Open(c.image, c.tokens[side]), _Open(c.image, c.tokens[~side])]
        done[c.image].append(c.tokens)
        return []

    roots = [_Open(i, torch.arange(n, device=dev)) for i in range(b)]
    _cut_levels(affinity, roots, bucket, eigvec, select, settle, memory_limit)
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


def cut_tree(affinity: Tensor, min_tokens: int = 24, tau: float | None = None,
             bucket: int = 64,
             eigvec: EigenSolver | None = None,
             memory_limit: int | None = None) -> list[Hierarchy]:
    """The tree of the recursive cuts: every region cut along its best split, down to a floor.

    The cuts of :func:`recursive_ncut` with no threshold: every region of at least
    ``min_tokens`` tokens is split into the two sides of :func:`best_cuts` of its own chain,
    whatever the NCut of that split, and each split is recorded with its NCut (float64).
    A split's *height* is the largest NCut on its path from the root (monotone: never below
    its parent's), so :meth:`Hierarchy.labels_at` ``(t)``, which keeps the splits of height
    below ``t``, keeps exactly the splits :func:`recursive_ncut` ``(affinity, t)`` keeps
    (every split on the path below ``t``) wherever the floor does not bind, and its levels
    nest (:class:`segment.core.hierarchy.Hierarchy`).

    Same level loop and batches as :func:`recursive_ncut`. With ``tau`` given, the regions
    of :func:`recursive_ncut` ``(affinity, tau)`` (those whose path from the root has every
    NCut below ``tau``) are cut whatever their size and in batches of their own (the same
    padded eigensolves as :func:`recursive_ncut`), so ``labels_at(tau)`` is its partition
    exactly, floor or not; the floor binds past ``tau`` only.

    Args:
        affinity: ``(B, n, n)`` symmetric non-negative ``W`` with positive row sums.
        min_tokens: the floor: a region of fewer tokens is not cut (a leaf), ``>= 2``; the
            default 24 (about a tenth of the 16 x 16 grid at 224 px: 34 leaves per ecssd-dev
            image) keeps the region stage with the pixel stage run on the leaves under half
            the backbone forward at 224 px (docs/benchmarks.md, "The tree of escape cuts").
        tau: ``None``, or in ``(0, 2]``: the level kept exact (the method's ``escape``).
        bucket: the size granularity of the padded batches (compute, not results).
        eigvec: the eigensolver of :func:`best_cuts` (``None``: batched ``torch.linalg.eigh``).
        memory_limit: bytes the cuts of a level may use at once, as in :func:`recursive_ncut`.

    Returns:
        per image, its :class:`segment.core.hierarchy.Hierarchy` (leaves on
        ``affinity.device``, tables on the CPU).
    """
    _check_affinity(affinity)
    if isinstance(min_tokens, bool) or int(min_tokens) != min_tokens or int(min_tokens) < 2:
        raise ValueError(f"min_tokens must be an integer >= 2, got {min_tokens!r}")
    if tau is not None and not 0 < float(tau) <= 2:
        raise ValueError(f"tau must lie in (0, 2] or be None, got {tau}")
    b, n, _ = affinity.shape
    self_loops = (affinity.diagonal(dim1=1, dim2=2) > 0).all(1).tolist()
    # per image, its nodes: tokens, parent node, NCut of its split (None: a leaf)
    tokens: list[list[Tensor]] = [[torch.arange(n, device=affinity.device)] for _ in range(b)]
    parent: list[list[int]] = [[-1] for _ in range(b)]
    ncuts: list[list[float | None]] = [[None] for _ in range(b)]

    def select(todo: list[_Open]) -> list[_Open]:
        cand = []
        for c in todo:
            if len(c.tokens) < 2 or (not c.batch and len(c.tokens) < int(min_tokens)):
                continue
            if not self_loops[c.image] and _isolated(affinity, c.image, c.tokens):
                continue
            cand.append(c)
        return cand

    def settle(c: _Open, ncut: float, side: Tensor) -> list[_Open]:
        ncuts[c.image][c.node] = ncut
        inside = c.batch and ncut < float(tau)  # type: ignore[arg-type]
        out = []
        for part in (c.tokens[side], c.tokens[~side]):
            tokens[c.image].append(part)
            parent[c.image].append(c.node)
            ncuts[c.image].append(None)
            out.append(_Open(c.image, part, inside, len(tokens[c.image]) - 1))
        return out

    roots = [_Open(i, tokens[i][0], tau is not None, 0) for i in range(b)]
    _cut_levels(affinity, roots, bucket, eigvec, select, settle, memory_limit)
    return [Hierarchy.from_splits(tokens[i], parent[i], ncuts[i], affinity[i])
            for i in range(b)]
