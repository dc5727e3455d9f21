"""``python -m segment.eval.bench cutcheck``: the default method's partitions with the Krylov
eigensolver forced at every region size against the dense solver's, on dev images.

Per image it runs :func:`segment.core.cuts.recursive_ncut` on the method's chain twice, with
the dense solver (``--dense``, the device's by default) and with
:func:`segment.core.lanczos.second_eigenvectors` on every region, and compares the
partitions. Where they differ, :func:`first_differences` walks both recursions in lockstep
(each region cut alone, by both solvers) and reports the first regions where the two
decisions part: a different cut (``kind="cut"``) or one solver cutting where the other keeps
the region whole (``kind="escape"``, the two NCuts lie on either side of ``escape``). Each
such difference is a *near-tie* when the two NCuts (exact float64, of the two candidate
cuts of that region) differ by at most ``--tie``; otherwise the Krylov vector missed a
better cut, a failure. A region's Krylov start depends on its place in the padded batch of
its level, so where the lockstep walk (each region alone) finds nothing it is retried with
``--seeds`` other starts; an image whose partitions differ without any lockstep difference
even then is counted as ``unexplained``. Exit code 1 when any
difference is not a near-tie.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from segment.core import cuts

TIE = 0.01  # two NCuts closer than this are a near-tie (NCut lies in [0, 2], escape 0.5)


@dataclass
class Difference:
    """The first region where the two solvers' recursions part.

    Attributes:
        size: the region's tokens.
        kind: ``"cut"`` (both cut it, differently) or ``"escape"`` (one keeps it whole).
        ncut_a: the exact NCut of the first solver's best cut of the region.
        ncut_b: that of the second solver's.
        near_tie: ``|ncut_a - ncut_b| <= tie``.
    """

    size: int
    kind: str
    ncut_a: float
    ncut_b: float
    near_tie: bool


def first_differences(affinity: Tensor, tau: float, eig_a: cuts.EigenSolver,
                      eig_b: cuts.EigenSolver, tie: float = TIE,
                      affinity_b: Tensor | None = None) -> list[Difference]:
    """The regions where two eigensolvers' recursive cuts of one chain first part (or,
    with ``affinity_b``, where the cuts of two chains of the same image part: the same
    image's ``W`` from two environments, ``bench envcheck``).

    Args:
        affinity: ``(n, n)`` one image's symmetric ``W``.
        tau: the cut threshold (the method's ``escape``).
        eig_a, eig_b: the two eigensolvers (``best_cuts``' ``eigvec``).
        tie: the near-tie tolerance on the NCut.
        affinity_b: the second side's ``W`` (default: ``affinity``); ``ncut_b`` is then the
            NCut of its best cut on it.

    Returns:
        One :class:`Difference` per region where the decisions part (the recursion does not
        descend below it); empty when the two recursions agree everywhere.
    """
    from segment.core.cuts import best_cuts

    other = affinity if affinity_b is None else affinity_b
    out = []
    stack = [torch.arange(affinity.shape[0], device=affinity.device)]
    while stack:
        idx = stack.pop()
        if idx.numel() < 2:
            continue
        sub = affinity[idx[:, None], idx][None]
        size = torch.tensor([idx.numel()], device=affinity.device)
        na, sa = best_cuts(sub, size, eig_a)
        nb, sb = best_cuts(other[idx[:, None], idx][None], size, eig_b)
        na, nb, sa, sb = float(na[0]), float(nb[0]), sa[0], sb[0]
        ka, kb = na < tau, nb < tau
        same = torch.equal(sa, sb) or torch.equal(sa, ~sb)
        if ka == kb and (not ka or same):
            if ka:
                stack += [idx[sa], idx[~sa]]
            continue
        out.append(Difference(size=int(idx.numel()), kind="cut" if ka == kb else "escape",
                              ncut_a=na, ncut_b=nb, near_tie=abs(na - nb) <= tie))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from functools import partial

    from hydra import compose, initialize_config_module
    from hydra.utils import instantiate
    from PIL import Image

    from segment import backends
    from segment.core import cuts, lanczos
    from segment.eval.bench.common import find_weights
    from segment.methods.cuts import EscapeCuts
    from segment.models.vit import TimmViT

    p = argparse.ArgumentParser(prog="python -m segment.eval.bench cutcheck")
    p.add_argument("--data", nargs="+", default=["ecssd-dev"],
                   help="dev sets under $SEGMENT_SHARED/data (or folders of images)")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--images", type=int, default=None, help="the first N images of each set")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tie", type=float, default=TIE)
    p.add_argument("--tol", type=float, default=lanczos.TOL, help="the Krylov residual tolerance")
    p.add_argument("--seeds", type=int, default=4,
                   help="where the lockstep walk finds no difference, retry it with this many"
                        " other Krylov start seeds")
    p.add_argument("--dense", choices=["scipy", "torch"], default=None,
                   help="the dense solver (default: scipy on the CPU, torch elsewhere)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--weights", default=None)
    p.add_argument("--json", default=None, help="write the per-image results here")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    device = torch.device(args.device)
    dense = args.dense or ("scipy" if device.type == "cpu" else "torch")  # the device's dense one
    eig_a = partial(backends.second_eigenvectors, backend=dense)
    eig_b = partial(lanczos.second_eigenvectors, tol=args.tol)
    weights = find_weights(args.weights)
    with initialize_config_module(version_base="1.3", config_module="segment.configs"):
        cfg = compose("segment")
    method = instantiate(cfg.method)
    if not isinstance(method, EscapeCuts):
        raise SystemExit(f"cutcheck: the default method {type(method).__name__} cuts no chain")
    tau = float(method.escape)
    model = TimmViT(name="dinov2_vits14", arch="vit_small_patch14_dinov2.lvd142m",
                    pretrained=False, checkpoint=str(weights) if weights else None,
                    image_size=args.size, device=str(device))
    cap = method.capture(model.num_layers)
    import os

    shared = Path(os.environ.get("SEGMENT_SHARED", "/work/shared")) / "data"
    print(f"# cutcheck: {type(method).__name__} escape {tau}, {args.size} px, dense {dense} vs"
          f" Krylov (tol {args.tol:g}) at every region size, near-tie |dNCut| <= {args.tie:g}")
    print("| data | px | images | partitions differ | near-ties only | failures | unexplained |"
          " dense ms/img | Krylov ms/img |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows, bad = [], 0
    for data in args.data:
        root = Path(data) if Path(data).is_dir() else shared / data
        folder = root / "images" if (root / "images").is_dir() else root
        files = sorted(f for f in folder.rglob("*")
                       if f.suffix.lower() in (".jpg", ".jpeg", ".png", ".bmp"))
        files = files[: args.images] if args.images else files
        count = {"images": 0, "differ": 0, "near_tie": 0, "failure": 0, "unexplained": 0}
        t_a = t_b = 0.0
        for i in range(0, len(files), args.batch):
            chunk = files[i: i + args.batch]
            with torch.no_grad():
                x = model.collate([Image.open(f).convert("RGB") for f in chunk]).to(device)
                w = method.cut_affinity(model.extract(x, cap))
            t = time.perf_counter()
            pa = cuts.recursive_ncut(w, tau, eigvec=eig_a)
            t_a += time.perf_counter() - t
            t = time.perf_counter()
            pb = cuts.recursive_ncut(w, tau, eigvec=eig_b)
            t_b += time.perf_counter() - t
            for j, f in enumerate(chunk):
                count["images"] += 1
                if torch.equal(pa.labels[j], pb.labels[j]):
                    continue
                count["differ"] += 1
                diffs = first_differences(w[j], tau, eig_a, eig_b, args.tie)
                for seed in range(1, 1 + args.seeds * (not diffs)):
                    # a region's Krylov start depends on its place in the padded batch: where
                    # the walk alone finds nothing, other starts show where the vectors part
                    diffs = first_differences(
                        w[j], tau, eig_a, partial(lanczos.second_eigenvectors, tol=args.tol,
                                                  seed=seed), args.tie)
                    if diffs:
                        break
                if not diffs:
                    count["unexplained"] += 1
                elif all(d.near_tie for d in diffs):
                    count["near_tie"] += 1
                else:
                    count["failure"] += 1
                    bad += 1
                rows.append({"data": data, "image": str(f.relative_to(folder)), "regions_dense": int(pa.counts[j]),
                             "regions_krylov": int(pb.counts[j]),
                             "differences": [asdict(d) for d in diffs]})
                print(f"  {data} {f.name}: {int(pa.counts[j])} vs {int(pb.counts[j])} regions; "
                      + ("; ".join(f"{d.kind} at {d.size} tokens, NCut {d.ncut_a:.4f} vs"
                                   f" {d.ncut_b:.4f} ({'near-tie' if d.near_tie else 'FAILURE'})"
                                   for d in diffs) or "no lockstep difference (unexplained)"),
                      flush=True)
        print(f"| {data} | {args.size} | {count['images']} | {count['differ']} |"
              f" {count['near_tie']} | {count['failure']} | {count['unexplained']} |"
              f" {1e3 * t_a / max(count['images'], 1):.1f} | {1e3 * t_b / max(count['images'], 1):.1f} |",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
