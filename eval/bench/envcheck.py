"""``python -m segment.eval.bench envcheck``: does the default's output depend on the machine?

Two steps, so that each environment (thread count, ATen's CPU kernels, a venv with other
dependency versions, torchrun) runs the same command and two of them are compared after:

``envcheck record DIR [--data SET ...]``
    runs the default method (``segment.load()``, the API's batches of 8 in sorted order) on
    every image of the dev sets at the README's input for each (ecssd-dev and pascal-dev at
    224 px, camvid-dev at 336 x 448, bsds-dev with the long side at 448 px), and writes per
    image its label map at the photo's size, its token partition at ``escape`` and the
    chain ``W`` it was cut on, plus ``env.json`` (threads, ATen's capability, versions).
    Under ``torchrun`` each rank takes every ``world_size``-th image (as ``segment-eval``
    shards), so its batches hold other images.

``envcheck compare DIR_A DIR_B [--json OUT]``
    per set, how many images' label maps differ, and why. An image whose token partitions
    differ is walked in lockstep (:func:`~segment.eval.bench.cutcheck.first_differences`,
    ``W_A`` against ``W_B``, each region cut by the dense float64 solver on both chains): a
    difference is a *near-tie* when the two best NCuts of the first region where the
    recursions part differ by at most ``--tie`` (cutcheck's rule: hard cuts take an argmin,
    so a 1e-7 change in attention can flip a cut between two near-equal ones). Where the
    dense walks agree, the method's Krylov solver parted (its start depends on a region's
    place in the padded batch): the walk is repeated with each side's Krylov solver against
    the dense one (cutcheck). Images whose partitions are equal but whose label maps differ
    moved in the pixel stage; their changed pixels are counted. Exit code 1 when a
    difference is neither a near-tie nor explained.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import numpy as np
import torch

from segment.eval.bench.cutcheck import TIE, first_differences

# the README's input per dev set (its headline table and configs/experiment/regions_bsds.yaml)
PRESETS: dict[str, dict] = {
    "ecssd-dev": {},
    "pascal-dev": {},
    "camvid-dev": {"image_size": [336, 448]},
    "bsds-dev": {"image_size": [294, 448], "match_orientation": True},
}
EXTS = (".jpg", ".jpeg", ".png", ".bmp")


def _files(root: Path) -> list[Path]:
    folder = root / "images" if (root / "images").is_dir() else root
    return sorted(f for f in folder.rglob("*") if f.suffix.lower() in EXTS)


def _env() -> dict:
    from segment.eval.bench.common import cpu_model
    from segment.run.job.manifest import package_versions

    versions = package_versions(("torch", "torchvision", "timm", "numpy", "pillow", "scipy",
                                 "scikit-image", "opencv-python-headless", "kornia"))
    return {"torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "aten_capability": torch.backends.cpu.get_cpu_capability(),
            "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY"),
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "machine": platform.machine(), "processor": cpu_model(), "versions": versions}


def record(out: Path, sets: Sequence[str], weights: Path | None, limit: int | None) -> None:
    from PIL import Image
    from tqdm import tqdm

    import segment
    from segment.run import dist

    ctx = dist.init("cpu")
    shared = Path(os.environ.get("SEGMENT_SHARED", "../shared")) / "data"
    for name in sets:
        root = Path(name) if Path(name).is_dir() else shared / name
        seg = segment.load(checkpoint=weights, device="cpu", **PRESETS.get(root.name, {}))
        files = _files(root)[:limit]
        mine = dist.shard(files, ctx)
        dest = out / root.name
        dest.mkdir(parents=True, exist_ok=True)
        tau = float(seg.method.escape)
        bar = tqdm(range(0, len(mine), seg.batch_size), desc=f"{root.name} rank {ctx.rank}",
                   unit="batch", disable=not ctx.is_main)
        for i in bar:
            chunk = mine[i: i + seg.batch_size]
            ims = [Image.open(f).convert("RGB") for f in chunk]
            # the API's own batching (one preprocessed size per batch), done here by hand so
            # that the chain W of the same forward is kept beside the labels
            groups: dict[tuple, list[int]] = {}
            pix = [seg.preprocess(im) for im in ims]
            for j, p in enumerate(pix):
                groups.setdefault(tuple(p.shape), []).append(j)
            for idx in groups.values():
                rec = seg.extract([pix[j] for j in idx])
                with torch.no_grad():
                    w = seg.method.cut_affinity(rec)
                out_b = seg.apply(rec)
                for k, j in enumerate(idx):
                    s = seg.postprocess(out_b, k, (ims[j].height, ims[j].width))
                    part = out_b.hierarchy[k].level(tau).labels
                    stem = chunk[j].stem
                    np.savez_compressed(dest / f"{stem}.npz", labels=s.labels.astype(np.int32),
                                        mask=s.mask, partition=part.cpu().numpy(),
                                        affinity=w[k].cpu().numpy())
    if ctx.is_main:
        (out / "env.json").write_text(json.dumps(_env(), indent=1) + "\n")
    dist.barrier(ctx)


def classify(a: dict, b: dict, tau: float, tie: float) -> dict:
    """Why one image's outputs differ between two environments (module docstring)."""
    from segment import backends
    from segment.core import lanczos

    wa = torch.from_numpy(a["affinity"]).double()
    wb = torch.from_numpy(b["affinity"]).double()
    row = {"pixels_changed": int((a["labels"] != b["labels"]).sum()),
           "pixels": int(a["labels"].size)}
    dense = partial(backends.second_eigenvectors, backend="scipy")
    if np.array_equal(a["partition"], b["partition"]):
        row["kind"] = "pixel stage"
        return row
    diffs = first_differences(wa, tau, dense, dense, tie, affinity_b=wb)
    how = "dense"
    if not diffs:  # the dense walks agree: a side's Krylov vector parted from the dense one
        how = "krylov"
        for seed in range(5):  # the method's start (0), then others where that walk finds none
            krylov = partial(lanczos.second_eigenvectors, tol=lanczos.TOL, seed=seed)
            diffs = first_differences(wa, tau, dense, krylov, tie) + first_differences(
                wb, tau, dense, krylov, tie)
            if diffs:
                break
    row["walk"] = how
    row["differences"] = [vars(d) for d in diffs]
    row["kind"] = ("unexplained" if not diffs else
                   "near-tie" if all(d.near_tie for d in diffs) else "failure")
    return row


def compare(a_dir: Path, b_dir: Path, tie: float, out_json: Path | None) -> int:
    import segment

    tau = float(segment.create_method("cuts").escape)
    env_a = json.loads((a_dir / "env.json").read_text())
    env_b = json.loads((b_dir / "env.json").read_text())
    moved = {k: (env_a.get(k), env_b.get(k)) for k in env_a
             if k != "versions" and env_a.get(k) != env_b.get(k)}
    moved.update({k: v for k, v in ((k, (env_a["versions"].get(k), env_b["versions"].get(k)))
                                    for k in env_a["versions"]) if v[0] != v[1]})
    print(f"# envcheck: {a_dir} vs {b_dir}; what differs: "
          + (", ".join(f"{k} {x} -> {y}" for k, (x, y) in moved.items()) or "nothing recorded"))
    print("| set | images | label maps differ | partitions differ: near-tie | failure |"
          " unexplained | pixel stage only (pixels changed) | max abs dW |")
    print("|---|---|---|---|---|---|---|---|")
    rows, bad = [], 0
    for sub in sorted(p for p in a_dir.iterdir() if p.is_dir()):
        other = b_dir / sub.name
        if not other.is_dir():
            continue
        names = sorted({p.name for p in sub.glob("*.npz")} & {p.name for p in other.glob("*.npz")})
        count = {"near-tie": 0, "failure": 0, "unexplained": 0, "pixel stage": 0}
        differ, px, dw = 0, 0, 0.0
        for n in names:
            a, b = dict(np.load(sub / n)), dict(np.load(other / n))
            image_dw = float(np.abs(a["affinity"].astype(np.float64) - b["affinity"]).max())
            dw = max(dw, image_dw)
            if np.array_equal(a["labels"], b["labels"]):
                continue
            differ += 1
            row = {**classify(a, b, tau, tie), "max_abs_dW": image_dw}
            count[row["kind"]] += 1
            px += row["pixels_changed"] if row["kind"] == "pixel stage" else 0
            rows.append({"set": sub.name, "image": n[:-4], **row})
            print(f"  {sub.name} {n[:-4]}: {row['kind']}, {row['pixels_changed']} of"
                  f" {row['pixels']} pixels; " + "; ".join(
                      f"{d['kind']} at {d['size']} tokens, NCut {d['ncut_a']:.4f} vs"
                      f" {d['ncut_b']:.4f}" for d in row.get("differences", [])), flush=True)
        bad += count["failure"] + count["unexplained"]
        print(f"| {sub.name} | {len(names)} | {differ} | {count['near-tie']} | {count['failure']} |"
              f" {count['unexplained']} | {count['pixel stage']} ({px}) | {dw:.2e} |", flush=True)
    if out_json:
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps({"a": env_a, "b": env_b, "tie": tie, "differences": rows},
                                       indent=1) + "\n")
    return 1 if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    from segment.eval.bench.common import find_weights

    p = argparse.ArgumentParser(prog="python -m segment.eval.bench envcheck",
                                description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    r = sub.add_parser("record", help="the default's outputs on the dev sets, into DIR")
    r.add_argument("dir", type=Path)
    r.add_argument("--data", nargs="+", default=list(PRESETS),
                   help="dev sets under $SEGMENT_SHARED/data (or folders of images)")
    r.add_argument("--images", type=int, default=None, help="the first N images of each set")
    r.add_argument("--weights", default=None)
    c = sub.add_parser("compare", help="which images differ between two records, and why")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    c.add_argument("--tie", type=float, default=TIE)
    c.add_argument("--json", type=Path, default=None, help="write the per-image differences here")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.step == "record":
        record(args.dir, args.data, find_weights(args.weights), args.images)
        return 0
    return compare(args.a, args.b, args.tie, args.json)
