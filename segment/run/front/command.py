"""The front door of ``segment``, ``segment-eval`` and ``segment-diagnose``: what happens
before and after Hydra.

Hydra alone turns a typo into exit 1 (``batchsize=4``) or silently ignores it
(``+batchsize=4``), creates the run folder before the job can say the input is unusable,
and prints a traceback of its log handler when the output cannot be written. So
:func:`run_command`, around the ``@hydra.main`` function:

1. composes the config with :func:`~segment.run.front.compose.compose` and checks the command line against it:
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

Exit codes (:mod:`segment.utils`): 0 done, 1 nothing could be processed, 2 unusable input
or settings, 3 the output folder is in use (``segment``), 130 interrupted.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from segment.run.front.compose import UsageError, compose, unset_dataset_settings
from segment.run.front.versions import TorchPairError, check_torch_pair

EXIT_FAILED = 1  # = segment.utils.EXIT_FAILED (not imported: that module loads torch)
EXIT_BAD_INPUT = 2  # = segment.utils.EXIT_BAD_INPUT
EXIT_BUSY = 3  # = segment.utils.EXIT_BUSY
EXIT_INTERRUPTED = 130

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


class FolderInUse(Exception):
    """Another run holds the output folder (one line, exit 3)."""


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


# the commands whose one bare argument is their input (``segment photos/``)
TAKES_INPUT = ("segment", "segment-diagnose")


@functools.cache
def hydra_options() -> tuple[frozenset[str], frozenset[str]]:
    """Hydra's own options, read from the parser ``@hydra.main`` uses: every option string
    (``--help``, ``-m``, ``--cfg``...), and those followed by a value (``--cfg job``: that
    value is not an input). Any other ``--key=value`` is a setting written with dashes."""
    from hydra._internal.utils import get_args_parser

    actions = [a for a in get_args_parser()._actions if a.option_strings]
    every = frozenset(s for a in actions for s in a.option_strings)
    return every, frozenset(s for a in actions if a.nargs != 0 for s in a.option_strings)


def _quote(value: str) -> str:
    """``value`` as a Hydra override value: bare when Hydra reads it back unchanged, else
    single-quoted with ``\\`` and ``'`` escaped."""
    if re.fullmatch(r"[\w./~@:+-]+", value) and not value[0].isdigit():
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def positional_input(command: str, args: Sequence[str]) -> list[str]:
    """``segment PATH [KEY=VALUE ...]``: one bare argument (no ``=``, no leading ``-``, ``+``
    or ``~``) is the command's ``input=PATH``.

    Raises:
        UsageError: a bare argument where the command takes none, a second one, or one
            beside ``input=``; each names ``input=PATH``.
    """
    bare = [a for i, a in enumerate(args) if "=" not in a and not a.startswith(("-", "+", "~"))
            and not (i and args[i - 1] in hydra_options()[1])]
    if not bare:
        return list(args)
    if command not in TAKES_INPUT:
        raise UsageError(f"unexpected argument {bare[0]!r}: settings are KEY=VALUE (e.g. "
                         f"dataset.root={bare[0]}); see {command} --help")
    if len(bare) > 1:
        raise UsageError(f"one input at a time, got {len(bare)} ({', '.join(map(repr, bare[:3]))});"
                         f" give a folder as input=PATH")
    if any(a.split("=", 1)[0].lstrip("+") == "input" for a in args if "=" in a):
        raise UsageError(f"{bare[0]!r} and input= both name the input; give one")
    return [f"input={_quote(a)}" if a is bare[0] else a for a in args]


def check_flags(command: str, args: Sequence[str]) -> None:
    """Refuse a setting written as an option (``--input=photos/``, ``--batch_size 4``) with
    the ``KEY=VALUE`` form it means, instead of Hydra's usage text.

    Raises:
        UsageError: naming the ``KEY=VALUE`` to write.
    """
    for i, a in enumerate(args):
        if not a.startswith("--"):
            continue
        name, eq, value = a[2:].partition("=")
        if f"--{name}" in hydra_options()[0] or not name:
            continue
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("-") and "=" not in args[i + 1]:
            value, eq = args[i + 1], "="
        hint = f"{name.replace('-', '_')}={value}" if eq else f"{name.replace('-', '_')}=VALUE"
        raise UsageError(f"unknown option {a!r}: settings are written without dashes, as {hint}"
                         f" (see {command} --help)")


def run_command(command: str, hydra_main: Callable[[], Any], argv: Sequence[str] | None = None,
                in_use: Callable[[Path], str | None] | None = None) -> int:
    """Pre-check, run the ``@hydra.main`` function, map its outcome to an exit code.

    The pre-check composes the config by :func:`~segment.run.front.compose.compose` (the
    arguments checked once); ``hydra_main`` (``@hydra.main`` on
    :data:`~segment.run.front.compose.CONFIG_PATH` and ``CONFIG_NAMES[command]``,
    the same configs) then composes the job's config from the same arguments, with Hydra's
    own node: the job's name, its run folder (``hydra.run.dir: ${output}``), its logging
    into ``<output>/<job>.log`` and ``.hydra/``, and the flags it alone handles (``--help``,
    ``--cfg``, ``-m``, ``--config-dir``...).

    ``in_use(output)``, when given, names the live run that holds the output folder (or
    returns ``None``); asked on rank 0 before Hydra writes into the folder (``segment``:
    :func:`segment.run.job.lock.in_use`), a held folder exits 3.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    plan = Plan()
    try:
        check_flags(command, args)
        args = positional_input(command, args)
        if argv is None:
            sys.argv[1:] = args  # @hydra.main reads sys.argv: the rewritten input= with it
        flags = [a for a in args if a.startswith("-") and not a.startswith("~")]
        if not flags:  # --help, --cfg, -m ...: Hydra's own business
            cfg = compose(command, args)
            if cfg.get("output"):
                plan = check_output(str(cfg.output))
            if in_use is not None and plan.output is not None and os.environ.get("RANK", "0") == "0":
                holder = in_use(plan.output)  # before Hydra writes its files into the folder
                if holder is not None:
                    raise FolderInUse(holder)
            check_paths(command, cfg)  # without torch: a mistyped path fails at once
            check_torch_pair()  # then torch: a broken pair fails late, inside the model
    except (UsageError, TorchPairError) as e:
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
