"""Shared fixtures. Tests that need the development assets (real DINOv2 weights, ecssd-dev)
find them through the SEGMENT_SHARED environment variable (set by .ci/run) and skip with a
clear reason when it is absent, so a user's checkout still passes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


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
