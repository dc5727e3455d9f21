"""The ``segment`` job: every image under a folder -> masks, heatmaps, overlays, COCO, gallery.

Flow (:func:`run_segment`)::

    find_images ──> plan (resume: skip images whose record is current)
        ──> build the Segmenter (segment.run.api: backbone + method; the Python API's object)
    ──> loader threads: read + EXIF + RGB + Segmenter.preprocess       (overlapped)
        ──> main thread: batches of one preprocessed size -> Segmenter.extract
        ──> method thread: Segmenter.apply on each batch's attention record (batch i
            while the main thread runs the forward of batch i + 1)
        ──> writer threads: Segmenter.postprocess at the original size, files, record
    ──> annotations.json, index.html, run.json from the records of every image

Helper threads run on one torch thread each, so only the forward holds an OpenMP team.
Several processes (CPUs or GPUs, one node or many) are ``torchrun``'s (:mod:`segment.run.shard`).

The per-batch computation is :class:`segment.run.api.Segmenter`'s, the object ``segment.load``
returns, so the command's masks and the API's are the same computation.

"Done" is recorded per image by ``records/<name>.json``, written after all of that image's
files; an image counts as done when its record exists, was made with the same model and
method config (a fingerprint), the source file has the same size and mtime, and the files
it lists exist. ``annotations.json`` and ``index.html`` are rebuilt from the records at the
end of every run, so a resumed run lists every image of the input. Under ``torchrun`` each
rank runs this flow on its share of the sorted list and rank 0 writes the run-level files
(:mod:`segment.run.shard`).

One run per output folder: the run holds ``<output>/.segment.lock`` (its pid and host,
:mod:`segment.run.lock`) from the scan to the run files; a second run into the same folder
stops at once with one line naming the first (exit 3), and a lock left by a run that died
is taken over. A write the output file system refuses (a full disk, a quota, a read-only
remount) stops the run at once (exit 1): the images finished stay complete, the image
being written leaves none of its files, and the error line says how far it got.

Bad input never stops the run: each unusable file is logged with the reason, listed in the
manifest and the gallery, and the run goes on. The exit code is 0 when at least one image is
segmented (now or by an earlier run), 1 when none could be or the output folder could not be
written, 2 when the input itself is unusable (missing path, no images, bad settings, a model
that cannot be loaded), 3 when another run holds the output folder, 130 after
Ctrl-C (the files of finished images and the run-level files are still written). A run that
cannot start (exit 2 before any image is processed) writes nothing into the output folder
and does not create it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
import warnings
from collections import OrderedDict, deque
from collections.abc import Iterator
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from PIL import Image
from torch import Tensor

from segment.core.masks import MethodOutput, label_upsampling_setting
from segment.core.record import AttentionRecord
from segment.models.base import Backbone
from segment.run import shard
from segment.run.api import Segmenter
from segment.run.io import (
    IMAGE_EXTENSIONS,
    ImageFile,
    ImageReadError,
    InputError,
    LoadedImage,
    bundled_examples,
    find_images,
    read_image,
)
from segment.run.lock import FolderBusy, OutputLock
from segment.run.outputs import (
    ImageRecord,
    ImageStatus,
    OutputWriteError,
    RenderOptions,
    device_info,
    load_record,
    package_versions,
    record_is_current,
    single_threaded_rendering,
    write_coco,
    write_gallery,
    write_image,
    write_manifest,
)
from segment.utils import (
    EXIT_BAD_INPUT,
    EXIT_BUSY,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    resolve_device,
    unwrap_instantiation,
)

log = logging.getLogger(__name__)

EXIT_NOTHING_DONE = EXIT_FAILED


class _ModelFailed(Exception):
    """The model or method could not run on an image (the message says why)."""


class _OutputFault(Exception):
    """The output folder's file system refused a write: the run stops (see ``SegmentRun.fault``)."""


@dataclass
class _Item:
    """One image on its way through the pipeline."""

    file: ImageFile
    source_bytes: int = 0
    source_mtime_ns: int = 0
    loaded: LoadedImage | None = None
    pixels: Tensor | None = None  # (3, H, W) preprocessed
    error: str | None = None
    unreadable: bool = False  # the error is the file's own (read_image), not a setting's
    read_s: float = 0.0


@dataclass
class _Timings:
    scan_s: float = 0.0
    plan_s: float = 0.0
    model_load_s: float = 0.0
    processing_s: float = 0.0
    summary_s: float = 0.0
    read_s: float = 0.0  # summed over loader threads
    model_s: float = 0.0  # backbone forward with capture (Segmenter.extract), main thread
    method_s: float = 0.0  # the method on the records (Segmenter.apply), method thread
    write_s: float = 0.0  # summed over writer threads
    wait_input_s: float = 0.0  # main thread waiting for decoded images
    extra: dict[str, float] = field(default_factory=dict)

    def rounded(self) -> dict[str, float]:
        """Every timing (the fields, then ``extra``) in seconds, to 0.1 ms."""
        out = {k: round(v, 4) for k, v in self.__dict__.items() if isinstance(v, float)}
        out.update({k: round(v, 4) for k, v in self.extra.items()})
        return out


def config_fingerprint(cfg: DictConfig) -> str:
    """Hash of what decides an image's outputs: the model and method configs (``device``
    left out), the rendering options and ``label_upsampling``. Records with another
    fingerprint are redone."""
    def clean(node: Any) -> Any:
        if node is None:
            return None
        d = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        if isinstance(d, dict):
            d = {k: v for k, v in d.items() if k != "device"}
        return d

    blob = {
        "model": clean(cfg.get("model")),
        "method": clean(cfg.get("method")),
        "render": {k: v for k, v in (clean(cfg.get("render")) or {}).items() if k != "fsync"},
        "label_upsampling": label_upsampling_setting(cfg.get("label_upsampling")),
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _describe(e: BaseException) -> str:
    """One line for an exception, unwrapping Hydra's instantiation wrapper."""
    e = unwrap_instantiation(e)
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _cfg_dict(cfg: DictConfig) -> Any:
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except Exception:  # an unresolvable interpolation: keep it unresolved in the manifest
        return OmegaConf.to_container(cfg, resolve=False)


class SegmentRun:
    """One ``segment`` run (see the module docstring); :func:`run_segment` drives it.

    Args:
        cfg: the composed ``segment`` config.
        backbone: an already built backbone (benchmarks reuse one); default: built from
            ``cfg.model``.
        method: an already built method; default: built from ``cfg.method``.
        ctx: this process's place under torchrun (:mod:`segment.run.shard`); default: a single
            process.
    """

    def __init__(self, cfg: DictConfig, *, backbone: Backbone | None = None, method: Any = None,
                 ctx: shard.DistContext | None = None) -> None:
        self.cfg = cfg
        self.ctx = ctx or shard.DistContext()
        self.backbone = backbone
        self.method = method
        self.segmenter: Segmenter | None = None
        self.opts = RenderOptions(**(OmegaConf.to_container(cfg.render, resolve=True) if cfg.get("render") else {}))
        self.out = Path(str(cfg.output)).expanduser().resolve()
        bs = cfg.get("batch_size")
        self.batch_size = 1 if bs is None else int(bs)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {bs}")
        nw = cfg.get("num_workers")
        self.num_workers = int(nw) if nw is not None else 0  # 0 = chosen for the device in _build
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0 (0 or null = automatic), got {nw}")
        label_upsampling_setting(cfg.get("label_upsampling"))  # refused before the model is built
        self.max_pixels = cfg.get("max_pixels")
        self.min_size = cfg.get("min_size")
        self.overwrite = bool(cfg.get("overwrite", False))
        retry = cfg.get("retry_skipped", False)
        if not isinstance(retry, bool):
            raise ValueError(f"retry_skipped must be true or false, got {retry!r}")
        self.retry_skipped = retry or self.overwrite
        self.known_bad = 0  # unreadable files skipped again without reading (see _plan)
        self.progress = bool(cfg.get("progress", True)) and self.ctx.is_main
        self.fingerprint = config_fingerprint(cfg)
        self.device: torch.device | None = None
        self.pin_memory = False  # set in _build: True when the backbone is on CUDA
        self.input_device = torch.device("cpu")  # where the backbone wants its pixels
        self._extracting = threading.Lock()  # one capture at a time (the hooks are per model)
        self._refused = threading.Event()  # a writer met a refused write: start nothing new
        self.t = _Timings()
        self.statuses: dict[str, ImageStatus] = {}
        self.records: dict[str, ImageRecord] = {}
        self.ignored: list[tuple[str, str]] = []
        self.interrupted = False
        self.error: str | None = None
        self.lock = OutputLock(self.out)  # held from the scan to the run files (rank 0)
        self.fault: str | None = None  # the first write the output file system refused (why, which file)
        self.unwritten: list[str] = []  # run-level files that could not be written
        self.started = datetime.now(timezone.utc)
        self.input_desc = "bundled examples" if cfg.get("input") is None else str(cfg.input)
        self.files: list[ImageFile] = []
        self.input_root: Path | None = None
        self.gallery: Path | None = None  # index.html, once written
        self.writing = False  # set once the output folder is in use: then run-level files are written
        self.mine: list[ImageFile] = []  # this rank's share of files (all of them in one process)
        self.ranks: list[dict[str, Any]] | None = None  # per-rank summaries (torchrun, rank 0)

    # ------------------------------------------------------------------ entry

    def run(self) -> int:
        """Do the run; returns the exit code."""
        t0 = time.perf_counter()
        code = EXIT_BAD_INPUT
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(warnings.catch_warnings())
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                old_limit = Image.MAX_IMAGE_PIXELS
                if self.max_pixels is not None and (old_limit is None or self.max_pixels > old_limit):
                    Image.MAX_IMAGE_PIXELS = int(self.max_pixels)  # Pillow's check, raised for us
                    stack.callback(setattr, Image, "MAX_IMAGE_PIXELS", old_limit)
                if self.cfg.get("input") is None:
                    root = stack.enter_context(bundled_examples())
                else:
                    root = Path(str(self.cfg.input))
                code = self._run(root)
        except KeyboardInterrupt:
            self.interrupted = True
            code = EXIT_INTERRUPTED
            log.warning("interrupted: finished images are kept; rerun the same command to resume")
        except _OutputFault:
            code = EXIT_FAILED
            self.error = f"cannot write to the output folder: {self.fault}"
        finally:
            self.t.extra["total_s"] = time.perf_counter() - t0
            if self.ctx.distributed:  # torchrun: rank 0 gathers the statuses and records
                code = shard.finish(self, code)
            if self.ctx.is_main and self.writing:
                self._write_summary(code)
                if self.fault is not None and code != EXIT_INTERRUPTED:
                    code = EXIT_FAILED
            self.lock.release()
            if self.ctx.distributed:
                code = shard.agree(code, self.ctx)
        if self.ctx.is_main and self.fault is not None:
            log.error(self._fault_line())
        elif self.gallery is not None:
            print(f"gallery: {self.gallery}", flush=True)  # the last line of a run: open it
        return code

    def _fault_line(self) -> str:
        """The one line of a run the output file system stopped: where, how far it got, how
        to go on, and which run-level files are missing."""
        n_ok = sum(s.status in ("done", "resumed") for s in self.statuses.values())
        line = (f"cannot write to the output folder {str(self.out)!r} ({self.fault}); "
                f"{n_ok} of {len(self.files)} images are finished and complete; "
                "rerun the same command to resume once it can be written")
        if self.unwritten:
            line += f"; {', '.join(self.unwritten)} could not be written either"
        return line

    def _fail(self, msg: str) -> int:
        self.error = msg
        log.error(msg)
        return EXIT_BAD_INPUT

    def _run(self, input_path: Path) -> int:
        ts = time.perf_counter()

        def list_input():
            if self.out.exists() and not self.out.is_dir():
                raise InputError(f"output {str(self.out)!r} exists and is not a folder")
            if input_path.exists() and input_path.resolve() == self.out:
                raise InputError(f"output folder {str(self.out)!r} is the input folder; choose another output")
            listing = find_images(input_path, exclude=[self.out])
            if listing.files:  # one run per output folder, from before the plan reads the records
                try:
                    self.lock.acquire()
                except OSError as e:
                    raise InputError(f"cannot create the output folder {str(self.out)!r}: {e.strerror or e}") from None
                if self.lock.stale is not None:
                    log.warning("took over the output folder's lock from a run that ended without "
                                "giving it back (%s)", self.lock.stale.describe())
            return listing

        try:
            listing = shard.scan(list_input, self.ctx)  # torchrun: rank 0 lists and locks, all get it
        except FolderBusy as e:
            self.error = str(e)
            log.error(self.error)
            return EXIT_BUSY
        except InputError as e:
            return self._fail(str(e))
        self.input_root = listing.root
        self.files = listing.files
        self.ignored = listing.ignored
        self.t.scan_s = time.perf_counter() - ts
        for rel, why in self.ignored:
            log.info("ignored %s: %s", rel, why)
        if not self.files:
            return self._fail(
                f"no images found under {str(listing.root)!r} (looked recursively for "
                f"{', '.join(IMAGE_EXTENSIONS)}; {len(self.ignored)} other files ignored)"
            )
        ts = time.perf_counter()
        self.mine = shard.share(self.files, self.ctx)  # torchrun: every world_size-th image
        todo = self._plan(self.mine)
        self.t.plan_s = time.perf_counter() - ts
        done_before = len(self.mine) - len(todo)
        n = len(self.files)
        done_before -= self.known_bad
        log.info(
            "%s%d image%s %s: %d already done%s, %d to segment%s -> %s",
            f"rank {self.ctx.rank}/{self.ctx.world_size}: {len(self.mine)} of " if self.ctx.distributed else "",
            n, "" if n == 1 else "s",
            f"({input_path})" if input_path.is_file() else f"under {listing.root}", done_before,
            "" if not self.overwrite else " (overwrite=true: redoing all)", len(todo),
            f", {self.known_bad} known-bad file{'' if self.known_bad == 1 else 's'} skipped again (unchanged "
            "since run.json listed them as unreadable; retry_skipped=true reads them again)" if self.known_bad else "",
            self.out,
        )
        if todo:
            ts = time.perf_counter()
            try:
                self._build()
            except Exception as e:  # a model/method that cannot be built stops the run
                log.debug("building the model/method failed", exc_info=True)
                return self._fail(f"cannot build the model or method: {_describe(e)}")
            self.t.model_load_s = time.perf_counter() - ts
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return self._fail(f"cannot create the output folder {str(self.out)!r}: {e.strerror or e}")
        self.writing = True
        if todo:
            ts = time.perf_counter()
            try:
                with single_threaded_rendering():  # the writer threads are the parallelism
                    self._process(todo)
            finally:
                self.t.processing_s = time.perf_counter() - ts
        if self.ctx.distributed:
            return EXIT_OK  # rank 0 decides from every rank's statuses (shard.finish)
        return self._outcome()

    def _outcome(self) -> int:
        """Exit code and closing log line from the statuses of every image."""
        n_ok = sum(s.status in ("done", "resumed") for s in self.statuses.values())
        n_resumed = sum(s.status == "resumed" for s in self.statuses.values())
        n_failed = sum(s.status == "failed" for s in self.statuses.values())
        if n_ok == 0:
            self.error = f"none of the {len(self.files)} images could be processed; see the reasons above and in run.json"
            log.error(self.error)
            return EXIT_NOTHING_DONE
        # the word the per-file warnings and the README use for images that could not be done
        log.info("done: %d segmented, %d resumed, %d skipped%s", n_ok - n_resumed, n_resumed, n_failed,
                 "" if not n_failed else " (reasons in run.json)" if n_failed == self.known_bad
                 else " (reasons above and in run.json)")
        return EXIT_OK

    # ------------------------------------------------------------------ plan / build

    def _plan(self, files: list[ImageFile]) -> list[_Item]:
        """The images to segment: not those with a current record (resume), nor the files
        an earlier run found unreadable that are unchanged since (size and mtime; unless
        ``retry_skipped`` or ``overwrite``)."""
        todo = []
        bad = {} if self.retry_skipped else self._known_unreadable()
        for f in files:
            try:
                st = f.path.stat()
            except OSError as e:
                self.statuses[f.name] = ImageStatus(f.name, f.rel, "failed", f"cannot be read: {e.strerror or e}")
                continue
            item = _Item(file=f, source_bytes=st.st_size, source_mtime_ns=st.st_mtime_ns)
            if not self.overwrite:
                rec = self._current_record(f, st.st_size, st.st_mtime_ns)
                if rec is not None:
                    self.records[f.name] = rec
                    self.statuses[f.name] = ImageStatus(f.name, f.rel, "resumed")
                    continue
            was = bad.get(f.rel)
            if was is not None and (was.get("source_bytes"), was.get("source_mtime_ns")) == (st.st_size, st.st_mtime_ns):
                self.statuses[f.name] = ImageStatus(
                    f.name, f.rel, "failed", str(was.get("reason", "unreadable")), unreadable=True,
                    source_bytes=st.st_size, source_mtime_ns=st.st_mtime_ns, known_bad=True)
                self.known_bad += 1
                continue
            todo.append(item)
        return todo

    def _known_unreadable(self) -> dict[str, dict[str, Any]]:
        """The files the last run.json of this output lists as unreadable (source -> status),
        when it read the same input with the same ``max_pixels`` (which decides some of them)."""
        try:
            man = json.loads((self.out / "run.json").read_text("utf-8"))
            if man.get("input") != str(self.input_root):
                return {}
            if (man.get("config") or {}).get("max_pixels") != self.max_pixels:
                return {}
            return {s["source"]: s for s in man.get("images", []) if s.get("unreadable")}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return {}

    def _current_record(self, f: ImageFile, size: int, mtime_ns: int) -> ImageRecord | None:
        """``f``'s record on disk if it is current (same settings, same source file, every
        output present), else ``None``."""
        rec = load_record(self.out, f.name)
        if not record_is_current(rec, self.out, fingerprint=self.fingerprint, source_bytes=size,
                                 source_mtime_ns=mtime_ns):
            return None
        rec.source_path = str(f.path)  # the input folder may have moved
        return rec

    def _build(self) -> None:
        if self.ctx.distributed:  # torchrun: cuda:LOCAL_RANK (segment.run.shard.init)
            self.device = self.ctx.device
            on_rank = {"device": str(self.device)} if "device" in self.cfg.model else {}
        else:
            self.device = resolve_device(self.cfg.get("device", "auto"))
            on_rank = {}
        self.segmenter = Segmenter.from_config(self.cfg, backbone=self.backbone, method=self.method,
                                               model_overrides=on_rank)
        self.backbone, self.method = self.segmenter.backbone, self.segmenter.method
        dev = torch.device(self.backbone.device)
        # CUDA: loader threads pin each image's pixels, the forward copies them asynchronously
        self.pin_memory = dev.type == "cuda"
        self.input_device = dev
        if self.num_workers == 0:  # a GPU forward is fast: more threads to decode and write
            self.num_workers = max(1, min(16 if dev.type == "cuda" else 4, os.cpu_count() or 1))
        ph, pw = self.backbone.patch_size
        self.min_hw = (int(self.min_size), int(self.min_size)) if self.min_size else (int(ph), int(pw))
        log.info("model %s on %s, method %s", self.backbone.name, self.backbone.device,
                 getattr(self.method, "name", type(self.method).__name__))

    # ------------------------------------------------------------------ stages

    def _load(self, item: _Item) -> _Item:
        """Loader thread: read, check, preprocess one image (errors are kept on the item)."""
        t0 = time.perf_counter()
        try:
            try:
                loaded = read_image(item.file.path, max_pixels=self.max_pixels)
            except ImageReadError:
                item.unreadable = True
                raise
            h, w = loaded.size
            mh, mw = self.min_hw
            if h < mh or w < mw:
                what = f"one {mh}x{mw} patch of {self.backbone.name}" if not self.min_size else f"min_size={self.min_size}"
                raise ImageReadError(item.file.path, f"image is {w}x{h} px, smaller than {what}")
            item.loaded = loaded
            item.pixels = self.segmenter.preprocess(loaded.image)
            if self.pin_memory:  # page-locked, in this thread: the H2D copy needs no staging
                item.pixels = item.pixels.pin_memory()
        except ImageReadError as e:
            item.error = e.reason
        except Exception as e:  # preprocessing of one odd image must not end the run
            item.error = f"preprocessing failed ({_describe(e)})"
        item.read_s = time.perf_counter() - t0
        return item

    def _extract(self, items: list[_Item]) -> AttentionRecord:
        """The attention record of one batch of one preprocessed size (main thread; the
        method thread when it redoes a failed batch image by image: one at a time, as the
        backbone's capture hooks are per model). On CUDA the pinned images are copied
        asynchronously and stacked on the device."""
        pixels = [it.pixels for it in items]
        if self.pin_memory:
            pixels = [p.to(self.input_device, non_blocking=True) for p in pixels]
        with self._extracting:
            return self.segmenter.extract(pixels)

    def _apply(self, items: list[_Item], held: list[AttentionRecord]) -> list[tuple[MethodOutput, int] | str]:
        """Method thread: the method on a batch's record. Returns per image its output and
        index in it, or why the model failed: a batch that fails (e.g. out of memory) is
        redone one image at a time. ``held`` is ``[record]``, emptied here: nothing else
        keeps the record, so a failed batch's memory is free before the retries."""
        t0 = time.perf_counter()
        try:
            out = self.segmenter.apply(held.pop() if held else self._extract(items))
        except Exception as e:
            reason = self._batch_failed(items, e)
            if reason is not None:
                return [reason]
        else:
            return [(out, i) for i in range(len(items))]
        finally:
            self.t.method_s += time.perf_counter() - t0
        return [got for it in items for got in self._apply([it], [])]

    @staticmethod
    def _batch_failed(items: list[_Item], e: Exception) -> str | None:
        """The model failed on ``items``: the reason for a single image, or ``None`` (logged)
        for a batch, which is then redone one image at a time (e.g. out of memory)."""
        if len(items) == 1:
            log.debug("model failed on %s", items[0].file.name, exc_info=True)
            return f"model failed ({_describe(e)})"
        log.warning("a batch of %d failed (%s); retrying one image at a time", len(items), _describe(e))
        return None

    def _write(self, item: _Item, out: MethodOutput, index: int) -> ImageRecord:
        """Writer thread: post-process at the original size, write files and record. Once
        the output file system has refused a write, the images still queued are not
        started (they raise :class:`_OutputFault`: neither done nor failed, a rerun does them)."""
        if self._refused.is_set():
            raise _OutputFault
        loaded = item.loaded
        seg = self.segmenter.postprocess(out, index, loaded.size)
        try:
            return write_image(
                self.out, item.file.name, np.asarray(loaded.image), seg, self.opts,
                source=item.file.rel, source_path=str(item.file.path),
                source_bytes=item.source_bytes, source_mtime_ns=item.source_mtime_ns,
                fingerprint=self.fingerprint, source_mode=loaded.source_mode, notes=list(loaded.notes),
            )
        except OutputWriteError:
            self._refused.set()
            raise

    def _fail_item(self, item: _Item, reason: str, unreadable: bool = False) -> None:
        """``item`` could not be segmented; an ``unreadable`` file keeps its size and mtime
        in run.json, so a rerun skips it while it is unchanged (see ``_plan``)."""
        st = ImageStatus(item.file.name, item.file.rel, "failed", reason)
        if unreadable:
            st.unreadable, st.source_bytes, st.source_mtime_ns = True, item.source_bytes, item.source_mtime_ns
        self.statuses[item.file.name] = st
        log.warning("skipped %s: %s", item.file.path, reason)

    def _progress_bar(self, total: int) -> Any:
        from tqdm import tqdm

        return tqdm(total=total, unit="img", desc="segment", disable=not self.progress, dynamic_ncols=True)

    def _process(self, todo: list[_Item]) -> None:
        """Segment ``todo`` in this process (the loader, method and writer threads around
        the forward in this thread), with a tqdm bar on stderr."""
        from tqdm.contrib.logging import logging_redirect_tqdm

        bar = self._progress_bar(len(todo))
        prefetch = max(2 * self.batch_size, 2 * self.num_workers)
        max_pending_writes = max(2 * self.batch_size, 2 * self.num_workers)
        max_held = 4 * self.batch_size  # images waiting in partly filled batches
        # readers and writers run on one torch thread each (set explicitly: torch.set_num_threads
        # in one thread is also the default of the threads that start later): their work is
        # decoding, resizing and encoding, and a torch pool per writer only adds threads
        # next to the forward. The files are the same at any thread count
        one = dict(initializer=torch.set_num_threads, initargs=(1,))
        loader = ThreadPoolExecutor(self.num_workers, thread_name_prefix="segment-read", **one)
        writer = ThreadPoolExecutor(self.num_workers, thread_name_prefix="segment-write", **one)
        # one method thread, on the run's torch threads: the method of batch i runs while the
        # main thread extracts batch i + 1; one method at a time, so at most two records are held
        methods = ThreadPoolExecutor(1, thread_name_prefix="segment-method", initializer=torch.set_num_threads,
                                     initargs=(torch.get_num_threads(),))
        running: deque[Future] = deque(maxlen=1)
        writes: deque[tuple[_Item, Future]] = deque()  # appended by the method thread
        buckets: OrderedDict[tuple[int, ...], list[_Item]] = OrderedDict()

        def finish_write(item: _Item, fut: Future) -> None:
            """The outcome of one image's write; raises _OutputFault when the output file
            system refused it (the image is then neither done nor failed: a rerun does it)."""
            try:
                rec = fut.result()
            except _ModelFailed as e:
                self._fail_item(item, str(e))
            except OutputWriteError as e:
                log.debug("writing %s failed", item.file.name, exc_info=True)
                if self.fault is None:
                    self.fault = str(e)
                raise _OutputFault from e
            except _OutputFault:  # queued after the refused write: not started
                raise
            except Exception as e:
                log.debug("writing %s failed", item.file.name, exc_info=True)
                self._fail_item(item, f"writing outputs failed ({_describe(e)})")
            else:
                self.records[item.file.name] = rec
                self.t.write_s += rec.seconds
                self.statuses[item.file.name] = ImageStatus(item.file.name, item.file.rel, "done",
                                                        seconds=round(item.read_s + rec.seconds, 4))
            bar.update(1)

        def drain(limit: int) -> None:
            while len(writes) > limit:
                finish_write(*writes.popleft())

        def apply_then_write(items: list[_Item], held: list[AttentionRecord]) -> None:
            for it, got in zip(items, self._apply(items, held)):
                it.pixels = None
                if isinstance(got, str):  # a failure, reported like the writes (main thread)
                    fut: Future = Future()
                    fut.set_exception(_ModelFailed(got))
                else:
                    fut = writer.submit(self._write, it, *got)
                writes.append((it, fut))

        def wait_method() -> None:
            """Until the running method is done; re-raises what ended it (Ctrl-C in it). It
            stays in ``running`` until then, so a Ctrl-C meanwhile still waits for it."""
            if running:
                running[0].result()
                running.clear()

        def run_batch(items: list[_Item]) -> None:
            t0 = time.perf_counter()
            try:
                record = self._extract(items)
            except Exception as e:
                reason = self._batch_failed(items, e)
                if reason is None:
                    for it in items:
                        run_batch([it])
                else:
                    self._fail_item(items[0], reason)
                    bar.update(1)
                return
            finally:
                self.t.model_s += time.perf_counter() - t0
            wait_method()
            running.append(methods.submit(apply_then_write, items, [record]))
            del record  # the method thread holds the only reference
            drain(max_pending_writes)

        def loaded_items() -> Iterator[_Item]:
            pending: deque[Future] = deque()
            it = iter(todo)
            for item in it:
                pending.append(loader.submit(self._load, item))
                if len(pending) >= prefetch:
                    break
            while pending:
                t0 = time.perf_counter()
                got = pending.popleft().result()
                self.t.wait_input_s += time.perf_counter() - t0
                nxt = next(it, None)
                if nxt is not None:
                    pending.append(loader.submit(self._load, nxt))
                yield got

        try:
            with logging_redirect_tqdm():
                for item in loaded_items():
                    if self._refused.is_set():  # a writer met a refused write: stop here
                        drain(0)  # raises _OutputFault at that image's write
                        raise _OutputFault
                    self.t.read_s += item.read_s
                    if item.error is not None:
                        self._fail_item(item, item.error, unreadable=item.unreadable)
                        bar.update(1)
                        continue
                    key = tuple(item.pixels.shape)
                    bucket = buckets.setdefault(key, [])
                    bucket.append(item)
                    if len(bucket) >= self.batch_size:
                        run_batch(buckets.pop(key))
                    elif sum(map(len, buckets.values())) > max_held:  # many sizes: bound memory
                        run_batch(buckets.pop(max(buckets, key=lambda k: len(buckets[k]))))
                for key in list(buckets):
                    if self._refused.is_set():
                        break
                    run_batch(buckets.pop(key))
                wait_method()
                drain(0)
        except (KeyboardInterrupt, _OutputFault):
            # Ctrl-C, or the output file system refused a write: stop reading and computing;
            # images being written are completed (or, refused too, leave none of their files)
            loader.shutdown(wait=False, cancel_futures=True)
            futures.wait(running)  # its batch's outputs join the writes below
            for it, fut in writes:
                if fut.cancel():
                    continue
                with contextlib.suppress(Exception):
                    finish_write(it, fut)
            raise
        finally:
            loader.shutdown(wait=True, cancel_futures=True)
            methods.shutdown(wait=True)
            writer.shutdown(wait=True)
            bar.close()

    # ------------------------------------------------------------------ summary

    def _write_summary(self, code: int) -> None:
        """annotations.json, index.html and run.json from every record of this input."""
        ts = time.perf_counter()
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            log.error("cannot create the output folder %s: %s", self.out, e)
            return
        records = [self.records[f.name] for f in self.files if f.name in self.records]
        failed = [
            {"path": s.source, "reason": s.reason or ""} for s in self.statuses.values() if s.status == "failed"
        ]
        skipped = failed + [{"path": p, "reason": r} for p, r in self.ignored]
        n_new = sum(s.status == "done" for s in self.statuses.values())
        model_name = (self.backbone.name if self.backbone is not None
                      else OmegaConf.select(self.cfg, "model.name", default="?"))
        method_name = getattr(self.method, "name", None) or OmegaConf.select(self.cfg, "method.name", default="?")
        if self.files:
            self._write_run_file("annotations.json", write_coco, records, info={
                "description": f"segment: {model_name} / {method_name}",
                "date_created": self.started.isoformat(timespec="seconds"),
                "version": package_versions(("segment",)).get("segment"),
                "input": str(self.input_root),
            })
            if self._write_run_file(
                "index.html", write_gallery, records, failed=skipped, title=f"segment: {self.out.name}",
                summary=[
                    ("input", str(self.input_root)), ("model", str(model_name)), ("method", str(method_name)),
                    ("images", f"{len(records)} segmented of {len(self.files)}; {len(skipped)} file(s) not used"),
                ],
                thumb_size=self.opts.thumb_size, colormap=self.opts.colormap,
            ):
                self.gallery = self.out / "index.html"
        proc = self.t.processing_s
        timings = self.t.rounded()
        if self.ranks:  # torchrun: the slowest rank's processing time
            proc = max(r["timings"].get("processing_s", 0.0) for r in self.ranks)
        timings["images_per_s"] = round(n_new / proc, 3) if proc > 0 and n_new else None
        self.t.summary_s = time.perf_counter() - ts
        timings["summary_s"] = round(self.t.summary_s, 4)
        statuses = [self.statuses[f.name].as_dict() for f in self.files if f.name in self.statuses]
        manifest = {
            "command": "segment",
            "exit_code": code,
            "error": self.error,
            "interrupted": self.interrupted,
            "started": self.started.isoformat(timespec="seconds"),
            "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "input": str(self.input_root) if self.input_root else self.input_desc,
            "output": str(self.out),
            "model": str(model_name),
            "method": str(method_name),
            "fingerprint": self.fingerprint,
            "counts": {
                "found": len(self.files),
                "segmented": n_new,
                "resumed": sum(s.status == "resumed" for s in self.statuses.values()),
                "failed": len(failed),
                "ignored": len(self.ignored),
            },
            "device": device_info(self.device),
            "timings": timings,
            "config": _cfg_dict(self.cfg),
            "versions": package_versions(),
            "images": statuses,
            "skipped": skipped,
        }
        if self.ranks is not None:  # torchrun: one entry per rank (counts, device, timings)
            manifest["world_size"] = len(self.ranks)
            manifest["ranks"] = self.ranks
        if self.fault is not None and self.error is None:  # it was annotations.json or index.html
            manifest["error"] = f"cannot write to the output folder: {self.fault}"
        if self.fault is not None:
            manifest["exit_code"] = code if code == EXIT_INTERRUPTED else EXIT_FAILED
        self._write_run_file("run.json", write_manifest, manifest)

    def _write_run_file(self, name: str, write: Any, *args: Any, **kwargs: Any) -> bool:
        """``write(self.out / name, ...)``; a refused write is noted (``unwritten``, ``fault``)
        instead of raised, so the other run-level files are still tried."""
        try:
            write(self.out / name, *args, **kwargs)
        except OSError as e:
            log.debug("writing %s failed", name, exc_info=True)
            self.unwritten.append(name)
            if self.fault is None:
                tmp = e.filename is not None and os.fsdecode(e.filename).endswith(".tmp")
                self.fault = str(OutputWriteError(self.out, e, self.out / name if tmp or e.filename is None else None))
            return False
        return True


def run_segment(cfg: DictConfig, **kwargs: Any) -> int:
    """Run ``segment`` with a composed config (``configs/segment.yaml``); returns the exit
    code (see the module docstring). ``kwargs`` go to :class:`SegmentRun`.

    Under ``torchrun`` (``WORLD_SIZE > 1``) this process joins the group and segments its
    share of the images; rank 0 writes the run files (:mod:`segment.run.shard`).
    """
    try:
        ctx = shard.init(cfg.get("device", "auto")) if shard.launched() else shard.DistContext()
    except ValueError as e:  # e.g. device=cuda without CUDA, a bad torchrun environment
        log.error("bad settings: %s", e)
        return EXIT_BAD_INPUT
    try:
        try:
            runner = SegmentRun(cfg, ctx=ctx, **kwargs)
        except (ValueError, TypeError) as e:
            log.error("bad settings: %s", e)
            return shard.agree(EXIT_BAD_INPUT, ctx) if ctx.distributed else EXIT_BAD_INPUT
        return runner.run()
    finally:
        shard.close(ctx)
