"""The tables of ``segment-eval``: one row per method, written as results.json, results.csv
and results.md (and printed as Markdown).

Binary sets: the protocol's scores and the peer metrics (:data:`BINARY_COLUMNS`);
multi-class sets: pixAcc, mIoU, region counts and per-class IoU; sets of human segmentations
(BSDS500): Covering, PRI, VI and region counts. Bootstrap intervals and paired differences
against the first row: :func:`add_intervals`.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from segment.eval.metrics import (
    BinaryState,
    Bootstrap,
    MulticlassState,
    RegionState,
    State,
    bootstrap,
    total,
)

from segment.datasets.base import SegmentationDataset
from segment.utils import atomic_write_json, atomic_write_text

# protocol columns, then the peer metrics (per-image means at the original resolution)
BINARY_COLUMNS = ("pixAcc", "mIoU", "mIoU_CA", "mAP", "fgIoU", "acc", "maxF", "maxF_img")
# + per-class IoU; regions: mean per image, regions_median: median per image, small_px: percent
# of the pixels in regions under 1% of their image
# escape_median: the median escape probability of the method's regions (cuts; empty for others)
MULTICLASS_COLUMNS = ("pixAcc", "mIoU", "regions", "regions_median", "small_px", "escape_median")
# human segmentations (BSDS500): Covering and PRI as fractions, VI in bits (as the field writes them)
REGION_COLUMNS = ("Covering", "PRI", "VI", "regions_median", "regions", "small_px", "escape_median")
COLUMNS = {"binary": BINARY_COLUMNS, "multiclass": MULTICLASS_COLUMNS, "regions": REGION_COLUMNS}
# the scores that get bootstrap intervals (results.json: all; CSV: INTERVAL_CSV; Markdown:
# INTERVAL_MD)
INTERVAL_SCORES = {"binary": ("pixAcc", "mIoU", "mAP", "fgIoU", "acc", "maxF", "maxF_img"),
                   "multiclass": ("pixAcc", "mIoU"), "regions": ("Covering", "PRI", "VI")}
INTERVAL_CSV = {"binary": ("mIoU", "mAP", "fgIoU", "maxF"), "multiclass": ("mIoU",),
                "regions": ("Covering", "PRI", "VI")}
INTERVAL_MD = {"binary": ("mIoU",), "multiclass": ("mIoU",), "regions": ("Covering", "PRI", "VI")}
# how the scores of a task are written: percent (x 100, 4 decimals in JSON, 2 in Markdown) or
# as they are (fractions and bits: 6 decimals in JSON, 3 in Markdown)
PERCENT = {"binary": True, "multiclass": True, "regions": False}
_MD_FORMAT = {"Covering": ".3f", "PRI": ".3f", "VI": ".3f", "regions_median": ".1f", "escape_median": ".3f"}


@dataclass
class Results:
    """The table: one row per method, scores in percent (binary, multi-class) or as the
    field writes them (``regions``: Covering and PRI as fractions, VI in bits).

    Multi-class rows also hold ``regions`` (mean predicted segments per image),
    ``regions_median``, ``small_px`` (percent of the pixels in segments under 1% of their
    image) and ``iou`` (class name -> IoU in percent, ``None`` for a class never seen nor
    predicted), shown as one column per class in the CSV (``IoU_<name>``) and Markdown tables.
    Region rows (BSDS500) hold ``Covering``, ``PRI``, ``VI``, ``regions_median``, ``regions``
    and ``small_px``. Both hold ``escape_median``: the median escape probability of the
    method's regions over all images (``cuts``; ``None``, shown empty, for methods that do not
    cut by escape).

    With bootstrap intervals (:func:`add_intervals`) every row holds ``ci95`` (score ->
    ``[low, high]``) and every row after the first ``delta`` (``{"vs": first row, score:
    [difference, low, high]}``, paired over the same resampled images); the CSV gets them
    for :data:`INTERVAL_CSV` and the Markdown for :data:`INTERVAL_MD`.
    """

    task: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    class_names: tuple[str, ...] = ()

    @property
    def columns(self) -> tuple[str, ...]:
        return COLUMNS[self.task]

    @property
    def _num(self) -> str:
        return ".2f" if PERCENT[self.task] else ".3f"

    @property
    def _intervals(self) -> bool:
        return bool(self.rows) and "ci95" in self.rows[0]

    def _class_values(self, r: dict[str, Any]) -> list[str]:
        iou = r.get("iou") or {}
        return ["" if iou.get(c) is None else f"{iou[c]:.2f}" for c in self.class_names]

    def _delta_text(self, r: dict[str, Any], score: str) -> str:
        d = (r.get("delta") or {}).get(score)
        f = "+" + self._num
        return "" if d is None else f"{d[0]:{f}} ({d[1]:{f}}, {d[2]:{f}})"

    def markdown(self) -> str:
        extra: list[str] = []
        scores = INTERVAL_MD[self.task] if self._intervals else ()
        deltas = scores if len(self.rows) > 1 else ()
        extra = [f"{s} 95% CI" for s in scores]
        extra += [f"Δ{s} vs {self.rows[0]['method']} (95% CI)" for s in deltas]
        cols = ("method", *self.columns, *self.class_names, "images", *extra)
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        num = self._num
        for r in self.rows:
            vals = [r["method"], *("" if r.get(c) is None else f"{r[c]:{_MD_FORMAT.get(c, '.2f')}}" for c in self.columns),
                    *self._class_values(r), str(r["images"])]
            for s in scores:
                lo, hi = r["ci95"][s]
                vals.append(f"{lo:{num}}-{hi:{num}}")
            vals += [self._delta_text(r, s) for s in deltas]
            lines.append("| " + " | ".join(v or "-" for v in vals) + " |")
        return "\n".join(lines) + "\n"

    def csv(self) -> str:
        buf = io.StringIO()
        per_class = [f"IoU_{c}" for c in self.class_names]
        scores = INTERVAL_CSV[self.task] if self._intervals else ()
        deltas = scores if len(self.rows) > 1 else ()
        extra = [f"{s}_{k}" for s in scores for k in ("ci95_low", "ci95_high")]
        extra += [f"delta_{s}{k}" for s in deltas for k in ("", "_ci95_low", "_ci95_high")]
        wr = csv.writer(buf, lineterminator="\n")
        wr.writerow(["method", *self.columns, *per_class, "images", *extra])
        for r in self.rows:
            iou = r.get("iou") or {}
            delta = r.get("delta") or {}
            wr.writerow([r["method"], *("" if r.get(c) is None else r[c] for c in self.columns),
                         *("" if iou.get(c) is None else iou[c] for c in self.class_names), r["images"],
                         *(v for s in scores for v in r["ci95"][s]),
                         *(v for s in deltas for v in delta.get(s, ("", "", "")))])
        return buf.getvalue()

    def write(self, out: Path) -> None:
        atomic_write_json(out / "results.json", self.rows)
        atomic_write_text(out / "results.csv", self.csv())
        atomic_write_text(out / "results.md", self.markdown())


def add_intervals(results: Results, boot: Bootstrap, keys: Sequence[str]) -> None:
    """Put the bootstrap intervals into ``results.rows`` (in the rows' units: percent rounded
    to 1e-4, or fractions and bits rounded to 1e-6 for region sets): ``ci95`` per row and,
    for every row after the first, ``delta`` against the first row (``keys[i]`` is row
    ``i``'s method in ``boot``)."""
    scores = INTERVAL_SCORES[results.task]
    scale, digits = (100.0, 4) if PERCENT[results.task] else (1.0, 6)
    if boot.level != 0.95:
        raise ValueError(f"the tables name 95% intervals, got level {boot.level}")
    ref_row, ref = results.rows[0], keys[0]
    for row, key in zip(results.rows, keys):
        row["ci95"] = {s: [round(scale * v, digits) for v in boot.interval(key, s)] for s in scores}
        if row is ref_row:
            continue
        delta = {"vs": ref_row["method"]}
        for s in scores:
            lo, hi = boot.difference(key, ref, s)
            delta[s] = [round(row[s] - ref_row[s], digits), round(scale * lo, digits), round(scale * hi, digits)]
        row["delta"] = delta


def empty_state(task: str, num_classes: int = 0) -> State:
    """The state of no images (the start of a sum) for a task."""
    if task == "multiclass":
        return MulticlassState.zero(num_classes)
    return {"binary": BinaryState, "regions": RegionState}[task]()


def results_table(task: str, rows: Sequence[tuple[str, Sequence[State]]],
                  class_names: Sequence[str] = (), num_classes: int = 0, reps: int = 1000,
                  seed: int = 0) -> Results:
    """The table of ``rows`` (label, per-image states; the same images in the same order in
    every row): each row's summed scores and, with ``reps`` draws and more than one image,
    95% bootstrap intervals over the same draws for every row and each row's paired
    difference to the first (:func:`add_intervals`)."""
    results = Results(task=task, class_names=tuple(class_names))
    for label, states in rows:
        results.rows.append(table_row(label, total(states, empty_state(task, num_classes)), class_names))
    if reps and rows and len(rows[0][1]) > 1:
        keys = [str(i) for i in range(len(rows))]
        boot = bootstrap({k: list(states) for k, (_, states) in zip(keys, rows)},
                         reps=reps, level=0.95, seed=seed)
        add_intervals(results, boot, keys)
    return results


def table_row(label: str, state: State, class_names: Sequence[str] = ()) -> dict[str, Any]:
    """The row of method ``label`` from its total ``state``: scores in the table's units
    (multi-class: per-class IoU under ``iou``, keyed by ``class_names``)."""
    sc = state.scores()
    row: dict[str, Any] = {"method": label, **sc.percent()}
    if isinstance(state, MulticlassState):
        names = list(class_names) or [str(i) for i in range(len(sc.iou))]
        row["iou"] = {c: None if math.isnan(x) else 100.0 * x for c, x in zip(names, sc.iou)}
    return row


def class_names_of(dataset: SegmentationDataset) -> tuple[str, ...]:
    """The data set's class names for tables and panels (``"0", "1", ...`` when it has none)."""
    names = dataset.class_names
    k = int(dataset.num_classes)
    if names is None or len(names) != k or len(set(names)) != k:
        return tuple(str(i) for i in range(k))
    return tuple(str(c) for c in names)

