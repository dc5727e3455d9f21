"""Byte-identity of the default recipe's outputs (issue 43: refactors must not change them).

``segment`` on the bundled examples and ``segment-eval`` on ecssd-dev, both with the real
DINOv2 ViT-S/14, are run as a user runs them; every file they write is hashed and compared
with the manifest under ``tests/golden/``. Images (labels, masks, heatmaps, overlays, the
gallery, the evaluator's panels) and tables are compared byte for byte; JSON files are
compared after dropping what changes from run to run on its own (wall-clock times, dates,
absolute paths, the source file's mtime and the config fingerprint, which hashes the
checkpoint's path).

The manifest holds the outputs of this machine's CPU kernels: on another CPU, float rounding
may move a pixel (eval/results/dev_set records such a case), so the test runs where the
development assets are (``SEGMENT_SHARED``, set by ``.ci/run``). After a change that is meant
to change the outputs, rewrite the manifest with ``SEGMENT_GOLDEN_UPDATE=1`` and say why in
the commit.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import assert_results_equal_files

GOLDEN = Path(__file__).parent / "golden"
EXAMPLES = Path(__file__).resolve().parents[1] / "datasets" / "examples"

# keys whose values change from run to run (or clone to clone) by themselves
VOLATILE = {"started", "finished", "output", "timings", "seconds", "date_created",
            "images_per_s", "method_ms_per_image", "source_path", "source_mtime_ns",
            "fingerprint", "root", "checkpoint", "input"}
# files that record the invocation (paths, the command line), not the outputs
SKIP_PARTS = {".hydra", "cli.log", "config.yaml"}


def _clean(node):
    if isinstance(node, dict):
        return {k: _clean(v) for k, v in node.items() if k not in VOLATILE}
    if isinstance(node, list):
        return [_clean(v) for v in node]
    return node


def manifest(root: Path, paths: tuple[Path, ...] = ()) -> dict[str, str]:
    """sha256 of every output file under ``root``; ``paths`` (the input folder) are written
    as ``INPUT`` in text files first (the gallery links to the sources: absolute and
    relative paths that depend on where the checkout and the output are)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if not p.is_file() or SKIP_PARTS & set(rel.parts):
            continue
        key = rel.as_posix()
        if rel.parts[0] == "cache" and len(rel.parts) == 3:
            # the cache folder is named by the fingerprint, which hashes the data set's and
            # the checkpoint's paths: the same outputs live under another name in another clone
            key = f"cache/FINGERPRINT/{rel.parts[2]}"
        data = p.read_bytes()
        if p.suffix == ".json":
            data = json.dumps(_clean(json.loads(data)), sort_keys=True).encode()
        elif p.suffix in (".html", ".md", ".csv"):
            text = data.decode().replace("<wbr>", "")  # the gallery's line-break hints
            for q in paths:
                for form in (os.path.relpath(q, p.parent), str(q)):
                    text = text.replace(form, "INPUT")
            data = text.encode()
        out[key] = hashlib.sha256(data).hexdigest()
    return out


def _check(name: str, root: Path, paths: tuple[Path, ...] = ()) -> None:
    got = manifest(root, paths)
    path = GOLDEN / f"{name}.json"
    if os.environ.get("SEGMENT_GOLDEN_UPDATE") == "1":
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(path.read_text())
    assert sorted(got) == sorted(want), (
        f"files written differ: new {sorted(set(got) - set(want))},"
        f" missing {sorted(set(want) - set(got))}")
    changed = [k for k in want if got[k] != want[k]]
    assert not changed, f"{len(changed)} of {len(want)} outputs changed: {changed[:8]}"


def _cli(tool: str, *args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name(tool)
    r = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return r


@pytest.mark.slow
def test_segment_examples_byte_identical(tmp_path, dinov2_weights):
    """The README's first command (the bundled examples by default): every output
    byte-identical to the manifest, the demo's run record and last line as a newcomer reads
    them, and the Python API's masks, heatmaps and labels equal to the files it wrote."""
    import numpy as np
    from PIL import Image

    import segment

    out = tmp_path / "seg"
    r = _cli("segment", f"output={out}", f"model.checkpoint={dinov2_weights}")
    assert r.stdout.strip().splitlines()[-1] == f"gallery: {out / 'index.html'}"
    _check("segment_examples", out, (EXAMPLES,))
    man = json.loads((out / "run.json").read_text())
    assert man["counts"]["segmented"] == 3 and man["model"] == "dinov2_vits14"
    assert Path(man["input"]).resolve() == EXAMPLES
    # the example folder holds only the photos: the demo run reports nothing as ignored
    assert man["counts"]["ignored"] == 0 and "ignored" not in r.stdout + r.stderr, r.stderr
    names = ["astronaut", "chelsea", "coffee"]
    results = segment.load(checkpoint=dinov2_weights, device="cpu")([EXAMPLES / f"{n}.png" for n in names])
    assert all(res.labels is not None for res in results)  # the default gives regions
    assert_results_equal_files(results, out, names)
    for n in names:
        m = np.asarray(Image.open(out / "masks" / f"{n}.png")) > 0
        assert m.shape == Image.open(EXAMPLES / f"{n}.png").size[::-1]
        assert 0.05 < m.mean() < 0.95, (n, m.mean())


# ecssd-dev/REFERENCE.md: the protocol-fidelity rows (pixAcc, mIoU, mIoU_CA, mAP)
ECSSD_REFERENCE = {
    "cls_attention": {"pixAcc": 87.74, "mIoU": 72.64, "mIoU_CA": 78.15, "mAP": 89.89},
    "rollout": {"pixAcc": 77.66, "mIoU": 57.57, "mIoU_CA": 63.48, "mAP": 86.98},
    "cls_keychain": {"pixAcc": 91.35, "mIoU": 80.36, "mIoU_CA": 84.08, "mAP": 95.74},  # strongest peer
}


@pytest.mark.shared
@pytest.mark.slow
def test_segment_eval_ecssd_byte_identical_and_reference_rows(tmp_path, dinov2_weights, ecssd_dev):
    """``segment-eval`` on ecssd-dev: the default's row first, then REFERENCE.md's
    protocol-fidelity rows and the seed-and-grow method from the same backbone pass; every
    output byte-identical to the manifest, and the reference rows within 0.1 of REFERENCE.md."""
    out = tmp_path / "ev"
    _cli("segment-eval", "dataset=folder", f"dataset.root={ecssd_dev}", f"output={out}",
         f"model.checkpoint={dinov2_weights}", "methods=[cls_attention,rollout,cls_keychain,regions]")
    rows = {r["method"]: r for r in json.loads((out / "results.json").read_text())}
    assert list(rows)[0] == "cuts" and all(r["images"] == 100 for r in rows.values())
    for method, ref in ECSSD_REFERENCE.items():
        for k, v in ref.items():
            assert rows[method][k] == pytest.approx(v, abs=0.1), (method, k, rows[method][k], v)
    # both region recipes (the default, cuts, and seed-and-grow) are ahead of CLS attention,
    # the protocol's floor; the default is ahead of the strongest peer as well
    cls = rows["cls_attention"]
    for method in ("cuts", "regions"):
        r = rows[method]
        assert r["mIoU"] > cls["mIoU"] + 2 and r["pixAcc"] > cls["pixAcc"] and r["mAP"] > cls["mAP"], r
    assert rows["cuts"]["mIoU"] > rows["cls_keychain"]["mIoU"]
    _check("eval_ecssd", out, (ecssd_dev,))
