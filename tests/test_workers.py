"""segment.workers: a CPU run split over forked worker processes (tiny random ViT, seconds)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import interrupt_when
from segment import workers
from segment.pipeline import run_segment
from test_pipeline import _img, _manifest, compose_cfg

pytestmark = [
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
    pytest.mark.skipif(not workers.can_fork(), reason="worker processes need Linux (fork)"),
]

CPU = torch.device("cpu")


def _folder(root: Path, n: int) -> Path:
    root.mkdir(parents=True)
    for i in range(n):
        _img(40 + (i % 3) * 7, 60 - (i % 2) * 9, i).save(root / f"{i:02d}.png")
    return root


def _files(out: Path) -> dict[str, bytes]:
    """Every output file but the run-level ones, whose times differ; records without
    their timing field."""
    got = {}
    for p in sorted(out.rglob("*")):
        rel = p.relative_to(out).as_posix()
        if not p.is_file() or rel.startswith(".hydra") or rel in ("run.json", "index.html", "cli.log"):
            continue
        if rel.startswith("records/"):
            rec = json.loads(p.read_text())
            rec.pop("seconds")
            got[rel] = json.dumps(rec, sort_keys=True).encode()
        elif rel == "annotations.json":
            coco = json.loads(p.read_text())
            coco["info"].pop("date_created")
            got[rel] = json.dumps(coco, sort_keys=True).encode()
        else:
            got[rel] = p.read_bytes()
    return got


def test_share_batches_gives_whole_batches_in_turn():
    todo = list(range(11))
    assert workers.share_batches(todo, 2, 3) == [[0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 10]]
    assert workers.share_batches(todo, 3, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    assert workers.share_batches(todo[:2], 4, 3) == [[0, 1]]  # empty shares left out


def test_choose_processes(monkeypatch):
    choose = workers.choose_processes
    kw = dict(device=CPU, distributed=False, threads=2, todo=16, batch_size=8)
    assert choose(None, **kw) == workers.AUTO_PROCESSES == 2
    assert choose(None, **{**kw, "threads": 1}) == 1  # one thread: nothing to gain
    assert choose(None, **{**kw, "todo": 8}) == 1  # one batch
    assert choose(None, **{**kw, "device": torch.device("cuda", 0)}) == 1
    assert choose(None, **{**kw, "distributed": True}) == 1
    assert choose(1, **kw) == 1
    assert choose(5, **kw) == 2  # no more processes than batches
    assert choose(3, **{**kw, "todo": 100}) == 3
    with pytest.raises(ValueError, match="CPU only"):
        choose(2, **{**kw, "device": torch.device("cuda", 0)})
    with pytest.raises(ValueError, match="torchrun"):
        choose(2, **{**kw, "distributed": True})
    monkeypatch.setattr(workers, "can_fork", lambda: False)
    assert choose(None, **kw) == 1
    with pytest.raises(ValueError, match="fork"):
        choose(2, **kw)


@pytest.mark.parametrize("method", ["regions", "cls_attention"])
def test_two_processes_write_the_same_files_as_one(tmp_path, method):
    """Every output file, record and annotation is the same bytes: with one preprocessed
    size each batch holds the same images in a worker as in one process (the images have
    several sizes, so post-processing at the original size differs between them)."""
    src = _folder(tmp_path / "in", 11)
    (src / "broken.png").write_text("not a png")
    from hydra.utils import instantiate

    backbone = instantiate(compose_cfg(src, tmp_path / "o").model)  # one set of random weights
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = {}
        for p in (1, 2):
            out = tmp_path / f"out{p}"
            assert run_segment(compose_cfg(src, out, f"method={method}", "batch_size=2",
                                           f"processes={p}"), backbone=backbone) == 0
            man = _manifest(out)
            assert man["processes"] == p
            assert man["counts"]["segmented"] == 11 and man["counts"]["failed"] == 1
            assert man["skipped"][0]["path"] == "broken.png"
            assert [s["status"] for s in man["images"]] == ["done"] * 11 + ["failed"]
            runs[p] = _files(out)
        assert torch.get_num_threads() == 2  # the parent's threads are left alone
    finally:
        torch.set_num_threads(before)
    assert runs[1].keys() == runs[2].keys() and len(runs[1]) > 11 * 4
    for rel in runs[1]:
        assert runs[1][rel] == runs[2][rel], rel


def test_automatic_processes_on_a_cpu_run(tmp_path):
    src = _folder(tmp_path / "in", 6)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert run_segment(compose_cfg(src, tmp_path / "a", "batch_size=3")) == 0
        assert _manifest(tmp_path / "a")["processes"] == 2
        assert run_segment(compose_cfg(src, tmp_path / "b", "batch_size=6")) == 0  # one batch
        assert _manifest(tmp_path / "b")["processes"] == 1
        torch.set_num_threads(1)
        assert run_segment(compose_cfg(src, tmp_path / "c", "batch_size=3")) == 0
        assert _manifest(tmp_path / "c")["processes"] == 1
    finally:
        torch.set_num_threads(before)


def test_worker_log_lines_reach_the_parent_once(tmp_path, caplog):
    src = _folder(tmp_path / "in", 4)
    (src / "zz_cut.png").write_bytes((src / "00.png").read_bytes()[:60])
    caplog.set_level("INFO")
    assert run_segment(compose_cfg(src, tmp_path / "out", "batch_size=2", "processes=2")) == 0
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage() and "zz_cut" in r.getMessage()]
    assert len(skipped) == 1 and "truncated" in skipped[0], skipped
    assert any("2 worker processes" in r.getMessage() for r in caplog.records)


class _DiesOnSecondBatch:
    """Wraps a method; the worker process that was given image ``6.png`` is killed on its
    second batch, as the kernel kills a process out of memory (``armed`` is set in that
    worker only, see the test)."""

    armed = False

    def __init__(self, inner, first: list[Path]) -> None:
        self.inner, self.name, self.calls, self.first = inner, inner.name, 0, first
        self.lock = threading.Lock()

    def capture(self, num_layers):
        return self.inner.capture(num_layers)

    def __call__(self, record):
        with self.lock:
            self.calls += 1  # a batch of 2 comes as two halves (Segmenter.apply)
            second = self.calls > 2
        if _DiesOnSecondBatch.armed and second:
            deadline = time.time() + 60  # the first batch's records written (its writes run on)
            while not all(p.is_file() for p in self.first) and time.time() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner(record)


def test_a_worker_that_dies_loses_only_its_unfinished_images(tmp_path, monkeypatch):
    from hydra.utils import instantiate

    src = _folder(tmp_path / "in", 8)  # batches of 2: worker 0 [0 1] [4 5], worker 1 [2 3] [6 7]
    out = tmp_path / "out"
    real = workers._worker

    def worker(run, share, conn, threads):  # runs in the forked worker
        _DiesOnSecondBatch.armed = any(it.file.rel == "06.png" for it in share)
        real(run, share, conn, threads)

    monkeypatch.setattr(workers, "_worker", worker)
    cfg = compose_cfg(src, out, "batch_size=2", "processes=2")
    first = [out / "records" / "02.json", out / "records" / "03.json"]
    assert run_segment(cfg, method=_DiesOnSecondBatch(instantiate(cfg.method), first)) == 0
    man = _manifest(out)
    status = {s["source"]: s for s in man["images"]}
    assert {k for k, s in status.items() if s["status"] == "done"} == {f"0{i}.png" for i in range(6)}
    for k in ("06.png", "07.png"):
        assert status[k]["status"] == "failed"
        assert status[k]["reason"] == "worker process 1 ended unexpectedly (killed by signal 9)"
    assert man["counts"] == {"found": 8, "segmented": 6, "resumed": 0, "failed": 2, "ignored": 0}
    assert len(json.loads((out / "annotations.json").read_text())["images"]) == 6
    assert not list(out.rglob("*.tmp"))
    monkeypatch.setattr(workers, "_worker", real)
    assert run_segment(compose_cfg(src, out, "batch_size=2", "processes=2")) == 0  # the rerun does the two
    man = _manifest(out)
    assert man["counts"]["resumed"] == 6 and man["counts"]["segmented"] == 2


SEGMENT = Path(sys.executable).with_name("segment")


def test_cli_ctrl_c_stops_the_workers_then_resume(tmp_path):
    """SIGINT to the command: the workers finish their files and stop, exit 130, nothing
    half-written, no worker left running; the rerun does the rest."""
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    n = 120
    for i in range(n):
        _img(56, 56, i).save(src / f"{i:03d}.png")
    env = dict(os.environ, OMP_NUM_THREADS="2", HYDRA_FULL_ERROR="1")
    tiny = ["model=vit_tiny_random", "device=cpu", "render.fsync=false", "progress=false", "processes=2"]
    proc = subprocess.Popen([str(SEGMENT), f"input={src}", f"output={out}", "batch_size=4", *tiny],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    log = interrupt_when(proc, lambda: (out / "records").is_dir() and len(list((out / "records").iterdir())) >= 8,
                         poll=0.02)
    assert proc.returncode == 130, log
    assert "interrupted" in log and "Traceback" not in log, log
    # no worker outlives the command
    left = subprocess.run(["pgrep", "-f", f"output={out}"], capture_output=True, text=True).stdout.split()
    assert not left, left
    man = json.loads((out / "run.json").read_text())
    done = man["counts"]["segmented"]
    assert man["interrupted"] is True and 0 < done < n and man["processes"] == 2
    assert done == len(list((out / "records").glob("*.json")))
    assert not list(out.rglob("*.tmp"))
    for p in out.rglob("*"):
        if p.suffix in (".png", ".jpg"):
            with Image.open(p) as im:
                im.load()
    r = subprocess.run([str(SEGMENT), f"input={src}", f"output={out}", "batch_size=4", *tiny],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    man = json.loads((out / "run.json").read_text())
    assert man["counts"]["resumed"] == done and man["counts"]["resumed"] + man["counts"]["segmented"] == n


def test_processes_setting_is_checked(tmp_path):
    from segment.front import run_value_problem

    assert run_value_problem("segment", "processes", None, 0) == "expected a whole number >= 1"
    assert run_value_problem("segment", "processes", None, None) is None
    assert run_value_problem("segment", "processes", None, 2) is None
    _ = np  # numpy imported for the image helpers


def test_workers_stop_when_the_command_is_killed(tmp_path):
    """SIGKILL to the command (no Ctrl-C handling possible): its workers do not run on."""
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    for i in range(200):
        _img(56, 56, i).save(src / f"{i:03d}.png")
    env = dict(os.environ, OMP_NUM_THREADS="2", HYDRA_FULL_ERROR="1")
    proc = subprocess.Popen([str(SEGMENT), f"input={src}", f"output={out}", "batch_size=4", "model=vit_tiny_random",
                             "device=cpu", "render.fsync=false", "progress=false", "processes=2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 240
    while time.time() < deadline and not ((out / "records").is_dir() and any((out / "records").iterdir())):
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    deadline = time.time() + 60
    left = ["?"]
    while left and time.time() < deadline:
        left = subprocess.run(["pgrep", "-f", f"output={out}"], capture_output=True, text=True).stdout.split()
        time.sleep(0.2)
    assert not left, f"workers still running: {left}"
    assert not list(out.rglob("*.tmp"))
