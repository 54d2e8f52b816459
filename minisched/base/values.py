"""Value checks shared by the configs and request validation."""

from __future__ import annotations

import math
import numbers
from typing import Any


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints (pages for tokens, panels for columns)."""
    return -(-a // b)


def is_int(x: Any) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x: Any) -> bool:
    """A finite real number (Python or NumPy), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
