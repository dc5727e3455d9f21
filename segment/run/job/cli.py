"""``segment``: segment a folder of images (Hydra entry point; the work is in ``run``).

:func:`segment.run.front.command.run_command` checks the command line and the output
folder before Hydra starts, and maps the outcome to the exit code (0 done, 1 nothing processed, 2
unusable input or settings, 130 interrupted).
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig

from segment.run.front.command import job, run_command
from segment.run.front.compose import CONFIG_NAMES, CONFIG_PATH
from segment.run.front.help import register_help_resolver

register_help_resolver()  # ${segment_help:segment} in hydra.help.template


def _in_use(output: Path) -> str | None:
    """Who holds ``output`` (:func:`segment.run.job.lock.in_use`), or ``None``."""
    if not (output / ".segment.lock").exists():  # = lock.LOCK_NAME; the usual case: no imports
        return None
    from segment.run.job.lock import in_use

    return in_use(output)


def run(cfg: DictConfig) -> int:
    """Segment every image under ``cfg.input`` into ``cfg.output``; returns the exit code."""
    from segment.run.job.pipeline import run_segment

    return run_segment(cfg)


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAMES["segment"])
def _main(cfg: DictConfig) -> int:
    code = job("segment", lambda: run(cfg))
    if code:  # hydra.main drops the task's return value; exit here so the shell sees it
        raise SystemExit(code)
    return code


def main() -> None:
    raise SystemExit(run_command("segment", _main, in_use=_in_use))


if __name__ == "__main__":
    main()
