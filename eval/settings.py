"""The settings, the model and the data set of ``segment-eval`` from its config, shared by
the evaluator (:mod:`segment.eval.runner`), token masking (:mod:`segment.eval.masking`) and
:mod:`segment.eval.paired`; each refuses a bad setting in one line (exit 2)."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig

from segment.datasets.base import SegmentationDataset
from segment.eval.specs import ConfigError
from segment.models.base import Backbone
from segment.run.front.build import build


def bootstrap_reps(cfg: DictConfig) -> int:
    """``bootstrap``: the number of bootstrap resamples (0: no intervals)."""
    reps = cfg.get("bootstrap", 0)
    if not isinstance(reps, int) or isinstance(reps, bool) or reps < 0:
        raise ConfigError(f"bootstrap must be a whole number of resamples >= 0 (0 = off), got {reps!r}")
    return int(reps)


def output_dir(cfg: DictConfig) -> Path:
    """``output``, else Hydra's run folder (``segment-eval`` only)."""
    if cfg.get("output"):
        return Path(str(cfg.output))
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:
        raise ConfigError("no output folder: pass output=DIR (Hydra's run dir exists only under segment-eval)") from None


def instantiate_model(cfg: DictConfig, device: torch.device) -> Backbone:
    """The backbone of ``cfg.model`` on ``device``; one-line :class:`BuildError` (exit 2)
    when it cannot be built (no weights offline, a checkpoint that does not fit...)."""
    kwargs = {"device": str(device)} if "device" in cfg.model else {}
    if cfg.get("seed") is not None:  # same random-init weights on every rank and rerun
        torch.manual_seed(int(cfg.seed))
    return build(cfg.model, Backbone, "the model", **kwargs)


def instantiate_dataset(cfg: DictConfig) -> SegmentationDataset:
    """The data set of ``cfg.dataset``; one line (exit 2) for required settings left unset
    (:class:`ConfigError`) or a data set that cannot be built (:class:`BuildError`)."""
    from segment.run.front.compose import unset_dataset_settings

    missing = unset_dataset_settings(cfg.dataset)
    if missing:
        raise ConfigError(missing)
    return build(cfg.dataset, SegmentationDataset, "the dataset")


def item_names(cfg: DictConfig, dataset: SegmentationDataset) -> list[str]:
    """The names of the items to score: the first ``limit`` of the data set (all without)."""
    n = len(dataset)
    limit = cfg.get("limit")
    if limit is not None:
        if int(limit) < 1:
            raise ConfigError(f"limit must be a positive number of images, got {limit}")
        n = min(n, int(limit))
    names = [dataset.name(i) for i in range(n)]
    if len(set(names)) != len(names):
        raise ConfigError(f"{type(dataset).__name__}: item names are not unique")
    return names
