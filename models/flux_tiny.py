"""A tiny random FLUX pipeline built from configs, for tests and smoke runs (``model=flux_tiny``).

Every part is the real class with a tiny config, randomly initialised from a fixed seed:
``FluxTransformer2DModel`` (default 2 double + 2 single blocks, 2 heads of 16 dims, RoPE axes
4 + 6 + 6), ``AutoencoderKL`` (16 latent channels, 8 x downsampling, FLUX's shift 0.1159 and
scale 0.3611), ``CLIPTextModel`` and ``T5EncoderModel`` (32 dims). The tokenizers are built
locally with the ``tokenizers`` library (no hub): a T5-like Unigram model with a metaspace
pre-tokenizer and ``</s>`` appended, and a CLIP-like one with start/end tokens, both over
whole words for common prompt/concept words plus single characters, so that any ASCII class
name tokenizes (to one or several tokens).

The numbers mean nothing; the data flow (VAE, packing, noising, prompt encoding, joint
attention, ConceptAttention stream) is exactly that of the real model.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Any

import torch

from segment.models.flux import FluxBackbone, FluxComponents

__all__ = ["build_tiny_components", "flux_tiny", "tiny_tokenizer"]

# words kept whole (prompt template, ConceptAttention's concepts, a few classes)
_WORDS = (
    "a", "an", "the", "photo", "of", "object", "background", "floor", "tree", "person",
    "grass", "face", "dog", "cat", "bird", "car", "coffee", "cup", "astronaut",
)
_CHARS = string.ascii_lowercase + string.digits + "-'.,&()/"


def tiny_tokenizer(kind: str, max_length: int) -> Any:
    """A fast tokenizer built locally: ``kind="t5"`` (pad 0, ``</s>`` 1, unk 2, ``</s>``
    appended) or ``"clip"`` (``<|startoftext|> ... <|endoftext|>``, padded with end tokens).

    Returns:
        ``transformers.PreTrainedTokenizerFast`` with character offsets.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if kind == "t5":
        specials = ["<pad>", "</s>", "<unk>"]
        single, bos, eos, pad = "$A </s>", None, "</s>", "<pad>"
    elif kind == "clip":
        specials = ["<|startoftext|>", "<|endoftext|>", "<unk>"]
        single, bos, eos, pad = "<|startoftext|> $A <|endoftext|>", "<|startoftext|>", "<|endoftext|>", "<|endoftext|>"
    else:
        raise ValueError(f"kind must be 't5' or 'clip', got {kind!r}")
    vocab = [(s, 0.0) for s in specials]
    vocab += [("\u2581" + w, -2.0) for w in _WORDS]
    vocab += [("\u2581", -8.0)]
    vocab += [("\u2581" + c, -6.0) for c in _CHARS] + [(c, -6.0) for c in _CHARS]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    ids = {s: i for i, s in enumerate(specials)}
    tok.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[(s, ids[s]) for s in specials[:2] if s in single]
    )
    kwargs = {"bos_token": bos} if bos else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=pad, eos_token=eos, unk_token="<unk>",
        model_max_length=max_length, **kwargs,
    )


def build_tiny_components(
    *,
    seed: int = 0,
    num_layers: int = 2,
    num_single_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 16,
    axes_dims_rope: Sequence[int] = (4, 6, 6),
    text_dim: int = 32,
    clip_max_length: int = 16,
    max_sequence_length: int = 16,
    guidance_embeds: bool = False,
) -> FluxComponents:
    """Tiny random FLUX components from configs (deterministic for a seed).

    Args:
        seed: initialisation seed (the global RNG state is left untouched).
        num_layers, num_single_layers: double- and single-stream blocks.
        num_heads, head_dim: attention heads and their size (``sum(axes_dims_rope) ==
            head_dim``).
        text_dim: T5 and CLIP hidden size (joint attention and pooled dims).
        clip_max_length: CLIP positions (the real model: 77).
        max_sequence_length: T5 tokenizer length (informative; the backbone pads to its own).
        guidance_embeds: FLUX-dev-style guidance embedding.
    """
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    if sum(axes_dims_rope) != head_dim:
        raise ValueError(f"axes_dims_rope {tuple(axes_dims_rope)} must sum to head_dim={head_dim}")
    t5_tok = tiny_tokenizer("t5", max_sequence_length)
    clip_tok = tiny_tokenizer("clip", clip_max_length)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=num_layers,
            num_single_layers=num_single_layers, attention_head_dim=head_dim,
            num_attention_heads=num_heads, joint_attention_dim=text_dim,
            pooled_projection_dim=text_dim, guidance_embeds=guidance_embeds,
            axes_dims_rope=tuple(axes_dims_rope),
        )
        vae = AutoencoderKL(
            in_channels=3, out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 8, 16, 16), layers_per_block=1, latent_channels=16,
            norm_num_groups=4, scaling_factor=0.3611, shift_factor=0.1159,
            use_quant_conv=False, use_post_quant_conv=False,
        )
        clip = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(clip_tok), hidden_size=text_dim, intermediate_size=2 * text_dim,
            num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=clip_max_length,
            projection_dim=text_dim, bos_token_id=clip_tok.bos_token_id,
            eos_token_id=clip_tok.eos_token_id, pad_token_id=clip_tok.pad_token_id,
        ))
        t5 = T5EncoderModel(T5Config(
            vocab_size=len(t5_tok), d_model=text_dim, d_kv=8, d_ff=2 * text_dim, num_layers=2,
            num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0,
            feed_forward_proj="gated-gelu", pad_token_id=t5_tok.pad_token_id,
            eos_token_id=t5_tok.eos_token_id, decoder_start_token_id=t5_tok.pad_token_id,
        ))
    return FluxComponents(
        transformer=transformer, vae=vae, text_encoder=clip, text_encoder_2=t5,
        tokenizer=clip_tok, tokenizer_2=t5_tok,
    )


def flux_tiny(
    *,
    seed: int = 0,
    num_layers: int = 2,
    num_single_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 16,
    axes_dims_rope: Sequence[int] = (4, 6, 6),
    text_dim: int = 32,
    clip_max_length: int = 16,
    guidance_embeds: bool = False,
    max_sequence_length: int = 16,
    name: str = "flux_tiny",
    dtype: str | torch.dtype = "float32",
    **kwargs: Any,
) -> FluxBackbone:
    """The tiny random FLUX backbone (``model=flux_tiny``); ``kwargs`` are
    :class:`~segment.models.flux.FluxBackbone` settings."""
    comps = build_tiny_components(
        seed=seed, num_layers=num_layers, num_single_layers=num_single_layers,
        num_heads=num_heads, head_dim=head_dim, axes_dims_rope=axes_dims_rope,
        text_dim=text_dim, clip_max_length=clip_max_length,
        max_sequence_length=max_sequence_length, guidance_embeds=guidance_embeds,
    )
    if guidance_embeds:
        kwargs.setdefault("guidance", 3.5)
    return FluxBackbone(
        comps, name=name, dtype=dtype, max_sequence_length=max_sequence_length,
        clip_max_length=clip_max_length, **kwargs,
    )
