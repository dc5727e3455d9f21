"""Another level of a finished ``segment`` run, without the model::

    python -m segment.run.job.levels RUN_DIR --t 0.6

writes ``RUN_DIR/labels_t0.60/<name>.png`` and ``RUN_DIR/masks_t0.60/<name>.png`` for every
image the run's ``run.json`` lists as done, from its ``hierarchy/<name>.npz``
(:mod:`segment.run.job.hierarchy_files`), in the formats of ``labels/`` and ``masks/``
(:func:`write_level`). Smaller ``t`` is coarser.

At ``t = method.escape`` the labels are the default level's regions of the tree, not
``labels/``: ``labels/`` splits each of them into its connected components (specks under
``min_area`` absorbed by a neighbour) and numbers the pieces anew, and the two maps are
upsampled to the image separately (docs/segment.md, "Every level").

A folder it creates gets a mark (``.segment-level.json``: the kind, ``t``, the run's
fingerprint; :func:`segment.run.job.rerun.mark_level_folder`), so that a rerun of
``segment`` with other settings removes it as stale; a folder that was there without the
mark is written into but never marked (it may be the user's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from segment.run.api.render import RenderOptions
from segment.run.job.hierarchy_files import level_labels, level_mask, load_hierarchy
from segment.run.job.records import OutputWriteError, encode_labels, encode_mask, write_file
from segment.run.job.rerun import LEVEL_MARK, mark_level_folder

__all__ = ["LevelRun", "check_threshold", "level_folder", "main", "run_images", "write_level"]

PROG = "python -m segment.run.job.levels"


def level_folder(kind: str, t: float) -> str:
    """The folder of a level's files: ``labels_t0.60`` / ``masks_t0.60`` (two decimals when
    they hold ``t`` exactly, else every digit: ``labels_t0.605``)."""
    tag = f"{t:.2f}" if float(f"{t:.2f}") == t else repr(float(t))
    return f"{kind}_t{tag}"


def check_threshold(value: str | float) -> float:
    """A threshold ``t`` in ``(0, 2]`` (the range of the heights, as of ``method.escape``).

    Raises:
        ValueError: not a number, or outside ``(0, 2]``.
    """
    try:
        t = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"t must be a number in (0, 2], got {value!r}") from None
    if not 0.0 < t <= 2.0:  # NaN fails too
        raise ValueError(f"t must lie in (0, 2] (the range of the heights), got {value!r}")
    return t


@dataclass
class LevelRun:
    """What :func:`write_level` did.

    Attributes:
        labels_dir, masks_dir: the folders written.
        written: the names whose labels and mask were written.
        skipped: ``(name, reason)`` of the images whose hierarchy file could not be used.
        seconds: per written image, the time to read its file, build the level and write the
            two PNGs.
    """

    labels_dir: Path
    masks_dir: Path
    written: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


def run_images(run_dir: str | os.PathLike) -> tuple[list[str], dict]:
    """The names of a finished ``segment`` run's images that have a hierarchy file, and its
    ``run.json``.

    Raises:
        ValueError: ``run_dir`` is not a finished run (no readable ``run.json``) or has no
            ``hierarchy/`` (its method gives one level).
    """
    root = Path(run_dir)
    if not root.is_dir():
        raise ValueError(f"{root} is not a folder (give the output folder of a segment run)")
    try:
        man = json.loads((root / "run.json").read_text("utf-8"))
        names = [im["name"] for im in man["images"] if im.get("status") in ("done", "resumed")]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        why = "no run.json" if not (root / "run.json").exists() else f"run.json unreadable ({e})"
        raise ValueError(f"{root} is not a finished segment run: {why}") from None
    if not (root / "hierarchy").is_dir():
        method = man.get("method", "?")
        raise ValueError(f"{root} has no hierarchy/: method {method} gives one level "
                         "(method=cuts writes every level)")
    return names, man


def write_level(run_dir: str | os.PathLike, t: float, *, progress: bool = True) -> LevelRun:
    """Write the labels and masks at threshold ``t`` of every image of a finished run, from
    its ``hierarchy/`` files, without the model: ``labels_t<t>/<name>.png`` (an indexed PNG
    as ``labels/``: the ids of :func:`segment.run.job.hierarchy_files.labels_at`) and
    ``masks_t<t>/<name>.png`` (0/255 as ``masks/``:
    :func:`segment.run.job.hierarchy_files.mask_at`), each written atomically with the run's ``render``
    settings. An image whose file is missing or corrupt is skipped (with its reason) and the
    rest go on. A folder it creates is marked as its own (module docstring).

    Raises:
        ValueError: not a finished run, no ``hierarchy/``, or ``t`` outside ``(0, 2]``.
        OutputWriteError: the file system refused a write.
    """
    t = check_threshold(t)
    root = Path(run_dir)
    names, man = run_images(root)
    try:
        opts = RenderOptions(**(man.get("config") or {}).get("render") or {})
    except (TypeError, ValueError):
        opts = RenderOptions()
    out = LevelRun(root / level_folder("labels", t), root / level_folder("masks", t))
    unmarked = [(k, d) for k, d in (("labels", out.labels_dir), ("masks", out.masks_dir))
                if not d.exists() or (d / LEVEL_MARK).is_file()]  # ours to mark
    bar = tqdm(names, desc=f"level t={t:g}", unit="image", disable=not progress, file=sys.stderr)
    for name in bar:
        t0 = time.perf_counter()
        path = root / "hierarchy" / f"{name}.npz"
        try:
            tree, leaves, share = load_hierarchy(path)
        except FileNotFoundError:
            out.skipped.append((name, f"{path} is missing"))
            continue
        except (OSError, ValueError) as e:
            out.skipped.append((name, str(e)))
            continue
        labels = encode_labels(level_labels(tree, leaves, t), opts)
        mask = encode_mask(level_mask(tree, leaves, share, t), opts)
        try:
            for kind, d in unmarked:  # before the first image's files
                d.mkdir(parents=True, exist_ok=True)
                mark_level_folder(d, kind=kind, t=t, fingerprint=man.get("fingerprint"))
            unmarked = []
            write_file(out.labels_dir / f"{name}.png", labels, opts.fsync)
            write_file(out.masks_dir / f"{name}.png", mask, opts.fsync)
        except OSError as e:
            raise OutputWriteError(root, e) from e
        out.written.append(name)
        out.seconds.append(time.perf_counter() - t0)
    bar.close()
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints the usage too)
        self.exit(2, f"{PROG}: {message} (--help for usage)\n")


def main(argv: list[str] | None = None) -> int:
    """``python -m segment.run.job.levels RUN_DIR --t T``: the labels and masks of a
    finished run at threshold ``T`` (:func:`write_level`). Exit 0 when images were written
    (corrupt or missing hierarchy files listed as skipped), 1 when none could be (or a
    write failed), 2 for a folder that is not a finished run, has no ``hierarchy/``, or a
    bad ``T``."""
    p = _Parser(prog=PROG, description=(
        "Write the labels and masks of a finished segment run at another threshold t, from "
        "its hierarchy/ files, without the model: RUN_DIR/labels_t<t>/ and "
        "RUN_DIR/masks_t<t>/ (PNG, as labels/ and masks/). Smaller t is coarser; the run's "
        "labels/ are the level at method.escape (split into connected components)."))
    p.add_argument("run_dir", metavar="RUN_DIR", help="the output folder of a segment run "
                   "with method=cuts (it holds run.json and hierarchy/)")
    p.add_argument("--t", required=True, metavar="T",
                   help="the threshold, in (0, 2]: keep the splits of height below T")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, one line)
        return int(e.code or 0)
    try:
        res = write_level(args.run_dir, check_threshold(args.t), progress=not args.no_progress)
    except ValueError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    except OutputWriteError as e:
        print(f"{PROG}: could not write {e.path or e.root}: {e.strerror}", file=sys.stderr)
        return 1
    for name, why in res.skipped:
        print(f"skipped {name}: {why}", file=sys.stderr)
    n, ms = len(res.written), 1000 * float(np.median(res.seconds)) if res.seconds else 0.0
    print(f"{n} images at t={float(args.t):g} -> {res.labels_dir}, {res.masks_dir}"
          f" ({ms:.1f} ms per image, median)"
          + (f"; {len(res.skipped)} skipped (above)" if res.skipped else ""))
    return 0 if n or not res.skipped else 1


if __name__ == "__main__":
    sys.exit(main())
