"""Recording served traffic (opt-in: `specdec serve --record-traffic DIR`) for distilling drafters.

Each request that finished normally (a stop or the length limit, not an abort or an error) becomes
one JSON line: its prompt and the target's own output, as token ids and text, with the sampling
temperature and a timestamp. That is what fine-tuning a draft model (or training a feature head) on
the target's outputs for the prompts users really send needs.

Files ``traffic-<n>.jsonl`` rotate at ``max_file_bytes``; when a new one starts, the oldest go until
it fits ``max_total_bytes``.
Writing runs on the engine thread after a request has finished, one buffered line at a time; a
failing disk is logged once and stops the recording, never a request.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from specdec.errors import SpecdecError

PATTERN = "traffic-*.jsonl"


class TrafficRecorder:
    def __init__(self, directory: str | Path, max_total_bytes: int = 1 << 30, max_file_bytes: int = 64 << 20) -> None:
        if max_total_bytes < 1 or max_file_bytes < 1:
            raise SpecdecError("traffic recording sizes must be positive")
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SpecdecError(f"cannot create the traffic directory '{self.dir}': {e.strerror}") from e
        self.max_total, self.max_file = max_total_bytes, min(max_file_bytes, max_total_bytes)
        self.records, self.enabled = 0, True
        self._next = max((self._number(p) for p in self.dir.glob(PATTERN)), default=-1) + 1
        self._file = None

    @staticmethod
    def _number(path: Path) -> int:
        try:
            return int(path.stem.split("-", 1)[1])
        except (IndexError, ValueError):
            return -1

    def files(self) -> list[Path]:
        """The recorded files, oldest first."""
        return sorted((p for p in self.dir.glob(PATTERN) if self._number(p) >= 0), key=self._number)

    def record(self, seq) -> None:
        """Append ``seq`` (a finished Sequence) if it ended normally."""
        if not self.enabled or seq.finish_reason not in ("stop", "length"):
            return
        line = json.dumps({"time": round(time.time(), 3), "prompt_ids": list(seq.prompt_ids),
                           "prompt": seq.prompt, "output_ids": list(seq.output_ids), "output": seq.text,
                           "temperature": seq.params.temperature, "finish_reason": seq.finish_reason},
                          ensure_ascii=False) + "\n"
        try:
            self._write(line.encode())
            self.records += 1
        except OSError as e:
            self.enabled = False
            logging.getLogger(__name__).error("traffic recording stopped: cannot write to %s: %s", self.dir, e)

    def _write(self, data: bytes) -> None:
        if self._file is None or self._file.tell() + len(data) > self.max_file:
            self._rotate()
        self._file.write(data)
        self._file.flush()

    def _rotate(self) -> None:
        """Start the next file, first deleting the oldest until a full new one fits the cap."""
        if self._file is not None:
            self._file.close()
        files = self.files()
        total = sum(p.stat().st_size for p in files)
        for p in files:
            if total + self.max_file <= self.max_total:
                break
            total -= p.stat().st_size
            p.unlink()
        self._file = open(self.dir / f"traffic-{self._next}.jsonl", "ab")  # noqa: SIM115 (kept open)
        self._next += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
