"""The methods of a ``segment-eval`` run, from the config: their labels, configs and cache keys.

Methods (``cfg.methods``), each scored from the same attention record:

- ``null``: only ``cfg.method`` (the default method);
- a list of ``configs/method`` names, or of ``{config: NAME, name: LABEL, KNOB: VALUE}``
  entries (``methods=[rollout,{config:bounce,name:bounce3,steps:3}]``);
- a dict ``LABEL -> method config``, as experiment files build it with the defaults-list
  packaging ``- /method@methods.LABEL: bounce`` and knobs under ``methods.LABEL``.

The default method (``cfg.method``) comes first unless ``include_default=false``.

Each method's key in the metric cache (:func:`method_key`) is its config's hash plus the
hash of the source of its class's modules and of the Markov core (:func:`source_hash`), so
that a code change never mixes old and new numbers. A setting that cannot work is a
:class:`ConfigError` (reported in one line, exit 2).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from segment.core.record import Capture
from segment.methods.base import Method
from segment.run.front.build import build


class ConfigError(ValueError):
    """A setting of ``segment-eval`` that cannot work (reported without a traceback)."""


@dataclass
class MethodSpec:
    """One row of the table: a label and the method's config (``_target_`` + knobs)."""

    label: str
    cfg: DictConfig
    method: Method | None = None
    key: str = ""

    def __post_init__(self) -> None:
        self.key = config_hash(self.cfg, drop=("name",))


def config_hash(cfg: Any, drop: Sequence[str] = ()) -> str:
    """Short stable hash of a config node (resolved; ``drop`` keys left out)."""
    if isinstance(cfg, (DictConfig, ListConfig)):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    if isinstance(cfg, dict):
        cfg = {k: v for k, v in cfg.items() if k not in drop}
    blob = json.dumps(cfg, sort_keys=True, default=str).encode()
    return hashlib.sha1(blob).hexdigest()[:12]


def module_source(name: str) -> bytes:
    """The source of module ``name`` (found without importing it), empty when unknown."""
    mod = sys.modules.get(name)
    path = getattr(mod, "__file__", None) if mod is not None else None
    if path is None:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        path = spec.origin if spec is not None else None
    try:
        return Path(path).read_bytes() if path else b""
    except OSError:
        return b""


def source_hash(modules: Sequence[str]) -> str:
    """Short hash of the source files of ``modules`` (names and contents)."""
    h = hashlib.sha1()
    for name in sorted(set(modules)):
        h.update(name.encode() + b"\0" + module_source(name) + b"\0")
    return h.hexdigest()[:12]


def _method_core() -> tuple[str, ...]:
    """Every module a method's numbers can depend on besides its own class's: all of
    ``segment.core`` and ``segment.methods`` and the back-ends (eigensolvers, components):
    a change to the cuts' eigensolver or to the Markov core is a new cache key."""
    import pkgutil

    import segment.core
    import segment.methods

    mods = [f"{pkg.__name__}.{m.name}" for pkg in (segment.core, segment.methods)
            for m in pkgutil.iter_modules(pkg.__path__)]
    return (*sorted(mods), "segment.backends")


def method_key(spec: MethodSpec) -> str:
    """Cache key of a method: its config hash plus the source of its class's modules (the
    class and its bases) and of the Markov core."""
    if spec.method is None:
        raise ValueError(f"method {spec.label!r} is not instantiated")
    mods = [c.__module__ for c in type(spec.method).__mro__
            if c.__module__ not in ("builtins", "abc")]
    return f"{config_hash(spec.cfg, drop=('name',))}-{source_hash([*mods, *_method_core()])}"


def compose_method(name: str) -> DictConfig:
    """The ``configs/method/<name>.yaml`` option, composed by :func:`segment.run.front.compose.compose`
    (the one composition of every command and the API: Hydra's compose API, defaults lists work)."""
    from segment.run.front.compose import compose, config_names, suggest

    names = config_names("method")
    if name not in names:
        raise ConfigError(
            f"methods: no method config named {name!r} in configs/method"
            f"{suggest(name, names)}; choose one of: {', '.join(names)}"
        )
    return compose("segment-eval", [f"method={name}"]).method


def _with_knobs(config: str, knobs: dict[str, Any], where: str) -> DictConfig:
    """``configs/method/<config>.yaml`` with ``knobs`` set; a knob the config does not have is
    a one-line :class:`ConfigError` naming the entry, the knob and the closest one."""
    from segment.run.front.compose import suggest

    node = compose_method(config)
    unknown = [str(k) for k in knobs if str(k) not in node]
    if unknown:
        keys = [str(k) for k in node if str(k) != "_target_"]
        k = unknown[0]
        raise ConfigError(
            f"{where}: method config {config!r} has no setting {k!r}{suggest(k, keys)};"
            f" its settings: {', '.join(keys)}"
        )
    return OmegaConf.merge(node, knobs)


def _label_of_default(cfg: DictConfig) -> str:
    m = cfg.method
    if "name" in m and m.name:
        return str(m.name)
    try:
        from hydra.core.hydra_config import HydraConfig

        choice = HydraConfig.get().runtime.choices.get("method")
        if choice:
            return str(choice)
    except (ValueError, AttributeError):
        pass
    return str(m.get("_target_", "method")).rsplit(".", 1)[-1]


def _knob_label(base: str, knobs: dict[str, Any]) -> str:
    if not knobs:
        return base
    return base + "(" + ",".join(f"{k}={v}" for k, v in sorted(knobs.items())) + ")"


def resolve_methods(cfg: DictConfig) -> list[MethodSpec]:
    """The methods to score, default first (see the module docstring for the forms)."""
    specs: list[MethodSpec] = []
    if cfg.get("include_default", True) or cfg.get("methods") is None:
        if cfg.get("method") is None:
            raise ConfigError("no method: set method=NAME or methods=[...]")
        specs.append(MethodSpec(_label_of_default(cfg), cfg.method))
    methods = cfg.get("methods")
    if methods is None:
        pass
    elif isinstance(methods, DictConfig):
        for label, node in methods.items():
            if isinstance(node, str):
                node = compose_method(node)
            elif not isinstance(node, DictConfig):
                raise ConfigError(f"methods.{label}: expected a method config or a config name, got {node!r}")
            if "_target_" not in node:
                if "config" not in node:
                    raise ConfigError(
                        f"methods.{label}: expected a method config with _target_ (e.g. from"
                        f" '- /method@methods.{label}: bounce'), or {{config: NAME, KNOB: VALUE}}"
                    )
                knobs = {k: v for k, v in node.items() if k != "config"}
                node = _with_knobs(str(node.config), knobs, f"methods.{label}")
            specs.append(MethodSpec(str(label), node))
    elif isinstance(methods, (ListConfig, list, tuple)):
        for entry in methods:
            if isinstance(entry, str):
                specs.append(MethodSpec(entry, compose_method(entry)))
            elif isinstance(entry, (DictConfig, dict)) and "config" in entry:
                entry = OmegaConf.create(entry) if isinstance(entry, dict) else entry
                knobs = {str(k): v for k, v in entry.items() if k not in ("config",)}
                label = str(knobs.pop("name", None) or _knob_label(str(entry.config), knobs))
                node = _with_knobs(str(entry.config), knobs, f"methods ({label})")
                if "name" in node:
                    node.name = label
                specs.append(MethodSpec(label, node))
            else:
                raise ConfigError(
                    f"methods: each entry must be a configs/method name or {{config: NAME, name: LABEL, "
                    f"KNOB: VALUE}}, got {entry!r}"
                )
    else:
        raise ConfigError(f"methods must be null, a list or a dict, got {type(methods).__name__}")
    # the default method given again in the list is the same row
    seen: dict[str, MethodSpec] = {}
    out = []
    for s in specs:
        if s.label in seen:
            if seen[s.label].key == s.key:
                continue
            raise ConfigError(f"two different methods are labelled {s.label!r}; give one another name")
        seen[s.label] = s
        out.append(s)
    return out


def instantiate_method(spec: MethodSpec) -> Method:
    """The method of ``spec``, named by its label; one-line :class:`BuildError` (exit 2)
    for a knob value it refuses or a target that is not a :class:`Method`."""
    kwargs = {"name": spec.label} if "name" in spec.cfg else {}
    return build(spec.cfg, Method, f"method {spec.label!r}", **kwargs)


def union_capture(methods: Sequence[Method], num_layers: int) -> Capture:
    """The smallest capture serving every method (``Capture.union`` folded)."""
    caps = [m.capture(num_layers) for m in methods]
    out = caps[0]
    for c in caps[1:]:
        out = out.union(c, num_layers)
    return out

