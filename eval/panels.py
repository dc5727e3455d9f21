"""The evaluator's PNG panels: per image, the photo, each method's maps and the ground truth.

Binary sets: ``image | heatmap | mask | ground truth`` per method; multi-class sets:
``image | labels (matched class) | ground truth`` in fixed class colours above a colour key;
sets of human segmentations: ``image | labels | human 1`` in region colours. Written for the
first ``panels`` images of a run to ``output/panels/<name>.png`` (:func:`write_sample_panel`).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from segment.datasets.base import Sample
from segment.eval.cache import SAFE_NAME
from segment.eval.metrics import matched_classes
from segment.eval.scoring import method_maps, region_labels
from torch import Tensor

from segment.core.masks import MethodOutput, labels_at
from segment.utils import atomic_path

PanelRows = dict[int, list[tuple[str, list[np.ndarray]]]]
"""The rows of the panels of one batch: position in the batch -> ``(label, tiles)`` per method."""


def _colour_heat(r: Tensor) -> np.ndarray:
    import cv2

    x = (r.clamp(0, 1).cpu().numpy() * 255).astype(np.uint8)
    return cv2.cvtColor(cv2.applyColorMap(x, cv2.COLORMAP_INFERNO), cv2.COLOR_BGR2RGB)


def _gray(mask: Tensor | np.ndarray) -> np.ndarray:
    m = mask.cpu().numpy() if isinstance(mask, Tensor) else np.asarray(mask)
    return np.repeat((m.astype(np.uint8) * 255)[..., None], 3, axis=2)


# distinct class colours (Tableau 20, dark then light); more classes take seeded random ones
_TAB20 = np.array([
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
    (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207),
    (174, 199, 232), (255, 187, 120), (152, 223, 138), (255, 152, 150), (197, 176, 213),
    (196, 156, 148), (247, 182, 210), (199, 199, 199), (219, 219, 141), (158, 218, 229),
], dtype=np.uint8)


def class_palette(k: int) -> np.ndarray:
    """``(k, 3)`` uint8: one fixed colour per class (the same in every panel)."""
    if k <= len(_TAB20):
        return _TAB20[:k].copy()
    rng = np.random.default_rng(27)
    return np.concatenate([_TAB20, rng.integers(30, 256, (k - len(_TAB20), 3), dtype=np.uint8)])


def colour_classes(cls: np.ndarray, k: int) -> np.ndarray:
    """``(H, W)`` class map -> RGB: classes ``0..k-1`` in :func:`class_palette`, negative
    values (segments left unmatched, see :func:`matched_classes`) in dark shades of grey,
    anything else (ignored pixels) black."""
    pal = class_palette(k)
    out = np.zeros((*cls.shape, 3), np.uint8)
    ok = (cls >= 0) & (cls < k)
    out[ok] = pal[cls[ok]]
    un = cls < 0
    out[un] = (40 + 25 * ((-cls[un] - 1) % 4)).astype(np.uint8)[:, None]
    return out


def colour_regions(labels: np.ndarray | Tensor) -> np.ndarray:
    """``(H, W)`` region ids -> RGB, the regions in :func:`class_palette` colours in the order of
    their ids."""
    lab = labels.cpu().numpy() if isinstance(labels, Tensor) else np.asarray(labels)
    ids, inv = np.unique(lab, return_inverse=True)
    return colour_classes(inv.reshape(lab.shape), len(ids))


def _text_strip(width: int, items: list[tuple[int, str]], height: int = 18,
                swatches: np.ndarray | None = None) -> np.ndarray:
    """A white strip with ``(x, text)`` labels (and a colour swatch before each, if given)."""
    import cv2

    head = np.full((height, width, 3), 255, np.uint8)
    for n, (x, text) in enumerate(items):
        if swatches is not None:
            head[4 : height - 4, x : x + 10] = swatches[n]
            x += 13
        cv2.putText(head, text, (x + 2, 13), cv2.FONT_HERSHEY_SIMPLEX, 0.45, (0, 0, 0), 1, cv2.LINE_AA)
    return head


def _legend(width: int, names: list[str]) -> list[np.ndarray]:
    """Colour key of the classes: strips of ``[swatch] name`` wrapped to ``width``."""
    pal = class_palette(len(names))
    strips, items, x = [], [], 0
    for c, name in enumerate(names):
        step = 22 + 8 * len(name)
        if x + step > width and items:
            strips.append(_text_strip(width, [(xi, t) for xi, t, _ in items], swatches=pal[[ci for _, _, ci in items]]))
            items, x = [], 0
        items.append((x, name, c))
        x += step
    if items:
        strips.append(_text_strip(width, [(xi, t) for xi, t, _ in items], swatches=pal[[ci for _, _, ci in items]]))
    return strips


def write_panel(path: Path, image, target: np.ndarray, rows: list[tuple[str, list[np.ndarray]]],
                columns: Sequence[str] | None = None, class_names: Sequence[str] | None = None) -> None:
    """One PNG: column headers, then per method a row ``image | heatmap | mask | ground
    truth`` (labelled); ``target`` is a bool mask, a class map (with ``class_names``) or an
    ``(H, W, 3)`` uint8 image shown as it is.

    Multi-class sets (``class_names`` given): rows are ``image | labels | ground truth``, the
    ground truth in :func:`class_palette` colours (ignored pixels black) above a colour key;
    ``columns`` names the columns in a header.
    """
    import cv2
    from PIL import Image

    h, w = target.shape[:2]
    img = np.asarray(image.convert("RGB").resize((w, h), Image.BILINEAR))
    if target.ndim == 3 and target.shape[2] == 3 and target.dtype == np.uint8:
        gt = target  # already in colour (e.g. a human segmentation, colour_regions)
    elif class_names is not None:
        gt = colour_classes(target.astype(np.int64), len(class_names))
    elif target.dtype == bool:
        gt = _gray(target)
    else:
        raise ValueError(f"write_panel: a binary panel needs a bool target, got {target.dtype}"
                         " (pass class_names for a class map)")
    pad = 4
    lines = []
    if columns is None and rows:  # binary: image | heatmap | mask | ground truth
        n = len(rows[0][1])
        columns = ["image", *(["heatmap", "mask"] + [""] * n)[:n], "ground truth"]
    if columns:
        lines.append(_text_strip((w + pad) * len(columns), [(c * (w + pad), t) for c, t in enumerate(columns)]))
    for label, tiles in rows:
        row = [img, *tiles, gt]
        row = [np.pad(t, ((0, 0), (0, pad), (0, 0)), constant_values=255) for t in row]
        strip = np.concatenate(row, axis=1)
        head = np.full((18, strip.shape[1], 3), 255, np.uint8)
        cv2.putText(head, label, (2, 13), cv2.FONT_HERSHEY_SIMPLEX, 0.45, (0, 0, 0), 1, cv2.LINE_AA)
        lines.append(np.concatenate([head, strip, np.full((pad, strip.shape[1], 3), 255, np.uint8)], 0))
    if class_names is not None:
        lines.extend(_legend(lines[-1].shape[1], list(class_names)))
    canvas = np.concatenate(lines, 0)
    buf = io.BytesIO()
    Image.fromarray(canvas).save(buf, format="PNG")
    with atomic_path(path) as tmp:
        tmp.write_bytes(buf.getvalue())


def panel_tiles(panel_rows: PanelRows, out: MethodOutput, targets: Sequence[Tensor], mask_at: str,
                label: str, task: str, num_classes: int = 2) -> None:
    """Add the tiles of one method's output ``out`` (a batch) to the panels in ``panel_rows``
    (``targets``: the batch's ground truths; ``task``: the data set's)."""
    for j in panel_rows:
        size = tuple(targets[j].shape[-2:])
        one = MethodOutput(
            heatmap=out.heatmap[j : j + 1],
            labels=None if out.labels is None else out.labels[j : j + 1],
            foreground=None if out.foreground is None else out.foreground[j : j + 1],
        )
        if task == "binary":
            ((r, m),) = method_maps(one, [size], mask_at)
            panel_rows[j].append((label, [_colour_heat(r), _gray(m)]))
        elif task == "regions":  # every region in its own colour
            lab = region_labels(one, 0, size).cpu().numpy()
            panel_rows[j].append((f"{label}: {len(np.unique(lab))} regions", [colour_regions(lab)]))
        else:  # segments coloured by the class the image's Hungarian matching gives them
            lab = labels_at(one.labels, size)[0].cpu().numpy()
            cls = matched_classes(lab, targets[j].numpy(), num_classes)
            panel_rows[j].append((f"{label}: {len(np.unique(lab))} regions", [colour_classes(cls, num_classes)]))


def write_sample_panel(out_dir: Path, sample: Sample, rows: list[tuple[str, list[np.ndarray]]],
                       task: str, class_names: Sequence[str] = ()) -> None:
    """``out_dir/panels/<name>.png``: the panel of one item of a data set of ``task``, its
    methods' ``rows`` from :func:`panel_tiles` (``class_names``: a multi-class set's)."""
    path = out_dir / "panels" / f"{SAFE_NAME.sub('_', sample.name)}.png"
    if task == "binary":
        write_panel(path, sample.image, sample.target, rows)
    elif task == "regions":  # the first human segmentation, in region colours
        write_panel(path, sample.image, colour_regions(sample.target[0]), rows,
                    columns=["image", "labels (as segment writes them)", "human 1"])
    else:
        write_panel(path, sample.image, sample.target, rows,
                    columns=["image", "labels (matched class)", "ground truth"],
                    class_names=class_names)
