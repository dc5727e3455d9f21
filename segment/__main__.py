"""``python -m segment`` / ``torchrun -m segment``: same as the ``segment`` command."""

from segment.run.job.cli import main

main()
