"""``python -m segment.eval.bench nesting``: what one refinement of the tree costs against
refining every level on its own, on real DINOv2 chains of dev images.

For each image, ``cuts`` gives its tree and every pixel's leaf (one refinement of ``L`` maps,
:class:`segment.methods.EscapeCuts`). At each threshold ``t`` of ``--thresholds`` the nested
level ``tree.pixel_labels_at(leaves, t)`` is compared with the level refined on its own (the
one-hot of ``tree.labels_at(t)`` through the same pixel chain, every pixel's most likely
region): the share of pixels on which the two agree (both numbered by the level's ids), and
the regions per image. Times per image (best of ``--repeat``, the same rounds): the region
stage of ``cuts`` with the tree, the stage as it was without it (``recursive_ncut`` and the
pixel stage on the default level), and the refinement of every threshold's level on its own.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from segment.eval.bench.common import best_time, find_weights


def main(argv: Sequence[str] | None = None) -> None:
    from PIL import Image

    import segment
    from segment.core import cuts
    from segment.core.stages import refine_assignment
    from segment.methods.cuts import HEAT
    from segment.methods.stages import pixel_regions

    p = argparse.ArgumentParser(prog="python -m segment.eval.bench nesting")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--images", type=int, default=8, help="the first N images of the set")
    p.add_argument("--set", default="bsds-dev", help="a folder of $SEGMENT_SHARED/data")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.3, 0.4, 0.5, 0.6, 0.8, 1.0])
    p.add_argument("--weights", default=None)
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    weights = find_weights(args.weights)
    if weights is None:
        raise SystemExit("needs the DINOv2 weights: --weights PATH or SEGMENT_SHARED")
    root = weights.parents[1] / "data" / args.set / "images"
    names = sorted(q for q in root.rglob("*") if q.suffix.lower() in (".jpg", ".png"))[: args.images]
    seg = segment.load("dinov2_vits14", "cuts", checkpoint=str(weights), device="cpu",
                       image_size=args.size)
    method, model = seg.method, seg.backbone
    pixels = [seg.preprocess(Image.open(q).convert("RGB")) for q in names]
    batches = [torch.stack(pixels[i: i + args.batch]) for i in range(0, len(pixels), args.batch)]
    escape = float(method.escape)

    def old_stage(rec):
        part = cuts.recursive_ncut(method.cut_affinity(rec), escape)
        b = part.labels.shape[0]
        h, w = rec.layout.grid
        grid = F.one_hot(part.labels, int(part.counts.max())).float()
        return pixel_regions(rec, grid.transpose(1, 2).reshape(b, -1, h, w),
                             score=method.scoring, refine=method.refinement,
                             components=method.components, heat=HEAT, name=method.name)

    def direct(rec, trees, t):
        lab = torch.stack([tr.labels_at(t) for tr in trees])
        h, w = rec.layout.grid
        grid = F.one_hot(lab, int(lab.max()) + 1).float().transpose(1, 2).reshape(len(trees), -1, h, w)
        return refine_assignment(grid, rec.pixels, tuple(rec.image_size), method.refinement).max(1).indices

    agree: dict[float, list[float]] = {t: [] for t in args.thresholds}
    regions: dict[float, list[int]] = {t: [] for t in args.thresholds}
    leaves_n: list[int] = []
    times: dict[str, list[float]] = {"tree": [], "old": [], "levels": []}
    with torch.no_grad():
        for x in batches:
            rec = model.extract(x, seg.capture)
            out = method(rec)
            leaves_n += [tr.num_leaves for tr in out.hierarchy]
            for t in args.thresholds:
                d = direct(rec, out.hierarchy, t)
                for i, tr in enumerate(out.hierarchy):
                    nested = tr.pixel_labels_at(out.leaves[i], t)
                    agree[t].append(float((nested == d[i]).float().mean()))
                    regions[t].append(tr.count_at(t))
            for _ in range(args.repeat):
                times["tree"].append(best_time(lambda: method(rec), torch.device("cpu")) / len(x))
                times["old"].append(best_time(lambda: old_stage(rec), torch.device("cpu")) / len(x))
                times["levels"].append(sum(
                    best_time(lambda: direct(rec, out.hierarchy, t), torch.device("cpu"))
                    for t in args.thresholds) / len(x))
    print(f"# nesting: {len(names)} {args.set} images at {args.size} px, escape {escape}, "
          f"min_leaf {method.min_leaf} ({method.min_tokens(rec.layout.grid[0] * rec.layout.grid[1])}"
          f" tokens), {statistics.mean(leaves_n):.1f} leaves/img, {torch.get_num_threads()} threads")
    print("| t | regions / img | pixels where nested = refined on its own (mean) | (min) |")
    print("|---|---|---|---|")
    for t in args.thresholds:
        print(f"| {t:g} | {statistics.mean(regions[t]):.1f} | {statistics.mean(agree[t]):.4f} |"
              f" {min(agree[t]):.4f} |")
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    print(f"stage with the tree {med['tree']:.1f} ms/img; without it {med['old']:.1f} ms/img; "
          f"the {len(args.thresholds)} levels refined each on its own {med['levels']:.1f} ms/img "
          "(medians; a busy shared machine)")


if __name__ == "__main__":
    main()
