"""``python -m segment.eval.bench cuts``: the escape cuts' eigensolvers on real attention
(see the package docstring)."""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence

import torch
from segment.eval.bench.common import best_time, find_weights


def _examples() -> list:
    from importlib.resources import files

    from PIL import Image

    folder = files("segment.datasets").joinpath("examples")
    return [Image.open(folder.joinpath(n)).convert("RGB")
            for n in ("astronaut.png", "chelsea.png", "coffee.png")]


def bench_cuts(argv: Sequence[str]) -> None:
    from segment import backends
    from segment.core import cuts
    from segment.methods import EscapeCuts
    from segment.models.vit import TimmViT

    p = argparse.ArgumentParser(prog="python -m segment.eval.bench cuts")
    p.add_argument("--sizes", type=int, nargs="+", default=[224, 448])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--weights", default=None)
    args = p.parse_args(list(argv))
    device = torch.device(args.device)
    weights = find_weights(args.weights)
    method = EscapeCuts()
    solvers = {"torch.linalg.eigh (batched, padded)": None}
    if device.type == "cpu":
        solvers["scipy eigh evx (one vector)"] = backends.second_eigenvectors_lapack
    print(f"# recursive normalized cuts of the default `cuts` chain (escape {method.escape}),"
          f" the three bundled examples: device {device}, {torch.get_num_threads()} threads,"
          f" weights {weights or 'random init'}")
    print("| px | tokens | eigensolver | cuts ms/img | ratio to torch | regions per image |"
          " partitions equal to torch |")
    print("|---|---|---|---|---|---|---|")
    imgs = _examples()
    for size in args.sizes:
        model = TimmViT(name="dinov2_vits14", arch="vit_small_patch14_dinov2.lvd142m",
                        pretrained=False, checkpoint=str(weights) if weights else None,
                        image_size=size, device=str(device))
        with torch.no_grad():
            rec = model.extract(model.collate(imgs).to(device), method.capture(model.num_layers))
            w = method.cut_affinity(rec)
            parts = {k: cuts.recursive_ncut(w, method.escape, eigvec=f)  # warm-up
                     for k, f in solvers.items()}
            # interleaved rounds: a machine that slows down mid-run moves all solvers alike
            rounds = [{k: best_time(lambda f=f: cuts.recursive_ncut(w, method.escape, eigvec=f),
                                    device) for k, f in solvers.items()}
                      for _ in range(args.repeat)]
        base = next(iter(solvers))
        n = len(imgs)
        for k in solvers:
            t = statistics.median(r[k] for r in rounds)
            ratio = statistics.median(r[k] / r[base] for r in rounds)
            same = sum(torch.equal(a, b) for a, b in zip(parts[k].labels, parts[base].labels))
            print(f"| {size} | {rec.layout.num_tokens} | {k} | {1e3 * t / n:.1f} | {ratio:.2f} |"
                  f" {parts[k].counts.tolist()} | {same} of {n} |", flush=True)


if __name__ == "__main__":
    bench_cuts(sys.argv[1:])
