"""``segment``: segment a folder of images (Hydra entry point; the work is in ``run``).

:func:`segment.run.front.compose.run_command` checks the command line and the output folder before
Hydra starts, and maps the outcome to the exit code (0 done, 1 nothing processed, 2
unusable input or settings, 130 interrupted).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from segment.run.front import compose as front

front.register_help_resolver()  # ${segment_help:segment} in hydra.help.template


def run(cfg: DictConfig) -> int:
    """Segment every image under ``cfg.input`` into ``cfg.output``; returns the exit code."""
    from segment.run.job.pipeline import run_segment

    return run_segment(cfg)


@hydra.main(version_base="1.3", config_path=front.CONFIG_PATH, config_name=front.CONFIG_NAMES["segment"])
def _main(cfg: DictConfig) -> int:
    code = front.job("segment", lambda: run(cfg))
    if code:  # hydra.main drops the task's return value; exit here so the shell sees it
        raise SystemExit(code)
    return code


def main() -> None:
    raise SystemExit(front.run_command("segment", _main))


if __name__ == "__main__":
    main()
