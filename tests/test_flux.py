"""FLUX backbone: capture equals a float64 reference, the model output is untouched, the
layout is right for non-square inputs, ConceptAttention's stream equals the model's own text
stream when fed the same tokens, and the noise / packing / schedule follow diffusers.

Everything runs on a tiny random FLUX built from configs (CPU, seconds)."""

from __future__ import annotations

import math

import pytest
import torch
from segment.eval.runner import TIMING_KEYS
from segment.models.flux import (
    FluxInputs,
    attention_probs,
    capture_forward,
    flow_timesteps,
    flux_pretrained,
    latent_image_ids,
    pack_latents,
    word_token_indices,
)
from segment.models.flux_tiny import build_tiny_components, flux_tiny, tiny_tokenizer

from segment.core.record import AttentionRecord, Capture, TokenLayout
from segment.core.reduce import AttentionReducer
from segment.core.concept import concept_heatmaps, gaussian_blur, normalize_concepts
from segment.methods import ConceptAttention

T = 16  # text tokens of the tiny model


@pytest.fixture(scope="module")
def comps():
    return build_tiny_components(seed=0, num_layers=2, num_single_layers=2)


@pytest.fixture(scope="module")
def backbone():
    return flux_tiny(image_size=64, vae_size=128, device="cpu", default_class="object",
                     seeds=(0,))


def _inputs(transformer, b=2, grid=(3, 5), text=None, pooled=None, seed=0) -> FluxInputs:
    g = torch.Generator().manual_seed(seed)
    cfg = transformer.config
    p = grid[0] * grid[1]
    if text is None:
        text = torch.randn(b, T, cfg.joint_attention_dim, generator=g)
    if pooled is None:
        pooled = torch.randn(b, cfg.pooled_projection_dim, generator=g)
    return FluxInputs(
        latents=torch.randn(b, p, cfg.in_channels, generator=g),
        img_ids=latent_image_ids(grid),
        text=text,
        txt_ids=torch.zeros(text.shape[1], 3),
        pooled=pooled,
        timestep=torch.full((b,), 0.5),
    )


def _call(transformer, x: FluxInputs) -> torch.Tensor:
    return transformer(
        hidden_states=x.latents, encoder_hidden_states=x.text, pooled_projections=x.pooled,
        timestep=x.timestep, img_ids=x.img_ids, txt_ids=x.txt_ids, return_dict=False,
    )[0]


def _blocks(transformer):
    return list(transformer.transformer_blocks) + list(transformer.single_transformer_blocks)


# --------------------------------------------------------------------------------------
# float64 reference of one block's attention, from the module's own weights
# --------------------------------------------------------------------------------------


def _lin(lin, x):
    y = x.double() @ lin.weight.double().T
    return y + lin.bias.double() if lin.bias is not None else y


def _rms(norm, x):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    return y * norm.weight.double() if norm.weight is not None else y


def _rope(x, cos, sin):  # x (B, S, H, D); interleaved (real, imag) pairs
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    rot = torch.stack([-pairs[..., 1], pairs[..., 0]], -1).flatten(-2)
    return x * cos.double()[None, :, None] + rot * sin.double()[None, :, None]


def _reference(attn, hidden, context, rope):
    """float64 probabilities (B, H, N, N) and pre-projection outputs (B, N, H*D)."""
    d = attn.head_dim
    split = lambda t: t.unflatten(-1, (-1, d))  # noqa: E731
    q, k, v = (split(_lin(m, hidden)) for m in (attn.to_q, attn.to_k, attn.to_v))
    q, k = _rms(attn.norm_q, q), _rms(attn.norm_k, k)
    if context is not None:
        cq, ck, cv = (split(_lin(m, context)) for m in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        cq, ck = _rms(attn.norm_added_q, cq), _rms(attn.norm_added_k, ck)
        q, k, v = torch.cat([cq, q], 1), torch.cat([ck, k], 1), torch.cat([cv, v], 1)
    q, k = _rope(q, *rope), _rope(k, *rope)
    logits = torch.einsum("bnhd,bmhd->bhnm", q, k) / math.sqrt(d)
    p = torch.softmax(logits, -1)
    out = torch.einsum("bhnm,bmhd->bnhd", p, v).flatten(2)
    return p, out


def _attn_inputs(transformer, x):
    """Inputs of every block's attention module (one plain forward)."""
    got, handles = {}, []
    for i, blk in enumerate(_blocks(transformer)):
        def pre(mod, args, kwargs, i=i):
            got[i] = (kwargs["hidden_states"], kwargs.get("encoder_hidden_states"),
                      kwargs["image_rotary_emb"])
        handles.append(blk.attn.register_forward_pre_hook(pre, with_kwargs=True))
    outs = {}
    for i, blk in enumerate(_blocks(transformer)):
        handles.append(blk.attn.register_forward_hook(
            lambda m, a, o, i=i: outs.__setitem__(i, o)))
    try:
        with torch.no_grad():
            _call(transformer, x)
    finally:
        for h in handles:
            h.remove()
    return got, outs


# --------------------------------------------------------------------------------------
# pure helpers
# --------------------------------------------------------------------------------------


def test_pack_and_ids_match_flux_pipeline():
    from diffusers import FluxPipeline

    z = torch.randn(2, 16, 6, 10)  # non-square latents -> 3 x 5 tokens
    ref = FluxPipeline._pack_latents(z, 2, 16, 6, 10)
    assert torch.equal(pack_latents(z), ref)
    assert torch.equal(latent_image_ids((3, 5)), FluxPipeline._prepare_latent_image_ids(1, 3, 5, "cpu", torch.float32))
    # token r * w + c holds the latent 2x2 patch at (2r, 2c)
    packed = pack_latents(z)
    r, c = 2, 3
    patch = z[:, :, 2 * r:2 * r + 2, 2 * c:2 * c + 2].reshape(2, -1)
    assert torch.equal(packed[:, r * 5 + c], patch)
    with pytest.raises(ValueError, match="even"):
        pack_latents(torch.randn(1, 16, 5, 6))


def test_flow_timesteps():
    t = flow_timesteps(4, 4096)
    assert torch.allclose(t, torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0], dtype=torch.float64))
    assert t[2] == 0.5 and t[3] == 0.25  # the two published ConceptAttention settings
    # dev shift at 4096 tokens: mu = 1.15, t' = e^mu / (e^mu + 1/t - 1)
    s = flow_timesteps(4, 4096, shift=True)
    mu = 1.15
    want = math.exp(mu) / (math.exp(mu) + 1 / 0.5 - 1)
    assert s[0] == 1.0 and s[-1] == 0.0 and abs(float(s[2]) - want) < 1e-12
    with pytest.raises(ValueError):
        flow_timesteps(0, 16)


def test_word_token_indices():
    # "a golden dog": tokens [a][_gol][den][_dog][</s>][pad]
    offsets = [(0, 1), (1, 5), (5, 8), (8, 12), (0, 0), (0, 0)]
    assert word_token_indices(offsets, (2, 12)) == (1, 2, 3)
    assert word_token_indices(offsets, (9, 12)) == (3,)
    assert word_token_indices(offsets, (20, 25)) == ()


def test_attention_probs_matches_float64_softmax():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 7, 3, 8, generator=g), torch.randn(2, 7, 3, 8, generator=g)
    ref = torch.softmax(torch.einsum("bnhd,bmhd->bhnm", q.double(), k.double()) / math.sqrt(8), -1)
    p = attention_probs(q, k)
    assert p.dtype == torch.float32 and p.shape == (2, 3, 7, 7)
    assert torch.allclose(p.double(), ref, atol=1e-6)
    mask = torch.ones(7, 7, dtype=torch.bool)
    mask[:, 0] = False
    pm = attention_probs(q, k, mask)
    assert torch.all(pm[..., 0] == 0) and torch.allclose(pm.sum(-1), torch.ones(2, 3, 7))
    # bf16 inputs: still fp32 probabilities
    assert attention_probs(q.bfloat16(), k.bfloat16()).dtype == torch.float32


def test_tiny_tokenizers_locate_words():
    t5 = tiny_tokenizer("t5", 24)
    enc = t5(["a golden retriever"], padding="max_length", max_length=24, truncation=True,
             return_offsets_mapping=True)
    idx = word_token_indices(enc["offset_mapping"][0], (2, 18))
    toks = t5.convert_ids_to_tokens(enc["input_ids"][0])
    assert "".join(toks[i] for i in idx).replace("\u2581", " ").strip() == "golden retriever"
    assert toks[idx[-1] + 1] == "</s>" and toks[-1] == "<pad>"
    clip = tiny_tokenizer("clip", 16)
    ids = clip(["a dog"], padding="max_length", max_length=16)["input_ids"][0]
    assert ids[0] == clip.bos_token_id and ids[3] == clip.eos_token_id


# --------------------------------------------------------------------------------------
# the capture processor on the tiny transformer
# --------------------------------------------------------------------------------------


def test_captured_probabilities_equal_float64_reference(comps):
    tr = comps.transformer
    x = _inputs(tr, b=2, grid=(3, 5))
    n = T + 15
    layout = TokenLayout(num_tokens=n, prefix=T, grid=(3, 5), cls_index=None, kind="dit")
    reducer = AttentionReducer(Capture(layers=None, heads="keep", keys=True), 4, layout)
    with torch.no_grad():
        capture_forward(tr, x, reducer=reducer, stop_early=False)
    inputs, outs = _attn_inputs(tr, x)
    for i, blk in enumerate(_blocks(tr)):
        hidden, context, rope = inputs[i]
        p_ref, out_ref = _reference(blk.attn, hidden, context, rope)
        got = reducer.attn[i]
        assert got.shape == (2, 2, n, n) and got.dtype == torch.float32
        assert torch.allclose(got.double(), p_ref, atol=1e-5), f"block {i}"
        assert reducer.keys[i].shape == (2, 2, n, 16)
        # the reference is the block's own attention: it reproduces the module's output
        if i < 2:  # double-stream: (image out, text out) after the output projections
            img, txt = outs[i]
            assert torch.allclose(_lin(blk.attn.to_out[0], out_ref[:, T:]), img.double(), atol=1e-4)
            assert torch.allclose(_lin(blk.attn.to_add_out, out_ref[:, :T]), txt.double(), atol=1e-4)
        else:  # single-stream: the joint output without projection
            assert torch.allclose(out_ref, outs[i].double(), atol=1e-4)


def test_processor_leaves_output_unchanged_and_is_removed(comps):
    tr = comps.transformer
    x = _inputs(tr, b=2, grid=(4, 4))
    before = [type(b.attn.processor) for b in _blocks(tr)]
    with torch.no_grad():
        plain = _call(tr, x)
        layout = TokenLayout(num_tokens=T + 16, prefix=T, grid=(4, 4), cls_index=None, kind="dit")
        red = AttentionReducer(Capture(layers=None, heads="lambda2"), 4, layout)
        res = capture_forward(tr, x, reducer=red, concepts=torch.randn(2, 3, 32),
                              concept_layers=[0, 1], stop_early=False)
    assert torch.equal(res.output, plain)
    assert [type(b.attn.processor) for b in _blocks(tr)] == before
    assert res.blocks_run == 4 and set(res.concept_scores) == {0, 1}
    assert red.weights[0].shape == (2, 2)


def test_stops_after_last_needed_block(comps):
    tr = comps.transformer
    x = _inputs(tr, b=1, grid=(2, 2))
    layout = TokenLayout(num_tokens=T + 4, prefix=T, grid=(2, 2), cls_index=None, kind="dit")
    red = AttentionReducer(Capture(layers=(1,)), 4, layout)
    kinds = {}
    hooks = [b.attn.register_forward_pre_hook(
        lambda m, a, i=i: kinds.__setitem__(i, type(m.processor).__name__))
        for i, b in enumerate(_blocks(tr))]
    try:
        with torch.no_grad():
            res = capture_forward(tr, x, reducer=red)
    finally:
        for h in hooks:
            h.remove()
    assert res.output is None and res.blocks_run == 2 and list(red.attn) == [1]
    # installed on the selected block only; the forward never reached blocks 2 and 3
    assert kinds == {0: "FluxAttnProcessor", 1: "CaptureProcessor"}
    with pytest.raises(ValueError, match="double-stream"):
        capture_forward(tr, x, concepts=torch.randn(1, 2, 32), concept_layers=[2])


def test_concept_stream_equals_text_stream_on_same_tokens(comps):
    """Fed the concept tokens as the text (and a zero pooled vector, as ConceptAttention's
    concept modulation), the model's own text stream *is* the concept stream: its
    pre-projection text and image attention outputs give the expected concept scores at every
    double-stream layer (this checks the stream's update, modulation and rotary handling)."""
    tr = comps.transformer
    g = torch.Generator().manual_seed(3)
    concepts = torch.randn(2, 5, 32, generator=g)
    x = _inputs(tr, b=2, grid=(3, 4), text=concepts, pooled=torch.zeros(2, 32))
    pre = {}
    handles = []
    for i, blk in enumerate(tr.transformer_blocks):
        handles.append(blk.attn.to_add_out.register_forward_pre_hook(
            lambda m, a, i=i: pre.__setitem__(("c", i), a[0])))
        handles.append(blk.attn.to_out[0].register_forward_pre_hook(
            lambda m, a, i=i: pre.__setitem__(("x", i), a[0])))
    try:
        with torch.no_grad():
            _call(tr, x)
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        res = capture_forward(tr, x, concepts=concepts, concept_layers=[0, 1])
    for i in (0, 1):
        want = pre[("c", i)] @ pre[("x", i)].transpose(1, 2)  # (B, C, P)
        assert res.concept_scores[i].shape == (2, 5, 12)
        assert torch.allclose(res.concept_scores[i], want, atol=1e-4, rtol=1e-4), i
        # --normalize_concepts: per output dimension, min-shift and divide by the concept sum
        c = pre[("c", i)].double()
        c = (c - c.min(1, keepdim=True).values) / (c - c.min(1, keepdim=True).values).sum(1, keepdim=True)
        want_n = (c @ pre[("x", i)].double().transpose(1, 2)).float()
        assert torch.allclose(res.concept_scores_normalized[i], want_n, atol=1e-4, rtol=1e-4), i


# --------------------------------------------------------------------------------------
# the backbone
# --------------------------------------------------------------------------------------


def _rgb(h, w, seed=0):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


def test_non_square_layout_and_noise_rule():
    bb = flux_tiny(image_size=(48, 80), vae_size=None, device="cpu", seeds=(7,),
                   timestep_index=3)
    px = bb.collate([_rgb(50, 90), _rgb(30, 30, 1)])
    assert px.shape == (2, 3, 48, 80) and px.min() >= -1 and px.max() <= 1
    seen = {}

    def pre(mod, args, kwargs):
        seen.update(kwargs)

    h = bb.transformer.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        rec = bb.extract(px, Capture(layers=(0, 3), heads="mean"), prompts=["dog", "tabby cat"])
    finally:
        h.remove()
    assert rec.layout.grid == (3, 5) and rec.layout.prefix == T
    assert rec.layout.num_tokens == T + 15 and rec.layout.cls_index is None
    assert rec.image_size == (48, 80) and bb.patch_size == (16, 16)
    assert rec.attn[0].shape == (2, 1, T + 15, T + 15)
    ids = seen["img_ids"]
    assert ids.shape == (15, 3) and ids[:, 1].max() == 2 and ids[:, 2].max() == 4
    assert torch.equal(ids[1 * 5 + 3], torch.tensor([0.0, 1.0, 3.0]))
    # x_t = t * eps + (1 - t) z, t = linspace(1, 0, 5)[3] = 0.25, packed row-major
    z = bb.encode_images(px)
    eps = torch.randn((1, *z.shape[1:]), generator=torch.Generator().manual_seed(7))
    assert torch.allclose(seen["hidden_states"], pack_latents(0.25 * eps + 0.75 * z), atol=1e-6)
    assert torch.allclose(seen["timestep"], torch.full((2,), 0.25))
    # the class word's T5 tokens: "a dog" -> [a][dog]; "a tabby cat" -> tabby cat's tokens
    toks = [bb.tokenizer_2.convert_ids_to_tokens(
        bb.tokenizer_2([p], padding="max_length", max_length=T)["input_ids"][0])
        for p in ("a dog", "a tabby cat")]
    assert [toks[0][i] for i in rec.query[0]] == ["\u2581dog"]
    assert "".join(toks[1][i] for i in rec.query[1]) == "\u2581tabby\u2581cat"
    assert rec.extras["query_mask"].sum(1).tolist() == [1, len(rec.query[1])]


def test_seeds_average_and_batch_invariance(backbone):
    px = backbone.collate([_rgb(64, 64, 1), _rgb(64, 64, 2)])
    cap = Capture(layers=(1, 2), heads="keep")
    backbone.seeds = (0, 1)
    try:
        both = backbone.extract(px, cap, prompts=["dog", "cat"])
        backbone.seeds = (0,)
        a = backbone.extract(px, cap, prompts=["dog", "cat"])
        backbone.seeds = (1,)
        b = backbone.extract(px, cap, prompts=["dog", "cat"])
        alone = backbone.extract(px[1:], cap, prompts=["cat"])
    finally:
        backbone.seeds = (0,)
    for layer in (1, 2):
        assert torch.allclose(both.attn[layer], (a.attn[layer] + b.attn[layer]) / 2, atol=1e-6)
        assert torch.allclose(b.attn[layer][1:], alone.attn[layer], atol=1e-5)
    # concept scores: seeds x captured double-stream layers (layer 1 only), 1 + 6 concepts
    assert both.extras["concept_scores"].shape == (2, 2, 7, 64)
    assert both.extras["concept_layers"].tolist() == [1, 1]
    assert torch.allclose(both.extras["concept_scores"][:, 0], a.extras["concept_scores"][:, 0])


def test_bf16_weights_give_fp32_stochastic_attention():
    bb = flux_tiny(image_size=32, vae_size=64, device="cpu", dtype="bfloat16", concepts=())
    rec = bb.extract(bb.collate([_rgb(32, 32)]), Capture(layers=(-1,)), prompts=["dog"])
    a = rec.attn[3]
    assert a.dtype == torch.float32 and rec.layout.grid == (4, 4)
    assert torch.allclose(a.sum(-1), torch.ones_like(a.sum(-1)), atol=1e-5)
    assert "concept_scores" not in rec.extras
    assert bb.forward_plain(bb.collate([_rgb(32, 32)])).shape == (1, 16, 64)


def test_guidance_model_and_shifted_schedule():
    bb = flux_tiny(image_size=32, vae_size=64, device="cpu", guidance_embeds=True,
                   shift_schedule=True, concepts=(), offload=True, text_dtype="bfloat16")
    assert bb.text_encoder_2.dtype == torch.bfloat16 and bb.transformer.dtype == torch.float32
    assert bb.guidance == 3.5
    t = bb.noise_level()
    assert t == float(flow_timesteps(4, 16, shift=True)[2]) and t != 0.5
    rec = bb.extract(bb.collate([_rgb(32, 32)]), Capture(layers=(0,)), prompts=["dog"])
    assert rec.attn[0].shape == (1, 2, T + 16, T + 16)


@pytest.mark.filterwarnings("ignore:The `local_dir_use_symlinks` argument is deprecated")
def test_clear_errors(backbone, tmp_path):
    px = backbone.collate([_rgb(64, 64)])
    with pytest.raises(ValueError, match="prompts for 1 images"):
        backbone.extract(px, Capture(), prompts=["a", "b"])
    with pytest.raises(ValueError, match=r"pixels must be \(B, 3, H, W\)"):
        backbone.extract(px[0], Capture(), prompts=["a"])
    backbone.default_class = None
    try:
        with pytest.raises(ValueError, match="class name per image"):
            backbone.extract(px, Capture())
    finally:
        backbone.default_class = "object"
    with pytest.raises(ValueError, match="multiple of 16"):
        flux_tiny(image_size=64, vae_size=120, device="cpu")
    with pytest.raises(ValueError, match="exactly once"):
        flux_tiny(image_size=64, prompt_template="a photo", device="cpu")
    with pytest.raises(ValueError, match="does not fit in max_sequence_length=4"):
        flux_tiny(image_size=32, vae_size=64, device="cpu", max_sequence_length=4).extract(
            backbone.collate([_rgb(32, 32)])[:, :, :32, :32], Capture(), prompts=["retriever"])
    with pytest.raises(FileNotFoundError, match="not a diffusers FLUX folder"):
        flux_pretrained(path=str(tmp_path / "nope"))
    with pytest.raises(RuntimeError, match="pass model.path=DIR"):
        flux_pretrained("black-forest-labs/FLUX.1-schnell", local_files_only=True)
    (tmp_path / "transformer").mkdir()
    with pytest.raises(FileNotFoundError, match="missing vae/"):
        flux_pretrained(path=str(tmp_path))


def test_no_network_and_no_cache_fails_at_once(tmp_path, monkeypatch):
    """Without a reachable hub and without the weights in the cache, loading FLUX stops in
    one message before the hub client's retries (about 30 s of warnings); with the weights
    cached, the same situation loads offline."""
    import time

    import segment.models.flux as flux
    import segment.models.hub as hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "hub_reachable", lambda endpoint, timeout=3.0: f"{endpoint} unreachable: test")
    asked = []
    monkeypatch.setattr(flux, "load_components", lambda *a, **k: asked.append(k) or (_ for _ in ()).throw(OSError("x")))
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"not in the cache .* cannot be downloaded: .*unreachable: test.*model.path=DIR"):
        flux_pretrained("black-forest-labs/FLUX.1-schnell")
    assert time.perf_counter() - t0 < 2 and asked == []  # the hub client was never asked
    # a cached snapshot (the hub cache's layout): offline mode, cache only
    snap = tmp_path / "models--black-forest-labs--FLUX.1-schnell"
    (snap / "refs").mkdir(parents=True)
    (snap / "refs" / "main").write_text("abc123")
    (snap / "snapshots" / "abc123" / "transformer").mkdir(parents=True)
    (snap / "snapshots" / "abc123" / "transformer" / "config.json").write_text("{}")
    assert flux._hub_unavailable("black-forest-labs/FLUX.1-schnell", None) == "cached"
    with pytest.raises(RuntimeError, match="could not load"):
        flux_pretrained("black-forest-labs/FLUX.1-schnell")
    assert asked and asked[-1]["local_files_only"] is True


def test_local_folder_roundtrip(comps, tmp_path):
    """``model.path=DIR`` loads a diffusers folder with the real ``from_pretrained`` code."""
    for sub, obj in (("transformer", comps.transformer), ("vae", comps.vae),
                     ("text_encoder", comps.text_encoder), ("text_encoder_2", comps.text_encoder_2),
                     ("tokenizer", comps.tokenizer), ("tokenizer_2", comps.tokenizer_2)):
        obj.save_pretrained(tmp_path / sub)
    bb = flux_pretrained(path=str(tmp_path), dtype="float32", device="cpu", image_size=32,
                         vae_size=64, max_sequence_length=T, clip_max_length=16)
    ref = flux_tiny(image_size=32, vae_size=64, device="cpu")
    px = ref.collate([_rgb(32, 32)])
    cap = Capture(layers=(1,))
    a = bb.extract(px, cap, prompts=["dog"])
    b = ref.extract(px, cap, prompts=["dog"])
    assert bb.name == tmp_path.name.lower() or bb.name
    assert torch.allclose(a.attn[1], b.attn[1], atol=1e-6)


# --------------------------------------------------------------------------------------
# ConceptAttention method
# --------------------------------------------------------------------------------------


def test_concept_heatmaps_softmax_then_mean():
    s = torch.tensor([[[[0.0, 1.0], [1.0, 0.0]], [[2.0, 0.0], [0.0, 0.0]]]])  # (1, 2, 2, 2)
    m = concept_heatmaps(s)
    e = math.e
    want0 = 0.5 * (torch.tensor([1 / (1 + e), e / (1 + e)]) + torch.tensor([e**2 / (1 + e**2), 0.5]))
    assert torch.allclose(m[0, 0], want0, atol=1e-6)
    assert torch.allclose(m.sum(1), torch.ones(1, 2))
    assert torch.allclose(concept_heatmaps(s, softmax=False)[0, 0], torch.tensor([1.0, 0.5]))


def test_concept_attention_method_reads_its_layers():
    layout = TokenLayout(num_tokens=4 + 6, prefix=4, grid=(2, 3), cls_index=None, kind="dit")
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 4, 3, 6, generator=g)  # layers [0, 1] x 2 seeds
    rec = AttentionRecord(
        attn={0: torch.full((2, 1, 10, 10), 0.1)}, layout=layout, image_size=(32, 48),
        extras={"concept_scores": scores, "concept_layers": torch.tensor([0, 1, 0, 1])},
        num_layers=4,
    )
    m = ConceptAttention(layers=[1])
    assert m.capture(4) == Capture(layers=(1,), heads="mean", average_layers=False)
    # the protocol's layers asked of a 12-block ViT: the error says which backbone it needs
    with pytest.raises(ValueError, match=r"layer 14 out of range.*DiT's double-stream layers"
                                         r" \(model=flux_schnell"):
        ConceptAttention().capture(12)
    out = m(rec)
    want = torch.softmax(scores[:, [1, 3]], dim=-2).mean(1)[:, 0].reshape(2, 2, 3)
    assert torch.allclose(out.heatmap, want)
    with pytest.raises(ValueError, match="no concept scores for layers"):
        ConceptAttention(layers=[2])(rec)
    rec.extras.clear()
    with pytest.raises(ValueError, match="no concept scores"):
        m(rec)


def test_normalize_concepts_by_hand():
    v = torch.tensor([[[1.0, -2.0, 5.0], [3.0, 0.0, 5.0], [2.0, 2.0, 5.0]]])  # (1, C=3, D=3)
    # d=0: shifted (0, 2, 1) / 3; d=1: (0, 2, 4) / 6; d=2: all equal -> zeros
    want = torch.tensor([[[0.0, 0.0, 0.0], [2 / 3, 1 / 3, 0.0], [1 / 3, 2 / 3, 0.0]]])
    assert torch.allclose(normalize_concepts(v), want)
    with pytest.raises(ValueError, match="C, D"):
        normalize_concepts(torch.ones(3))


def test_gaussian_blur_by_hand_and_against_torchvision():
    from torchvision.transforms.functional import gaussian_blur as tv_blur

    x = torch.zeros(1, 5, 6, dtype=torch.float64)
    x[0, 2, 2] = 1.0  # an impulse away from the border spreads as the kernel g g^T
    g = torch.tensor([math.exp(-0.5), 1.0, math.exp(-0.5)], dtype=torch.float64)
    g = g / g.sum()  # (0.2741, 0.4519, 0.2741)
    out = gaussian_blur(x, 3, 1.0)
    assert torch.allclose(out[0, 1:4, 1:4], g[:, None] * g[None, :], atol=1e-15)
    assert float(out[0, 0].abs().sum()) == 0.0 and float(out.sum()) == pytest.approx(1.0)
    # reflect padding mirrors without repeating the border: an impulse next to the top border
    # comes back from the padded row -1 (weight 2 g0 at row 0), one on the border does not
    y = torch.zeros(1, 5, 6, dtype=torch.float64)
    y[0, 1, 2] = 1.0
    assert float(gaussian_blur(y, 3, 1.0)[0, 0, 2]) == pytest.approx(float(2 * g[0] * g[1]))
    y = torch.zeros(1, 5, 6, dtype=torch.float64)
    y[0, 0, 2] = 1.0
    assert float(gaussian_blur(y, 3, 1.0)[0, 0, 2]) == pytest.approx(float(g[1] ** 2))
    r = torch.rand(2, 3, 8, 8)
    assert torch.allclose(gaussian_blur(r, 3, 1.0), tv_blur(r, kernel_size=3, sigma=1.0), atol=1e-6)
    assert torch.allclose(gaussian_blur(r, 5, 2.0), tv_blur(r, kernel_size=5, sigma=2.0), atol=1e-6)
    for bad in ((2, 1.0), (3, 0.0), (1, 1.0)):
        with pytest.raises(ValueError, match="odd kernel"):
            gaussian_blur(r, *bad)


def test_concept_attention_options_on_hand_built_scores():
    layout = TokenLayout(num_tokens=2 + 9, prefix=2, grid=(3, 3), cls_index=None, kind="dit")
    g = torch.Generator().manual_seed(1)
    raw = torch.randn(1, 2, 2, 9, generator=g)
    norm = torch.rand(1, 2, 2, 9, generator=g)
    rec = AttentionRecord(
        attn={0: torch.full((1, 1, 11, 11), 1 / 11)}, layout=layout, image_size=(24, 24),
        extras={"concept_scores": raw, "concept_scores_normalized": norm,
                "concept_layers": torch.tensor([0, 0])}, num_layers=2,
    )
    plain = ConceptAttention(layers=[0], softmax=False)(rec).heatmap
    assert torch.allclose(plain, raw[:, :, 0].mean(1).reshape(1, 3, 3))
    n = ConceptAttention(layers=[0], softmax=True, normalize_concepts=True)(rec).heatmap
    assert torch.allclose(n, torch.softmax(norm, dim=-2)[:, :, 0].mean(1).reshape(1, 3, 3))
    blurred = ConceptAttention(layers=[0], softmax=False, blur=[3, 1.0])(rec).heatmap
    # the centre cell of a 3x3 map: the 3x3 kernel over the whole (unpadded) map
    k = torch.tensor([math.exp(-0.5), 1.0, math.exp(-0.5)])
    k = k / k.sum()
    assert float(blurred[0, 1, 1]) == pytest.approx(float((k[:, None] * k[None, :] * plain[0]).sum()), abs=1e-6)
    assert not torch.allclose(blurred, plain)
    for bad in ([3], [4, 1.0], [3, -1.0], "3"):
        with pytest.raises(ValueError, match="blur"):
            ConceptAttention(blur=bad)
    del rec.extras["concept_scores_normalized"]
    with pytest.raises(ValueError, match="no concept scores"):
        ConceptAttention(layers=[0], normalize_concepts=True)(rec)


def test_concept_attention_on_tiny_backbone(backbone):
    px = backbone.collate([_rgb(64, 64, 3)])
    m = ConceptAttention(layers=[0, 1])
    rec = backbone.extract(px, m.capture(backbone.num_layers), prompts=["dog"])
    out = m(rec)
    assert out.heatmap.shape == (1, 8, 8)
    assert 0 < float(out.heatmap.min()) and float(out.heatmap.max()) < 1


# --------------------------------------------------------------------------------------
# end to end: `segment` and `segment-eval` with model=flux_tiny
# --------------------------------------------------------------------------------------


def _compose(name, overrides):
    from hydra import compose, initialize_config_module

    with initialize_config_module(version_base="1.3", config_module="segment.configs"):
        return compose(name, overrides=list(overrides))


def test_model_configs_compose_and_flux_tiny_instantiates():
    from hydra.utils import instantiate

    for name, target in (("flux_schnell", "flux_pretrained"), ("flux_dev", "flux_pretrained"),
                         ("flux_tiny", "flux_tiny")):
        cfg = _compose("segment", [f"model={name}", "device=cpu"])
        assert cfg.model._target_.endswith(target)
    dev = _compose("segment", ["model=flux_dev"]).model
    assert dev.max_sequence_length == 512 and dev.guidance == 3.5
    assert dev.repo_id == "black-forest-labs/FLUX.1-dev"
    bb = instantiate(_compose("segment", ["model=flux_tiny", "device=cpu"]).model)
    assert bb.num_layers == 4 and bb.grid_size() == (8, 8) and bb.noise_level() == 0.5


def test_segment_end_to_end_flux_tiny(tmp_path):
    from segment.run.job.pipeline import run_segment

    out = tmp_path / "out"
    cfg = _compose("segment", [f"output='{out}'", "model=flux_tiny", "method=bounce",
                               "device=cpu", "progress=false", "batch_size=3",
                               "render.fsync=false", "num_workers=1"])
    assert run_segment(cfg) == 0  # the bundled examples, class word: model.default_class
    masks = sorted(p.name for p in (out / "masks").glob("*.png"))
    assert masks == ["astronaut.png", "chelsea.png", "coffee.png"]
    assert (out / "run.json").is_file()


def test_the_backbone_contract_of_flux_and_vit(backbone):
    """What callers read of a backbone, declared by models/base.py's Backbone: FLUX is a
    text-conditioned DiT (a default class word); a ViT is not text-conditioned; the records of
    both carry the input image (RGB in [0, 1] at the record's image_size)."""
    from hydra.utils import instantiate
    from segment.models.base import Backbone

    assert isinstance(backbone, Backbone)
    assert backbone.text_conditioned and backbone.provides_pixels and backbone.kind == "dit"
    assert backbone.default_class == "object" and backbone.name == "flux_tiny"
    assert backbone.patch_size == (8, 8)  # 64 px over 8 x 8 latent tokens
    vit = instantiate(_compose("segment", ["model=vit_tiny_random", "device=cpu"]).model)
    assert isinstance(vit, Backbone) and vit.provides_pixels and not vit.text_conditioned
    assert vit.default_class is None and vit.kind == "vit"
    for model in (backbone, vit):
        photo = _photo(48, 80)
        x = model.collate([photo])
        rec = model.extract(x, Capture(layers=(0,)))
        assert rec.pixels is not None and rec.pixels.dtype == torch.float32
        assert tuple(rec.pixels.shape) == (1, 3, *rec.image_size)
        assert float(rec.pixels.min()) >= 0 and float(rec.pixels.max()) <= 1


def test_flux_records_carry_the_preprocessed_image_not_the_vae_input(backbone):
    """The FLUX record's pixels are preprocess's image at model.image_size (64 px here), not
    the VAE's 128 px input: what the pixel chain of regions and cuts refines on."""
    import numpy as np
    from PIL import Image

    photo = _photo(40, 56)
    rec = backbone.extract(backbone.collate([photo]), Capture(layers=(0,)))
    assert rec.image_size == (64, 64) and tuple(rec.pixels.shape) == (1, 3, 64, 64)
    want = np.asarray(photo.resize((64, 64), Image.BICUBIC), dtype=np.float32) / 255.0
    got = rec.pixels[0].permute(1, 2, 0).numpy()
    assert np.abs(got - want).max() < 1e-6


def _photo(h, w):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8))


# the method configs, each with what it needs on the tiny models: ConceptAttention scores the
# double-stream layers (protocol: 14-17 of FLUX's 19; flux_tiny has 2)
_TINY_OVERRIDES = {"concept_attention": ["method.layers=[0,1]"]}


def _method_configs():
    from pathlib import Path

    import segment.configs

    return sorted(p.stem for p in Path(segment.configs.__file__).parent.joinpath("method").glob("*.yaml"))


@pytest.mark.parametrize("model", ["vit_tiny_random", "flux_tiny"])
def test_every_method_runs_on_each_backbone_kind_it_declares(model):
    """Every method config on the tiny model of each backbone kind: the kinds the method
    declares (Method.backbones) run with its defaults and give a finite heatmap on the grid
    (and region labels at the input for region methods); every other pair is refused before
    the first batch with one line naming the method, its kinds and the model."""
    from hydra.utils import instantiate
    from segment.run.api.segmenter import check_method

    bb = instantiate(_compose("segment", [f"model={model}", "device=cpu"]).model)
    photos = [_photo(48, 64), _photo(64, 40)]
    ran = []
    for name in _method_configs():
        cfg = _compose("segment", [f"model={model}", f"method={name}", "device=cpu",
                                   *_TINY_OVERRIDES.get(name, []) * (bb.kind == "dit")])
        method = instantiate(cfg.method)
        if bb.kind not in method.backbones:
            with pytest.raises(ValueError) as err:
                check_method(method, bb)
            msg = str(err.value)
            assert "\n" not in msg and msg.startswith(f"{method.name} runs on ")
            assert f"model {bb.name} is a {bb.kind}" in msg
            continue
        capture = check_method(method, bb)
        rec = bb.extract(bb.collate(photos), capture)
        out = method(rec)
        assert out.heatmap.shape[0] == 2 and bool(torch.isfinite(out.heatmap).all()), name
        if method.gives_labels:
            assert tuple(out.labels.shape) == (2, *rec.image_size), name
        ran.append(name)
    assert "cuts" in ran and "regions" in ran
    assert ("concept_attention" in ran) == (bb.kind == "dit")


def test_segment_runs_the_default_method_on_flux(tmp_path):
    """`segment input=<the bundled examples> model=flux_tiny` with the default method (cuts,
    with its pixel refinement): 3 masks and 3 label maps, exit 0."""
    from segment.run.job.pipeline import run_segment

    out = tmp_path / "out"
    cfg = _compose("segment", [f"output='{out}'", "model=flux_tiny", "device=cpu",
                               "progress=false", "render.fsync=false", "num_workers=1"])
    assert cfg.method.name == "cuts"
    assert run_segment(cfg) == 0
    want = ["astronaut.png", "chelsea.png", "coffee.png"]
    assert sorted(p.name for p in (out / "masks").glob("*.png")) == want
    assert sorted(p.name for p in (out / "labels").glob("*.png")) == want


def test_a_knob_that_needs_pixels_is_refused_on_a_backbone_without_them(backbone, monkeypatch):
    """A backbone whose records carry no pixels (Backbone.provides_pixels false; none of the
    bundled ones) refuses the pixel chain's refine_steps >= 1 in one line naming the knob
    and the model; refine_steps=0 is accepted."""
    from segment.methods import EscapeCuts
    from segment.run.api.segmenter import check_method

    monkeypatch.setattr(type(backbone), "provides_pixels", False)
    with pytest.raises(ValueError, match=r"^cuts: refine_steps=3 reads the input image, which model"
                                         r" flux_tiny does not provide .*set method.refine_steps=0$"):
        check_method(EscapeCuts(), backbone)
    assert check_method(EscapeCuts(refine_steps=0), backbone) == \
        EscapeCuts(refine_steps=0).capture(backbone.num_layers)


def test_a_vit_refuses_a_dit_only_method_in_one_line(tmp_path, capsys):
    """concept_attention reads concept words' text tokens: on a ViT `segment` and the API
    refuse it before the first batch, one line, nothing written."""
    import segment
    from segment.run.job.pipeline import run_segment

    with pytest.raises(ValueError, match=r"^concept_attention runs on dit backbones; model"
                                         r" vit_tiny_random is a vit"):
        segment.load(model="vit_tiny_random", method="concept_attention", device="cpu")
    out = tmp_path / "refused"
    cfg = _compose("segment", [f"output='{out}'", "model=vit_tiny_random",
                               "method=concept_attention", "device=cpu", "progress=false",
                               "render.fsync=false", "num_workers=1"])
    assert run_segment(cfg) == 2
    assert not (out / "masks").exists()


def test_segment_eval_flux_experiment_end_to_end(tmp_path, monkeypatch):
    import json

    import numpy as np
    from segment.eval.runner import run_eval
    from segment.models.flux import FluxBackbone
    from test_datasets import write_gtsegs

    rng = np.random.default_rng(0)
    sizes = [(40, 56), (48, 32), (36, 36)]
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    masks = [rng.random((h, w)) > 0.5 for h, w in sizes]
    mat = tmp_path / "gtsegs_ijcv.mat"
    write_gtsegs(mat, images, masks, ["n02084071", "n01443537", "n07747607"])
    seen = []
    extract = FluxBackbone.extract

    def spy(self, pixels, capture, *, prompts=None):
        seen.append((list(prompts), capture))
        return extract(self, pixels, capture, prompts=prompts)

    monkeypatch.setattr(FluxBackbone, "extract", spy)
    out = tmp_path / "eval"
    tiny_blocks = ["blocks.concept=[0,1]", "blocks.late_double=[0,1]", "blocks.late_single=[2,3]"]
    cfg = _compose("eval", ["experiment=flux_imagenet_seg", "model=flux_tiny", f"dataset.root={mat}",
                            "device=cpu", "progress=false", f"output={out}", "model.seeds=[0]",
                            "batch_size=2", "panels=1", *tiny_blocks])
    assert run_eval(cfg) == 0
    rows = json.loads((out / "results.json").read_text())
    chains = [f"{c}_{d}_{n}" for c in ("joint", "grid") for d in ("fwd", "src") for n in (1, 2, 3)]
    chains.remove("joint_fwd_2")  # the paper's row, flux_bounce2
    blocks = [f"joint_{d}_2_{b}" for d in ("fwd", "src") for b in ("double_9_18", "single_28_37")]
    want = ["flux_bounce2", *sorted(chains), *blocks, "tokenrank_joint_fwd", "tokenrank_joint_src",
            "tokenrank_grid_fwd", "concept_attention", "cross_attention"]
    assert sorted(r["method"] for r in rows) == sorted(want) and rows[0]["method"] == "flux_bounce2"
    for r in rows:
        assert r["images"] == 3
        assert all(0.0 <= r[k] <= 100.0 for k in r if k not in ("method", "images", "ci95", "delta", *TIMING_KEYS))
        assert all(0.0 <= lo <= hi <= 100.0 for lo, hi in r["ci95"].values())
    by = {r["method"]: r for r in rows}
    # by construction: one joint bounce is an affine image of one grid bounce (same masks, AP)
    # (forward only: the source direction weighs several query tokens by 1 / column sums of
    # the damped chain on one side and of the attention on the other)
    # (the masks exactly; AP up to the rounding of the affine map and the min-max: on one
    # development machine it reordered a pair of nearly tied pixels, 1.2e-6 points of AP)
    for k in ("pixAcc", "mIoU", "mIoU_CA"):
        assert by["joint_fwd_1"][k] == pytest.approx(by["grid_fwd_1"][k], abs=1e-6)
    assert by["joint_fwd_1"]["mAP"] == pytest.approx(by["grid_fwd_1"]["mAP"], abs=1e-4)
    # class names are the prompts; one union capture: heads fused on the fly, blocks kept
    # apart (the rows average different blocks)
    assert [p for batch, _ in seen for p in batch][0] == "dog" and len(seen) == 2
    assert seen[0][1] == Capture(layers=(0, 1, 2, 3), heads="mean", average_layers=False)


def test_pooled_prompt_zeros_reaches_the_transformer():
    bb = flux_tiny(image_size=32, vae_size=64, device="cpu", concepts=(), pooled_prompt="zeros")
    seen = {}
    h = bb.transformer.register_forward_pre_hook(lambda m, a, k: seen.update(k), with_kwargs=True)
    try:
        bb.extract(bb.collate([_rgb(32, 32)]), Capture(layers=(0,)), prompts=["dog"])
    finally:
        h.remove()
    assert torch.equal(seen["pooled_projections"], torch.zeros(1, 32))
    with pytest.raises(ValueError, match="pooled_prompt"):
        flux_tiny(image_size=32, vae_size=64, device="cpu", pooled_prompt="mean")


# --------------------------------------------------------------------------------------
# the joint chain (bounce / tokenrank chain=joint) on captured FLUX attention
# --------------------------------------------------------------------------------------


class _NoCopies:
    """Records every tensor of at least ``numel`` elements that a torch op inside the block
    produces in new memory (views of existing tensors, e.g. of the attention, are fine)."""

    def __init__(self, numel: int, of: torch.Tensor):
        self.numel, self.ptr, self.copies = numel, of.untyped_storage().data_ptr(), []

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        guard = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in (out if isinstance(out, (tuple, list)) else (out,)):
                    if (isinstance(t, torch.Tensor) and t.numel() >= guard.numel
                            and t.untyped_storage().data_ptr() != guard.ptr):
                        guard.copies.append((str(func), tuple(t.shape)))
                return out

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def _dense_joint(a: torch.Tensor, alpha: float, source: bool) -> torch.Tensor:
    """float64 ``T = alpha A + (1 - alpha) 11^T / N`` (source: its column-normalised transpose)."""
    n = a.shape[-1]
    t = alpha * a.double() + (1 - alpha) / n
    if source:
        t = (t / t.sum(-2, keepdim=True)).transpose(-1, -2)
    return t


@pytest.mark.parametrize("direction", ["forward", "source"])
def test_joint_chain_on_captured_flux_attention_equals_float64(backbone, direction):
    from segment.methods import Bounce, TokenRank

    px = backbone.collate([_rgb(64, 64, 5), _rgb(64, 64, 6)])
    src = direction == "source"
    # heads fused and blocks 1-2 averaged while capturing: one (B, 1, N, N) matrix
    cap = Capture(layers=(1, 2), heads="mean", average_layers=True)
    rec = backbone.extract(px, cap, prompts=["dog", "coffee cup"])
    a = rec.attn[1]  # (2, 1, N, N), N = 16 text + 64 image tokens
    assert a.shape == (2, 1, T + 64, T + 64)
    # every head kept: the per-head walks are averaged (fuse=output)
    keep = backbone.extract(px, Capture(layers=(1,), heads="keep"), prompts=["dog", "coffee cup"])
    assert keep.attn[1].shape[1] == 2
    for i, q in enumerate(rec.query):
        assert len(q) >= 1 and max(q) < T  # the class word's T5 tokens
    alpha = 0.9
    for steps in (1, 2, 3):
        m = Bounce(layers=[1, 2], steps=steps, fuse="attention", average_layers=True,
                   chain="joint", direction=direction, alpha=alpha)
        with _NoCopies(a[0].numel(), a) as nc:  # nothing of one image's (N, N) size is formed
            got = m(rec).heatmap.reshape(2, 64)
        assert nc.copies == []
        mo = Bounce(layers=[1], steps=steps, fuse="output", chain="joint", direction=direction,
                    alpha=alpha)
        got_heads = mo(keep).heatmap.reshape(2, 64)
        for b, q in enumerate(rec.query):
            s = torch.zeros(T + 64, dtype=torch.float64)
            s[list(q)] = 1.0 / len(q)
            t = _dense_joint(a[b, 0], alpha, src)
            want = (s @ torch.linalg.matrix_power(t, steps))[T:]
            torch.testing.assert_close(got[b].double(), want, rtol=1e-5, atol=1e-7)
            per_head = [(s @ torch.linalg.matrix_power(_dense_joint(h, alpha, src), steps))[T:]
                        for h in keep.attn[1][b]]
            torch.testing.assert_close(got_heads[b].double(), torch.stack(per_head).mean(0),
                                       rtol=1e-5, atol=1e-7)
    # the grid chain drops the text after the first step: a different map from 2 bounces on
    g = Bounce(layers=[1, 2], steps=2, fuse="attention", average_layers=True,
               direction=direction)(rec).heatmap
    j = Bounce(layers=[1, 2], steps=2, fuse="attention", average_layers=True, chain="joint",
               direction=direction)(rec).heatmap
    assert not torch.allclose(g / g.sum((1, 2), keepdim=True), j / j.sum((1, 2), keepdim=True),
                              atol=1e-4)
    # TokenRank of the joint chain: the stationary vector of T, read on the image tokens
    tr = TokenRank(layers=[1, 2], fuse="attention", average_layers=True, chain="joint",
                   direction=direction, alpha=alpha, tol=1e-12, max_iter=2000)
    with _NoCopies(a.numel(), a) as nc:  # (elements that converge first leave the others'
        pi = tr(rec).heatmap.reshape(2, 64)  # chains to a smaller copy)
    assert nc.copies == []
    for b in range(2):
        t = _dense_joint(a[b, 0], alpha, src)
        w, v = torch.linalg.eig(t.T)
        ref = v[:, torch.argmin((w - 1).abs())].real
        ref = ref / ref.sum()
        torch.testing.assert_close(pi[b].double(), ref[T:], rtol=1e-5, atol=1e-8)


@pytest.mark.slow
def test_reproduce_flux_script_end_to_end(tmp_path):
    """`bash eval/reproduce_flux.sh DATA` with the tiny model: every FLUX table and the
    manifest (device, versions, seeds) land in --out; the working folders stay in --work."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np
    from test_datasets import write_gtsegs

    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, (40, 48, 3), dtype=np.uint8) for _ in range(2)]
    masks = [rng.random((40, 48)) > 0.5 for _ in range(2)]
    mat = tmp_path / "gtsegs_ijcv.mat"
    write_gtsegs(mat, images, masks, ["n02084071", "n01443537"])
    script = Path(__file__).resolve().parents[1] / "eval" / "reproduce_flux.sh"
    out, work = tmp_path / "tables", tmp_path / "work"
    tiny = ["model=flux_tiny", "model.seeds=[4]", "++blocks.concept=[0,1]",
            "++blocks.late_double=[0,1]", "++blocks.late_single=[2,3]", "batch_size=2", "panels=0"]
    proc = subprocess.run(
        ["bash", str(script), str(mat), "--out", str(out), "--work", str(work), "--device", "cpu",
         *tiny],
        cwd=tmp_path, capture_output=True, text=True, env={**__import__("os").environ,
                                                            "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    man = json.loads((out / "manifest.json").read_text())
    assert set(man["tables"]) == {"flux_imagenet_seg", "flux_concept_attention",
                                  "flux_concept_attention_defaults"}
    assert man["device"]["requested"] == "cpu" and man["versions"]["torch"] == torch.__version__
    assert man["versions"]["diffusers"] and man["command"].endswith(" ".join(tiny))
    for exp, t in man["tables"].items():
        assert t["seeds"] == [4] and t["images"] == 2 and t["model"] == "flux_tiny"
        for f in t["files"]:
            assert (out / f).is_file(), f
        rows = json.loads((out / exp / "results.json").read_text())
        assert [r["method"] for r in rows] == t["rows"] and all(r["images"] == 2 for r in rows)
    assert man["tables"]["flux_imagenet_seg"]["rows"][0] == "flux_bounce2"
    assert man["tables"]["flux_concept_attention"]["rows"] == ["concept_attention",
                                                               "concept_attention_unnormalized"]
    assert [man["tables"][e]["timestep_index"] for e in sorted(man["tables"])] == [2, 3, 2]
    assert not (out / "flux_imagenet_seg" / "cache").exists()  # caches stay in --work
    # a missing data file: a one-line error, exit code 2
    bad = subprocess.run(["bash", str(script), str(tmp_path / "nope.mat")], capture_output=True,
                         text=True, env={**__import__("os").environ, "PYTHON": sys.executable})
    assert bad.returncode == 2 and "no such file" in bad.stderr
