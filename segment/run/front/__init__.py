"""The command front end shared by ``segment``, ``segment-eval`` and ``segment-diagnose``:
the one config composition, argument checks, one-line errors, exit codes and ``--help``."""
