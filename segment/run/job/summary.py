"""The summary writer of a ``segment`` run: what it says and writes once the images are done.

:func:`outcome` gives the exit code and the closing log line from the statuses of every
image; :func:`write_summary` writes ``annotations.json``, ``index.html`` and ``run.json``
from the records of every image of the input (made now, by an earlier run or by another
rank); :func:`final_line` is the run's last line (the gallery, or the one line of a run
the output file system stopped).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from omegaconf import DictConfig, OmegaConf

from segment.run.job.coco import write_coco

from segment.run.job.gallery import write_gallery

from segment.run.job.manifest import device_info, package_versions, write_manifest

from segment.run.job.records import OutputWriteError
from segment.run.job.state import RunSettings, RunState
from segment.utils import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK

__all__ = ["EXIT_NOTHING_DONE", "config_dict", "fault_line", "final_line", "outcome", "write_run_file",
           "write_summary"]

log = logging.getLogger("segment.run.job.pipeline")  # the run's lines keep one logger name

EXIT_NOTHING_DONE = EXIT_FAILED


def outcome(state: RunState) -> int:
    """Exit code and closing log line from the statuses of every image (sets
    ``state.error`` when none could be processed)."""
    n_ok = state.count("done", "resumed")
    n_resumed = state.count("resumed")
    n_skipped = state.count("skipped")
    if n_ok == 0:
        n = len(state.files)
        state.error = (f"none of the {n} images could be segmented" if n != 1
                       else "the one image could not be segmented") + (
            "; see the reasons in run.json" if n_skipped == state.known_bad
            else "; see the reasons above and in run.json")
        log.error(state.error)
        return EXIT_NOTHING_DONE
    # "skipped": the one word of the per-file warnings, run.json, the gallery and the README
    log.info("done: %d segmented, %d resumed, %d skipped%s", n_ok - n_resumed, n_resumed, n_skipped,
             "" if not n_skipped else " (reasons in run.json)" if n_skipped == state.known_bad
             else " (reasons above and in run.json)")
    return EXIT_OK


def config_dict(cfg: DictConfig) -> Any:
    """The config as plain data for ``run.json`` (resolved where it can be)."""
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except Exception:  # an unresolvable interpolation: keep it unresolved in the manifest
        return OmegaConf.to_container(cfg, resolve=False)


def write_summary(state: RunState, settings: RunSettings, cfg: DictConfig, code: int, *,
                  model_name: str, method_name: str, default_level: float | None = None) -> None:
    """annotations.json, index.html and run.json from every record of this input; a file
    that cannot be written is noted in ``state`` (``unwritten``, ``fault``), and
    ``state.gallery`` is set once index.html is written. ``default_level``: the method's
    default threshold of its hierarchy (``Method.default_level``; the gallery's slider)."""
    ts = time.perf_counter()
    try:
        settings.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.error("cannot create the output folder %s: %s", settings.out, e)
        return
    skipped = [
        {"path": s.source, "reason": s.reason or ""}
        for f in state.files if (s := state.statuses.get(f.name)) is not None and s.status == "skipped"
    ]
    ignored = [{"path": p, "reason": r} for p, r in state.ignored]
    if state.files:
        _write_coco_and_gallery(state, settings, skipped, ignored, model_name=model_name, method_name=method_name,
                                default_level=default_level)
    manifest = _manifest(state, settings, cfg, code, skipped=skipped, ignored=ignored, model_name=model_name,
                         method_name=method_name, started_s=ts)
    write_run_file(state, settings, "run.json", write_manifest, manifest)


def _write_coco_and_gallery(state: RunState, settings: RunSettings, skipped: list[dict[str, str]],
                            ignored: list[dict[str, str]], *, model_name: str, method_name: str,
                            default_level: float | None = None) -> None:
    out = settings.out
    records = [state.records[f.name] for f in state.files if f.name in state.records]
    write_run_file(state, settings, "annotations.json", write_coco, records, info={
        "description": f"segment: {model_name} / {method_name}",
        "date_created": state.started.isoformat(timespec="seconds"),
        "version": package_versions(("segment",)).get("segment"),
        "input": str(state.input_root),
    })
    if write_run_file(
        state, settings, "index.html", write_gallery, records, skipped=skipped, ignored=ignored,
        title=f"segment: {out.name}",
        summary=[
            ("input", str(state.input_root)), ("model", str(model_name)), ("method", str(method_name)),
            ("images", images_line(len(records), len(state.files), len(skipped), len(ignored))),
        ],
        thumb_size=settings.opts.thumb_size, colormap=settings.opts.colormap,
        default_level=default_level,
    ):
        state.gallery = out / "index.html"


def images_line(segmented: int, found: int, skipped: int, ignored: int) -> str:
    """The gallery's count of the input, e.g. ``3 segmented of 4 images; 1 skipped; 2 other
    files ignored`` (skipped: images that could not be segmented; ignored: files that are
    not images; parts that are zero are left out)."""
    line = f"{segmented} segmented of {found} image{'' if found == 1 else 's'}"
    if skipped:
        line += f"; {skipped} skipped"
    if ignored:
        line += f"; {ignored} other file{'' if ignored == 1 else 's'} ignored"
    return line


def _manifest(state: RunState, settings: RunSettings, cfg: DictConfig, code: int, *,
              skipped: list[dict[str, str]], ignored: list[dict[str, str]], model_name: str, method_name: str,
              started_s: float) -> dict[str, Any]:
    """run.json's content (``started_s``: when the summary began, for its ``summary_s``)."""
    n_new = state.count("done")
    t = state.timings
    proc = t.processing_s
    timings = t.rounded()
    if state.ranks:  # torchrun: the slowest rank's processing time
        proc = max(r["timings"].get("processing_s", 0.0) for r in state.ranks)
    timings["images_per_s"] = round(n_new / proc, 3) if proc > 0 and n_new else None
    t.summary_s = time.perf_counter() - started_s
    timings["summary_s"] = round(t.summary_s, 4)
    statuses = [state.statuses[f.name].as_dict() for f in state.files if f.name in state.statuses]
    manifest = {
        "command": "segment",
        "exit_code": code,
        "error": state.error,
        "interrupted": state.interrupted,
        "started": state.started.isoformat(timespec="seconds"),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "input": str(state.input_root) if state.input_root else settings.input_desc,
        "output": str(settings.out),
        "model": str(model_name),
        "method": str(method_name),
        "fingerprint": settings.fingerprint,
        "counts": {
            "found": len(state.files),
            "segmented": n_new,
            "resumed": state.count("resumed"),
            "skipped": len(skipped),
            "ignored": len(ignored),
        },
        "device": device_info(state.device),
        "timings": timings,
        "config": config_dict(cfg),
        "versions": package_versions(),
        "images": statuses,
        "skipped": skipped,
        "ignored": ignored,
    }
    if state.changes:  # a rerun with other output settings (segment.run.job.rerun)
        manifest["settings_changed"] = [c.as_dict() for c in state.changes]
    if state.stale_removed or state.stale_kept:
        manifest["stale_removed"] = state.stale_removed
        manifest["stale_kept"] = state.stale_kept
    if state.ranks is not None:  # torchrun: one entry per rank (counts, device, timings)
        manifest["world_size"] = len(state.ranks)
        manifest["ranks"] = state.ranks
    if state.fault is not None and state.error is None:  # it was annotations.json or index.html
        manifest["error"] = f"cannot write to the output folder: {state.fault}"
    if state.fault is not None:
        manifest["exit_code"] = code if code == EXIT_INTERRUPTED else EXIT_FAILED
    return manifest


def write_run_file(state: RunState, settings: RunSettings, name: str, write: Callable[..., Any],
                   *args: Any, **kwargs: Any) -> bool:
    """``write(settings.out / name, ...)``; a refused write is noted in ``state``
    (``unwritten``, ``fault``) instead of raised, so the other run-level files are still tried."""
    out = settings.out
    try:
        write(out / name, *args, **kwargs)
    except OSError as e:
        log.debug("writing %s failed", name, exc_info=True)
        state.unwritten.append(name)
        if state.fault is None:
            tmp = e.filename is not None and os.fsdecode(e.filename).endswith(".tmp")
            state.fault = str(OutputWriteError(out, e, out / name if tmp or e.filename is None else None))
        return False
    return True


def fault_line(state: RunState, settings: RunSettings) -> str:
    """The one line of a run the output file system stopped: where, how far it got, how
    to go on, and which run-level files are missing."""
    line = (f"cannot write to the output folder {str(settings.out)!r} ({state.fault}); "
            f"{state.count('done', 'resumed')} of {len(state.files)} images are finished and complete; "
            "rerun the same command to resume once it can be written")
    if state.unwritten:
        line += f"; {', '.join(state.unwritten)} could not be written either"
    return line


def final_line(state: RunState, settings: RunSettings, *, is_main: bool) -> None:
    """The run's last line: the fault line (rank 0), or where the gallery is (open it)."""
    if is_main and state.fault is not None:
        log.error(fault_line(state, settings))
    elif state.gallery is not None:
        print(f"gallery: {state.gallery}", flush=True)
