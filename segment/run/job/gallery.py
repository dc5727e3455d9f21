"""``index.html``, the static gallery of a ``segment`` run (opens from disk, relative links)."""

from __future__ import annotations

import html
import logging
import os
import urllib.parse
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from segment.run.api.render import colormap_lut, palette, thumb_shape
from segment.run.job import gallery_levels as lv
from segment.run.job.coco import FOREGROUND_ID
from segment.run.job.records import ImageRecord
from segment.utils import atomic_write_text

log = logging.getLogger(__name__)


_GALLERY_CSS = """
*{box-sizing:border-box}
body{font-family:system-ui,sans-serif;margin:0 auto;padding:1em 1.5em;max-width:%(maxw)dpx;color:#222}
h1{font-size:1.4em;margin:.2em 0 .4em}
.wrap{overflow-x:auto}
table{border-collapse:collapse;width:100%%;table-layout:fixed}
td,th{border:1px solid #ccc;padding:4px;vertical-align:top;text-align:left}
th{background:#f3f3f3;position:sticky;top:0;z-index:1}
col.name{width:11em}
td img{width:100%%;height:auto;max-width:%(t)dpx;display:block}
.name{font-family:monospace;overflow-wrap:normal;word-break:normal;hyphens:none;overflow-x:auto}
.small{color:#666;font-size:85%%}
.legend{display:flex;flex-wrap:wrap;gap:.6em 2em;align-items:center;margin:.6em 0 1em;font-size:90%%}
.legend>div{max-width:100%%}
.bar{display:inline-block;width:14em;max-width:40vw;height:.9em;border:1px solid #888;vertical-align:middle;margin:0 .3em}
.sw{display:inline-block;width:.9em;height:.9em;border:1px solid #555;vertical-align:middle;margin:1px}
.sw.fg{outline:2px solid #111;outline-offset:1px}
.key{font-size:80%%;color:#444;margin-top:2px}
.skipped td:first-child{width:40%%}
@media (max-width:900px){body{padding:.5em}table{min-width:760px}}
"""


def _name_html(name: str) -> str:
    """An escaped file name that may wrap only after a separator (``/ _ -`` or a space), never
    in the middle of a word."""
    out = []
    for ch in name:
        out.append(html.escape(ch))
        if ch in "/_- ":
            out.append("<wbr>")
    return "".join(out)


def _hex(rgb: Sequence[int]) -> str:
    return "#%02x%02x%02x" % tuple(int(v) for v in rgb)


def _legend(colormap: str, with_labels: bool, with_levels: bool = False) -> str:
    """The key above the table: heatmap colour bar, mask and overlay conventions, labels,
    the regions at t."""
    lut = colormap_lut(colormap)
    stops = ",".join(_hex(lut[i]) for i in np.linspace(0, 255, 17).round().astype(int))
    parts = [
        f'<div><b>heatmap</b> R: 0 <span class="bar" style="background:linear-gradient(to right,{stops})">'
        f"</span> 1 <span class=\"small\">({html.escape(colormap)}; binary masks: R &gt; mean R)</span></div>",
        '<div><b>mask</b>: <span class="sw" style="background:#fff"></span> foreground '
        '<span class="sw" style="background:#000"></span> background</div>',
    ]
    if with_labels:
        parts.append(
            '<div><b>labels</b>: one colour per region; <span class="sw fg" style="background:#ccc"></span> '
            "ringed = foreground region, plain = background (key under each label map)</div>"
            "<div><b>overlay</b>: regions tinted, foreground outlined in white, background regions darkened</div>"
        )
    else:
        parts.append("<div><b>overlay</b>: background darkened, mask outlined in green</div>")
    if with_levels:
        parts.append(lv.LEVELS_LEGEND)
    return '<div class="legend">' + "".join(parts) + "</div>"


def _region_key(rec: ImageRecord) -> str:
    """Swatches of the regions of one image, foreground ones ringed."""
    regions = sorted({(int(a["region_id"]), a["category_id"] == FOREGROUND_ID)
                      for a in rec.annotations if "region_id" in a})
    if not regions:
        return ""
    pal = palette(max(r for r, _ in regions) + 1)
    sw = lambda r, fg: (f'<span class="sw{" fg" if fg else ""}" style="background:{_hex(pal[r])}" '  # noqa: E731
                        f'title="region {r}: {"foreground" if fg else "background"}"></span>')
    fg = "".join(sw(r, True) for r, f in regions if f)
    bg = "".join(sw(r, False) for r, f in regions if not f)
    return f'<div class="key">fg {fg or "none"}<br>bg {bg or "none"}</div>'


def _href(rel: str) -> str:
    return html.escape(urllib.parse.quote(rel), quote=True)


def source_link(source_path: str, root: str | os.PathLike) -> str:
    """Relative link from the output folder to a source file (absolute URI as fallback)."""
    try:
        return Path(os.path.relpath(source_path, os.path.abspath(root))).as_posix()
    except ValueError:  # another drive on Windows
        return Path(source_path).resolve().as_uri()


def render_gallery(
    root: str | os.PathLike,
    records: Sequence[ImageRecord],
    skipped: Sequence[dict[str, str]] = (),
    ignored: Sequence[dict[str, str]] = (),
    title: str = "segment",
    summary: Sequence[tuple[str, str]] = (),
    thumb_size: int = 256,
    colormap: str = "inferno",
    default_level: float | None = None,
) -> str:
    """The HTML of the static gallery: a legend (heatmap colour bar, mask, overlay and label
    keys), one row per image (image | heatmap | mask | overlay, plus labels with a
    foreground/background key for region methods), thumbnails linking to the full-size
    files, then the ``skipped`` images (that could not be segmented) and the ``ignored``
    files (not images), each ``{"path", "reason"}``. All links are relative.

    The layout fits the window (columns share its width, thumbnails scale down; at least
    1,280 px show every column without scrolling) and names wrap only after separators.

    Images with a hierarchy (``hierarchy/<name>.npz``) get one more column, "regions at
    t": their regions at the threshold of a slider, drawn from data inlined in the page, the
    one under the pointer with its height and escape probability
    (:mod:`segment.run.job.gallery_levels`); ``default_level`` is the method's default
    threshold (``Method.default_level``: the slider's start, marked). A run without
    hierarchies gets none of it."""
    with_labels = any("labels" in r.outputs for r in records)
    levels = _levels(root, records, thumb_size)
    cols = (["image", "heatmap", "mask", "overlay"] + (["labels"] if with_labels else [])
            + (["regions"] if levels else []))
    ts = lv.thresholds(default_level)
    e = html.escape
    css = _GALLERY_CSS % {"t": thumb_size, "maxw": 220 + len(cols) * (thumb_size + 10)}
    if levels:
        css += lv.LEVELS_CSS.replace("THUMB", str(thumb_size))
    out = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{e(title)}</title><style>{css}</style></head><body>",
        f"<h1>{_name_html(title)}</h1>",
    ]
    if summary:
        out.append("<p>" + "<br>".join(f"<b>{e(k)}</b>: {_name_html(v)}" for k, v in summary) + "</p>")
    out.append(_legend(colormap, with_labels, bool(levels)))
    out.append('<div class="wrap"><table class="images"><colgroup><col class="name">'
               + "<col>" * len(cols) + "</colgroup>")
    out.append("<thead><tr><th>name</th>" + "".join(
        lv.levels_header(ts, default_level) if c == "regions" else f"<th>{c}</th>" for c in cols)
        + "</tr></thead><tbody>")
    inlined: list[dict[str, Any]] = []  # the levels of the canvases, in their order
    out += [_row(root, r, cols, levels, inlined) for r in records]
    out.append("</tbody></table></div>")
    out += _file_tables(skipped, ignored)
    if inlined:
        out.append(lv.levels_script(ts, lv.start_index(ts, default_level), inlined))
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _row(root: str | os.PathLike, r: ImageRecord, cols: Sequence[str],
         levels: dict[str, dict[str, Any]], inlined: list[dict[str, Any]]) -> str:
    """The table row of one image; the data of its canvas (column "regions") is appended to
    ``inlined``."""
    e = html.escape
    cells = [
        f'<td class="name" title="{e(r.name)}">{_name_html(r.name)}<div class="small">{r.width}&times;{r.height}<br>'
        f"foreground {100 * r.mask_fraction:.1f}%"
        + (f"<br>{r.num_regions} regions" if r.num_regions is not None else "")
        + "</div></td>"
    ]
    for c in cols:
        if c == "regions":
            data = levels.get(r.name)
            if data is None or "thumb/image" not in r.outputs:
                cells.append("<td></td>")
                continue
            cells.append(lv.levels_cell(len(inlined), _href(r.outputs["thumb/image"]),
                                        (data["h"], data["w"]), f"regions of {r.name}"))
            inlined.append(data)
            continue
        thumb = r.outputs.get(f"thumb/{c}")
        full = source_link(r.source_path, root) if c == "image" else r.outputs.get(c)
        if thumb is None:
            cells.append("<td></td>")
            continue
        key = _region_key(r) if c == "labels" else ""
        cells.append(
            f'<td><a href="{_href(full or thumb)}"><img loading="lazy" src="{_href(thumb)}" '
            f'alt="{e(c)} of {e(r.name)}"></a>{key}</td>'
        )
    return "<tr>" + "".join(cells) + "</tr>"


def _file_tables(skipped: Sequence[dict[str, str]], ignored: Sequence[dict[str, str]]) -> list[str]:
    """The tables of the skipped images and the ignored files (none when empty)."""
    e = html.escape
    out = []
    for heading, files in (("Skipped", skipped), ("Ignored", ignored)):
        if not files:
            continue
        out.append(f'<h2>{heading} ({len(files)})</h2><div class="wrap"><table class="skipped">'
                   "<tr><th>file</th><th>reason</th></tr>")
        for f in files:
            out.append(f"<tr><td class=\"name\" title=\"{e(f['path'])}\">{_name_html(f['path'])}</td><td>{e(f['reason'])}</td></tr>")
        out.append("</table></div>")
    return out


def _levels(root: str | os.PathLike, records: Sequence[ImageRecord],
            thumb_size: int) -> dict[str, dict[str, Any]]:
    """Per image with a readable ``hierarchy/<name>.npz``, the page's data of its levels at
    the thumbnail's size (an unreadable file leaves its image without the column's canvas)."""
    out = {}
    for r in records:
        rel = r.outputs.get("hierarchy")
        if rel is None:
            continue
        try:
            out[r.name] = lv.image_levels(Path(root) / rel, thumb_shape(r.height, r.width, thumb_size))
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
            log.warning("gallery: no regions at t for %s: %s is unreadable (%s)", r.name, rel, e)
    return out


def write_gallery(path: str | os.PathLike, records: Sequence[ImageRecord], **kwargs: Any) -> None:
    """Write :func:`render_gallery` for the output folder that holds ``path``."""
    path = Path(path)
    atomic_write_text(path, render_gallery(path.parent, records, **kwargs))
