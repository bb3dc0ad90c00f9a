"""Progress bars for training loops: odtrain's own, or tqdm's when it is installed.

`Progress` needs nothing: on a terminal it redraws one line (`\\r`);
elsewhere (logs, CI) it prints a line at the end of each task, so output
stays readable in files. `progress_bar` picks tqdm on a terminal when it is
installed, else `Progress`; with `leave=False` the bar disappears when done,
for loops that print their own summary line.
"""
from __future__ import annotations

import shutil
import sys
import time


class Progress:
    def __init__(self, total: int, description: str = "", stream=None, width: int = 28, unit: str = "it",
                 initial: int = 0, leave: bool = True):
        self.total, self.description, self.width = max(int(total), 1), description, width
        self.stream = stream or sys.stderr
        self.interactive = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.unit, self.leave, self.initial = unit, leave, int(initial)
        self.count, self.start, self.postfix = self.initial, time.perf_counter(), ""

    def update(self, count: int = 1, **postfix) -> None:
        self.count += count
        if postfix:
            self.postfix = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in postfix.items())
        if self.interactive:
            self.stream.write("\r" + self.line())
            self.stream.flush()

    def line(self) -> str:
        done = self.count / self.total
        bar = "#" * int(done * self.width)
        elapsed = time.perf_counter() - self.start
        rate = (self.count - self.initial) / elapsed if elapsed > 0 else 0.0
        return (f"{self.description} [{bar:<{self.width}}] {self.count}/{self.total} "
                f"{rate:.0f} {self.unit}/s {self.postfix}").rstrip()

    def close(self) -> None:
        if self.leave:
            self.stream.write(("\r" if self.interactive else "") + self.line() + "\n")
        elif self.interactive:
            self.stream.write("\r" + " " * len(self.line()) + "\r")
        self.stream.flush()


class _Tqdm:
    """tqdm behind Progress's interface: update(count, **postfix), close()."""

    def __init__(self, tqdm, total, description, stream, unit, initial, leave):
        width = min(100, shutil.get_terminal_size().columns - 2)  # a margin, so an echoed ^C does not wrap
        self.bar = tqdm(total=total, desc=description, file=stream, unit=unit, initial=initial, leave=leave,
                        ncols=width, unit_scale=False)

    def update(self, count: int = 1, **postfix) -> None:
        if postfix:
            self.bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in postfix.items()},
                                 refresh=False)
        self.bar.update(count)

    def close(self) -> None:
        self.bar.close()


def progress_bar(total: int, description: str = "", stream=None, unit: str = "it", initial: int = 0,
                 leave: bool = True):
    """A bar with update(count, **postfix) and close(): tqdm on a terminal when installed, else Progress."""
    stream = stream or sys.stderr
    if hasattr(stream, "isatty") and stream.isatty():
        try:
            from tqdm import tqdm
        except ImportError:
            pass
        else:
            return _Tqdm(tqdm, total, description, stream, unit, initial, leave)
    return Progress(total, description, stream, unit=unit, initial=initial, leave=leave)
