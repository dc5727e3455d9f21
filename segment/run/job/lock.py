"""One ``segment`` run per output folder: a lock file with the holder's pid and host.

Two runs into one folder would segment every image twice and race on the run files, so a
run holds ``<output>/.segment.lock`` from before it plans (reads the records) until its
run files are written. The file says who holds it (pid, host, start time, command line);
the lock itself is an ``flock`` on that file, which the system releases when the process
ends however it ends (Ctrl-C, SIGKILL, a crash), so a lock file left behind by a dead run
is *stale*: the next run takes it over and says so. ``flock`` reaches other hosts on
network file systems that support it (NFSv4, Lustre with ``-o flock``); where it is not
supported, a lock file of this host whose process is gone is stale, and one of another
host is honoured (the message names the file to delete if that run is gone).

Under ``torchrun`` rank 0 holds the lock for the whole run (:mod:`segment.run.job.shard`): the
ranks of one run are one run.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from segment.run.io import InputError

try:
    import fcntl
except ImportError:  # Windows: the pid check alone
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".segment.lock"


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) an output folder.

    Attributes:
        pid: the process id.
        host: the host name.
        started: when it took the lock (ISO 8601, UTC).
        command: its command line.
        proc_start: the process's start time in clock ticks since boot (Linux; tells a
            reused pid apart), ``None`` elsewhere.
    """

    pid: int
    host: str
    started: str = ""
    command: str = ""
    proc_start: int | None = None

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}" + (f", started {self.started}" if self.started else "")

    @classmethod
    def me(cls) -> Holder:
        return cls(pid=os.getpid(), host=socket.gethostname(),
                   started=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   command=" ".join(sys.argv), proc_start=_proc_start(os.getpid()))

    def alive(self) -> bool | None:
        """Whether the process still runs: ``None`` when it is on another host."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process
            pass
        start = _proc_start(self.pid)
        return self.proc_start is None or start is None or start == self.proc_start


class FolderBusy(InputError):
    """Another run holds the output folder (the message names it).

    Attributes:
        holder: that run, when the lock file says.
    """

    def __init__(self, message: str, holder: Holder | None = None) -> None:
        super().__init__(message)
        self.holder = holder


def _proc_start(pid: int) -> int | None:
    """Start time of a process in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _read(fd: int) -> Holder | None:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = b""
        while chunk := os.read(fd, 65536):
            data += chunk
        d = json.loads(data.decode("utf-8"))
        return Holder(**{k: d[k] for k in Holder.__dataclass_fields__ if k in d})
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _read_held(fd: int, wait_s: float = 1.0) -> Holder | None:
    """The holder of a lock file another process has flocked: it writes itself into the
    file right after taking the flock, so a file read empty (or half written) in between
    is read again for up to ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while (h := _read(fd)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return h


_NO_FLOCK = (errno.ENOLCK, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP)


def busy_message(folder: str | os.PathLike, holder: Holder | None) -> str:
    """The one line that refuses ``folder`` to a second run."""
    who = holder.describe() if holder else "a process the lock file does not name"
    msg = (f"output folder {str(folder)!r} is in use by another segment run ({who}); "
           "wait for it to finish (a rerun then resumes) or choose another output=")
    if fcntl is None and holder is not None and holder.alive() is None:
        msg += f"; if that run is gone, delete {Path(folder) / LOCK_NAME}"
    return msg


def _busy(folder: Path, holder: Holder | None) -> FolderBusy:
    return FolderBusy(busy_message(folder, holder), holder)


class OutputLock:
    """The lock of one output folder (see the module docstring).

    Args:
        folder: the output folder; created (with missing parents) by :meth:`acquire`.

    Attributes:
        stale: the holder of a stale lock file that :meth:`acquire` took over, if any.
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.stale: Holder | None = None
        self._fd: int | None = None
        self._created: list[Path] = []  # folders acquire made, removed by release when empty

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the folder for this process.

        Raises:
            FolderBusy: another live run holds it (naming its pid and host).
            OSError: the folder or the lock file cannot be created.
        """
        missing = []
        p = self.folder
        while not p.exists() and p != p.parent:
            missing.append(p)
            p = p.parent
        self.folder.mkdir(parents=True, exist_ok=True)
        self._created = missing  # deepest first
        try:
            for _ in range(10):  # a run releasing the lock meanwhile: try the new file
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
                try:
                    if self._lock(fd):
                        return
                except BaseException:
                    os.close(fd)
                    raise
                os.close(fd)
            raise FolderBusy(f"output folder {str(self.folder)!r}: the lock file {self.path} keeps changing")
        except BaseException:
            self._remove_created()
            raise

    def _lock(self, fd: int) -> bool:
        """Lock ``fd`` and write this process into it; ``False`` when the file was replaced
        meanwhile (try again)."""
        flocked = False
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                flocked = True
            except BlockingIOError:
                raise _busy(self.folder, _read_held(fd)) from None
            except OSError as e:
                if e.errno not in _NO_FLOCK:
                    raise
        try:
            if os.fstat(fd).st_ino != os.stat(self.path).st_ino:
                return False  # the holder released it (unlinked) between open and flock
        except FileNotFoundError:
            return False
        before = _read(fd)
        if before is not None and not flocked and before.alive() is not False:
            raise _busy(self.folder, before)  # no flock here: honour a live pid
        self.stale = before  # a lock file nobody holds: its run ended without releasing it
        data = (json.dumps(asdict(Holder.me())) + "\n").encode("utf-8")
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, data)
        self._fd = fd
        return True

    def release(self) -> None:
        """Give the folder back: the lock file is removed, and the folders :meth:`acquire`
        created when they are still empty (a run that could not start leaves nothing)."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # before the unlock: a waiter sees a new file
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None
        self._remove_created()

    def _remove_created(self) -> None:
        for p in self._created:
            try:
                p.rmdir()
            except OSError:
                break
        self._created = []

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder(folder: str | os.PathLike) -> Holder | None:
    """The live run that holds ``folder``, or ``None``; creates nothing (the command's
    pre-check, before Hydra writes its files into the folder)."""
    path = Path(folder) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        h = _read(fd)
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return None  # nobody holds it (a stale file)
            except BlockingIOError:
                return h or Holder(pid=0, host="?")
            except OSError as e:
                if e.errno not in _NO_FLOCK:
                    return None
        return h if h is not None and h.alive() is not False else None
    finally:
        os.close(fd)


def in_use(folder: str | os.PathLike) -> str | None:
    """The message naming the live run that holds ``folder`` (:func:`holder`), or ``None``:
    the ``segment`` command's check before Hydra writes into the folder (exit 3; the run
    itself takes the lock later, so two runs started at once are told apart there)."""
    h = holder(folder)
    return None if h is None else busy_message(folder, h)
