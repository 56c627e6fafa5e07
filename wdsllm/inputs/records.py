"""Records already cut out of their input (Parquet/Arrow rows, tar samples), as one chunk for a
worker: their payloads in one buffer with offsets, so that a chunk pickles as a few large objects
whatever its number of documents. Imports only numpy: the workers never import pyarrow.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from .sources import ParsedChunk, ParseOptions, Skip, add_text, json_field, lone_surrogate, not_text, settle


@dataclass
class RecordChunk:
    """Documents of one input, each a payload: UTF-8 text, or a JSON object holding the text."""

    file_index: int
    unit: str  # what a line number counts: "row" (Parquet, Arrow) or "sample" (tar)
    lines: np.ndarray  # int64: the row or sample number of each record
    data: bytes  # the payloads, concatenated
    offsets: np.ndarray  # int64, one more than the records: payload i is data[offsets[i]:offsets[i+1]]
    is_json: np.ndarray | None = None  # bool per record: the payload is JSON (a tar sample's .json)
    metas: list[bytes | None] | None = None  # tar: each sample's .json, when --where reads it beside a .txt
    keys: list[str] | None = None  # tar: each sample's key
    skips: list[Skip] = field(default_factory=list)  # found by the reader (nulls, too long, unreadable)
    tallies: dict[str, list[int]] = field(default_factory=dict)  # found by the reader (filtered)
    raw_offset: int = 0

    @property
    def text_bytes(self) -> int:
        return len(self.data)

    def parse(self, opts: ParseOptions, display: str) -> ParsedChunk:
        out = ParsedChunk(skips=list(self.skips), keys=[] if self.keys is not None else None)
        for reason, lines in self.tallies.items():
            out.tallies[reason] = list(lines)
        view = memoryview(self.data)
        offsets = self.offsets.tolist()
        path = opts.text_field.split(".")
        # Rows were filtered by the reader, on the columns; tar samples are filtered here.
        where = opts.where if self.unit == "sample" else None
        for i, line in enumerate(self.lines.tolist()):
            key = self.keys[i] if self.keys is not None else None
            payload = view[offsets[i] : offsets[i + 1]]
            is_json = self.is_json is not None and bool(self.is_json[i])
            if is_json or where is not None:
                source = payload if is_json else (self.metas[i] if self.metas else None)
                try:
                    obj = json.loads(bytes(source)) if source is not None else {}
                except ValueError as exc:
                    what = "the .json member" if self.unit == "sample" else "JSON"
                    message = f"invalid {what}: {exc}"
                    out.skips.append(Skip(self.file_index, line, "invalid_json", str(exc), message, key=key))
                    continue
                if where is not None and not where.keeps(obj):
                    out.tally("filtered", line)
                    continue
                if is_json:
                    text = json_field(obj, path)
                    if not isinstance(text, str):
                        problem = not_text(text)
                        message = f"text field {opts.text_field!r} of the .json member is {problem}"
                        detail = f"{opts.text_field!r} {problem}"
                        out.skips.append(Skip(self.file_index, line, "missing_field", detail, message, key=key))
                        continue
                    bad = lone_surrogate(self.file_index, line, text, opts.text_field, key)
                    if bad is not None:
                        out.skips.append(bad)
                        continue
                    add_text(out, line, text, key)
                    continue
            try:
                text = str(payload, "utf-8")
            except UnicodeDecodeError as exc:
                message = f"invalid UTF-8 at byte {exc.start} of the text"
                out.skips.append(Skip(self.file_index, line, "decode_error", str(exc.reason), message, key=key))
                continue
            add_text(out, line, text, key)
        return settle(out, opts, display, self.unit)


def empty_chunk(file_index: int, unit: str, raw_offset: int = 0, **kwargs) -> RecordChunk:
    """A chunk of no documents: only skips or tallies."""
    return RecordChunk(
        file_index, unit, np.zeros(0, np.int64), b"", np.zeros(1, np.int64), raw_offset=raw_offset, **kwargs
    )
