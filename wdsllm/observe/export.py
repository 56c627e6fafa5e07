"""The loader's metrics as JSON lines: written during a run, read back to plot (``wdsllm metrics``).

One line per call: ``{"step": N, "time": unix seconds, <every key of loader.metrics()>}``. A line
is written whole (one ``write`` of text ending in a newline, flushed), so a run killed mid-write
leaves at most a last partial line, which the reader reports by line number.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import IO

from ..errors import FormatError

#: a metrics line longer than this is refused when read (a loader's line is a few KiB)
MAX_LINE_BYTES = 1 << 20
#: lines read at most from one file
MAX_LINES = 10_000_000

#: what the trainer integrations log by default (``data/<key>``): the wait, its spread over ranks
#: where reduced, and where it comes from
DEFAULT_KEYS = (
    "data_wait_s",
    "data_wait_share",
    "data_wait_p95_s",
    "data_wait_max_s",
    "data_wait_rank_max_s",
    "data_wait_rank_mean_s",
    "data_wait_slowest_rank",
    "slowest_stage",
    "slowest_worker",
    "mix_drift_max",
)


def selected(metrics: dict[str, float], keys: tuple[str, ...] | None = DEFAULT_KEYS, prefix: str = "data/") -> dict:
    """``metrics`` limited to ``keys`` (None: all) that are present, each name behind ``prefix``."""
    names = metrics if keys is None else [k for k in keys if k in metrics]
    return {f"{prefix}{k}": metrics[k] for k in names}


class MetricsLog:
    """Appends ``loader.metrics()`` to a JSONL file every ``every`` steps (``write``), and closes it."""

    def __init__(self, path: str | os.PathLike, every: int = 1):
        if every < 1:
            raise ValueError(f"every must be positive, not {every}")
        self.path = Path(path)
        self.every = every
        self._file: IO[str] | None = None

    def write(self, step: int, metrics: dict[str, float]) -> bool:
        """Write one line for ``step`` if it is one of every ``every``; whether it was written."""
        if step % self.every:
            return False
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open across steps
        record = {"step": int(step), "time": time.time(), **{k: _number(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        return True

    def close(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            file.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _number(value: float) -> float | None:
    """JSON has no NaN or infinity: those are written as null."""
    value = float(value)
    return value if math.isfinite(value) else None


def read_metrics(path: str | os.PathLike) -> list[dict[str, float]]:
    """The lines of a metrics file, each checked (an object of numbers with a step); a bad line is
    a ``FormatError`` naming the file and the line."""
    out = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if number > MAX_LINES:
                raise FormatError(f"{path}: more than {MAX_LINES:,} lines")
            if len(raw) > MAX_LINE_BYTES:
                raise FormatError(f"{path}, line {number}: longer than {MAX_LINE_BYTES:,} bytes")
            if not raw.strip():
                continue
            out.append(_record(path, number, raw))
    return out


def _record(path: str | os.PathLike, number: int, raw: bytes) -> dict[str, float]:
    try:
        record = json.loads(raw)
    except ValueError as exc:
        raise FormatError(f"{path}, line {number}: not JSON ({exc.msg})") from None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        raise FormatError(f"{path}, line {number}: not a metrics record (an object with an integer step)")
    for key, value in record.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise FormatError(f"{path}, line {number}: {key!r} is not a number")
    return record
