"""Token masking: drop the patch tokens a score ranks first and watch the model degrade.

The third experiment of "Attention (as Discrete-Time Markov) Chains": on any image folder,
each score under test (the ``methods`` of the experiment, every one computed from the same
attention record, plus ``random`` as the floor) ranks the patch tokens of an image; the top
(``most`` important first) or the bottom (``least`` important first) fraction ``p`` of them
is dropped from the sequence, for ``p`` in ``masking.fractions`` (0, 0.1, ..., 0.9), and the
masked model is compared with the unmasked one:

- ``similarity``: cosine similarity of the final embedding (the final CLS token for a
  CLS-pooled ViT) to the unmasked one; any backbone that can drop tokens;
- ``agreement``: whether the top-1 class equals the unmasked top-1 (a classifier head);
- ``accuracy``: whether the top-1 class is the image's label (a head and
  ``masking.labels``: a file of ``image-stem class`` lines, the class an ImageNet index or
  synset).

Dropping means leaving the tokens out of the sequence (the kept patches keep their own
positional embeddings, CLS and registers always stay): :meth:`Backbone.forward_kept
<segment.models.base.Backbone.forward_kept>`. A backbone that cannot (FLUX) is refused.

AUC
---
Each image's curve ``y(p)`` is summarised by the trapezoid rule over the fractions,
normalised by their span: ``AUC = (1 / (p_last - p_first)) * sum_k (p_{k+1} - p_k) (y_k +
y_{k+1}) / 2``, i.e. the mean height of the curve over ``[0, 0.9]`` (a curve that stays at 1
has AUC 1). It is linear in the curve, so the mean of the images' AUCs is the AUC of the
mean curve. For ``most`` first a *lower* AUC means the score found the tokens the model
relies on (it degrades faster); for ``least`` first a *higher* AUC is better.

Intervals: the images are resampled with replacement (``bootstrap`` draws, the same draws
for every row, :func:`segment.eval.metrics.resample_counts`); each row gets the 95%
percentile interval of its mean AUC and the paired difference to ``random`` in the same
order and to every other method of ``masking.compare`` (default: random and CLS
attention); the curves get 95% bands per fraction the same way.

Cost: the masked passes of one image at one fraction (every method and order: rows of the
same length) run as one batch through :meth:`forward_kept`; the table states the time of all
masked passes of an image against one bare forward (``forward_plain``) of it.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from segment.eval.figures import write_figure
from segment.eval.metrics import Bootstrap, resample_counts
from segment.utils import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    atomic_write_json,
    atomic_write_text,
)

log = logging.getLogger(__name__)

FRACTIONS = tuple(round(0.1 * i, 1) for i in range(10))  # 0, 0.1, ..., 0.9
ORDERS = ("most", "least")  # most important first (top of the score) / least important first
METRICS = ("similarity", "agreement", "accuracy")
RANDOM = "random"


# ---------------------------------------------------------------------------------------
# the math
# ---------------------------------------------------------------------------------------


def drop_count(num_patches: int, fraction: float) -> int:
    """Patches dropped at ``fraction``: ``round(fraction * n)`` (halves up), at most ``n - 1``."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fractions must lie in [0, 1), got {fraction}")
    return min(int(math.floor(fraction * num_patches + 0.5)), num_patches - 1)


def ranking(scores: Tensor) -> Tensor:
    """``(n,)`` scores -> ``(n,)`` patch indices, most important (highest score) first; ties
    keep the lower index first (stable)."""
    return torch.argsort(scores.float(), descending=True, stable=True)


def kept_patches(order: Tensor, fraction: float, direction: str) -> Tensor:
    """The patches kept when the first (``most``) or last (``least``) ``fraction`` of a ranking
    is dropped.

    Args:
        order: ``(n,)`` patch indices, most important first (:func:`ranking`).
        fraction: the share of patches to drop (:func:`drop_count`).
        direction: ``"most"`` drops the top of the ranking, ``"least"`` its bottom.

    Returns:
        ``(n - k,)`` int64 indices, sorted ascending (row-major order of the grid).
    """
    n = order.numel()
    k = drop_count(n, fraction)
    if direction == "most":
        kept = order[k:]
    elif direction == "least":
        kept = order[: n - k]
    else:
        raise ValueError(f"order must be one of {ORDERS}, got {direction!r}")
    return torch.sort(kept).values


def cosine(a: Tensor, b: Tensor) -> Tensor:
    """Cosine similarity of ``(..., C)`` vectors in float64, ``a.b / sqrt(|a|^2 |b|^2)``,
    clipped to [-1, 1]. Exactly 1 for identical vectors (``sqrt(d * d) == d`` in IEEE
    arithmetic), so the unmasked row compares as 1 with no rounding."""
    a, b = a.double(), b.double()
    num = (a * b).sum(-1)
    den = torch.sqrt((a * a).sum(-1) * (b * b).sum(-1))
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(num)).clamp(-1.0, 1.0)


def auc(curves: np.ndarray, fractions: Sequence[float]) -> np.ndarray:
    """Normalised area under ``(..., P)`` curves sampled at ``fractions`` (module docstring):
    the trapezoid rule divided by ``fractions[-1] - fractions[0]`` (the curve's mean height)."""
    x = np.asarray(fractions, dtype=np.float64)
    y = np.asarray(curves, dtype=np.float64)
    if x.ndim != 1 or x.size < 2 or y.shape[-1] != x.size:
        raise ValueError(f"need >= 2 fractions and curves of that length, got {x.size} and {y.shape}")
    if not np.all(np.diff(x) > 0):
        raise ValueError(f"fractions must increase, got {list(x)}")
    area = (np.diff(x) * (y[..., 1:] + y[..., :-1]) / 2.0).sum(-1)
    return area / (x[-1] - x[0])


@dataclass
class ImageCurves:
    """One image's curves: ``(rows, P)`` per metric, rows = ``(method, order)`` pairs.

    Attributes:
        rows: the ``(method, order)`` of each curve row.
        similarity: ``(R, P)`` cosine similarity to the unmasked embedding.
        agreement: ``(R, P)`` 1 where the top-1 class equals the unmasked one (a head).
        correct: ``(R, P)`` 1 where the top-1 class is the label (a head and a label).
        masked_s: seconds of the masked passes (every fraction > 0).
    """

    rows: list[tuple[str, str]]
    similarity: np.ndarray
    agreement: np.ndarray | None = None
    correct: np.ndarray | None = None
    masked_s: float = 0.0


def mask_image(backbone: Any, pixels: Tensor, scores: Mapping[str, Tensor],
               fractions: Sequence[float] = FRACTIONS, orders: Sequence[str] = ORDERS,
               label: int | None = None) -> ImageCurves:
    """Token-masking curves of one image.

    The unmasked pass (every patch kept) gives the reference embedding and top-1; at each
    fraction the passes of every ``(method, order)`` row, all of one length, run as one
    batch (:meth:`forward_kept`).

    Args:
        backbone: a backbone with ``can_drop_tokens`` (``forward_kept``).
        pixels: ``(1, 3, H, W)`` one preprocessed image.
        scores: method -> ``(n,)`` patch scores (higher = more important).
        fractions: increasing shares of the patches to drop, the first 0.
        orders: ``"most"`` and/or ``"least"``.
        label: the image's class index, for ``correct``.

    Returns:
        :class:`ImageCurves`.
    """
    if pixels.dim() != 4 or pixels.shape[0] != 1:
        raise ValueError(f"mask_image takes one image (1, 3, H, W), got {tuple(pixels.shape)}")
    if not fractions or fractions[0] != 0:
        raise ValueError(f"fractions must start at 0 (the unmasked reference), got {list(fractions)}")
    rows = [(m, o) for m in scores for o in orders]
    ranks = {m: ranking(s.flatten()) for m, s in scores.items()}
    n = next(iter(ranks.values())).numel()
    if any(r.numel() != n for r in ranks.values()):
        raise ValueError("every method's scores must cover the same patches")
    full = torch.arange(n).unsqueeze(0)
    ref = backbone.forward_kept(pixels, full)
    head = ref.logits is not None
    top0 = ref.logits.argmax(-1) if head else None
    shape = (len(rows), len(fractions))
    sim = np.empty(shape)
    agree = np.empty(shape) if head else None
    correct = np.empty(shape) if head and label is not None else None
    t0 = time.perf_counter()
    for j, p in enumerate(fractions):
        if p == 0:
            out, reps = ref, len(rows)  # dropping nothing: the reference itself, for every row
        else:
            keep = torch.stack([kept_patches(ranks[m], p, o) for m, o in rows])  # (R, K)
            out, reps = backbone.forward_kept(pixels, keep), 1
        emb = out.embedding.expand(len(rows), -1) if reps > 1 else out.embedding
        sim[:, j] = cosine(emb, ref.embedding).cpu().numpy()
        if head:
            top = out.logits.argmax(-1).expand(len(rows)) if reps > 1 else out.logits.argmax(-1)
            agree[:, j] = (top == top0).cpu().numpy()
            if correct is not None:
                correct[:, j] = (top == int(label)).cpu().numpy()
    _sync(backbone.device)
    return ImageCurves(rows=rows, similarity=sim, agreement=agree, correct=correct,
                       masked_s=time.perf_counter() - t0)


def random_scores(num_patches: int, seed: int, index: int) -> Tensor:
    """The floor: a random ranking of the patches, reproducible per image (``seed``, ``index``)."""
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(index))
    return torch.rand(num_patches, generator=g)


# ---------------------------------------------------------------------------------------
# aggregation: AUCs, bootstrap intervals, curves with bands
# ---------------------------------------------------------------------------------------


@dataclass
class Summary:
    """Per-row AUCs with intervals and per-fraction curve bands.

    Attributes:
        rows: table rows (dicts; see :func:`summarise`).
        curves: long-format curve rows ``(method, order, metric, p, mean, low, high)``.
    """

    rows: list[dict[str, Any]] = field(default_factory=list)
    curves: list[dict[str, Any]] = field(default_factory=list)


def summarise(per_image: Sequence[ImageCurves], fractions: Sequence[float], reps: int = 1000,
              seed: int = 0, references: Sequence[str] = (RANDOM,)) -> Summary:
    """Mean AUC per ``(method, order)`` row with 95% bootstrap intervals, paired differences
    to each reference method of the same order, and the mean curves with 95% bands.

    Args:
        per_image: every image's curves, the same rows in the same order.
        fractions: the curves' fractions.
        reps: bootstrap resamples (0 = no intervals).
        seed: seed of the resamples.
        references: methods every other row is compared with (``row["delta"][ref][metric] =
            [difference, low, high]``, row minus reference); those that are not rows are
            skipped.
    """
    if not per_image:
        raise ValueError("no images to summarise")
    rows = per_image[0].rows
    if any(c.rows != rows for c in per_image):
        raise ValueError("every image needs the same (method, order) rows")
    n = len(per_image)
    metrics = {"similarity": np.stack([c.similarity for c in per_image])}  # (I, R, P)
    if all(c.agreement is not None for c in per_image):
        metrics["agreement"] = np.stack([c.agreement for c in per_image])
    if all(c.correct is not None for c in per_image):
        metrics["accuracy"] = np.stack([c.correct for c in per_image])
    counts = resample_counts(n, reps, seed) / n if reps and n > 1 else None  # (reps, I) weights
    draws: dict[str, dict[str, np.ndarray]] = {}
    out = Summary()
    index = {r: i for i, r in enumerate(rows)}
    for r, (method, order) in enumerate(rows):
        row: dict[str, Any] = {"method": method, "order": order, "images": n}
        key = f"{method}/{order}"
        draws[key] = {}
        for name, cube in metrics.items():
            a = auc(cube[:, r], fractions)  # (I,)
            row[f"AUC_{name}"] = round(float(a.mean()), 6)
            if counts is not None:
                draws[key][name] = counts @ a
            mean_curve = cube[:, r].mean(0)
            band = np.percentile(counts @ cube[:, r], [2.5, 97.5], axis=0) if counts is not None else None
            for j, p in enumerate(fractions):
                out.curves.append({
                    "method": method, "order": order, "metric": name, "p": float(p),
                    "mean": round(float(mean_curve[j]), 6),
                    "ci95_low": None if band is None else round(float(band[0, j]), 6),
                    "ci95_high": None if band is None else round(float(band[1, j]), 6),
                })
        out.rows.append(row)
    if counts is not None:
        boot = Bootstrap(level=0.95, draws=draws)
        for r, (method, order) in enumerate(rows):
            row, key = out.rows[r], f"{method}/{order}"
            row["ci95"] = {m: [round(v, 6) for v in boot.interval(key, m)] for m in metrics}
            deltas: dict[str, Any] = {}
            for name in references:
                ref = (name, order)
                if name == method or ref not in index:
                    continue
                rk = f"{name}/{order}"
                deltas[name] = {}
                for m in metrics:
                    lo, hi = boot.difference(key, rk, m)
                    d = row[f"AUC_{m}"] - out.rows[index[ref]][f"AUC_{m}"]
                    deltas[name][m] = [round(d, 6), round(lo, 6), round(hi, 6)]
            if deltas:
                row["delta"] = deltas
    return out


# ---------------------------------------------------------------------------------------
# tables and the plot
# ---------------------------------------------------------------------------------------


def _ci(row: dict[str, Any], metric: str) -> str:
    ci = (row.get("ci95") or {}).get(metric)
    return "" if ci is None else f"{ci[0]:.3f}-{ci[1]:.3f}"


def _delta(row: dict[str, Any], ref: str, metric: str) -> str:
    d = ((row.get("delta") or {}).get(ref) or {}).get(metric)
    return "" if d is None else f"{d[0]:+.3f} ({d[1]:+.3f}, {d[2]:+.3f})"


def _references(summary: Summary) -> list[str]:
    return list(dict.fromkeys(ref for r in summary.rows for ref in (r.get("delta") or {})))


def markdown(summary: Summary, cost: Mapping[str, Any] | None = None) -> str:
    """The AUC table (one row per method and order), then the cost line."""
    metrics = [m for m in METRICS if f"AUC_{m}" in summary.rows[0]]
    refs = _references(summary)
    cols = ["method", "order"]
    for m in metrics:
        cols += [f"AUC {m}", "95% CI", *(f"Δ vs {ref} (95% CI)" for ref in refs)]
    cols.append("images")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in sorted(summary.rows, key=lambda r: (ORDERS.index(r["order"]) if r["order"] in ORDERS else 9)):
        vals = [r["method"], r["order"]]
        for m in metrics:
            vals += [f"{r[f'AUC_{m}']:.3f}", _ci(r, m), *(_delta(r, ref, m) for ref in refs)]
        vals.append(str(r["images"]))
        lines.append("| " + " | ".join(v or "-" for v in vals) + " |")
    text = "\n".join(lines) + "\n"
    text += ("\nAUC: trapezoid over the dropped fractions, divided by their span (mean height of the"
             " curve). most = most important tokens dropped first (lower = the score found what the"
             " model relies on); least = least important first (higher = better).\n")
    if cost:
        text += (f"\nCost: {cost['masked_forwards_per_image']} masked passes per image in"
                 f" {cost['batches_per_image']} batches, {cost['masked_ms_per_image']:.1f} ms per image"
                 f" against {cost['bare_ms_per_image']:.1f} ms for one bare forward"
                 f" ({cost['masked_vs_bare']:.1f}x); attention record + scores"
                 f" {cost['scores_ms_per_image']:.1f} ms per image ({cost['device']}).\n")
    return text


def table_csv(summary: Summary) -> str:
    metrics = [m for m in METRICS if f"AUC_{m}" in summary.rows[0]]
    refs = _references(summary)
    buf = io.StringIO()
    wr = csv.writer(buf, lineterminator="\n")
    head = ["method", "order", "images"]
    for m in metrics:
        head += [f"AUC_{m}", f"AUC_{m}_ci95_low", f"AUC_{m}_ci95_high"]
        for ref in refs:
            head += [f"delta_{m}_vs_{ref}", f"delta_{m}_vs_{ref}_ci95_low", f"delta_{m}_vs_{ref}_ci95_high"]
    wr.writerow(head)
    for r in summary.rows:
        vals: list[Any] = [r["method"], r["order"], r["images"]]
        for m in metrics:
            ci = (r.get("ci95") or {}).get(m) or ["", ""]
            vals += [r[f"AUC_{m}"], *ci]
            for ref in refs:
                vals += ((r.get("delta") or {}).get(ref) or {}).get(m) or ["", "", ""]
        wr.writerow(vals)
    return buf.getvalue()


def curves_csv(summary: Summary) -> str:
    buf = io.StringIO()
    keys = ["method", "order", "metric", "p", "mean", "ci95_low", "ci95_high"]
    wr = csv.DictWriter(buf, fieldnames=keys, lineterminator="\n")
    wr.writeheader()
    for c in summary.curves:
        wr.writerow({k: "" if c[k] is None else c[k] for k in keys})
    return buf.getvalue()


def plot(summary: Summary, path: Path, title: str = "") -> None:
    """``curves.png``: one panel per metric and order, mean curves with their 95% bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m in METRICS if any(c["metric"] == m for c in summary.curves)]
    orders = [o for o in ORDERS if any(c["order"] == o for c in summary.curves)]
    methods = list(dict.fromkeys(c["method"] for c in summary.curves))
    fig, axes = plt.subplots(len(metrics), len(orders), figsize=(5.2 * len(orders), 3.6 * len(metrics)),
                             squeeze=False)
    colours = plt.get_cmap("tab10")
    for i, m in enumerate(metrics):
        for j, o in enumerate(orders):
            ax = axes[i, j]
            for k, meth in enumerate(methods):
                pts = [c for c in summary.curves if c["metric"] == m and c["order"] == o and c["method"] == meth]
                x = [c["p"] for c in pts]
                style = dict(color="black", linestyle="--") if meth == RANDOM else dict(color=colours(k % 10))
                ax.plot(x, [c["mean"] for c in pts], label=meth, lw=1.5, **style)
                if pts and pts[0]["ci95_low"] is not None:
                    ax.fill_between(x, [c["ci95_low"] for c in pts], [c["ci95_high"] for c in pts],
                                    alpha=0.18, color=style["color"], lw=0)
            ax.set_title(f"{m}, {o} important dropped first", fontsize=9)
            ax.set_xlabel("fraction of patch tokens dropped")
            ax.set_ylabel(m)
            ax.grid(alpha=0.3)
    axes[0, -1].legend(fontsize=7, loc="lower left")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    write_figure(path, fig, dpi=110)


# ---------------------------------------------------------------------------------------
# the command: segment-eval experiment=token_masking masking.input=FOLDER
# ---------------------------------------------------------------------------------------


def read_labels(path: str | Path) -> dict[str, int]:
    """``masking.labels``: one ``image-stem class`` line per image (comma, tab or space
    separated; ``#`` comments), the class an ImageNet-1k index (0-999) or a synset
    (``n01440764``). Returns stem -> class index.

    Raises:
        ValueError: naming the file and line of anything else.
    """
    from timm.data import ImageNetInfo

    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"masking.labels: no such file: {p}")
    synsets = {s: i for i, s in enumerate(ImageNetInfo().label_names())}
    out: dict[str, int] = {}
    for ln, line in enumerate(p.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.replace(",", " ").replace("\t", " ").split()
        if len(parts) != 2:
            raise ValueError(f"masking.labels: {p}:{ln}: expected 'image-stem class', got {line!r}")
        stem, cls = Path(parts[0]).stem, parts[1]
        if cls.isdigit() and int(cls) < len(synsets):
            out[stem] = int(cls)
        elif cls in synsets:
            out[stem] = synsets[cls]
        else:
            raise ValueError(
                f"masking.labels: {p}:{ln}: {cls!r} is neither an ImageNet-1k index (0-999) nor"
                " a synset id (n01440764)"
            )
    return out


def _settings(cfg: DictConfig) -> tuple[Path, tuple[float, ...], tuple[str, ...]]:
    from segment.eval.specs import ConfigError

    node = cfg.get("masking")
    if node is None or OmegaConf.is_missing(node, "input"):
        raise ConfigError("masking.input: set the image folder (masking.input=PATH)")
    fractions = tuple(float(f) for f in node.get("fractions") or FRACTIONS)
    if len(fractions) < 2 or fractions[0] != 0 or any(b <= a for a, b in zip(fractions, fractions[1:])) \
            or fractions[-1] >= 1:
        raise ConfigError(
            f"masking.fractions must increase from 0 and stay below 1 (e.g. 0, 0.1, ..., 0.9),"
            f" got {list(fractions)}"
        )
    orders = tuple(str(o) for o in node.get("orders") or ORDERS)
    bad = [o for o in orders if o not in ORDERS]
    if bad or not orders or len(set(orders)) != len(orders):
        raise ConfigError(f"masking.orders must be distinct entries of {list(ORDERS)}, got {list(orders)}")
    return Path(str(node.input)).expanduser(), fractions, orders


def _references_of(cfg: DictConfig, labels: Sequence[str]) -> tuple[str, ...]:
    from segment.eval.specs import ConfigError

    refs = tuple(str(r) for r in (cfg.masking.get("compare") or (RANDOM,)))
    unknown = [r for r in refs if r not in labels]
    if unknown:
        raise ConfigError(f"masking.compare: {unknown} are not rows; the rows are {list(labels)}")
    return refs


def _sync(device: Any) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _size_pair(size: Any) -> list[int]:
    """``model.image_size`` (an int or ``[H, W]``) as ``[H, W]``."""
    return [int(size), int(size)] if isinstance(size, (int, float)) else [int(v) for v in size]


def run_masking(cfg: DictConfig) -> int:
    """The token-masking experiment (module docstring); returns the exit code: 0 done,
    1 no image could be read, 2 unusable settings or input, 130 interrupted."""
    from segment.eval.specs import ConfigError
    from segment.run.front.build import BuildError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _run(cfg)
    except (ConfigError, BuildError) as e:
        print(f"segment-eval: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("segment-eval: interrupted; nothing written (token masking keeps no cache: rerun it)",
              file=sys.stderr)
        return EXIT_INTERRUPTED


@dataclass
class _Setup:
    """What every image of the experiment is measured with (:func:`_image_curves`)."""

    backbone: Any
    specs: list[Any]
    capture: Any
    device: torch.device
    fractions: tuple[float, ...]
    orders: tuple[str, ...]
    labels: dict[str, int] | None
    head: int
    seed: int
    use_random: bool


@dataclass
class _Cost:
    """Where the experiment's time went (seconds, over the images so far) and its forwards."""

    bare_s: float = 0.0
    scores_s: float = 0.0
    masked_s: float = 0.0
    batches: int = 0
    forwards: int = 0
    warm: bool = False

    def per_image(self, device: torch.device, k: int) -> dict[str, Any]:
        return {
            "device": str(device),
            "bare_ms_per_image": round(1e3 * self.bare_s / k, 3),
            "scores_ms_per_image": round(1e3 * self.scores_s / k, 3),
            "masked_ms_per_image": round(1e3 * self.masked_s / k, 3),
            "masked_vs_bare": round(self.masked_s / max(self.bare_s, 1e-12), 3),
            "masked_forwards_per_image": self.forwards // k,
            "batches_per_image": self.batches // k,
        }


def _inputs(cfg: DictConfig, folder: Path) -> tuple[list[Any], dict[str, int] | None]:
    """The image files (the first ``limit``) and, with ``masking.labels``, their classes."""
    from segment.eval.specs import ConfigError
    from segment.run.io import InputError, find_images

    try:
        listing = find_images(folder)
    except InputError as e:
        raise ConfigError(f"masking.input: {e}") from None
    files = listing.files
    if cfg.get("limit") is not None:
        if int(cfg.limit) < 1:
            raise ConfigError(f"limit must be a positive number of images, got {cfg.limit}")
        files = files[: int(cfg.limit)]
    if not files:
        raise ConfigError(f"masking.input: no images under {folder}")
    try:
        labels = read_labels(cfg.masking.labels) if cfg.masking.get("labels") else None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if labels is not None:
        missing = [f.name for f in files if Path(f.rel).stem not in labels]
        if missing:
            raise ConfigError(f"masking.labels: no class for {len(missing)} images (e.g. {missing[:3]})")
    return files, labels


def _setup(cfg: DictConfig, fractions: tuple[float, ...], orders: tuple[str, ...],
           labels: dict[str, int] | None) -> _Setup:
    """The methods and the model, checked for the experiment (one line, exit 2)."""
    from segment.eval.settings import instantiate_model
    from segment.eval.specs import ConfigError, instantiate_method, resolve_methods, union_capture
    from segment.utils import resolve_device

    specs = resolve_methods(cfg)
    for s in specs:
        s.method = instantiate_method(s)
    if any(s.label == RANDOM for s in specs):
        raise ConfigError(f"the label {RANDOM!r} is the random floor, added by the experiment; rename that method")
    try:
        device = resolve_device(cfg.get("device", "auto"))
    except ValueError as e:
        raise ConfigError(f"device: {e}") from None
    backbone = instantiate_model(cfg, device)
    if not backbone.can_drop_tokens:
        raise ConfigError(
            f"model {backbone.name} ({type(backbone).__name__}) cannot drop tokens"
            " from its sequence; token masking needs a timm ViT (segment.models.vit.TimmViT)"
        )
    head = int(backbone.num_classes)
    if labels is not None and not head:
        raise ConfigError(
            "masking.labels needs a classifier head: a timm ViT with ImageNet weights built with"
            " +model.model_kwargs.num_classes=1000"
        )
    capture = union_capture([s.method for s in specs], backbone.num_layers)
    return _Setup(backbone=backbone, specs=specs, capture=capture, device=device, fractions=fractions,
                  orders=orders, labels=labels, head=head, seed=int(cfg.get("seed") or 0),
                  use_random=bool(cfg.masking.get("random", True)))


def _image_curves(setup: _Setup, cost: _Cost, i: int, rel: str, image: Any) -> ImageCurves:
    """The curves of image ``i`` (file ``rel``): the bare forward timed, every method's
    scores, the masked forwards (:func:`mask_image`); the times added to ``cost``."""
    backbone, device, fractions = setup.backbone, setup.device, setup.fractions
    x = backbone.preprocess(image).unsqueeze(0)
    if not cost.warm:  # one untimed pass: allocations and kernel choices of the first call
        backbone.forward_plain(x)
        cost.warm = True
    _sync(device)
    t0 = time.perf_counter()
    backbone.forward_plain(x)
    _sync(device)
    t1 = time.perf_counter()
    record = backbone.extract(x, setup.capture)
    scores = {s.label: s.method(record).heatmap[0].flatten().float().cpu() for s in setup.specs}
    _sync(device)
    t2 = time.perf_counter()
    n = record.layout.num_patches
    if setup.use_random:
        scores[RANDOM] = random_scores(n, setup.seed, i)
    label = setup.labels[Path(rel).stem] if setup.labels is not None else None
    curves = mask_image(backbone, x, scores, fractions, setup.orders, label=label if setup.head else None)
    cost.bare_s += t1 - t0
    cost.scores_s += t2 - t1
    cost.masked_s += curves.masked_s
    cost.batches += len(fractions) - 1
    cost.forwards += len(curves.rows) * (len(fractions) - 1)
    return curves


def _run(cfg: DictConfig) -> int:
    from tqdm import tqdm

    from segment.eval.settings import bootstrap_reps, output_dir
    from segment.run.io import ImageReadError, read_image

    folder, fractions, orders = _settings(cfg)
    reps = bootstrap_reps(cfg)
    out_dir = output_dir(cfg)
    files, labels = _inputs(cfg, folder)
    setup = _setup(cfg, fractions, orders, labels)
    rows = [s.label for s in setup.specs] + ([RANDOM] if setup.use_random else [])
    references = _references_of(cfg, rows)
    per_image: list[ImageCurves] = []
    names: list[str] = []
    skipped: list[tuple[str, str]] = []
    cost = _Cost()
    every = int(cfg.masking.get("write_every") or 0)

    def meta() -> dict[str, Any]:
        return {
            "model": str(setup.backbone.name), "input": str(folder), "images": len(per_image),
            "skipped": skipped, "image_size": _size_pair(cfg.model.image_size),
            "fractions": list(fractions), "orders": list(orders), "bootstrap": reps, "seed": setup.seed,
            "head_classes": setup.head, "labels": bool(labels), "compare": list(references),
            "cost": cost.per_image(setup.device, len(per_image)),
            "auc": "trapezoid over the fractions divided by their span (mean height of the curve)",
        }

    bar = tqdm(files, desc="token masking", unit="img", disable=not cfg.get("progress", True))
    for i, f in enumerate(bar):
        try:
            image = read_image(f.path).image
        except ImageReadError as e:
            log.warning("skipped %s", e)
            skipped.append((f.rel, e.reason))
            continue
        per_image.append(_image_curves(setup, cost, i, f.rel, image))
        names.append(f.name)
        if every and len(per_image) % every == 0 and len(per_image) < len(files):
            _write(out_dir, cfg, per_image, names, meta(), final=False)  # partial tables
    if not per_image:
        print(f"segment-eval: none of the {len(files)} images could be read", file=sys.stderr)
        return EXIT_FAILED
    summary = _write(out_dir, cfg, per_image, names, meta(), final=True)
    print(markdown(summary, meta()["cost"]), end="")
    log.info("results in %s", out_dir)
    return EXIT_OK


def _write(out_dir: Path, cfg: DictConfig, per_image: Sequence[ImageCurves], names: Sequence[str],
           meta: dict[str, Any], final: bool) -> Summary:
    """Write results.md/json/csv, curves.csv/png and per_image.csv for the images so far."""
    fractions = meta["fractions"]
    summary = summarise(per_image, fractions, reps=int(meta["bootstrap"]), seed=int(meta["seed"]),
                        references=meta["compare"])
    meta = {**meta, "partial": not final}
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "results.json", {"rows": summary.rows, **meta})
    atomic_write_text(out_dir / "results.csv", table_csv(summary))
    atomic_write_text(out_dir / "results.md", markdown(summary, meta["cost"]))
    atomic_write_text(out_dir / "curves.csv", curves_csv(summary))
    atomic_write_text(out_dir / "per_image.csv", _per_image_csv(per_image, names, fractions))
    atomic_write_text(out_dir / "config.yaml", OmegaConf.to_yaml(cfg))
    folder = Path(meta["input"])
    plot(summary, out_dir / "curves.png",
         title=f"token masking: {meta['model']} on {folder.parent.name if folder.name == 'images' else folder.name}"
               f" ({len(per_image)} images{'' if final else ', partial'})")
    return summary


def _per_image_csv(per_image: Sequence[ImageCurves], names: Sequence[str],
                   fractions: Sequence[float]) -> str:
    """Each image's AUC per row and metric (for other statistics than the table's)."""
    buf = io.StringIO()
    wr = csv.writer(buf, lineterminator="\n")
    wr.writerow(["image", "method", "order", "metric", "AUC"])
    for name, c in zip(names, per_image):
        for metric, cube in (("similarity", c.similarity), ("agreement", c.agreement),
                             ("accuracy", c.correct)):
            if cube is None:
                continue
            for (m, o), a in zip(c.rows, auc(cube, fractions)):
                wr.writerow([name, m, o, metric, round(float(a), 6)])
    return buf.getvalue()
