"""Random start vectors that depend on a matrix's own coordinates only, never on its batch.

The iterative eigensolvers (:func:`segment.core.lanczos.second_eigenvectors`,
:func:`segment.core.markov.lambda2`) start from random vectors. Drawn from a
``torch.Generator`` for a whole batch, the start of one matrix depends on its place in the
batch and on the batch's padded size, so the same image cut in another batch (another
``batch_size``, another torchrun rank, other regions in its level) would start elsewhere
and stop, at the solver's tolerance, on a slightly different vector. Here entry
``(row, col)`` of a draw is a pure function of ``(seed, draw, row, col)``: a counter-based
hash (a 32-bit integer finaliser, in int64 so that no product overflows) turned into a
standard normal by Box-Muller, identical for every matrix of a batch and for every padded
length, on any device.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["Noise"]

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27: a product of it and a 32-bit value stays below 2**59


def _mix(x: Tensor) -> Tensor:
    """A 32-bit integer finaliser on int64 values in ``[0, 2**32)`` (same range out)."""
    x = ((x >> 16) ^ x) * _MUL & _M32
    x = ((x >> 16) ^ x) * _MUL & _M32
    return (x >> 16) ^ x


class Noise:
    """Deterministic standard-normal draws indexed by ``(seed, draw, row, col)``.

    Each :meth:`normal` call is a new draw (a new stream); the values of a call do not
    depend on the leading (batch) dimensions of the shape, and the leading ``n`` columns of
    a draw do not depend on how many columns are asked for.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = int(seed) & _M32
        self.draws = 0

    def normal(self, shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device | str
               ) -> Tensor:
        """``shape = (*batch, rows, cols)``: the draw's ``(rows, cols)`` block, broadcast
        (expanded, not copied) over ``batch``, in ``dtype`` on ``device``."""
        *batch, rows, cols = shape
        key = torch.tensor((self.seed * 0x9E37 + self.draws) & _M32, dtype=torch.int64,
                           device=device)
        self.draws += 1
        r = torch.arange(rows, dtype=torch.int64, device=device)[:, None]
        c = torch.arange(cols, dtype=torch.int64, device=device)[None, :]
        h = _mix(_mix(_mix(key) ^ r) ^ c)
        h1, h2 = _mix(h ^ 0x68E31DA4), _mix(h ^ 0x1B56C4E9)
        u1 = (h1.double() + 0.5) / 2.0 ** 32  # (0, 1): the logarithm is finite
        u2 = h2.double() / 2.0 ** 32
        z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
        return z.to(dtype).expand(*batch, rows, cols)
