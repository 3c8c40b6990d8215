"""A small dependency-free progress bar for the ``ckpt`` command, drawn on stderr.

On a terminal the bar redraws one line in place (at most ten times a second);
on a pipe or file it writes plain lines at every tenth of the work, so logs
never fill with carriage returns. A disabled bar writes nothing at all.

>>> import io
>>> out = io.StringIO()
>>> with Progress(200, stream=out, enabled=True, tty=False) as bar:
...     bar.update(100, "a")
...     bar.update(100, "b")
>>> out.getvalue().splitlines()[-1]
'100% 200 B / 200 B (2 values)'
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["Progress", "human_size"]


def human_size(n: float) -> str:
    """``n`` bytes in binary units, at least three significant figures, never an exponent.

    The one home of sizes the CLI prints (inspect, ls, convert, the progress bar).

    >>> human_size(0), human_size(1023), human_size(1536), human_size(3 * 2**30)
    ('0 B', '1023 B', '1.50 KiB', '3.00 GiB')
    >>> human_size(1000 * 1024), human_size(1023.9 * 1024), human_size(1045 * 2**20)
    ('1000 KiB', '1.00 MiB', '1.02 GiB')
    """
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    value = float(n)
    for unit in units:
        if unit == "B" and abs(value) < 1024:
            return f"{int(value)} B"
        if abs(value) < 1023.5 or unit == units[-1]:  # 1023.6 KiB prints as 1.00 MiB
            return f"{value:.0f} {unit}" if abs(value) >= 100 else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


class Progress(contextlib.AbstractContextManager["Progress"]):
    """Counts bytes done out of ``total`` and draws them when ``enabled``.

    Args:
        total: the bytes the whole job will process.
        stream: where to draw (stderr by default).
        enabled: draw at all; when false every method is a no-op.
        tty: draw in place with carriage returns; defaults to ``stream.isatty()``.
        width: the number of cells of the bar on a terminal.
        delay: draw nothing until this many seconds have passed (a job that ends
            sooner stays silent).
    """

    def __init__(
        self,
        total: int,
        *,
        stream: TextIO | None = None,
        enabled: bool = True,
        tty: bool | None = None,
        width: int = 30,
        delay: float = 0.0,
    ) -> None:
        self.total = max(int(total), 0)
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty()) if callable(isatty) else False
        self.tty = tty
        self.width = width
        self.done = 0
        self.count = 0
        self._last_draw = 0.0
        self._last_tenth = -1
        self._line_len = 0
        self._start = time.monotonic()
        self._delay = delay

    def _fraction(self) -> float:
        return 1.0 if self.total == 0 else min(self.done / self.total, 1.0)

    def update(self, nbytes: int, label: str = "", *, values: int = 1) -> None:
        """Record ``nbytes`` more bytes done and ``values`` more values (the last ``label``).

        A large value reports its blocks with ``values=0`` and ends with ``update(0, label)``,
        so the bar moves within it.
        """
        self.done += int(nbytes)
        self.count += values
        if not self.enabled:
            return
        if self._delay and time.monotonic() - self._start < self._delay:
            return
        frac = self._fraction()
        if self.tty:
            now = time.monotonic()
            if now - self._last_draw >= 0.1 or frac >= 1.0:
                self._last_draw = now
                self._draw_tty(frac, label)
        else:
            tenth = int(frac * 10)
            if tenth > self._last_tenth:
                self._last_tenth = tenth
                self.stream.write(self._text(frac) + "\n")
                self.stream.flush()

    def note(self, text: str) -> None:
        """Say what the job does once the bar is full (writing, syncing to disk): after the
        bar on a terminal, on a line of its own otherwise."""
        if not self.enabled:
            return
        if self.tty:
            self._draw_tty(self._fraction(), text)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def bytes_of(self, label: str) -> Callable[[int], None]:
        """A callback counting the bytes of one value's blocks (the value itself not yet)."""
        return functools.partial(self.update, label=label, values=0)

    def _text(self, frac: float) -> str:
        values = f"{self.count} value" + ("" if self.count == 1 else "s")
        return (
            f"{int(frac * 100):3d}% {human_size(self.done)} / {human_size(self.total)} ({values})"
        )

    def _draw_tty(self, frac: float, label: str) -> None:
        filled = int(frac * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        line = f"[{bar}] {self._text(frac)}"
        if label:
            line += f" {label[:60]}"
        pad = max(self._line_len - len(line), 0)
        self._line_len = len(line)
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()

    def close(self) -> None:
        """Finish the line (terminal mode); safe to call twice."""
        if self.enabled and self.tty and self._line_len:
            self._draw_tty(self._fraction(), "")
            self.stream.write("\n")
            self.stream.flush()
            self._line_len = 0

    def __exit__(self, *exc_info: object) -> None:
        self.close()
