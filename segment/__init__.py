"""segment: zero-shot segmentation from attention read as a discrete-time Markov chain.

Python API (loaded on first use, so ``import segment`` stays light)::

    seg = segment.load()            # -> segment.Segmenter (configs/model, configs/method names)
    res = seg("photo.jpg")          # -> segment.Result: mask, heatmap, labels, foreground, record
    segment.show(res)               # overlay as a PIL image
    segment.list_models("dinov2*")  # the configs/model names (list_methods, list_datasets)
    m = segment.create_method("cuts", escape=0.4)  # configs/method/cuts.yaml with an override
    segment.load(method=m)          # a built method is used as it is
    diag = segment.diagnose("photos/")  # -> per-head attention diagnostics (segment-diagnose)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and editors see; at run time __getattr__ imports them
    from segment.run.api.registry import create_method, list_datasets, list_methods, list_models
    from segment.run.api.segmenter import Result, Segmenter, load, show
    from segment.run.diagnose.measure import diagnose

__version__ = "0.1.0"

_LAZY = {
    "load": "segment.run.api.segmenter", "show": "segment.run.api.segmenter",
    "Segmenter": "segment.run.api.segmenter", "Result": "segment.run.api.segmenter",
    "diagnose": "segment.run.diagnose.measure",
    "list_models": "segment.run.api.registry", "list_methods": "segment.run.api.registry",
    "list_datasets": "segment.run.api.registry", "create_method": "segment.run.api.registry",
}
"""Each public name and the module it is imported from on first use."""

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'segment' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(module), name)


def __dir__() -> list[str]:
    """The public names (the lazy ones too: tab completion) and the module's dunders."""
    return sorted({*__all__, *(k for k in globals() if k.startswith("__"))})
