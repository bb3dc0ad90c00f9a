"""Progress bars for training loops: odtrain's own, or tqdm's when it is installed.

`Progress` needs nothing: on a terminal it redraws one line (`\\r`);
elsewhere (logs, CI) it prints a line at the end of each task, so output
stays readable in files. `progress_bar` picks tqdm on a terminal when it is
installed, else `Progress`; with `leave=False` the bar disappears when done,
for loops that print their own summary line.

`announce(message)` says something once on stderr and, while a bar is drawn, in the bar's line until
its next update: a step that first compiles kernels holds the line for seconds, and says why there.
"""
from __future__ import annotations

import shutil
import sys
import time
import weakref

_drawn: list = []  # weak references to the bars drawn now, the newest last


def announce(message: str) -> None:
    """Say `message` on stderr, and in the line of the newest bar still drawn until its next update."""
    bars = [bar for bar in (reference() for reference in _drawn) if bar is not None]
    _drawn[:] = [weakref.ref(bar) for bar in bars]
    if not (bars and bars[-1].note(message)):
        print(message, file=sys.stderr, flush=True)


def _opened(bar) -> None:
    _drawn.append(weakref.ref(bar))


def _closed(bar) -> None:
    _drawn[:] = [reference for reference in _drawn if reference() not in (bar, None)]


class Progress:
    def __init__(self, total: int, description: str = "", stream=None, width: int = 28, unit: str = "it",
                 initial: int = 0, leave: bool = True):
        self.total, self.description, self.width = max(int(total), 1), description, width
        self.stream = stream or sys.stderr
        self.interactive = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.unit, self.leave, self.initial = unit, leave, int(initial)
        self.count, self.start, self.postfix, self.notice = self.initial, time.perf_counter(), "", ""
        _opened(self)

    def note(self, message: str) -> bool:
        """Show `message` in the line until the next update; True when it was also written on stderr."""
        self.notice = message
        if not self.interactive:
            return False
        self.stream.write("\r" + " " * len(self.line()) + "\r" + message + "\n" + self.line())
        self.stream.flush()
        return self.stream is sys.stderr

    def update(self, count: int = 1, **postfix) -> None:
        self.count += count
        self.notice = ""
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
                f"{rate:.0f} {self.unit}/s {self.notice or self.postfix}").rstrip()

    def close(self) -> None:
        _closed(self)
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
        self.stream, self.noted = stream, False
        _opened(self)

    def note(self, message: str) -> bool:
        """Show `message` in the bar until the next update; True when it was also written on stderr."""
        type(self.bar).write(message, file=self.stream)  # above the bar, which is drawn again below
        self.bar.set_postfix_str(message, refresh=True)
        self.noted = True
        return self.stream is sys.stderr

    def update(self, count: int = 1, **postfix) -> None:
        if self.noted and not postfix:
            self.bar.set_postfix_str("", refresh=False)
        self.noted = False
        if postfix:
            self.bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in postfix.items()},
                                 refresh=False)
        self.bar.update(count)

    def close(self) -> None:
        _closed(self)
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
