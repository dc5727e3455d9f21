"""segment.run.job.shard: ``torchrun -m segment`` with 2 gloo ranks on CPU equals one process, and a
run resumed with another number of ranks completes it from the per-image records."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from segment.run.dist import DistContext
from segment.run.job.shard import RankReport, share

from conftest import segment_in_process

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

SIZES = [(40, 60), (50, 30), (33, 47), (45, 45), (30, 40), (64, 48), (28, 70)]  # (h, w)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_share_is_strided_and_covers_the_list():
    items = list(range(7))
    parts = [share(items, DistContext(rank=r, world_size=3)) for r in range(3)]
    assert parts == [[0, 3, 6], [1, 4], [2, 5]]
    assert share(items, DistContext()) == items
    rep = RankReport(rank=1, images=2, statuses={
        "a": {"name": "a", "source": "a.png", "status": "done"},
        "b": {"name": "b", "source": "b.png", "status": "skipped", "reason": "x"}})
    assert rep.summary()["segmented"] == 1 and rep.summary()["skipped"] == 1


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A folder of 7 images + one broken file, and fixed weights for the tiny ViT (random
    init differs per process, a checkpoint does not)."""
    from safetensors.torch import save_file
    from segment.models.vit import TimmViT

    root = tmp_path_factory.mktemp("shard")
    src = root / "in"
    (src / "sub").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i, (h, w) in enumerate(SIZES):
        a = np.full((h, w, 3), 40, np.uint8)
        a[h // 4 : 3 * h // 4, w // 5 : 3 * w // 4] = rng.integers(120, 255, 3)
        a = (a + rng.integers(0, 30, a.shape)).astype(np.uint8)
        Image.fromarray(a).save(src / ("sub" if i % 3 == 2 else ".") / f"im{i}.png")
    (src / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    torch.manual_seed(0)
    bb = TimmViT("vit_small_patch14_dinov2", pretrained=False, image_size=224, device="cpu",
                 model_kwargs={"embed_dim": 64, "depth": 2, "num_heads": 2})
    ckpt = root / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in bb.model.state_dict().items()}, str(ckpt))
    args = ["model=vit_tiny_random", f"model.checkpoint={ckpt}", "device=cpu", "progress=false",
            "batch_size=2", "num_workers=2", "render.fsync=false", f"input={src}"]
    return root, src, args


def _run(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _torchrun(n: int) -> list[str]:
    """``torchrun`` of this Python (``python -m torch.distributed.run`` is the same program)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={n}", f"--master_port={_free_port()}", "-m", "segment"]


def _files(out: Path, folder: str) -> dict[str, bytes]:
    return {str(p.relative_to(out / folder)): p.read_bytes() for p in sorted((out / folder).rglob("*")) if p.is_file()}


def _coco(out: Path) -> dict:
    d = json.loads((out / "annotations.json").read_text())
    d.pop("info")
    return d


def _same_coco(a: Path, b: Path) -> None:
    """Equal COCO files: ids, images, RLE masks, boxes, areas exactly; the float ``score``
    (mean heatmap over a region) to 1e-3 relative, since a batch of another size may round
    the forward differently in the last bit, which the min-max normalisations of the blended
    heatmap (``heat: blend``) amplify (measured: 1.5e-4 at most)."""
    x, y = _coco(a), _coco(b)
    sx = [ann.pop("score") for ann in x["annotations"]]
    sy = [ann.pop("score") for ann in y["annotations"]]
    assert x == y
    assert sx == pytest.approx(sy, rel=1e-3, abs=1e-5)


@pytest.mark.slow
def test_torchrun_two_ranks_equal_one_and_resume_with_other_rank_counts(setup):
    root, src, args = setup
    one, two = root / "one", root / "two"
    assert segment_in_process(*args, f"output={one}") == 0  # the single process: this one
    r2 = _run([*_torchrun(2), *args, f"output={two}"])
    assert r2.returncode == 0, (r2.stdout + r2.stderr)[-4000:]
    logs = r2.stdout + r2.stderr
    assert "rank 0/2: 4 of 8 images" in logs and "rank 1/2: 4 of 8 images" in logs

    # per-image files: masks and region labels byte for byte, the same set of files; the
    # heatmap PNGs hold round(255 R), and a batch of another size may round the forward in
    # the last bit, which can move a pixel across a rounding boundary: one level at most
    for folder in ("masks", "heatmaps", "labels"):
        a, b = _files(one, folder), _files(two, folder)
        assert len(a) == len(SIZES) and a.keys() == b.keys(), folder
        for k in a:
            if folder != "heatmaps":
                assert a[k] == b[k], f"{folder}/{k} differs"
                continue
            x, y = (np.asarray(Image.open(io.BytesIO(v))).astype(int) for v in (a[k], b[k]))
            assert x.shape == y.shape and np.abs(x - y).max() <= 1, f"{folder}/{k} differs"
            assert (x != y).mean() < 0.01, f"{folder}/{k}: {(x != y).mean():.3%} of pixels differ"
    # COCO: same images, annotations and ids as the single process
    _same_coco(one, two)
    m1, m2 = (json.loads((o / "run.json").read_text()) for o in (one, two))
    assert m2["counts"] == m1["counts"] == {"found": 8, "segmented": 7, "resumed": 0, "skipped": 1, "ignored": 0}
    assert m2["world_size"] == 2 and [r["rank"] for r in m2["ranks"]] == [0, 1]
    assert sum(r["segmented"] for r in m2["ranks"]) == 7 and sum(r["skipped"] for r in m2["ranks"]) == 1
    # the sorted list is dealt out round robin; every image done by its rank
    names = [s["name"] for s in m1["images"]]
    assert [s["name"] for s in m2["images"]] == names
    for i, s in enumerate(m2["images"]):
        assert s.get("rank", i % 2) == i % 2, s
    assert any(s["status"] == "skipped" and "broken" in s["source"] for s in m2["images"])
    assert (two / "index.html").read_text().count("<tr>") == (one / "index.html").read_text().count("<tr>")

    # an interrupted rank: the records of 3 images are gone, and so are the run files;
    # rerun with 3 ranks (other shares): only those 3 are redone, the result is whole again
    lost = [n for n in names if not n.startswith("broken")][1::2][:3]
    for n in lost:
        (two / "records" / f"{n}.json").unlink()
    for f in ("annotations.json", "run.json", "index.html"):
        (two / f).unlink()
    r3 = _run([*_torchrun(3), *args, f"output={two}"])
    assert r3.returncode == 0, (r3.stdout + r3.stderr)[-4000:]
    m3 = json.loads((two / "run.json").read_text())
    assert m3["counts"] == {"found": 8, "segmented": 3, "resumed": 4, "skipped": 1, "ignored": 0}
    assert m3["world_size"] == 3
    redone = {s["name"] for s in m3["images"] if s["status"] == "done"}
    assert redone == set(lost)
    _same_coco(one, two)
    assert _files(one, "masks") == _files(two, "masks")


_DYING_METHOD = '''
import os
import signal
import time
from pathlib import Path
from dataclasses import dataclass

from segment.methods import ClsAttention

CALLS = []


@dataclass(frozen=True)
class DieOnRankOne(ClsAttention):
    """CLS attention that kills its own process (SIGKILL, as the kernel's OOM killer does)
    on torchrun rank 1 when asked for its second batch."""

    def __call__(self, record):
        if os.environ.get("RANK") == "1":
            CALLS.append(record.batch_size)
            if len(CALLS) == 2:
                # the first batch's files are written on other threads: let them land first,
                # so the test knows what must survive the kill
                records = Path(os.environ["DYING_RECORDS"])
                deadline = time.monotonic() + 120
                while not any(records.glob("*.json")) and time.monotonic() < deadline:
                    time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGKILL)
        return super().__call__(record)
'''


@pytest.mark.slow
def test_torchrun_a_dying_rank_keeps_finished_images_and_a_rerun_completes_the_run(setup, tmp_path, monkeypatch):
    """One rank killed mid-run (SIGKILL): torchrun fails, every image recorded as done has all
    its files, and the same command in one process resumes those and does only the rest."""
    root, src, args = setup
    (tmp_path / "dying_method.py").write_text(_DYING_METHOD)
    out = tmp_path / "out"
    run_args = [*args, "method=cls_attention", "method._target_=dying_method.DieOnRankOne", f"output={out}"]
    env_path = f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": env_path, "DYING_RECORDS": str(out / "records")}
    r = subprocess.run([*_torchrun(2), *run_args], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0, (r.stdout + r.stderr)[-3000:]
    records = {p.stem: json.loads(p.read_text()) for p in (out / "records").glob("*.json")}
    assert 1 <= len(records) < 7  # rank 1's first batch at least; never the images it had left
    for rec in records.values():  # a recorded image is whole
        for rel in rec["outputs"].values():
            assert (out / rel).is_file() and (out / rel).stat().st_size > 0, rel
    monkeypatch.syspath_prepend(str(tmp_path))  # dying_method (it kills rank 1 only)
    assert segment_in_process(*run_args) == 0  # the same command in one process: this one
    man = json.loads((out / "run.json").read_text())
    resumed = {s["name"] for s in man["images"] if s["status"] == "resumed"}
    assert set(records) <= resumed  # (rank 0 may finish the file it was writing when told to stop)
    assert man["counts"]["resumed"] == len(resumed)
    assert man["counts"]["segmented"] + man["counts"]["resumed"] == 7 and man["counts"]["skipped"] == 1
