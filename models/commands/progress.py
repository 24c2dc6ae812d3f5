"""A text progress bar for long offline work (`anima-models bundle`): parts done of all parts, the current part and
its own count (blocks packed, branches compiled), the elapsed time. On a terminal it redraws one line; into a file or
pipe it writes a line per part and at most one per PIPE_EVERY_S within a part, so logs stay short."""
from __future__ import annotations

import sys
import time

BAR = 24                   # characters of the bar
PIPE_EVERY_S = 10.0        # not a terminal: seconds between lines within one part


def _clock(s: float) -> str:
    m, s = divmod(int(s), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


class Progress:
    def __init__(self, parts: int, stream=None, label: str = "bundle"):
        self.parts, self.done, self.label = max(1, parts), 0, label
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.monotonic()
        self.what, self.last_line = "", 0.0

    def line(self, sub: str = "") -> str:
        frac = min(1.0, self.done / self.parts)
        fill = int(round(frac * BAR))
        return (f"{self.label} [{'#' * fill}{'.' * (BAR - fill)}] {self.done}/{self.parts} parts "
                f"{_clock(time.monotonic() - self.t0)}  {self.what}{(' ' + sub) if sub else ''}")

    def _show(self, text: str, force: bool) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K" + text)
        elif force or time.monotonic() - self.last_line >= PIPE_EVERY_S:
            self.stream.write(text + "\n")
            self.last_line = time.monotonic()
        self.stream.flush()

    def start(self, what: str) -> None:
        """A part begins."""
        self.what = what
        self._show(self.line(), True)

    def count(self, done: int, total: int, unit: str) -> None:
        """Within the current part: `done` of `total` units."""
        self._show(self.line(f"{done}/{total} {unit}"), done >= total)

    def finish(self, note: str = "") -> None:
        """The current part is complete (built or kept)."""
        self.done += 1
        self._show(self.line(note), True)
        if self.tty:
            self.stream.write("\n")
