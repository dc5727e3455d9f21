"""``python -m segment.eval.bench cutmem [--tokens 1024 2304 4096] [--batch 1 2]``: the
predicted peak memory of the cuts (:func:`segment.core.cuts.cut_peak_bytes`) against the
measured one.

Each case runs in a fresh process: a random symmetric ``W`` of ``batch`` images of ``n``
tokens is built (block structure, so that the recursion cuts), the process's resident size is
read, :func:`segment.core.cuts.recursive_ncut` runs with the given eigensolver, and the peak
resident size (``ru_maxrss``) above the size before the call is printed beside the
prediction for the first level, ``cut_peak_bytes(n, batch)``; with ``--limit-images K`` the
level is limited to K images' worth of memory (chunked) and the peak must fall accordingly.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence

CHILD = r"""
import json, resource, sys, torch
from functools import partial
from segment import backends
from segment.core import cuts
n, b, eigen, limit = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
w = torch.rand(b, n, n, generator=g)
blocks = torch.arange(n) * 4 // n
w += 4.0 * (blocks[:, None] == blocks[None, :])
w += w.transpose(1, 2).clone()
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
before = rss()
peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
lim = None if limit == "none" else int(float(limit) * cuts.cut_peak_bytes(n))
part = cuts.recursive_ncut(w, 0.5, eigvec=partial(backends.second_eigenvectors, backend=eigen),
                           memory_limit=lim)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"before": before, "peak": peak, "peak_before": peak_before,
                  "regions": part.counts.tolist()}))
"""


def main(argv: Sequence[str] | None = None) -> int:
    from segment.core.cuts import cut_peak_bytes

    p = argparse.ArgumentParser(prog="python -m segment.eval.bench cutmem")
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2304, 4096])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2])
    p.add_argument("--eigen", default="krylov", choices=["scipy", "torch", "krylov"])
    p.add_argument("--limit-images", type=float, default=None,
                   help="memory_limit = this many images' cut_peak_bytes (chunks the level)")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    limit = "none" if args.limit_images is None else str(args.limit_images)
    print(f"# cuts' peak memory, eigensolver {args.eigen}, memory_limit {limit} images;"
          f" MiB above the resident size before recursive_ncut")
    print("| tokens | batch | predicted MiB | measured MiB | measured / predicted | regions |")
    print("|---|---|---|---|---|---|")
    for n in args.tokens:
        for b in args.batch:
            out = subprocess.run([sys.executable, "-c", CHILD, str(n), str(b), args.eigen, limit],
                                 capture_output=True, text=True, check=True)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            k = b if args.limit_images is None else min(b, max(1, int(args.limit_images)))
            pred = cut_peak_bytes(n, k)
            used = max(got["peak"] - got["before"], 0)
            print(f"| {n} | {b} | {pred / 2**20:.0f} | {used / 2**20:.0f} |"
                  f" {used / pred:.2f} | {got['regions']} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
