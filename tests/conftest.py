"""Shared fixtures. Tests that need the development assets (real DINOv2 weights, ecssd-dev)
find them through the SEGMENT_SHARED environment variable (set by .ci/run) and skip with a
clear reason when it is absent, so a user's checkout still passes."""

from __future__ import annotations

import os

# Thread settings first, before numpy, SciPy or torch load (their BLAS and OpenMP pools read
# the environment once, when they start). pytest-xdist runs N workers side by side: each
# (and every command a test starts, which inherits the environment) gets its share of the
# cores, not all of them. A value the caller set is kept (`OMP_NUM_THREADS=1 pytest` runs
# everything on one thread); one this file set in xdist's controller, which the workers
# inherit, is recomputed in each worker (`_SEGMENT_TEST_THREADS` marks it as ours).
_ours = os.environ.get("_SEGMENT_TEST_THREADS")
if "OMP_NUM_THREADS" not in os.environ or os.environ["OMP_NUM_THREADS"] == _ours:
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    _n = str(max(1, (os.cpu_count() or 1) // _workers))
    os.environ["OMP_NUM_THREADS"] = os.environ["_SEGMENT_TEST_THREADS"] = _n
    for _var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[_var] = _n
else:
    for _var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, os.environ["OMP_NUM_THREADS"])

import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_report_header(config: pytest.Config) -> str:
    """The machine a run's numbers come from: CPU kernels and threads (in the header)."""
    return (f"threads: OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, torch {torch.get_num_threads()};"
            f" ATen CPU capability: {torch.backends.cpu.get_cpu_capability()}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` (10 s or more) run first, in their file order: with ``-n 2`` the
    workers then end on short tests instead of one waiting for the other's long one."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable


def _shared() -> Path | None:
    root = os.environ.get("SEGMENT_SHARED")
    if not root:
        return None
    p = Path(root)
    return p if p.is_dir() else None


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    p = _shared()
    if p is None:
        pytest.skip("needs the development assets: set SEGMENT_SHARED to the shared/ folder")
    return p


@pytest.fixture(scope="session")
def dinov2_weights(shared_dir: Path) -> Path:
    w = shared_dir / "weights" / "dinov2_vits14.safetensors"
    if not w.is_file():
        pytest.skip(f"{w} is missing")
    return w


@pytest.fixture(scope="session")
def ecssd_dev(shared_dir: Path) -> Path:
    d = shared_dir / "data" / "ecssd-dev"
    if not (d / "images").is_dir():
        pytest.skip(f"{d} is missing")
    return d


def popen_interruptible(cmd: list[str], **kw) -> subprocess.Popen:
    """``subprocess.Popen`` whose child takes Ctrl-C even where this process ignores SIGINT
    (a suite started in the background by a non-interactive shell: an ignored signal stays
    ignored across exec, and Python then never raises KeyboardInterrupt). A handled signal
    is reset to the default on exec, so SIGINT is handled while the child starts."""
    try:
        old = signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:  # not the main thread: leave the disposition alone
        return subprocess.Popen(cmd, **kw)
    try:
        return subprocess.Popen(cmd, **kw)
    finally:
        signal.signal(signal.SIGINT, old)


def interrupt_when(proc: subprocess.Popen, ready: Callable[[], bool], timeout: float = 240,
                   poll: float = 0.05) -> str:
    """Wait until ``ready()`` (the run has made progress), then Ctrl-C ``proc``; returns its
    output. Fails if the run ended before it could be interrupted."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not ready():
        time.sleep(poll)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    log, _ = proc.communicate(timeout=120)
    return log


def segment_in_process(*args: str) -> int:
    """``segment ARGS`` in the test's own process, its config composed as the command composes
    it, for runs whose command line is not what a test checks (no interpreter, torch and timm
    to start); the exit code."""
    from segment.run.front.compose import compose
    from segment.run.job.pipeline import run_segment

    return run_segment(compose("segment", list(args)))


def assert_results_equal_files(results: list, out: Path, names: list[str]) -> None:
    """The API's results equal the files ``segment`` wrote under ``out`` for ``names``:
    masks, heatmaps (the PNG index is round(255 R)), where the method gives them, labels, and
    the records' ``region_height`` and ``region_escape`` (``Result.region_height`` ...)."""
    for r, n in zip(results, names):
        m = np.asarray(Image.open(out / "masks" / f"{n}.png")) > 0
        np.testing.assert_array_equal(r.mask, m, err_msg=n)
        h = np.asarray(Image.open(out / "heatmaps" / f"{n}.png"))
        np.testing.assert_array_equal(np.clip(np.rint(r.heatmap * 255), 0, 255).astype(np.uint8), h, err_msg=n)
        if r.labels is not None:
            np.testing.assert_array_equal(r.labels, np.asarray(Image.open(out / "labels" / f"{n}.png")), err_msg=n)
        # each region's height and escape, index-aligned with the ids, as the record has them
        from segment.run.job.coco import json_floats

        rec = json.loads((out / "records" / f"{n}.json").read_text())
        assert rec["region_height"] == json_floats(r.region_height), n
        assert rec["region_escape"] == json_floats(r.region_escape), n
