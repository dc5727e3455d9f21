"""The second eigenvector of a batch of symmetric matrices by a matrix-free Krylov method.

A cut (:func:`segment.core.cuts.best_cuts`) needs one vector of the symmetric normalized
affinity ``S = D^-1/2 W D^-1/2``: the eigenvector of its second largest eigenvalue, and
only the order of its entries (the sweep that places the cut then runs exactly, in
float64). A dense eigendecomposition costs ``O(m^3)`` per region; a Lanczos iteration
costs one matrix-vector product, ``O(m^2)``, per step and stops once the vector is
accurate enough.

:func:`second_eigenvectors` runs a thick-restarted Lanczos iteration (Krylov-Schur for
symmetric matrices) on every matrix of the batch at once: each step is one
matrix-vector product per matrix (:func:`segment.core.markov.row_times`) plus a full re-orthogonalisation against the basis
(classical Gram-Schmidt, twice); at the end of a cycle the Rayleigh-Ritz matrix of the
basis is diagonalised in float64, and a matrix is done when the residual of its second
Ritz pair, ``|S y - theta y|`` (``|y| = 1``), is at most ``tol``. The others restart from
their ``keep`` leading Ritz vectors plus the next Krylov vector (whose span contains every
Ritz residual, so the restarted basis is again a Krylov basis and nothing the cycle learnt
about the leading eigenvectors is lost); converged matrices leave the batch.

What the tolerance buys: by Davis-Kahan, the angle between the Ritz vector and the exact
eigenvector is at most ``residual / gap`` (``gap``: the distance from ``theta`` to the
rest of the spectrum). The vector only orders the tokens for the exact sweep, so an error
far below the spacing of the entries around the best cut leaves the cut unchanged; where
``lambda_2`` and ``lambda_3`` nearly coincide the eigenvector itself is ill-determined
(the dense solver's float32 rounding moves it as well) and two solvers may cut
differently, with nearly equal normalized cuts (``eval/bench/krylov_check.py`` counts
those cases on the dev images).

Pure torch (CPU or CUDA, the input's device); no dense inverse or full decomposition of the
``m x m`` matrices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from segment.core.markov import row_times
from segment.core.noise import Noise

__all__ = ["KrylovInfo", "second_eigenvectors"]

TOL = 1e-3  # the default residual tolerance (eval/bench/krylov_check.py: same partitions)


@dataclass
class KrylovInfo:
    """How the iteration went, per matrix.

    Attributes:
        value: ``(R,)`` the second largest Ritz value (float64).
        residual: ``(R,)`` ``|S y - theta y|`` of the returned unit vector (float64).
        matvecs: ``(R,)`` matrix-vector products spent.
        converged: ``(R,)`` whether the residual met ``tol`` within ``max_cycles``.
    """

    value: Tensor
    residual: Tensor
    matvecs: Tensor
    converged: Tensor


def _orth(v: Tensor, basis: Tensor, fresh: Tensor) -> Tensor:
    """Unit rows ``(R, 1, m)`` spanning ``v`` minus its part in ``basis`` (R, j, m), by
    classical Gram-Schmidt twice; a row that lies in the span of ``basis`` (the Krylov space
    became invariant) is replaced by ``fresh`` (R, 1, m, random) orthogonalised the same
    way. No host synchronisation."""
    bt = basis.transpose(1, 2)

    def project(x: Tensor) -> Tensor:
        x = torch.baddbmm(x, torch.bmm(x, bt), basis, alpha=-1)
        return torch.baddbmm(x, torch.bmm(x, bt), basis, alpha=-1)

    before = torch.linalg.vector_norm(v, dim=-1, keepdim=True)
    p = project(v)
    after = torch.linalg.vector_norm(p, dim=-1, keepdim=True)
    lost = after <= 100 * torch.finfo(v.dtype).eps * before.clamp_min(torch.finfo(v.dtype).tiny)
    q = project(fresh)
    q = q / torch.linalg.vector_norm(q, dim=-1, keepdim=True).clamp_min(torch.finfo(v.dtype).tiny)
    return torch.where(lost, q, p / after.clamp_min(torch.finfo(v.dtype).tiny))


def second_eigenvectors(
    sym: Tensor,
    *,
    size: Tensor | None = None,
    tol: float = TOL,
    start: Tensor | None = None,
    steps: int = 16,
    keep: int = 6,
    max_cycles: int = 100,
    seed: int = 0,
    return_info: bool = False,
) -> Tensor | tuple[Tensor, KrylovInfo]:
    """``(R, m)`` the eigenvector of the second largest eigenvalue of each symmetric matrix.

    Args:
        sym: ``(R, m, m)`` symmetric float32 or float64 (computed in its dtype), ``m >= 2``.
        size: ``(R,)`` the real rows of each matrix, the rest being padding decoupled from
            them (what :func:`segment.core.cuts.best_cuts` builds); the iteration never
            leaves the leading ``size[r]`` coordinates (the start and the fresh directions
            are zero on the padding), so a matrix gets the same vector whatever it is padded
            to, up to rounding. ``None``: every row is real.
        tol: stop a matrix when the residual ``|S y - theta y|`` of its unit second Ritz
            vector is at most this (the matrices of the cuts have spectra in ``[-2, 1]``, so
            it is relative to ``|S| <= 2``).
        start: ``(R, m)`` a start vector per matrix (e.g. the parent region's eigenvector
            restricted to the region; zeros are fine where nothing is known); ``None``: a
            random one (``seed``). A random perturbation of relative size ``1e-3`` is
            added, so that a start orthogonal to an eigenvector does not miss it. The random
            vectors depend on a coordinate's index only (:class:`segment.core.noise.Noise`),
            not on the matrix's place in the batch.
        steps: the basis size of a cycle (at most ``m``, and at most the smallest
            ``size``: a matrix whose real rows the basis spans is solved exactly).
        keep: Ritz vectors kept at a restart, ``2 <= keep < steps``.
        max_cycles: restart cycles before giving up (the vector of the last cycle is
            returned, ``converged`` false).
        seed: seed of the random start and of the fresh directions (deterministic).
        return_info: also return a :class:`KrylovInfo`.

    Returns:
        ``(R, m)`` unit vectors (sign arbitrary) in ``sym``'s dtype and device, and the
        :class:`KrylovInfo` with ``return_info``.
    """
    if sym.dim() != 3 or sym.shape[-1] != sym.shape[-2] or sym.shape[-1] < 2:
        raise ValueError(f"sym must be (R, m, m) with m >= 2, got {tuple(sym.shape)}")
    if not float(tol) > 0:
        raise ValueError(f"tol must be > 0, got {tol}")
    if not 2 <= int(keep) < int(steps):
        raise ValueError(f"need 2 <= keep < steps, got keep={keep}, steps={steps}")
    if max_cycles < 1:
        raise ValueError(f"max_cycles must be >= 1, got {max_cycles}")
    r, m, _ = sym.shape
    dev = sym.device
    dt = sym.dtype if sym.dtype == torch.float64 else torch.float32
    mats = sym.to(dt)
    real_rows = torch.full((r,), m, device=dev) if size is None else size.to(dev)
    if real_rows.shape != (r,) or bool((real_rows < 2).any()) or bool((real_rows > m).any()):
        raise ValueError(f"size must be (R,) = ({r},) with 2 <= size <= m = {m}")
    d = min(int(steps), int(real_rows.min()))
    k = min(int(keep), d - 1)
    real = (torch.arange(m, device=dev)[None, :] < real_rows[:, None]).to(dt)[:, None, :]
    noise = Noise(seed).normal((r, d + 1, m), dtype=dt, device=dev) * real  # start + fresh
    if start is None:
        v0 = noise[:, :1]
    else:
        if start.shape != (r, m):
            raise ValueError(f"start must be (R, m) = {(r, m)}, got {tuple(start.shape)}")
        s = start.to(device=dev, dtype=dt)[:, None, :] * real
        s = s / torch.linalg.vector_norm(s, dim=-1, keepdim=True).clamp_min(1e-30)
        v0 = s + 1e-3 * noise[:, :1] / real_rows.to(dt).sqrt()[:, None, None]
    vec = torch.zeros(r, m, dtype=dt, device=dev)
    value = torch.zeros(r, dtype=torch.float64, device=dev)
    resid = torch.full((r,), float("inf"), dtype=torch.float64, device=dev)
    conv = torch.zeros(r, dtype=torch.bool, device=dev)
    matvecs = torch.zeros(r, dtype=torch.long, device=dev)

    active = torch.arange(r, device=dev)
    basis = torch.empty(r, d, m, dtype=dt, device=dev)
    images = torch.empty(r, d, m, dtype=dt, device=dev)
    basis[:, :1] = v0 / torch.linalg.vector_norm(v0, dim=-1, keepdim=True)
    filled = 0  # rows [filled, d) of basis get their images (and their successors) this cycle
    fresh = noise[:, 1:]
    for cycle in range(max_cycles):
        images[:, filled] = row_times(basis[:, filled], mats)
        for j in range(filled + 1, d):
            basis[:, j:j + 1] = _orth(images[:, j - 1:j], basis[:, :j], fresh[:, j:j + 1])
            images[:, j] = row_times(basis[:, j], mats)
        matvecs[active] += d - filled
        # Rayleigh-Ritz: H = V (S V^T), symmetric up to rounding; eigenvalues ascending
        h = torch.bmm(basis, images.transpose(1, 2)).double()
        theta, c = torch.linalg.eigh((h + h.transpose(1, 2)) / 2)
        theta, c = theta.flip(-1), c.flip(-1)  # descending
        c2 = c[:, :, 1:2].transpose(1, 2).to(dt)  # (Ra, 1, d) the second Ritz pair
        y = torch.bmm(c2, basis)
        ry = torch.bmm(c2, images) - theta[:, 1, None, None].to(dt) * y
        ny = torch.linalg.vector_norm(y, dim=-1)[:, 0]
        res = torch.linalg.vector_norm(ry, dim=-1)[:, 0].double() / ny.double()
        done = res <= float(tol)
        # a basis that spans a matrix's real rows: its Ritz pairs are the eigenpairs
        done = done | (real_rows[active] == d)
        vec[active] = (y[:, 0] / ny[:, None])
        value[active], resid[active], conv[active] = theta[:, 1], res, done
        if bool(done.all()) or cycle == max_cycles - 1:
            break
        left = (~done).nonzero().squeeze(-1)
        if left.numel() < active.numel():
            active = active[left]
            mats, fresh = mats.index_select(0, left), fresh.index_select(0, left)
            basis, images = basis.index_select(0, left), images.index_select(0, left)
            c = c.index_select(0, left)
        # thick restart: the k leading Ritz vectors and their images (no product), then the
        # next Krylov vector (the last image orthogonalised against the whole basis)
        f = _orth(images[:, d - 1:], basis, fresh[:, :1])
        ck = c[:, :, :k].transpose(1, 2).to(dt)  # (Ra, k, d), orthonormal rows
        basis[:, :k], images[:, :k] = torch.bmm(ck, basis), torch.bmm(ck, images)
        basis[:, k:k + 1] = f
        filled = k
    vec = vec.to(sym.dtype)
    if not return_info:
        return vec
    return vec, KrylovInfo(value=value, residual=resid, matvecs=matvecs, converged=conv)
