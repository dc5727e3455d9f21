"""The planner of a ``segment`` run: what there is to do.

:func:`list_input` lists the input (and takes the output folder's lock), :func:`plan_items`
decides per image of this rank's share: resumed (its record is current,
:func:`current_record`), skipped again (an earlier run refused the file, as unreadable, too
large or too small, and neither the file nor the refusing settings changed since,
:func:`known_unreadable`), refused from its header (more pixels than ``max_pixels``:
:func:`refuse_too_large`, before the model loads), or to segment (an :class:`Item` for the
stage runner, :mod:`segment.run.job.stages`). The decisions go into the run's :class:`~segment.run.job.state.RunState`.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from segment.run.dist import DistContext
from segment.run.io import ImageFile, InputError, Listing, LoadedImage, find_images, too_many_pixels
from segment.run.job.lock import OutputLock
from segment.run.job.manifest import ImageStatus
from segment.run.job.records import ImageRecord, load_record, record_is_current
from segment.run.job.state import RunSettings, RunState, refusal_key

__all__ = ["Item", "current_record", "known_unreadable", "list_input", "log_plan", "plan_items",
           "refuse_too_large"]

log = logging.getLogger("segment.run.job.pipeline")  # the run's lines keep one logger name


@dataclass
class Item:
    """One image on its way through the stages (:mod:`segment.run.job.stages`)."""

    file: ImageFile
    source_bytes: int = 0
    source_mtime_ns: int = 0
    loaded: LoadedImage | None = None
    pixels: Tensor | None = None  # (3, H, W) preprocessed
    error: str | None = None
    unreadable: bool = False  # refused for the file itself (unreadable, too large or too small), not the model
    read_s: float = 0.0


def list_input(input_path: Path, out: Path, lock: OutputLock) -> Listing:
    """The images under ``input_path``; when there are any, ``lock`` is taken (one run per
    output folder, from before the plan reads the records).

    Raises:
        InputError: the output is a file or the input folder, or cannot be created.
        FolderBusy: another run holds the output folder (an :class:`InputError`).
    """
    if out.exists() and not out.is_dir():
        raise InputError(f"output {str(out)!r} exists and is not a folder")
    if input_path.exists() and input_path.resolve() == out:
        raise InputError(f"output folder {str(out)!r} is the input folder; choose another output")
    listing = find_images(input_path, exclude=[out])
    if listing.files:
        try:
            lock.acquire()
        except OSError as e:
            raise InputError(f"cannot create the output folder {str(out)!r}: {e.strerror or e}") from None
        if lock.stale is not None:
            log.warning("took over the output folder's lock from a run that ended without "
                        "giving it back (%s)", lock.stale.describe())
    return listing


def plan_items(files: list[ImageFile], settings: RunSettings, state: RunState) -> list[Item]:
    """The images of ``files`` to segment: not those with a current record (resume), nor the
    files an earlier run refused that are unchanged since (size and mtime, and the settings
    that refused them: :func:`known_unreadable`; unless ``retry_skipped`` or ``overwrite``),
    nor those with more pixels than ``max_pixels`` (:func:`refuse_too_large`). The others get
    their status (and a resumed image its record) in ``state``; ``state.known_bad`` counts
    the refused ones skipped again, ``state.too_large`` those refused from their header."""
    todo = []
    bad = {} if settings.retry_skipped else known_unreadable(settings, state.input_root, state.previous)
    for f in files:
        try:
            st = f.path.stat()
        except OSError as e:
            state.statuses[f.name] = ImageStatus(f.name, f.rel, "skipped", f"cannot be read: {e.strerror or e}")
            continue
        item = Item(file=f, source_bytes=st.st_size, source_mtime_ns=st.st_mtime_ns)
        if not settings.overwrite:
            rec = current_record(settings, f, st.st_size, st.st_mtime_ns)
            if rec is not None:
                state.records[f.name] = rec
                state.statuses[f.name] = ImageStatus.finished(rec, "resumed")
                continue
        was = bad.get(f.rel)
        if was is not None and (was.get("source_bytes"), was.get("source_mtime_ns")) == (st.st_size, st.st_mtime_ns):
            state.statuses[f.name] = ImageStatus(
                f.name, f.rel, "skipped", str(was.get("reason", "unreadable")), unreadable=True,
                source_bytes=st.st_size, source_mtime_ns=st.st_mtime_ns, known_bad=True)
            state.known_bad += 1
            continue
        todo.append(item)
    return refuse_too_large(todo, settings, state)


def refuse_too_large(todo: list[Item], settings: RunSettings, state: RunState) -> list[Item]:
    """The items of ``todo`` within ``max_pixels`` (Pillow's limit when ``None``), read from
    each file's header alone (:func:`~segment.run.io.too_many_pixels`; a few threads, as the
    files may be remote), so that a file too large is refused before the model loads. A
    refused file is skipped as the loader skips an unreadable one: one line (``skipped PATH:
    reason``), its status in ``state`` with its size and mtime (a rerun skips it again while
    it and the refusing settings are unchanged), counted in ``state.too_large``."""
    if not todo:
        return todo
    with ThreadPoolExecutor(min(8, len(todo)), thread_name_prefix="segment-header") as pool:
        reasons = list(pool.map(lambda it: too_many_pixels(it.file.path, max_pixels=settings.max_pixels), todo))
    keep = []
    for item, reason in zip(todo, reasons):
        if reason is None:
            keep.append(item)
            continue
        f = item.file
        state.statuses[f.name] = ImageStatus(f.name, f.rel, "skipped", reason, unreadable=True,
                                             source_bytes=item.source_bytes, source_mtime_ns=item.source_mtime_ns)
        state.too_large += 1
        log.warning("skipped %s: %s", f.path, reason)
    return keep


def known_unreadable(settings: RunSettings, input_root: Path | None,
                     previous: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The files the last run.json of this output (``previous``: its contents,
    :func:`segment.run.job.rerun.previous_run`) lists as refused (``unreadable``: not an
    image, corrupt, too large or too small; source -> status), when it read the same input
    with the same refusing settings (``max_pixels``, ``min_size`` and, without ``min_size``,
    the model, whose patch is the smallest image: :func:`~segment.run.job.state.refusal_key`)."""
    if previous is None:
        return {}
    try:
        if previous.get("input") != str(input_root):
            return {}
        if refusal_key(previous.get("config") or {}) != settings.refusals:
            return {}
        return {s["source"]: s for s in previous.get("images", []) if s.get("unreadable")}
    except (ValueError, TypeError, KeyError, AttributeError):
        return {}


def current_record(settings: RunSettings, f: ImageFile, size: int, mtime_ns: int) -> ImageRecord | None:
    """``f``'s record in ``settings.out`` if it is current (same settings, same source file,
    every output present), else ``None``."""
    rec = load_record(settings.out, f.name)
    if not record_is_current(rec, settings.out, fingerprint=settings.fingerprint, source_bytes=size,
                             source_mtime_ns=mtime_ns):
        return None
    rec.source_path = str(f.path)  # the input folder may have moved
    return rec


def log_plan(state: RunState, settings: RunSettings, ctx: DistContext, input_path: Path, todo: list[Item]) -> None:
    """The plan's one line: how many images, how many already done, how many to segment."""
    n = len(state.files)
    done_before = len(state.mine) - len(todo) - state.known_bad - state.too_large
    log.info(
        "%s%d image%s %s: %d already done%s, %d to segment%s%s -> %s",
        f"rank {ctx.rank}/{ctx.world_size}: {len(state.mine)} of " if ctx.distributed else "",
        n, "" if n == 1 else "s",
        f"({input_path})" if input_path.is_file() else f"under {state.input_root}", done_before,
        "" if not settings.overwrite else " (overwrite=true: redoing all)", len(todo),
        f", {state.known_bad} known-bad file{'' if state.known_bad == 1 else 's'} skipped again (unchanged "
        f"since run.json listed {'it' if state.known_bad == 1 else 'them'} as refused; retry_skipped=true reads "
        f"{'it' if state.known_bad == 1 else 'them'} again)" if state.known_bad else "",
        f", {state.too_large} skipped as too large (over the pixel limit, max_pixels)" if state.too_large else "",
        settings.out,
    )
