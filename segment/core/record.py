"""The one attention record every backbone returns (ViT or DiT), and what to capture.

A backbone turns images into an :class:`AttentionRecord`: attention probabilities of the
selected layers (all heads, or heads already fused on the fly), plus the
:class:`TokenLayout` that says which tokens are the prefix (CLS and registers for a ViT,
text tokens for FLUX) and which form the image grid. Every Markov method reads only this
record, so methods and evaluation work unchanged for any backbone.

A :class:`Capture` says what a method needs (which layers, whether heads may be fused while
capturing, whether to average the layers), so that a run never holds more than that.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from torch import Tensor

HeadReduction = Literal["keep", "mean", "lambda2"]


@dataclass(frozen=True)
class TokenLayout:
    """Where the tokens of an attention matrix come from.

    Token order is ``[prefix tokens][grid tokens, row-major h x w][suffix tokens]``.

    Attributes:
        num_tokens: ``N``, the side of every attention matrix.
        prefix: number of tokens before the grid (ViT: 1 CLS + registers; FLUX: text).
        grid: ``(h, w)`` patch / latent-token grid.
        cls_index: index of the CLS token, ``None`` when the model has none (FLUX).
        num_registers: register tokens (after CLS) in the prefix.
        kind: ``"vit"`` or ``"dit"``, for messages and defaults only.
    """

    num_tokens: int
    prefix: int
    grid: tuple[int, int]
    cls_index: int | None = 0
    num_registers: int = 0
    kind: str = "vit"

    def __post_init__(self) -> None:
        h, w = self.grid
        if h < 1 or w < 1:
            raise ValueError(f"grid must be positive, got {self.grid}")
        if self.prefix < 0 or self.prefix + h * w > self.num_tokens:
            raise ValueError(
                f"layout does not fit: prefix {self.prefix} + grid {h}x{w} > N {self.num_tokens}"
            )

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def patches(self) -> slice:
        """Slice of the grid tokens."""
        return slice(self.prefix, self.prefix + self.num_patches)


@dataclass(frozen=True)
class Capture:
    """What to keep while the backbone runs (a reducer spec).

    Attributes:
        layers: layer indices to capture (negative counts from the end); ``None`` = all.
        heads: ``"keep"`` keeps every head ``(B, H, N, N)``; ``"mean"`` / ``"lambda2"`` fuse
            the heads of each layer as soon as it is computed (``H = 1`` in the record), the
            ``lambda2`` weights computed on the prefix-free patch chain.
        average_layers: average the captured layers into one matrix on the fly (the record
            then holds a single entry, see :attr:`AttentionRecord.attn`).
        keys: also keep each captured layer's attention keys ``(B, H, N, D)`` (for chains built
            from key similarity).
    """

    layers: tuple[int, ...] | None = (-1,)
    heads: HeadReduction = "keep"
    average_layers: bool = False
    keys: bool = False

    def __post_init__(self) -> None:
        if self.heads not in ("keep", "mean", "lambda2"):
            raise ValueError(f"Capture.heads must be keep/mean/lambda2, got {self.heads!r}")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))

    def resolve(self, num_layers: int) -> tuple[int, ...]:
        """Absolute, sorted, unique layer indices for a model with ``num_layers`` layers."""
        if self.layers is None:
            return tuple(range(num_layers))
        out = set()
        for i in self.layers:
            j = i + num_layers if i < 0 else i
            if not 0 <= j < num_layers:
                raise ValueError(f"layer {i} out of range for a model with {num_layers} layers")
            out.add(j)
        return tuple(sorted(out))

    def union(self, other: Capture, num_layers: int) -> Capture:
        """The smallest capture that serves both: heads stay fused only where both fuse
        them the same way, layers stay averaged only where both average the same layers."""
        mine, theirs = self.resolve(num_layers), other.resolve(num_layers)
        return Capture(
            layers=tuple(sorted(set(mine) | set(theirs))),
            heads=self.heads if self.heads == other.heads else "keep",
            average_layers=self.average_layers and other.average_layers and mine == theirs,
            keys=self.keys or other.keys,
        )


@dataclass
class AttentionRecord:
    """Attention captured from one batch of images.

    Attributes:
        attn: layer index -> ``(B, H, N, N)`` float32 attention probabilities; ``H = 1`` when
            heads were fused while capturing. Averaged layers are stored under the first
            averaged index with ``averaged_layers`` listing them.
        layout: the token layout (shared by the batch).
        image_size: ``(H, W)`` of the backbone input in pixels.
        query: per image, the token indices to start bouncing from (ViT: the CLS token;
            FLUX: the class word's text tokens). ``None`` = ``[layout.cls_index]``.
        keys: layer index -> ``(B, H, N, D)`` attention keys, when captured.
        head_weights: layer index -> ``(B, H)`` weights used to fuse heads, when fused.
        head_fusion: how they were fused (``"mean"`` or ``"lambda2"``, the capture's
            ``heads``); ``None`` when the heads were kept or the record was built by hand
            (then uniform weights are read as ``"mean"``).
        averaged_layers: the layers averaged into one entry, when ``Capture.average_layers``.
        extras: backbone-specific tensors (e.g. ConceptAttention outputs), by name.
        num_layers: layers of the backbone that made the record (resolves a method's
            negative layer indices); ``None`` when unknown.
        pixels: ``(B, 3, H, W)`` the backbone's input as RGB in ``[0, 1]`` (before
            normalisation), for methods that refine masks on the image; ``None`` if the
            backbone does not provide it.
    """

    attn: dict[int, Tensor]
    layout: TokenLayout
    image_size: tuple[int, int]
    query: list[tuple[int, ...]] | None = None
    keys: dict[int, Tensor] = field(default_factory=dict)
    head_weights: dict[int, Tensor] = field(default_factory=dict)
    head_fusion: str | None = None
    averaged_layers: tuple[int, ...] | None = None
    extras: dict[str, Tensor] = field(default_factory=dict)
    num_layers: int | None = None
    pixels: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return next(iter(self.attn.values())).shape[0]

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.attn))

    def queries(self) -> list[tuple[int, ...]]:
        """Start tokens per image (defaults to the CLS token)."""
        if self.query is not None:
            return self.query
        if self.layout.cls_index is None:
            raise ValueError("this record has no CLS token and no query tokens to bounce from")
        return [(self.layout.cls_index,)] * self.batch_size

    def select(self, layers: tuple[int, ...]) -> AttentionRecord:
        """A view restricted to some layers (no copy)."""
        missing = [i for i in layers if i not in self.attn]
        if missing:
            raise KeyError(f"layers {missing} were not captured (have {self.layers})")
        return replace(
            self,
            attn={i: self.attn[i] for i in layers},
            keys={i: self.keys[i] for i in layers if i in self.keys},
            head_weights={i: self.head_weights[i] for i in layers if i in self.head_weights},
        )

    def images(self, start: int, stop: int) -> AttentionRecord:
        """The record of images ``start:stop`` of the batch (views, no copy).

        A record with ``extras`` (backbone-specific tensors, e.g. FLUX's ConceptAttention)
        is not split: their layout is the backbone's own.
        """
        if self.extras:
            raise ValueError(f"a record with extras ({sorted(self.extras)}) cannot be split by image")
        part = lambda d: {k: v[start:stop] for k, v in d.items()}  # noqa: E731
        return replace(
            self, attn=part(self.attn), keys=part(self.keys), head_weights=part(self.head_weights),
            query=None if self.query is None else self.query[start:stop],
            pixels=None if self.pixels is None else self.pixels[start:stop],
        )

    def to(self, device: torch.device | str) -> AttentionRecord:
        mv = lambda d: {k: v.to(device) for k, v in d.items()}  # noqa: E731
        return replace(
            self, attn=mv(self.attn), keys=mv(self.keys), head_weights=mv(self.head_weights),
            extras=mv(self.extras),
            pixels=None if self.pixels is None else self.pixels.to(device),
        )
