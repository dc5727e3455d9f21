"""Writes tests/golden/vit_tiny_fixed.safetensors, the fixed weights of the everyday golden
test (tests/test_golden_tiny.py): ``configs/model/vit_tiny_random.yaml``'s architecture (timm
``vit_small_patch14_dinov2``, width 64, 2 blocks, 2 heads) at a 16 x 16 position table
(224 px), built with ``torch.manual_seed(0)``, then in each block the key projection tied to
the query projection and both scaled by :data:`SCALE`, their biases zero, stored in fp16
(about 310 KB).

Why not timm's random init as it is: its attention logits are ~0.01, so every chain is
near uniform and the default method finds one region per image whatever its settings (a
summary of that catches no change of recipe). With ``k = q = SCALE W_q LN(x)`` the logits are
a positive semi-definite similarity of the tokens' (random) features, so attention follows
the image's content, and the cuts find 9 to 23 regions per example with escape
probabilities spread over (0, 1); the nearest cut to the default threshold (0.5) is 0.4955.

The file is committed (timm's init order may change between versions; the file does not).
Rewrite it only on purpose, then the summary with ``SEGMENT_GOLDEN_UPDATE=1``::

    python tests/golden/make_vit_tiny_fixed.py
"""

from __future__ import annotations

from pathlib import Path

import timm
import torch
from safetensors.torch import save_file

SCALE = 6.0
OUT = Path(__file__).with_name("vit_tiny_fixed.safetensors")


def fixed_state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch14_dinov2", pretrained=False, num_classes=0,
                              img_size=224, embed_dim=64, depth=2, num_heads=2)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    width = model.embed_dim
    for i in range(len(model.blocks)):
        qkv = sd[f"blocks.{i}.attn.qkv.weight"]  # (3 C, C): rows of q, k, v
        q = qkv[:width] * SCALE
        qkv[:width] = q
        qkv[width : 2 * width] = q
        sd[f"blocks.{i}.attn.qkv.bias"].zero_()
    return {k: v.half() for k, v in sd.items()}


if __name__ == "__main__":
    save_file(fixed_state_dict(), str(OUT))
    print(f"{OUT}: {OUT.stat().st_size} bytes")
