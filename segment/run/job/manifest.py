"""``run.json``, the manifest of a ``segment`` run: per-image statuses, package versions, the
device."""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import torch

from segment.run.job.records import ImageRecord
from segment.utils import atomic_write_json


def package_versions(names: Iterable[str] = (
    "segment", "torch", "torchvision", "timm", "hydra-core", "omegaconf", "numpy", "pillow",
    "opencv-python-headless", "pycocotools", "safetensors", "tqdm",
)) -> dict[str, str | None]:
    """Installed versions of the packages a run depends on (``None`` when absent)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            out[n] = None
    out["cuda"] = torch.version.cuda
    return out


@dataclass
class ImageStatus:
    """Per-image outcome, for the manifest."""

    name: str
    source: str
    status: str  # done | resumed | skipped (could not be segmented: ``reason`` says why)
    reason: str | None = None
    seconds: float | None = None
    rank: int | None = None  # the torchrun rank that segmented it (distributed runs)
    # files refused for themselves (unreadable, too large, too small): their size and mtime
    # then, so that a rerun skips them while they and the refusing settings are unchanged
    # (known_bad: skipped again without reading, unless retry_skipped=true)
    unreadable: bool | None = None
    source_bytes: int | None = None
    source_mtime_ns: int | None = None
    known_bad: bool | None = None
    # done or resumed: the regions in its label map and (methods with a hierarchy) each label
    # id's region_height and region_escape, index-aligned with the ids, as in its record
    regions: int | None = None
    region_height: list[float | None] | None = None
    region_escape: list[float | None] | None = None

    @classmethod
    def finished(cls, rec: ImageRecord, status: str, **kw: Any) -> ImageStatus:
        """The status of an image whose outputs are written (``done``) or kept (``resumed``)."""
        return cls(rec.name, rec.source, status, regions=rec.num_regions,
                   region_height=rec.region_height, region_escape=rec.region_escape, **kw)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def device_info(device: torch.device | None) -> dict[str, Any]:
    """The device of a run for run.json: its name, torch threads (and CPU count)."""
    if device is None:
        return {}
    info: dict[str, Any] = {"device": str(device), "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        info["name"] = torch.cuda.get_device_name(device)
    else:
        import platform

        info["name"] = platform.processor() or platform.machine()
        info["cpu_count"] = os.cpu_count()
    return info


def write_manifest(path: str | os.PathLike, manifest: dict[str, Any]) -> None:
    atomic_write_json(path, manifest, default=str)


