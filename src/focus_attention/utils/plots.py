"""How the package writes its plots: PNG files, replaced atomically."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .io import atomic_write

__all__ = ["save_png"]


def save_png(fig: Any, path: str | os.PathLike[str], dpi: int = 110) -> Path:
    """Write the matplotlib figure ``fig`` to ``path`` as a PNG whatever the path's suffix
    (none, or another: the path is used as it is), creating its folders, then close it.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        OSError: the file cannot be written (the path is left as it was).
    """
    import matplotlib.pyplot as plt  # heavy, used only to draw: loaded when a plot is written

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=dpi))
    finally:
        plt.close(fig)
    return path
