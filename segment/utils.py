"""Small shared helpers: device selection, torch threads and atomic file writes."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

# exit codes of the `segment` and `segment-eval` commands
EXIT_OK = 0  # something was done
EXIT_FAILED = 1  # nothing could be processed
EXIT_BAD_INPUT = 2  # unusable input or configuration
EXIT_BUSY = 3  # segment: the output folder is in use by another run (nothing was written)
EXIT_INTERRUPTED = 130  # Ctrl-C (finished work kept)


def unwrap_instantiation(e: BaseException) -> BaseException:
    """The error behind Hydra's ``InstantiationException`` wrappers (``e`` itself if none)."""
    while type(e).__name__ == "InstantiationException" and e.__cause__ is not None:
        e = e.__cause__
    return e


def resolve_device(spec: str | torch.device | None = "auto") -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; otherwise ``torch.device(spec)``.

    Raises:
        ValueError: when CUDA is asked for and not available.
    """
    if spec is None or str(spec) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError):  # torch lists every device type it knows
        raise ValueError(f"device={spec!r} is not a device: use auto, cpu, cuda or cuda:N (or mps)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={spec!r} was asked for but CUDA is not available; use device=cpu")
    return dev


# temp names: unique within the process (next() is atomic), across processes and hosts
# sharing a folder (the pid, then a random tag drawn once per import)
_TMP_SEQ = itertools.count()
_TMP_TAG = secrets.token_hex(4)
_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


def set_thread_torch_threads(n: int) -> None:
    """This thread's torch thread count set to ``n`` (a thread pool's ``initializer``).

    Torch initialises a thread's count lazily, at its first ``get_num_threads`` or parallel
    op, to the count last set by *any* thread; a pool thread that only called
    ``set_num_threads(n)`` would take another thread's later setting at that first use.
    So the lazy initialisation runs first, then ``n`` is set."""
    torch.get_num_threads()
    torch.set_num_threads(n)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """This thread's torch thread count set to ``n`` for the duration (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _create_beside(path: str) -> tuple[int, str]:
    """A new temporary file next to ``path`` (its folder made when missing): ``(fd, name)``."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}-{_TMP_TAG}-{next(_TMP_SEQ)}.tmp")
    try:
        return os.open(tmp, _TMP_FLAGS, 0o666), tmp
    except FileNotFoundError:
        os.makedirs(folder or ".", exist_ok=True)
        return os.open(tmp, _TMP_FLAGS, 0o666), tmp


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it replaces ``path`` atomically.

    A crash or Ctrl-C inside the block leaves ``path`` as it was (old content or absent),
    never truncated.
    """
    fd, tmp = _create_beside(os.fspath(path))
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` atomically: a temporary file next to it, flushed to disk
    (``fsync``) and renamed over ``path``. A crash or Ctrl-C leaves ``path`` as it was (old
    content or absent), never truncated, and no temporary file behind.

    The same temporary file as :func:`atomic_path`, written in plain system calls: a batch
    run writes about ten files per image, and ``tempfile`` names and buffered files cost
    more CPU than the write itself (0.22 against 0.18 ms per file with the flush, 0.15
    against 0.05 without). The folder is created only when it is missing.
    """
    fd, tmp = _create_beside(os.fspath(path))
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, **kwargs: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=kwargs.pop("indent", 2), **kwargs) + "\n")
