"""The Python API behind ``segment.load``: the :class:`~segment.run.api.segmenter.Segmenter`
and its results."""
