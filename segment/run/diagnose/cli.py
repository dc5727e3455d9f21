"""``segment-diagnose``: attention diagnostics as a report (Hydra entry point; the work is
in :func:`segment.run.diagnose.command.run_diagnose`).

:func:`segment.run.front.command.run_command` checks the command line and the output
folder before Hydra starts, and maps the outcome to the exit code (0 done, 1 no image could be read, 2
unusable input or settings, 130 interrupted).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from segment.run.front.command import job, run_command
from segment.run.front.compose import CONFIG_NAMES, CONFIG_PATH
from segment.run.front.help import register_help_resolver

register_help_resolver()  # ${segment_help:segment-diagnose} in hydra.help.template


def run(cfg: DictConfig) -> int:
    """Diagnose the attention of ``cfg.model`` on ``cfg.input``; returns the exit code."""
    from segment.run.diagnose.command import run_diagnose

    return run_diagnose(cfg)


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAMES["segment-diagnose"])
def _main(cfg: DictConfig) -> int:
    code = job("segment-diagnose", lambda: run(cfg))
    if code:  # hydra.main drops the task's return value; exit here so the shell sees it
        raise SystemExit(code)
    return code


def main() -> None:
    raise SystemExit(run_command("segment-diagnose", _main))


if __name__ == "__main__":
    main()
