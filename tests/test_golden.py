"""Byte-identity of the default recipe's outputs (issue 43: refactors must not change them).

``segment`` on the bundled examples and ``segment-eval`` on ecssd-dev, both with the real
DINOv2 ViT-S/14, are run as a user runs them and checked twice:

- on any machine, a **summary** of what they wrote (regions, escape probabilities, mask and
  region areas, heatmap means; the evaluator's metric rows) against
  ``tests/golden/summary/NAME.json``, within a tolerance far below what a change of recipe
  moves and far above float rounding;
- where ``tests/golden/PLATFORM/NAME.json`` exists for this machine's CPU kernels
  (architecture, vendor, the instruction set torch dispatches to) and the same versions of
  torch, numpy, Pillow, OpenCV and SciPy, **every file byte for byte**: images (labels,
  masks, heatmaps, overlays, the gallery, the evaluator's panels) and tables exactly, JSON
  after dropping what changes from run to run on its own (wall-clock times, dates, absolute
  paths, the source file's mtime and the config fingerprint, which hashes the checkpoint's
  path). Float rounding differs between CPUs (on an AMD EPYC with AVX-512, heatmap levels
  and the last digits of the per-image floats in records and the metric cache differ from
  the machine that wrote the first manifest, labels and masks do not;
  eval/results/dev_set records such cases), so a platform without a manifest skips this half
  with its reason, after the summary has passed.

After a change that is meant to change the outputs, run with ``SEGMENT_GOLDEN_UPDATE=1``: it
rewrites the summary and this platform's manifest and drops the other platforms' (now
stale) manifests; say why in the commit. ``SEGMENT_GOLDEN_UPDATE=platform`` adds this
platform's manifest without touching the summary, and only after the summary has passed.
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

# keys whose values change from run to run (or clone to clone) by themselves, and the
# machine's own record (threads, cores): the outputs must not depend on them
VOLATILE = {"started", "finished", "output", "timings", "seconds", "date_created",
            "images_per_s", "method_ms_per_image", "source_path", "source_mtime_ns",
            "fingerprint", "root", "checkpoint", "input", "torch_threads", "cpu_count"}
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


def platform_key() -> str:
    """The CPU kernels' platform: architecture, vendor, the instruction set torch dispatches
    to and the core NumPy/SciPy's OpenBLAS runs (the cuts' dense eigensolver):
    ``x86_64-AuthenticAMD-AVX512-SkylakeX``. On the AMD EPYC development VM OpenBLAS
    reports ``Zen`` or ``SkylakeX`` from one process to the next; the manifests of both
    hold the same bytes (checked on 2026-12-07)."""
    import platform

    import threadpoolctl
    import torch

    vendor = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                vendor = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    vendor = vendor or platform.processor() or "unknown"
    import numpy  # noqa: F401 - loads the BLAS threadpoolctl reads
    import scipy.linalg  # noqa: F401

    cores = [i.get("architecture") or i.get("internal_api") for i in threadpoolctl.threadpool_info()
             if i.get("user_api") == "blas"]
    blas = cores[0] if cores else "noblas"
    return f"{platform.machine()}-{vendor}-{torch.backends.cpu.get_cpu_capability()}-{blas}"


def stack() -> dict[str, str]:
    """Versions of the libraries whose kernels and encoders make the bytes."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("torch", "numpy", "pillow", "opencv-python", "opencv-python-headless", "scipy"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            continue
    return out


def _mismatches(got, want, tol: float, where: str = "") -> list[str]:
    """Where ``got`` differs from ``want``: ints, strings and structure exactly, floats
    within ``tol``."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or sorted(got) != sorted(want):
            return [f"{where or '.'}: keys {sorted(got) if isinstance(got, dict) else got} != {sorted(want)}"]
        return [m for k in want for m in _mismatches(got[k], want[k], tol, f"{where}/{k}")]
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{where}: {got} != {want}"]
        return [m for i, (g, w) in enumerate(zip(got, want)) for m in _mismatches(g, w, tol, f"{where}[{i}]")]
    if isinstance(want, float) or isinstance(got, float):
        ok = isinstance(got, (int, float)) and abs(got - want) <= tol
        return [] if ok else [f"{where}: {got} != {want} (tolerance {tol})"]
    return [] if got == want else [f"{where}: {got!r} != {want!r}"]


def _check(name: str, root: Path, summary: dict, tol: float, paths: tuple[Path, ...] = ()) -> None:
    update = os.environ.get("SEGMENT_GOLDEN_UPDATE", "")
    spath = GOLDEN / "summary" / f"{name}.json"
    mpath = GOLDEN / platform_key() / f"{name}.json"
    if update == "1":
        spath.parent.mkdir(parents=True, exist_ok=True)
        spath.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
        for stale in GOLDEN.glob(f"*/{name}.json"):
            if stale.parent.name != "summary" and stale != mpath:
                stale.unlink()
    bad = _mismatches(json.loads(json.dumps(summary)), json.loads(spath.read_text()), tol)
    assert not bad, f"{len(bad)} summary values of {name} moved: {bad[:8]}"
    got = manifest(root, paths)
    if update in ("1", "platform"):
        mpath.parent.mkdir(parents=True, exist_ok=True)
        mpath.write_text(json.dumps({"stack": stack(), "files": got}, indent=1, sort_keys=True) + "\n")
    if not mpath.exists():
        pytest.skip(f"summary of {name} matched; byte identity not checked: no manifest for "
                    f"{platform_key()} under tests/golden (SEGMENT_GOLDEN_UPDATE=platform writes one)")
    recorded = json.loads(mpath.read_text())
    if recorded["stack"] != stack():
        pytest.skip(f"summary of {name} matched; byte identity not checked: {mpath.relative_to(GOLDEN)}"
                    f" was written with {recorded['stack']}, this is {stack()}")
    want = recorded["files"]
    assert sorted(got) == sorted(want), (
        f"files written differ: new {sorted(set(got) - set(want))},"
        f" missing {sorted(set(want) - set(got))}")
    changed = [k for k in want if got[k] != want[k]]
    assert not changed, f"{len(changed)} of {len(want)} outputs changed: {changed[:8]}"


def examples_summary(out: Path) -> dict:
    """Per image: regions, the escape probabilities of the token regions of the default level
    (``method.escape`` of run.json's config, in the tree's order: what the cuts decided,
    before the pixel refinement and the components; read from ``hierarchy/``) and the label
    map's region areas (fractions of the image, largest first), the mask's fraction and the
    heatmap's mean (0..1)."""
    import numpy as np
    from PIL import Image

    from segment.run.job.hierarchy_files import load_hierarchy

    level = float(json.loads((out / "run.json").read_text())["config"]["method"]["escape"])
    summary = {}
    for path in sorted((out / "records").glob("*.json")):
        rec = json.loads(path.read_text())
        labels = np.asarray(Image.open(out / rec["outputs"]["labels"]))
        areas = np.unique(labels, return_counts=True)[1] / labels.size
        heat = np.asarray(Image.open(out / rec["outputs"]["heatmap"]), dtype=np.float64)
        tree = load_hierarchy(out / rec["outputs"]["hierarchy"])[0]
        summary[rec["name"]] = {
            "num_regions": rec["num_regions"],
            "escape": [round(float(e), 6) for e in tree.escape_at(level)],
            "region_areas": sorted(areas.tolist(), reverse=True),
            "mask_fraction": rec["mask_fraction"], "heatmap_mean": heat.mean() / 255}
    return summary


def eval_summary(out: Path) -> dict:
    """Per method: the metric row of results.json (percent), without intervals and timings."""
    return {r["method"]: {k: v for k, v in r.items()
                          if k not in VOLATILE and k not in ("method", "ci95")}
            for r in json.loads((out / "results.json").read_text())}


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
    # tolerance: threads and CPU kernels moved no label map of the 701 dev images and the
    # chains by <= 2.6e-7 (docs/benchmarks.md "Numbers across machines"); 2e-3 covers the
    # summary's 6-digit rounding and such float noise, not a moved region
    _check("segment_examples", out, examples_summary(out), 2e-3, (EXAMPLES,))


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
    # tolerance (metric points): no ecssd-dev label map moved with threads or kernels
    # (docs/benchmarks.md "Numbers across machines"); the companions' rows (rollout, keys)
    # are heatmaps thresholded at the mean, whose float noise moves a few border pixels
    # (Pillow 12.3 moved them by 0.05, hence pillow >= 13): 0.05 stays below one image's share
    _check("eval_ecssd", out, eval_summary(out), 0.05, (ecssd_dev,))
    # the README's ecssd-dev headline row, its committed table, within the reproduce spread
    from segment.eval import reproduce

    row = next(r for r in reproduce.ROWS if r.name == "ecssd-dev")
    committed = json.loads(row.table.with_suffix(".json").read_text())
    assert reproduce.compare(committed, list(rows.values())) == []


def test_summary_comparison_tolerates_rounding_not_changes():
    """The cross-platform half: float rounding passes, a moved region count, a float beyond
    the tolerance, a lost region or a renamed key is reported with where it is."""
    want = {"a": {"num_regions": 3, "escape": [0.2, 0.02], "areas": [0.5, 0.3, 0.2]}}
    same = {"a": {"num_regions": 3, "escape": [0.2 + 1e-9, 0.02], "areas": [0.5, 0.3, 0.2 - 1e-4]}}
    assert _mismatches(same, want, 2e-3) == []
    assert _mismatches({"a": {**same["a"], "num_regions": 4}}, want, 2e-3) == ["/a/num_regions: 4 != 3"]
    far = {"a": {**same["a"], "escape": [0.2, 0.03]}}
    assert _mismatches(far, want, 2e-3) == ["/a/escape[1]: 0.03 != 0.02 (tolerance 0.002)"]
    assert _mismatches({"a": {**same["a"], "escape": [0.2]}}, want, 2e-3)[0].startswith("/a/escape:")
    assert "keys" in _mismatches({"b": same["a"]}, want, 2e-3)[0]
    assert platform_key().count("-") >= 2 and "torch" in stack()


@pytest.mark.shared
@pytest.mark.slow
def test_companion_methods_never_move_the_default(tmp_path, dinov2_weights, ecssd_dev):
    """Capture never changes the forward: the default's per-image metric states and its row
    are byte-identical whether it runs alone, beside rollout (every layer captured) or beside
    the CLS rows (last layer and its keys), on the same machine."""
    runs = {}
    for label, methods in (("alone", "null"), ("rollout", "[rollout]"),
                           ("cls", "[cls_keychain,cls_attention]")):
        out = tmp_path / label
        _cli("segment-eval", "dataset=folder", f"dataset.root={ecssd_dev}", f"output={out}",
             f"model.checkpoint={dinov2_weights}", f"methods={methods}", "limit=12", "progress=false")
        row = json.loads((out / "results.json").read_text())[0]
        assert row["method"] == "cuts"
        states = {}
        for path in sorted(out.glob("cache/*/*.json")):
            states[path.name] = json.loads(path.read_text())["methods"]
        runs[label] = ({k: v for k, v in row.items() if k not in VOLATILE}, states)
    (row, states) = runs["alone"]
    assert len(states) == 12 and all(len(s) == 1 for s in states.values())
    for label in ("rollout", "cls"):
        other_row, other_states = runs[label]
        assert other_row == row, label
        for name, s in states.items():
            (key, state), = s.items()  # the default's entry: the same key in every run
            assert other_states[name][key] == state, (label, name)
