"""Peak memory of FLUX attention capture vs the number of captured blocks.

Runs the tiny random FLUX transformer with its depth increased on a 1024-px-sized token
sequence (a 64 x 64 latent-token grid = 4,096 image tokens, plus 256 text tokens as
FLUX-schnell: ``N = 4,352``) and captures the first ``k`` blocks for several ``k``, each in a
fresh process so that peaks do not mix. Reported: the peak memory of the capture forward
above the memory held before it (model and inputs), on CPU from the kernel's peak-RSS
counter (reset through ``/proc/self/clear_refs`` before the forward), on CUDA from
``torch.cuda.max_memory_allocated``.

With on-the-fly reduction (heads fused, blocks averaged: ``--mode mean``/``lambda2``) the
peak must not grow with ``k``: only one block's ``(B, H, N, N)`` matrices exist at a time.
``--mode keep`` (every head of every block kept) is the contrast that grows linearly.

    python -m segment.eval.bench.flux                       # CPU, k = 1 2 4 8 16, mean + keep
    python -m segment.eval.bench.flux --device cuda --heads 24 --json bench.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from segment.utils import atomic_write_json

MiB = 2**20


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _child(args: argparse.Namespace) -> dict[str, Any]:
    """One measurement: build, capture the first ``args.child`` blocks, report memory."""
    from segment.models.flux import FluxInputs, capture_forward, latent_image_ids
    from segment.models.flux_tiny import build_tiny_components

    from segment.core.record import Capture, TokenLayout
    from segment.core.reduce import AttentionReducer

    torch.set_num_threads(max(1, min(args.threads, os.cpu_count() or 1)))
    dev = torch.device(args.device)
    depth = args.depth
    n_double = (depth + 1) // 2
    comps = build_tiny_components(
        num_layers=n_double, num_single_layers=depth - n_double, num_heads=args.heads,
        head_dim=16, axes_dims_rope=(4, 6, 6), text_dim=32,
    )
    tr = comps.transformer.eval().requires_grad_(False).to(dev)
    h, w = args.grid
    g = torch.Generator().manual_seed(0)
    x = FluxInputs(
        latents=torch.randn(args.batch, h * w, 64, generator=g).to(dev),
        img_ids=latent_image_ids((h, w), dev),
        text=torch.randn(args.batch, args.text, 32, generator=g).to(dev),
        txt_ids=torch.zeros(args.text, 3, device=dev),
        pooled=torch.randn(args.batch, 32, generator=g).to(dev),
        timestep=torch.full((args.batch,), 0.5, device=dev),
    )
    n = args.text + h * w
    layout = TokenLayout(num_tokens=n, prefix=args.text, grid=(h, w), cls_index=None, kind="dit")
    k = args.child
    capture = Capture(
        layers=tuple(range(k)),
        heads="keep" if args.mode == "keep" else args.mode,
        average_layers=args.mode != "keep",
    )
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    else:
        if not _reset_peak_rss():
            raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs); run on Linux")
        base = (_status_kib("VmRSS") or 0) * 1024
    t0 = time.perf_counter()
    with torch.no_grad():
        reducer = AttentionReducer(capture, depth, layout)
        capture_forward(tr, x, reducer=reducer)
        rec = reducer.record((h * 16, w * 16))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
    else:
        peak = (_status_kib("VmHWM") or 0) * 1024
    held = sum(t.numel() * t.element_size() for t in rec.attn.values())
    return {
        "blocks": k, "mode": args.mode, "tokens": n, "heads": args.heads, "batch": args.batch,
        "peak_above_base_mib": (peak - base) / MiB, "peak_mib": peak / MiB,
        "base_mib": base / MiB, "record_mib": held / MiB,
        "block_matrices_mib": args.batch * args.heads * n * n * 4 / MiB,
        "seconds": time.perf_counter() - t0, "device": str(dev),
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m segment.eval.bench.flux", description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                   help="numbers of captured blocks (the first k of the model)")
    p.add_argument("--modes", nargs="+", default=["mean", "keep"],
                   choices=["mean", "lambda2", "keep"], help="reductions to measure")
    p.add_argument("--grid", type=int, nargs=2, default=[64, 64], metavar=("H", "W"),
                   help="latent-token grid (64 64 = a 1024 px image)")
    p.add_argument("--text", type=int, default=256, help="text tokens (schnell 256, dev 512)")
    p.add_argument("--heads", type=int, default=2, help="attention heads of the tiny model")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None, help="write the rows to this file")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="mean", help=argparse.SUPPRESS)
    p.add_argument("--depth", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; prints a table (and writes ``--json``). Returns the exit code."""
    args = _parser().parse_args(argv)
    if args.child is not None:
        print(json.dumps(_child(args)))
        return 0
    if min(args.blocks) < 1:
        raise SystemExit("--blocks must be >= 1")
    depth = max(args.blocks)
    rows = []
    print(f"FLUX capture memory: {args.text} text + {args.grid[0]}x{args.grid[1]} image tokens,"
          f" {args.heads} heads, batch {args.batch}, depth {depth}, {args.device}")
    print(f"{'mode':>8} {'blocks':>6} {'peak-base MiB':>14} {'record MiB':>11} {'one block MiB':>14} {'s':>6}")
    for mode in args.modes:
        for k in args.blocks:
            cmd = [sys.executable, "-m", "segment.eval.bench.flux", "--child", str(k), "--mode", mode,
                   "--depth", str(depth), "--grid", *map(str, args.grid), "--text", str(args.text),
                   "--heads", str(args.heads), "--batch", str(args.batch), "--device", args.device,
                   "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                sys.stderr.write(out.stderr)
                raise SystemExit(f"benchmark child failed: {' '.join(cmd)}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{mode:>8} {k:>6} {row['peak_above_base_mib']:>14.1f} {row['record_mib']:>11.1f}"
                  f" {row['block_matrices_mib']:>14.1f} {row['seconds']:>6.2f}")
    if args.json:
        atomic_write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
