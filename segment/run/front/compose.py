"""The one way to a config: :func:`compose` composes the config of ``segment``,
``segment-eval`` and ``segment-diagnose`` with Hydra's compose API from the installed
``configs/`` and checks the arguments on it once (unknown keys and options with a
did-you-mean, values of the wrong type). The commands' pre-check
(:func:`segment.run.front.command.run_command`), the Python API
(:func:`segment.run.api.segmenter.compose_config`) and the evaluator's ``methods=[NAME]``
entries (:func:`segment.eval.specs.compose_method`) compose here.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

CONFIG_MODULE = "segment.configs"
# the same configs for @hydra.main (job/cli.py, diagnose/cli.py, eval/cli.py)
CONFIG_PATH = f"pkg://{CONFIG_MODULE}"
CONFIG_NAMES = {"segment": "segment", "segment-eval": "eval", "segment-diagnose": "diagnose"}
"""Each command's primary config, ``configs/<name>.yaml``."""

# keys under which new entries may be added with `+`: free-form argument dicts
_OPEN_NODES = ("model.model_kwargs", "methods")


class UsageError(ValueError):
    """The command line cannot start a run (one line, printed without a traceback)."""



# --------------------------------------------------------------------------- names


def config_names(group: str) -> list[str]:
    """The options of a config group (``model``, ``method``, ``dataset``, ``experiment``)."""
    from importlib import resources

    root = resources.files(CONFIG_MODULE) / group
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def suggest(word: str, candidates: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate, or an empty string."""
    cands = list(dict.fromkeys(candidates))
    got = difflib.get_close_matches(word, cands, n=1, cutoff=0.6)
    if not got:  # compare the last component of dotted keys too (model.checkpont)
        tail: dict[str, str] = {}
        for c in cands:
            tail.setdefault(c.rsplit(".", 1)[-1], c)
        hit = difflib.get_close_matches(word.rsplit(".", 1)[-1], list(tail), n=1, cutoff=0.75)
        got = [tail[hit[0]]] if hit else []
    return f" (did you mean {got[0]!r}?)" if got else ""


# --------------------------------------------------------------------------- checks


def _flatten_keys(node: Any, prefix: str = "") -> list[str]:
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            key = f"{prefix}{k}"
            out.append(key)
            out.extend(_flatten_keys(v, key + "."))
    return out


_MISSING = object()


def _get(tree: Any, key: str) -> Any:
    """The value at dotted ``key`` of a config tree, or ``_MISSING``."""
    node = tree
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def _exists(tree: Any, key: str) -> bool:
    return _get(tree, key) is not _MISSING


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def value_problem(default: Any, value: Any) -> str | None:
    """Why ``value`` cannot replace a setting whose default is ``default``, or ``None``.

    Only what is certain from the default's type: a number (or a list of numbers) given a
    word, an integer given a fraction, a switch given anything but true/false (or 1/0), a
    list of numbers (``layers: [-1]``) given anything but a list of numbers. ``null`` and
    interpolations (``${...}``) are left to the component that reads them."""
    if value is None or (isinstance(value, str) and "${" in value):
        return None
    if isinstance(default, bool):
        return None if isinstance(value, bool) or value in (0, 1) else "expected true or false"
    if _is_number(default):
        items = value if isinstance(value, list) else [value]  # e.g. image_size=[336,448]
        if not all(_is_number(v) for v in items):
            return "expected a number"
        if isinstance(default, int) and not all(isinstance(v, int) or float(v).is_integer() for v in items):
            return "expected a whole number"
    if isinstance(default, list) and default and all(_is_number(v) for v in default):
        # one number stands for a list of one (layers=-1) or both sides (image_size=448)
        example = "[" + ",".join(str(v) for v in default) + "]"
        items = value if isinstance(value, list) else [value]
        if not all(_is_number(v) for v in items):
            return f"expected a number or a list of numbers, e.g. {example}"
        if all(isinstance(v, int) for v in default) and not all(
            isinstance(v, int) or float(v).is_integer() for v in items
        ):
            return f"expected whole numbers, e.g. {example}"
    return None


# run settings that are whole numbers with a lowest value (several default to null = auto,
# which the type check above cannot see): command -> key -> lowest
WHOLE_AT_LEAST = {
    "segment": {"batch_size": 1, "num_workers": 0, "max_pixels": 1, "min_size": 0, "limit": 1},
    "segment-eval": {"batch_size": 1, "num_workers": 0, "limit": 1, "bootstrap": 0, "panels": 0},
}
# ... of which these also take null (a default of null, or null read as 0 by the run)
_NULL_OK = {"segment-eval": ("num_workers", "panels")}
# ... and these a float with a whole value (a pixel count written 2e8)
_FLOAT_OK = ("max_pixels",)


def run_value_problem(command: str, key: str, default: Any, value: Any) -> str | None:
    """Why ``value`` cannot be the run setting ``key`` of ``command`` (or ``None``): the
    whole-number settings of :data:`WHOLE_AT_LEAST` (``null`` where that is the default or
    means 0), and ``input`` (a path; empty is refused: an unset shell variable)."""
    if command == "segment-diagnose" and key == "compare" and value is not None:
        names = config_names("model")
        if str(value) not in names:
            return f"unknown model{suggest(str(value), names)}; choose one of: {', '.join(names)}"
        return None
    if command == "segment-diagnose" and key in ("alpha", "top") and _is_number(value):
        return None if 0 < float(value) < 1 or (key == "top" and value == 1) else "expected a number in (0, 1)"
    if command in ("segment", "segment-diagnose") and key == "input":
        if value is not None and str(value).strip() == "":
            return "empty; give a folder or an image, or leave out input= for the bundled examples"
        return None
    low = WHOLE_AT_LEAST.get(command, {}).get(key)
    if low is None:
        return None
    if value is None:
        ok = default is None or key in _NULL_OK.get(command, ())
        return None if ok else f"expected a whole number >= {low}"
    if isinstance(value, str) and "${" in value:
        return None
    whole = isinstance(value, int) or (key in _FLOAT_OK and _is_number(value) and float(value).is_integer())
    if not _is_number(value) or not whole or value < low:
        return f"expected a whole number >= {low}"
    return None


def show_default(v: Any) -> str:
    """A default as it is written on the command line: ``null``, ``true``, ``0.2``, ``'auto'``."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return "null" if v is None else repr(v)


def hydra_compose(config_name: str, overrides: Sequence[str] = ()) -> DictConfig:
    """``configs/<config_name>.yaml`` composed by Hydra's compose API with ``overrides``
    (Hydra's syntax), from the installed configs (:data:`CONFIG_MODULE`), unchecked: use
    :func:`compose`. A Hydra app already running in this process (the ``@hydra.main`` job,
    a caller's own ``initialize``) is put back afterwards.

    Raises:
        Exception: what Hydra raises (an unknown key, a broken config...).
    """
    from hydra import compose as hydra_compose_api
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    outer = GlobalHydra.instance().hydra
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
            return hydra_compose_api(config_name, overrides=list(overrides))
    finally:
        gh = GlobalHydra.instance()  # initialize_config_module puts a new instance back
        gh.clear()
        if outer is not None:
            gh.initialize(outer)


# the config groups of every command (one place: the pre-check and --help read it)
ALL_GROUPS = ("model", "method", "dataset", "experiment")
COMMAND_GROUPS = {"segment": ("model", "method"), "segment-eval": ALL_GROUPS,
                  "segment-diagnose": ("model",)}


def compose(command: str, args: Sequence[str] = ()) -> DictConfig:
    """The config of ``command`` for the ``KEY=VALUE`` arguments ``args``: the one way in.

    ``segment``, ``segment-eval`` and ``segment-diagnose``
    (:func:`segment.run.front.command.run_command`, before Hydra's job), the Python API
    (:func:`segment.run.api.segmenter.compose_config`) and the evaluator's ``methods=[NAME]``
    entries (:func:`segment.eval.specs.compose_method`) all compose here, by Hydra's compose
    API (:func:`hydra_compose`) from ``configs/<name>.yaml`` (:data:`CONFIG_NAMES`), and the
    arguments are checked on the composition once: the group options first
    (:func:`check_groups`), then every key and value against the config those options
    compose (:func:`check_overrides`); the config of all the arguments is composed last.

    Raises:
        UsageError: unparsable argument, unknown group option, group the command does not
            use, unknown key or a value of the wrong type (each with a suggestion where one
            is close), or a config Hydra cannot compose (its first line).
    """
    config_name = CONFIG_NAMES[command]
    overrides = parse_overrides(args)
    choices = check_groups(command, overrides)
    try:
        base = hydra_compose(config_name, choices)
    except Exception as e:  # noqa: BLE001 - a broken experiment file etc.: one line
        raise UsageError(f"cannot compose the config: {str(e).strip().splitlines()[0]}") from None
    check_overrides(command, overrides, base)
    everything = [o.input_line for o in overrides]
    if everything == choices:  # only group options: that is the config
        return base
    try:
        return hydra_compose(config_name, everything)
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"bad settings: {str(e).strip().splitlines()[0]}") from None


def parse_overrides(args: Sequence[str]) -> list[Any]:
    """``KEY=VALUE`` arguments as Hydra's ``Override`` objects.

    Raises:
        UsageError: an argument Hydra cannot parse.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_overrides(list(args))
    except HydraException as e:
        raise UsageError(f"cannot parse the arguments: {str(e).strip().splitlines()[0]}") from None


def _is_choice(o: Any) -> bool:
    """A config group option (``model=NAME``), not a key, a package override or a deletion."""
    return o.key_or_group in ALL_GROUPS and o.package is None and not o.is_delete()


def check_groups(command: str, overrides: Sequence[Any]) -> list[str]:
    """The config group options among ``overrides`` (``model=NAME``...), checked; returns
    them as Hydra overrides (without ``+``).

    Raises:
        UsageError: a group the command does not use, or an option that is not a file of
            ``configs/<group>`` (with a suggestion).
    """
    groups = COMMAND_GROUPS[command]
    choices = []
    for o in overrides:
        key = o.key_or_group
        if o.is_hydra_override():
            continue
        if _is_choice(o):
            if key not in groups:
                raise UsageError(f"{command} has no {key!r} settings (its config groups: "
                                 f"{', '.join(groups)})")
            value = o.value()
            if not isinstance(value, str):
                raise UsageError(f"{key}= takes one name of configs/{key}, got {value!r}")
            names = config_names(key)
            if value not in names:
                raise UsageError(f"unknown {key} {value!r}{suggest(value, names)}; choose one of: {', '.join(names)}")
            choices.append(o.input_line.lstrip("+"))
    return choices


def check_overrides(command: str, overrides: Sequence[Any], base: DictConfig) -> None:
    """Check the ``KEY=VALUE`` overrides (not the group options) against ``base``, the
    config their group options compose: every key must exist (or sit under an open node,
    ``model.model_kwargs``, ``methods``), and a value must suit the default's type
    (:func:`value_problem`) and the run setting's range (:func:`run_value_problem`).

    Raises:
        UsageError: unknown key or bad value, naming it, the default and a suggestion.
    """
    tree = OmegaConf.to_container(base, resolve=False)
    known = [k for k in _flatten_keys(tree) if not k.endswith("_target_")]
    for o in overrides:
        key = o.key_or_group
        if o.is_hydra_override() or _is_choice(o):
            continue
        default = _get(tree, key)
        if default is not _MISSING:
            if o.is_delete() or o.is_sweep_override():  # Hydra's own business (it refuses them)
                continue
            value = o.value()
            why = value_problem(default, value) or run_value_problem(command, key, default, value)
            if why is not None:
                raise UsageError(f"{key}={o.get_value_element_as_str()}: {why} (the default is "
                                 f"{show_default(default)}); see {command} --help")
            continue
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        if any(parent == n or parent.startswith(n + ".") or key.startswith(n + ".") for n in _OPEN_NODES) and (
            _exists(tree, parent) or key.split(".")[0] == "methods"
        ):
            continue
        what = "unknown setting" if not o.is_delete() else "cannot delete unknown setting"
        raise UsageError(f"{what} {key!r}{suggest(key, known)}; see {command} --help "
                         f"(and `{command} --cfg job` for every key)")


def unset_dataset_settings(dataset: DictConfig) -> str | None:
    """The message naming the data set's required settings left unset (``???``), or None."""
    missing = [k for k in dataset if OmegaConf.is_missing(dataset, k)]
    if not missing:
        return None
    return f"dataset: set {', '.join('dataset.' + k for k in missing)} (e.g. dataset.{missing[0]}=PATH)"
