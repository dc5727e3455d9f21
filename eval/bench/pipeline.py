"""Benchmark: throughput of the whole ``segment`` pipeline against a bare fused forward.

``python -m segment.eval.bench pipeline [options] [hydra overrides]``

Both are measured in the same process, on the same images, with the same backbone object,
batch size and thread count, interleaved (bare, pipeline, bare, pipeline, ...) so that a
busy machine slows both alike; the medians are reported.

- **bare forward**: ``backbone.forward_plain`` (fused attention everywhere, nothing
  captured) on batches of already preprocessed images; decoding and resizing are not
  counted. This is the speed of the model alone.
- **pipeline**: :class:`segment.run.job.pipeline.SegmentRun` on a folder of the same images into a
  fresh output folder: listing, decoding, EXIF, preprocessing, attention capture, the
  method, protocol post-processing at the original resolution, every output file, per-image
  records, ``annotations.json``, ``index.html`` and ``run.json``. Only building the model is
  left out (done once, before timing).

- ``--against 'OVERRIDES'``: the pipeline with other settings in the same rounds (the
  order alternates), for an A/B on the same machine minutes.

The target (issues 3 and 13) is ``pipeline >= 0.75 x bare``, at 224 and 448 px
(``--size 448``). Besides the two images/s it prints the ratio of CPU seconds per image,
the machine's idle core time while each side ran (Linux ``/proc/stat``; on an otherwise
idle machine the wall ratio is the CPU-time ratio times the pipeline's busy share of the
cores over the bare forward's) and each stage's CPU cost alone.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from segment.methods.base import Method
from segment.models.base import Backbone
from segment.eval.bench.common import machine
from segment.utils import atomic_write_json, torch_threads

_DEFAULT_CKPT = "weights/dinov2_vits14.safetensors"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m segment.eval.bench pipeline",
        description="images/s of the whole segment pipeline vs a bare fused forward of the same model",
    )
    p.add_argument("--input", type=Path, default=None,
                   help="folder of images (default: the bundled examples, repeated to --images)")
    p.add_argument("--images", type=int, default=48, help="number of images (default 48)")
    p.add_argument("--model", default="dinov2_vits14", help="model config name (configs/model)")
    p.add_argument("--method", default="cls_attention", help="method config name (configs/method)")
    p.add_argument("--checkpoint", default=None,
                   help=f"local weights; default: $SEGMENT_SHARED/{_DEFAULT_CKPT} when present,"
                        " else random weights (same compute)")
    p.add_argument("--size", type=int, default=None,
                   help="model input size in px (model.image_size; default: the model config's)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--workers", type=int, default=None, help="segment num_workers (default: config)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repetitions (median)")
    p.add_argument("--against", default=None, metavar="OVERRIDES",
                   help="also time the pipeline with these Hydra overrides (space-separated, e.g. "
                        "'method.refine_steps=0') in every round, in alternating order with the default: an A/B "
                        "on the same machine minutes")
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    p.add_argument("--config-dir", type=Path, default=None,
                   help="a config folder instead of the packaged segment.configs")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. model.image_size=448")
    return p


def _compose(args: argparse.Namespace, overrides: list[str]):
    from hydra import compose, initialize_config_dir, initialize_config_module

    if args.config_dir is not None:
        ctx = initialize_config_dir(version_base="1.3", config_dir=str(args.config_dir.resolve()))
    else:
        ctx = initialize_config_module(version_base="1.3", config_module="segment.configs")
    with ctx:
        return compose("segment", overrides=overrides)


def _prepare_input(args: argparse.Namespace, tmp: Path) -> Path:
    """The benchmark folder: ``--input`` as is (first ``--images`` files), or the bundled
    examples copied round-robin to ``--images`` files."""
    from segment.run.io import bundled_examples, find_images

    dst = tmp / "images"
    dst.mkdir()
    if args.input is not None:
        files = find_images(args.input).files[: args.images]
    else:
        with bundled_examples() as ex:
            base = find_images(ex).files
            files = [base[i % len(base)] for i in range(args.images)]
            for i, f in enumerate(files):
                shutil.copyfile(f.path, dst / f"{i:04d}_{f.path.name}")
            return dst
    for i, f in enumerate(files):
        shutil.copyfile(f.path, dst / f"{i:04d}_{f.path.name}")
    return dst


def _cpu_jiffies(stat: str | os.PathLike = "/proc/stat") -> tuple[int, int] | None:
    """``(idle, total)`` clock ticks of all cores since boot from Linux's ``/proc/stat``
    (idle counts ``iowait`` too), or ``None`` where there is no such file."""
    try:
        with open(stat) as f:
            first = f.readline().split()
    except OSError:
        return None
    if not first or first[0] != "cpu" or len(first) < 5:
        return None
    ticks = [int(v) for v in first[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
    total = sum(ticks[:8])
    return ticks[3] + ticks[4], total


def _idle_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of all cores' time that was idle between two :func:`_cpu_jiffies`."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stage_costs(backbone: Backbone, method: Method, files: list, batches: list, n: int, out: Path,
                 cfg: Any) -> dict[str, float]:
    """CPU milliseconds per image of each stage run alone, one after the other (no overlap).

    Less sensitive to other processes than wall time: ``bare / (read + model + write)`` is
    the ratio the pipeline would reach with no overlap at all (a lower bound). Each stage
    runs as the pipeline runs it: reading and preprocessing on one torch thread, the method
    through :meth:`Segmenter.apply`,
    post-processing and writing on one torch thread.
    """
    from segment.core.masks import label_upsampling_setting
    from segment.run.api.segmenter import Segmenter
    from segment.run.io import read_image
    from segment.run.api.render import RenderOptions, postprocess, single_threaded_rendering
    from segment.run.job.records import write_image
    from segment.run.job.pipeline import config_fingerprint

    opts = RenderOptions(**OmegaConf.to_container(cfg.render, resolve=True))
    device = torch.device(backbone.device)
    c0 = time.process_time()
    with torch_threads(1):  # as the pipeline's reader threads
        loaded = [read_image(f.path) for f in files]
        for im in loaded:
            backbone.preprocess(im.image)
    read = time.process_time() - c0
    c0 = time.process_time()
    for b in batches:
        backbone.forward_plain(b)
    _sync(device)
    bare = time.process_time() - c0
    segmenter = Segmenter(backbone, method)
    capture = method.capture(backbone.num_layers)
    outs = []
    c0 = time.process_time()
    with torch.no_grad():
        for b in batches:
            o = segmenter.apply(backbone.extract(b, capture))
            outs += [(o, i) for i in range(b.shape[0])]
    _sync(device)
    model = time.process_time() - c0
    fp = config_fingerprint(cfg)
    labels = label_upsampling_setting(cfg.get("label_upsampling"))
    c0 = time.process_time()
    # as the pipeline's writer threads render: one torch thread, OpenCV's pool off
    with torch_threads(1), single_threaded_rendering():
        for k, (f, im) in enumerate(zip(files, loaded)):  # heatmaps of other images: same cost
            o, i = outs[k % len(outs)]
            seg = postprocess(o, i, im.size, labels)
            write_image(out, f.name, np.asarray(im.image), seg, opts, source=f.rel,
                        source_path=str(f.path), source_bytes=0, source_mtime_ns=0, fingerprint=fp)
    write = time.process_time() - c0
    ms = lambda t: round(1000 * t / n, 2)  # noqa: E731
    return {"read_preprocess": ms(read), "bare_forward": ms(bare), "extract_method": ms(model),
            "postprocess_write": ms(write)}


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Measure; returns the result dict (also printed by :func:`main`)."""
    from hydra.utils import instantiate

    from segment.run.io import find_images, read_image
    from segment.run.job.pipeline import SegmentRun

    if args.threads:
        torch.set_num_threads(args.threads)
    ckpt = args.checkpoint
    if ckpt is None and os.environ.get("SEGMENT_SHARED"):
        cand = Path(os.environ["SEGMENT_SHARED"]) / _DEFAULT_CKPT
        ckpt = str(cand) if cand.is_file() and args.model == "dinov2_vits14" else None
    base = [f"model={args.model}", f"method={args.method}", f"device={args.device}",
            f"batch_size={args.batch_size}", "progress=false", "overwrite=true"]
    if args.workers is not None:
        base.append(f"num_workers={args.workers}")
    base += [f"model.checkpoint='{ckpt}'"] if ckpt else ["model.pretrained=false"]
    if args.size is not None:
        base.append(f"model.image_size={args.size}")
    base += list(args.overrides)

    with tempfile.TemporaryDirectory(prefix="segment-bench-") as tmp_s:
        tmp = Path(tmp_s)
        src = _prepare_input(args, tmp)
        cfg = _compose(args, base + [f"input='{src}'", f"output='{tmp / 'warmup'}'"])
        t0 = time.perf_counter()
        backbone = instantiate(cfg.model)
        method = instantiate(cfg.method)
        load_s = time.perf_counter() - t0
        device = torch.device(backbone.device)
        files = find_images(src).files
        n = len(files)
        if n == 0:
            raise SystemExit(f"no images under {src}")
        pix = [backbone.preprocess(read_image(f.path).image) for f in files]
        sizes = {tuple(p.shape) for p in pix}
        batches = []
        for s in sizes:  # same grouping as the pipeline: one size per batch
            group = [p for p in pix if tuple(p.shape) == s]
            batches += [torch.stack(group[i : i + args.batch_size]) for i in range(0, len(group), args.batch_size)]
        if device.type == "cuda":
            batches = [b.to(device) for b in batches]

        # warm-up: both paths once (allocator, pos_embed cache, thread pools)
        backbone.forward_plain(batches[0])
        capture = method.capture(backbone.num_layers)
        with torch.no_grad():
            method(backbone.extract(batches[0], capture))
        _sync(device)

        bare, pipe_proc, pipe_total, runs, alt_total = [], [], [], [], []
        against = args.against.split() if args.against else None
        bare_cpu, pipe_cpu, bare_idle, pipe_idle = [], [], [], []
        for r in range(args.repeats):
            _sync(device)
            j0, c0, t0 = _cpu_jiffies(), time.process_time(), time.perf_counter()
            for b in batches:
                backbone.forward_plain(b)
            _sync(device)
            bare.append(n / (time.perf_counter() - t0))
            bare_cpu.append((time.process_time() - c0) / n)
            bare_idle.append(_idle_share(j0, _cpu_jiffies()))

            sides = ["default", "against"] if against is not None else ["default"]
            for side in sides if r % 2 == 0 else sides[::-1]:  # alternating order
                out = tmp / f"{'out' if side == 'default' else 'against'}{r}"
                cfg_r = _compose(args, base + (against if side == "against" else []) +
                                 [f"input='{src}'", f"output='{out}'"])
                run = SegmentRun(cfg_r, backbone=backbone, method=method)
                j0, c0, t0 = _cpu_jiffies(), time.process_time(), time.perf_counter()
                code = run.run()
                total = time.perf_counter() - t0
                if code != 0:
                    raise SystemExit(f"the pipeline run failed with exit code {code}; see {out}/run.json")
                if side == "against":
                    alt_total.append(n / total)
                    continue
                pipe_cpu.append((time.process_time() - c0) / n)
                pipe_idle.append(_idle_share(j0, _cpu_jiffies()))
                pipe_total.append(n / total)
                pipe_proc.append(n / run.state.timings.processing_s)
                runs.append({k: round(v, 4) for k, v in run.state.timings.__dict__.items() if isinstance(v, float)})
            # every round's files stay until the end (the temporary folder goes then): on ext4
            # without a journal, creating a file skips the inodes deleted in the last minute
            # or so, one by one, so deleting a round's ~500 files made the next round's
            # writes pay ~10 ms of kernel CPU per image (measured here: 0.721 against 0.747)

        cfg_r = _compose(args, base + [f"input='{src}'", f"output='{tmp / 'stages_cfg'}'"])
        stages = _stage_costs(backbone, method, files, batches, n, tmp / "stages", cfg_r)

    med = statistics.median
    result = {
        "images": n,
        "input": str(args.input) if args.input else "bundled examples (repeated)",
        "input_sizes": sorted({f"{p.shape[-1]}x{p.shape[-2]}" for p in pix}),
        "model": backbone.name,
        "weights": ckpt or "random (same compute)",
        "method": method.name,
        "device": str(device),
        "machine": machine(device),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "num_workers": cfg.get("num_workers"),
        "batch_size": args.batch_size,
        "model_load_s": round(load_s, 3),
        "bare_forward_img_s": [round(v, 3) for v in bare],
        "pipeline_img_s": [round(v, 3) for v in pipe_total],
        "pipeline_processing_img_s": [round(v, 3) for v in pipe_proc],
        "bare_forward_median": round(med(bare), 3),
        "pipeline_median": round(med(pipe_total), 3),
        # each round times the bare forward and the pipeline back to back: the median of the
        # rounds' ratios is steadier than a ratio of medians when the machine's speed drifts
        "round_ratios": [round(p / q, 3) for p, q in zip(pipe_total, bare)],
        "ratio": round(med(p / q for p, q in zip(pipe_total, bare)), 3),
        "bare_cpu_s_per_image": round(med(bare_cpu), 4),
        "pipeline_cpu_s_per_image": round(med(pipe_cpu), 4),
        "cpu_ratio": round(med(bare_cpu) / med(pipe_cpu), 3),
        # the machine's idle core time while each ran (Linux /proc/stat; None elsewhere): on
        # an otherwise idle machine the wall ratio is the CPU-time ratio times the pipeline's
        # busy share of the cores over the bare forward's
        "bare_idle_share": _median_or_none(bare_idle),
        "pipeline_idle_share": _median_or_none(pipe_idle),
        "target_ratio": 0.75,
        "pipeline_timings": runs,
        "stages_cpu_ms_per_image": stages,
        "serial_ratio": round(stages["bare_forward"] / (stages["read_preprocess"] + stages["extract_method"]
                                                        + stages["postprocess_write"]), 3),
    }
    result["meets_target"] = result["ratio"] >= result["target_ratio"]
    if against is not None:
        result["against"] = {
            "overrides": against,
            "img_s": [round(v, 3) for v in alt_total],
            "median": round(med(alt_total), 3),
            "ratio": round(med(a / q for a, q in zip(alt_total, bare)), 3),
            # the default's images/s over the other's, round by round (> 1: the default is faster)
            "default_over_against": [round(p / a, 3) for p, a in zip(pipe_total, alt_total)],
        }
    return result


def _median_or_none(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return round(statistics.median(got), 4) if got else None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m segment.eval.bench pipeline``; returns 0 (measurement done)."""
    args = parser().parse_args(argv)
    res = run_benchmark(args)
    print(f"segment pipeline benchmark: {res['images']} images ({', '.join(res['input_sizes'])} model input), "
          f"{res['model']} [{res['weights']}], {res['method']}, {res['device']} ({res['machine']}), "
          f"{res['torch_threads']} torch threads (OMP_WAIT_POLICY={res['omp_wait_policy'] or 'unset'}), "
          f"batch {res['batch_size']}")
    print(f"  bare fused forward : {res['bare_forward_median']:8.2f} img/s  (runs {res['bare_forward_img_s']})")
    print(f"  whole pipeline     : {res['pipeline_median']:8.2f} img/s  (runs {res['pipeline_img_s']})")
    print(f"  ratio              : {res['ratio']:.3f}  (target >= {res['target_ratio']}: "
          f"{'met' if res['meets_target'] else 'NOT met'}; median of the back-to-back rounds "
          f"{res['round_ratios']})")
    print(f"  CPU time per image : bare {res['bare_cpu_s_per_image']:.4f} s, pipeline "
          f"{res['pipeline_cpu_s_per_image']:.4f} s (all threads; bare/pipeline = {res['cpu_ratio']:.3f})")
    if res["pipeline_idle_share"] is not None and res["bare_idle_share"] is not None:
        print(f"  idle core time     : bare {100 * res['bare_idle_share']:.1f}%, pipeline "
              f"{100 * res['pipeline_idle_share']:.1f}% (of all cores, the whole machine; /proc/stat)")
    st = res["stages_cpu_ms_per_image"]
    print(f"  stages alone (CPU ms/img): read+preprocess {st['read_preprocess']}, extract+method "
          f"{st['extract_method']}, post-process+write {st['postprocess_write']}; bare forward "
          f"{st['bare_forward']} -> ratio without any overlap {res['serial_ratio']:.3f}")
    if "against" in res:
        a = res["against"]
        faster = sum(v > 1 for v in a["default_over_against"])
        print(f"  against {' '.join(a['overrides'])}: "
              f"{a['median']:.2f} img/s, ratio {a['ratio']:.3f}; default / against per round "
              f"{a['default_over_against']} (default faster in {faster} of {len(a['default_over_against'])})")
    last = res["pipeline_timings"][-1]
    print("  last pipeline run  : " + ", ".join(f"{k}={v}" for k, v in last.items() if v))
    if args.json:
        atomic_write_json(args.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
