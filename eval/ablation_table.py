"""One long table of paired ablations from several `segment-eval` runs: rows = (set, method).

    python -m segment.eval.ablation_table --out eval/results/dev_set/claims \
        ecssd=RUN_ECSSD pascal=RUN_PASCAL camvid=RUN_CAMVID

Each ``NAME=RUN`` is a `segment-eval` output folder (its ``results.json``) run with bootstrap
intervals (``bootstrap``, on by default); its first row is the baseline of the paired
differences. Every other row gets its mIoU difference with the paired 95% interval and a
verdict: ``helps`` (interval above 0), ``hurts`` (below 0) or ``within noise`` (it contains
0). Binary sets add the peer metrics (fgIoU, acc, maxF, maxF_img) and the maxF difference
with its own verdict; multi-class sets add the segments per image. Writes ``OUT.md`` and
``OUT.csv``.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

HEADER = ["set", "method", "pixAcc", "mIoU", "ΔmIoU (95% CI)", "mIoU verdict", "mAP", "fgIoU",
          "acc", "maxF", "maxF_img", "ΔmaxF (95% CI)", "maxF verdict", "regions/img"]


def verdict(delta: list[float] | None) -> str:
    """``helps`` / ``hurts`` / ``within noise`` from ``[difference, low, high]`` (``-``
    for the baseline)."""
    if delta is None:
        return "-"
    _, lo, hi = delta
    return "helps" if lo > 0 else "hurts" if hi < 0 else "within noise"


def _delta_text(delta: list[float] | None) -> str:
    return "-" if delta is None else f"{delta[0]:+.2f} ({delta[1]:+.2f}, {delta[2]:+.2f})"


def rows_of(name: str, rows: list[dict]) -> list[list[str]]:
    """The table rows of one run (``rows``: its ``results.json``)."""
    if not rows or "ci95" not in rows[0]:
        raise SystemExit(f"{name}: the run has no bootstrap intervals (rerun with bootstrap=1000)")
    out = []
    for r in rows:
        d = r.get("delta") or {}
        binary = "mAP" in r

        def num(key: str, fmt: str = "{:.2f}", r=r) -> str:
            return fmt.format(r[key]) if r.get(key) is not None else ""

        out.append([
            name, r["method"], num("pixAcc"), num("mIoU"), _delta_text(d.get("mIoU")), verdict(d.get("mIoU")),
            num("mAP"), num("fgIoU"), num("acc"), num("maxF"), num("maxF_img"),
            _delta_text(d.get("maxF")) if binary else "", verdict(d.get("maxF")) if binary else "",
            "" if binary else num("regions", "{:.1f}"),
        ])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m segment.eval.ablation_table", description=__doc__.split("\n")[0])
    p.add_argument("sets", nargs="+", metavar="NAME=RUN")
    p.add_argument("--out", required=True, help="output path without extension (.md and .csv)")
    p.add_argument("--preamble", type=Path, help="Markdown put above the table in OUT.md (setup, commands)")
    args = p.parse_args(argv)
    table = []
    for spec in args.sets:
        name, _, run = spec.partition("=")
        if not (name and run):
            p.error(f"{spec!r}: expected NAME=RUN")
        results = Path(run) / "results.json"
        if not results.is_file():
            p.error(f"{results}: not found (is {run} a segment-eval output folder?)")
        table += rows_of(name, json.loads(results.read_text(encoding="utf-8")))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([HEADER] + table)
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(c or "" for c in r) + " |" for r in table]
    pre = args.preamble.read_text(encoding="utf-8").rstrip("\n") + "\n\n" if args.preamble else ""
    out.with_suffix(".md").write_text(pre + "\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
