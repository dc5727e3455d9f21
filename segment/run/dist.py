"""The torchrun context both commands share: one process per device, or a single process.

``torchrun --nproc_per_node=K -m segment.eval ...`` (or ``-m segment``) sets ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK``; :func:`init` then joins the process group (NCCL on CUDA,
gloo on CPU; ``segment`` always asks for gloo, :mod:`segment.run.job.shard`), each rank takes
every K-th image (:func:`shard`), and what the ranks computed is gathered to rank 0
(:func:`gather`): ``segment-eval`` sums the per-image metric states in data set order, so
the merged numbers are the same as a single-process run's.

It lives in the run layer (``segment.run``) so that ``segment`` does not depend on the
evaluation layer; ``segment.eval.runner`` imports it from here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as td

from segment.utils import resolve_device

T = TypeVar("T")


@dataclass(frozen=True)
class DistContext:
    """Where this process stands.

    Attributes:
        rank: global rank (0 without torchrun).
        world_size: number of processes.
        local_rank: rank on this machine (selects the CUDA device).
        device: the device this rank evaluates on.
        initialized: whether this call created the process group (and must destroy it).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    initialized: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def env_int(name: str, default: int) -> int:
    """The integer in environment variable ``name`` (``default`` when unset or empty).

    Raises:
        ValueError: naming the variable when it holds something else.
    """
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def init(device: str | torch.device | None = "auto", backend: str | None = None,
         timeout_s: float = 1800.0) -> DistContext:
    """Join the process group when launched by ``torchrun`` (``WORLD_SIZE > 1``).

    Args:
        device: ``auto`` / ``cpu`` / ``cuda``; under torchrun ``cuda`` becomes
            ``cuda:LOCAL_RANK``.
        backend: ``None`` = ``nccl`` on CUDA, ``gloo`` otherwise.
        timeout_s: collective timeout (a slow rank waits this long at the final gather).
    """
    world = env_int("WORLD_SIZE", 1)
    local = env_int("LOCAL_RANK", 0)
    dev = resolve_device(device)
    if dev.type == "cuda" and world > 1 and dev.index is None:
        dev = torch.device("cuda", local % max(1, torch.cuda.device_count()))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world <= 1:
        return DistContext(device=dev)
    created = False
    if not td.is_initialized():
        be = backend or ("nccl" if dev.type == "cuda" else "gloo")
        kwargs: dict[str, Any] = {"backend": be, "timeout": timedelta(seconds=timeout_s)}
        if be == "nccl":
            kwargs["device_id"] = dev
        td.init_process_group(**kwargs)
        created = True
    return DistContext(rank=td.get_rank(), world_size=td.get_world_size(), local_rank=local,
                       device=dev, initialized=created)


def shard(items: Sequence[T], ctx: DistContext) -> list[T]:
    """This rank's part: every ``world_size``-th item starting at ``rank``."""
    return list(items[ctx.rank :: ctx.world_size])


def gather(obj: T, ctx: DistContext) -> list[T] | None:
    """Every rank's ``obj`` on rank 0 (in rank order); ``None`` on the other ranks."""
    if not ctx.distributed:
        return [obj]
    out: list[Any] | None = [None] * ctx.world_size if ctx.is_main else None
    td.gather_object(obj, out, dst=0)
    return out


def broadcast(obj: T, ctx: DistContext) -> T:
    """Rank 0's ``obj`` on every rank."""
    if not ctx.distributed:
        return obj
    box = [obj if ctx.is_main else None]
    td.broadcast_object_list(box, src=0)
    return box[0]


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        td.barrier()


def close(ctx: DistContext) -> None:
    """Leave the process group if :func:`init` created it, all ranks together.

    The barrier first: a rank that tears down its gloo connections while another still
    uses them can abort at exit ("terminate called without an active exception", seen
    once in tests/test_shard.py after a finished run). A failed barrier (a rank already
    gone) does not stop the teardown.
    """
    if ctx.initialized and td.is_initialized():
        try:
            td.barrier()
        except Exception:  # noqa: BLE001 - leaving anyway
            pass
        td.destroy_process_group()
