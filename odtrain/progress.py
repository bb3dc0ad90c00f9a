"""A dependency-free progress bar for training loops.

On a terminal it redraws one line (`\\r`); elsewhere (logs, CI) it prints a
line at the end of each task, so output stays readable in files.
"""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, description: str = "", stream=None, width: int = 28):
        self.total, self.description, self.width = max(int(total), 1), description, width
        self.stream = stream or sys.stderr
        self.interactive = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.count, self.start, self.postfix = 0, time.perf_counter(), ""

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
        rate = self.count / elapsed if elapsed > 0 else 0.0
        return (f"{self.description} [{bar:<{self.width}}] {self.count}/{self.total} "
                f"{rate:.0f} it/s {self.postfix}").rstrip()

    def close(self) -> None:
        self.stream.write(("\r" if self.interactive else "") + self.line() + "\n")
        self.stream.flush()
