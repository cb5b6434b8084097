"""Progress with ETA for long runs (engine start-up, scoring, sweeps): a live rich bar on
a terminal; one line per step otherwise (logs stay readable); nothing when quiet."""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager


class Progress:
    def __init__(self, quiet: bool = False, stream=None):
        self.quiet = quiet
        self.stream = stream or sys.stderr
        self.live = not quiet and hasattr(self.stream, "isatty") and self.stream.isatty()

    def log(self, msg: str) -> None:
        if not self.quiet:
            print(msg, file=self.stream, flush=True)

    __call__ = log

    @contextmanager
    def task(self, description: str, total: int | None):
        """Yields advance(n=1, note=""); `total` None for an open-ended wait."""
        if self.quiet:
            yield lambda n=1, note="": None
            return
        if self.live:
            from rich.progress import (BarColumn, Progress as Bar, SpinnerColumn, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)
            cols = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.completed}/{task.total}" if total else ""),
                    TimeElapsedColumn(), TimeRemainingColumn()]
            with Bar(*cols, transient=True, console=_console(self.stream)) as bar:
                t = bar.add_task(description, total=total)
                yield lambda n=1, note="": bar.update(t, advance=n,
                                                      description=f"{description} {note}".strip())
            self.log(f"{description}: done")
            return
        t0, done = time.monotonic(), [0]

        def advance(n=1, note=""):
            done[0] += n
            el = time.monotonic() - t0
            eta = f", eta {el / done[0] * (total - done[0]):.0f} s" if total and done[0] else ""
            self.log(f"  {description}: {done[0]}{'/' + str(total) if total else ''}"
                     f" ({el:.0f} s{eta}) {note}".rstrip())
        yield advance


def _console(stream):
    from rich.console import Console
    return Console(file=stream)
