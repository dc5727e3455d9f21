"""``python -m segment.eval.bench markov``: TokenRank and |lambda_2| on real heads against dense eigvals
(see the package docstring)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from segment.eval.bench.common import SIZES, best_time, example_image, find_weights
from torch import Tensor

from segment.core import markov


def real_heads(weights: Path, image_size: int, device: torch.device) -> torch.Tensor:
    """``(L, H, N, N)`` attention of every layer of DINOv2 ViT-S/14 on a bundled example."""
    from segment.models.vit import TimmViT

    from segment.core.record import Capture

    model = TimmViT(name="dinov2_vits14", arch="vit_small_patch14_dinov2.lvd142m",
                    pretrained=False, checkpoint=str(weights), image_size=image_size,
                    device=str(device))
    rec = model.extract(model.collate([example_image()]), Capture(layers=None, heads="keep"))
    return torch.stack([rec.attn[i][0] for i in sorted(rec.attn)])


def synthetic_heads(layers: int, heads: int, n: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """Attention-like chains: softmax of scaled cosine similarities of clustered features."""
    g = torch.Generator().manual_seed(seed)
    m = layers * heads
    centers = torch.randn(m, 8, 32, generator=g)
    assign = torch.randint(0, 8, (m, n), generator=g)
    feats = centers.gather(1, assign[..., None].expand(-1, -1, 32)) + 0.7 * torch.randn(m, n, 32, generator=g)
    feats = torch.nn.functional.normalize(feats, dim=-1)
    sharp = torch.linspace(4, 14, m).view(m, 1, 1)
    a = torch.softmax(sharp * feats @ feats.transpose(1, 2), -1)
    return a.view(layers, heads, n, n).to(device)


def bench_markov_accuracy(args: argparse.Namespace, weights: Path | None, device: torch.device) -> None:
    """``--accuracy``: max error of the fast lambda2 vs dense float64 over many real heads."""
    from PIL import Image
    from segment.models.vit import TimmViT

    from segment.core.record import Capture

    if weights is None:
        raise SystemExit("--accuracy needs real heads: pass --weights or set SEGMENT_SHARED")
    shared = os.environ.get("SEGMENT_SHARED")
    root = Path(args.root) if args.root else (Path(shared) / "data" / "ecssd-dev" if shared else None)
    if root is None or not (root / "images").is_dir():
        raise SystemExit("--accuracy needs a folder of images: --root DIR (DIR/images) or SEGMENT_SHARED")
    files = sorted(p for p in (root / "images").iterdir() if p.is_file())
    print(f"# lambda2 accuracy: every head of all layers of DINOv2 ViT-S/14 ({weights}) on "
          f"{root}/images; device {device}, {torch.get_num_threads()} threads")
    print("| px | images | heads | min abs lambda2 | max abs lambda2 | max err vs dense f64 | mean err |"
          " dense fallbacks | lambda2 ms/head | dense ms/head |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    errs, count = [], 0
    for size, k in ((224, args.images_224), (448, args.images_448)):
        if k <= 0:
            continue
        model = TimmViT(name="dinov2_vits14", arch="vit_small_patch14_dinov2.lvd142m", pretrained=False,
                        checkpoint=str(weights), image_size=size, device=str(device))
        e_all, v_all, fb, t_fast, t_dense = [], [], 0, 0.0, 0.0
        for f in files[:k]:
            img = Image.open(f).convert("RGB")
            rec = model.extract(model.collate([img]), Capture(layers=None, heads="keep"))
            attn = torch.stack([rec.attn[i][0] for i in sorted(rec.attn)])
            chains = markov.strip_prefix(attn.reshape(-1, *attn.shape[-2:]), 1, zero_rows="uniform")
            res: list[markov.Lambda2Result] = []
            t_fast += best_time(lambda: res.append(markov.lambda2(chains, return_info=True)), device)
            ref: list[Tensor] = []
            t_dense += best_time(lambda: ref.append(markov.lambda2_dense(chains)), device)
            e_all.append((res[-1].value - ref[-1]).abs())
            v_all.append(ref[-1])
            fb += int(res[-1].dense.sum())
        e, v = torch.cat(e_all), torch.cat(v_all)
        count += e.numel()
        errs.append(e.max().item())
        print(f"| {size} | {min(k, len(files))} | {e.numel()} | {v.min().item():.1e} | {v.max().item():.4f} | "
              f"{e.max().item():.1e} | {e.mean().item():.1e} | {fb}/{e.numel()} | "
              f"{1e3 * t_fast / e.numel():.2f} | {1e3 * t_dense / e.numel():.1f} |", flush=True)
    if errs:
        print(f"largest error over {count} heads: {max(errs):.1e} (goal <= 1e-4)")


def bench_markov(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m segment.eval.bench markov")
    p.add_argument("--sizes", type=int, nargs="+", default=[257, 1025, 4097],
                   help="token counts N (with CLS): 257, 1025, 4097 = 224, 448, 896 px")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--weights", default=None, help="DINOv2 ViT-S/14 safetensors (default: $SEGMENT_SHARED)")
    p.add_argument("--dense-heads", type=int, default=6,
                   help="heads timed with dense eigvals (spread over the layers); 1 at N=4097")
    p.add_argument("--layers", default="all", choices=["all", "last3"],
                   help="which layers' heads lambda2 runs on (N=4097 always uses last3)")
    p.add_argument("--accuracy", action="store_true",
                   help="instead: max error of lambda2 vs dense float64 over every head of many images")
    p.add_argument("--images-224", type=int, default=10, help="--accuracy: images at 224 px")
    p.add_argument("--images-448", type=int, default=2, help="--accuracy: images at 448 px")
    p.add_argument("--root", default=None, help="--accuracy: folder with images/ (default $SEGMENT_SHARED/data/ecssd-dev)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    weights = find_weights(args.weights)
    if args.accuracy:
        bench_markov_accuracy(args, weights, device)
        return
    src = f"DINOv2 ViT-S/14 heads ({weights})" if weights else "synthetic attention-like chains"
    print(f"# Markov benchmark: {src}; device {device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print("| N | layers | heads | tokenrank ms/head | lambda2 ms/head | lambda2 products/head"
          " | dense eigvals ms/head | speed-up | max err vs dense f64 (heads) | dense fallbacks |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n_tok in args.sizes:
        size = SIZES.get(n_tok)
        if weights and size:
            attn = real_heads(weights, size, device)
        else:
            attn = synthetic_heads(12, 6, n_tok, device)
        num_l, num_h, n, _ = attn.shape
        last3 = args.layers == "last3" or n > 2000
        sel = attn[-3:] if last3 else attn
        flat = sel.reshape(-1, n, n)
        t_tr = best_time(lambda: markov.tokenrank(flat, alpha=0.99, tol=1e-6), device)
        chains = markov.strip_prefix(flat, 1, zero_rows="uniform")  # patch chains
        res: list[markov.Lambda2Result] = []
        # best of 3 (the first run pays one-time allocation and library start-up)
        t_l2 = best_time(lambda: res.append(markov.lambda2(chains, return_info=True)), device, repeat=3)
        info = res[-1]
        k = 1 if n > 2000 else min(args.dense_heads, chains.shape[0])
        idx = torch.linspace(0, chains.shape[0] - 1, k).round().long()
        dense_vals = []
        t_dense = best_time(lambda: dense_vals.append(
            torch.stack([torch.linalg.eigvals(chains[i]) for i in idx])), device, repeat=2) / k
        ref = markov.lambda2_dense(chains[idx])
        err = (info.value[idx] - ref).abs().max().item()
        m = chains.shape[0]
        per_l2 = 1e3 * t_l2 / m
        print(f"| {n} | {'9-11' if last3 else f'0-{num_l - 1}'} | {m} | {1e3 * t_tr / m:.2f} | "
              f"{per_l2:.2f} | {info.matvecs.double().mean().item():.1f} | {1e3 * t_dense:.1f} | "
              f"{1e3 * t_dense / per_l2:.0f}x | "
              f"{err:.1e} ({k}) | {int(info.dense.sum())}/{m} |", flush=True)


if __name__ == "__main__":
    bench_markov(sys.argv[1:])
