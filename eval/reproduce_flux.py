"""Reproduce every FLUX table of docs/flux.md in one process (``bash eval/reproduce_flux.sh``).

Runs ``experiment=flux_imagenet_seg`` (the paper's multi-bounce row and the chain /
direction / bounces / blocks grid), ``flux_concept_attention`` (ConceptAttention's published
settings) and ``flux_concept_attention_defaults`` (its script's defaults) one after the other
on ImageNet-segmentation. Each run works in ``WORK/<experiment>`` (metric cache, panels;
rerun to resume) and its tables are copied to ``OUT/<experiment>/`` (``results.md`` /
``.csv`` / ``.json`` and the resolved ``config.yaml``); ``OUT/manifest.json`` records the
device, library versions, git commit, seeds, noise level and command of every table.

    python -m segment.eval.reproduce_flux DATA_ROOT [--out DIR] [--work DIR] [--device cuda]
        [--experiments a,b,c] [HYDRA_OVERRIDES...]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from segment.utils import atomic_write_json

EXPERIMENTS = ("flux_imagenet_seg", "flux_concept_attention", "flux_concept_attention_defaults")
FILES = ("results.md", "results.csv", "results.json", "config.yaml")
PACKAGES = ("segment", "torch", "diffusers", "transformers", "accelerate", "timm", "hydra-core",
            "numpy", "scikit-learn", "h5py")


def _version(pkg: str) -> str | None:
    if pkg == "torch":  # with its build tag (+cu130, +cpu)
        import torch

        return torch.__version__
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _device_info(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"requested": device, "torch_cuda": torch.version.cuda}
    if device.startswith("cuda") and torch.cuda.is_available():
        idx = torch.device(device).index or 0
        info.update(name=torch.cuda.get_device_name(idx), count=torch.cuda.device_count())
    else:
        info.update(name=platform.processor() or platform.machine())
    return info


def _table(out: Path, cfg: Any) -> dict[str, Any]:
    rows = json.loads((out / "results.json").read_text())
    m = cfg.model
    return {
        "model": str(m.get("repo_id") or m.get("name")),
        "seeds": [int(s) for s in m.seeds],
        "num_steps": int(m.num_steps),
        "timestep_index": int(m.timestep_index),
        "dtype": m.get("dtype"),
        "vae_dtype": m.get("vae_dtype"),
        "images": max((int(r["images"]) for r in rows), default=0),
        "rows": [r["method"] for r in rows],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="reproduce_flux", description=__doc__.split("\n\n")[0])
    p.add_argument("data", help="gtsegs_ijcv.mat (ImageNet-segmentation) or the folder holding it")
    p.add_argument("--out", default="eval/results/flux", help="where the tables go")
    p.add_argument("--work", default="outputs/reproduce_flux", help="working folders (cache, panels)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--experiments", default=",".join(EXPERIMENTS))
    args, overrides = p.parse_known_args(argv)
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        p.error(f"unknown options {bad}; Hydra overrides look like key=value")
    data = Path(args.data)
    if not data.exists():
        print(f"reproduce_flux: {data}: no such file or folder (expected gtsegs_ijcv.mat)",
              file=sys.stderr)
        return 2

    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from segment.eval.runner import run_eval

    out, work = Path(args.out), Path(args.work)
    names = [e for e in args.experiments.split(",") if e]
    tables: dict[str, Any] = {}
    for exp in names:
        print(f"== {exp}", file=sys.stderr)
        with initialize_config_module(version_base="1.3", config_module="segment.configs"):
            cfg = compose("eval", overrides=[
                f"experiment={exp}", f"dataset.root={data}", f"device={args.device}",
                f"output={work / exp}", "progress=false", *overrides,
            ])
        code = run_eval(cfg)
        if code != 0:
            print(f"reproduce_flux: {exp} failed (exit code {code})", file=sys.stderr)
            return code
        (out / exp).mkdir(parents=True, exist_ok=True)
        for f in FILES:
            shutil.copyfile(work / exp / f, out / exp / f)
        tables[exp] = {**_table(out / exp, OmegaConf.load(out / exp / "config.yaml")),
                       "files": [f"{exp}/{f}" for f in FILES]}
    manifest = {
        "command": " ".join(["bash eval/reproduce_flux.sh", str(args.data), *overrides]),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": _device_info(args.device),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {pkg: _version(pkg) for pkg in PACKAGES},
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain")),
        "tables": tables,
    }
    atomic_write_json(out / "manifest.json", manifest)
    print(f"reproduce_flux: tables and manifest.json in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
