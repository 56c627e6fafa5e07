"""Which reader reads an input kind: the one place that knows every reader, so that the readers
import only the shared parts in :mod:`.sources` and never each other."""

from __future__ import annotations

from ..errors import SourceError
from .sources import Reader


def reader_for(kind: str) -> Reader:
    """The reader of an input kind (imported on first use: pyarrow only when Parquet is read)."""
    if kind in ("txt", "jsonl"):
        from .text import TextReader

        return TextReader()
    if kind == "parquet":
        from .columns import ParquetReader

        return ParquetReader()
    if kind == "arrow":
        from .columns import ArrowReader

        return ArrowReader()
    if kind == "wds":
        from .tarinput import TarReader

        return TarReader()
    raise SourceError(f"unknown input kind {kind!r}")
