"""The configs folder read as a registry, as timm's ``list_models`` / ``create_model``.

There is no second registry: a model is a file of ``configs/model/``, a method one of
``configs/method/``, a data set one of ``configs/dataset/`` (the names the commands take
as ``model=``, ``method=``, ``dataset=``), and :func:`create_method` composes the method's
file with Hydra's compose API (:func:`segment.run.front.compose.compose`, the commands'
one way to a config) and builds it (:func:`segment.run.front.build.build`), as ``segment method=NAME KEY=VALUE``
does. Listing reads only the folder: it imports neither torch nor the methods.

Example::

    import segment

    segment.list_models("dinov2*")                 # ['dinov2_vitb14', ..., 'dinov2_vits14_reg4']
    segment.list_methods()                         # ['bounce', 'cls_attention', ..., 'cuts', ...]
    m = segment.create_method("cuts", escape=0.4)  # an EscapeCuts, as configs/method/cuts.yaml
    seg = segment.load(method=m)                   #   with method.escape=0.4
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from segment.run.front.build import build
from segment.run.front.compose import compose, config_names, show_default, suggest, value_problem

if TYPE_CHECKING:
    from segment.methods.base import Method

__all__ = ["create_method", "list_datasets", "list_methods", "list_models", "method_config"]


def _matching(group: str, pattern: str | Sequence[str]) -> list[str]:
    """The names of config group ``group`` that match any of the shell-style ``pattern``
    (``*``, ``?``, ``[...]``, case-sensitive); ``""`` = all, sorted."""
    patterns = [pattern] if isinstance(pattern, str) else pattern
    if not isinstance(patterns, Sequence) or not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"pattern must be a string or a list of strings, got {pattern!r}")
    names = config_names(group)
    patterns = [p for p in patterns if p]
    if not patterns:
        return names
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def list_models(pattern: str | Sequence[str] = "") -> list[str]:
    """The model names ``segment.load(model=...)`` and ``segment model=...`` take: the files
    of ``configs/model/``, sorted.

    Args:
        pattern: keep the names that match this shell-style pattern (``"dinov2*"``,
            ``"*_reg4"``), or any of a list of them; ``""`` = every name. A pattern that
            matches nothing gives an empty list, as timm's ``list_models`` does.
    """
    return _matching("model", pattern)


def list_methods(pattern: str | Sequence[str] = "") -> list[str]:
    """The method names ``segment.create_method``, ``segment.load(method=...)`` and
    ``segment method=...`` take: the files of ``configs/method/``, sorted (``pattern`` as in
    :func:`list_models`)."""
    return _matching("method", pattern)


def list_datasets(pattern: str | Sequence[str] = "") -> list[str]:
    """The data set names ``segment-eval dataset=...`` takes: the files of
    ``configs/dataset/``, sorted (``pattern`` as in :func:`list_models`)."""
    return _matching("dataset", pattern)


def create_method(name: str, **overrides: Any) -> Method:
    """The method ``configs/method/NAME.yaml`` describes, with ``overrides`` of its keys.

    The same object ``segment method=NAME method.KEY=VALUE`` runs: the file is composed by
    Hydra's compose API and built by :func:`segment.run.front.build.build`; each override is
    checked against the key's default as the commands check their arguments
    (:func:`segment.run.front.compose.value_problem`) and then by the method's own constructor.
    Pass the result to ``segment.load(method=...)``; change a field afterwards with
    ``dataclasses.replace``.

    Args:
        name: a method config name (:func:`list_methods`), e.g. ``"cuts"``.
        **overrides: keys of that file (``escape=0.4``, ``layers=[-2, -1]``).

    Raises:
        ValueError: an unknown name or key (with a suggestion), a value of the wrong type,
            or a value the method refuses (``BuildError``: ``cannot build method 'NAME':``
            and the method's own message).
    """
    from segment.methods.base import Method

    names = config_names("method")
    if name not in names:
        raise ValueError(f"unknown method {name!r}{suggest(str(name), names)}; choose one of {names}")
    node = compose("segment", [f"method={name}"]).method
    keys = [k for k in node if k != "_target_"]
    for key, value in overrides.items():
        if key not in keys:
            raise ValueError(f"unknown setting {key!r} of method {name!r}{suggest(key, keys)};"
                             f" it takes: {', '.join(keys)}")
        default = node[key]
        if isinstance(default, (DictConfig, ListConfig)):
            default = OmegaConf.to_container(default)
        plain = list(value) if isinstance(value, tuple) else value
        why = value_problem(default, plain)
        if why is not None:
            raise ValueError(f"{name}: {key}={plain!r}: {why} (the default is {show_default(default)})")
        OmegaConf.update(node, key, plain, merge=False)
    return build(node, Method, f"method {name!r}")


def method_config(method: Method) -> DictConfig:
    """The config node that builds ``method`` again: ``_target_`` (its class) and every
    field of its dataclass, so that ``hydra.utils.instantiate(method_config(m)) == m``
    (``segment.load(method=m)`` records it as the Segmenter's ``config.method``).

    Raises:
        ValueError: a field whose value a config cannot hold (names the field).
    """
    cls = type(method)
    node: dict[str, Any] = {"_target_": f"{cls.__module__}.{cls.__qualname__}"}
    for f in dataclasses.fields(method):
        if not f.init:
            continue
        value = getattr(method, f.name)
        value = list(value) if isinstance(value, tuple) else value
        try:
            OmegaConf.create({f.name: value})
        except Exception as e:  # noqa: BLE001 - OmegaConf's unsupported-type errors vary
            raise ValueError(f"{cls.__name__}.{f.name}={value!r} cannot be written to a config"
                             f" ({type(e).__name__})") from None
        node[f.name] = value
    return OmegaConf.create(node)
