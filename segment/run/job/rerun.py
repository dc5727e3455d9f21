"""A rerun that says why: what changed since the last run into an output folder, and the
level folders the change makes stale.

Before segmenting, a rerun into a folder with a ``run.json`` compares the settings that
decide the outputs (:func:`~segment.run.job.state.output_settings`, what the resume
fingerprint hashes) with the recorded ``config`` and logs one line per changed key
(:func:`setting_changes`: ``setting changed: method.escape 0.5 -> 0.4``), then how many
images will be segmented again (:func:`log_changes`).

``python -m segment.run.job.levels`` marks each folder it creates with
:data:`LEVEL_MARK` (the kind, ``t`` and the run's fingerprint: :func:`mark_level_folder`).
A marked folder of another fingerprint (or any, with ``overwrite=true``) is stale once the
run redoes every image it holds, and the rerun removes it after its checks have passed
(:func:`remove_stale`); a folder named like a level folder without the mark, or one that
holds images this run does not segment again, is kept and listed. Both lists go into
run.json (``stale_removed``, ``stale_kept``).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from segment.run.job.records import rel_output
from segment.run.job.state import RunSettings, RunState, output_settings
from segment.utils import atomic_write_json

__all__ = ["LEVEL_MARK", "Change", "find_stale", "log_changes", "mark_level_folder",
           "previous_run", "remove_stale", "setting_changes"]

log = logging.getLogger("segment.run.job.pipeline")  # the run's lines keep one logger name

LEVEL_MARK = ".segment-level.json"
"""The file ``levels`` writes into each folder it creates: the proof that it wrote it."""

WRITTEN_BY = "segment.run.job.levels"
LEVEL_NAME = re.compile(r"(labels|masks)_t\d+(\.\d+)?")
_ABSENT = object()


@dataclass(frozen=True)
class Change:
    """One changed output setting: its dotted key and the old and new values
    (:data:`_ABSENT` on one side for an added or removed key)."""

    key: str
    old: Any
    new: Any

    def line(self) -> str:
        """``method.escape 0.5 -> 0.4``, ``method.foo added (1)``, ``method.bar removed (was 2)``."""
        if self.old is _ABSENT:
            return f"{self.key} added ({_show(self.new)})"
        if self.new is _ABSENT:
            return f"{self.key} removed (was {_show(self.old)})"
        return f"{self.key} {_show(self.old)} -> {_show(self.new)}"

    def as_dict(self) -> dict[str, Any]:
        """For run.json: ``{"key", "old", "new"}``, a side left out when absent."""
        d: dict[str, Any] = {"key": self.key}
        d.update({k: v for k, v in (("old", self.old), ("new", self.new)) if v is not _ABSENT})
        return d


def _show(value: Any) -> str:
    """A value as a config override writes it: ``0.4``, ``true``, ``null``, ``regions``."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as ``{dotted key: leaf}`` (lists and empty dicts are leaves)."""
    if not isinstance(node, Mapping) or (not node and prefix):
        return {prefix: node}
    out: dict[str, Any] = {}
    for k, v in node.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def setting_changes(old_cfg: Mapping[str, Any], new_cfg: Any) -> list[Change]:
    """The output settings (:func:`~segment.run.job.state.output_settings`) that differ
    between a recorded config (run.json's ``config``) and ``new_cfg``, sorted by key."""
    try:
        old = _flat(output_settings(old_cfg))
    except ValueError:  # a recorded value this version refuses: compare it as written
        old = _flat({**output_settings({**old_cfg, "label_upsampling": None}),
                     "label_upsampling": old_cfg.get("label_upsampling")})
    new = _flat(output_settings(new_cfg))
    return [Change(k, old.get(k, _ABSENT), new.get(k, _ABSENT)) for k in sorted(old.keys() | new.keys())
            if old.get(k, _ABSENT) != new.get(k, _ABSENT)]


def previous_run(out: Path) -> dict[str, Any] | None:
    """The run.json an earlier run left in ``out`` (``None``: none, or not readable)."""
    try:
        man = json.loads((out / "run.json").read_text("utf-8"))
    except (OSError, ValueError):
        return None
    return man if isinstance(man, dict) and isinstance(man.get("config"), dict) else None


def log_changes(state: RunState, settings: RunSettings, cfg: Any, todo_names: list[str],
                *, prefix: str = "") -> None:
    """Before segmenting: the settings that changed since ``state.previous`` (one line
    each, also kept in ``state.changes``), or that none did, and how many of ``todo_names``
    an earlier run had segmented (their record exists): ``N images will be segmented
    again``. Nothing without an earlier run.json. ``prefix``: ``rank R/W: `` under torchrun."""
    prev = state.previous
    if prev is None:
        return
    if prev.get("fingerprint") == settings.fingerprint:
        log.info("settings unchanged since the last run in this folder (run.json)")
    else:
        state.changes = setting_changes(prev["config"], cfg)
        for c in state.changes:
            log.info("setting changed: %s", c.line())
        if not state.changes:  # e.g. a run.json of an older segment that hashed otherwise
            log.info("setting changed: the outputs' fingerprint %s -> %s (no key differs; "
                     "another segment version)", prev.get("fingerprint"), settings.fingerprint)
    again = sum((settings.out / rel_output("record", n)).is_file() for n in todo_names)
    if again or prev.get("fingerprint") != settings.fingerprint or settings.overwrite:
        log.info("%s%d image%s will be segmented again%s", prefix, again, "" if again == 1 else "s",
                 " (overwrite=true)" if settings.overwrite else "")


def mark_level_folder(folder: Path, *, kind: str, t: float, fingerprint: str | None) -> None:
    """Write :data:`LEVEL_MARK` into ``folder`` (``levels``' own, created by it): a rerun
    with other settings may then remove it (:func:`find_stale`).

    Raises:
        OSError: the file system refused the write.
    """
    atomic_write_json(folder / LEVEL_MARK, {"written_by": WRITTEN_BY, "kind": kind, "t": t,
                                            "fingerprint": fingerprint})


def _mark(folder: Path) -> dict[str, Any] | None:
    """The folder's :data:`LEVEL_MARK` when it is ``levels``' (and names this folder)."""
    try:
        mark = json.loads((folder / LEVEL_MARK).read_text("utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(mark, dict) or mark.get("written_by") != WRITTEN_BY:
        return None
    return mark if LEVEL_NAME.fullmatch(folder.name) and folder.name.startswith(f"{mark.get('kind')}_t") else None


def _images_in(folder: Path) -> set[str]:
    return {p.relative_to(folder).with_suffix("").as_posix() for p in folder.rglob("*.png")}


def find_stale(state: RunState, settings: RunSettings) -> tuple[list[str], list[dict[str, str]]]:
    """The level folders of ``settings.out`` this run makes stale: ``(removable, kept)``.

    Removable: marked by ``levels`` (:func:`mark_level_folder`) with another fingerprint,
    or any with ``overwrite=true``, and every image it holds is one this run segments (of
    ``state.files``: its record is not current). Kept (``{"folder", "reason"}``), only when
    the settings changed or ``overwrite=true``: such a folder that also holds other images,
    and folders named like level folders (``labels_t0.50``) without the mark."""
    prev = state.previous
    changed = settings.overwrite or (prev is not None and prev.get("fingerprint") != settings.fingerprint)
    if not changed or not settings.out.is_dir():
        return [], []
    names = {f.name for f in state.files}
    removable, kept = [], []
    for folder in sorted(p for p in settings.out.iterdir() if p.is_dir()):
        mark = _mark(folder)
        if mark is None:
            if LEVEL_NAME.fullmatch(folder.name):
                kept.append({"folder": folder.name, "reason": f"no {LEVEL_MARK}: not provably "
                             "written by python -m segment.run.job.levels"})
            continue
        if mark.get("fingerprint") == settings.fingerprint and not settings.overwrite:
            continue
        others = _images_in(folder) - names
        if others:
            kept.append({"folder": folder.name, "reason": f"holds {len(others)} image(s) this run "
                         "does not segment again"})
        else:
            removable.append(folder.name)
    return removable, kept


def remove_stale(state: RunState, settings: RunSettings) -> None:
    """Remove the stale level folders (:func:`find_stale`), one line each; what was removed
    and what was kept go into ``state.stale_removed`` and ``state.stale_kept`` (run.json).
    Called once the run's checks have passed (lock, settings, model)."""
    removable, kept = find_stale(state, settings)
    for name in removable:
        try:
            shutil.rmtree(settings.out / name)
        except OSError as e:
            kept.append({"folder": name, "reason": f"could not be removed: {e.strerror or e}"})
            continue
        state.stale_removed.append(name)
        log.info("removed stale level folder %s/ (written by levels for other settings)", name)
    for k in kept:
        log.warning("kept level folder %s/, possibly stale: %s", k["folder"], k["reason"])
    state.stale_kept.extend(kept)
