"""One table from several `segment-eval` runs: rows = methods (recipes), columns = sets.

    python -m segment.eval.sweep_table --out eval/results/dev_set/sweep_recipe \
        ecssd=OUT_ECSSD:../shared/data/ecssd-dev/REFERENCE.md \
        pascal=OUT_PASCAL:../shared/data/pascal-dev/REFERENCE.md \
        camvid=OUT_CAMVID:../shared/data/camvid-dev/REFERENCE.md

Each ``NAME=RUN:REFERENCE`` pairs a `segment-eval` output folder (its ``results.json``) with
the set's ``REFERENCE.md``; the best row of the first table there that has a ``mIoU`` column
(the default input size) is the bar. A binary set (rows with ``mAP``) must beat it by
``--binary-margin`` mIoU (2) and match its best mAP; a multi-class set (rows with
``regions``) by ``--scene-margin`` (3). The last columns give every set's margin and the
worst set, the one a recipe is chosen by. A run with bootstrap intervals (``segment-eval``'s
``bootstrap``, on by default) adds a column per set: each recipe's mIoU difference to that
run's first row (the default) with its paired 95% interval. Binary runs that report the
peer metrics add their fgIoU and maxF. Writes ``OUT.md`` and ``OUT.csv``.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path


def best_reference(path: Path) -> dict[str, float]:
    """The best ``mIoU`` (and ``mAP`` when present) of the first table with a mIoU column."""
    header: list[str] | None = None
    best: dict[str, float] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("|"):
            if best:
                break  # the first table has ended
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells if "mIoU" in cells else None
            continue
        if set("".join(cells)) <= set("-: "):
            continue  # the separator row
        for col in ("mIoU", "mAP"):
            if col in header:
                value = re.match(r"[-+]?\d+(\.\d+)?", cells[header.index(col)])
                if value:
                    best[col] = max(best.get(col, float("-inf")), float(value.group()))
    if "mIoU" not in best:
        raise SystemExit(f"{path}: no table with a mIoU column")
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m segment.eval.sweep_table", description=__doc__.split("\n")[0])
    p.add_argument("sets", nargs="+", metavar="NAME=RUN:REFERENCE")
    p.add_argument("--out", required=True, help="output path without extension (.md and .csv)")
    p.add_argument("--binary-margin", type=float, default=2.0)
    p.add_argument("--scene-margin", type=float, default=3.0)
    args = p.parse_args(argv)
    runs: dict[str, dict[str, dict]] = {}
    refs: dict[str, dict[str, float]] = {}
    for spec in args.sets:
        name, _, rest = spec.partition("=")
        run, _, ref = rest.partition(":")
        if not (name and run and ref):
            p.error(f"{spec!r}: expected NAME=RUN:REFERENCE")
        results = Path(run) / "results.json"
        if not results.is_file():
            p.error(f"{results}: not found (is {run} a segment-eval output folder?)")
        runs[name] = {row["method"]: row for row in json.loads(results.read_text())}
        refs[name] = best_reference(Path(ref))
    methods = list(dict.fromkeys(m for rows in runs.values() for m in rows))
    # runs with bootstrap intervals: each recipe's paired mIoU difference to the run's first row
    paired = {name: next(iter(rows)) for name, rows in runs.items()
              if any("delta" in r for r in rows.values())}
    # binary runs with the peer metrics (per-image fgIoU, maxF at the original resolution)
    peer = {name for name, rows in runs.items() if all("maxF" in r for r in rows.values())}
    header = ["recipe"]
    for name, rows in runs.items():
        scene = any("regions" in r and "mAP" not in r for r in rows.values())
        header += [f"{name} pixAcc", f"{name} mIoU"] + ([f"{name} regions/img"] if scene else [f"{name} mAP"])
        if name in peer:
            header += [f"{name} fgIoU", f"{name} maxF"]
        if name in paired:
            header.append(f"{name} ΔmIoU vs {paired[name]} (95% CI)")
    header += [f"mIoU over best REFERENCE ({' / '.join(runs)})", "worst set (margin over its target)"]
    table = []
    for m in methods:
        row, margins = [m], []
        for name, rows in runs.items():
            r = rows.get(m)
            scene = "regions" in (r or {}) and "mAP" not in (r or {})
            if r is None:
                row += ["", "", ""] + (["", ""] if name in peer else []) + ([""] if name in paired else [])
                continue
            row += [f"{r['pixAcc']:.2f}", f"{r['mIoU']:.2f}",
                    f"{r['regions']:.1f}" if scene else f"{r['mAP']:.2f}"]
            if name in peer:
                row += [f"{r['fgIoU']:.2f}", f"{r['maxF']:.2f}"]
            if name in paired:
                d = (r.get("delta") or {}).get("mIoU")
                row.append("-" if d is None else f"{d[0]:+.2f} ({d[1]:+.2f}, {d[2]:+.2f})")
            over = r["mIoU"] - refs[name]["mIoU"]
            target = args.scene_margin if scene else args.binary_margin
            slack = over - target
            if not scene and "mAP" in refs[name]:
                slack = min(slack, r["mAP"] - refs[name]["mAP"])  # mAP must match too
            margins.append((slack, name, over))
        row.append(" / ".join(f"{o:+.2f}" for _, _, o in margins))
        if margins:
            slack, name, _ = min(margins)
            row.append(f"{name} ({slack:+.2f})")
        else:
            row.append("")
        table.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([header] + table)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in table]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
