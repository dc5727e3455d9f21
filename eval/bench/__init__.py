"""Benchmarks (scripts that print numbers and ratios against a baseline measured in the
same run; never timed tests).

    python -m segment.eval.bench markov    [--sizes 257 1024 4096] [--device cpu|cuda] [--weights PATH]
    python -m segment.eval.bench markov --accuracy [--images-224 10] [--images-448 2] [--root DIR]
    python -m segment.eval.bench regions   [--sizes 224 448] [--batch 4] [--repeat 5] [--weights PATH] [--eigen torch scipy] [method overrides]
    python -m segment.eval.bench tree      [--size 224] [--images 8] [--min-tokens 4 8 16 32] [--repeat 3] [--weights PATH]
    python -m segment.eval.bench pipeline  ...   (segment.eval.bench.pipeline)
    python -m segment.eval.bench flux      ...   (segment.eval.bench.flux)
    python -m segment.eval.bench eval      ...   (segment.eval.bench.evaluator)
    python -m segment.eval.bench diagnose  [--sizes 224] [--repeat 3] [--weights PATH]
    python -m segment.eval.bench gpu       [--quick] [--json PATH]   (segment.eval.bench.gpu: GPU self-check)
    python -m segment.eval.bench cutcheck  [--data ecssd-dev] [--size 224] ...   (Krylov vs dense cuts, near-ties)
    python -m segment.eval.bench envcheck  record DIR | compare DIR_A DIR_B   (segment.eval.bench.envcheck)

``markov``: TokenRank and ``|lambda_2|`` on real DINOv2 ViT-S/14 attention heads (the
shared weights, or ``--weights``; synthetic attention-like chains otherwise) against dense
``torch.linalg.eigvals``, per head, with the error of the fast path against dense float64.
``markov --accuracy``: the largest error of ``lambda2`` (``method="auto"``) against dense
float64 ``eigvals`` over every head of every layer of several ecssd-dev images (10 at
224 px and 2 at 448 px by default: 864 heads), with the range of ``|lambda_2|``.
``regions``: the seed-and-grow stage per image against the backbone forward of the same
batch, in ``--repeat`` interleaved rounds (medians; the ratio is the median of the rounds'
ratios); ``--eigen torch scipy`` times the default's cuts with each eigensolver
(:func:`segment.backends.second_eigenvectors`) in the same rounds.
``tree``: the tree of escape cuts (:func:`segment.core.cuts.cut_tree`) per ``--min-tokens``
floor against today's ``recursive_ncut`` and the forward, on ecssd-dev images: the cut alone
and the whole region stage with the pixel stage run on the leaves (segment.eval.bench.tree).
``envcheck``: the default's label maps on every dev set recorded in one environment
(threads, ATen's CPU kernels, dependency versions, torchrun) and compared with another's,
each difference classified by cutcheck's near-tie rule (segment.eval.bench.envcheck).
``diagnose``: ``segment-diagnose``'s work per image (attention capture of every layer and
head, then every measure of :mod:`segment.core.diagnostics`) against the bare forward of
the same image, with the dense spectra, the exact TokenRank and the stable rank timed alone.
"""

