"""``python -m segment.eval.bench regions``: the region stage against the forward of the same batch
(see the package docstring); ``--eigen torch scipy krylov``: the cuts' eigensolvers in the same
rounds (default: the device's dense one and ``krylov``); with several ``--sizes``, the fitted
growth exponent of each time against the tokens.

The "of which pixel refinement" column is the method's time less that of the same method
with ``refine_steps=0`` (:func:`without_refinement`, a copy by ``dataclasses.replace``)."""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields, replace

import torch
from segment.eval.bench.common import best_time, example_image, find_weights, machine

from segment.core.masks import MethodOutput
from segment.core.record import AttentionRecord
from segment.methods import EscapeCuts, Method, RegionGrow

# the pixel chain's knobs besides refine_steps: inactive (and refused off their defaults)
# without it
_PIXEL_CHAIN = ("refine_radius", "refine_dilation", "refine_scale", "sigma_space", "sigma_color")


def without_refinement(method: EscapeCuts | RegionGrow) -> EscapeCuts | RegionGrow:
    """``method`` with ``refine_steps=0`` and the pixel chain's other knobs it has at their
    defaults (they act only with the chain): everything else as it is."""
    defaults = {f.name: f.default for f in fields(method) if f.name in _PIXEL_CHAIN}
    return replace(method, refine_steps=0, **defaults)


def stage(method: Method, eigen: str) -> Callable[[AttentionRecord], MethodOutput]:
    """The method's call, with the cuts' eigensolver ``eigen`` (``"-"``: a method without)."""
    if isinstance(method, EscapeCuts) and eigen != "-":
        return lambda rec: method(rec, eigen=eigen)  # type: ignore[arg-type]
    return method


def bench_regions(argv: Sequence[str]) -> None:
    from hydra import compose, initialize_config_module
    from hydra.utils import instantiate
    from segment.models.vit import TimmViT

    from segment.backends import eigen_backend

    p = argparse.ArgumentParser(prog="python -m segment.eval.bench regions")
    p.add_argument("--sizes", type=int, nargs="+", default=[224, 448])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--weights", default=None)
    p.add_argument("--eigen", nargs="+", choices=["torch", "scipy", "krylov"], default=None,
                   help="the cuts' eigensolvers to time, each in every round (default: the"
                        " device's dense one, segment.backends.eigen_backend, and krylov)")
    p.add_argument("overrides", nargs="*", help="method overrides, e.g. method.refine_steps=0"
                   " (anywhere on the line)")
    # KEY=VALUE words are overrides wherever they stand (after --sizes too)
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    args = p.parse_args([a for a in argv if a not in overrides])
    device = torch.device(args.device)
    weights = find_weights(args.weights)
    with initialize_config_module(version_base="1.3", config_module="segment.configs"):
        cfg = compose("segment", overrides=overrides + list(args.overrides))
    method = instantiate(cfg.method)
    cuts = isinstance(method, EscapeCuts)
    if args.eigen and not cuts:
        raise SystemExit(f"--eigen: method {type(method).__name__} cuts no chain")
    dense = "scipy" if device.type == "cpu" else "torch"
    eigens = (args.eigen or list(dict.fromkeys([dense, eigen_backend(device), "krylov"]))
              ) if cuts else ["-"]
    print(f"# region growing vs backbone forward: method {type(method).__name__}, device "
          f"{device} ({machine(device)}), batch {args.batch}, repeat {args.repeat},"
          f" weights {weights or 'random init'}")
    print("| px | tokens | eigensolver | forward ms/img | extract ms/img | regions ms/img |"
          " regions / forward | of which pixel refinement ms/img |")
    print("|---|---|---|---|---|---|---|---|")
    img = example_image()
    times: dict[str, list[tuple[int, float]]] = {}  # per eigensolver, (tokens, s/img) by size
    for size in args.sizes:
        model = TimmViT(name="dinov2_vits14", arch="vit_small_patch14_dinov2.lvd142m",
                        pretrained=False, checkpoint=str(weights) if weights else None,
                        image_size=size, device=str(device))
        x = model.collate([img] * args.batch).to(device)
        cap = method.capture(model.num_layers)
        refines = isinstance(method, (EscapeCuts, RegionGrow)) and int(method.refine_steps) > 0
        plain = without_refinement(method) if refines else None

        def timed(eigen: str) -> tuple[float, float | None]:
            full = stage(method, eigen)
            bare = stage(plain, eigen) if plain is not None else None
            return (best_time(lambda: full(rec), device),
                    best_time(lambda: bare(rec), device) if bare is not None else None)

        with torch.no_grad():
            rec = model.extract(x, cap)
            for eigen in eigens:  # warm-up
                timed(eigen)
            # interleaved rounds (forward, extract, then regions with and without refinement
            # per eigensolver): a machine that slows down or speeds up mid-run moves them
            # all alike, and the ratios are medians of the rounds' ratios. The stage right
            # after the backbone runs slower (as in a real run), so the eigensolvers take
            # turns at going first
            rounds = []
            for r in range(args.repeat):
                t_f = best_time(lambda: model.forward_plain(x), device)
                t_e = best_time(lambda: model.extract(x, cap), device)
                turn = list(range(len(eigens)))
                turn = turn[r % len(turn):] + turn[: r % len(turn)]
                got = dict((e, timed(eigens[e])) for e in turn)
                rounds.append((t_f, t_e, [got[e] for e in range(len(eigens))]))
        t_fwd, t_ext = (statistics.median(r[j] for r in rounds) for j in range(2))
        times.setdefault("forward", []).append((rec.layout.num_tokens, t_fwd / args.batch))
        b = args.batch
        for e, eigen in enumerate(eigens):
            t_reg = statistics.median(r[2][e][0] for r in rounds)
            ratio = statistics.median(r[2][e][0] / r[0] for r in rounds)
            t_noref = statistics.median(r[2][e][1] for r in rounds) if refines else t_reg
            times.setdefault(eigen, []).append((rec.layout.num_tokens, t_reg / b))
            print(f"| {size} | {rec.layout.num_tokens} | {eigen} | {1e3 * t_fwd / b:.1f} | "
                  f"{1e3 * t_ext / b:.1f} | {1e3 * t_reg / b:.1f} | {ratio:.2f} | "
                  f"{1e3 * (t_reg - t_noref) / b:.1f} |", flush=True)
        if len(eigens) > 1:
            for e, eigen in enumerate(eigens[1:], 1):
                rel = statistics.median(r[2][e][0] / r[2][0][0] for r in rounds)
                print(f"#   {size} px: region stage with {eigen} / with {eigens[0]}: {rel:.2f}"
                      f" (median of the rounds' ratios)", flush=True)

    if len(args.sizes) > 1:
        print("# growth exponent of the time per image against the tokens (t ~ tokens^k):"
              " least-squares fit over all sizes; between each pair of consecutive sizes")
        for what, pts in times.items():
            steps = ", ".join(f"{a[0]}->{b[0]}: {growth([a, b]):.2f}" for a, b in zip(pts, pts[1:]))
            print(f"#   {'region stage, ' + what if what != 'forward' else 'forward'}:"
                  f" {growth(pts):.2f} ({steps})", flush=True)


def growth(points: Sequence[tuple[int, float]]) -> float:
    """The slope of ``log t`` against ``log tokens`` (least squares) over ``(tokens, t)``."""
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(t) for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return (sum((x - mx) * (y - my) for x, y in zip(xs, ys))
            / sum((x - mx) ** 2 for x in xs))


if __name__ == "__main__":
    bench_regions(sys.argv[1:])
