"""``python -m segment.eval.bench diagnose``: the cost of ``segment-diagnose`` per image
against the bare backbone forward of the same image (see the package docstring)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

from segment.eval.bench.common import best_time, example_image, find_weights


def main(argv: Sequence[str]) -> None:
    from segment.core import diagnostics as dg
    from segment.core.record import Capture
    from segment.models.vit import TimmViT

    p = argparse.ArgumentParser(prog="python -m segment.eval.bench diagnose")
    p.add_argument("--sizes", type=int, nargs="+", default=[224])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--weights", default=None)
    args = p.parse_args(list(argv))
    weights = find_weights(args.weights)
    print(f"# segment-diagnose per image vs the bare forward: DINOv2 ViT-S/14 (all 12 layers x 6"
          f" heads), cpu, {torch.get_num_threads()} torch threads, batch 1, weights"
          f" {weights or 'random init'}; medians of {args.repeat} interleaved rounds")
    print("| px | tokens | forward ms | capture ms | measures ms | of which spectra ms |"
          " of which TokenRank ms | stable rank ms | diagnose / forward |")
    print("|---|---|---|---|---|---|---|---|---|")
    img = example_image()
    for size in args.sizes:
        model = TimmViT(name="dinov2_vits14", arch="vit_small_patch14_dinov2.lvd142m",
                        pretrained=False, checkpoint=str(weights) if weights else None,
                        image_size=size, device="cpu")
        x = model.collate([img])
        cap = Capture(layers=None, heads="keep")
        with torch.no_grad():
            model.forward_plain(x)  # warm-up
            rec = model.extract(x, cap)
        attn = torch.stack([rec.attn[i][0] for i in rec.layers])  # (L, H, N, N)
        chain = dg.grid_chain(attn, rec.layout.prefix)
        rounds = []
        for _ in range(args.repeat):
            t_fwd = best_time(lambda: model.forward_plain(x), torch.device("cpu"))
            t0 = time.perf_counter()
            with torch.no_grad():
                rec = model.extract(x, cap)
            t_cap = time.perf_counter() - t0
            t_all = best_time(lambda: dg.diagnose_heads(attn, rec.layout.prefix),
                              torch.device("cpu"))
            t_eig = best_time(lambda: dg.eigen_moduli(chain), torch.device("cpu"))
            t_tr = best_time(lambda: dg.exact_tokenrank(chain), torch.device("cpu"))
            t_sr = best_time(lambda: dg.stable_rank(attn), torch.device("cpu"))
            rounds.append((t_fwd, t_cap, t_all, t_eig, t_tr, t_sr, (t_cap + t_all) / t_fwd))
        med = [statistics.median(r[j] for r in rounds) for j in range(7)]
        print(f"| {size} | {rec.layout.num_tokens} | " + " | ".join(f"{1e3 * v:.0f}" for v in med[:6])
              + f" | {med[6]:.1f} |", flush=True)
