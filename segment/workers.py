"""``segment`` on the CPU in several worker processes, each on its share of whole batches.

On a CPU the forward runs on ``T`` torch threads, and every operator waits at a barrier for
its slowest thread; the reader, method and writer threads that work next to it take cores
from those threads (:class:`segment.pipeline.CoreSharing`). ``P`` worker processes with
``T / P`` torch threads each have fewer barriers to wait at (none at all on two cores: one
thread each), and nothing of one process waits for the other. On the 2-core development
machines this made 5-14% more images/s than one process on both threads, with the same
files (``eval/results/bench/HISTORY.md``).

How a run is split (:func:`run_in_processes`):

- the images to do are cut into batches of ``batch_size`` in the run's order, and batch
  ``k`` goes to process ``k % P``: with one preprocessed size and no unreadable file each
  batch holds the same images as in one process, so the records, and every file, are the
  same bytes (the forward gives the same values at any thread count,
  ``tests/test_pipeline.py``);
- the processes are forked after the model is built: they share its weights (copy on
  write) and start in milliseconds. Each runs :meth:`SegmentRun._process` on its share
  and writes its images' files itself (each file atomic, each record last, as always);
- the parent shows one progress bar, logs what the workers log (through a pipe, so the
  bar and ``cli.log`` stay in one piece), then gathers every image's status, record and
  timings and writes the run files as a single process does;
- Ctrl-C reaches the parent only (the workers ignore SIGINT); it asks each worker to stop
  (SIGTERM, which a worker turns into the same KeyboardInterrupt as a one-process run:
  files being written are finished), waits for them and ends the run with exit code 130.
  A worker that dies (e.g. killed for memory) loses only its images in flight: those
  whose record it wrote count as done, the others are listed as skipped with the reason.

Only on the CPU (a forked process cannot use a CUDA context made before the fork; several
GPUs are torchrun's, :mod:`segment.shard`), and only where ``fork`` is the safe way to start
a process (Linux).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from segment.pipeline import SegmentRun, _Item

log = logging.getLogger("segment.pipeline")

AUTO_PROCESSES = 2  # the number measured; more processes than 2 were not measured


def can_fork() -> bool:
    """Whether worker processes can be started here (Linux, where ``fork`` is safe)."""
    return sys.platform.startswith("linux") and "fork" in mp.get_all_start_methods()


def choose_processes(setting: Any, *, device: torch.device, distributed: bool, threads: int,
                     todo: int, batch_size: int) -> int:
    """The number of worker processes of a run (1: the run's own process does the work).

    Args:
        setting: the ``processes`` setting: ``None`` = automatic (2 on a CPU with at least
            2 torch threads and at least 2 batches to do, on Linux; else 1), or a whole
            number >= 1.
        device: where the model runs.
        distributed: whether this is one rank of a torchrun job.
        threads: the run's torch threads.
        todo: images to segment.
        batch_size: images per batch.

    Raises:
        ValueError: more than one process asked for where none can be started: on CUDA,
            under torchrun, or without ``fork``.
    """
    batches = -(-todo // max(1, batch_size))
    if setting is None:
        if device.type != "cpu" or distributed or not can_fork() or threads < 2 or batches < 2:
            return 1
        return AUTO_PROCESSES
    n = int(setting)
    if n > 1:
        if device.type != "cpu":
            raise ValueError(f"processes={n}: worker processes run on the CPU only (the model is on "
                             f"{device}); for several GPUs use torchrun (see the README)")
        if distributed:
            raise ValueError(f"processes={n}: under torchrun each rank is one process; leave processes unset")
        if not can_fork():
            raise ValueError(f"processes={n}: worker processes need Linux (fork); use processes=1 here")
    return max(1, min(n, batches))


def share_batches(todo: list[_Item], processes: int, batch_size: int) -> list[list[_Item]]:
    """``todo`` cut into batches of ``batch_size`` in order, batch ``k`` to process
    ``k % processes``; empty shares are left out."""
    shares: list[list[_Item]] = [[] for _ in range(processes)]
    for k, start in enumerate(range(0, len(todo), batch_size)):
        shares[k % processes].extend(todo[start: start + batch_size])
    return [s for s in shares if s]


class _PipeBar:
    """A worker's progress bar: each ``update`` goes to the parent's bar."""

    def __init__(self, send: Any) -> None:
        self.send = send

    def update(self, n: int = 1) -> None:
        self.send(("n", n))

    def close(self) -> None:
        pass


class _PipeHandler(logging.Handler):
    """A worker's log records, sent to the parent, which logs them (its console and
    ``cli.log``)."""

    def __init__(self, send: Any) -> None:
        super().__init__(logging.NOTSET)
        self.send = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
            if record.exc_info:
                msg += "\n" + logging.Formatter().formatException(record.exc_info)
            self.send(("log", record.levelno, record.name, msg))
        except Exception:  # a closed pipe: the parent is gone; nothing to tell
            pass


class _Stop:
    """A worker's SIGTERM (the parent's "stop", after Ctrl-C) becomes the same
    KeyboardInterrupt as Ctrl-C in a one-process run, so the run's own handling finishes
    the files being written. Never in the middle of a message to the parent (the pipe
    would be left with half a message): then it waits until the message is out."""

    def __init__(self) -> None:
        self.sending = False  # the main thread is writing to the pipe
        self.pending = False

    def __call__(self, signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # once; a second SIGTERM ends the worker
        if self.sending:
            self.pending = True
            return
        raise KeyboardInterrupt

    def after_send(self) -> None:
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt


def _stop_with_parent() -> None:
    """Ask Linux to send this worker SIGTERM when the parent dies (killed, say): the worker
    then stops as after Ctrl-C instead of running on alone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not glibc/Linux: the worker ends with its share
        return
    parent = mp.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before the request
        os._exit(1)


def _worker(run: SegmentRun, share: list[_Item], conn: Connection, threads: int) -> None:
    """A forked worker's whole life: segment ``share``, send back what happened."""
    from segment.pipeline import _describe, _Timings

    stop = _Stop()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGTERM, stop)
    _stop_with_parent()
    lock = threading.Lock()  # the worker's threads share the pipe

    def send(msg: Any) -> None:
        main = threading.current_thread() is threading.main_thread()  # where handlers run
        with lock:
            stop.sending = main
            try:
                conn.send(msg)
            finally:
                stop.sending = False
        if main:
            stop.after_send()

    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(_PipeHandler(send))
    # the method splits batches as the run's own thread count would, one half after the
    # other on this worker's thread (Segmenter.apply): the same values, so the same files
    run.method_halves = torch.get_num_threads() >= 2
    torch.set_num_threads(threads)
    run.statuses, run.records, run.t = {}, {}, _Timings()
    state = "done"
    try:
        run._process(share, bar=_PipeBar(send))
    except KeyboardInterrupt:
        state = "interrupted"
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which goes on
        log.debug("worker failed", exc_info=True)
        state = f"failed ({_describe(e)})"
    try:
        send(("result", state, run.statuses, run.records, run.t))
    except KeyboardInterrupt:  # the stop came while the result went out (whole): too late
        pass
    finally:
        conn.close()


@dataclass
class _Worker:
    index: int
    proc: Any
    conn: Connection
    share: list
    result: tuple | None = None


def run_in_processes(run: SegmentRun, todo: list[_Item], processes: int) -> None:
    """Segment ``todo`` in ``processes`` forked workers (see the module docstring); their
    statuses, records and timings join ``run``'s. Raises KeyboardInterrupt after Ctrl-C,
    once every worker has stopped, as :meth:`SegmentRun._process` does."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    from segment.pipeline import _Status

    threads = max(1, torch.get_num_threads() // processes)
    shares = share_batches(todo, processes, run.batch_size)
    ctx = mp.get_context("fork")
    workers: list[_Worker] = []
    main = threading.current_thread() is threading.main_thread()
    finished = False
    try:
        for i, share in enumerate(shares):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, args=(run, share, send, threads), name=f"segment-worker-{i}",
                               daemon=True)
            # the worker is born ignoring Ctrl-C (no window before it sets that itself)
            old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
            try:
                proc.start()
            finally:
                if main:
                    signal.signal(signal.SIGINT, old)
            send.close()
            workers.append(_Worker(i, proc, recv, share))
        log.info("%d worker processes on %d torch thread%s each", len(workers), threads, "" if threads == 1 else "s")
        bar = run._progress_bar(len(todo))
        try:
            with logging_redirect_tqdm():
                interrupted = _collect(workers, bar)
        finally:
            bar.close()
        finished = True
    finally:
        if not finished:  # an error or a second Ctrl-C here: no worker is left behind
            for w in workers:
                if w.proc.is_alive():
                    w.proc.terminate()
        for w in workers:  # every worker has closed its pipe (or been stopped): it is ending
            w.proc.join(None if finished else 30)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join()
    for w in workers:
        if w.result is None:
            code = w.proc.exitcode
            why = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            log.error("worker process %d ended unexpectedly (%s); images it had not finished are skipped",
                      w.index, why)
            state = f"worker process {w.index} ended unexpectedly ({why})"
        else:
            state, statuses, records, t = w.result
            run.statuses.update(statuses)
            run.records.update(records)
            for k in ("read_s", "model_s", "method_s", "write_s", "wait_input_s"):
                setattr(run.t, k, getattr(run.t, k) + getattr(t, k))
            if state == "interrupted":
                interrupted = True
            elif state != "done":
                log.error("worker process %d stopped: %s; images it had not finished are skipped",
                          w.index, state)
        for it in w.share:  # what the worker did not report: its record on disk decides
            if it.file.name in run.statuses:
                continue
            rec = run._current_record(it.file, it.source_bytes, it.source_mtime_ns)
            if rec is not None:
                run.records[it.file.name] = rec
                run.statuses[it.file.name] = _Status(it.file.name, it.file.rel, "done")
            elif state not in ("done", "interrupted"):
                run.statuses[it.file.name] = _Status(it.file.name, it.file.rel, "failed", state)
    if interrupted:
        raise KeyboardInterrupt


def _collect(workers: list[_Worker], bar: Any) -> bool:
    """Relay the workers' progress and log lines until each has sent its result and
    closed its pipe; returns whether the run was interrupted.

    Ctrl-C here is noted, not raised (a message half read would leave the pipe out of
    step): each live worker is then asked once to stop, and their results are still
    awaited. A second Ctrl-C stops the waiting.
    """
    pending = {w.conn: w for w in workers}
    asked = [0]

    def on_ctrl_c(signum: int, frame: Any) -> None:
        asked[0] += 1
        if asked[0] > 1:
            raise KeyboardInterrupt

    main = threading.current_thread() is threading.main_thread()  # else no Ctrl-C comes here
    old = signal.signal(signal.SIGINT, on_ctrl_c) if main else None
    stopping = False
    try:
        while pending:
            if asked[0] and not stopping:
                stopping = True
                for w in pending.values():
                    if w.proc.is_alive():
                        w.proc.terminate()  # SIGTERM: the worker's KeyboardInterrupt
            for conn in wait(list(pending), timeout=0.2):
                w = pending[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):  # the worker is gone
                    del pending[conn]
                    conn.close()
                    continue
                if msg[0] == "n":
                    bar.update(msg[1])
                elif msg[0] == "log":
                    logging.getLogger(msg[2]).log(msg[1], "%s", msg[3])
                elif msg[0] == "result":
                    w.result = tuple(msg[1:])
    finally:
        if main:
            signal.signal(signal.SIGINT, old)
    return asked[0] > 0
