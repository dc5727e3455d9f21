"""Writing the evaluator's matplotlib figures (``curves.png`` of token masking and of the
hierarchies): one function, atomic like every file the project writes."""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

from segment.utils import atomic_path

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def write_figure(path: str | Path, fig: Figure, dpi: int = 100) -> None:
    """``fig`` as a PNG file at ``path``, written atomically; the figure is closed."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    with atomic_path(path) as tmp:
        tmp.write_bytes(buf.getvalue())
