"""``python -m segment.eval.bench tree``: the cost of the tree of escape cuts
(:func:`segment.core.cuts.cut_tree`) against today's cut (:func:`segment.core.cuts.recursive_ncut`)
and the backbone forward, on real DINOv2 chains of ecssd-dev images, in the same rounds.

Per ``--min-tokens`` floor it times, per image:

- ``cut``: the cut alone on the method's chain ``W`` (``recursive_ncut(W, escape)`` for today,
  ``cut_tree(W, min_tokens, escape)`` for the tree), the method's eigensolver;
- ``stage``: the whole region stage: today's ``EscapeCuts(record)``, and for the tree the chain,
  the tree and the pixel stage (refinement, components, foreground) run once on its leaves,
  as the tree's method will (``segment.methods.stages.pixel_regions`` on the leaves' one-hot grid),

with the ratio of each stage to the forward of the same batch (medians of the rounds' ratios).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from segment.eval.bench.common import best_time, find_weights


def main(argv: Sequence[str] | None = None) -> None:
    from PIL import Image

    import segment
    from segment import backends
    from segment.core import cuts
    from segment.methods.cuts import HEAT
    from segment.methods.stages import pixel_regions

    p = argparse.ArgumentParser(prog="python -m segment.eval.bench tree")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--images", type=int, default=8, help="the first N ecssd-dev images")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--min-tokens", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--weights", default=None)
    p.add_argument("--root", default=None,
                   help="ecssd-dev (default: $SEGMENT_SHARED/data/ecssd-dev)")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    weights = find_weights(args.weights)
    if weights is None:
        raise SystemExit("needs the DINOv2 weights: --weights PATH or SEGMENT_SHARED")
    root = Path(args.root) if args.root else weights.parents[1] / "data" / "ecssd-dev"
    names = sorted((root / "images").iterdir())[: args.images]
    device = torch.device(args.device)
    seg = segment.load("dinov2_vits14", "cuts", checkpoint=str(weights), device=str(device),
                       image_size=args.size)
    method, model = seg.method, seg.backbone
    escape = float(method.escape)
    eigvec = partial(backends.second_eigenvectors, backend=None)  # the device's, as the method's
    pixels = [seg.preprocess(Image.open(p).convert("RGB")) for p in names]
    batches = [torch.stack(pixels[i: i + args.batch]).to(device)
               for i in range(0, len(pixels), args.batch)]
    print(f"# the tree of escape cuts vs recursive_ncut (escape {escape}) and the forward: "
          f"{len(names)} ecssd-dev images at {args.size} px, batch {args.batch}, device {device},"
          f" {torch.get_num_threads()} threads, eigensolver "
          f"{backends.eigen_backend(device)}")

    def tree_stage(rec, mt: int) -> None:
        w = method.cut_affinity(rec)
        trees = cuts.cut_tree(w, mt, escape, eigvec=eigvec)
        leaves = torch.stack([t.leaves for t in trees])  # (B, n)
        h, ww = rec.layout.grid
        grid = F.one_hot(leaves, int(leaves.max()) + 1).to(torch.float32)
        pixel_regions(rec, grid.transpose(1, 2).reshape(len(trees), -1, h, ww),
                      score=method.scoring, refine=method.refinement,
                      components=method.components, heat=HEAT, name=method.name)

    with torch.no_grad():
        recs = [model.extract(x, seg.capture) for x in batches]
        ws = [method.cut_affinity(r) for r in recs]
        stats = {mt: [cuts.cut_tree(w, mt, escape, eigvec=eigvec) for w in ws]
                 for mt in args.min_tokens}
        for r in recs:  # warm-up
            method(r)
            tree_stage(r, args.min_tokens[0])
        rounds = []
        for _ in range(args.repeat):
            got: dict[str, float] = {"forward": 0.0, "cut today": 0.0, "stage today": 0.0}
            for x, rec, w in zip(batches, recs, ws):
                got["forward"] += best_time(lambda: model.forward_plain(x), device)
                got["stage today"] += best_time(lambda: method(rec), device)
                got["cut today"] += best_time(
                    lambda: cuts.recursive_ncut(w, escape, eigvec=eigvec), device)
                for mt in args.min_tokens:
                    got[f"cut {mt}"] = got.get(f"cut {mt}", 0.0) + best_time(
                        lambda: cuts.cut_tree(w, mt, escape, eigvec=eigvec), device)
                    got[f"stage {mt}"] = got.get(f"stage {mt}", 0.0) + best_time(
                        lambda: tree_stage(rec, mt), device)
            rounds.append(got)
    n = len(names)
    fwd = statistics.median(r["forward"] for r in rounds)
    print(f"forward {1e3 * fwd / n:.1f} ms/img (median of {args.repeat} rounds)")
    print("| cut | leaves / img | splits at most per path | cut ms/img | cut / today's cut |"
          " stage ms/img | stage / forward |")
    print("|---|---|---|---|---|---|---|")
    for key in ["today"] + args.min_tokens:
        cut = statistics.median(r[f"cut {key}"] for r in rounds)
        stage = statistics.median(r[f"stage {key}"] for r in rounds)
        rel = statistics.median(r[f"cut {key}"] / r["cut today"] for r in rounds)
        ratio = statistics.median(r[f"stage {key}"] / r["forward"] for r in rounds)
        if key == "today":
            label, leaves, depth = f"recursive_ncut({escape})", "-", "-"
        else:
            trees = [t for ts in stats[key] for t in ts]
            label = f"cut_tree(min_tokens={key})"
            leaves = f"{statistics.mean(t.num_leaves for t in trees):.1f}"
            depth = str(max(t.depth for t in trees))
        print(f"| {label} | {leaves} | {depth} | {1e3 * cut / n:.1f} | {rel:.2f} | "
              f"{1e3 * stage / n:.1f} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
