"""``segment-eval``: score methods on a benchmark (Hydra entry point; work in ``run``).

:func:`segment.run.front.command.run_command` checks the command line and the output
folder before Hydra starts, and maps the outcome to the exit code (0 done, 2 unusable input or settings,
130 interrupted); a run that cannot start leaves no ``outputs/eval/DATE/TIME`` behind.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from segment.run.front.command import job, run_command
from segment.run.front.compose import CONFIG_NAMES, CONFIG_PATH
from segment.run.front.help import register_help_resolver

register_help_resolver()  # ${segment_help:segment-eval} in hydra.help.template


def run(cfg: DictConfig) -> int:
    """Evaluate ``cfg.methods`` on ``cfg.dataset`` (or, with a ``masking`` node, run the
    token-masking experiment on ``masking.input``); returns the exit code."""
    if cfg.get("masking") is not None:  # experiment=token_masking
        from segment.eval.masking import run_masking

        return run_masking(cfg)
    from segment.eval.runner import run_eval

    return run_eval(cfg)


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAMES["segment-eval"])
def _main(cfg: DictConfig) -> int:
    code = job("segment-eval", lambda: run(cfg))
    if code:  # hydra.main drops the task's return value; exit here so the shell sees it
        raise SystemExit(code)
    return code


def main() -> None:
    raise SystemExit(run_command("segment-eval", _main))


if __name__ == "__main__":
    main()
