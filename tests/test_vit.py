"""TimmViT: weights, position tables, preprocessing and attention capture.

Tiny random timm models (width 64, 2 blocks) run on a CPU in seconds; the shared real
DINOv2 ViT-S/14 tests skip without SEGMENT_SHARED.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from PIL import Image
from safetensors.torch import load_file, save_file
from segment.models.vit import TimmViT, load_state_dict, resample_pos_embed

from segment.core.record import Capture

TINY = dict(embed_dim=64, depth=2, num_heads=2)
ARCHS = {  # arch, prefix tokens, registers
    "dinov2": ("vit_small_patch14_dinov2", 1, 0),
    "dinov2_reg4": ("vit_small_patch14_reg4_dinov2", 5, 4),
    "clip_b16": ("vit_base_patch16_clip_224", 1, 0),
}
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "model"


def tiny(kind: str = "dinov2", **kw) -> TimmViT:
    torch.manual_seed(0)
    return TimmViT(ARCHS[kind][0], pretrained=False, model_kwargs=TINY, device="cpu", **kw)


def attn_io(model: TimmViT, pixels: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Input and output of every block's attention module on the plain (fused) path."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [
        blk.attn.register_forward_hook(
            lambda m, i, o, k=k: seen.__setitem__(k, (i[0].clone(), o.clone()))
        )
        for k, blk in enumerate(model.model.blocks)
    ]
    try:
        model.forward_plain(pixels)
    finally:
        for h in hooks:
            h.remove()
    return seen


def reproduce(model: TimmViT, probs: torch.Tensor, x: torch.Tensor, layer: int) -> torch.Tensor:
    """``proj(probs @ v)`` of block ``layer`` for its input ``x`` (B, N, C)."""
    attn = model.model.blocks[layer].attn
    b, n, _ = x.shape
    qkv = attn.qkv(x).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    v = qkv[2]  # (B, H, N, D)
    out = (probs.to(v.dtype) @ v).transpose(1, 2).reshape(b, n, -1)
    return attn.proj(attn.norm(out))


# --------------------------------------------------------------------------------------
# capture
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(ARCHS))
@pytest.mark.parametrize("size", [(224, 224), (224, 336), (160, 96)])
def test_captured_probs_reproduce_fused_attention_output(kind, size):
    model = tiny(kind, dtype="float64")
    ph, pw = model.patch_size
    size = (size[0] // ph * ph, size[1] // pw * pw)
    pixels = torch.randn(2, 3, *size, dtype=torch.float64)
    rec = model.extract(pixels, Capture(layers=None, heads="keep"))
    io = attn_io(model, pixels)
    grid = (size[0] // ph, size[1] // pw)
    n = ARCHS[kind][1] + grid[0] * grid[1]
    assert rec.layout.grid == grid and rec.layout.num_tokens == n
    assert rec.image_size == size and rec.num_layers == 2
    for layer in range(model.num_layers):
        probs = rec.attn[layer]
        assert probs.shape == (2, model.num_heads, n, n)
        assert torch.allclose(probs.sum(-1), torch.ones(()), atol=1e-6)
        x, y = io[layer]
        assert torch.allclose(reproduce(model, probs, x, layer), y, atol=1e-5, rtol=1e-4), layer
    assert all(blk.attn.fused_attn for blk in model.model.blocks)  # capture left them fused


def test_fp32_capture_matches_fp32_fused_block():
    model = tiny()
    pixels = torch.randn(1, 3, 224, 224)
    rec = model.extract(pixels, Capture(layers=(-1,), heads="keep"))
    x, y = attn_io(model, pixels)[1]
    assert torch.allclose(reproduce(model, rec.attn[1], x, 1), y, atol=1e-5, rtol=1e-4)


def test_capture_never_changes_the_forward():
    """Which layers are captured moves no float: the last layer's probabilities are bit for
    bit the same captured alone, with every layer (rollout) or with keys, and every block
    runs the fused path throughout (the manual path's attn_drop never fires)."""
    model = tiny()
    pixels = torch.randn(2, 3, 224, 224)
    drops = [0]
    hooks = [blk.attn.attn_drop.register_forward_hook(lambda *a: drops.__setitem__(0, drops[0] + 1))
             for blk in model.model.blocks]
    try:
        alone = model.extract(pixels, Capture(layers=(-1,), heads="keep")).attn[1]
        every = model.extract(pixels, Capture(layers=None, heads="keep"))
        keyed = model.extract(pixels, Capture(layers=(0, 1), heads="keep", keys=True))
    finally:
        for h in hooks:
            h.remove()
    assert drops[0] == 0  # no block left the fused path
    assert torch.equal(every.attn[1], alone) and torch.equal(keyed.attn[1], alone)
    assert torch.equal(every.attn[0], keyed.attn[0])
    # the probabilities are those of timm's own manual path for the same block input
    x, _ = attn_io(model, pixels)[1]
    attn = model.model.blocks[1].attn
    qkv = attn.qkv(x).reshape(2, x.shape[1], 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    manual = ((qkv[0] * attn.scale) @ qkv[1].transpose(-2, -1)).softmax(-1)
    assert torch.allclose(alone, manual, atol=1e-6)


def test_nothing_after_the_last_probabilities_runs():
    model = tiny()
    blocks = model.model.blocks
    calls = {"k1": 0, "block0": 0, "block1": 0, "proj1": 0, "mlp1": 0}

    def count(key):
        return lambda *a: calls.__setitem__(key, calls[key] + 1)

    hooks = [
        blocks[1].attn.k_norm.register_forward_hook(count("k1")),
        blocks[0].register_forward_hook(count("block0")),
        blocks[1].register_forward_hook(count("block1")),
        blocks[1].attn.proj.register_forward_hook(count("proj1")),
        blocks[1].mlp.register_forward_hook(count("mlp1")),
    ]
    try:
        # layer 0 captured: block 0's attention, projection and MLP never run, nor block 1
        rec = model.extract(torch.randn(1, 3, 224, 224), Capture(layers=(0,), heads="keep"))
        assert calls == {"k1": 0, "block0": 0, "block1": 0, "proj1": 0, "mlp1": 0}
        assert rec.layers == (0,)
        # layers 0 and 1: block 0 runs whole, block 1 up to its probabilities
        rec = model.extract(torch.randn(1, 3, 224, 224), Capture(layers=(0, 1), heads="keep", keys=True))
        assert calls["block0"] == 1 and calls["k1"] == 1
        assert calls["block1"] == calls["proj1"] == calls["mlp1"] == 0
        assert rec.layers == (0, 1) and set(rec.keys) == {0, 1}
        # no hook is left behind: the plain forward runs whole
        model.forward_plain(torch.randn(1, 3, 224, 224))
        assert calls["k1"] == 2 and calls["block1"] == calls["mlp1"] == 1
        assert all(not blk.attn.q_norm._forward_hooks for blk in blocks)
        assert not blocks[0].attn.k_norm._forward_hooks and len(blocks[1].attn.k_norm._forward_hooks) == 1
    finally:
        for h in hooks:
            h.remove()


def test_keys_and_reduced_captures():
    model = tiny("dinov2_reg4")
    pixels = torch.randn(2, 3, 224, 224)
    full = model.extract(pixels, Capture(layers=None, heads="keep", keys=True))
    n = 5 + 16 * 16
    assert full.layout.prefix == 5 and full.layout.num_registers == 4 and full.layout.cls_index == 0
    assert full.layout.num_tokens == n and full.layout.patches == slice(5, n)
    # keys: the k of q k^T, so softmax(q k^T * scale) rebuilds the probabilities
    x, _ = attn_io(model, pixels)[0]
    attn = model.model.blocks[0].attn
    qkv = attn.qkv(x).reshape(2, n, 3, 2, 32).permute(2, 0, 3, 1, 4)
    assert full.keys[0].shape == (2, 2, n, 32)
    assert torch.allclose(full.keys[0], qkv[1], atol=1e-6)
    rebuilt = torch.softmax(qkv[0] * attn.scale @ full.keys[0].transpose(-1, -2), -1)
    assert torch.allclose(rebuilt, full.attn[0], atol=1e-6)
    # fused and averaged on the fly = the same reductions of the full record
    mean = model.extract(pixels, Capture(layers=(-1,), heads="mean"))
    assert mean.attn[1].shape == (2, 1, n, n)
    assert torch.allclose(mean.attn[1][:, 0], full.attn[1].mean(1), atol=1e-6)
    avg = model.extract(pixels, Capture(layers=None, heads="keep", average_layers=True))
    assert avg.averaged_layers == (0, 1)
    assert torch.allclose(avg.attn[0], (full.attn[0] + full.attn[1]) / 2, atol=1e-6)


# --------------------------------------------------------------------------------------
# position tables
# --------------------------------------------------------------------------------------


def test_resample_pos_embed_is_bicubic_without_antialias():
    torch.manual_seed(1)
    pos = torch.randn(1, 1 + 37 * 37, 8)
    out = resample_pos_embed(pos, (37, 37), (16, 22), 1)
    grid = pos[:, 1:].reshape(1, 37, 37, 8).permute(0, 3, 1, 2)
    ref = F.interpolate(grid, size=(16, 22), mode="bicubic", align_corners=False, antialias=False)
    assert out.shape == (1, 1 + 16 * 22, 8)
    assert torch.equal(out[:, :1], pos[:, :1])
    assert torch.allclose(out[:, 1:], ref.permute(0, 2, 3, 1).reshape(1, -1, 8), atol=1e-6)
    # timm's dynamic resampling (antialias) is a different function when downsampling
    alias = timm.layers.resample_abs_pos_embed(pos, (16, 22), (37, 37), num_prefix_tokens=1)
    assert (alias - out).abs().max() > 1e-2
    assert resample_pos_embed(pos, (37, 37), (37, 37), 1) is pos
    with pytest.raises(ValueError, match="entries"):
        resample_pos_embed(pos, (36, 36), (16, 16), 1)


def test_model_uses_resampled_table_per_size():
    model = tiny()
    src = model.model.pos_embed.detach().clone()  # 37 x 37 + CLS, as built (518 px)
    assert model._src_grid == (37, 37)
    for size in [(224, 224), (448, 336), (224, 224)]:
        model.extract(torch.randn(1, 3, *size), Capture(layers=(0,), heads="keep"))
        grid = (size[0] // 14, size[1] // 14)
        assert torch.equal(model.model.pos_embed, resample_pos_embed(src, (37, 37), grid, 1))
    assert set(model._pos_cache) == {(16, 16), (32, 24)}


# --------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------


def _tiny_timm(arch: str, **kw) -> torch.nn.Module:
    torch.manual_seed(3)
    return timm.create_model(arch, pretrained=False, num_classes=0, **TINY, **kw).eval()


def test_checkpoint_safetensors_reproduces_the_model(tmp_path):
    ref = _tiny_timm("vit_small_patch14_dinov2")  # 518 px native, 37 x 37 table
    path = tmp_path / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    model = TimmViT("vit_small_patch14_dinov2", pretrained=True, checkpoint=path,
                    model_kwargs=TINY, image_size=518, device="cpu")
    x = torch.randn(1, 3, 518, 518)
    with torch.no_grad():
        assert torch.allclose(model.forward_plain(x), ref.forward_features(x), atol=1e-6)
    assert torch.equal(model._pos_src, ref.pos_embed.detach())


@pytest.mark.parametrize("wrap", ["plain", "model", "state_dict_module"])
def test_checkpoint_torch_state_dict_and_wrappers(tmp_path, wrap):
    ref = _tiny_timm("vit_small_patch14_reg4_dinov2")
    sd = ref.state_dict()
    obj = {
        "plain": sd,
        "model": {"model": sd, "epoch": 3},
        "state_dict_module": {"state_dict": {f"module.{k}": v for k, v in sd.items()}},
    }[wrap]
    path = tmp_path / "tiny.pt"
    torch.save(obj, path)
    model = TimmViT("vit_small_patch14_reg4_dinov2", pretrained=False, checkpoint=str(path),
                    model_kwargs=TINY, device="cpu")
    for k, v in sd.items():
        assert torch.equal(model.model.state_dict()[k], v), k


def test_checkpoint_at_another_grid_is_resampled_from_its_own_table(tmp_path):
    ref = _tiny_timm("vit_small_patch14_dinov2", img_size=140)  # a 10 x 10 table
    path = tmp_path / "small_grid.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    model = TimmViT("vit_small_patch14_dinov2", pretrained=False, checkpoint=path,
                    model_kwargs=TINY, device="cpu")
    assert model._src_grid == (10, 10)
    model.extract(torch.randn(1, 3, 224, 224), Capture(layers=(0,), heads="keep"))
    want = resample_pos_embed(ref.pos_embed.detach(), (10, 10), (16, 16), 1)
    assert torch.equal(model.model.pos_embed, want)


def test_bad_checkpoints_say_which_file_and_why(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        tiny(checkpoint=tmp_path / "nope.safetensors")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="junk.pt"):
        tiny(checkpoint=junk)
    other = tmp_path / "other.safetensors"  # a patch-16 CLIP tower is not a DINOv2 ViT
    save_file({k: v.contiguous() for k, v in _tiny_timm("vit_base_patch16_clip_224").state_dict().items()},
              str(other))
    with pytest.raises(ValueError, match="does not fit"):
        tiny(checkpoint=other)
    assert load_state_dict(other)  # the file itself is fine


def test_clear_error_without_weights(monkeypatch, tmp_path):
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"model\.checkpoint=PATH"):
        TimmViT("vit_small_patch16_224.dino", pretrained=True, model_kwargs=TINY, device="cpu")


# --------------------------------------------------------------------------------------
# preprocessing, sizes, configs
# --------------------------------------------------------------------------------------


def test_preprocess_is_pillow_bilinear_then_normalise():
    model = tiny(image_size=(224, 308))
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (150, 200, 3), dtype=np.uint8))
    x = model.preprocess(img)
    ref = np.asarray(img.resize((308, 224), Image.BILINEAR), dtype=np.float32) / 255.0
    ref = (ref - np.array(model.mean, dtype=np.float32)) / np.array(model.std, dtype=np.float32)
    assert x.shape == (3, 224, 308)
    assert np.allclose(x.permute(1, 2, 0).numpy(), ref, atol=1e-6)
    assert model.mean == (0.485, 0.456, 0.406)  # timm's DINOv2 config
    gray = model.preprocess(img.convert("L"))
    assert gray.shape == (3, 224, 308)
    assert model.collate([img, img.convert("RGBA")]).shape == (2, 3, 224, 308)


def test_match_orientation_transposes_the_input_for_the_other_orientation():
    rng = np.random.default_rng(1)
    land = Image.fromarray(rng.integers(0, 256, (321, 481, 3), dtype=np.uint8))
    port = land.transpose(Image.Transpose.TRANSPOSE)  # 321 x 481 -> 481 x 321
    square = land.resize((300, 300))
    fixed = tiny(image_size=(294, 448))
    assert fixed.input_size(port) is None and fixed.preprocess(port).shape == (3, 294, 448)
    model = tiny(image_size=(294, 448), match_orientation=True)
    assert model.input_size(land) == (294, 448) and model.input_size(port) == (448, 294)
    assert model.input_size(square) == (294, 448)
    x = model.preprocess(port)
    ref = np.asarray(port.resize((294, 448), Image.BILINEAR), dtype=np.float32) / 255.0
    ref = (ref - np.array(model.mean, dtype=np.float32)) / np.array(model.std, dtype=np.float32)
    assert x.shape == (3, 448, 294) and np.allclose(x.permute(1, 2, 0).numpy(), ref, atol=1e-6)
    assert tiny(image_size=224, match_orientation=True).input_size(port) == (224, 224)
    with pytest.raises(ValueError, match=r"one batch needs one input size, got 294x448 and 448x294"):
        model.collate([land, port])
    with pytest.raises(ValueError, match="match_orientation must be true or false"):
        tiny(match_orientation="yes")


def test_sizes_must_be_patch_multiples():
    with pytest.raises(ValueError, match="multiple of the patch size"):
        tiny(image_size=225)
    model = tiny()
    with pytest.raises(ValueError, match="multiple of the patch size"):
        model.extract(torch.randn(1, 3, 224, 230), Capture())
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        model.extract(torch.randn(3, 224, 224), Capture())


def test_every_model_config_names_a_pretrained_timm_vit():
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    vits = [n for n in names if n.startswith(("dinov2_", "dino_", "clip_", "vit_"))]
    assert {"dinov2_vits14", "dinov2_vits14_reg4", "dinov2_vitg14_reg4", "dino_vits8",
            "dino_vits16", "clip_vitb16", "vit_b16", "vit_tiny_random"} <= set(vits)
    pretrained = set(timm.list_pretrained())
    with initialize_config_module(version_base="1.3", config_module="segment.configs"):
        for n in vits:
            cfg = compose(config_name="segment", overrides=[f"model={n}"]).model
            assert cfg._target_ == "segment.models.vit.TimmViT" and cfg.name == n
            assert timm.is_model(cfg.arch), cfg.arch
            if cfg.pretrained:
                assert cfg.arch in pretrained, cfg.arch
            assert ("reg4" in n) == ("reg4" in cfg.arch)
        cfg = compose(config_name="segment", overrides=["model=vit_tiny_random", "device=cpu"])
        model = instantiate(cfg.model)
    assert isinstance(model, TimmViT) and model.device == torch.device("cpu")
    assert (model.num_layers, model.num_heads, model.grid_size()) == (2, 2, (16, 16))


# --------------------------------------------------------------------------------------
# the shared real DINOv2 ViT-S/14
# --------------------------------------------------------------------------------------


@pytest.mark.shared
def test_real_dinov2_loads_at_several_sizes(dinov2_weights):
    model = TimmViT("vit_small_patch14_dinov2.lvd142m", pretrained=True,
                    checkpoint=dinov2_weights, device="cpu")
    src = load_file(str(dinov2_weights))["pos_embed"]
    assert model._src_grid == (37, 37) and torch.equal(model._pos_src, src)
    img = Image.new("RGB", (300, 200), (120, 60, 30))
    for size in [(224, 224), (448, 448), (224, 336)]:
        pixels = torch.randn(1, 3, *size)
        rec = model.extract(pixels, Capture(layers=(-1,), heads="keep"))
        grid = (size[0] // 14, size[1] // 14)
        n = 1 + grid[0] * grid[1]
        assert rec.layout.grid == grid and rec.attn[11].shape == (1, 6, n, n)
        grid_part = src[:, 1:].reshape(1, 37, 37, -1).permute(0, 3, 1, 2)
        want = F.interpolate(grid_part, size=grid, mode="bicubic", align_corners=False,
                             antialias=False).permute(0, 2, 3, 1).reshape(1, -1, src.shape[-1])
        assert torch.allclose(model.model.pos_embed[:, 1:], want, atol=1e-6)
    x, y = attn_io(model, pixels)[11]
    assert torch.allclose(reproduce(model, rec.attn[11], x, 11), y, atol=1e-4, rtol=1e-4)
    assert model.preprocess(img).shape == (3, 224, 224)
