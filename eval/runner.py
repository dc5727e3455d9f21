"""``segment-eval``: score any number of methods on a benchmark from one backbone pass.

Flow (:func:`run_eval`)::

    dataset, backbone, methods (configs)
      -> this rank's shard of the first `limit` images, minus those in the metric cache
      -> batches: backbone.extract(pixels, union of the methods' captures, prompts=classes)
           -> every method on the same record -> protocol post-processing -> per-image
              metric states -> cache (one JSON per image, atomic) + a few PNG panels
      -> gather the per-image states on rank 0, sum them in data set order
      -> Markdown table on stdout, results.json / results.csv / results.md in `output`

This module is the loop; each concern has its own module:

- :mod:`segment.eval.settings`: the settings, the model and the data set from the config;
- :mod:`segment.eval.specs`: the methods from the config (``method``, ``methods``), their
  cache keys, :class:`~segment.eval.specs.ConfigError`;
- :mod:`segment.eval.cache`: the per-image metric cache and its fingerprint;
- :mod:`segment.eval.scoring`: a method's output -> per-image metric states (binary sets:
  the protocol's scores at ``mask_at`` and the peer metrics at the ground truth's original
  resolution; multi-class sets: Hungarian matching; BSDS500: Covering, PRI, VI), with the
  metrics themselves in :mod:`segment.eval.metrics`;
- :mod:`segment.eval.panels`: the PNG panels;
- :mod:`segment.eval.tables`: the results table (JSON, CSV, Markdown) and its intervals.

A rerun with the same ``output`` skips images already scored and adding a method scores
only that method (:mod:`segment.eval.cache`); the log says how many per-image results were
reused.

Prompts: a text-conditioned backbone (``Backbone.text_conditioned``, e.g. FLUX) is prompted
with each image's class name; an image without one (an unknown synset) falls back to
``model.default_class`` alone, and results.json counts those images (``prompt_fallbacks``).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from segment.datasets.base import DataError, Sample, SegmentationDataset
from segment.run import dist
from segment.run.front.build import BuildError
from segment.eval.cache import MetricCache, cache_dir
from segment.eval.metrics import State, state_from_dict
from segment.eval.panels import PanelRows, panel_tiles, write_sample_panel
from segment.eval.scoring import (
    batch_originals,
    batch_targets,
    score_binary_many,
    score_multiclass,
    score_regions,
)
from segment.eval.specs import (
    ConfigError,
    MethodSpec,
    instantiate_method,
    method_key,
    resolve_methods,
    union_capture,
)
from segment.eval.settings import (
    bootstrap_reps,
    instantiate_dataset,
    instantiate_model,
    item_names,
    output_dir,
)
from segment.eval.tables import Results, class_names_of, results_table
from segment.eval.batches import batch_prompts, input_size_groups  # noqa: F401  (re-exported)
from segment.eval.hierarchy import ImageScores
from segment.eval.trees import default_threshold, scores_tree, tree_key, tree_states, tree_table

from segment.core.record import AttentionRecord
from segment.models.base import Backbone
from segment.utils import (  # noqa: F401  (exit codes re-exported for callers)
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    atomic_write_text,
)

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------


def run_eval(cfg: DictConfig) -> int:
    """Evaluate the configured methods; returns the exit code (0 ok, 2 bad input/config,
    130 interrupted: rerun with the same ``output`` to resume)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        ctx = dist.init(cfg.get("device", "auto"))
    except ValueError as e:  # e.g. device=cuda without CUDA, a bad torchrun environment
        print(f"segment-eval: bad settings: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return _run(cfg, ctx)
    except (ConfigError, BuildError) as e:
        print(f"segment-eval: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except DataError as e:  # a data set file that cannot be read as expected (named in e)
        print(f"segment-eval: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("segment-eval: interrupted; rerun with the same output= to resume from the metric cache",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        dist.close(ctx)


@dataclass
class _Timing:
    """Where the scoring time of this rank went (seconds) and how many images each method
    scored now (not from the cache)."""

    method_s: dict[str, float] = field(default_factory=dict)
    images: dict[str, int] = field(default_factory=dict)
    build_s: float = 0.0  # building the backbone (not counted in images_per_s)


TIMING_KEYS = ("images_per_s", "method_ms_per_image")
"""Keys of a results row that are measurements of this run, not scores: ``images_per_s``,
the images scored per second by the whole run (reading, one backbone pass, every method,
scoring; rank 0); ``method_ms_per_image``, this method's own time per image. ``null``
when the row came from the metric cache only."""


@dataclass(frozen=True)
class ScoreJob:
    """What scoring this rank's images and writing the table need, named: one per run.

    Frozen: the fields stay the same objects for the whole run; ``states``, ``fallbacks``
    and ``timing`` are filled in as images are scored.

    Attributes:
        cfg: the ``segment-eval`` config (``batch_size``, ``num_workers``, ``panels``, ...).
        ctx: this process's place in the torchrun group.
        dataset: the data set; its ``task`` decides how images are scored.
        specs: the methods, instantiated, with their cache keys.
        cache: the per-image metric cache.
        out_dir: the output folder (panels go to ``out_dir/panels``).
        mask_at: ``"image"`` or ``"grid"``: where binary masks are thresholded.
        states: data set index -> method key -> metric state, this rank's images.
        fallbacks: data set index -> whether a text-conditioned backbone was prompted with
            the default class (``None``: no prompt was used).
        timing: where this rank's time went.
    """

    cfg: DictConfig
    ctx: dist.DistContext
    dataset: SegmentationDataset
    specs: Sequence[MethodSpec]
    cache: MetricCache
    out_dir: Path
    mask_at: str
    states: dict[int, dict[str, State]]
    fallbacks: dict[int, bool | None]
    timing: _Timing = field(default_factory=_Timing)


# what the ranks gather: per rank, data set index -> method key -> state (as a dict), and the
# prompt fallbacks
Gathered = list[tuple[dict[int, dict[str, dict]], dict[int, bool | None]]]


def _run(cfg: DictConfig, ctx: dist.DistContext) -> int:
    out_dir = Path(dist.broadcast(str(output_dir(cfg)), ctx))
    mask_at = str(cfg.get("mask_at", "image"))
    if mask_at not in ("image", "grid"):
        raise ConfigError(f"mask_at must be 'image' or 'grid', got {mask_at!r}")
    reps = bootstrap_reps(cfg)
    for knob, low in (("batch_size", 1), ("num_workers", 0)):
        v = cfg.get(knob)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
            raise ConfigError(f"{knob} must be an integer >= {low}, got {v!r}")

    dataset = instantiate_dataset(cfg)
    if mask_at != "image" and dataset.task != "binary":
        raise ConfigError(
            f"mask_at={mask_at} has no effect on {type(dataset).__name__} ({dataset.task}):"
            " it says how binary masks are made from heatmaps; region labels are scored as"
            " they are"
        )
    specs = resolve_methods(cfg)
    for s in specs:
        s.method = instantiate_method(s)
        s.key = method_key(s)
    _check_eigen(cfg, specs)
    names = item_names(cfg, dataset)
    indices = list(range(len(names)))

    cache = MetricCache(cache_dir(out_dir, cfg, dataset), enabled=bool(cfg.get("cache", True)))
    mine = dist.shard(indices, ctx)
    job = ScoreJob(cfg=cfg, ctx=ctx, dataset=dataset, specs=specs, cache=cache, out_dir=out_dir,
                   mask_at=mask_at, states={}, fallbacks={})
    todo = _read_cache(job, names, mine)

    t0 = time.perf_counter()
    if todo or ctx.distributed:  # under torchrun every rank checks, so all refuse alike
        backbone = _build_backbone(job)
    if todo:
        _score(job, backbone, todo)
    elapsed = time.perf_counter() - t0 - job.timing.build_s

    # one collective: every rank's per-image states and prompt fallbacks together
    mine_out = ({i: {k: v.to_dict() for k, v in st.items()} for i, st in job.states.items()}, job.fallbacks)
    gathered = dist.gather(mine_out, ctx)
    if not ctx.is_main:
        return EXIT_OK
    results, trees = _table(job, gathered or [], indices, len(todo), elapsed, reps)
    results.write(out_dir)
    atomic_write_text(out_dir / "config.yaml", OmegaConf.to_yaml(cfg))
    print(results.markdown() + trees, end="")
    if todo:
        log.info("scored %d images in %.1f s (%.2f images/s on rank 0)", len(todo), elapsed, len(todo) / max(elapsed, 1e-9))
    log.info("results in %s", out_dir)
    return EXIT_OK


def _check_eigen(cfg: DictConfig, specs: Sequence[MethodSpec]) -> None:
    """``eigen=``: one of the eigensolvers, and only where some method cuts (else it would
    change nothing)."""
    from segment.backends import EIGEN_BACKENDS

    eigen = cfg.get("eigen")
    if eigen is None:
        return
    if eigen not in EIGEN_BACKENDS:
        raise ConfigError(f"eigen must be one of {', '.join(EIGEN_BACKENDS)} (or null: the"
                          f" device's), got {eigen!r}")
    if not any(s.method.takes_eigen for s in specs if s.method is not None):
        raise ConfigError(f"eigen={eigen} has no effect: no method of this run cuts a chain"
                          f" ({', '.join(s.label for s in specs)}); eigen sets the eigensolver"
                          " of method=cuts")


def _read_cache(job: ScoreJob, names: Sequence[str], mine: Sequence[int]) -> list[int]:
    """Fill ``job.states`` and ``job.fallbacks`` of this rank's images ``mine`` from the
    metric cache (logging what was reused); returns the images some method still lacks."""
    cache, ctx = job.cache, job.ctx
    keys = [k for s in job.specs for k in _keys(job, s)]
    todo = []
    reused = 0
    for i in mine:
        entry = cache.load_entry(names[i])
        job.states[i] = entry.states
        job.fallbacks[i] = entry.prompt_fallback
        reused += sum(k in entry.states for k in keys)
        if any(k not in entry.states for k in keys):
            todo.append(i)
    log.info(
        "rank %d/%d: %d images, %d with every row in the metric cache, %d to score with %d method%s",
        ctx.rank, ctx.world_size, len(mine), len(mine) - len(todo), len(todo), len(job.specs),
        "" if len(job.specs) == 1 else "s",
    )
    if cache.enabled:
        others = [p for p in cache.root.parent.iterdir() if p.is_dir() and p != cache.root]
        log.info(
            "metric cache %s: reused %d of %d (image, method) results%s", cache.root, reused,
            len(mine) * len(keys),
            f"; {len(others)} other cache folder(s) (another model, data set, post-processing,"
            " package version or code) not used" if others else "",
        )
    return todo


def _keys(job: ScoreJob, spec: MethodSpec) -> list[str]:
    """The cache keys of a method's per-image results: its state, and its hierarchy's scores
    where it gives one (:mod:`segment.eval.trees`)."""
    return [spec.key, *([tree_key(spec.key)] if scores_tree(spec.method, job.dataset.task) else [])]


def _table(job: ScoreJob, gathered: Gathered, indices: Sequence[int], scored_now: int,
           elapsed: float, reps: int) -> tuple[Results, str]:
    """The results table from every rank's per-image states (``gathered``), summed in data
    set order; ``scored_now`` images took ``elapsed`` seconds on this rank. With the
    hierarchical methods' table (written to ``out_dir/hierarchy``) as Markdown."""
    per_image: dict[int, dict[str, dict]] = {}
    prompted: dict[int, bool | None] = {}
    for part_states, part_prompted in gathered:
        per_image.update(part_states)
        prompted.update(part_prompted)
    dataset, specs, timing = job.dataset, job.specs, job.timing
    names = class_names_of(dataset) if dataset.task == "multiclass" else ()
    rows = [(s.label, [state_from_dict(per_image[i][s.key]) for i in indices]) for s in specs]
    results = results_table(dataset.task, rows, names, dataset.num_classes,
                            reps=reps, seed=int(job.cfg.get("seed") or 0))
    for s, row in zip(specs, results.rows):  # the same images for every row: paired deltas
        scored = timing.images.get(s.key, 0)
        row["images_per_s"] = round(scored_now / elapsed, 4) if scored_now and scored else None
        row["method_ms_per_image"] = round(1e3 * timing.method_s[s.key] / scored, 3) if scored else None
    if any(prompted.get(i) is not None for i in indices):  # a text-conditioned backbone
        count = sum(bool(prompted.get(i)) for i in indices)
        for row in results.rows:
            row["prompt_fallbacks"] = count
        if count:
            log.warning("%d of %d images had no class name and were prompted with the default"
                        " class", count, len(indices))
    tree_specs = [s for s in specs if scores_tree(s.method, dataset.task)]
    if not tree_specs:
        return results, ""
    per = {s.label: [ImageScores.from_dict(per_image[i][tree_key(s.key)]) for i in indices] for s in tree_specs}
    defaults = {s.label: default_threshold(s.method) for s in tree_specs}  # each method its own
    tree = tree_table(per, defaults, reps, int(job.cfg.get("seed") or 0),
                      job.out_dir, f"{type(dataset).__name__}, {len(indices)} images")
    return results, "\nEvery level (hierarchy/):\n\n" + tree.markdown()


def _build_backbone(job: ScoreJob) -> Backbone:
    """The model, with every method checked against it (:func:`segment.run.api.segmenter.check_method`:
    layers it lacks, knobs that need pixels it does not provide): before the first batch,
    one line, exit 2."""
    from segment.run.api.segmenter import check_method

    t_build = time.perf_counter()
    backbone = instantiate_model(job.cfg, job.ctx.device)
    for s in job.specs:
        try:
            check_method(s.method, backbone)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"method {s.label!r} cannot run on this model: {e}") from e
    job.timing.build_s = time.perf_counter() - t_build
    return backbone


def _score(job: ScoreJob, backbone: Backbone, todo: list[int]) -> None:
    """Score this rank's images ``todo`` (data set indices) in batches."""
    from torch.utils.data import DataLoader, Subset
    from tqdm import tqdm

    cfg = job.cfg
    loader = DataLoader(
        Subset(job.dataset, todo),
        batch_size=int(cfg.get("batch_size", 8)),
        shuffle=False,
        num_workers=int(cfg.get("num_workers", 0) or 0),
        collate_fn=list,
    )
    bar = tqdm(total=len(todo), desc="segment-eval", unit="img",
               disable=not job.ctx.is_main or not cfg.get("progress", True), dynamic_ncols=True)
    pos = 0
    for batch in loader:
        idx = todo[pos : pos + len(batch)]
        pos += len(batch)
        # one backbone pass per input size (model.match_orientation: portrait and landscape)
        for part in input_size_groups(backbone, [s.image for s in batch]):
            _score_batch(job, backbone, [batch[j] for j in part], [idx[j] for j in part])
        bar.update(len(batch))
    bar.close()


def _score_batch(job: ScoreJob, backbone: Backbone, batch: list[Sample], idx: list[int]) -> None:
    """Score the images ``batch`` (data set indices ``idx``, one input size) with every
    method that lacks them: one backbone pass, then the metric states, cache files and panels."""
    dataset, states, timing = job.dataset, job.states, job.timing
    prompted = backbone.text_conditioned  # FLUX: a class word per image, else the default
    default_class = backbone.default_class
    panels = int(job.cfg.get("panels", 4) or 0)
    need = [s for s in job.specs if any(k not in states[i] for i in idx for k in _keys(job, s))]
    capture = union_capture([s.method for s in need], backbone.num_layers)
    pixels = backbone.collate([s.image for s in batch])
    classes = [s.class_name for s in batch]
    if prompted:
        prompts = batch_prompts(classes, default_class, [s.name for s in batch])
        for j, i in enumerate(idx):
            job.fallbacks[i] = classes[j] is None
        if any(c is None for c in classes):
            log.warning("no class name for %s: prompted with the default class %r",
                        ", ".join(s.name for s, c in zip(batch, classes) if c is None),
                        default_class)
    else:  # prompts are ignored; passed when every image has one
        prompts = classes if all(c is not None for c in classes) else None
    with torch.inference_mode():
        record: AttentionRecord = backbone.extract(pixels, capture, prompts=prompts)
        targets = batch_targets(batch)
        panel_rows: PanelRows = {j: [] for j, i in enumerate(idx) if i < panels}
        outs = []
        for s in need:
            t_s = time.perf_counter()
            eigen = job.cfg.get("eigen")
            outs.append(s.method(record, eigen=eigen)  # type: ignore[call-arg]
                        if eigen is not None and s.method.takes_eigen else s.method(record))
            timing.method_s[s.key] = timing.method_s.get(s.key, 0.0) + time.perf_counter() - t_s
        if dataset.task == "binary":  # all methods' maps of the batch scored together
            new_all = score_binary_many(outs, targets, job.mask_at, batch_originals(batch))
        elif dataset.task == "regions":
            new_all = [score_regions(o, targets, s.label) for s, o in zip(need, outs)]
        else:
            new_all = [score_multiclass(o, targets, dataset.num_classes, s.label) for s, o in zip(need, outs)]
        for s, out, new in zip(need, outs, new_all):
            tree = scores_tree(s.method, dataset.task)
            trees = tree_states(out, targets, dataset.task, dataset.num_classes) if tree else []
            for j, i in enumerate(idx):
                states[i][s.key] = new[j]
                if trees:
                    states[i][tree_key(s.key)] = trees[j]
            timing.images[s.key] = timing.images.get(s.key, 0) + len(idx)
            if panel_rows:
                panel_tiles(panel_rows, out, targets, job.mask_at, s.label, dataset.task,
                            dataset.num_classes)
    for j, i in enumerate(idx):
        job.cache.save(batch[j].name, states[i], job.fallbacks.get(i))
    for j, rows in panel_rows.items():
        write_sample_panel(job.out_dir, batch[j], rows, dataset.task,
                           class_names_of(dataset) if dataset.task == "multiclass" else ())
