"""``segment-diagnose`` and ``segment.diagnose``: per-head attention diagnostics and their
report."""
