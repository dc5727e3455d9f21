"""segment: zero-shot segmentation from attention read as a discrete-time Markov chain.

Python API (loaded on first use, so ``import segment`` stays light)::

    seg = segment.load()            # -> segment.Segmenter (configs/model, configs/method names)
    res = seg("photo.jpg")          # -> segment.Result: mask, heatmap, labels, foreground, record
    segment.show(res)               # overlay as a PIL image
    diag = segment.diagnose("photos/")  # -> per-head attention diagnostics (segment-diagnose)
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_API = ("load", "show", "Segmenter", "Result")
__all__ = [*_API, "diagnose", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _API:
        from segment.run.api import segmenter as api

        return getattr(api, name)
    if name == "diagnose":
        from segment.run.diagnose.measure import diagnose

        return diagnose
    raise AttributeError(f"module 'segment' has no attribute {name!r}")
