"""``segment`` under ``torchrun``: each rank segments its share, rank 0 merges the run files.

``torchrun --nproc_per_node=K -m segment input=DIR output=OUT`` (multi-node: torchrun's
``--nnodes``/``--rdzv_*`` flags) starts K processes; each one:

1. joins a **gloo** process group (:func:`init`; the ranks exchange only small Python
   objects, so gloo serves CPU and CUDA runs alike and no NCCL watchdog fires while a slow
   rank finishes; each rank computes on ``cuda:LOCAL_RANK``);
2. gets rank 0's listing of the input (:func:`scan`: one scan, so every rank sees the same
   sorted file list even if the folder changes meanwhile); rank 0 also takes the output
   folder's lock (:mod:`segment.run.job.lock`) for the whole run: its ranks are one run;
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
from segment.run.job.manifest import ImageStatus, device_info
from segment.run.job.plan import current_record
from segment.run.job.state import RunSettings, RunState
from segment.run.job.summary import outcome
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
            :class:`segment.run.job.manifest.ImageStatus`).
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
            "resumed": count("resumed"), "skipped": count("skipped"), "interrupted": self.interrupted,
            "error": self.error, "device": self.device, "timings": self.timings,
        }


def merge(report: RankReport, ctx: DistContext) -> list[RankReport] | None:
    """Every rank's report on rank 0 (rank order); ``None`` on the other ranks."""
    return dist.gather(report, ctx)


def finish(state: RunState, settings: RunSettings, ctx: DistContext, code: int) -> int:
    """End of a distributed ``segment`` run (:class:`segment.run.job.pipeline.SegmentRun`; every
    rank calls it with its run state).

    Every rank sends its statuses and timings to rank 0 (:func:`merge`). Rank 0 takes the
    other ranks' statuses into ``state``, marks the unfinished share of a rank that stopped
    on an error as skipped, and loads from disk the current record of every image another
    rank reported done or resumed (one that it cannot find is skipped with the reason), so
    the run files it writes next list every image; ``state.ranks`` gets each rank's summary.

    Args:
        state: this rank's run state.
        settings: the run settings (the output folder, the config's fingerprint).
        ctx: this rank's place in the group.
        code: this rank's exit code so far.

    Returns:
        The run's exit code on rank 0 (130 if any rank was interrupted, 1 if a rank's output
        file system refused a write, else :func:`segment.run.job.summary.outcome`), ``code``
        elsewhere.
    """
    report = RankReport(
        rank=ctx.rank, images=len(state.mine), timings=state.timings.rounded(), device=device_info(state.device),
        statuses={n: s.as_dict() for n, s in state.statuses.items()},
        interrupted=state.interrupted, error=state.error, fault=state.fault,
    )
    reports = merge(report, ctx)
    if reports is None:  # not rank 0
        return code
    for r in reports:
        for name, d in r.statuses.items():
            state.statuses[name] = ImageStatus(**{**d, "rank": r.rank if d["status"] == "done" else None})
        if r.fault is not None and state.fault is None:  # not an image fault: a rerun does the rest
            state.fault = r.fault if r.rank == 0 else f"rank {r.rank}: {r.fault}"
        if r.error and not r.interrupted and r.fault is None and r.rank != 0 and state.input_root is not None:
            for f in state.files[r.rank :: ctx.world_size]:  # its unfinished share
                if f.name not in state.statuses:
                    state.statuses[f.name] = ImageStatus(f.name, f.rel, "skipped", f"rank {r.rank} stopped: {r.error}")
    for f in state.files:  # the records the other ranks wrote, read back from disk
        st = state.statuses.get(f.name)
        if f.name in state.records or st is None or st.status == "skipped":
            continue
        try:
            stat = f.path.stat()
            size, mtime = stat.st_size, stat.st_mtime_ns
        except OSError:
            size = mtime = -1
        rec = current_record(settings, f, size, mtime)
        if rec is not None:
            state.records[f.name] = rec
        else:
            st.status, st.reason = "skipped", (
                f"reported {st.status} by a rank, but rank 0 finds no current record in {settings.out}"
                " (the output folder must be on a file system every node sees)")
            log.error("%s: %s", f.rel, st.reason)
    state.ranks = [r.summary() for r in reports]
    state.interrupted = any(r.interrupted for r in reports)
    if state.interrupted:
        return EXIT_INTERRUPTED
    if state.fault is not None:
        return EXIT_FAILED
    if code != EXIT_OK or state.input_root is None:
        return code
    return outcome(state)


def agree(code: int, ctx: DistContext) -> int:
    """Rank 0's exit code on every rank, so torchrun's exit status is the run's."""
    return dist.broadcast(code, ctx)
