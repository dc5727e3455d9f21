"""The README's headline rows, rerun with the README's commands and diffed against the
committed tables.

    python -m segment.eval.reproduce [--shared DIR] [--weights PATH] [--out DIR]
                                     [--only SET ...] [--update]

Each row of the README's headline table (ecssd-dev, pascal-dev, camvid-dev, bsds-dev: the
sets whose data is in the shared folder) is one `segment-eval` command (:data:`ROWS`,
written in docs/evaluation.md's "Reproducing the tables" as well), run in a fresh folder
under ``--out`` (a temporary one by default). Every number of the committed table
(``eval/results/dev_set/default_vs_peers_<set>.json``: each method's metrics, class IoUs
and paired differences; not the timings) is compared with the new run's, and one line per
row says ``match`` or what differs and by how much.

The spread a number may move by (:data:`SPREAD`): across thread counts, CPU kernels and
the supported dependency versions no label map of the dev sets moved (docs/benchmarks.md,
"Numbers across machines"), so a rerun on another machine is expected to give the same
numbers up to the rounding of the float sums; what the spread allows beyond that is what
one image's near-tie (a cut the float noise can flip) moves a mean by on these sets:
0.05 points of a percentage, 0.0005 of Covering and PRI, 0.005 of VI.

``--update`` writes the new runs' ``results.{json,csv,md}`` over the committed tables and
the README's headline table from them (between its ``reproduce`` markers): how the README's
numbers are made. Exit 0 when every row matches (or after ``--update``), 1 when one
differs, 2 when the data, the weights or a run is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from segment.utils import EXIT_BAD_INPUT, EXIT_FAILED

REPO = Path(__file__).resolve().parent.parent
TABLES = REPO / "eval" / "results" / "dev_set"
README = REPO / "README.md"
BEGIN, END = "<!-- reproduce:begin -->", "<!-- reproduce:end -->"
SPREAD = {"Covering": 5e-4, "PRI": 5e-4, "VI": 5e-3}
DEFAULT_SPREAD = 0.05  # points of a percentage (and of a region count)
NOT_COMPARED = {"images_per_s", "method_ms_per_image", "ci95"}


@dataclass(frozen=True)
class Row:
    """One headline row: its set (a folder of ``shared/data``), the README's command
    (``{data}``, ``{weights}`` filled in) and its committed table's stem."""

    name: str
    overrides: tuple[str, ...]

    @property
    def table(self) -> Path:
        return TABLES / f"default_vs_peers_{self.name.split('-')[0]}"

    def command(self, data: Path, weights: Path, out: Path) -> list[str]:
        args = [a.replace("{data}", str(data / self.name)).replace("{weights}", str(weights))
                for a in self.overrides]
        return [sys.executable, "-m", "segment.eval.cli", *args, f"output={out}"]


ROWS = (
    Row("ecssd-dev", ("dataset.root={data}", "model.checkpoint={weights}",
                      "methods=[cls_keychain,cls_attention]")),
    Row("pascal-dev", ("dataset.root={data}", "model.checkpoint={weights}",
                       "methods=[cls_keychain,cls_attention]")),
    Row("camvid-dev", ("dataset=camvid", "dataset.root={data}", "model.checkpoint={weights}",
                       "model.image_size=[336,448]", "methods=[{config:kmeans,name:kmeans_k8,k:8}]")),
    Row("bsds-dev", ("experiment=regions_bsds", "dataset.root={data}", "model.checkpoint={weights}")),
)


def numbers(rows: list[dict]) -> dict[str, float]:
    """``{"method/metric": value}`` of a results.json: every metric, class IoU and paired
    difference (``delta/metric/i``), not the timings or the intervals."""
    out: dict[str, float] = {}
    for r in rows:
        for key, value in r.items():
            if key in NOT_COMPARED or key == "method":
                continue
            if isinstance(value, dict):
                for k, v in value.items():
                    for i, x in enumerate(v if isinstance(v, list) else [v]):
                        if isinstance(x, (int, float)):
                            out[f"{r['method']}/{key}/{k}" + (f"/{i}" if isinstance(v, list) else "")] = x
            elif isinstance(value, (int, float)):
                out[f"{r['method']}/{key}"] = value
    return out


def spread_of(key: str) -> float:
    """The spread a number may move by: its metric's (the key's last metric name)."""
    parts = [p for p in key.split("/") if not p.isdigit()]
    return SPREAD.get(parts[-1], DEFAULT_SPREAD)


def compare(committed: list[dict], fresh: list[dict]) -> list[str]:
    """What differs beyond the spread, one phrase per number (empty: a match)."""
    want, got = numbers(committed), numbers(fresh)
    bad = [f"{k} missing" for k in want if k not in got]
    for key, w in want.items():
        g = got.get(key)
        if g is not None and abs(g - w) > spread_of(key):
            bad.append(f"{key} {g:.4g} vs {w:.4g} ({g - w:+.3g})")
    return bad


def line(row: Row, committed: list[dict], fresh: list[dict]) -> tuple[bool, str]:
    """The row's one line: ``match`` with how many numbers were compared, or what differs."""
    bad = compare(committed, fresh)
    n = len(numbers(committed))
    if not bad:
        return True, f"{row.name}: match ({n} numbers within the spread)"
    return False, f"{row.name}: differs in {len(bad)} of {n} numbers: " + "; ".join(bad[:6]) + (
        f"; ... {len(bad) - 6} more" if len(bad) > 6 else "")


def _run(row: Row, shared: Path, weights: Path, out: Path) -> list[dict]:
    folder = out / row.name
    if folder.exists():
        shutil.rmtree(folder)
    print(f"# {row.name}: {' '.join(row.command(shared / 'data', weights, folder)[3:])}", flush=True)
    r = subprocess.run(row.command(shared / "data", weights, folder), cwd=REPO)
    results = folder / "results.json"
    if r.returncode != 0 or not results.is_file():
        raise RuntimeError(f"{row.name}: segment-eval exited {r.returncode} (its log: {folder})")
    return json.loads(results.read_text())


def _fmt_delta(d: list[float], sign: float, digits: int) -> str:
    lo, hi = sorted((sign * d[1], sign * d[2]))
    return f"{sign * d[0]:+.{digits}f} ({lo:+.{digits}f}, {hi:+.{digits}f})"


def headline(tables: dict[str, list[dict]]) -> list[str]:
    """The README's headline table rows from the tables (the default first in each)."""
    by = {name: {r["method"]: r for r in rows} for name, rows in tables.items()}
    out = ["| set | `cuts` (default) mIoU / mAP | best peer | default - peer, mIoU (95% CI) |",
           "|---|---|---|---|"]
    for name, label in (("ecssd-dev", "ecssd-dev (100 photos)"), ("pascal-dev", "pascal-dev (200 scenes)")):
        m = by[name]
        peer = max((r for k, r in m.items() if k != "cuts"), key=lambda r: r["mIoU"])
        out.append(f"| {label} | {m['cuts']['mIoU']:.2f} / {m['cuts']['mAP']:.2f} | `{peer['method']}` "
                   f"{peer['mIoU']:.2f} / {peer['mAP']:.2f} | {_fmt_delta(peer['delta']['mIoU'], -1, 2)} |")
    c = by["camvid-dev"]
    out.append(f"| camvid-dev (101 road scenes, 11 classes) | {c['cuts']['mIoU']:.2f} (pixAcc "
               f"{c['cuts']['pixAcc']:.2f}) | `kmeans` k8 {c['kmeans_k8']['mIoU']:.2f} | "
               f"{_fmt_delta(c['kmeans_k8']['delta']['mIoU'], -1, 2)} |")
    b = by["bsds-dev"]
    km = {k: r for k, r in b.items() if k.startswith("kmeans_keys_k")}
    cov = max(km.values(), key=lambda r: r["Covering"])
    vi = min(km.values(), key=lambda r: r["VI"])
    k_of = lambda r: r["method"].rsplit("_k", 1)[1]  # noqa: E731
    out.append(
        f"| bsds-dev (300 photos, [table](eval/results/dev_set/default_vs_peers_bsds.md)): Covering / VI"
        f" | {b['cuts']['Covering']:.3f} / {b['cuts']['VI']:.3f} ({b['cuts']['regions_median']:g} regions)"
        f" | `kmeans` k{k_of(cov)} {cov['Covering']:.3f} / k{k_of(vi)} {vi['VI']:.3f} | Covering "
        f"{_fmt_delta(cov['delta']['Covering'], -1, 3)}, VI {_fmt_delta(vi['delta']['VI'], -1, 3)} |")
    return out


def committed_tables() -> dict[str, list[dict]]:
    return {row.name: json.loads(row.table.with_suffix(".json").read_text()) for row in ROWS}


def write_readme(tables: dict[str, list[dict]], readme: Path = README) -> None:
    """Replace the README's lines between the markers by :func:`headline` of ``tables``."""
    text = readme.read_text().splitlines()
    i, j = text.index(BEGIN), text.index(END)
    readme.write_text("\n".join([*text[:i + 1], *headline(tables), *text[j:]]) + "\n")


def _update(row: Row, out: Path) -> None:
    for ext in ("json", "csv", "md"):
        shutil.copyfile(out / row.name / f"results.{ext}", row.table.with_suffix(f".{ext}"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m segment.eval.reproduce", description=__doc__.split("\n")[0])
    p.add_argument("--shared", type=Path, default=os.environ.get("SEGMENT_SHARED"),
                   help="the folder with data/ and weights/ (default: $SEGMENT_SHARED)")
    p.add_argument("--weights", type=Path, default=None,
                   help="the DINOv2 ViT-S/14 checkpoint (default: SHARED/weights/dinov2_vits14.safetensors)")
    p.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    p.add_argument("--only", nargs="+", choices=[r.name for r in ROWS], default=None, help="these rows only")
    p.add_argument("--update", action="store_true",
                   help="write the new tables over the committed ones and the README's headline table")
    args = p.parse_args(argv)
    rows = [r for r in ROWS if args.only is None or r.name in args.only]
    weights = args.weights or (args.shared / "weights" / "dinov2_vits14.safetensors" if args.shared else None)
    missing = [str(x) for x in ([args.shared / "data" / r.name for r in rows] if args.shared else [])
               + ([weights] if weights else []) if not Path(x).exists()]
    if args.shared is None or weights is None or missing:
        print("segment.eval.reproduce: needs the shared data and weights (--shared DIR or SEGMENT_SHARED)"
              + (f"; not found: {', '.join(missing)}" if missing else ""), file=sys.stderr)
        return EXIT_BAD_INPUT
    out = args.out or Path(tempfile.mkdtemp(prefix="segment-reproduce-"))
    lines, ok = [], True
    for row in rows:
        try:
            fresh = _run(row, args.shared, weights, out)
        except RuntimeError as e:
            print(f"segment.eval.reproduce: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
        committed = json.loads(row.table.with_suffix(".json").read_text()) if row.table.with_suffix(
            ".json").is_file() else []
        same, text = line(row, committed, fresh) if committed else (False, f"{row.name}: no committed table")
        ok &= same
        lines.append(text)
        if args.update:
            _update(row, out)
    if args.update:
        write_readme(committed_tables())
    print(f"# runs in {out}", *lines, sep="\n")
    return 0 if ok or args.update else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
