"""The front door of ``segment`` and ``segment-eval``: what happens before and after Hydra.

Hydra alone turns a typo into exit 1 (``batchsize=4``) or silently ignores it
(``+batchsize=4``), creates the run folder before the job can say the input is unusable,
and prints a traceback of its log handler when the output cannot be written. So
:func:`run_command`, around the ``@hydra.main`` function:

1. composes the config with :func:`compose` and checks the command line against it:
   unknown keys (with or without ``+``/``++``, or a ``~`` deletion) and unknown
   config-group options exit 2 with a did-you-mean; groups the command does not use
   (``segment dataset=...``) exit 2;
2. checks that the output folder can be created and written (not a file, not under a
   file, not read-only): exit 2 with one line naming it;
3. runs Hydra; the job's exit code comes back through ``SystemExit`` (Hydra drops return
   values); Ctrl-C anywhere is 130;
4. after exit 2 (the run could not start), removes the run folder when this run created
   it and it holds only Hydra's own files (``.hydra/``, ``*.log``) and empty folders, and the empty parent
   folders it created (``outputs/eval/DATE/TIME``): nothing is left behind.

:func:`compose` is the one way to a config: the commands' pre-check, the Python API
(:func:`segment.run.api.segmenter.compose_config`) and the evaluator's ``methods=[NAME]`` entries
compose through it (Hydra's compose API on the installed ``configs/``). It also provides
the ``--help`` text (``hydra.help.template`` in ``configs/segment.yaml``
and ``configs/eval.yaml`` interpolates ``${segment_help:COMMAND}``).

Exit codes (:mod:`segment.utils`): 0 done, 1 nothing could be processed, 2 unusable input
or settings, 130 interrupted.
"""

from __future__ import annotations

import difflib
import errno
import logging
import os
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

EXIT_FAILED = 1  # = segment.utils.EXIT_FAILED (not imported: that module loads torch)
EXIT_BAD_INPUT = 2  # = segment.utils.EXIT_BAD_INPUT
EXIT_BUSY = 3  # = segment.utils.EXIT_BUSY
EXIT_INTERRUPTED = 130

CONFIG_MODULE = "segment.configs"
CONFIG_PATH = f"pkg://{CONFIG_MODULE}"  # the same configs for @hydra.main (segment/run/cli.py ...)
CONFIG_NAMES = {"segment": "segment", "segment-eval": "eval", "segment-diagnose": "diagnose"}
"""Each command's primary config, ``configs/<name>.yaml``."""

# keys under which new entries may be added with `+`: free-form argument dicts
_OPEN_NODES = ("model.model_kwargs", "methods")


class UsageError(ValueError):
    """The command line cannot start a run (one line, printed without a traceback)."""


@dataclass
class Plan:
    """What the pre-check learnt: the output folder and what existed before the run."""

    output: Path | None = None
    output_existed: bool = True
    anchor: Path | None = None  # deepest ancestor of output that existed before the run


_RUN_DIR: list[str] = []  # the run folder Hydra made, recorded by the job (see note_run_dir)


def note_run_dir() -> None:
    """Called inside the ``@hydra.main`` job: remember Hydra's run folder for the cleanup."""
    from hydra.core.hydra_config import HydraConfig

    try:
        _RUN_DIR.append(HydraConfig.get().runtime.output_dir)
    except ValueError:
        pass


class OneLineErrors(logging.Formatter):
    """A console formatter: an error is one ``COMMAND: message`` line, like the pre-check's
    (no time stamp, no logger name, no traceback unless ``HYDRA_FULL_ERROR=1``); other
    records as ``base`` formats them."""

    def __init__(self, command: str, base: logging.Formatter | None = None) -> None:
        super().__init__()
        self.command = command
        self.base = base or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno < logging.ERROR:
            return self.base.format(record)
        line = f"{self.command}: {record.getMessage()}"
        if record.exc_info and _full_error():
            line += "\n" + self.formatException(record.exc_info)
        return line


def _full_error() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def job(command: str, work: Callable[[], int]) -> int:
    """The body of a ``@hydra.main`` job: Hydra's run folder noted (:func:`note_run_dir`),
    errors on the console as one line (:class:`OneLineErrors`), then ``work()``.

    An exception that escapes ``work`` (a bug, or a fault nothing expected) is one
    ``COMMAND: ...`` line and exit 1; ``HYDRA_FULL_ERROR=1`` lets it through to Hydra,
    which prints the traceback.
    """
    note_run_dir()
    for h in logging.getLogger().handlers:
        if type(h) is logging.StreamHandler and not isinstance(h.formatter, OneLineErrors):
            h.setFormatter(OneLineErrors(command, h.formatter))
    try:
        return work()
    except Exception as e:
        if _full_error():
            raise
        while type(e).__name__ == "InstantiationException" and e.__cause__ is not None:
            e = e.__cause__
        if isinstance(e, OSError) and e.errno in _WRITE_FAULTS:  # a full disk, a quota, read-only
            where = f" ({os.fsdecode(e.filename)})" if e.filename else ""
            print(f"{command}: cannot write: {e.strerror}{where}; rerun the same command to resume "
                  "once it can be written", file=sys.stderr, flush=True)
            return EXIT_FAILED
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"{command}: {type(e).__name__}{': ' + msg if msg else ''} "
              "(rerun with HYDRA_FULL_ERROR=1 for the traceback)", file=sys.stderr, flush=True)
        return EXIT_FAILED


_WRITE_FAULTS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO}


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
    "segment": {"batch_size": 1, "num_workers": 0, "max_pixels": 1, "min_size": 0},
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

    ``segment``, ``segment-eval`` and ``segment-diagnose`` (:func:`run_command`, before
    Hydra's job), the Python API (:func:`segment.run.api.segmenter.compose_config`) and the
    evaluator's ``methods=[NAME]`` entries (:func:`segment.eval.specs.compose_method`) all
    compose here, by Hydra's compose API
    (:func:`hydra_compose`) from ``configs/<name>.yaml`` (:data:`CONFIG_NAMES`), and the
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


def check_output(output: str | os.PathLike) -> Plan:
    """The output folder must be creatable and writable; returns what existed before.

    Raises:
        UsageError: naming the folder and the problem.
    """
    out = Path(output).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise UsageError(f"output {str(out)!r} is a file, not a folder; choose another output=")
    anchor = out
    while not anchor.exists():
        anchor = anchor.parent
    if not anchor.is_dir():
        raise UsageError(f"output {str(out)!r} cannot be created: {str(anchor)!r} is a file")
    try:  # a real attempt: permissions, read-only mounts, ACLs
        probe = tempfile.mkdtemp(prefix=".segment-write-test-", dir=anchor)
        os.rmdir(probe)
    except OSError as e:
        what = "is not writable" if out == anchor else f"cannot be created: {str(anchor)!r} is not writable"
        raise UsageError(f"output {str(out)!r} {what} ({e.strerror or e}); choose another output=") from None
    return Plan(output=out, output_existed=out.exists(), anchor=anchor)


def check_paths(command: str, cfg: DictConfig) -> None:
    """The files and folders the command reads exist: ``input`` (and holds an image),
    ``model.checkpoint``, ``compare_checkpoint`` (with ``compare``), ``dataset.root`` (or,
    token masking, ``masking.input``). Checked before any model library loads (torch and
    timm take seconds to import), so a mistyped path or an empty folder fails at once; the
    run checks them again where it reads them (the Python API starts there).

    Raises:
        UsageError: naming the setting and the path.
    """
    from segment.run.io import InputError, check_input

    def images(value: Any, prefix: str = "") -> None:
        if value is not None:
            try:
                check_input(str(value))
            except InputError as e:
                raise UsageError(f"{prefix}{e}") from None

    if command in ("segment", "segment-diagnose"):
        images(cfg.get("input"))
    if cfg.get("compare_checkpoint") and not cfg.get("compare"):
        raise UsageError(f"compare_checkpoint={cfg.compare_checkpoint} needs compare=MODEL")
    files = ["model.checkpoint"] + (["compare_checkpoint"] if cfg.get("compare") else [])
    for key in files:
        value = OmegaConf.select(cfg, key, default=None)
        if value is not None and not (path := Path(str(value)).expanduser()).is_file():
            raise UsageError(f"{key}: no such file: {path}")
    if command != "segment-eval":
        return
    if cfg.get("masking") is not None:  # experiment=token_masking reads masking.input instead
        images(cfg.masking.get("input"), "masking.input: ")
        return
    missing = unset_dataset_settings(cfg.dataset)
    if missing:
        raise UsageError(missing)
    root = cfg.dataset.get("root")
    if root is not None and not (path := Path(str(root)).expanduser()).exists():
        raise UsageError(f"dataset.root: no such file or folder: {path}")


def unset_dataset_settings(dataset: DictConfig) -> str | None:
    """The message naming the data set's required settings left unset (``???``), or None."""
    missing = [k for k in dataset if OmegaConf.is_missing(dataset, k)]
    if not missing:
        return None
    return f"dataset: set {', '.join('dataset.' + k for k in missing)} (e.g. dataset.{missing[0]}=PATH)"


class FolderInUse(Exception):
    """Another ``segment`` run holds the output folder (one line, exit 3)."""


def check_not_busy(output: Path) -> None:
    """Refuse an output folder that a live run holds (:mod:`segment.run.job.lock`); the run
    itself takes the lock later, so two runs started at once are told apart there.

    Raises:
        FolderInUse: naming the other run's pid and host.
    """
    if not (output / ".segment.lock").exists():  # = lock.LOCK_NAME; the usual case: no imports
        return
    from segment.run.job.lock import busy_message, holder

    h = holder(output)
    if h is not None:
        raise FolderInUse(busy_message(output, h))


# --------------------------------------------------------------------------- cleanup


def _no_files(folder: Path) -> bool:
    return all(p.is_dir() and not p.is_symlink() and _no_files(p) for p in folder.iterdir())


def _only_hydra_files(folder: Path) -> bool:
    """Only Hydra's ``.hydra/`` and ``*.log``, and folders without files (an empty cache)."""
    for p in folder.iterdir():
        if p.name == ".hydra" and p.is_dir():
            continue
        if p.suffix == ".log" and p.is_file():
            continue
        if p.is_dir() and not p.is_symlink() and _no_files(p):
            continue
        return False
    return True


def cleanup(plan: Plan) -> None:
    """Remove a run folder this run created that holds only Hydra's files, and the empty
    parents it created (never anything that existed before the run)."""
    if plan.output is None or plan.anchor is None:
        return
    run_dir = Path(_RUN_DIR[-1]).absolute() if _RUN_DIR else plan.output
    existed = plan.output_existed and run_dir == plan.output
    if existed or not run_dir.is_dir() or not _only_hydra_files(run_dir):
        return
    try:
        run_dir.relative_to(plan.anchor)
    except ValueError:
        return
    import logging

    logging.shutdown()  # Hydra's file handler holds <job>.log open
    shutil.rmtree(run_dir, ignore_errors=True)
    parent = run_dir.parent
    while parent != plan.anchor and plan.anchor in parent.parents:
        try:
            parent.rmdir()  # only when empty
        except OSError:
            break
        parent = parent.parent


# --------------------------------------------------------------------------- the command


def run_command(command: str, hydra_main: Callable[[], Any], argv: Sequence[str] | None = None) -> int:
    """Pre-check, run the ``@hydra.main`` function, map its outcome to an exit code.

    The pre-check composes the config by :func:`compose` (the arguments checked once);
    ``hydra_main`` (``@hydra.main`` on :data:`CONFIG_PATH` and ``CONFIG_NAMES[command]``,
    the same configs) then composes the job's config from the same arguments, with Hydra's
    own node: the job's name, its run folder (``hydra.run.dir: ${output}``), its logging
    into ``<output>/<job>.log`` and ``.hydra/``, and the flags it alone handles (``--help``,
    ``--cfg``, ``-m``, ``--config-dir``...).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    plan = Plan()
    flags = [a for a in args if a.startswith("-") and not a.startswith("~")]
    try:
        if not flags:  # --help, --cfg, -m ...: Hydra's own business
            cfg = compose(command, args)
            if cfg.get("output"):
                plan = check_output(str(cfg.output))
            if command == "segment" and plan.output is not None and os.environ.get("RANK", "0") == "0":
                check_not_busy(plan.output)  # before Hydra writes its files into the folder
            check_paths(command, cfg)
    except UsageError as e:
        print(f"{command}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except FolderInUse as e:
        print(f"{command}: {e}", file=sys.stderr)
        return EXIT_BUSY
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    try:
        hydra_main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    if code == EXIT_BAD_INPUT:
        cleanup(plan)
    return code


# --------------------------------------------------------------------------- --help


_HELP = {
    "segment": dict(
        what="segment every image of a folder: masks, heatmaps, overlays, region labels, COCO "
             "annotations and an index.html gallery (attention read as Markov chains)",
        usage="segment [input=DIR|FILE] [output=DIR] [model=NAME] [method=NAME] [KEY=VALUE ...]",
        examples=[
            ("segment output=results/ model.checkpoint=/path/dinov2_vits14.safetensors",
             "offline: local weights, the bundled example photos"),
            ("segment input=photos/ output=results/", "weights from the Hugging Face hub (cached)"),
            ("segment input=photos/ output=results/ model=dinov2_vitb14_reg4 device=cuda batch_size=32", ""),
            ("torchrun --nproc_per_node=4 -m segment input=photos/ output=results/",
             "several processes (GPUs: device=cuda; CPUs: gloo), one node or many"),
        ],
        required=[
            ("input=DIR", "a folder (read recursively) or one image; default: the bundled examples"),
            ("output=DIR", "the results folder; default: outputs/segment (a rerun resumes)"),
            ("model.checkpoint=PATH", "offline machines: local weights (.safetensors / torch state dict)"),
        ],
        settings="device=auto|cpu|cuda  batch_size=8  overwrite=false  retry_skipped=false  num_workers\n"
                 "  max_pixels  min_size  progress=true  label_upsampling=smooth|nearest\n"
                 "  render.{colormap,overlay_alpha,jpeg_quality,png_compression,thumb_size,fsync}",
    ),
    "segment-diagnose": dict(
        what="attention diagnostics: every layer and head read as a Markov chain (entropy, "
             "sinks, |lambda_2|, metastable states, exact TokenRank, stable rank), averaged "
             "over images, written as diagnostics.json/.csv and report.html",
        usage="segment-diagnose [input=DIR|FILE] [output=DIR] [model=NAME] [compare=NAME] "
              "[KEY=VALUE ...]",
        examples=[
            ("segment-diagnose output=diag/ model.checkpoint=/path/dinov2_vits14.safetensors",
             "offline: local weights, the bundled example photos"),
            ("segment-diagnose input=photos/ output=diag/ model=dinov2_vits14 compare=dinov2_vits14_reg4",
             "two models side by side (registers), with the per-measure difference"),
        ],
        required=[
            ("input=DIR", "a folder (read recursively) or one image; default: the bundled examples"),
            ("output=DIR", "the results folder; default: outputs/diagnose"),
            ("model.checkpoint=PATH", "offline machines: local weights (.safetensors / torch state dict)"),
            ("compare=NAME", "a second model (configs/model); compare_checkpoint=PATH its weights"),
        ],
        settings="device=auto|cpu|cuda  per_image=false  report=true  progress=true\n"
                 "  alpha=0.99 (TokenRank damping)  threshold=0.9 (metastable moduli)  top=0.01",
    ),
    "segment-eval": dict(
        what="score segmentation methods on a benchmark (pixAcc, mIoU, mIoU_CA, mAP) from one "
             "backbone pass per batch",
        usage="segment-eval dataset=NAME dataset.root=PATH [model=NAME] [method=NAME] "
              "[experiment=NAME] [KEY=VALUE ...]",
        examples=[
            ("segment-eval dataset=folder dataset.root=/data/ECSSD model.checkpoint=/path/dinov2_vits14.safetensors",
             "offline: local weights"),
            ("segment-eval experiment=vit_imagenet_seg dataset.root=/data/gtsegs_ijcv.mat", "the ViT rows of a table"),
            ("segment-eval dataset.root=/data/ECSSD 'methods=[rollout,tokenrank]' limit=50 output=eval_out/", ""),
        ],
        required=[
            ("dataset.root=PATH", "the data set (required)"),
            ("output=DIR", "results folder (default outputs/eval/DATE/TIME); the same output= resumes"),
            ("model.checkpoint=PATH", "offline machines: local weights"),
        ],
        settings="methods=[...]  include_default=true  device=auto  batch_size=8  num_workers=0  limit=N\n"
                 "  bootstrap=1000 (95% intervals; 0 = off)  mask_at=image|grid  cache=true  panels=4\n"
                 "  progress=true  seed=0",
    ),
}


def help_text(command: str) -> str:
    """The ``--help`` text of a command (groups listed from the installed configs)."""
    h = _HELP[command]
    groups = COMMAND_GROUPS[command]
    lines = [textwrap.fill(f"{command}: {h['what']}.", width=96), "", "Usage:", f"  {h['usage']}", "", "Examples:"]
    for cmd, note in h["examples"]:
        lines.append(f"  {cmd}" + (f"\n      # {note}" if note else ""))
    lines += ["", "Required keys and the usual ones:"]
    lines += [f"  {k:<22} {v}" for k, v in h["required"]]
    lines += ["", "Config groups (GROUP=NAME):"]
    for g in groups:
        lines.append(textwrap.fill(", ".join(config_names(g)), width=96, initial_indent=f"  {g:<11} ",
                                   subsequent_indent=" " * 14, break_on_hyphens=False))
    lines += ["", "Settings (KEY=VALUE):", f"  {h['settings']}",
              "  model.KEY / method.KEY: the keys of the chosen configs; list them with",
              f"  `{command} [model=NAME] [method=NAME] --cfg job`",
              "", textwrap.fill("Exit codes: 0 done, 1 nothing could be processed" + (
                  " or the output folder could not be written (a full disk: a rerun resumes)"
                  if command == "segment" else "") + ", 2 unusable input or settings, " + (
                  "3 the output folder is in use by another run, " if command == "segment" else "")
                  + "130 interrupted.", width=96),
              "Python: import segment; seg = segment.load(model=..., method=...); seg(image)",
              "Hydra's own options: --hydra-help"]
    return "\n".join(lines).replace("$", "$$")


def register_help_resolver() -> None:
    """``${segment_help:COMMAND}`` for ``hydra.help.template``."""
    if not OmegaConf.has_resolver("segment_help"):
        OmegaConf.register_new_resolver("segment_help", help_text)
