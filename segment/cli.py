"""``segment``: segment a folder of images (Hydra entry point; the work is in ``run``)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

CONFIG_PATH = "pkg://segment.configs"


def run(cfg: DictConfig) -> int:
    """Segment every image under ``cfg.input`` into ``cfg.output``; returns the exit code."""
    from segment.pipeline import run_segment

    return run_segment(cfg)


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="segment")
def _main(cfg: DictConfig) -> int:
    code = run(cfg)
    if code:  # hydra.main drops the task's return value; exit here so the shell sees it
        raise SystemExit(code)
    return code


def main() -> None:
    raise SystemExit(_main())


if __name__ == "__main__":
    main()
