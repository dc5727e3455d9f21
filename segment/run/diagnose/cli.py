"""``segment-diagnose``: attention diagnostics as a report (Hydra entry point; the work is
in :func:`segment.run.diagnose.measure.run_diagnose`).

:func:`segment.run.front.compose.run_command` checks the command line and the output folder before
Hydra starts, and maps the outcome to the exit code (0 done, 1 no image could be read, 2
unusable input or settings, 130 interrupted).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from segment.run.front import compose as front

front.register_help_resolver()  # ${segment_help:segment-diagnose} in hydra.help.template


def run(cfg: DictConfig) -> int:
    """Diagnose the attention of ``cfg.model`` on ``cfg.input``; returns the exit code."""
    from segment.run.diagnose.measure import run_diagnose

    return run_diagnose(cfg)


@hydra.main(version_base="1.3", config_path=front.CONFIG_PATH, config_name=front.CONFIG_NAMES["segment-diagnose"])
def _main(cfg: DictConfig) -> int:
    code = front.job("segment-diagnose", lambda: run(cfg))
    if code:  # hydra.main drops the task's return value; exit here so the shell sees it
        raise SystemExit(code)
    return code


def main() -> None:
    raise SystemExit(front.run_command("segment-diagnose", _main))


if __name__ == "__main__":
    main()
