"""Output paths are checked before the work that fills them, so a typo never throws away a run."""

from __future__ import annotations

import os
from pathlib import Path


def unwritable(path: str | Path | None) -> str | None:
    """Why `path` cannot be written, or None (also None for no path)."""
    if not path:
        return None
    p = Path(path).resolve()
    if p.is_dir():
        return "is a directory"
    if not p.parent.is_dir():
        return f"folder {p.parent} does not exist"
    if not os.access(p.parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        return "not writable"
    return None
