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
    from segment.run.api import Result, Segmenter, load, show
    from segment.run.diagnose import diagnose
    from segment.run.registry import create_method, list_datasets, list_methods, list_models

__version__ = "0.1.0"

_LAZY = {
    "load": "segment.run.api", "show": "segment.run.api", "Segmenter": "segment.run.api",
    "Result": "segment.run.api", "diagnose": "segment.run.diagnose",
    "list_models": "segment.run.registry", "list_methods": "segment.run.registry",
    "list_datasets": "segment.run.registry", "create_method": "segment.run.registry",
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
