"""``python -m segment`` / ``torchrun -m segment``: same as the ``segment`` command."""

from segment.cli import main

main()
