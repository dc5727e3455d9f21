"""One method of two `segment-eval` runs, compared image by image with paired intervals.

    python -m segment.eval.paired RUN_A RUN_B [--method NAME] [--method-b NAME] [--out DIR] [--any-code]

`segment-eval` pairs the methods of one run (one backbone pass, one input size). Two runs
differ in what a run fixes: the input size (`model.image_size`), the backbone or its
checkpoint. This reads each run's `config.yaml` and per-image metric cache, takes the
states of one method per run (``--method``, the same name in both unless ``--method-b``
names B's; by default each run's first row) for the images both runs scored, and resamples
those images together (``--reps`` draws, ``--seed``; the bootstrap of `segment-eval`), so
the difference B - A gets a paired 95% interval. Both runs must score the same data set
(the same task and image names) and their caches must hold the method's states under the
code that runs this (the cache is keyed by the code's source: rerun `segment-eval` with
the same ``output=`` to rescore after a change; ``--any-code`` pairs what each run recorded
under the code that made it: the before and after of a change). The data set's files must be where the
run read them (its images are listed again, not read).

Prints a Markdown table (rows A and B, B's paired difference to A); ``--out DIR`` writes
``results.{json,csv,md}`` there as `segment-eval` writes its own. Exit 2 with one line when
a run cannot be read or the runs do not pair.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omegaconf import OmegaConf
from segment.datasets.base import SegmentationDataset
from segment.eval.metrics import State

from segment.utils import EXIT_BAD_INPUT


class PairError(ValueError):
    """A run that cannot be read, or two runs that do not pair."""


def _without_source(key: str) -> tuple[str, str]:
    """A method's cache key without its source hash: ``(config hash, '#' suffix)``
    (``CONFIG-SOURCE`` or ``CONFIG-SOURCE#part``)."""
    config, _, rest = key.partition("-")
    return config, rest.partition("#")[2]


def _state_of(recorded: dict[str, State], key: str, any_code: bool) -> State | None:
    """The state of ``key``, or with ``any_code`` the one state recorded for the same
    config under another source (``None`` when there is none or more than one)."""
    state = recorded.get(key)
    if state is None and any_code:
        same = [v for k, v in recorded.items() if _without_source(k) == _without_source(key)]
        state = same[0] if len(same) == 1 else None
    return state


def run_states(run: Path, method: str | None = None, any_code: bool = False
               ) -> tuple[str, dict[str, State], SegmentationDataset]:
    """One method's per-image states of a finished `segment-eval` run.

    ``any_code``: take the states the run recorded under whatever code made it (the
    method's config the same, its source another: the before and after of a change),
    where there is one such record per image and one metric cache in the run.

    Returns:
        ``(label, {image name: state} in the data set's order, the data set)``.
    """
    from segment.eval.cache import MetricCache, cache_dir
    from segment.eval.settings import instantiate_dataset, item_names
    from segment.eval.specs import instantiate_method, method_key, resolve_methods

    path = run / "config.yaml"
    if not path.is_file():
        raise PairError(f"{run}: no config.yaml (not the output folder of a finished segment-eval run)")
    cfg = OmegaConf.load(path)
    if not cfg.get("cache", True):
        raise PairError(f"{run}: the run was made with cache=false: no per-image states to pair")
    specs = resolve_methods(cfg)
    if method is None:
        spec = specs[0]
    else:
        found = [s for s in specs if s.label == method]
        if not found:
            raise PairError(f"{run}: no method {method!r}; the run has {[s.label for s in specs]}")
        spec = found[0]
    spec.method = instantiate_method(spec)
    key = method_key(spec)
    dataset = instantiate_dataset(cfg)
    names = item_names(cfg, dataset)
    folder = cache_dir(run, cfg, dataset)
    if any_code and not folder.is_dir():
        found_dirs = sorted(p for p in (run / "cache").glob("*") if p.is_dir())
        folder = found_dirs[0] if len(found_dirs) == 1 else folder
    if not folder.is_dir():
        raise PairError(f"{run}: no metric cache {folder.name} for this model and data set under this"
                        f" code; rerun segment-eval with output={run}")
    cache = MetricCache(folder)
    states: dict[str, State] = {}
    for name in names:
        state = _state_of(cache.load_entry(name).states, key, any_code)
        if state is not None:
            states[name] = state
    if len(states) < len(names):
        raise PairError(f"{run}: {len(names) - len(states)} of {len(names)} images have no cached"
                        f" {spec.label} result under this code (the cache is keyed by the code's"
                        f" source); rerun segment-eval with output={run} to score them")
    return spec.label, states, dataset


def compare(run_a: Path, run_b: Path, method_a: str | None = None, method_b: str | None = None,
            reps: int = 1000, seed: int = 0, any_code: bool = False):
    """The two-row table (:class:`segment.eval.tables.Results`): A, then B with its paired
    difference to A (``delta``) and both rows' 95% intervals."""
    from segment.eval.tables import class_names_of, results_table

    label_a, a, data_a = run_states(run_a, method_a, any_code)
    label_b, b, data_b = run_states(run_b, method_b or method_a, any_code)
    if data_a.task != data_b.task:
        raise PairError(f"the runs score different tasks: {run_a} {data_a.task}, {run_b} {data_b.task}")
    if sorted(a) != sorted(b):
        raise PairError(f"the runs scored different images: {len(set(a) - set(b))} only in {run_a},"
                        f" {len(set(b) - set(a))} only in {run_b}")
    if len(a) < 2:
        raise PairError("fewer than 2 images: no interval")
    names = list(a)  # A's data set order: A's own intervals are those of its run
    rows = [(f"A: {label_a} ({run_a.name})", [a[n] for n in names]),
            (f"B: {label_b} ({run_b.name})", [b[n] for n in names])]
    multiclass = data_a.task == "multiclass"
    return results_table(data_a.task, rows, class_names_of(data_a) if multiclass else (),
                         data_a.num_classes, reps=int(reps), seed=int(seed))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m segment.eval.paired",
                                description=__doc__.split("\n")[0])
    p.add_argument("run_a", type=Path, help="a segment-eval output folder (A)")
    p.add_argument("run_b", type=Path, help="another one on the same data set (B)")
    p.add_argument("--method", default=None,
                   help="the method (row name) to compare; default: each run's first row")
    p.add_argument("--method-b", default=None, help="B's method, when it is named otherwise than A's")
    p.add_argument("--reps", type=int, default=1000, help="bootstrap draws (default 1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write results.{json,csv,md} here")
    p.add_argument("--any-code", action="store_true",
                   help="pair what each run recorded under the code that made it (a change's"
                        " before and after: the same method config, another source)")
    args = p.parse_args(argv)
    try:
        results = compare(args.run_a, args.run_b, args.method, args.method_b, args.reps, args.seed,
                          args.any_code)
    except ValueError as e:  # PairError, and a config or data set that cannot be read
        print(f"segment.eval.paired: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        results.write(args.out)
    print(results.markdown(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
