"""``python -m segment.eval`` / ``torchrun -m segment.eval``: same as ``segment-eval``."""

from segment.eval.cli import main

main()
