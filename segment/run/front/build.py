"""One way from a config node to an object: :func:`build`, Hydra's ``instantiate`` with one
error policy, for every node the package builds (the model, the method, the data set)."""

from __future__ import annotations

from typing import Any, TypeVar

from omegaconf import DictConfig

T = TypeVar("T")


class BuildError(ValueError):
    """A config node that cannot be built: one line naming the node and the problem (the
    constructor's own error is its ``__cause__``)."""


def _unwrap(e: BaseException) -> BaseException:
    """The error behind Hydra's ``InstantiationException`` wrappers (``e`` itself if none)."""
    while type(e).__name__ == "InstantiationException" and e.__cause__ is not None:
        e = e.__cause__
    return e


def problem(e: BaseException) -> str:
    """An error as one line: the first line of its message, led by its type unless it is a
    ``ValueError`` (a setting a constructor refuses says what is wrong by itself)."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    if isinstance(e, ValueError) and first:
        return first
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def build(node: DictConfig, expect: type[T], what: str | None = None, **kwargs: Any) -> T:
    """``instantiate(node, **kwargs)``, which must give an ``expect``.

    Args:
        node: a config node with ``_target_`` (``cfg.model``, ``cfg.method``, ``cfg.dataset``).
        expect: the class the object must be an instance of (``Backbone``, ``Method``,
            ``SegmentationDataset``).
        what: the node in messages (``the model``, ``method 'r2'``); default its ``_target_``.
        **kwargs: passed to the constructor over the node's keys (``device=...``).

    Raises:
        BuildError: a ``ValueError`` of one line, ``cannot build WHAT: PROBLEM``: the
            constructor's error (:func:`problem`; Hydra's wrappers removed, the error kept as
            ``__cause__``), or an object that is not an ``expect``.
    """
    from hydra.utils import instantiate

    what = what or str(node.get("_target_", "the config"))
    try:
        obj = instantiate(node, **kwargs)
    except Exception as e:  # noqa: BLE001 - whatever the constructor raises: one line
        cause = _unwrap(e)
        raise BuildError(f"cannot build {what}: {problem(cause)}") from cause
    if not isinstance(obj, expect):
        raise BuildError(f"cannot build {what}: {node.get('_target_')} is not a "
                         f"{expect.__module__}.{expect.__qualname__} (got {type(obj).__name__})")
    return obj
