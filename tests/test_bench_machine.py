"""A benchmark's header names the machine that gave it: the CPU, ATen's CPU kernels and the
torch threads (eval/bench/common.machine)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from segment.eval.bench.common import cpu_model, machine


def test_machine_names_the_cpu_the_kernels_and_the_threads():
    got = machine("cpu")
    assert got.startswith(cpu_model())
    assert f"ATen CPU kernels {torch.backends.cpu.get_cpu_capability()}" in got
    assert got.endswith(f"{torch.get_num_threads()} torch threads")


def test_machine_follows_the_kernels_and_threads_of_the_process():
    code = ("import torch; from segment.eval.bench.common import machine; torch.set_num_threads(1);"
            " print(machine('cpu'))")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "ATEN CPU KERNELS DEFAULT" in out.upper() and out.strip().endswith(", 1 torch threads")
