"""Seed and grow: regions as the metastable states of a token chain (protocol §1, §4).

A chain ``P`` over the ``n = h * w`` grid tokens (attention, or a key-similarity chain)
has metastable states: token sets with high internal and low cross transition mass.
Mass started at a token spreads over its own state in a few bounces, so the
``steps``-bounce distributions of tokens in one state look alike and those of different
states do not. The stage, all batched in torch (CPU or CUDA unchanged):

1. **seeds**: a uniform grid of tokens (the DiffSeg baseline) or the top TokenRank tokens
   with spatial suppression (:func:`grid_seeds`, :func:`tokenrank_seeds`);
2. **propagation**: every seed's ``steps``-bounce distribution, one batched product
   (:func:`propagate`);
3. **merging**: proposals whose distributions are closer than ``tau`` in symmetric KL are
   averaged, ``iterations`` times, and duplicates collapse (:func:`merge_proposals`);
4. **assignment**: each token's share of every proposal's mass (:func:`soft_assign`),
   upsampled to the image, optionally refined by a few bounces of a *pixel* chain (an
   edge-aware random walk on colour and position, :func:`pixel_chain_refine`), then the
   argmax;
5. **connectivity**: every region is split into its connected components, tiny components
   are absorbed by their neighbours (``segment.backends.connected_regions``: scikit-image on
   CPU, kornia's union-find on CUDA, the same ids; the numbering and the absorption in
   torch are here: :func:`number_components`, :func:`absorb_small`);
6. **foreground** (binary tasks): a region is foreground when the mean of a score map
   (e.g. the CLS attention) inside it exceeds the map's mean over the image: the
   protocol's mean-threshold rule applied to regions instead of pixels
   (:func:`region_scores`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from segment.core import markov

__all__ = [
    "Proposals",
    "absorb_small",
    "grid_seeds",
    "key_chain",
    "merge_proposals",
    "number_components",
    "pixel_chain_refine",
    "propagate",
    "region_scores",
    "relabel",
    "soft_assign",
    "symmetric_kl",
    "tokenrank_seeds",
]


def key_chain(keys: Tensor, temperature: float = 0.05) -> Tensor:
    """Chain from key similarity: ``P_ij = softmax_j(cos(k_i, k_j) / temperature)``.

    Args:
        keys: ``(..., n, D)`` token keys (one head, or heads in a leading dim).
        temperature: softmax temperature of the cosine similarities (> 0).

    Returns:
        ``(..., n, n)`` row-stochastic (and symmetric-kernel, hence reversible) chain, in
        float64 for float64 keys and float32 otherwise.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    k = F.normalize(keys.to(markov.compute_dtype(keys.dtype)), dim=-1)
    return torch.softmax((k @ k.transpose(-1, -2)).div_(temperature), dim=-1)


def grid_seeds(grid: tuple[int, int], stride: int, device: torch.device | str = "cpu") -> Tensor:
    """Token indices of a uniform grid of seeds, every ``stride`` tokens (offset to centre).

    Returns:
        ``(S,)`` long indices into the row-major ``h x w`` grid.
    """
    h, w = grid
    if stride < 1:
        raise ValueError(f"seed stride must be >= 1, got {stride}")
    ys = torch.arange((stride - 1) // 2, h, stride, device=device)
    xs = torch.arange((stride - 1) // 2, w, stride, device=device)
    return (ys[:, None] * w + xs[None, :]).flatten()


def tokenrank_seeds(rank: Tensor, grid: tuple[int, int], num: int, radius: int = 1) -> Tensor:
    """The ``num`` highest-ranked tokens, suppressing a window around each pick.

    Greedy non-maximum suppression on the grid: after a token is chosen, every token within
    Chebyshev distance ``radius`` of it is excluded, so seeds spread over the image. When
    suppression exhausts the grid, the remaining picks fall back to the best unchosen
    tokens.

    Args:
        rank: ``(B, n)`` scores (e.g. TokenRank) over the grid tokens.
        grid: ``(h, w)`` with ``h * w = n``.
        num: number of seeds ``S`` (<= n).
        radius: suppression radius in tokens (0 = none).

    Returns:
        ``(B, S)`` long indices.
    """
    b, n = rank.shape
    h, w = grid
    if h * w != n:
        raise ValueError(f"rank has {n} tokens, grid {h}x{w} has {h * w}")
    if not 1 <= num <= n:
        raise ValueError(f"num seeds must be in [1, {n}], got {num}")
    yy, xx = torch.meshgrid(
        torch.arange(h, device=rank.device), torch.arange(w, device=rank.device), indexing="ij"
    )
    yy, xx = yy.flatten(), xx.flatten()
    score = rank.float().clone()
    chosen = torch.zeros(b, n, dtype=torch.bool, device=rank.device)
    free = torch.ones(b, n, dtype=torch.bool, device=rank.device)
    out = torch.empty(b, num, dtype=torch.long, device=rank.device)
    neg = torch.finfo(score.dtype).min
    for s in range(num):
        avail = free & ~chosen
        avail = torch.where(avail.any(1, keepdim=True), avail, ~chosen)  # fallback
        pick = torch.where(avail, score, torch.full_like(score, neg)).argmax(1)
        out[:, s] = pick
        chosen[torch.arange(b), pick] = True
        near = ((yy[None] - yy[pick][:, None]).abs() <= radius) & (
            (xx[None] - xx[pick][:, None]).abs() <= radius
        )
        free &= ~near
    return out


def propagate(chain: Tensor, seeds: Tensor, steps: int = 2) -> Tensor:
    """``steps``-bounce distributions from every seed, one batched product per bounce.

    Args:
        chain: ``(B, n, n)`` row-stochastic chain over grid tokens.
        seeds: ``(S,)`` (shared) or ``(B, S)`` (per image) seed token indices.
        steps: bounces ``>= 1`` (1 = the seeds' rows).

    Returns:
        ``(B, S, n)`` distributions ``v_steps`` (rows sum to 1).
    """
    b, n, _ = chain.shape
    if seeds.dim() == 1:
        return markov.bounce(chain, seeds, steps).last
    onehot = F.one_hot(seeds, n).to(chain.dtype)  # (B, S, n)
    return markov.bounce(chain, onehot, steps).last


def symmetric_kl(p: Tensor, q: Tensor, eps: float = 1e-8) -> Tensor:
    """``0.5 KL(p||q) + 0.5 KL(q||p)`` between all pairs of rows.

    Args:
        p: ``(B, S, n)`` distributions; q: ``(B, T, n)`` distributions.
        eps: floor added before the logarithms.

    Returns:
        ``(B, S, T)`` symmetric KL divergences (>= 0).
    """
    a = _log_terms(p, eps)
    return _symkl(a, a if q is p else _log_terms(q, eps))


def _log_terms(p: Tensor, eps: float = 1e-8) -> tuple[Tensor, Tensor, Tensor]:
    """``(p, log p, sum p log p)`` of ``(B, S, n)`` rows, floored at ``eps``, reusable."""
    p = p.float().clamp_min(eps)
    lp = p.log()
    return p, lp, (p * lp).sum(-1)


def _symkl(a: tuple[Tensor, Tensor, Tensor], b: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """Symmetric KL ``(B, S, T)`` from :func:`_log_terms` of ``(B, S, n)`` and ``(B, T, n)``."""
    pa, la, ea = a
    pb, lb, eb = b
    # KL(a||b) = sum a log a - a log b ; KL(b||a) = sum b log b - b log a
    cross = pa @ lb.transpose(1, 2)  # (B, S, T): sum_i a_si log b_ti
    ab = ea.unsqueeze(-1) - cross
    # of a set with itself the other product is this one transposed (the same numbers)
    other = cross if a is b else pb @ la.transpose(1, 2)
    ba = eb.unsqueeze(1) - other.transpose(1, 2)
    return (0.5 * (ab + ba)).clamp_min(0)


@dataclass
class Proposals:
    """Merged region proposals of a batch.

    Attributes:
        dist: ``(B, K, n)`` proposal distributions over grid tokens (rows of invalid slots
            are zero).
        valid: ``(B, K)`` which slots hold a proposal (``K`` = the number of seeds).
    """

    dist: Tensor
    valid: Tensor

    @property
    def count(self) -> Tensor:
        """``(B,)`` number of proposals per image."""
        return self.valid.sum(1)

    def compact(self) -> Proposals:
        """Valid proposals first, slots truncated to the largest count in the batch."""
        k = max(1, int(self.count.max()))
        order = torch.argsort((~self.valid).to(torch.int8), dim=1, stable=True)[:, :k]
        dist = torch.gather(self.dist, 1, order.unsqueeze(-1).expand(-1, -1, self.dist.shape[-1]))
        return Proposals(dist=dist, valid=torch.gather(self.valid, 1, order))


def _leaders(dist: Tensor, valid: Tensor, threshold: float) -> Tensor:
    """Greedy leader clustering of proposals ``(B, S, n)`` at symmetric KL ``threshold``.

    Slots are visited in order; the first unassigned valid slot becomes a leader and takes
    every unassigned valid slot closer than ``threshold`` to it (not transitively: a chain
    of small steps does not merge distant proposals). The KL matrix is computed once, all
    images at once; the sequential sweep over leaders runs on its ``(S, S)`` threshold
    pattern, one image at a time on the CPU, with every row of the pattern and the free
    slots as bit sets (Python integers: one operation per leader, not one per slot).
    Returns ``(B, S)`` the leader index of every slot (invalid slots point to themselves).
    """
    b, s, _ = dist.shape
    near = (symmetric_kl(dist, dist) < threshold).cpu().numpy()  # (B, S, S)
    free_all = valid.cpu().numpy()
    nbytes = (s + 7) // 8
    rows = np.packbits(near, axis=-1, bitorder="little")  # (B, S, nbytes): bit j of row i
    frees = np.packbits(free_all, axis=-1, bitorder="little")
    lab = np.tile(np.arange(s), (b, 1))
    for i in range(b):
        raw = rows[i].tobytes()  # only the leaders' rows are read (as integers)
        free = int.from_bytes(frees[i].tobytes(), "little")
        leads, takes = [], []
        while free:
            lead = (free & -free).bit_length() - 1  # the first free slot
            near_lead = int.from_bytes(raw[lead * nbytes: (lead + 1) * nbytes], "little")
            take = (near_lead & free) | (1 << lead)
            free &= ~take
            leads.append(lead)
            takes.append(take.to_bytes(nbytes, "little"))
        if leads:  # every taken slot belongs to exactly one leader
            member = np.unpackbits(np.frombuffer(b"".join(takes), np.uint8).reshape(len(leads), nbytes),
                                   axis=-1, count=s, bitorder="little").astype(bool)
            taken = member.any(0)
            lab[i, taken] = np.asarray(leads)[member.argmax(0)[taken]]
    return torch.from_numpy(lab).to(dist.device)


def merge_proposals(
    dist: Tensor,
    tau: float,
    iterations: int = 3,
    *,
    dedupe: float = 0.1,
    kl: Tensor | None = None,
) -> Proposals:
    """DiffSeg-style iterative merging of seed distributions.

    Each iteration replaces every proposal by the mean of the proposals within symmetric
    KL ``tau`` of it, then collapses near-duplicates (greedy leader clustering at
    ``KL < dedupe * tau``) into one proposal, their mean.

    Args:
        dist: ``(B, S, n)`` seed distributions.
        tau: merge threshold on the symmetric KL (protocol §4: 1.1 on COCO-Stuff-27, 0.9 on
            Cityscapes for 64 x 64 diffusion attention; attention-chain distributions over
            a ViT grid are broader and want smaller values).
        iterations: merge rounds (protocol: 3).
        dedupe: duplicates are proposals closer than ``dedupe * tau``.
        kl: ``symmetric_kl(dist, dist)`` when already at hand (merging the same seeds at
            another ``tau``): the first round reuses it.

    Returns:
        :class:`Proposals`, compacted (valid slots first).
    """
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    d = dist.float()
    b, s, n = d.shape
    valid = torch.ones(b, s, dtype=torch.bool, device=d.device)
    for it in range(max(1, int(iterations))):
        if it:  # later rounds only see the surviving proposals
            props = Proposals(dist=d, valid=valid).compact()
            d, valid = props.dist, props.valid
            s = d.shape[1]
        if it or kl is None:
            kl = symmetric_kl(d, d)
        pair = valid.unsqueeze(1) & valid.unsqueeze(2)
        near = (kl < tau) & pair
        w = near.to(d.dtype)
        d = (w @ d) / w.sum(-1, keepdim=True).clamp_min(1)
        lab = _leaders(d, valid, dedupe * tau)  # representative = the leader slot
        # every valid member added into its leader's slot (flat over the batch)
        member = valid.flatten()
        slot = (lab + s * torch.arange(b, device=d.device).unsqueeze(1)).flatten()[member]
        counts = torch.bincount(slot, minlength=b * s).to(d.dtype)  # members per leader slot
        d = torch.zeros_like(d).view(b * s, n).index_add_(0, slot, d.reshape(b * s, n)[member])
        d = (d / counts.clamp_min(1).unsqueeze(-1)).view(b, s, n)
        valid = (counts > 0).view(b, s)
        d = d * valid.unsqueeze(-1).to(d.dtype)
    return Proposals(dist=d, valid=valid).compact()


def soft_assign(props: Proposals, eps: float = 1e-12) -> Tensor:
    """Each token's share of every proposal's mass: ``(B, K, n)``, summing to 1 over ``K``.

    Invalid slots get 0. Argmax over ``K`` is DiffSeg's "each pixel takes the argmax
    proposal".
    """
    d = props.dist * props.valid.unsqueeze(-1).to(props.dist.dtype)
    return d / d.sum(1, keepdim=True).clamp_min(eps)


def pixel_chain_refine(
    prob: Tensor,
    image: Tensor,
    *,
    radius: int = 6,
    dilation: int = 1,
    sigma_space: float = 5.0,
    sigma_color: float = 0.08,
    steps: int = 3,
    nonzero: Tensor | None = None,
) -> Tensor:
    """A few bounces of an edge-aware pixel chain (joint bilateral random walk).

    The pixel chain moves from pixel ``p`` to ``q`` in the window of ``radius`` (sampled every
    ``dilation`` pixels) with probability ``softmax_q(-|p - q|^2 / 2 sigma_s^2 -
    |I_p - I_q|^2 / 2 sigma_c^2)``: it stays inside regions of similar colour. Averaging
    region probabilities along it (``x <- P x``, ``steps`` times) snaps region boundaries to
    image edges. Memory is ``O(B K H W)`` (windows are visited one offset at a time).

    Args:
        prob: ``(B, K, H, W)`` soft region assignment (or any maps) at image resolution.
        image: ``(B, 3, H, W)`` RGB in ``[0, 1]``.
        radius, dilation: window half-size and sampling step in pixels.
        sigma_space: spatial bandwidth in pixels; sigma_color: colour bandwidth.
        steps: bounces on the pixel chain (0 = no refinement).
        nonzero: ``(B, K)`` which maps hold any nonzero value, when the caller knows (e.g.
            from the grid the maps were upsampled from); else found by a pass over them.
            The zero maps stay zero under any bounce and are skipped.

    Returns:
        ``(B, K, H, W)`` refined maps (convex combinations of the inputs).
    """
    if steps <= 0:
        return prob
    if prob.shape[-2:] != image.shape[-2:] or prob.shape[0] != image.shape[0]:
        raise ValueError(
            f"prob {tuple(prob.shape)} and image {tuple(image.shape)} must share batch and size"
        )
    r, dl = int(radius), max(1, int(dilation))
    offsets = [(dy, dx) for dy in range(-r, r + 1, dl) for dx in range(-r, r + 1, dl)]
    x = prob.float()
    if x.is_cuda:  # the whole batch at once (the same numbers)
        return _pixel_chain_steps(x, image.float(), offsets, r, sigma_space, sigma_color,
                                  int(steps)).contiguous()
    out = torch.empty_like(x)
    # a few images at a time (up to _REFINE_PIXELS pixels: their maps stay in cache; one
    # image at 448 px), and only their nonzero maps: the zero slots of a padded batch stay
    # zero under any bounce. Every image's maps are refined on their own (elementwise per
    # image and map), so images with as many maps are grouped: fewer zero maps ride along
    h, w = x.shape[-2:]
    chunk = max(1, _REFINE_PIXELS // (h * w))
    known = nonzero.to(x.device) if nonzero is not None else x.flatten(2).any(2)  # (B, K)
    order = torch.argsort(known.sum(1), descending=True, stable=True)
    for i in range(0, x.shape[0], chunk):
        idx = order[i: i + chunk]
        live: Tensor = known[idx].any(0).nonzero()[:, 0]
        if not live.numel():
            out[idx] = 0
            continue
        refined = _pixel_chain_steps(x[idx[:, None], live], image[idx].float(), offsets, r,
                                     sigma_space, sigma_color, int(steps))  # one gather
        if live.numel() == x.shape[1]:
            out[idx] = refined
        else:
            part = torch.zeros((idx.numel(), *x.shape[1:]), dtype=x.dtype, device=x.device)
            part[:, live] = refined
            out[idx] = part
    return out


# weights under exp(-80) ~ 2e-35 (next to a normaliser >= 1) are set to 0 rather than left to
# underflow into subnormal floats, whose arithmetic is ~10x slower on x86 CPUs
_LOG_TINY = -80.0
# ``F.threshold_(x, _BELOW_TINY, -inf)`` keeps ``x >= _LOG_TINY`` (``x > `` the float32 just
# below it): ``masked_fill_(x < _LOG_TINY, -inf)`` in one pass, without a boolean mask
_BELOW_TINY = float(np.nextafter(np.float32(_LOG_TINY), np.float32(-np.inf)))
_REFINE_PIXELS = 1 << 18  # pixels per chunk of the CPU pixel chain (measured: 4 x 224^2
# together are ~15% faster than one by one; a 448^2 image alone is ~1.7x faster than 4)


def _pixel_chain_steps(x: Tensor, img: Tensor, offsets: list[tuple[int, int]], pad: int,
                       sigma_space: float, sigma_color: float, steps: int) -> Tensor:
    """``steps`` bounces of :func:`pixel_chain_refine`'s chain on ``(B, K, H, W)`` maps
    (returned as a view into a padded buffer)."""
    b, _, h, w = img.shape
    imp = F.pad(img, (pad, pad, pad, pad), mode="replicate")
    weights = torch.empty(b, len(offsets), h, w, dtype=img.dtype, device=img.device)
    index = {o: i for i, o in enumerate(offsets)}
    # the softmax over offsets, its normalisation applied once per bounce to the K maps
    # instead of to every offset's weight: w_o = exp(logit_o - max), x <- sum_o w_o x_o / sum_o w_o.
    # With the zero offset in the window the max is its logit, exactly 0 (the others are
    # <= 0), and w_o = exp(-|o|^2 / 2 sigma_s^2) exp(-col_o / 2 sigma_c^2): one exp per pair
    # of mirror offsets. Without it the logits are formed, shifted by their max, then exp'd
    factored = (0, 0) in index
    # one buffer for every offset's colour differences (the largest frame: fewer
    # temporaries, the same numbers as ``((a - b) ** 2).sum(1)``)
    diff = torch.empty(b, img.shape[1], (h + pad) * (w + pad), dtype=img.dtype, device=img.device)
    for dy, dx in offsets:
        mirror = index.get((-dy, -dx))
        if (dy, dx) < (0, 0) and mirror is not None:
            continue  # filled with its mirror offset
        # |I(q + o) - I(q)|^2 on the padded frame for q = p and q = p - o: the mirror
        # offset's distance at p is this one's at p - o (the replicate padding holds
        # I(clamp(p - o))), the same numbers computed once
        y0, x0 = pad - max(dy, 0), pad - max(dx, 0)
        y1, x1 = pad + h + max(-dy, 0), pad + w + max(-dx, 0)
        d = diff[:, :, : (y1 - y0) * (x1 - x0)].view(b, -1, y1 - y0, x1 - x0)
        torch.sub(imp[:, :, y0 + dy: y1 + dy, x0 + dx: x1 + dx], imp[:, :, y0:y1, x0:x1], out=d)
        col = d.mul_(d).sum(1)
        col.mul_(-1.0 / (2 * sigma_color**2))
        if factored:
            F.threshold_(col, _BELOW_TINY, -math.inf).exp_()
        pairs = [((dy, dx), max(dy, 0), max(dx, 0))]
        if mirror is not None and (dy, dx) != (0, 0):
            pairs.append(((-dy, -dx), max(-dy, 0), max(-dx, 0)))
        for (ey, ex), top, left in pairs:
            out = weights[:, index[(ey, ex)]]
            space = -(ey * ey + ex * ex) / (2 * sigma_space**2)
            if factored:
                torch.mul(col[:, top: top + h, left: left + w], math.exp(space), out=out)
            else:
                torch.add(col[:, top: top + h, left: left + w], space, out=out)
    if not factored:
        weights.sub_(weights.amax(1, keepdim=True))
        F.threshold_(weights, _BELOW_TINY, -math.inf).exp_()
    norm = weights.sum(1, keepdim=True)  # (B, 1, H, W), >= 1
    k = x.shape[1]
    xp = torch.empty(b, k, h + 2 * pad, w + 2 * pad, dtype=x.dtype, device=x.device)
    inner = xp[:, :, pad: pad + h, pad: pad + w]
    inner.copy_(x)
    acc = torch.empty_like(x)
    for _ in range(steps):
        _replicate_border(xp, pad)
        for o, (dy, dx) in enumerate(offsets):
            shifted = xp[:, :, pad + dy: pad + dy + h, pad + dx: pad + dx + w]
            if o == 0:
                torch.mul(shifted, weights[:, :1], out=acc)
            else:
                acc.addcmul_(shifted, weights[:, o: o + 1])
        torch.div(acc, norm, out=inner)  # the next bounce reads it in place
    return inner


def _replicate_border(xp: Tensor, pad: int) -> None:
    """Fill the ``pad``-wide frame of ``(..., H + 2 pad, W + 2 pad)`` from its interior, as
    ``F.pad(mode="replicate")`` of the interior would."""
    if pad <= 0:
        return
    h, w = xp.shape[-2] - 2 * pad, xp.shape[-1] - 2 * pad
    rows = xp[..., pad: pad + h, :]
    rows[..., :pad].copy_(rows[..., pad: pad + 1].expand_as(rows[..., :pad]))
    rows[..., pad + w:].copy_(rows[..., pad + w - 1: pad + w].expand_as(rows[..., pad + w:]))
    xp[..., :pad, :].copy_(xp[..., pad: pad + 1, :].expand_as(xp[..., :pad, :]))
    xp[..., pad + h:, :].copy_(xp[..., pad + h - 1: pad + h, :].expand_as(xp[..., pad + h:, :]))


def number_components(cc: Tensor, labels: Tensor) -> Tensor:
    """Components ``cc`` (any unique ids) numbered ``0 .. n_b - 1`` per image by (label
    value, raster position of the first pixel): one numbering on every device."""
    ids = relabel(cc)
    b = ids.shape[0]
    n = int(ids.max()) + 1
    flat = ids.flatten(1)
    pos = torch.arange(flat.shape[1], device=ids.device).expand(b, -1)
    first = torch.full((b, n), flat.shape[1], device=ids.device, dtype=torch.long)
    first.scatter_reduce_(1, flat, pos, reduce="amin")
    value = torch.zeros(b, n, device=ids.device, dtype=torch.long)
    value.scatter_(1, flat, labels.flatten(1).long())
    key = value * (flat.shape[1] + 1) + first  # absent ids (first = H W) sort last
    key = torch.where(first == flat.shape[1], torch.iinfo(torch.long).max, key)
    rank = torch.empty_like(key)
    rank.scatter_(1, key.argsort(1), torch.arange(n, device=ids.device).expand(b, -1).contiguous())
    return torch.gather(rank, 1, flat).view_as(ids)


def relabel(labels: Tensor) -> Tensor:
    """Per image, map the label values present to ``0 .. K_b - 1`` (in increasing order)."""
    lab = labels.long()
    lab = lab - lab.flatten(1).amin(1).view(-1, *([1] * (lab.dim() - 1)))  # >= 0
    b = lab.shape[0]
    span = int(lab.max()) + 1
    present = torch.zeros(b, span, dtype=torch.long, device=lab.device)
    present.scatter_(1, lab.flatten(1), 1)
    new_id = present.cumsum(1) - 1
    return torch.gather(new_id, 1, lab.flatten(1)).view_as(lab)


def absorb_small(labels: Tensor, min_area: int) -> Tensor:
    """Components under ``min_area`` pixels take the labels of their kept neighbours.

    The kept regions grow into the removed pixels one 8-neighbourhood step at a time (a
    max-pool of the ids ranked by area), so every removed pixel ends up with the label of
    the nearest kept region, the largest of them on a tie (batched in torch; the scikit-image
    path of ``segment.backends`` grows hole pixels only, to the same labels). An image whose
    components are all small keeps them.
    """
    lab = relabel(labels)
    b, h, w = lab.shape
    k = int(lab.max()) + 1
    area = torch.zeros(b, k, device=lab.device, dtype=torch.long)
    area.scatter_add_(1, lab.flatten(1), torch.ones_like(lab.flatten(1)))
    present = area > 0
    small = (area < min_area) & present
    all_small = (small | ~present).all(1, keepdim=True)
    small &= ~all_small  # an image of small components only keeps them
    tiny = torch.gather(small, 1, lab.flatten(1)).view(b, h, w)
    # the growth takes the largest id around a pixel: ids ranked by area (then id), so a
    # speck between kept regions at the same distance joins the largest of them
    order = torch.argsort(area * k + torch.arange(k, device=lab.device), dim=1)
    ranks = torch.arange(k, device=lab.device).expand(b, k).contiguous()
    rank = torch.empty_like(order).scatter_(1, order, ranks)
    cur = torch.where(tiny, torch.full_like(lab, -1),
                      torch.gather(rank, 1, lab.flatten(1)).view_as(lab))
    for _ in range(h + w):
        missing = cur < 0
        if not bool(missing.any()):
            break
        grown = F.max_pool2d((cur + 1).float().unsqueeze(1), 3, stride=1, padding=1)
        grown = grown.squeeze(1).long() - 1
        cur = torch.where(missing & (grown >= 0), grown, cur)
    return torch.gather(order, 1, cur.flatten(1).clamp_min(0)).view_as(cur)  # back to the ids


def region_scores(labels: Tensor, score: Tensor, num: int | None = None) -> Tensor:
    """Mean of ``score`` inside each region.

    Args:
        labels: ``(B, H, W)`` labels ``0 .. K-1``.
        score: ``(B, H, W)`` a score map at the same resolution.
        num: ``K`` (default: ``labels.max() + 1``).

    Returns:
        ``(B, K)`` mean score per region (0 for empty ids).
    """
    k = int(labels.max()) + 1 if num is None else int(num)
    b = labels.shape[0]
    idx = labels.flatten(1).long()
    s = torch.zeros(b, k, device=score.device, dtype=torch.float32)
    c = torch.zeros(b, k, device=score.device, dtype=torch.float32)
    s.scatter_add_(1, idx, score.flatten(1).float())
    c.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float32))
    return s / c.clamp_min(1)

