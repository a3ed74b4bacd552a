"""Output paths checked before the work that writes them: a bad path found after minutes of
training or planning would throw the result away."""

from __future__ import annotations

import os
from pathlib import Path


def png_path(requested: str, flag: str = "--plot") -> Path:
    """``requested`` as the PNG that will be written ('.png' added to a name without a suffix);
    ``ValueError`` naming ``flag`` where it cannot be written."""
    path = Path(requested).expanduser()
    if not path.suffix:
        path = path.with_suffix(".png")
    if path.suffix.lower() != ".png":
        raise ValueError(f"{flag} must name a .png file, got {requested!r}")
    path = path.resolve()
    if not path.parent.is_dir():
        raise ValueError(f"{flag}: directory {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag}: {path} is not writable")
    return path


__all__ = ["png_path"]
