"""``report.html`` of ``segment-diagnose``: the measures as pictures (matplotlib).

One self-contained HTML file (the plots are PNGs inlined as data URIs, so it opens from
disk and can be mailed): for each model a layer x head heatmap of every measure, the
eigenvalue moduli of a few heads (the most and least metastable and two between), and the
exact TokenRank over the first image for the most and least metastable heads; for two
models, a table of the per-measure means and their difference, and per-head difference
heatmaps when the two have the same layers x heads.
"""

from __future__ import annotations

import base64
import html
import io
import os
from pathlib import Path

import numpy as np

from segment.core.diagnostics import MEASURES
from segment.run.diagnose.measure import DESCRIPTIONS, Diagnosis, ModelDiagnostics
from segment.utils import atomic_write_text

__all__ = ["render_report", "write_report", "metastable_order"]

_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1400px; color: #222; }
h1 { font-size: 1.5em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: .6em 0; font-size: .9em; }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: right; }
th { background: #f4f4f4; } td:first-child, th:first-child { text-align: left; }
img { max-width: 100%; } .note { color: #555; font-size: .9em; }
.side { display: flex; gap: 1em; flex-wrap: wrap; } .side > div { flex: 1 1 600px; }
"""


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _img(src: str, alt: str) -> str:
    return f'<img src="{src}" alt="{html.escape(alt)}">'


def metastable_order(m: ModelDiagnostics) -> list[tuple[int, int]]:
    """Heads ``(layer, head)`` from the most to the least metastable: by the mean
    ``|lambda_2|`` over the images (ties by the metastable-state count)."""
    lam, cnt = m.mean["lambda2"], m.mean["metastable"]
    order = np.lexsort((-cnt.ravel(), -lam.ravel()))
    return [(int(i) // m.num_heads, int(i) % m.num_heads) for i in order]


def _heatmaps(values: dict[str, np.ndarray], title: str, *, diverging: bool = False) -> str:
    import matplotlib.pyplot as plt

    cols = 4
    rows = (len(MEASURES) + cols - 1) // cols
    first = values[MEASURES[0]]
    num_layers, num_heads = first.shape
    w = max(2.6, 0.28 * num_heads + 1.4)
    h = max(2.2, 0.22 * num_layers + 0.9)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * w, rows * h), squeeze=False)
    for ax, m in zip(axes.ravel(), MEASURES):
        v = values[m]
        if diverging:
            lim = float(np.abs(v).max()) or 1.0
            im = ax.imshow(v, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
        else:
            im = ax.imshow(v, cmap="viridis", aspect="auto")
        ax.set_title(m, fontsize=9)
        ax.set_xlabel("head", fontsize=8)
        ax.set_ylabel("layer", fontsize=8)
        ax.tick_params(labelsize=7)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03).ax.tick_params(labelsize=7)
    for ax in axes.ravel()[len(MEASURES):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return _png(fig)


def _picked(m: ModelDiagnostics) -> list[tuple[int, int]]:
    order = metastable_order(m)
    k = len(order)
    idx = sorted({0, k // 3, (2 * k) // 3, k - 1})
    return [order[i] for i in idx]


def _moduli(m: ModelDiagnostics, threshold: float) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    show = min(40, m.moduli.shape[-1])
    for layer, head in _picked(m):
        ax.plot(np.arange(1, show + 1), m.moduli[layer, head, :show], marker=".",
                label=f"layer {layer} head {head} (mean |lambda_2| {m.mean['lambda2'][layer, head]:.3f})")
    ax.axhline(threshold, color="grey", ls="--", lw=1, label=f"threshold {threshold:g}")
    ax.set_xlabel("eigenvalue rank k")
    ax.set_ylabel("|lambda_k|")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{m.name}: eigenvalue moduli of the grid chain (first image)", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return _png(fig)


def _tokenrank_maps(m: ModelDiagnostics) -> str:
    import matplotlib.pyplot as plt

    order = metastable_order(m)
    heads = [("most metastable", order[0]), ("least metastable", order[-1])]
    gh, gw = m.grid
    img = np.asarray(m.image.convert("RGB"))
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.9))
    axes[0].imshow(img)
    axes[0].set_title(f"{m.images[0]}", fontsize=9)
    for ax, (what, (layer, head)) in zip(axes[1:], heads):
        pi = m.tokenrank[layer, head].reshape(gh, gw)
        ax.imshow(img)
        ax.imshow(pi, cmap="inferno", alpha=0.65, extent=(0, img.shape[1], img.shape[0], 0),
                  interpolation="bilinear")
        ax.set_title(f"{what}: layer {layer} head {head}\n|lambda_2| "
                     f"{m.mean['lambda2'][layer, head]:.4f}, metastable "
                     f"{m.mean['metastable'][layer, head]:.1f}", fontsize=9)
    for ax in axes:
        ax.axis("off")
    fig.suptitle(f"{m.name}: exact TokenRank over the image", fontsize=10)
    fig.tight_layout()
    return _png(fig)


def _summary_table(diag: Diagnosis) -> str:
    names = [m.name for m in diag.models]
    sums = [m.summary() for m in diag.models]
    head = "".join(f"<th>{html.escape(n)}</th>" for n in names)
    if len(names) == 2:
        head += f"<th>{html.escape(names[1])} - {html.escape(names[0])}</th>"
    rows = []
    for k in MEASURES:
        cells = "".join(f"<td>{s[k]:.4g}</td>" for s in sums)
        if len(names) == 2:
            cells += f"<td>{sums[1][k] - sums[0][k]:+.4g}</td>"
        rows.append(f"<tr><td title=\"{html.escape(DESCRIPTIONS[k])}\">{k}</td>{cells}"
                    f"<td class=note style='text-align:left'>{html.escape(DESCRIPTIONS[k])}</td></tr>")
    return (f"<table><tr><th>measure (mean over heads and images)</th>{head}<th>meaning</th></tr>"
            + "".join(rows) + "</table>")


def _summary_bars(diag: Diagnosis) -> str:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 6, figsize=(14, 4.2), squeeze=False)
    colors = ["#4c72b0", "#dd8452"]
    for ax, k in zip(axes.ravel(), MEASURES):
        for i, m in enumerate(diag.models):
            per_layer = m.mean[k].mean(1)  # (L,)
            ax.plot(np.arange(m.num_layers), per_layer, marker=".", color=colors[i % 2],
                    label=m.name)
        ax.set_title(k, fontsize=9)
        ax.set_xlabel("layer", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
    axes[0, 0].legend(fontsize=7)
    fig.suptitle("per layer, mean over heads", fontsize=10)
    fig.tight_layout()
    return _png(fig)


def _model_section(m: ModelDiagnostics) -> str:
    thr = float(m.settings.get("threshold", 0.9))
    order = metastable_order(m)
    lo, hi = order[-1], order[0]
    return "\n".join([
        f"<h2>{html.escape(m.name)}</h2>",
        f"<p class=note>{m.num_layers} layers x {m.num_heads} heads, N = {m.num_tokens} tokens "
        f"({m.prefix} prefix + {m.grid[0]} x {m.grid[1]} grid), {len(m.images)} image(s); "
        f"capture {m.seconds.get('forward', 0):.2f} s, measures {m.seconds.get('measures', 0):.2f} s. "
        f"Most metastable head: layer {hi[0]} head {hi[1]}; least: layer {lo[0]} head {lo[1]}.</p>",
        _img(_heatmaps(m.mean, f"{m.name}: each measure per layer x head (mean over images)"),
             f"{m.name} heatmaps"),
        "<div class=side><div>" + _img(_moduli(m, thr), f"{m.name} moduli") + "</div><div>"
        + _img(_tokenrank_maps(m), f"{m.name} TokenRank") + "</div></div>",
    ])


def render_report(diag: Diagnosis) -> str:
    """The report as an HTML string."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    names = " vs ".join(html.escape(m.name) for m in diag.models)
    first = diag.models[0]
    parts = [
        "<!doctype html><html><head><meta charset=utf-8>",
        f"<title>segment-diagnose: {names}</title><style>{_CSS}</style></head><body>",
        f"<h1>Attention diagnostics: {names}</h1>",
        f"<p class=note>Every head read as a Markov chain (docs/diagnostics.md). Images: "
        f"{html.escape(', '.join(first.images[:12]))}{' ...' if len(first.images) > 12 else ''}. "
        f"TokenRank: exact stationary vector of the damped grid chain (alpha "
        f"{first.settings.get('alpha', 0.99):g}); metastable: eigenvalue moduli above "
        f"{first.settings.get('threshold', 0.9):g}.</p>",
        "<h2>Summary</h2>", _summary_table(diag), _img(_summary_bars(diag), "per layer"),
    ]
    if diag.same_shape():
        a, b = diag.models
        diff = {k: b.mean[k] - a.mean[k] for k in MEASURES}
        parts += [f"<h2>Difference per head: {html.escape(b.name)} - {html.escape(a.name)}</h2>",
                  _img(_heatmaps(diff, f"{b.name} - {a.name}", diverging=True), "difference")]
    for m in diag.models:
        parts.append(_model_section(m))
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(diag: Diagnosis, path: str | os.PathLike) -> Path:
    """Write :func:`render_report` to ``path`` atomically; returns the path."""
    p = Path(path)
    atomic_write_text(p, render_report(diag))
    return p
