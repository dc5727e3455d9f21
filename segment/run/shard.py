"""``segment`` under ``torchrun``: each rank segments its share, rank 0 merges the run files.

``torchrun --nproc_per_node=K -m segment input=DIR output=OUT`` (multi-node: torchrun's
``--nnodes``/``--rdzv_*`` flags) starts K processes; each one:

1. joins a **gloo** process group (:func:`init`; the ranks exchange only small Python
   objects, so gloo serves CPU and CUDA runs alike and no NCCL watchdog fires while a slow
   rank finishes; each rank computes on ``cuda:LOCAL_RANK``);
2. gets rank 0's listing of the input (:func:`scan`: one scan, so every rank sees the same
   sorted file list even if the folder changes meanwhile); rank 0 also takes the output
   folder's lock (:mod:`segment.run.lock`) for the whole run: its ranks are one run;
3. takes every K-th image of that sorted list (:func:`share`, :func:`segment.run.dist.shard`)
   and plans, segments and writes it exactly like a single process: every per-image file
   and its ``records/<name>.json`` are written by the rank that made them;
4. sends its statuses and timings to rank 0 (:func:`merge`), which reads the **records on
   disk** of every image it did not make itself, so ``annotations.json`` (image and
   annotation ids in sorted-list order, as in a single-process run), ``index.html`` and
   ``run.json`` list every image done by any rank or any earlier run.

Resume is per image (records), so a rerun may use another number of ranks; an interrupted
rank loses only the images it had not finished, and the rerun completes them. A rank whose
writes the output file system refuses (a full disk) stops; rank 0 reports it in the run's
one error line and the run exits 1, and a rerun completes the rest. The output
folder must be on a file system that every node sees (as on a cluster).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from segment.run import dist
from segment.run.dist import DistContext
from segment.run.io import InputError
from segment.utils import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK

T = TypeVar("T")
log = logging.getLogger(__name__)

__all__ = ["DistContext", "RankReport", "launched", "init", "close", "scan", "share", "merge", "finish", "agree"]

DEFAULT_TIMEOUT_S = 7 * 24 * 3600.0
"""How long a rank waits for the others at the start (the scan) and the end (the merge):
ranks finish their shares at different times, and a run over millions of images may take
days. A rank that dies makes torchrun stop the others, so nobody waits that long for it."""


def launched() -> bool:
    """Whether torchrun started more than one process (``WORLD_SIZE > 1``)."""
    return dist.env_int("WORLD_SIZE", 1) > 1


def init(device: Any = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> DistContext:
    """Join the process group when launched by torchrun (``WORLD_SIZE > 1``); a single
    process gets ``DistContext(device=...)``. Always gloo (see the module docstring)."""
    return dist.init(device, backend="gloo", timeout_s=timeout_s)


def close(ctx: DistContext) -> None:
    dist.close(ctx)


def scan(list_input: Callable[[], T], ctx: DistContext) -> T:
    """``list_input()`` on rank 0, its result (or its :class:`~segment.run.io.InputError`) on
    every rank."""
    if not ctx.distributed:
        return list_input()
    got: tuple[str, Any] = ("ok", None)
    if ctx.is_main:
        try:
            got = ("ok", list_input())
        except InputError as e:  # the same error (FolderBusy...) on every rank
            got = ("error", e)
    kind, value = dist.broadcast(got, ctx)
    if kind == "error":
        raise value
    return value


def share(items: Sequence[T], ctx: DistContext) -> list[T]:
    """This rank's images: every ``world_size``-th of the sorted list, from ``rank``."""
    return dist.shard(items, ctx)


@dataclass
class RankReport:
    """What one rank tells rank 0 at the end.

    Attributes:
        rank: the rank.
        images: how many images were its share.
        statuses: the per-image statuses of its share (``name`` -> status dict of
            :class:`segment.run.outputs.ImageStatus`).
        timings: its stage timings (seconds).
        device: its device description.
        interrupted: it stopped on Ctrl-C.
        error: its run-level error, if any.
        fault: the write its output file system refused, if any (the run stops).
    """

    rank: int
    images: int
    statuses: dict[str, dict[str, Any]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    device: dict[str, Any] = field(default_factory=dict)
    interrupted: bool = False
    error: str | None = None
    fault: str | None = None

    def summary(self) -> dict[str, Any]:
        """The rank's line in ``run.json``: counts, timings, device (no per-image list)."""
        count = lambda s: sum(v["status"] == s for v in self.statuses.values())  # noqa: E731
        return {
            "rank": self.rank, "images": self.images, "segmented": count("done"),
            "resumed": count("resumed"), "failed": count("failed"), "interrupted": self.interrupted,
            "error": self.error, "device": self.device, "timings": self.timings,
        }


def merge(report: RankReport, ctx: DistContext) -> list[RankReport] | None:
    """Every rank's report on rank 0 (rank order); ``None`` on the other ranks."""
    return dist.gather(report, ctx)


def finish(run: Any, code: int) -> int:
    """End of a distributed :class:`segment.run.pipeline.SegmentRun` (every rank calls it).

    Every rank sends its statuses and timings to rank 0 (:func:`merge`). Rank 0 takes the
    other ranks' statuses, marks the unfinished share of a rank that stopped on an error as
    failed, and loads from disk the current record of every image another rank reported
    done or resumed (one that it cannot find is failed with the reason), so the run files
    it writes next list every image; ``run.ranks`` gets each rank's summary.

    Args:
        run: the :class:`~segment.run.pipeline.SegmentRun` of this rank.
        code: this rank's exit code so far.

    Returns:
        The run's exit code on rank 0 (130 if any rank was interrupted, 1 if a rank's output
        file system refused a write), ``code`` elsewhere.
    """
    from segment.run.outputs import ImageStatus, device_info

    ctx = run.ctx
    report = RankReport(
        rank=ctx.rank, images=len(run.mine), timings=run.t.rounded(), device=device_info(run.device),
        statuses={n: s.as_dict() for n, s in run.statuses.items()},
        interrupted=run.interrupted, error=run.error, fault=run.fault,
    )
    reports = merge(report, ctx)
    if reports is None:  # not rank 0
        return code
    for r in reports:
        for name, d in r.statuses.items():
            run.statuses[name] = ImageStatus(**{**d, "rank": r.rank if d["status"] == "done" else None})
        if r.fault is not None and run.fault is None:  # not an image fault: a rerun does the rest
            run.fault = r.fault if r.rank == 0 else f"rank {r.rank}: {r.fault}"
        if r.error and not r.interrupted and r.fault is None and r.rank != 0 and run.input_root is not None:
            for f in run.files[r.rank :: ctx.world_size]:  # its unfinished share
                if f.name not in run.statuses:
                    run.statuses[f.name] = ImageStatus(f.name, f.rel, "failed", f"rank {r.rank} stopped: {r.error}")
    for f in run.files:  # the records the other ranks wrote, read back from disk
        st = run.statuses.get(f.name)
        if f.name in run.records or st is None or st.status == "failed":
            continue
        try:
            stat = f.path.stat()
            size, mtime = stat.st_size, stat.st_mtime_ns
        except OSError:
            size = mtime = -1
        rec = run._current_record(f, size, mtime)
        if rec is not None:
            run.records[f.name] = rec
        else:
            st.status, st.reason = "failed", (
                f"reported {st.status} by a rank, but rank 0 finds no current record in {run.out}"
                " (the output folder must be on a file system every node sees)")
            log.error("%s: %s", f.rel, st.reason)
    run.ranks = [r.summary() for r in reports]
    run.interrupted = any(r.interrupted for r in reports)
    if run.interrupted:
        return EXIT_INTERRUPTED
    if run.fault is not None:
        return EXIT_FAILED
    if code != EXIT_OK or run.input_root is None:
        return code
    return run._outcome()


def agree(code: int, ctx: DistContext) -> int:
    """Rank 0's exit code on every rank, so torchrun's exit status is the run's."""
    return dist.broadcast(code, ctx)
