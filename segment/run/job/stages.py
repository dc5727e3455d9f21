"""The stage runner of a ``segment`` run: read -> extract -> method -> write.

:class:`StageRunner` takes the planned :class:`~segment.run.job.plan.Item` s through four stages
with explicit hand-offs between them::

    loader threads  read, EXIF, RGB, Segmenter.preprocess        -> reads (read-ahead window)
    main thread     batches of one preprocessed size (buckets), Segmenter.extract
                                                                  -> method (one in flight)
    method thread   Segmenter.apply on the batch's record         -> writes (one future per image)
    writer threads  Segmenter.postprocess at the original size, files, record
    main thread     drains writes: status, record and timing of each image into the RunState

The method of batch *i* runs while the main thread extracts batch *i + 1*; at most two
attention records are held. Helper threads run on one torch thread each, so only the
forward and the method hold OpenMP teams. A write the output file system refuses stops the
stages (:class:`OutputFault`): the images still queued are not started, those being written
are completed or leave none of their files.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from segment.core.masks import MethodOutput
from segment.core.record import AttentionRecord
from segment.run.api.segmenter import Segmenter
from segment.run.io import ImageReadError, read_image
from segment.run.api.render import RenderOptions
from segment.run.job.manifest import ImageStatus
from segment.run.job.records import ImageRecord, OutputWriteError, write_image
from segment.run.job.plan import Item
from segment.run.job.state import RunState
from segment.utils import set_thread_torch_threads, unwrap_instantiation

__all__ = ["ModelFailed", "OutputFault", "StageRunner", "StageSettings", "describe"]

log = logging.getLogger("segment.run.job.pipeline")  # the run's lines keep one logger name


class ModelFailed(Exception):
    """The model or method could not run on an image (the message says why)."""


class OutputFault(Exception):
    """The output folder's file system refused a write: the run stops (``RunState.fault``
    says which write and why)."""


def describe(e: BaseException) -> str:
    """One line for an exception, unwrapping Hydra's instantiation wrapper."""
    e = unwrap_instantiation(e)
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


@dataclass(frozen=True)
class StageSettings:
    """What the stages need to know, fixed once the model is built.

    Attributes:
        out: the output folder.
        opts: how the per-image files look.
        fingerprint: the config's fingerprint, written into each record.
        batch_size: images per forward pass.
        num_workers: loader threads and writer threads (each).
        max_pixels: refuse larger images.
        min_size: refuse images with a smaller side (``None``: ``min_hw`` is one patch).
        min_hw: the smallest image ``(H, W)`` the model takes.
        pin_memory: loader threads pin the pixels (the backbone is on CUDA).
        input_device: where the backbone wants its pixels.
        progress: show a tqdm bar on stderr.
    """

    out: Path
    opts: RenderOptions
    fingerprint: str
    batch_size: int
    num_workers: int
    max_pixels: Any
    min_size: Any
    min_hw: tuple[int, int]
    pin_memory: bool
    input_device: torch.device
    progress: bool


class StageRunner:
    """Segment the planned items of this process into ``settings.out`` (see the module
    docstring); what becomes of each image goes into ``state`` (statuses, records, timings,
    and ``fault`` when the output file system refuses a write). Use once: :meth:`run`."""

    def __init__(self, segmenter: Segmenter, settings: StageSettings, state: RunState) -> None:
        self.segmenter = segmenter
        self.settings = settings
        self.state = state
        self.extracting = threading.Lock()  # one capture at a time (the hooks are per model)
        self.refused = threading.Event()  # a writer met a refused write: start nothing new
        bs, nw = settings.batch_size, settings.num_workers
        self.prefetch = max(2 * bs, 2 * nw)  # images read ahead
        self.max_pending_writes = max(2 * bs, 2 * nw)
        self.max_held = 4 * bs  # images waiting in partly filled batches
        # the hand-offs between the stages
        self.reads: deque[Future[Item]] = deque()  # loader -> main: read and preprocessed
        self.buckets: OrderedDict[tuple[int, ...], list[Item]] = OrderedDict()  # by preprocessed size
        self.method: deque[Future[None]] = deque(maxlen=1)  # main -> method thread: one batch
        self.writes: deque[tuple[Item, Future[ImageRecord]]] = deque()  # method thread -> main
        self.bar: Any = None
        self.loader: ThreadPoolExecutor | None = None
        self.writer: ThreadPoolExecutor | None = None
        self.methods: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ the loop

    def run(self, todo: list[Item]) -> None:
        """Segment ``todo`` (the loader, method and writer threads around the forward in this
        thread), with a tqdm bar on stderr.

        Raises:
            OutputFault: the output file system refused a write (``state.fault`` says which).
            KeyboardInterrupt: Ctrl-C; the images being written are completed first.
        """
        from tqdm.contrib.logging import logging_redirect_tqdm

        self.bar = self._progress_bar(len(todo))
        nw = self.settings.num_workers
        # readers and writers run on one torch thread each (set explicitly: torch.set_num_threads
        # in one thread is also the default of the threads that start later): their work is
        # decoding, resizing and encoding, and a torch pool per writer only adds threads
        # next to the forward. The files are the same at any thread count
        one = dict(initializer=set_thread_torch_threads, initargs=(1,))
        self.loader = ThreadPoolExecutor(nw, thread_name_prefix="segment-read", **one)
        self.writer = ThreadPoolExecutor(nw, thread_name_prefix="segment-write", **one)
        # one method thread, on the run's torch threads: the method of batch i runs while the
        # main thread extracts batch i + 1; one method at a time, so at most two records are held
        self.methods = ThreadPoolExecutor(1, thread_name_prefix="segment-method",
                                          initializer=set_thread_torch_threads,
                                          initargs=(torch.get_num_threads(),))
        try:
            with logging_redirect_tqdm():
                for item in self._loaded(todo):
                    if self.refused.is_set():  # a writer met a refused write: stop here
                        self._drain(0)  # raises OutputFault at that image's write
                        raise OutputFault
                    self.state.timings.read_s += item.read_s
                    if item.error is not None:
                        self._fail_item(item, item.error, unreadable=item.unreadable)
                        self.bar.update(1)
                        continue
                    batch = self._add(item)
                    if batch is not None:
                        self._run_batch(batch)
                for key in list(self.buckets):
                    if self.refused.is_set():
                        break
                    self._run_batch(self.buckets.pop(key))
                self._wait_method()
                self._drain(0)
        except (KeyboardInterrupt, OutputFault):
            self._stop()
            raise
        finally:
            self.loader.shutdown(wait=True, cancel_futures=True)
            self.methods.shutdown(wait=True)
            self.writer.shutdown(wait=True)
            self.bar.close()

    def _progress_bar(self, total: int) -> Any:
        from tqdm import tqdm

        return tqdm(total=total, unit="img", desc="segment", disable=not self.settings.progress, dynamic_ncols=True)

    def _loaded(self, todo: list[Item]) -> Iterator[Item]:
        """The items of ``todo`` in order, read by the loader threads ``prefetch`` ahead."""
        it = iter(todo)
        for item in it:
            self.reads.append(self.loader.submit(self._load, item))
            if len(self.reads) >= self.prefetch:
                break
        while self.reads:
            t0 = time.perf_counter()
            got = self.reads.popleft().result()
            self.state.timings.wait_input_s += time.perf_counter() - t0
            nxt = next(it, None)
            if nxt is not None:
                self.reads.append(self.loader.submit(self._load, nxt))
            yield got

    def _add(self, item: Item) -> list[Item] | None:
        """Put a read item in the bucket of its preprocessed size; returns a batch to run:
        a full bucket, or the fullest one when too many images wait (many sizes: bound memory)."""
        key = tuple(item.pixels.shape)
        bucket = self.buckets.setdefault(key, [])
        bucket.append(item)
        if len(bucket) >= self.settings.batch_size:
            return self.buckets.pop(key)
        if sum(map(len, self.buckets.values())) > self.max_held:
            return self.buckets.pop(max(self.buckets, key=lambda k: len(self.buckets[k])))
        return None

    def _run_batch(self, items: list[Item]) -> None:
        """Main thread: the forward of one batch, then its method handed to the method thread
        (after the previous batch's), then the writes drained down to their bound. A batch
        the model fails on is redone one image at a time."""
        t0 = time.perf_counter()
        try:
            record = self._extract(items)
        except Exception as e:
            reason = self._batch_failed(items, e)
            if reason is None:
                for it in items:
                    self._run_batch([it])
            else:
                self._fail_item(items[0], reason)
                self.bar.update(1)
            return
        finally:
            self.state.timings.model_s += time.perf_counter() - t0
        self._wait_method()
        self.method.append(self.methods.submit(self._apply_then_write, items, [record]))
        del record  # the method thread holds the only reference
        self._drain(self.max_pending_writes)

    def _wait_method(self) -> None:
        """Until the running method is done; re-raises what ended it (Ctrl-C in it). It
        stays in ``method`` until then, so a Ctrl-C meanwhile still waits for it."""
        if self.method:
            self.method[0].result()
            self.method.clear()

    def _apply_then_write(self, items: list[Item], held: list[AttentionRecord]) -> None:
        """Method thread: the method on a batch, then one write per image handed to the
        writer threads (a failed image gets a failed future: reported like the writes)."""
        for it, got in zip(items, self._apply(items, held)):
            it.pixels = None
            if isinstance(got, str):
                fut: Future = Future()
                fut.set_exception(ModelFailed(got))
            else:
                fut = self.writer.submit(self._write, it, *got)
            self.writes.append((it, fut))

    def _drain(self, limit: int) -> None:
        """Main thread: finish the oldest writes until at most ``limit`` are pending."""
        while len(self.writes) > limit:
            self._finish_write(*self.writes.popleft())

    def _finish_write(self, item: Item, fut: Future) -> None:
        """The outcome of one image's write; raises OutputFault when the output file
        system refused it (the image is then neither done nor skipped: a rerun does it)."""
        state = self.state
        try:
            rec = fut.result()
        except ModelFailed as e:
            self._fail_item(item, str(e))
        except OutputWriteError as e:
            log.debug("writing %s failed", item.file.name, exc_info=True)
            if state.fault is None:
                state.fault = str(e)
            raise OutputFault from e
        except OutputFault:  # queued after the refused write: not started
            raise
        except Exception as e:
            log.debug("writing %s failed", item.file.name, exc_info=True)
            self._fail_item(item, f"writing outputs failed ({describe(e)})")
        else:
            state.records[item.file.name] = rec
            state.timings.write_s += rec.seconds
            state.statuses[item.file.name] = ImageStatus.finished(
                rec, "done", seconds=round(item.read_s + rec.seconds, 4))
        self.bar.update(1)

    def _stop(self) -> None:
        """After Ctrl-C, or a write the output file system refused: stop reading and
        computing; the images being written are completed (or, refused too, leave none of
        their files)."""
        self.loader.shutdown(wait=False, cancel_futures=True)
        futures.wait(self.method)  # its batch's outputs join the writes below
        for it, fut in self.writes:
            if fut.cancel():
                continue
            with contextlib.suppress(Exception):
                self._finish_write(it, fut)

    # ------------------------------------------------------------------ the stages

    def _load(self, item: Item) -> Item:
        """Loader thread: read, check, preprocess one image (errors are kept on the item)."""
        s = self.settings
        t0 = time.perf_counter()
        try:
            try:
                loaded = read_image(item.file.path, max_pixels=s.max_pixels)
            except ImageReadError:
                item.unreadable = True
                raise
            h, w = loaded.size
            mh, mw = s.min_hw
            if h < mh or w < mw:
                what = (f"one {mh}x{mw} patch of {self.segmenter.backbone.name}" if not s.min_size
                        else f"min_size={s.min_size}")
                item.unreadable = True  # the file's own size: skipped again while it and the settings are unchanged
                raise ImageReadError(item.file.path, f"image is {w}x{h} px, smaller than {what}")
            item.loaded = loaded
            item.pixels = self.segmenter.preprocess(loaded.image)
            if s.pin_memory:  # page-locked, in this thread: the H2D copy needs no staging
                item.pixels = item.pixels.pin_memory()
        except ImageReadError as e:
            item.error = e.reason
        except Exception as e:  # preprocessing of one odd image must not end the run
            item.error = f"preprocessing failed ({describe(e)})"
        item.read_s = time.perf_counter() - t0
        return item

    def _extract(self, items: list[Item]) -> AttentionRecord:
        """The attention record of one batch of one preprocessed size (main thread; the
        method thread when it redoes a failed batch image by image: one at a time, as the
        backbone's capture hooks are per model). On CUDA the pinned images are copied
        asynchronously and stacked on the device."""
        pixels = [it.pixels for it in items]
        if self.settings.pin_memory:
            pixels = [p.to(self.settings.input_device, non_blocking=True) for p in pixels]
        with self.extracting:
            return self.segmenter.extract(pixels)

    def _apply(self, items: list[Item], held: list[AttentionRecord]) -> list[tuple[MethodOutput, int] | str]:
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
            self.state.timings.method_s += time.perf_counter() - t0
        return [got for it in items for got in self._apply([it], [])]

    @staticmethod
    def _batch_failed(items: list[Item], e: Exception) -> str | None:
        """The model failed on ``items``: the reason for a single image, or ``None`` (logged)
        for a batch, which is then redone one image at a time (e.g. out of memory)."""
        if len(items) == 1:
            log.debug("model failed on %s", items[0].file.name, exc_info=True)
            return f"model failed ({describe(e)})"
        log.warning("a batch of %d failed (%s); retrying one image at a time", len(items), describe(e))
        return None

    def _write(self, item: Item, out: MethodOutput, index: int) -> ImageRecord:
        """Writer thread: post-process at the original size, write files and record. Once
        the output file system has refused a write, the images still queued are not
        started (they raise :class:`OutputFault`: neither done nor skipped, a rerun does them)."""
        if self.refused.is_set():
            raise OutputFault
        s = self.settings
        loaded = item.loaded
        seg = self.segmenter.postprocess(out, index, loaded.size)
        try:
            return write_image(
                s.out, item.file.name, np.asarray(loaded.image), seg, s.opts,
                source=item.file.rel, source_path=str(item.file.path),
                source_bytes=item.source_bytes, source_mtime_ns=item.source_mtime_ns,
                fingerprint=s.fingerprint, source_mode=loaded.source_mode, notes=list(loaded.notes),
            )
        except OutputWriteError:
            self.refused.set()
            raise

    def _fail_item(self, item: Item, reason: str, unreadable: bool = False) -> None:
        """``item`` could not be segmented; a file refused for itself (``unreadable``: not an
        image, corrupt, too large or too small) keeps its size and mtime in run.json, so a
        rerun skips it while it and the refusing settings are unchanged (see
        :func:`segment.run.job.plan.plan_items`)."""
        st = ImageStatus(item.file.name, item.file.rel, "skipped", reason)
        if unreadable:
            st.unreadable, st.source_bytes, st.source_mtime_ns = True, item.source_bytes, item.source_mtime_ns
        self.state.statuses[item.file.name] = st
        log.warning("skipped %s: %s", item.file.path, reason)
