"""A dependency-free progress bar for the operator commands (stderr, never stdout).

On a terminal it redraws one line (``\\r``); elsewhere (logs, pipes, CI) it prints a plain line,
never a ``\\r``, at most every ``interval_s`` seconds and once more at ``close``, so logs stay
readable. Rates are averages since the start. ``enabled=False`` makes every call a no-op.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and the noun in its number: ``counted(1, "namespace") -> '1 namespace'``,
    ``counted(3, "namespace") -> '3 namespaces'`` (``plural`` where adding "s" is wrong)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


class ProgressBar:
    """``update(done, **rates)`` with ``done`` out of ``total`` units named ``unit``.

    ``total=None`` (not known yet, e.g. while a listing streams): a running count and its rate
    instead of a bar.
    """

    def __init__(self, total: int | None, unit: str, *, label: str = "", enabled: bool = True,
                 stream: TextIO | None = None, interval_s: float = 2.0, width: int = 24) -> None:
        self.total = None if total is None else max(total, 0)
        self.unit = unit
        self.label = label
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = interval_s
        self.width = width
        self.started = time.monotonic()
        self._last = 0.0
        self._drawn = False
        #: the last update not printed (skipped by the interval): ``close`` prints it.
        self._pending: tuple[int, int | None, int | None] | None = None

    def update(self, done: int, *, tokens: int | None = None, nbytes: int | None = None,
               final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not final and not self.tty and now - self._last < self.interval_s:
            self._pending = (done, tokens, nbytes)
            return
        self._pending = None
        self._last = now
        elapsed = max(now - self.started, 1e-9)
        parts = [f"{self.label} " if self.label else ""]
        if self.total is None:
            parts.append(f"{done:,} {self.unit}  {done / elapsed:,.0f} {self.unit}/s")
        else:
            frac = min(done / self.total, 1.0) if self.total else 1.0
            filled = int(frac * self.width)
            parts += [f"[{'#' * filled}{'.' * (self.width - filled)}] {frac:4.0%} ",
                      f"{done}/{self.total} {self.unit}"]
        if tokens is not None:
            parts.append(f"  {tokens / elapsed:,.0f} tok/s")
        if nbytes is not None:
            parts.append(f"  {human_bytes(nbytes / elapsed)}/s")
        parts.append(f"  {elapsed:.1f}s")
        line = "".join(parts)
        if self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self._drawn = not final

    def close(self) -> None:
        """End the line on a terminal; elsewhere print the last update the interval held back."""
        if self._pending is not None:
            done, tokens, nbytes = self._pending
            self.update(done, tokens=tokens, nbytes=nbytes, final=True)
        if self.enabled and self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
