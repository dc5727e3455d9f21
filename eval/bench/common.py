"""Helpers shared by the benchmarks (timing, the shared weights, a bundled example)."""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

SIZES = {257: 224, 1025: 448, 4097: 896, 256: 224, 1024: 448, 4096: 896}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn: Callable[[], object], device: torch.device, repeat: int = 1) -> float:
    """Best wall time of ``repeat`` runs (seconds)."""
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def find_weights(path: str | None) -> Path | None:
    if path:
        return Path(path)
    shared = os.environ.get("SEGMENT_SHARED")
    if shared and (Path(shared) / "weights" / "dinov2_vits14.safetensors").is_file():
        return Path(shared) / "weights" / "dinov2_vits14.safetensors"
    print("bench: no weights (--weights PATH, or SEGMENT_SHARED with weights/"
          "dinov2_vits14.safetensors): a randomly initialised model, whose chains are not the"
          " trained model's (region-stage times differ)", file=sys.stderr)
    return None


def example_image():
    from importlib.resources import files

    from PIL import Image

    return Image.open(files("segment.datasets").joinpath("examples", "astronaut.png")).convert("RGB")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or ``platform.processor()``."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine(device: torch.device | str = "cpu") -> str:
    """What gave a benchmark's numbers, for its header: the CPU (or GPU), ATen's CPU kernels
    (``ATEN_CPU_CAPABILITY``, e.g. ``avx512``, ``avx2``, ``default``) and the torch threads."""
    device = torch.device(device)
    chip = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    return (f"{chip}, ATen CPU kernels {torch.backends.cpu.get_cpu_capability()}, "
            f"{torch.get_num_threads()} torch threads")
