"""FLUX (and other diffusers MM-DiTs of its family) as a :class:`~segment.models.base.Backbone`.

A real image becomes one forward pass of the flow-matching transformer (protocol §3):

1. ``preprocess``: Pillow resize to ``image_size`` (bicubic), scale to ``[-1, 1]``;
2. ``extract``: nearest resize to ``vae_size`` (the protocol's 512 -> 1024), VAE encode
   (``latent_dist.mode()``, the posterior mean: the deterministic choice, where
   ConceptAttention's code draws one posterior sample; then FLUX's ``(z - shift) * scale``;
   the experiments run the VAE in float32, ``vae_dtype``), pack the latents 2 x 2 into
   tokens, noise them to ``t`` with the flow-matching rule ``x_t = t * eps + (1 - t) * z``,
   encode the prompt (``"a {class}"``: T5 tokens for the joint attention, the pooled CLIP
   vector for the modulation), and run the transformer once, stopping after the last block
   anything was captured from. Several noise seeds are run and averaged.

Attention is captured by a processor installed on the selected blocks only (double-stream
``transformer_blocks`` are layers ``0 .. D-1``, single-stream ``single_transformer_blocks``
are ``D .. D+S-1``; real FLUX: 19 + 38 = 57). It calls the block's own processor for the
output (so the model computes exactly what it computes without capture) and recomputes the
probabilities in fp32 from the block's q and k after the q/k RMS norms and the rotary
embedding, text tokens first. Each block's ``(B, H, N, N)`` probabilities go straight to the
shared :class:`~segment.core.reduce.AttentionReducer` (head fusion, layer averaging), so a run
never holds more than one block's matrices plus the reduced state.

The record uses the layout every method reads: ``TokenLayout(prefix=T, grid=(h, w),
cls_index=None, kind="dit")`` with ``T`` text tokens (256 for schnell, 512 for dev) and the
``h x w`` latent-token grid (64 x 64 at 1024 px), and ``record.query`` = per image the T5
token indices of the class word, so multi-bounce starts from the class word and reads the
image part of the joint chain.

ConceptAttention (Helbling et al. 2025) is computed on the side when ``concepts`` are set:
the concept words (``[class] + concepts``, each the first T5 token of the word alone) form a
separate residual stream through the double-stream blocks that attends to
``[concepts; image]`` with the text-stream weights and never influences the image or text
streams. For every captured double-stream layer the record gets the dot products of the
concept and image attention-output vectors (before the output projections),
``extras["concept_scores"]``: ``(B, R, C, P)`` with ``R`` = seeds x layers, ``C`` concepts
(concept 0 is the class), ``P = h * w`` image tokens, and the same scores with the concept
vectors normalised per output dimension, ``extras["concept_scores_normalized"]``
(:func:`segment.core.concept.normalize_concepts`, ConceptAttention's ``--normalize_concepts``).

Loading: from the Hugging Face hub (``repo_id``) or a local diffusers folder
(``path=DIR`` with ``transformer/ vae/ text_encoder/ text_encoder_2/ tokenizer/
tokenizer_2/``). ``diffusers`` and ``transformers`` are imported only inside this module's
functions.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from segment.models.base import Backbone
from segment.models.hub import hub_offline, hub_unavailable
from torch import Tensor

from segment.core.concept import normalize_concepts
from segment.core.record import AttentionRecord, Capture, TokenLayout
from segment.core.reduce import AttentionReducer
from segment.utils import resolve_device

__all__ = [
    "CaptureProcessor",
    "FluxBackbone",
    "FluxComponents",
    "FluxInputs",
    "ForwardCapture",
    "attention_probs",
    "capture_forward",
    "flow_timesteps",
    "flux_pretrained",
    "latent_image_ids",
    "pack_latents",
    "word_token_indices",
]

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
_RESAMPLE = {
    "nearest": Image.NEAREST, "bilinear": Image.BILINEAR,
    "bicubic": Image.BICUBIC, "lanczos": Image.LANCZOS,
}
_SUBFOLDERS = ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
_CLASS = "{class}"


def _dtype(value: str | torch.dtype, what: str) -> torch.dtype:
    dt = value if isinstance(value, torch.dtype) else _DTYPES.get(str(value))
    if dt is None:
        raise ValueError(f"{what} must be one of {sorted(_DTYPES)}, got {value!r}")
    return dt


def _place(module: Any, device: torch.device, dtype: torch.dtype) -> None:
    """Move a module; cast only when some floating parameter has another dtype (models
    loaded with ``torch_dtype`` are not cast again)."""
    if any(p.is_floating_point() and p.dtype != dtype for p in module.parameters()):
        module.to(dtype=dtype)
    module.to(device=device)


def _pair(size: int | Sequence[int], what: str) -> tuple[int, int]:
    if isinstance(size, int):
        return (size, size)
    vals = tuple(int(v) for v in size)
    if len(vals) != 2 or min(vals) < 1:
        raise ValueError(f"{what} must be a positive int or [H, W], got {size!r}")
    return vals  # type: ignore[return-value]


# --------------------------------------------------------------------------------------
# pure helpers: schedule, packing, token bookkeeping, probabilities
# --------------------------------------------------------------------------------------


def flow_timesteps(
    num_steps: int,
    image_seq_len: int,
    *,
    shift: bool = False,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
) -> Tensor:
    """The FLUX sampling schedule ``t_0 = 1 > t_1 > ... > t_K = 0`` (float64).

    Unshifted (schnell): ``linspace(1, 0, K + 1)``. Shifted (dev): each ``t`` is mapped by
    ``exp(mu) / (exp(mu) + 1 / t - 1)`` with ``mu`` linear in the number of image tokens from
    ``base_shift`` at ``base_seq_len`` to ``max_shift`` at ``max_seq_len``.

    Args:
        num_steps: ``K >= 1`` sampling steps.
        image_seq_len: image tokens ``h * w`` (only used when ``shift``).
        shift: apply the resolution-dependent shift.

    Returns:
        ``(K + 1,)`` timesteps in ``[0, 1]``.
    """
    if int(num_steps) < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    t = torch.linspace(1.0, 0.0, int(num_steps) + 1, dtype=torch.float64)
    if shift:
        m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
        mu = base_shift + m * (image_seq_len - base_seq_len)
        inner = t[1:-1]
        t[1:-1] = math.exp(mu) / (math.exp(mu) + (1.0 / inner - 1.0))
    return t


def pack_latents(latents: Tensor) -> Tensor:
    """2 x 2 patches of VAE latents as tokens, row-major over the token grid.

    Args:
        latents: ``(B, C, 2h, 2w)``.

    Returns:
        ``(B, h * w, 4 C)``; token ``r * w + c`` holds latent pixels ``(2r..2r+1, 2c..2c+1)``.
    """
    b, c, hh, ww = latents.shape
    if hh % 2 or ww % 2:
        raise ValueError(f"latents must have an even height and width to pack 2x2, got {hh}x{ww}")
    x = latents.view(b, c, hh // 2, 2, ww // 2, 2).permute(0, 2, 4, 1, 3, 5)  # (B, h, w, C, 2, 2)
    return x.reshape(b, (hh // 2) * (ww // 2), c * 4)


def latent_image_ids(grid: tuple[int, int], device: torch.device | str = "cpu") -> Tensor:
    """RoPE position ids ``(h * w, 3)`` of the image tokens: ``[0, row, col]``, row-major."""
    h, w = grid
    rows = torch.arange(h, device=device).repeat_interleave(w)
    cols = torch.arange(w, device=device).repeat(h)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).float()


def word_token_indices(offsets: Sequence[Sequence[int]], span: tuple[int, int]) -> tuple[int, ...]:
    """Indices of the tokens whose character span overlaps ``span``.

    Args:
        offsets: per token ``(start, end)`` character offsets from a fast tokenizer
            (special and padding tokens have ``start == end``).
        span: ``(start, end)`` of the word in the prompt.

    Returns:
        Sorted token indices (empty when the word was truncated away).
    """
    a, b = span
    return tuple(i for i, (s, e) in enumerate(offsets) if e > s and s < b and e > a)


def attention_probs(q: Tensor, k: Tensor, mask: Tensor | None = None) -> Tensor:
    """Softmax attention probabilities in fp32 from queries and keys as diffusers holds them.

    Args:
        q: ``(B, N, H, D)`` queries (after q norm and rotary embedding).
        k: ``(B, M, H, D)`` keys.
        mask: optional boolean (``True`` = attend) or additive mask broadcastable to
            ``(B, H, N, M)``.

    Returns:
        ``(B, H, N, M)`` float32 rows summing to one.
    """
    scale = q.shape[-1] ** -0.5
    qf = q.transpose(1, 2).float()
    kf = k.transpose(1, 2).float()
    logits = torch.matmul(qf * scale, kf.transpose(-1, -2))  # (B, H, N, M)
    if mask is not None:
        if mask.dtype == torch.bool:
            logits.masked_fill_(~mask, float("-inf"))
        else:
            logits.add_(mask.float())
    # softmax in place: one (B, H, N, M) buffer
    logits.sub_(logits.amax(-1, keepdim=True)).exp_()
    return logits.div_(logits.sum(-1, keepdim=True))


# --------------------------------------------------------------------------------------
# capture machinery: a processor on the selected blocks, hooks for the concept stream
# --------------------------------------------------------------------------------------


@dataclass
class FluxInputs:
    """One transformer call's inputs (what ``FluxPipeline`` would pass).

    Attributes:
        latents: ``(B, P, C_in)`` packed noisy latents.
        img_ids: ``(P, 3)`` image position ids.
        text: ``(B, T, J)`` T5 hidden states.
        txt_ids: ``(T, 3)`` text position ids (zeros).
        pooled: ``(B, J_pooled)`` pooled CLIP embedding.
        timestep: ``(B,)`` flow time ``t`` in ``[0, 1]``.
        guidance: ``(B,)`` guidance strength for guidance-distilled models (FLUX-dev).
    """

    latents: Tensor
    img_ids: Tensor
    text: Tensor
    txt_ids: Tensor
    pooled: Tensor
    timestep: Tensor
    guidance: Tensor | None = None


@dataclass
class ForwardCapture:
    """What one captured transformer call produced besides the reducer's state.

    Attributes:
        output: ``(B, P, C_out)`` model prediction, ``None`` when the forward stopped early.
        concept_scores: layer -> ``(B, C, P)`` concept-image output dot products.
        concept_scores_normalized: the same with the concept vectors normalised per output
            dimension (:func:`segment.core.concept.normalize_concepts`).
        blocks_run: blocks that ran (the forward stops after the last needed one).
    """

    output: Tensor | None
    concept_scores: dict[int, Tensor] = field(default_factory=dict)
    concept_scores_normalized: dict[int, Tensor] = field(default_factory=dict)
    blocks_run: int = 0


class _Stop(Exception):
    """Raised after the last needed block to skip the rest of the forward."""


def _split_heads(x: Tensor, head_dim: int) -> Tensor:
    return x.unflatten(-1, (-1, head_dim))  # (B, S, H, D)


def _joint_qkv(
    attn: Any, hidden: Tensor, context: Tensor | None, rope: tuple[Tensor, Tensor] | None
) -> tuple[Tensor, Tensor, Tensor]:
    """The block's q, k, v ``(B, S, H, D)`` exactly as ``FluxAttnProcessor`` forms them:
    projections, q/k RMS norms, ``[text; image]`` concatenation, rotary embedding."""
    from diffusers.models.embeddings import apply_rotary_emb

    if getattr(attn, "fused_projections", False):
        q, k, v = attn.to_qkv(hidden).chunk(3, dim=-1)
    else:
        q, k, v = attn.to_q(hidden), attn.to_k(hidden), attn.to_v(hidden)
    q, k, v = (_split_heads(t, attn.head_dim) for t in (q, k, v))
    q, k = attn.norm_q(q), attn.norm_k(k)
    if context is not None and attn.added_kv_proj_dim is not None:
        cq, ck, cv = _context_qkv(attn, context)
        q, k, v = torch.cat([cq, q], 1), torch.cat([ck, k], 1), torch.cat([cv, v], 1)
    if rope is not None:
        q = apply_rotary_emb(q, rope, sequence_dim=1)
        k = apply_rotary_emb(k, rope, sequence_dim=1)
    return q, k, v


def _context_qkv(attn: Any, context: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Text-stream q, k, v ``(B, T, H, D)`` of a double-stream block (after q/k norms)."""
    if getattr(attn, "fused_projections", False) and hasattr(attn, "to_added_qkv"):
        cq, ck, cv = attn.to_added_qkv(context).chunk(3, dim=-1)
    else:
        cq, ck, cv = attn.add_q_proj(context), attn.add_k_proj(context), attn.add_v_proj(context)
    cq, ck, cv = (_split_heads(t, attn.head_dim) for t in (cq, ck, cv))
    return attn.norm_added_q(cq), attn.norm_added_k(ck), cv


def _attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """fp32 attention output ``(B, Nq, H * D)`` for ``(B, S, H, D)`` inputs (no projection)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float()
    )  # (B, H, Nq, D)
    return out.transpose(1, 2).flatten(2)


class _ConceptStream:
    """ConceptAttention's concept residual stream through the double-stream blocks.

    The concept tokens are updated with the text-stream weights of each block
    (``norm1_context``, ``add_*_proj``, ``to_add_out``, ``ff_context``) and attend to
    ``[concepts; image]``; nothing flows back into the image or text streams. The
    modulation uses the timestep embedding with a zero pooled vector (as the reference).
    """

    def __init__(self, tokens: Tensor, last_layer: int, score_layers: set[int]) -> None:
        self.tokens = tokens  # (B, C, J) T5 embeddings of the concept words
        self.last_layer = last_layer
        self.score_layers = score_layers
        self.hidden: Tensor | None = None  # (B, C, dim)
        self.temb: Tensor | None = None
        self.mod: tuple[Tensor, ...] | None = None
        self.norm: Tensor | None = None
        self.attn_out: Tensor | None = None  # (B, C, H * D) fp32, before to_add_out
        self.scores: dict[int, Tensor] = {}
        self.scores_normalized: dict[int, Tensor] = {}

    def start(self, transformer: Any, temb_args: tuple[Any, ...]) -> None:
        """Concept temb (timestep [+ guidance] with a zero pooled vector) and the embedded
        concept tokens; ``temb_args`` are the model's own ``time_text_embed`` arguments."""
        *head, pooled = temb_args
        self.temb = transformer.time_text_embed(*head, torch.zeros_like(pooled))
        self.hidden = transformer.context_embedder(self.tokens.to(pooled.dtype))

    def before_block(self, block: Any) -> None:
        norm, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1_context(self.hidden, emb=self.temb)
        self.norm, self.mod = norm, (gate_msa, shift_mlp, scale_mlp, gate_mlp)

    def attend(self, attn: Any, q: Tensor, k: Tensor, v: Tensor, text_len: int) -> Tensor:
        """Concept attention output ``(B, C, H * D)`` over ``[concepts; image]``; ``q, k, v``
        are the block's joint ``[text; image]`` tensors (image part already rotated; the
        concepts, like the text, sit at position id 0 where the rotation is the identity)."""
        cq, ck, cv = _context_qkv(attn, self.norm)
        keys = torch.cat([ck, k[:, text_len:]], 1)
        vals = torch.cat([cv, v[:, text_len:]], 1)
        self.attn_out = _attend(cq, keys, vals)
        return self.attn_out

    def after_block(self, block: Any) -> None:
        gate_msa, shift_mlp, scale_mlp, gate_mlp = self.mod
        h = self.hidden
        out = block.attn.to_add_out(self.attn_out.to(h.dtype))
        h = h + gate_msa.unsqueeze(1) * out
        x = block.norm2_context(h) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        h = h + gate_mlp.unsqueeze(1) * block.ff_context(x)
        if h.dtype == torch.float16:
            h = h.clip(-65504, 65504)
        self.hidden, self.norm, self.mod, self.attn_out = h, None, None, None


class _Tap:
    """Shared state of one captured forward: the reducer and the concept stream."""

    def __init__(
        self,
        reducer: AttentionReducer | None,
        text_len: int,
        concept: _ConceptStream | None,
    ) -> None:
        self.reducer = reducer
        self.text_len = text_len
        self.concept = concept

    def wants_attention(self, layer: int) -> bool:
        return self.reducer is not None and self.reducer.wants(layer)

    def in_concept_stream(self, layer: int) -> bool:
        return self.concept is not None and layer <= self.concept.last_layer


class CaptureProcessor:
    """Attention processor that returns exactly what the block's own processor returns and
    hands the block's fp32 attention probabilities ``(B, H, N, N)`` (text tokens first) to the
    reducer; on concept-stream blocks it also computes ConceptAttention's vectors.

    Args:
        original: the processor it replaces (called for the output).
        layer: global block index (double-stream first, then single-stream).
        tap: shared capture state.
    """

    def __init__(self, original: Any, layer: int, tap: _Tap) -> None:
        self.original = original
        self.layer = layer
        self.tap = tap

    def __call__(
        self,
        attn: Any,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        image_rotary_emb: tuple[Tensor, Tensor] | None = None,
    ) -> Any:
        out = self.original(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        tap, layer = self.tap, self.layer
        want_attn = tap.wants_attention(layer)
        concept = tap.concept if tap.in_concept_stream(layer) else None
        if not want_attn and concept is None:
            return out
        with torch.no_grad():
            q, k, v = _joint_qkv(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
            text_len = (
                encoder_hidden_states.shape[1] if encoder_hidden_states is not None else tap.text_len
            )
            probs = None
            if want_attn:
                probs = attention_probs(q, k, attention_mask)  # (B, H, N, N)
                keys = k.transpose(1, 2) if tap.reducer.capture.keys else None
                tap.reducer.update(layer, probs, keys)
            if concept is not None:
                c_out = concept.attend(attn, q, k, v, text_len)  # (B, C, H*D)
                if layer in concept.score_layers:
                    if probs is not None:  # reuse: image rows of the probabilities @ v
                        img = torch.matmul(probs[:, :, text_len:], v.transpose(1, 2).float())
                        img = img.transpose(1, 2).flatten(2)
                    else:
                        img = _attend(q[:, text_len:], k, v)  # (B, P, H*D)
                    img_t = img.transpose(1, 2)
                    concept.scores[layer] = torch.matmul(c_out, img_t)  # (B, C, P)
                    concept.scores_normalized[layer] = torch.matmul(normalize_concepts(c_out), img_t)
            del probs
        return out


def _blocks(transformer: Any) -> list[Any]:
    return list(transformer.transformer_blocks) + list(transformer.single_transformer_blocks)


def capture_forward(
    transformer: Any,
    inputs: FluxInputs,
    *,
    reducer: AttentionReducer | None = None,
    concepts: Tensor | None = None,
    concept_layers: Sequence[int] = (),
    stop_early: bool = True,
) -> ForwardCapture:
    """One transformer call with attention captured on the reducer's layers.

    Processors are installed on the needed blocks only and the originals restored
    afterwards, whatever happens.

    Args:
        transformer: a diffusers ``FluxTransformer2DModel``.
        inputs: the call's inputs.
        reducer: receives ``(B, H, N, N)`` fp32 probabilities of its layers (``N = T + P``).
        concepts: ``(B, C, J)`` T5 embeddings of the concept tokens (ConceptAttention).
        concept_layers: double-stream layers to score concepts on.
        stop_early: stop after the last block anything is captured from.

    Returns:
        :class:`ForwardCapture`.
    """
    blocks = _blocks(transformer)
    n_double = len(transformer.transformer_blocks)
    attn_layers = set(reducer.layers) if reducer is not None else set()
    score_layers = {int(i) for i in concept_layers}
    bad = sorted(i for i in score_layers if not 0 <= i < n_double)
    if bad:
        raise ValueError(
            f"concept layers {bad} are not double-stream blocks (0..{n_double - 1})"
        )
    concept = None
    if concepts is not None and score_layers:
        concept = _ConceptStream(concepts, max(score_layers), score_layers)
    tap = _Tap(reducer, inputs.text.shape[1], concept)
    needed = set(attn_layers) | (set(range(concept.last_layer + 1)) if concept else set())
    last = max(needed) if needed else len(blocks) - 1

    originals: dict[int, Any] = {}
    handles: list[Any] = []
    try:
        for i in sorted(needed):
            a = blocks[i].attn
            originals[i] = a.processor
            a.set_processor(CaptureProcessor(originals[i], i, tap))
        if concept is not None:
            busy = [False]

            def temb_hook(module: Any, args: tuple[Any, ...], output: Tensor) -> None:
                if not busy[0]:
                    busy[0] = True
                    try:
                        concept.start(transformer, args)
                    finally:
                        busy[0] = False

            handles.append(transformer.time_text_embed.register_forward_hook(temb_hook))
            for i in range(concept.last_layer + 1):
                blk = blocks[i]
                handles.append(blk.register_forward_pre_hook(lambda m, a: concept.before_block(m)))
                handles.append(blk.register_forward_hook(lambda m, a, o: concept.after_block(m)))
        ran = [0]
        for blk in blocks:
            handles.append(blk.register_forward_hook(lambda m, a, o: ran.__setitem__(0, ran[0] + 1)))
        if stop_early and last < len(blocks) - 1:

            def stop(module: Any, args: Any, output: Any) -> None:
                raise _Stop

            handles.append(blocks[last].register_forward_hook(stop))
        output = None
        try:
            output = transformer(
                hidden_states=inputs.latents,
                encoder_hidden_states=inputs.text,
                pooled_projections=inputs.pooled,
                timestep=inputs.timestep,
                img_ids=inputs.img_ids,
                txt_ids=inputs.txt_ids,
                guidance=inputs.guidance,
                return_dict=False,
            )[0]
        except _Stop:
            pass
    finally:
        for h in handles:
            h.remove()
        for i, proc in originals.items():
            blocks[i].attn.set_processor(proc)
    return ForwardCapture(
        output=output,
        concept_scores=dict(concept.scores) if concept else {},
        concept_scores_normalized=dict(concept.scores_normalized) if concept else {},
        blocks_run=ran[0],
    )


# --------------------------------------------------------------------------------------
# the backbone
# --------------------------------------------------------------------------------------


@dataclass
class FluxComponents:
    """The parts of a FLUX pipeline the backbone runs (no scheduler: one forward pass).

    Attributes:
        transformer: ``FluxTransformer2DModel``.
        vae: ``AutoencoderKL`` with 16 latent channels (``shift_factor``, ``scaling_factor``).
        text_encoder: ``CLIPTextModel`` (pooled vector).
        text_encoder_2: ``T5EncoderModel`` (token embeddings).
        tokenizer: CLIP tokenizer.
        tokenizer_2: T5 tokenizer; must be a fast tokenizer (offsets locate the class word).
    """

    transformer: Any
    vae: Any
    text_encoder: Any
    text_encoder_2: Any
    tokenizer: Any
    tokenizer_2: Any


@dataclass
class _Prompts:
    text: Tensor  # (B, T, J)
    pooled: Tensor  # (B, J_pooled)
    query: list[tuple[int, ...]]
    query_mask: Tensor  # (B, T) bool


class FluxBackbone(Backbone):
    """A FLUX transformer read as Markov chains over its joint text-image attention.

    Args:
        components: the loaded models and tokenizers.
        name: short name for tables and manifests.
        image_size: ``int`` or ``(H, W)`` pixels of ``preprocess`` (protocol: 512).
        resample: Pillow filter of that resize (``bicubic``, ``bilinear``, ``nearest``,
            ``lanczos``).
        vae_size: ``int`` or ``(H, W)`` the image is resized to before the VAE (protocol:
            1024), ``None`` = as preprocessed. Must be a multiple of 16 (VAE 8 x, packing 2 x).
        vae_resize: ``F.interpolate`` mode of that resize (protocol: ``nearest``).
        max_sequence_length: T5 tokens ``T`` (schnell 256, dev 512).
        clip_max_length: CLIP tokens of the pooled prompt (77).
        prompt_template: prompt with a ``{class}`` placeholder (protocol: ``"a {class}"``).
        default_class: class name used when ``extract`` gets no prompts (``None`` = error).
        concepts: ConceptAttention's extra concept words (the class is concept 0); empty =
            no concept stream.
        num_steps: sampling steps of the schedule (schnell: 4).
        timestep_index: index into the schedule ``t_0 .. t_K`` (protocol: 2 -> ``t = 0.5``;
            ConceptAttention's experiment default 3 -> ``t = 0.25``).
        shift_schedule: resolution-shifted schedule (dev-style) instead of ``linspace``.
        timestep: explicit ``t`` in ``[0, 1]``, overrides the schedule when set.
        seeds: noise seeds; their captures are averaged (each image gets the same noise for
            a seed whatever the batch).
        guidance: guidance strength for guidance-distilled models (FLUX-dev; diffusers'
            default 3.5); ignored by models without guidance embeddings.
        pooled_prompt: the modulation's pooled text vector: ``clip`` (the prompt's pooled
            CLIP embedding, as FluxPipeline) or ``zeros`` (ConceptAttention's segmentation
            code passes its zeroed concept vector there instead of the caption's).
        dtype: weights dtype, ``bfloat16`` / ``float16`` / ``float32``.
        vae_dtype: VAE dtype (``None`` = ``dtype``).
        text_dtype: CLIP and T5 dtype (``None`` = ``dtype``); T5 overflows in ``float16``,
            so with ``dtype=float16`` keep it at ``bfloat16`` or ``float32``.
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:N``.
        offload: keep every component on the CPU and move each to the device only while it
            runs (text encoders, VAE, transformer), like diffusers' model CPU offload.
    """

    text_conditioned = True  # prompted with a class word per image (default_class without one)
    provides_pixels = True  # records carry the preprocessed input as RGB in [0, 1]
    kind = "dit"

    def __init__(
        self,
        components: FluxComponents,
        *,
        name: str = "flux",
        image_size: int | Sequence[int] = 512,
        resample: str = "bicubic",
        vae_size: int | Sequence[int] | None = 1024,
        vae_resize: str = "nearest",
        max_sequence_length: int = 256,
        clip_max_length: int = 77,
        prompt_template: str = "a {class}",
        default_class: str | None = None,
        concepts: Sequence[str] = ("background", "floor", "tree", "person", "grass", "face"),
        num_steps: int = 4,
        timestep_index: int = 2,
        shift_schedule: bool = False,
        timestep: float | None = None,
        seeds: Sequence[int] = (0,),
        guidance: float | None = 3.5,
        pooled_prompt: str = "clip",
        dtype: str | torch.dtype = "bfloat16",
        vae_dtype: str | torch.dtype | None = None,
        text_dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = "auto",
        offload: bool = False,
    ) -> None:
        self.name = name
        self.device = resolve_device(device)
        self.dtype = _dtype(dtype, "model.dtype")
        self.vae_dtype = _dtype(vae_dtype, "model.vae_dtype") if vae_dtype else self.dtype
        self.text_dtype = _dtype(text_dtype, "model.text_dtype") if text_dtype else self.dtype
        self.offload = bool(offload)
        c = components
        self.transformer = c.transformer.eval().requires_grad_(False)
        self.vae = c.vae.eval().requires_grad_(False)
        self.text_encoder = c.text_encoder.eval().requires_grad_(False)
        self.text_encoder_2 = c.text_encoder_2.eval().requires_grad_(False)
        self.tokenizer, self.tokenizer_2 = c.tokenizer, c.tokenizer_2
        if not getattr(self.tokenizer_2, "is_fast", False):
            raise ValueError(
                "tokenizer_2 (T5) must be a fast tokenizer (it gives the character offsets that"
                f" locate the class word), got {type(self.tokenizer_2).__name__}"
            )
        home = torch.device("cpu") if self.offload else self.device
        for module, dt in ((self.transformer, self.dtype), (self.text_encoder, self.text_dtype),
                           (self.text_encoder_2, self.text_dtype), (self.vae, self.vae_dtype)):
            _place(module, home, dt)

        cfg = self.transformer.config
        self.num_double = len(self.transformer.transformer_blocks)
        self.num_layers = self.num_double + len(self.transformer.single_transformer_blocks)
        self.num_heads = int(cfg.num_attention_heads)
        self.guidance_embeds = bool(getattr(cfg, "guidance_embeds", False))
        vcfg = self.vae.config
        self.latent_channels = int(vcfg.latent_channels)
        self.vae_factor = 2 ** (len(vcfg.block_out_channels) - 1)
        self.vae_shift = float(getattr(vcfg, "shift_factor", None) or 0.0)
        self.vae_scale = float(vcfg.scaling_factor)
        if self.latent_channels * 4 != int(cfg.in_channels):
            raise ValueError(
                f"the VAE has {self.latent_channels} latent channels (x4 packed ="
                f" {4 * self.latent_channels}) but the transformer takes {cfg.in_channels}"
            )

        self.image_size = _pair(image_size, "model.image_size")
        if resample not in _RESAMPLE:
            raise ValueError(f"model.resample must be one of {sorted(_RESAMPLE)}, got {resample!r}")
        self.resample = resample
        self.vae_size = _pair(vae_size, "model.vae_size") if vae_size is not None else None
        if vae_resize not in ("nearest", "nearest-exact", "bilinear", "bicubic", "area"):
            raise ValueError(f"model.vae_resize must be an F.interpolate mode, got {vae_resize!r}")
        self.vae_resize = vae_resize
        self._check_vae_size(self.vae_size or self.image_size, "model.vae_size" if self.vae_size else "model.image_size")
        self.max_sequence_length = int(max_sequence_length)
        self.clip_max_length = int(clip_max_length)
        if self.max_sequence_length < 2:
            raise ValueError(f"model.max_sequence_length must be >= 2, got {max_sequence_length}")
        if prompt_template.count(_CLASS) != 1:
            raise ValueError(
                f"model.prompt_template must contain {_CLASS} exactly once, got {prompt_template!r}"
            )
        self.prompt_template = prompt_template
        self.default_class = default_class
        self.concepts = tuple(str(w) for w in (concepts or ()))
        self.num_steps = int(num_steps)
        self.timestep_index = int(timestep_index)
        self.shift_schedule = bool(shift_schedule)
        if not 0 <= self.timestep_index <= self.num_steps:
            raise ValueError(
                f"model.timestep_index must lie in [0, num_steps={self.num_steps}], got {timestep_index}"
            )
        if timestep is not None and not 0.0 <= float(timestep) <= 1.0:
            raise ValueError(f"model.timestep must lie in [0, 1], got {timestep}")
        self.timestep = None if timestep is None else float(timestep)
        self.seeds = tuple(int(s) for s in seeds)
        if not self.seeds:
            raise ValueError("model.seeds must list at least one noise seed")
        self.guidance = None if guidance is None else float(guidance)
        if self.guidance_embeds and self.guidance is None:
            raise ValueError(f"{name} is guidance-distilled: set model.guidance (e.g. 3.5)")
        grid = self.grid_size()
        #: pixels of the preprocessed image per latent token (at least 1)
        self.patch_size = (max(1, self.image_size[0] // grid[0]), max(1, self.image_size[1] // grid[1]))
        if pooled_prompt not in ("clip", "zeros"):
            raise ValueError(f"model.pooled_prompt must be 'clip' or 'zeros', got {pooled_prompt!r}")
        self.pooled_prompt = pooled_prompt
        self._concept_cache: dict[str, Tensor] = {}

    # ----------------------------------------------------------------------------------
    # sizes and schedule
    # ----------------------------------------------------------------------------------

    def _check_vae_size(self, size: tuple[int, int], what: str) -> None:
        m = 2 * self.vae_factor
        h, w = size
        if h % m or w % m:
            raise ValueError(
                f"{what} {h}x{w} must be a multiple of {m} (VAE {self.vae_factor}x, 2x2 packing)"
            )

    def grid_size(self, image_size: tuple[int, int] | None = None) -> tuple[int, int]:
        """Latent-token grid ``(h, w)`` for a preprocessed input of ``image_size`` pixels."""
        size = self.vae_size or image_size or self.image_size
        m = 2 * self.vae_factor
        return (size[0] // m, size[1] // m)

    def noise_level(self, grid: tuple[int, int] | None = None) -> float:
        """The flow time ``t`` of the forward pass."""
        if self.timestep is not None:
            return self.timestep
        h, w = grid or self.grid_size()
        return float(flow_timesteps(self.num_steps, h * w, shift=self.shift_schedule)[self.timestep_index])

    # ----------------------------------------------------------------------------------
    # input
    # ----------------------------------------------------------------------------------

    def preprocess(self, image: Image.Image) -> Tensor:
        """PIL image -> ``(3, H, W)`` in ``[-1, 1]``: RGB, Pillow resize to ``image_size``."""
        if image.mode != "RGB":
            image = image.convert("RGB")
        h, w = self.image_size
        if image.size != (w, h):
            image = image.resize((w, h), _RESAMPLE[self.resample])
        x = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
        return x * 2.0 - 1.0

    @contextlib.contextmanager
    def _on_device(self, module: Any) -> Iterator[None]:
        if not self.offload:
            yield
            return
        module.to(self.device)
        try:
            yield
        finally:
            module.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    @torch.no_grad()
    def encode_images(self, pixels: Tensor) -> Tensor:
        """``(B, 3, H, W)`` pixels in ``[-1, 1]`` -> ``(B, 16, 2h, 2w)`` scaled VAE latents.

        The latent is ``latent_dist.mode()``, the posterior mean: deterministic, so a run
        depends only on the noise seeds (ConceptAttention's code samples the posterior)."""
        if pixels.dim() != 4 or pixels.shape[1] != 3:
            raise ValueError(f"pixels must be (B, 3, H, W), got {tuple(pixels.shape)}")
        x = pixels.to(self.device, torch.float32)
        if self.vae_size is not None and tuple(x.shape[-2:]) != self.vae_size:
            x = F.interpolate(x, size=self.vae_size, mode=self.vae_resize)
        self._check_vae_size((x.shape[-2], x.shape[-1]), "input")
        with self._on_device(self.vae):
            z = self.vae.encode(x.to(self.vae_dtype)).latent_dist.mode()
        return (z.float() - self.vae_shift) * self.vae_scale

    def _class_names(self, prompts: Sequence[str] | None, batch: int) -> list[str]:
        if prompts is None:
            if self.default_class is None:
                raise ValueError(
                    f"{self.name} needs a class name per image: pass prompts=[...] (segment-eval"
                    " passes the dataset's class names) or set model.default_class"
                )
            return [self.default_class] * batch
        names = [prompts] if isinstance(prompts, str) else list(prompts)
        if len(names) != batch:
            raise ValueError(f"got {len(names)} prompts for {batch} images")
        out = []
        for n in names:
            n = str(n).replace("_", " ").strip()
            if not n:
                raise ValueError("an empty class name was passed as a prompt")
            out.append(n)
        return out

    @torch.no_grad()
    def encode_prompts(self, names: Sequence[str]) -> _Prompts:
        """T5 token embeddings, pooled CLIP vectors and the class word's token indices."""
        pre = self.prompt_template.index(_CLASS)
        texts = [self.prompt_template.replace(_CLASS, n) for n in names]
        tok = self.tokenizer_2(
            texts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
            return_offsets_mapping=True, return_tensors="pt",
        )
        query = []
        for i, n in enumerate(names):
            offsets = tok["offset_mapping"][i].tolist()
            idx = word_token_indices(offsets, (pre, pre + len(n)))
            if not idx or max(offsets[j][1] for j in idx) < pre + len(n.rstrip()):
                raise ValueError(
                    f"the class word {n!r} of prompt {texts[i]!r} does not fit in"
                    f" max_sequence_length={self.max_sequence_length} T5 tokens"
                )
            query.append(idx)
        mask = torch.zeros(len(names), self.max_sequence_length, dtype=torch.bool)
        for i, idx in enumerate(query):
            mask[i, list(idx)] = True
        clip = self.tokenizer(
            texts, padding="max_length", max_length=self.clip_max_length, truncation=True,
            return_tensors="pt",
        )
        with self._on_device(self.text_encoder_2):
            text = self.text_encoder_2(tok["input_ids"].to(self.device))[0]
        if self.pooled_prompt == "zeros":
            dim = int(self.transformer.config.pooled_projection_dim)
            pooled = torch.zeros(len(names), dim, device=self.device)
        else:
            with self._on_device(self.text_encoder):
                pooled = self.text_encoder(clip["input_ids"].to(self.device)).pooler_output
        return _Prompts(text=text.to(self.dtype), pooled=pooled.to(self.dtype), query=query,
                        query_mask=mask)

    @torch.no_grad()
    def concept_tokens(self, words: Sequence[str]) -> Tensor:
        """``(C, J)`` ConceptAttention concept tokens: the first T5 token embedding of each word
        encoded alone (padded to ``max_sequence_length`` as the prompt). Cached per word."""
        todo = [w for w in dict.fromkeys(words) if w not in self._concept_cache]
        if todo:
            tok = self.tokenizer_2(
                todo, padding="max_length", max_length=self.max_sequence_length,
                truncation=True, return_tensors="pt",
            )
            with self._on_device(self.text_encoder_2):
                emb = self.text_encoder_2(tok["input_ids"].to(self.device))[0]
            for w, e in zip(todo, emb[:, 0]):
                self._concept_cache[w] = e.to(self.dtype)
        return torch.stack([self._concept_cache[w].to(self.device) for w in words])

    def _noise(self, seed: int, shape: tuple[int, ...], batch: int) -> Tensor:
        g = torch.Generator(device="cpu").manual_seed(int(seed))
        eps = torch.randn((1, *shape), generator=g, dtype=torch.float32)
        return eps.expand(batch, *shape).to(self.device)

    def _inputs(self, z: Tensor, prompts: _Prompts, eps: Tensor, t: float) -> FluxInputs:
        b = z.shape[0]
        grid = (z.shape[-2] // 2, z.shape[-1] // 2)
        x_t = t * eps + (1.0 - t) * z  # flow matching: x_t = t * eps + (1 - t) * z
        return FluxInputs(
            latents=pack_latents(x_t).to(self.dtype),
            img_ids=latent_image_ids(grid, self.device),
            text=prompts.text,
            txt_ids=torch.zeros(prompts.text.shape[1], 3, device=self.device),
            pooled=prompts.pooled,
            timestep=torch.full((b,), t, device=self.device, dtype=self.dtype),
            guidance=(
                torch.full((b,), self.guidance, device=self.device, dtype=torch.float32)
                if self.guidance_embeds else None
            ),
        )

    # ----------------------------------------------------------------------------------
    # capture
    # ----------------------------------------------------------------------------------

    @torch.no_grad()
    def extract(
        self,
        pixels: Tensor,
        capture: Capture,
        *,
        prompts: Sequence[str] | None = None,
    ) -> AttentionRecord:
        """Noise, one forward per seed, capture per ``capture``; seeds are averaged.

        Args:
            pixels: ``(B, 3, H, W)`` preprocessed images in ``[-1, 1]``.
            capture: layers (global block indices) and on-the-fly reduction.
            prompts: per-image class names (``None`` = ``default_class``).

        Returns:
            The :class:`AttentionRecord`: ``attn`` over ``N = T + h*w`` tokens (text first),
            ``query`` = the class word's T5 tokens per image, ``extras``: ``query_mask``
            ``(B, T)``; with concepts, ``concept_scores`` and ``concept_scores_normalized``
            ``(B, R, C, P)`` (R = seeds x captured double-stream layers, concept 0 = the
            class) and ``concept_layers`` ``(R,)`` the layer of each.
        """
        if pixels.dim() != 4 or pixels.shape[1] != 3:
            raise ValueError(f"pixels must be (B, 3, H, W), got {tuple(pixels.shape)}")
        b = pixels.shape[0]
        names = self._class_names(prompts, b)
        z = self.encode_images(pixels)  # (B, 16, 2h, 2w)
        grid = (z.shape[-2] // 2, z.shape[-1] // 2)
        text = self.encode_prompts(names)
        t_len = text.text.shape[1]
        layout = TokenLayout(
            num_tokens=t_len + grid[0] * grid[1], prefix=t_len, grid=grid, cls_index=None,
            kind="dit",
        )
        layers = capture.resolve(self.num_layers)
        score_layers = [i for i in layers if i < self.num_double] if self.concepts else []
        concepts = None
        if score_layers:
            words = [[n, *self.concepts] for n in names]
            concepts = torch.stack([self.concept_tokens(w) for w in words])  # (B, C, J)
        t = self.noise_level(grid)
        total: AttentionRecord | None = None
        scores: list[Tensor] = []
        scores_norm: list[Tensor] = []
        with self._on_device(self.transformer):
            for seed in self.seeds:
                eps = self._noise(seed, tuple(z.shape[1:]), b)
                reducer = AttentionReducer(capture, self.num_layers, layout)
                res = capture_forward(
                    self.transformer, self._inputs(z, text, eps, t), reducer=reducer,
                    concepts=concepts, concept_layers=score_layers,
                )
                rec = reducer.record((pixels.shape[-2], pixels.shape[-1]))
                total = rec if total is None else _add_records(total, rec)
                scores.extend(res.concept_scores[i] for i in score_layers)
                scores_norm.extend(res.concept_scores_normalized[i] for i in score_layers)
        assert total is not None
        if len(self.seeds) > 1:
            total = _scale_record(total, 1.0 / len(self.seeds))
        # the image the methods refine on: preprocess's input at image_size (e.g. 512 px), not
        # the VAE's size; preprocess scaled it to [-1, 1]
        total.pixels = pixels.to(self.device, torch.float32).add(1.0).mul_(0.5).clamp_(0.0, 1.0)
        total.query = text.query
        total.extras["query_mask"] = text.query_mask.to(self.device)
        if scores:
            total.extras["concept_scores"] = torch.stack(scores, dim=1).float()  # (B, R, C, P)
            total.extras["concept_scores_normalized"] = torch.stack(scores_norm, dim=1).float()
            total.extras["concept_layers"] = torch.tensor(
                score_layers * len(self.seeds), dtype=torch.long, device=self.device
            )  # (R,) the layer of each score map
        return total

    @torch.no_grad()
    def forward_plain(self, pixels: Tensor) -> Tensor:
        """The full transformer forward on the first seed's noisy latents, nothing captured.

        Returns:
            ``(B, P, C_out)`` the flow prediction.
        """
        z = self.encode_images(pixels)
        names = [self.default_class or "object"] * z.shape[0]
        text = self.encode_prompts(names)
        eps = self._noise(self.seeds[0], tuple(z.shape[1:]), z.shape[0])
        inputs = self._inputs(z, text, eps, self.noise_level((z.shape[-2] // 2, z.shape[-1] // 2)))
        with self._on_device(self.transformer):
            return self.transformer(
                hidden_states=inputs.latents, encoder_hidden_states=inputs.text,
                pooled_projections=inputs.pooled, timestep=inputs.timestep,
                img_ids=inputs.img_ids, txt_ids=inputs.txt_ids, guidance=inputs.guidance,
                return_dict=False,
            )[0]


def _add_records(a: AttentionRecord, b: AttentionRecord) -> AttentionRecord:
    """Sum ``b`` into ``a`` (attention, keys, head weights), in place."""
    for d_a, d_b in ((a.attn, b.attn), (a.keys, b.keys), (a.head_weights, b.head_weights)):
        for k, v in d_b.items():
            d_a[k].add_(v)
    return a


def _scale_record(r: AttentionRecord, s: float) -> AttentionRecord:
    for d in (r.attn, r.keys, r.head_weights):
        for v in d.values():
            v.mul_(s)
    return r


# --------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------


def _hub_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _hub_unavailable(repo_id: str, revision: str | None) -> str | None:
    """``None`` when the hub can be asked (the normal path), ``"cached"`` when it cannot
    but the repository's transformer config (the first file :func:`load_components` reads)
    is in the cache, else why it cannot."""
    from huggingface_hub import constants, try_to_load_from_cache

    why = hub_unavailable()
    if why is None:
        return None
    cached = try_to_load_from_cache(repo_id, "transformer/config.json", cache_dir=constants.HF_HUB_CACHE,
                                    revision=revision)
    return "cached" if isinstance(cached, str) else why


def load_components(
    source: str,
    *,
    dtype: torch.dtype,
    vae_dtype: torch.dtype | None = None,
    revision: str | None = None,
    local_files_only: bool = False,
) -> FluxComponents:
    """Load the six FLUX components with their ``from_pretrained`` (hub id or local folder);
    the VAE in ``vae_dtype`` (``None`` = ``dtype``), read straight from the stored weights."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

    common = {"revision": revision, "local_files_only": local_files_only}
    return FluxComponents(
        transformer=FluxTransformer2DModel.from_pretrained(
            source, subfolder="transformer", torch_dtype=dtype, **common),
        vae=AutoencoderKL.from_pretrained(
            source, subfolder="vae", torch_dtype=vae_dtype or dtype, **common),
        text_encoder=CLIPTextModel.from_pretrained(
            source, subfolder="text_encoder", dtype=dtype, **common),
        text_encoder_2=T5EncoderModel.from_pretrained(
            source, subfolder="text_encoder_2", dtype=dtype, **common),
        tokenizer=AutoTokenizer.from_pretrained(source, subfolder="tokenizer", **common),
        tokenizer_2=AutoTokenizer.from_pretrained(source, subfolder="tokenizer_2", **common),
    )


def flux_pretrained(
    repo_id: str = "black-forest-labs/FLUX.1-schnell",
    *,
    path: str | None = None,
    revision: str | None = None,
    local_files_only: bool = False,
    dtype: str | torch.dtype = "bfloat16",
    **kwargs: Any,
) -> FluxBackbone:
    """A FLUX backbone from the hub (``repo_id``) or a local diffusers folder (``path``).

    Args:
        repo_id: Hugging Face id, ``black-forest-labs/FLUX.1-schnell`` or ``-dev`` (gated:
            accept the licence and log in with ``huggingface-cli login`` first).
        path: local diffusers folder; takes precedence over ``repo_id``.
        revision: hub revision.
        local_files_only: only look in the local Hugging Face cache.
        dtype: weights dtype.
        **kwargs: :class:`FluxBackbone` settings.

    Raises:
        FileNotFoundError: when ``path`` is not a diffusers FLUX folder.
        RuntimeError: when the hub cannot be reached or the weights cannot be loaded; the
            message says how to pass a local folder.
    """
    dt = _dtype(dtype, "model.dtype")
    vae_dt = _dtype(kwargs["vae_dtype"], "model.vae_dtype") if kwargs.get("vae_dtype") else None
    if path:
        root = Path(path).expanduser()
        missing = [s for s in _SUBFOLDERS if not (root / s).is_dir()]
        if not root.is_dir() or missing:
            raise FileNotFoundError(
                f"model.path={root} is not a diffusers FLUX folder"
                + (f" (missing {', '.join(s + '/' for s in missing)})" if root.is_dir() else " (no such folder)")
                + f"; it needs {', '.join(s + '/' for s in _SUBFOLDERS)}"
                f" as written by FluxPipeline.save_pretrained or `huggingface-cli download {repo_id}`"
            )
        try:
            comps = load_components(str(root), dtype=dt, vae_dtype=vae_dt, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - any loader error is a bad folder for the user
            raise RuntimeError(
                f"model.path={root}: could not load the FLUX components"
                f" ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            ) from e
    else:
        # no network and nothing cached: say so at once, not after the hub client's retries
        # (about 30 s of warnings); cached and no network: load in offline mode
        why = None if local_files_only else _hub_unavailable(repo_id, revision)
        try:
            if why == "cached":
                with hub_offline():
                    comps = load_components(repo_id, dtype=dt, vae_dtype=vae_dt, revision=revision,
                                            local_files_only=True)
            elif why is not None:
                raise RuntimeError(f"not in the cache {_hub_cache()} and cannot be downloaded: {why}")
            else:
                comps = load_components(repo_id, dtype=dt, vae_dtype=vae_dt, revision=revision,
                                        local_files_only=local_files_only)
        except Exception as e:  # noqa: BLE001 - hub / network / cache / licence errors vary
            raise RuntimeError(
                f"could not load {repo_id!r} from the Hugging Face hub"
                f" ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})."
                f" On an offline machine download it elsewhere (`huggingface-cli download"
                f" {repo_id} --local-dir DIR`) and pass model.path=DIR, or put it in the"
                " Hugging Face cache (HF_HOME). FLUX.1-dev is gated: accept its licence and log in."
            ) from e
    kwargs.setdefault("name", repo_id.rsplit("/", 1)[-1].lower())
    return FluxBackbone(comps, dtype=dt, **kwargs)
