"""segment.run.job.lock: one run per output folder (a lock file with the holder's pid and host,
stale locks taken over), in one process, against another process, and two `segment`
commands started at the same moment."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from segment.run.job.lock import LOCK_NAME, FolderBusy, OutputLock, holder

BIN = Path(sys.executable).parent
TINY = ["model=vit_tiny_random", "device=cpu", "progress=false", "render.fsync=false"]


def _env() -> dict[str, str]:
    e = dict(os.environ, OMP_NUM_THREADS="1")
    e.pop("HYDRA_FULL_ERROR", None)
    return e


def _images(folder: Path, n: int) -> Path:
    folder.mkdir(parents=True)
    for i in range(n):
        a = np.full((42, 56, 3), 30, np.uint8)
        a[10:32, 14:42] = (200, 40 + 10 * i % 200, 90)
        Image.fromarray(a).save(folder / f"{i:02d}.png")
    return folder


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_second_lock_is_refused_naming_the_holder_and_release_leaves_nothing(tmp_path):
    out = tmp_path / "new" / "out"
    first = OutputLock(out)
    first.acquire()
    lock_file = json.loads((out / LOCK_NAME).read_text())
    assert lock_file["pid"] == os.getpid() and lock_file["host"] == socket.gethostname()
    with pytest.raises(FolderBusy) as e:  # a second open file: flock refuses it in any process
        OutputLock(out).acquire()
    msg = str(e.value)
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in msg and str(out) in msg
    assert e.value.holder.pid == os.getpid()
    assert holder(out).pid == os.getpid()
    first.release()
    assert not (tmp_path / "new").exists()  # acquire made new/out: release removes both again
    assert holder(out) is None
    with OutputLock(out) as again:  # free again
        assert again.held and again.stale is None
        (out / "result.txt").write_text("kept")
    assert sorted(p.name for p in out.iterdir()) == ["result.txt"]  # a folder in use stays


def test_a_lock_left_by_a_dead_process_is_stale_and_taken_over(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    dead = _dead_pid()
    (out / LOCK_NAME).write_text(json.dumps({"pid": dead, "host": socket.gethostname(), "started": "earlier"}))
    assert holder(out) is None  # nobody holds it
    with OutputLock(out) as lock:
        assert lock.stale is not None and lock.stale.pid == dead
        assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert not (out / LOCK_NAME).exists()


_HOLD = """
import sys, time
from pathlib import Path
from segment.run.job.lock import OutputLock
lock = OutputLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
while not Path(sys.argv[2]).exists():
    time.sleep(0.02)
lock.release()
"""


@pytest.fixture
def other_holder(tmp_path):
    """Another process that holds ``tmp_path/out`` until ``tmp_path/stop`` appears."""
    out, stop = tmp_path / "out", tmp_path / "stop"
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(out), str(stop)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield out, proc
    stop.touch()
    proc.wait(timeout=60)


def test_segment_into_a_folder_another_process_holds_exits_3_in_one_line(tmp_path, other_holder):
    from hydra import compose, initialize_config_module

    from segment.run.job.pipeline import run_segment

    out, proc = other_holder
    src = _images(tmp_path / "in", 2)
    assert holder(out).pid == proc.pid
    want = f"in use by another segment run (pid {proc.pid} on host {socket.gethostname()}"
    # the command: refused before Hydra writes anything into the folder
    r = subprocess.run([str(BIN / "segment"), f"input={src}", f"output={out}", *TINY],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 3, (r.stdout, r.stderr)
    lines = (r.stdout + r.stderr).splitlines()
    assert len(lines) == 1 and lines[0].startswith("segment: output folder") and want in lines[0], lines
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]
    # the run itself (Python API, or a command that passed the pre-check just before)
    with initialize_config_module(version_base="1.3", config_module="segment.configs"):
        cfg = compose("segment", overrides=[f"input={src}", f"output={out}", *TINY])
    assert run_segment(cfg) == 3
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # nothing written


_START_AT_ONCE = """
import os, sys, time
from segment.run.job import cli
import segment.run.job.pipeline  # the heavy imports before the start line
go = sys.argv[1]
while not os.path.exists(go):
    time.sleep(0.005)
sys.argv = ["segment", *sys.argv[2:]]
cli.main()
"""


@pytest.mark.slow
def test_two_segment_commands_started_at_once_into_one_folder(tmp_path):
    """Both start at the same moment (imports done, then one go): one segments every image,
    the other stops with exit 3 and one line naming the first one's pid and host."""
    src = _images(tmp_path / "in", 24)
    out, go = tmp_path / "out", tmp_path / "go"
    args = [f"input={src}", f"output={out}", *TINY, "batch_size=2", "num_workers=1"]
    procs = [subprocess.Popen([sys.executable, "-c", _START_AT_ONCE, str(go), *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env()) for _ in range(2)]
    time.sleep(8)  # both have imported torch and wait for the go
    go.touch()
    results = [(p, *p.communicate(timeout=300)) for p in procs]
    codes = sorted(p.returncode for p, _, _ in results)
    assert codes == [0, 3], [(p.returncode, o[-2000:], e[-2000:]) for p, o, e in results]
    (winner, _, _), = [r for r in results if r[0].returncode == 0]
    (_, lout, lerr), = [r for r in results if r[0].returncode == 3]
    lines = (lout + lerr).splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert lines[0].startswith("segment: output folder")
    assert f"pid {winner.pid} on host {socket.gethostname()}" in lines[0]
    man = json.loads((out / "run.json").read_text())
    assert man["counts"]["segmented"] == 24 and man["counts"]["resumed"] == 0  # the work was done once
    assert len(list((out / "records").glob("*.json"))) == 24 and not (out / LOCK_NAME).exists()
