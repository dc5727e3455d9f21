"""GPU self-check: every device path against the CPU result for the same inputs.

``python -m segment.eval.bench gpu [--quick] [--json PATH] [--device cuda[:N]] [--weights PATH]``

On a CUDA device each check computes a reference on the CPU and the same thing on the
device, and compares them within the tolerance printed next to it:

- **capture**: attention probabilities of every layer and head captured on the device in
  fp32 and in bf16 against the CPU fp32 capture (the same weights and images);
- **method**: every method of ``configs/method`` (ViT methods on the ViT record; the FLUX
  method ``concept_attention`` on the tiny FLUX record), run on the device from the CPU's
  record moved there: heatmap error, mask disagreement away from the threshold, agreement
  of the region partitions;
- **regions**: kornia's union-find connected components (the CUDA back-end of
  :func:`segment.backends.connected_regions`) against scikit-image's, ids and all, exactly;
  :func:`segment.core.masks.smooth_labels_at` on the device against the CPU, exactly;
- **markov**: TokenRank on the device against the CPU, ``|lambda_2|`` (fast path, fp32) on
  the device against dense float64 eigenvalues on the CPU (protocol: 1e-4);
- **cuts**: the default method's cuts with the Krylov eigensolver forced at every region
  size on the device against the dense solver on the CPU (differences that are not
  near-ties, :func:`segment.eval.bench.cutcheck.first_differences`: none), and the
  iterative stationary distribution (:func:`segment.core.markov.stationary`) on the device
  against the exact dense solve on the CPU;
- **flux**: the tiny FLUX (``models/flux_tiny.py``) captured on the device with and without
  offload against the CPU;
- **e2e**: ``segment`` and ``segment-eval`` on a few images with ``device=cpu`` and with
  the device: masks and heatmap files, and the metric rows.

It also measures ratios on the device against the bare fused forward of the same model in
the same run: the whole ``segment`` pipeline (``segment.eval.bench.pipeline``), the region stage,
and ``lambda_2`` against dense ``eigvals`` per head.

The model is the tiny random ViT (``vit_tiny_random``, weights saved once so that both
devices load the same ones) and, when ``$SEGMENT_SHARED`` (or ``--weights``) provides them
and ``--quick`` is not given, the shared DINOv2 ViT-S/14 too.

Without CUDA it says so, runs the **CPU half** (the same checks with the CPU as the
"device": bf16 against fp32, kornia against scikit-image, the Krylov ``lambda_2`` against dense
float64 are real comparisons there; the others compare the CPU with itself) and exits 0
unless a check failed. The JSON (``--json``) holds every check and the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from segment.eval.bench.common import best_time, find_weights, sync

from segment.utils import atomic_write_json

# tolerances (stated in the output next to every check)
TOL_CAPTURE_FP32 = 2e-3  # max |attention prob| difference, TF32 off
TOL_CAPTURE_TF32 = 1e-2  # the same with PyTorch's default cuDNN TF32 convolutions (the patch embedding)
TOL_CAPTURE_BF16 = 0.05  # bf16 against the fp32 CPU capture: mean total-variation distance of the
#   attention rows (worst layer); single entries may differ by 0.4 (DINOv2 on the CPU: 0.022)
TOL_BF16_MASK = 0.01  # bf16: last-layer CLS-attention mask, share differing off the threshold ...
BF16_MASK_BAND = 0.02  # ... band (bf16 keeps ~3 digits; min-max normalisation amplifies flat maps)
TOL_HEATMAP = 2e-3  # max difference of the min-max normalised heatmap R at the grid
TOL_MASK = 0.01  # share of pixels whose mask differs although R is not at the threshold
MASK_BAND = 2e-3  # ... "at the threshold" = |R - mean R| below this on the CPU
TOL_LABELS = 0.97  # partition agreement of region labels (min purity both ways), at least
TOL_TOKENRANK = 1e-5  # max |pi| difference
TOL_LAMBDA2 = 1e-4  # |lambda_2| against dense float64 (protocol)
TOL_STATIONARY = 1e-4  # max relative |pi| difference, power iteration (1e-6 residual) vs exact
TOL_FLUX = 2e-3  # max |attention prob| difference, tiny FLUX fp32
TOL_OFFLOAD = 1e-6  # offload against no offload on the same device
TOL_METRIC = 1.0  # segment-eval: metric rows, percentage points
TOL_HEAT_PNG = 2  # segment: heatmap PNG levels (of 255)

_TINY_KW = {"embed_dim": 64, "depth": 2, "num_heads": 2}


@dataclass
class Check:
    """One comparison.

    Attributes:
        group: capture | method | regions | markov | flux | e2e.
        name: what was compared.
        metric: how (``max_abs``, ``share``, ``agreement``, ``differing``...).
        value: the measured value.
        tolerance: the bound it must meet.
        higher_is_better: ``value >= tolerance`` passes (else ``value <= tolerance``).
        passed: the verdict.
        cpu_ms: time of the CPU reference (ms), when timed.
        device_ms: time of the device path (ms), when timed.
        note: context.
    """

    group: str
    name: str
    metric: str
    value: float
    tolerance: float
    higher_is_better: bool = False
    passed: bool = False
    cpu_ms: float | None = None
    device_ms: float | None = None
    note: str = ""


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """``fn()`` and its wall time in ms (device synchronised)."""
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return out, 1e3 * (time.perf_counter() - t)


def _best_ms(fn: Callable[[], Any], device: torch.device, repeat: int) -> float:
    return 1e3 * best_time(fn, device, max(1, repeat))


def _examples() -> list:
    from importlib.resources import files

    from PIL import Image

    ex = files("segment.datasets").joinpath("examples")
    return [Image.open(ex.joinpath(n)).convert("RGB") for n in ("astronaut.png", "chelsea.png", "coffee.png")]


def partition_agreement(a: np.ndarray, b: np.ndarray) -> float:
    """How well two label maps agree as partitions (ids may differ): the smaller of the
    two purities ``sum_k max_j |A_k & B_j| / n`` (1 = the same partition).

    Args:
        a: ``(...)`` integer labels.
        b: same shape.
    """
    a = np.asarray(a).ravel().astype(np.int64)
    b = np.asarray(b).ravel().astype(np.int64)
    _, ai = np.unique(a, return_inverse=True)
    _, bi = np.unique(b, return_inverse=True)
    table = np.zeros((ai.max() + 1, bi.max() + 1), np.int64)
    np.add.at(table, (ai, bi), 1)
    n = a.size
    return float(min(table.max(1).sum() / n, table.max(0).sum() / n))


def mask_disagreement(r_ref: torch.Tensor, r_dev: torch.Tensor, band: float = MASK_BAND) -> float:
    """Share of pixels where ``R > mean R`` differs between two heatmaps, counting only
    pixels whose reference value is farther than ``band`` from its threshold.

    Args:
        r_ref: ``(B, H, W)`` normalised reference heatmap.
        r_dev: same shape.
    """
    thr_ref = r_ref.flatten(1).mean(1).view(-1, 1, 1)
    thr_dev = r_dev.flatten(1).mean(1).view(-1, 1, 1)
    differ = (r_ref > thr_ref) != (r_dev > thr_dev)
    clear = (r_ref - thr_ref).abs() > band
    return float((differ & clear).float().mean())


class SelfCheck:
    """Runs the checks (see the module docstring) and collects :class:`Check` rows and
    ratios.

    Args:
        device: the device under test (``cpu`` = the CPU half).
        quick: tiny models and few images only.
        weights: DINOv2 ViT-S/14 safetensors, or ``None``.
        workdir: a scratch folder.
        log: where progress lines go.
    """

    def __init__(self, device: torch.device, quick: bool, weights: Path | None, workdir: Path,
                 log: Callable[[str], None] = print) -> None:
        self.device = device
        self.cpu = torch.device("cpu")
        self.quick = quick
        self.weights = weights
        self.work = workdir
        self.log = log
        self.checks: list[Check] = []
        self.ratios: dict[str, Any] = {}
        self.images = _examples()[: 2 if quick else 3]
        self.size = 112 if quick else 224  # backbone input (px): quick = 8 x 8 tokens
        self.tiny_ckpt = self._tiny_checkpoint()

    # ------------------------------------------------------------------ helpers

    def add(self, group: str, name: str, metric: str, value: float, tolerance: float, *,
            higher_is_better: bool = False, cpu_ms: float | None = None,
            device_ms: float | None = None, note: str = "") -> Check:
        value = float(value)
        ok = value >= tolerance if higher_is_better else value <= tolerance
        c = Check(group, name, metric, value, tolerance, higher_is_better, bool(ok and np.isfinite(value)),
                  None if cpu_ms is None else round(cpu_ms, 3),
                  None if device_ms is None else round(device_ms, 3), note)
        self.checks.append(c)
        op = ">=" if higher_is_better else "<="
        times = ""
        if cpu_ms is not None and device_ms is not None:
            times = f"  (cpu {cpu_ms:.1f} ms, {self.device.type} {device_ms:.1f} ms)"
        self.log(f"  [{'ok' if c.passed else 'FAIL'}] {group}/{name}: {metric} {value:.3g} "
                 f"(tolerance {op} {tolerance:g}){times}{'  ' + note if note else ''}")
        return c

    def _tiny_checkpoint(self) -> Path:
        """Seeded random weights of the tiny ViT, saved so that every device loads them."""
        from safetensors.torch import save_file
        from segment.models.vit import TimmViT

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            bb = TimmViT("vit_small_patch14_dinov2", name="vit_tiny_random", pretrained=False,
                         image_size=224, device="cpu", model_kwargs=_TINY_KW)
        path = self.work / "vit_tiny_random.safetensors"
        save_file({k: v.contiguous() for k, v in bb.model.state_dict().items()}, str(path))
        return path

    def vit_specs(self) -> list[dict[str, Any]]:
        """The ViTs checked: the tiny one, and the shared DINOv2 unless ``quick``."""
        specs = [{"config": "vit_tiny_random", "arch": "vit_small_patch14_dinov2", "name": "vit_tiny_random",
                  "checkpoint": self.tiny_ckpt, "model_kwargs": _TINY_KW}]
        if self.weights is not None and not self.quick:
            specs.append({"config": "dinov2_vits14", "arch": "vit_small_patch14_dinov2.lvd142m",
                          "name": "dinov2_vits14", "checkpoint": self.weights, "model_kwargs": {}})
        return specs

    def build_vit(self, spec: dict[str, Any], device: torch.device, dtype: str = "float32"):
        from segment.models.vit import TimmViT

        return TimmViT(spec["arch"], name=spec["name"], pretrained=False, checkpoint=str(spec["checkpoint"]),
                       image_size=self.size, device=str(device), dtype=dtype, model_kwargs=spec["model_kwargs"])

    # ------------------------------------------------------------------ checks

    def check_capture(self, spec: dict[str, Any]) -> Any:
        """fp32 and bf16 capture on the device against the CPU fp32 capture; returns the
        CPU model and its full record for the later checks."""
        from segment.core.masks import heatmap_at
        from segment.core.record import Capture

        cap = Capture(layers=None, heads="keep")
        ref_model = self.build_vit(spec, self.cpu)
        x = ref_model.collate(self.images)
        ref, t_cpu = _timed(lambda: ref_model.extract(x, cap), self.cpu)
        variants = [("float32", "float32", False, TOL_CAPTURE_FP32), ("bfloat16", "bfloat16", None, TOL_CAPTURE_BF16)]
        if self.device.type == "cuda":  # as users run it: cuDNN convolutions in TF32 by default
            variants.insert(1, ("float32 (cuDNN TF32 on)", "float32", True, TOL_CAPTURE_TF32))
        for label, dtype, tf32, tol in variants:
            model = self.build_vit(spec, self.device, dtype)
            flags = (torch.backends.cudnn.flags(enabled=True, allow_tf32=tf32) if tf32 is not None
                     else contextlib.nullcontext())
            with flags:
                model.extract(x, cap)  # warm-up
                got, t_dev = _timed(lambda: model.extract(x, cap), self.device)
            note = f"{len(ref.attn)} layers x {ref.attn[0].shape[1]} heads"
            if dtype == "float32":
                err = max((got.attn[i].float().cpu() - ref.attn[i]).abs().max().item() for i in ref.attn)
                self.add("capture", f"{spec['name']} {label}", "max_abs attention", err, tol,
                         cpu_ms=t_cpu, device_ms=t_dev, note=note)
            else:  # bf16: compare distributions, and the protocol's mask from the last layer
                tv = max(0.5 * (got.attn[i].float().cpu() - ref.attn[i]).abs().sum(-1).mean().item() for i in ref.attn)
                self.add("capture", f"{spec['name']} {label}", "mean row TV distance (worst layer)", tv, tol,
                         cpu_ms=t_cpu, device_ms=t_dev, note=note)
                last = max(ref.attn)
                grid = ref.layout.grid
                cls = lambda r: r.attn[last][:, :, 0, ref.layout.patches].float().cpu().mean(1)  # noqa: E731
                ha, hb = (heatmap_at(cls(r).view(-1, *grid), ref.image_size) for r in (ref, got))
                self.add("capture", f"{spec['name']} {label} CLS mask", "share differing off the threshold",
                         mask_disagreement(ha, hb, band=BF16_MASK_BAND), TOL_BF16_MASK,
                         note=f"band {BF16_MASK_BAND}")
        return ref_model, x

    def _compare_outputs(self, group: str, name: str, ref, got, t_cpu: float | None, t_dev: float | None,
                         size) -> None:
        from segment.core.masks import heatmap_at, labels_at, minmax

        hr, hd = minmax(ref.heatmap.float().cpu()), minmax(got.heatmap.float().cpu())
        self.add(group, f"{name} heatmap", "max_abs R (grid)", (hr - hd).abs().max().item(), TOL_HEATMAP,
                 cpu_ms=t_cpu, device_ms=t_dev)
        if ref.labels is None:
            ra, rd = heatmap_at(ref.heatmap.float().cpu(), size), heatmap_at(got.heatmap.float().cpu(), size)
            self.add(group, f"{name} mask", "share differing off the threshold", mask_disagreement(ra, rd), TOL_MASK)
            return
        la, ld = labels_at(ref.labels.cpu(), size).numpy(), labels_at(got.labels.cpu(), size).numpy()
        agree = min(partition_agreement(la[b], ld[b]) for b in range(la.shape[0]))
        self.add(group, f"{name} regions", "partition agreement (worst image)", agree, TOL_LABELS,
                 higher_is_better=True)
        fa = np.stack([ref.foreground.cpu().numpy()[b][la[b]] for b in range(la.shape[0])])
        fd = np.stack([got.foreground.cpu().numpy()[b][ld[b]] for b in range(ld.shape[0])])
        self.add(group, f"{name} mask", "share of pixels differing", float((fa != fd).mean()), TOL_MASK)

    def check_methods(self, model, x) -> None:
        """Every ViT method of configs/method on the device, from the CPU record moved there."""
        from hydra.utils import instantiate

        for name in method_names():
            cfg = compose("segment", [f"method={name}"])
            method = instantiate(cfg.method)
            try:
                cap = method.capture(model.num_layers)
                rec = model.extract(x, cap)
            except (ValueError, KeyError) as e:  # a DiT method (concept_attention): check_flux
                self.log(f"  [skip] method/{name} on {model.name}: {e}")
                continue
            with torch.no_grad():
                ref, t_cpu = _timed(lambda: method(rec), self.cpu)
                rec_d = rec.to(self.device)
                method(rec_d)  # warm-up
                got, t_dev = _timed(lambda: method(rec_d), self.device)
            self._compare_outputs("method", f"{model.name} {name}", ref, got, t_cpu, t_dev, rec.image_size)

    def check_regions(self) -> None:
        """kornia union-find (the CUDA path) against scikit-image's connected components:
        the same components with the same ids (numbered by value, then first pixel)."""
        from segment import backends

        g = torch.Generator().manual_seed(0)
        b, h, w = (4, 32, 32) if self.quick else (8, 64, 64)
        coarse = torch.randint(0, 5, (b, 1, h // 8, w // 8), generator=g).float()
        lab = torch.nn.functional.interpolate(coarse, size=(h, w), mode="nearest")[:, 0].long()
        noise = torch.rand(b, h, w, generator=g) < 0.08  # specks and thin bridges
        lab = torch.where(noise, torch.randint(0, 5, (b, h, w), generator=g), lab)
        ref, t_cpu = _timed(lambda: backends.components(lab, "skimage"), self.cpu)
        lab_d = lab.to(self.device)
        backends.components(lab_d, "kornia")  # warm-up
        got, t_dev = _timed(lambda: backends.components(lab_d, "kornia"), self.device)
        bad = sum(not torch.equal(ref[i], got[i].cpu()) for i in range(b))
        self.add("regions", f"kornia vs scikit-image components ({b}x{h}x{w})", "images differing", bad, 0,
                 cpu_ms=t_cpu, device_ms=t_dev, note=f"{int(ref.flatten(1).amax(1).sum()) + b} components")
        area = max(1, h * w // 200)
        ref = backends.connected_regions(lab, min_area=area)  # scikit-image
        got = backends.connected_regions(lab.to(self.device), min_area=area).cpu()  # kornia
        bad = sum(not torch.equal(ref[i], got[i]) for i in range(b))
        self.add("regions", f"connected_regions min_area={area}", "images differing", bad, 0)
        from segment.core.masks import (
            smooth_labels_at,  # the torch path of device tensors
        )

        size = (3 * h + 1, 2 * w + 3)
        ref = smooth_labels_at(lab, size)
        got = smooth_labels_at(lab.to(self.device), size).cpu()
        self.add("regions", f"smooth label upsampling to {size[0]}x{size[1]}", "pixels differing",
                 int((ref != got).sum()), 0)

    def check_markov(self, model, x) -> None:
        """TokenRank and lambda_2 on the device; lambda_2 against dense float64."""
        from segment.core import markov
        from segment.core.record import Capture

        rec = model.extract(x[:1], Capture(layers=None, heads="keep"))
        heads = torch.cat([rec.attn[i][0] for i in sorted(rec.attn)])  # (L*H, N, N)
        ref, t_cpu = _timed(lambda: markov.tokenrank(heads, alpha=0.99, tol=1e-6), self.cpu)
        hd = heads.to(self.device)
        markov.tokenrank(hd, alpha=0.99, tol=1e-6)
        got, t_dev = _timed(lambda: markov.tokenrank(hd, alpha=0.99, tol=1e-6), self.device)
        self.add("markov", f"{model.name} tokenrank ({heads.shape[0]} heads, N={heads.shape[-1]})", "max_abs pi",
                 (got.cpu() - ref).abs().max().item(), TOL_TOKENRANK, cpu_ms=t_cpu, device_ms=t_dev)
        chains = markov.strip_prefix(heads, rec.layout.prefix, zero_rows="uniform")
        dense = markov.lambda2_dense(chains.double())
        ch_d = chains.to(self.device)
        markov.lambda2(ch_d, return_info=True)
        info, t_l2 = _timed(lambda: markov.lambda2(ch_d, return_info=True), self.device)
        err = (info.value.double().cpu() - dense).abs().max().item()
        self.add("markov", f"{model.name} lambda_2 fp32 vs dense float64", "max_abs |lambda_2|", err, TOL_LAMBDA2,
                 device_ms=t_l2, note=f"{int(info.dense.sum())}/{chains.shape[0]} dense fallbacks")
        k = min(4, chains.shape[0])
        dense_on = self.device
        try:
            t_dense = _best_ms(lambda: [torch.linalg.eigvals(ch_d[i]) for i in range(k)], self.device, 1) / k
        except RuntimeError as e:  # a build without a device eigensolver: time it on the CPU
            self.log(f"  dense eigvals on {self.device} failed ({str(e).splitlines()[0]}); timing it on the CPU")
            dense_on = self.cpu
            t_dense = _best_ms(lambda: [torch.linalg.eigvals(chains[i]) for i in range(k)], self.cpu, 1) / k
        self.ratios.setdefault("lambda2_vs_dense", []).append({
            "model": model.name, "tokens": int(chains.shape[-1]), "heads": int(chains.shape[0]),
            "dense_device": str(dense_on),
            "lambda2_ms_per_head": round(t_l2 / chains.shape[0], 3), "dense_ms_per_head": round(t_dense, 3),
            "ratio": round((t_l2 / chains.shape[0]) / t_dense, 4),
        })

    def check_cuts(self, model, x) -> None:
        """The cuts' Krylov eigensolver and iterative stationary distribution on the device
        against the dense CPU solvers."""
        from functools import partial

        from hydra.utils import instantiate

        from segment import backends
        from segment.core import cuts, lanczos, markov
        from segment.eval.bench.cutcheck import first_differences
        from segment.methods.base import fused_patch_chain

        method = instantiate(compose("segment", ["method=cuts"]).method)
        rec = model.extract(x, method.capture(model.num_layers))
        chain = fused_patch_chain(rec.attn[method._resolve(rec)[-1]], rec.layout, method.heads)
        ref, t_cpu = _timed(lambda: markov.exact_stationary(chain), self.cpu)
        got, t_dev = _timed(lambda: markov.stationary(chain.to(self.device), dense_up_to=0),
                            self.device)
        self.add("cuts", f"{model.name} stationary, power iteration vs exact (N={chain.shape[-1]})",
                 "max_rel pi", ((got.cpu() - ref).abs() / ref).max().item(), TOL_STATIONARY,
                 cpu_ms=t_cpu, device_ms=t_dev)
        w = method.cut_affinity(rec)
        tau = float(method.escape)
        dense = partial(backends.second_eigenvectors, backend="scipy")
        part_ref, t_cpu = _timed(lambda: cuts.recursive_ncut(w, tau, eigvec=dense), self.cpu)
        wd = w.to(self.device)
        part, t_dev = _timed(lambda: cuts.recursive_ncut(wd, tau, eigvec=lanczos.second_eigenvectors),
                             self.device)
        differ = [i for i in range(w.shape[0]) if not torch.equal(part.labels[i].cpu(), part_ref.labels[i])]
        diffs = [d for i in differ for d in first_differences(
            w[i], tau, dense, lambda s, size=None: lanczos.second_eigenvectors(
                s.to(self.device), size=None if size is None else size.to(self.device)).cpu())]
        self.add("cuts", f"{model.name} cuts, Krylov on {self.device.type} vs dense on the CPU",
                 "differences not near-ties", sum(not d.near_tie for d in diffs), 0,
                 cpu_ms=t_cpu, device_ms=t_dev,
                 note=f"{len(differ)}/{w.shape[0]} partitions differ, {len(diffs)} first differences")

    def check_flux(self) -> None:
        """Tiny FLUX: capture, ConceptAttention and a Markov method (bounce from the class
        word) on the device, with and without offload, against the CPU."""
        from hydra.utils import instantiate

        from segment.core.record import Capture

        cfg = compose("segment", ["model=flux_tiny", "device=cpu"])
        methods = {name: instantiate(compose("segment", [f"method={name}", "method.layers=[0,1]"]).method)
                   for name in ("concept_attention", "bounce")}  # the tiny model's double blocks
        ref_model = instantiate(cfg.model)
        full = Capture(layers=None, heads="keep")
        x = ref_model.collate(self.images[:2])
        prompts = ["person", "cat"]
        ref, t_cpu = _timed(lambda: ref_model.extract(x, full, prompts=prompts), self.cpu)
        ref_out = {n: m(ref_model.extract(x, m.capture(ref_model.num_layers), prompts=prompts))
                   for n, m in methods.items()}
        got = {}
        for offload in (False, True):
            model = instantiate(cfg.model, device=str(self.device), offload=offload)
            model.extract(x, full, prompts=prompts)  # warm-up
            rec, t_dev = _timed(lambda: model.extract(x, full, prompts=prompts), self.device)
            got[offload] = rec
            err = max((rec.attn[i].float().cpu() - ref.attn[i]).abs().max().item() for i in ref.attn)
            tag = "offload" if offload else "no offload"
            self.add("flux", f"flux_tiny capture, {tag}", "max_abs attention", err, TOL_FLUX,
                     cpu_ms=t_cpu, device_ms=t_dev, note=f"{len(ref.attn)} blocks, N={ref.attn[0].shape[-1]}")
            for n, m in methods.items():
                with torch.no_grad():
                    out, t_m = _timed(lambda: m(model.extract(x, m.capture(model.num_layers), prompts=prompts)),
                                      self.device)
                self._compare_outputs("flux", f"flux_tiny {n}, {tag}", ref_out[n], out, None, t_m,
                                      ref.image_size)
        err = max((got[True].attn[i].float() - got[False].attn[i].float()).abs().max().item() for i in ref.attn)
        self.add("flux", "flux_tiny offload vs no offload (same device)", "max_abs attention", err, TOL_OFFLOAD)

    def check_segment(self, spec: dict[str, Any]) -> Path:
        """``segment`` with device=cpu and on the device: files compared; returns the CPU
        output (its masks serve as labels for the segment-eval check)."""
        from PIL import Image

        from segment.run.job.pipeline import run_segment

        src = self.work / "examples"
        if not src.is_dir():
            src.mkdir()
            for i, im in enumerate(self.images):
                im.save(src / f"{i}.png")
        outs, times = {}, {}
        for tag, dev in (("ref", self.cpu), ("dev", self.device)):
            out = self.work / f"segment_{spec['name']}_{tag}"
            cfg = compose("segment", [f"model={spec['config']}", f"model.checkpoint='{spec['checkpoint']}'",
                                      f"device={dev}", f"input='{src}'", f"output='{out}'", "progress=false",
                                      "overwrite=true", "render.fsync=false", "batch_size=4",
                                      f"model.image_size={self.size}"])
            code, times[tag] = _timed(lambda: run_segment(cfg), dev)
            if code != 0:
                raise RuntimeError(f"segment on {dev} failed with exit code {code}; see {out}/run.json")
            outs[tag] = out
        a, b = outs["ref"], outs["dev"]
        masks_off, heat_off, agree = 0.0, 0, 1.0
        for p in sorted((a / "masks").glob("*.png")):
            ma = np.asarray(Image.open(p)) > 0
            mb = np.asarray(Image.open(b / "masks" / p.name)) > 0
            masks_off = max(masks_off, float((ma != mb).mean()))
            ha = np.asarray(Image.open(a / "heatmaps" / p.name)).astype(int)
            hb = np.asarray(Image.open(b / "heatmaps" / p.name)).astype(int)
            heat_off = max(heat_off, int(np.abs(ha - hb).max()))
            if (a / "labels" / p.name).is_file():
                la, lb = np.asarray(Image.open(a / "labels" / p.name)), np.asarray(Image.open(b / "labels" / p.name))
                agree = min(agree, partition_agreement(la, lb))
        name = f"segment {spec['name']} (default method)"
        self.add("e2e", f"{name} heatmap PNG", "max level difference", heat_off, TOL_HEAT_PNG,
                 cpu_ms=times["ref"], device_ms=times["dev"])
        self.add("e2e", f"{name} masks", "share of pixels differing (worst image)", masks_off, TOL_MASK)
        self.add("e2e", f"{name} region labels", "partition agreement (worst image)", agree, TOL_LABELS,
                 higher_is_better=True)
        return a

    def check_eval(self, spec: dict[str, Any], labels_from: Path) -> None:
        """``segment-eval`` with device=cpu and on the device: metric rows compared."""
        import json

        from segment.eval.runner import run_eval

        shared = os.environ.get("SEGMENT_SHARED")
        ecssd = Path(shared) / "data" / "ecssd-dev" if shared else None
        if ecssd is not None and (ecssd / "images").is_dir() and not self.quick:
            root, limit = ecssd, 16
        else:  # the examples with the CPU run's masks as labels: any fixed labels serve
            root, limit = self.work / "eval_set", None
            if not root.is_dir():
                (root / "images").mkdir(parents=True)
                (root / "masks").mkdir()
                for i, im in enumerate(self.images):
                    im.save(root / "images" / f"{i}.png")
                    shutil.copyfile(labels_from / "masks" / f"{i}.png", root / "masks" / f"{i}.png")
        rows, times = {}, {}
        for tag, dev in (("ref", self.cpu), ("dev", self.device)):
            out = self.work / f"eval_{spec['name']}_{tag}"
            ov = [f"model={spec['config']}", f"model.checkpoint='{spec['checkpoint']}'", f"device={dev}",
                  "dataset=folder", f"dataset.root='{root}'", f"output='{out}'", "progress=false", "panels=0",
                  "cache=false", "batch_size=4", "methods=[cls_attention,tokenrank,bounce]",
                  f"model.image_size={self.size}", f"dataset.size=[{self.size},{self.size}]"]
            if limit:
                ov.append(f"limit={limit}")
            code, times[tag] = _timed(lambda: run_eval(compose("eval", ov)), dev)
            if code != 0:
                raise RuntimeError(f"segment-eval on {dev} failed with exit code {code}")
            rows[tag] = {r["method"]: r for r in json.loads((out / "results.json").read_text())}
        worst = 0.0
        for m, r in rows["ref"].items():
            for k in ("pixAcc", "mIoU", "mAP"):
                worst = max(worst, abs(r[k] - rows["dev"][m][k]))
        self.add("e2e", f"segment-eval {spec['name']} on {root.name} ({len(rows['ref'])} methods)",
                 "max metric difference (points)", worst, TOL_METRIC, cpu_ms=times["ref"], device_ms=times["dev"])

    # ------------------------------------------------------------------ ratios

    def measure_ratios(self, spec: dict[str, Any]) -> None:
        """Region stage and whole pipeline against the bare fused forward, on the device."""
        from hydra.utils import instantiate

        from segment.eval.bench import pipeline as bench_pipeline

        dev_model = self.build_vit(spec, self.device)
        x = dev_model.collate((self.images * 4)[:4]).to(self.device)  # batch 4
        method = instantiate(compose("segment", []).method)  # the default (regions)
        cap = method.capture(dev_model.num_layers)
        rep = 1 if self.quick else 5
        with torch.no_grad():
            dev_model.forward_plain(x)
            rec = dev_model.extract(x, cap)
            method(rec)
            # interleaved rounds, medians and the median of the rounds' ratios, as
            # `bench regions` reports them: a device that speeds up or slows down mid-run
            # moves the three timings of a round alike
            rounds = [(_best_ms(lambda: dev_model.forward_plain(x), self.device, 1),
                       _best_ms(lambda: dev_model.extract(x, cap), self.device, 1),
                       _best_ms(lambda: method(rec), self.device, 1)) for _ in range(rep)]
        t_fwd, t_ext, t_reg = (statistics.median(r[j] for r in rounds) for j in range(3))
        ext_ratio = statistics.median(r[1] / r[0] for r in rounds)
        reg_ratio = statistics.median(r[2] / r[0] for r in rounds)
        self.ratios.setdefault("region_stage", []).append({
            "model": spec["name"], "px": self.size, "batch": int(x.shape[0]), "forward_ms": round(t_fwd, 3),
            "extract_ms": round(t_ext, 3), "regions_ms": round(t_reg, 3),
            "extract_over_forward": round(ext_ratio, 3), "regions_over_forward": round(reg_ratio, 3),
        })
        args = bench_pipeline.parser().parse_args([
            "--images", str(6 if self.quick else 32), "--model", spec["config"], "--method", "regions",
            "--checkpoint", str(spec["checkpoint"]), "--batch-size", "8", "--device", str(self.device),
            "--repeats", "1" if self.quick else "2", f"model.image_size={self.size}",
        ])
        res = bench_pipeline.run_benchmark(args)
        self.ratios.setdefault("pipeline", []).append({
            "model": spec["name"], "px": self.size, "method": "regions", "images": res["images"],
            "bare_forward_img_s": res["bare_forward_median"], "pipeline_img_s": res["pipeline_median"],
            "ratio": res["ratio"],
        })
        self.log(f"  ratios {spec['name']}: extract/forward {ext_ratio:.2f}, regions/forward "
                 f"{reg_ratio:.2f}, pipeline/bare {res['ratio']:.2f} ({res['pipeline_median']:.1f} vs "
                 f"{res['bare_forward_median']:.1f} img/s)")

    def measure_throughput(self, configs: tuple[str, ...] = ("dinov2_vits14", "dinov2_vitb14"),
                           sizes: tuple[int, ...] = (224, 448), images: int = 128, batch: int = 32) -> None:
        """Images/s of ``segment`` and of the bare forward for ViT-S/14 and ViT-B/14 at 224
        and 448 px (device runs without ``--quick`` only; random ViT-B weights, same compute)."""
        from segment.eval.bench import pipeline as bench_pipeline

        for config in configs:
            ckpt = ["--checkpoint", str(self.weights)] if config == "dinov2_vits14" and self.weights else []
            for px in sizes:
                args = bench_pipeline.parser().parse_args([
                    "--images", str(images), "--model", config, "--method", "regions", "--batch-size", str(batch),
                    "--device", str(self.device), "--repeats", "2", *ckpt, f"model.image_size={px}",
                ])  # no checkpoint: bench_pipeline sets model.pretrained=false
                res = bench_pipeline.run_benchmark(args)
                row = {"model": config, "px": px, "batch": batch, "images": res["images"],
                       "bare_forward_img_s": res["bare_forward_median"], "pipeline_img_s": res["pipeline_median"],
                       "ratio": res["ratio"], "stages_cpu_ms_per_image": res["stages_cpu_ms_per_image"]}
                self.ratios.setdefault("throughput", []).append(row)
                self.log(f"  throughput {config} {px} px: pipeline {row['pipeline_img_s']:.1f} img/s, bare "
                         f"{row['bare_forward_img_s']:.1f} img/s, ratio {row['ratio']:.2f}")

    # ------------------------------------------------------------------ all

    def run(self) -> None:
        for spec in self.vit_specs():
            self.log(f"# {spec['name']}")
            model, x = self.check_capture(spec)
            self.check_methods(model, x)
            self.check_markov(model, x)
            self.check_cuts(model, x)
            out = self.check_segment(spec)
            self.check_eval(spec, out)
            self.measure_ratios(spec)
        self.log("# regions, FLUX")
        self.check_regions()
        self.check_flux()
        if self.device.type == "cuda" and not self.quick:
            self.log("# throughput (segment vs bare forward)")
            self.measure_throughput()


@contextlib.contextmanager
def _config_context() -> Iterator[None]:
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        yield
        return
    with initialize_config_module(version_base="1.3", config_module="segment.configs"):
        yield


def compose(name: str, overrides: list[str]):
    from hydra import compose as hcompose

    with _config_context():
        return hcompose(name, overrides=overrides)


def method_names() -> list[str]:
    """Every method config (``configs/method/*.yaml``)."""
    from segment.run.front.compose import config_names

    return config_names("method")


def run_selfcheck(device: str | None = None, quick: bool = False, weights: str | None = None,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every check; returns the JSON-able result (see :func:`main`)."""

    cuda = torch.cuda.is_available()
    dev = torch.device(device or ("cuda" if cuda else "cpu"))
    if dev.type == "cuda" and not cuda:
        raise SystemExit("--device cuda: CUDA is not available on this machine")
    w = find_weights(weights)
    if dev.type == "cpu":
        why = "--device cpu" if cuda else "no CUDA device on this machine"
        log(f"{why}: running the CPU half only (every path on the CPU against its reference); the"
            " device comparisons need a GPU: run `python -m segment.eval.bench gpu` on a CUDA machine")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or platform.machine())
    log(f"# segment GPU self-check on {dev} ({name}), torch {torch.__version__}, quick={quick}, "
        f"DINOv2 weights: {w if w and not quick else 'not used'}")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="segment-selfcheck-") as tmp:
        sc = SelfCheck(dev, quick, w, Path(tmp), log)
        sc.run()
    failed = [f"{c.group}/{c.name}" for c in sc.checks if not c.passed]
    result = {
        "device": str(dev),
        "device_name": name,
        "cuda": dev.type == "cuda",
        "cpu_half_only": dev.type != "cuda",
        "torch": torch.__version__,
        "cuda_version": torch.version.cuda,
        "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32},
        "quick": quick,
        "weights": str(w) if w and not quick else None,
        "seconds": round(time.perf_counter() - t0, 1),
        "checks": [asdict(c) for c in sc.checks],
        "ratios": sc.ratios,
        "passed": not failed,
        "failed": failed,
    }
    log(f"# {len(sc.checks) - len(failed)}/{len(sc.checks)} checks passed in {result['seconds']} s"
        + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m segment.eval.bench gpu``; returns 0 when every check passed (also on a
    machine without CUDA, after the CPU half), 1 otherwise."""
    p = argparse.ArgumentParser(prog="python -m segment.eval.bench gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="device under test (default: cuda if available, else cpu)")
    p.add_argument("--quick", action="store_true", help="tiny models and few images only (CI)")
    p.add_argument("--weights", default=None, help="DINOv2 ViT-S/14 safetensors (default: $SEGMENT_SHARED)")
    p.add_argument("--json", type=Path, default=None, help="write the checks and ratios here")
    args = p.parse_args(argv)
    res = run_selfcheck(args.device, args.quick, args.weights)
    if args.json:
        atomic_write_json(args.json, res)
        print(f"wrote {args.json}")
    sys.stdout.flush()
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
