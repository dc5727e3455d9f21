"""Methods on a Markov chain of the attention: multi-bounce and TokenRank."""

from __future__ import annotations

import abc
import contextvars
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import Tensor

from segment.core import markov
from segment.core.masks import MethodOutput
from segment.core.record import AttentionRecord, TokenLayout
from segment.methods.base import (
    FUSE,
    AveragesLayers,
    knob,
    grid_part,
    grid_weights,
    patch_chain,
    renorm,
    start_distribution,
)

_CHAIN_KINDS = ("grid", "joint")
# the convergence flags of the power iterations of the TokenRank call in progress (one list
# per call and thread, so that a method object shared by threads keeps no state)
_CONVERGED: contextvars.ContextVar[list[Tensor] | None] = contextvars.ContextVar(
    "tokenrank_converged", default=None
)
_DIRECTIONS = ("forward", "source")


@dataclass(frozen=True)
class _ChainMethod(AveragesLayers):
    """A method run on the grid chain or on the joint chain over every token (module doc).

    ``chain: grid`` (the patch chain ``P`` and the first bounce ``v_1``, text / CLS / register
    tokens dropped after the first step) or ``chain: joint`` (the full ``(N, N)`` chain over
    every captured token, damped by ``alpha``, walked from the query tokens; the grid slice
    of the result is read at the end, not renormalised). ``direction: source`` walks the
    reverse chain (:func:`segment.core.markov.reverse_chain`: where the attention a token receives
    comes from) instead of the attention itself (``forward``).
    """

    fuse: str = knob("output", "where heads are combined: attention (the raw attention, before"
                     " the chain is built; the backbone may fuse while it runs), chain (P = sum_h"
                     " w_h P_h and v_1 = sum_h w_h v_1,h from each head's own patch chain; grid"
                     " chain only) or output (the method runs on every head, the heatmaps are"
                     " combined)")
    chain: str = knob("grid", "grid (the patch chain, prefix dropped after the first step) or"
                      " joint (the damped chain over every captured token, grid slice read at"
                      " the end)")
    direction: str = knob("forward", "forward (follow the attention) or source (walk the"
                          " reverse chain: where the attention a token receives comes from)")
    _directions: ClassVar[tuple[str, ...]] = _DIRECTIONS

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fuse not in FUSE:
            raise ValueError(f"{self.name}: fuse must be one of {FUSE}, got {self.fuse!r}")
        if self.chain not in _CHAIN_KINDS:
            raise ValueError(f"{self.name}: chain must be one of {_CHAIN_KINDS}, got {self.chain!r}")
        if self.direction not in self._directions:
            hint = {"incoming": " (was: incoming)", "outgoing": " (source was: outgoing)"}
            raise ValueError(
                f"{self.name}: direction must be one of {self._directions}, got {self.direction!r}"
                + hint.get(str(self.direction), "")
            )
        if self.chain == "joint" and self.fuse == "chain":
            raise ValueError(
                f"{self.name}: fuse=chain fuses the heads' grid chains; with chain=joint use"
                " fuse=attention (the fused joint chain) or fuse=output"
            )

    @property
    def _fuse_first(self) -> bool:
        return self.fuse == "attention"

    @property
    def fuse_point(self) -> str | None:
        return self.fuse

    @abc.abstractmethod
    def _run(self, v1: Tensor, chain: Tensor) -> Tensor:
        """``v_1`` ``(B, H', n)`` and patch chains ``(B, H', n, n)`` -> ``(B, H', n)``."""

    @abc.abstractmethod
    def _run_joint(self, start: Tensor, attn: Tensor) -> Tensor:
        """Start masses ``(B, N)`` and joint chains ``(B, H', N, N)`` -> ``(B, H', N)``."""

    def _heat(self, attn: Tensor, record: AttentionRecord) -> Tensor:
        layout = record.layout
        s = start_distribution(record, attn.shape[-1], attn.dtype, attn.device)
        if self.chain == "joint":
            return self._heat_joint(s, attn, layout)
        if self.direction == "forward":  # the query tokens' rows
            first = torch.einsum("bn,bhnm->bhm", s, attn)
        else:  # the first step of the reverse chain: their columns, scaled by 1 / column sum
            inv_c = markov.inverse_column_sums(attn, 1.0)  # (B, H, N)
            first = torch.einsum("bhmn,bhn->bhm", attn, s.unsqueeze(1) * inv_c)
        v1 = renorm(grid_part(first, layout))  # (B, H, n)
        chain = patch_chain(attn, layout)  # (B, H, n, n)
        if chain.shape[1] == 1:
            return self._run(v1, chain)[:, 0]
        w = grid_weights(chain, self.heads)  # (B, H), from the forward patch chains
        if self.fuse == "chain":
            chain = markov.fuse_heads(chain, w).unsqueeze(1)
            v1 = (w.unsqueeze(-1) * v1).sum(1, keepdim=True)
            return self._run(v1, chain)[:, 0]
        return (w.unsqueeze(-1) * self._run(v1, chain)).sum(1)  # fuse == "output"

    def _heat_joint(self, s: Tensor, attn: Tensor, layout: TokenLayout) -> Tensor:
        heat = grid_part(self._run_joint(s, attn), layout)  # (B, H', n)
        if heat.shape[1] == 1:
            return heat[:, 0]
        if self.heads == "mean":  # fuse == "output"
            w = torch.full(heat.shape[:2], 1.0 / heat.shape[1], dtype=heat.dtype, device=heat.device)
        else:
            w = grid_weights(patch_chain(attn, layout), self.heads)
        return (w.unsqueeze(-1) * heat).sum(1)


@dataclass(frozen=True)
class Bounce(_ChainMethod):
    """``steps`` bounces from the query tokens.

    Grid chain: ``v_1 = rownorm([s^T A]_grid)``, ``v_{k+1}^T = v_k^T P``, heatmap ``v_steps``
    (module docstring). Joint chain: ``v_k^T = s^T T^k`` on the damped chain
    ``T = alpha A + (1 - alpha) 11^T / N`` over every token (damping applied implicitly),
    heatmap ``[v_steps]_grid``; the paths class word -> text token -> image token count.
    ``direction: source`` uses the reverse chain in both. The default ``fuse: output`` runs
    per head and fuses the heads' ``v_steps`` (``cls_2bounce_*`` of ecssd-dev/REFERENCE.md).
    """

    name: str = knob("bounce", "the method's name in tables, manifests and file records")
    steps: int = knob(2, "n >= 1 bounces (1 = the renormalised query row)")
    fuse: str = knob("output", "where heads are combined: attention (the raw attention, before"
                     " the chain is built; the backbone may fuse while it runs), chain (P = sum_h"
                     " w_h P_h and v_1 = sum_h w_h v_1,h from each head's own patch chain; grid"
                     " chain only) or output (the method runs on every head, the heatmaps are"
                     " combined)")
    alpha: float = knob(1.0, "damping of the joint chain in (0, 1] (the reference code's 0.99;"
                        " 1 = undamped); the grid chain is undamped, so chain=grid refuses"
                        " alpha < 1")

    def __post_init__(self) -> None:
        super().__post_init__()
        if int(self.steps) < 1:
            raise ValueError(f"{self.name}: steps must be >= 1, got {self.steps}")
        object.__setattr__(self, "steps", int(self.steps))
        object.__setattr__(self, "alpha", markov.validate_alpha(self.alpha))
        if self.chain == "grid" and self.alpha != 1.0:
            raise ValueError(
                f"{self.name}: alpha={self.alpha} damps the joint chain only; use chain=joint"
                " or alpha=1.0"
            )

    def _run(self, v1: Tensor, chain: Tensor) -> Tensor:
        if self.steps == 1:
            return v1
        # v_1 P^(steps-1): bounce() from the start masses v_1, (B, H', 1, n)
        return markov.bounce(
            chain, v1.unsqueeze(-2), steps=self.steps - 1, direction=self.direction
        ).last[..., 0, :]

    def _run_joint(self, start: Tensor, attn: Tensor) -> Tensor:
        v0 = start[:, None, None, :]  # (B, 1, 1, N), broadcast over the heads
        return markov.bounce(
            attn, v0, steps=self.steps, direction=self.direction, alpha=self.alpha
        ).last[..., 0, :]


@dataclass(frozen=True)
class TokenRank(_ChainMethod):
    """TokenRank: stationary distribution of the damped chain.

    Grid chain: of the damped patch chain; the default ``fuse: chain`` takes the stationary
    vector of ``sum_h w_h P_h`` (``tokenrank_last_*`` of ecssd-dev/REFERENCE.md), ``output``
    averages the per-head stationary vectors, ``attention`` uses the patch chain of the fused
    attention. Joint chain: of ``alpha A + (1 - alpha) 11^T / N`` over every token, read on
    the grid (the reference code's ``tokenrank_sink``). ``direction: source``: of the reverse
    of the damped chain (the reference code's ``tokenrank_src``); ``direction: outgoing``:
    of the damped reverse chain, ``alpha S + (1 - alpha) 11^T / n`` with ``S`` the
    column-normalised transpose (protocol §1's outgoing view: the same power iteration on
    the column-normalised transpose); on either chain.
    """

    name: str = knob("tokenrank", "the method's name in tables, manifests and file records")
    fuse: str = knob("chain", "where heads are combined: attention (the raw attention, before"
                     " the chain is built; the backbone may fuse while it runs), chain (the"
                     " stationary vector of sum_h w_h P_h; grid chain only) or output (the"
                     " per-head stationary vectors, combined)")
    direction: str = knob("forward", "forward (who receives attention), source (the reverse of"
                          " the damped chain, the reference code's tokenrank_src) or outgoing"
                          " (the damped reverse chain, protocol §1)")
    alpha: float = knob(0.99, "damping in (0, 1] (the reference code's 0.99; classic"
                        " PageRank 0.85)")
    tol: float = knob(1e-6, "L1 change that stops the power iteration (the reference code's"
                      " 1e-5; 1e-6 leaves ~3e-6 L1 error on a real last-layer chain instead of"
                      " ~3e-5, 44 steps instead of 35)")
    max_iter: int = knob(200, "power-iteration steps at most")
    _directions: ClassVar[tuple[str, ...]] = (*_DIRECTIONS, "outgoing")

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "alpha", markov.validate_alpha(self.alpha))
        if int(self.max_iter) < 1 or not float(self.tol) > 0:
            raise ValueError(
                f"{self.name}: need max_iter >= 1 and tol > 0, got {self.max_iter}, {self.tol}"
            )

    def __call__(self, record: AttentionRecord) -> MethodOutput:
        """The heatmap, with ``converged`` ``(B,)``: whether every power iteration behind
        an image's heatmap (every head and layer it read) fell below ``tol`` within
        ``max_iter`` steps. Slow-mixing heads at ``alpha`` near 1 may not (docs/markov.md)."""
        flags: list[Tensor] = []
        token = _CONVERGED.set(flags)
        try:
            out = super().__call__(record)
        finally:
            _CONVERGED.reset(token)
        b = out.heatmap.shape[0]
        conv = torch.ones(b, dtype=torch.bool, device=out.heatmap.device)
        for f in flags:  # (B,) or (B, H')
            conv &= f.reshape(b, -1).all(1).to(conv.device)
        return replace(out, converged=conv)

    def _pi(self, chain: Tensor) -> Tensor:
        res = markov.tokenrank(
            chain, alpha=self.alpha, tol=float(self.tol), max_iter=int(self.max_iter),
            direction={"forward": "incoming"}.get(self.direction, self.direction),
            return_info=True,
        )
        flags = _CONVERGED.get()
        if flags is not None:
            flags.append(res.converged)
        return res.pi

    def _run(self, v1: Tensor, chain: Tensor) -> Tensor:
        return self._pi(chain)

    def _run_joint(self, start: Tensor, attn: Tensor) -> Tensor:
        return self._pi(attn)
