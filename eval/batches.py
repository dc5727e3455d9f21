"""``segment-eval``'s batches: grouped how, prompted with what (moved out of
:mod:`segment.eval.runner`, which re-exports them; the items: :func:`segment.eval.settings.item_names`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from segment.eval.specs import ConfigError

from segment.models.base import Backbone


def batch_prompts(classes: Sequence[str | None], default: str | None,
                  names: Sequence[str]) -> list[str] | None:
    """Per-image prompts: each image's class name, ``default`` for an image without one.

    ``None`` when no image has a class name (the backbone then uses its own default).

    Raises:
        ConfigError: some images lack a class name and there is no ``default``.
    """
    if all(c is None for c in classes):
        return None
    missing = [n for n, c in zip(names, classes) if c is None]
    if missing and default is None:
        raise ConfigError(
            f"{', '.join(missing)}: no class name to prompt with and model.default_class is not set"
        )
    return [default if c is None else c for c in classes]  # type: ignore[misc]


def input_size_groups(backbone: Backbone, images: Sequence[Any]) -> list[list[int]]:
    """The positions of ``images`` grouped by the backbone's input size for each
    (:meth:`segment.models.base.Backbone.input_size`; one group, in order, when every image
    gets the same size: ``None``), groups in the order of their first image."""
    groups: dict[Any, list[int]] = {}
    for j, im in enumerate(images):
        groups.setdefault(backbone.input_size(im), []).append(j)
    return list(groups.values())
