"""The ``segment`` job: every image under a folder -> masks, heatmaps, overlays, COCO, gallery.

Flow (:func:`run_segment`; :class:`SegmentRun` orchestrates, the parts are modules)::

    plan (segment.run.job.plan): find_images, the lock, resume: skip images whose record is
        current and unchanged files an earlier run found unreadable
    ──> build the Segmenter (segment.run.api.segmenter: backbone + method; the Python API's object)
    ──> stages (segment.run.job.stages), overlapped:
        loader threads: read + EXIF + RGB + Segmenter.preprocess
        ──> main thread: batches of one preprocessed size -> Segmenter.extract
        ──> method thread: Segmenter.apply on each batch's attention record (batch i
            while the main thread runs the forward of batch i + 1)
        ──> writer threads: Segmenter.postprocess at the original size, files, record
    ──> summary (segment.run.job.summary): annotations.json, index.html, run.json from the
        records of every image, the exit code, the last line

What the run knows is in two dataclasses passed to each part (:mod:`segment.run.job.state`):
:class:`~segment.run.job.state.RunSettings` (the checked run settings) and
:class:`~segment.run.job.state.RunState` (files, statuses, records, timings, faults).
Helper threads run on one torch thread each, so only the forward holds an OpenMP team.
Several processes (CPUs or GPUs, one node or many) are ``torchrun``'s (:mod:`segment.run.job.shard`).

The per-batch computation is :class:`segment.run.api.segmenter.Segmenter`'s, the object ``segment.load``
returns, so the command's masks and the API's are the same computation.

"Done" is recorded per image by ``records/<name>.json``, written after all of that image's
files; an image counts as done when its record exists, was made with the same model and
method config (a fingerprint), the source file has the same size and mtime, and the files
it lists exist. ``annotations.json`` and ``index.html`` are rebuilt from the records at the
end of every run, so a resumed run lists every image of the input. Under ``torchrun`` each
rank runs this flow on its share of the sorted list and rank 0 writes the run-level files
(:mod:`segment.run.job.shard`).

One run per output folder: the run holds ``<output>/.segment.lock`` (its pid and host,
:mod:`segment.run.job.lock`) from the scan to the run files; a second run into the same folder
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
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from PIL import Image

from segment.methods.base import Method
from segment.models.base import Backbone
from segment.run.job import plan, rerun, shard, summary
from segment.run.api.segmenter import Segmenter
from segment.run.front.build import BuildError, build
from segment.run.io import InputError, bundled_examples, no_images_message
from segment.run.job.lock import FolderBusy, OutputLock
from segment.run.api.render import single_threaded_rendering
from segment.run.job.stages import OutputFault, StageRunner, StageSettings, describe
from segment.run.job.state import RunSettings, RunState, config_fingerprint
from segment.utils import (
    EXIT_BAD_INPUT,
    EXIT_BUSY,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    resolve_device,
)

__all__ = ["SegmentRun", "config_fingerprint", "run_segment"]

log = logging.getLogger(__name__)


class SegmentRun:
    """One ``segment`` run (see the module docstring); :func:`run_segment` drives it.

    Args:
        cfg: the composed ``segment`` config.
        backbone: an already built backbone (benchmarks reuse one); default: built from
            ``cfg.model``.
        method: an already built method; default: built from ``cfg.method``.
        ctx: this process's place under torchrun (:mod:`segment.run.job.shard`); default: a single
            process.

    Attributes:
        settings: the checked run settings (:class:`~segment.run.job.state.RunSettings`).
        state: what the run found and did (:class:`~segment.run.job.state.RunState`;
            ``state.timings`` for benchmarks).

    Raises:
        ValueError, TypeError: a bad run setting (:meth:`RunSettings.from_config`).
    """

    def __init__(self, cfg: DictConfig, *, backbone: Backbone | None = None,
                 method: Method | None = None,
                 ctx: shard.DistContext | None = None) -> None:
        self.cfg = cfg
        self.ctx = ctx or shard.DistContext()
        self.settings = RunSettings.from_config(cfg, is_main=self.ctx.is_main)
        self.state = RunState()
        self.backbone = backbone
        self.method = method
        self.segmenter: Segmenter | None = None
        self.stages: StageRunner | None = None  # once the model is built
        self.lock = OutputLock(self.settings.out)  # held from the scan to the run files (rank 0)

    def run(self) -> int:
        """Do the run; returns the exit code."""
        state = self.state
        t0 = time.perf_counter()
        code = EXIT_BAD_INPUT
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(warnings.catch_warnings())
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                old_limit = Image.MAX_IMAGE_PIXELS
                max_pixels = self.settings.max_pixels
                if max_pixels is not None and (old_limit is None or max_pixels > old_limit):
                    Image.MAX_IMAGE_PIXELS = int(max_pixels)  # Pillow's check, raised for us
                    stack.callback(setattr, Image, "MAX_IMAGE_PIXELS", old_limit)
                if self.cfg.get("input") is None:
                    root = stack.enter_context(bundled_examples())
                else:
                    root = Path(str(self.cfg.input))
                code = self._run(root)
        except KeyboardInterrupt:
            state.interrupted = True
            code = EXIT_INTERRUPTED
            log.warning("interrupted: finished images are kept; rerun the same command to resume")
        except OutputFault:
            code = EXIT_FAILED
            state.error = f"cannot write to the output folder: {state.fault}"
        finally:
            state.timings.extra["total_s"] = time.perf_counter() - t0
            if self.ctx.distributed:  # torchrun: rank 0 gathers the statuses and records
                code = shard.finish(state, self.settings, self.ctx, code)
            if self.ctx.is_main and state.writing:
                model_name, method_name = self._names()
                summary.write_summary(state, self.settings, self.cfg, code,
                                      model_name=model_name, method_name=method_name,
                                      default_level=self._default_level())
                if state.fault is not None and code != EXIT_INTERRUPTED:
                    code = EXIT_FAILED
            self.lock.release()
            if self.ctx.distributed:
                code = shard.agree(code, self.ctx)
        summary.final_line(state, self.settings, is_main=self.ctx.is_main)
        return code

    def _fail(self, msg: str) -> int:
        self.state.error = msg
        log.error(msg)
        return EXIT_BAD_INPUT

    def _run(self, input_path: Path) -> int:
        """Scan, plan, build, segment; the exit code so far (rank 0 under torchrun decides
        it from every rank's statuses, :func:`segment.run.job.shard.finish`)."""
        state, out = self.state, self.settings.out
        ts = time.perf_counter()
        try:  # torchrun: rank 0 lists and locks, all get its listing
            listing = shard.scan(lambda: plan.list_input(input_path, out, self.lock), self.ctx)
        except FolderBusy as e:
            state.error = str(e)
            log.error(state.error)
            return EXIT_BUSY
        except InputError as e:
            return self._fail(str(e))
        state.input_root, state.files, state.ignored = listing.root, listing.files, listing.ignored
        state.previous = rerun.previous_run(out)  # read once: the resume plan and the rerun's report
        state.timings.scan_s = time.perf_counter() - ts
        for rel, why in state.ignored:
            log.info("ignored %s: %s", rel, why)
        if not state.files:
            return self._fail(no_images_message(listing))
        limit = self.settings.limit
        if limit is not None and limit < len(state.files):
            log.info("limit=%d: the first %d of %d images (in the run's sorted order)", limit,
                     limit, len(state.files))
            state.files = state.files[:limit]
        ts = time.perf_counter()
        state.mine = shard.share(state.files, self.ctx)  # torchrun: every world_size-th image
        todo = plan.plan_items(state.mine, self.settings, state)
        state.timings.plan_s = time.perf_counter() - ts
        if self.ctx.is_main:
            rerun.log_changes(state, self.settings, self.cfg, [it.file.name for it in todo],
                              prefix=f"rank {self.ctx.rank}/{self.ctx.world_size}: " if self.ctx.distributed else "")
        plan.log_plan(state, self.settings, self.ctx, input_path, todo)
        if todo:
            ts = time.perf_counter()
            try:
                self._build()
            except Exception as e:  # a model/method that cannot be built (or used) stops the run
                log.debug("building the model/method failed", exc_info=True)
                return self._fail(str(e) if isinstance(e, BuildError)
                                  else f"cannot build the model or method: {describe(e)}")
            state.timings.model_load_s = time.perf_counter() - ts
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return self._fail(f"cannot create the output folder {str(out)!r}: {e.strerror or e}")
        if self.ctx.is_main:  # the checks passed: the level folders the change makes stale go
            rerun.remove_stale(state, self.settings)
        state.writing = True
        if todo:
            ts = time.perf_counter()
            try:
                with single_threaded_rendering():  # the writer threads are the parallelism
                    self.stages.run(todo)
            finally:
                state.timings.processing_s = time.perf_counter() - ts
        if self.ctx.distributed:
            return EXIT_OK  # rank 0 decides from every rank's statuses (shard.finish)
        return summary.outcome(state)

    def _build(self) -> None:
        """The Segmenter (backbone and method) on this process's device, and the stage
        runner for it."""
        s = self.settings
        if self.ctx.distributed:  # torchrun: cuda:LOCAL_RANK (segment.run.job.shard.init)
            self.state.device = self.ctx.device
            on_rank = {"device": str(self.state.device)} if "device" in self.cfg.model else {}
        else:
            self.state.device = resolve_device(self.cfg.get("device", "auto"))
            on_rank = {}
        self.segmenter = Segmenter.from_config(self.cfg, backbone=self.backbone, method=self.method,
                                               model_overrides=on_rank)
        self.backbone, self.method = self.segmenter.backbone, self.segmenter.method
        dev = torch.device(self.backbone.device)
        # a GPU forward is fast: more threads to decode and write
        num_workers = s.num_workers or max(1, min(16 if dev.type == "cuda" else 4, os.cpu_count() or 1))
        ph, pw = self.backbone.patch_size
        self.stages = StageRunner(self.segmenter, StageSettings(
            out=s.out, opts=s.opts, fingerprint=s.fingerprint, batch_size=s.batch_size,
            num_workers=num_workers, max_pixels=s.max_pixels, min_size=s.min_size,
            min_hw=(int(s.min_size), int(s.min_size)) if s.min_size else (int(ph), int(pw)),
            # CUDA: loader threads pin each image's pixels, the forward copies them asynchronously
            pin_memory=dev.type == "cuda", input_device=dev, progress=s.progress,
        ), self.state)
        log.info("model %s on %s, method %s", self.backbone.name, self.backbone.device,
                 self.segmenter.method.name)

    def _names(self) -> tuple[str, str]:
        """The model's and the method's names for the run files (from the config when the
        model was not built: nothing to do, or it failed)."""
        model_name = (self.backbone.name if self.backbone is not None
                      else OmegaConf.select(self.cfg, "model.name", default="?"))
        method_name = (self.method.name if self.method is not None
                       else OmegaConf.select(self.cfg, "method.name", default="?"))
        return model_name, method_name

    def _default_level(self) -> float | None:
        """The method's default level of its hierarchy for the gallery's slider
        (``Method.default_level``; from the config when the run built no method: nothing to
        do, or it failed)."""
        method = self.method
        if method is None:
            try:
                method = build(self.cfg.method, Method, "the method")
            except Exception:  # the run reports why it could not build it
                return None
        return method.default_level


def run_segment(cfg: DictConfig, **kwargs: Any) -> int:
    """Run ``segment`` with a composed config (``configs/segment.yaml``); returns the exit
    code (see the module docstring). ``kwargs`` go to :class:`SegmentRun`.

    Under ``torchrun`` (``WORLD_SIZE > 1``) this process joins the group and segments its
    share of the images; rank 0 writes the run files (:mod:`segment.run.job.shard`).
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
