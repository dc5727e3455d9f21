"""segment: zero-shot segmentation from attention read as a discrete-time Markov chain."""

__version__ = "0.1.0"
