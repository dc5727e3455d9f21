"""``segment-eval``: score methods on a benchmark (Hydra entry point; work in ``run``)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

CONFIG_PATH = "pkg://segment.configs"


def run(cfg: DictConfig) -> int:
    """Evaluate ``cfg.methods`` on ``cfg.dataset``; returns the exit code."""
    from segment.eval.runner import run_eval

    return run_eval(cfg)


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="eval")
def _main(cfg: DictConfig) -> int:
    return run(cfg)


def main() -> None:
    raise SystemExit(_main())


if __name__ == "__main__":
    main()
