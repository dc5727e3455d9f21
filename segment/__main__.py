"""``python -m segment`` / ``torchrun -m segment``: same as the ``segment`` command."""

from segment.run.cli import main

main()
