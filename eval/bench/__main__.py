"""``python -m segment.eval.bench NAME [options]``: run one benchmark (the list: the package docstring)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        import segment.eval.bench as package

        print(package.__doc__)
        return
    what, rest = argv[0], argv[1:]
    if what == "markov":
        from segment.eval.bench.markov import bench_markov

        bench_markov(rest)
    elif what == "regions":
        from segment.eval.bench.regions import bench_regions

        bench_regions(rest)
    elif what == "tree":
        from segment.eval.bench.tree import main as run

        run(rest)
    elif what == "nesting":
        from segment.eval.bench.nesting import main as run

        run(rest)
    elif what == "pipeline":
        from segment.eval.bench.pipeline import main as run

        run(rest)
    elif what == "flux":
        from segment.eval.bench.flux import main as run

        run(rest)
    elif what == "eval":
        from segment.eval.bench.evaluator import main as run

        run(rest)
    elif what == "diagnose":
        from segment.eval.bench.diagnose import main as run

        run(rest)
    elif what == "cutcheck":
        from segment.eval.bench.cutcheck import main as run

        raise SystemExit(run(rest))  # 1 when a difference is not a near-tie
    elif what == "envcheck":
        from segment.eval.bench.envcheck import main as run

        raise SystemExit(run(rest))  # 1 when a difference is neither a near-tie nor explained
    elif what == "cutmem":
        from segment.eval.bench.cutmem import main as run

        raise SystemExit(run(rest))
    elif what == "gpu":
        from segment.eval.bench.gpu import main as run

        raise SystemExit(run(rest))  # 1 when a check failed
    else:
        raise SystemExit(f"unknown benchmark {what!r}: choose markov, regions, tree, cutcheck, cutmem, pipeline, flux, eval, diagnose or gpu")


if __name__ == "__main__":
    main()
