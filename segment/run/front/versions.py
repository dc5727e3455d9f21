"""The torch / torchvision pair, checked before anything loads a model.

torchvision's compiled operators (``torchvision::nms``...) are built against one torch
release; with another, ``import torchvision`` (which timm does) fails deep inside the model's
construction with ``operator torchvision::nms does not exist``. :func:`check_torch_pair`
says it in one line first, naming both versions and the command that installs the pair the
project's numbers were measured with (:data:`TESTED`; ``pyproject.toml``'s range, the
README's install and ``.ci/run`` name the same pair: ``tests/test_versions.py``).
"""

from __future__ import annotations

import re
from importlib import metadata

TESTED = ("2.14.1", "0.29.1")  # torch, torchvision
FIX = f"pip install torch=={TESTED[0]} torchvision=={TESTED[1]}"


class TorchPairError(RuntimeError):
    """torch and torchvision do not work together (one line: both versions and the fix)."""


def _minor(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def pair_problem(torch_version: str, vision_version: str | None) -> str | None:
    """What is wrong with this pair of versions (``None``: they pair). torchvision
    ``0.N`` is built for torch ``2.(N - 15)`` (0.16 for 2.1 ... 0.29 for 2.14)."""
    if vision_version is None:
        return f"torchvision is not installed (torch {torch_version}); {FIX}"
    t, v = _minor(torch_version), _minor(vision_version)
    if t is None or v is None or t[0] != 2 or v[0] != 0:
        return None  # a development or unknown scheme: leave it to the import below
    if v[1] != t[1] + 15:
        return (f"torch {torch_version} and torchvision {vision_version} are not a pair"
                f" (torch {torch_version} needs torchvision 0.{t[1] + 15}); install the tested"
                f" pair: {FIX}")
    return None


def check_torch_pair() -> None:
    """Refuse a torch / torchvision pair that cannot work together.

    Raises:
        TorchPairError: the versions do not pair, or torchvision's compiled operators do
            not load with this torch; one line naming both versions and :data:`FIX`.
    """
    import torch

    try:
        vision: str | None = metadata.version("torchvision")
    except metadata.PackageNotFoundError:
        vision = None
    problem = pair_problem(torch.__version__, vision)
    if problem is None:
        try:
            import torchvision  # noqa: F401 - registers torchvision's operators

            torch.ops.torchvision.nms  # noqa: B018 - raises when the compiled ops are missing
        except (ImportError, RuntimeError, AttributeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            problem = (f"torchvision {vision}'s compiled operators do not load with torch"
                       f" {torch.__version__} ({first}); install the tested pair: {FIX}")
    if problem is not None:
        raise TorchPairError(problem)
