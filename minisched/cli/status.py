"""Live progress on stderr for long work: one \\r-rewritten line on a terminal (4 updates/s),
else a plain line every 10 s (logs stay readable)."""

from __future__ import annotations

import sys
import time


class StatusLine:
    def __init__(self, label: str, enabled: bool = True):
        self.label, self.enabled, self.tty = label, enabled, sys.stderr.isatty()
        self.start = self.last = time.monotonic()  # short work stays silent
        self.shown = False

    def __call__(self, p: dict) -> None:
        now = time.monotonic()
        if not self.enabled or now - self.last < (0.25 if self.tty else 10.0):
            return
        self.last = now
        parts = [f"{self.label}: {p.get('elapsed', now - self.start):6.1f}s", f"done {p['done']}/{p['total']}"]
        if "running" in p:
            parts.append(f"running {p['running']:3d}  waiting {p['waiting']:3d}")
        line = "  ".join(parts)
        sys.stderr.write(f"\r{line}   " if self.tty else line + "\n")
        sys.stderr.flush()
        self.shown = True

    def close(self) -> None:
        if self.enabled and self.tty and self.shown:
            sys.stderr.write("\n")
