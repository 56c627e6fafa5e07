"""Shard writing: groups to tar samples, shards finished atomically, a journal for --resume.

A shard is written under a temporary name and handed to ``storage.Output.put_file`` only when
complete. After each shard a journal record (the shard's index entry, its document lengths, where
its groups start and where the input stands) is stored beside the shards; ``--resume`` continues from the last record.
The index is written last, after which the journal is removed.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .. import format as fmt
from ..format.tar import SampleTarWriter, member_bytes, tar_file_bytes
from ..inputs.sources import UNLISTED
from ..storage import Output
from .shaping import GroupData, Position

log = logging.getLogger(__name__)

JOURNAL_PREFIX = ".pack-"
JOURNAL_START = fmt.JOURNAL_START
MAX_SKIP_RECORDS = 10_000


JOURNAL_RECORD_SUFFIX = ".rec"


def records_truncated(counts: dict, records: list) -> bool:
    """Whether the skip records leave out some listed skips (the index keeps MAX_SKIP_RECORDS)."""
    listed = sum(n for reason, n in counts.items() if reason not in UNLISTED)
    return listed > sum(r.get("count", 1) for r in records)


def journal_record_name(number: int) -> str:
    return f"{JOURNAL_PREFIX}shard-{number:06d}{JOURNAL_RECORD_SUFFIX}"


def encode_record(record: dict, lengths: np.ndarray) -> bytes:
    """One journal file per shard: a JSON line, then the shard's document lengths as .npy.

    One file, so that a shard costs one atomic put (and its fsyncs) in the journal, not two.
    """
    return (
        json.dumps(record, separators=(",", ":")).encode() + b"\n" + fmt.npy_bytes(np.asarray(lengths, dtype=np.uint32))
    )


def decode_record(data: bytes, where: str) -> dict:
    """The record dict, with its lengths under ``"lengths"``."""
    head, sep, tail = data.partition(b"\n")
    if not sep:
        raise fmt.FormatError(f"{where}: truncated journal record")
    record = json.loads(head)
    record["lengths"] = fmt.npy_array(tail, where)
    return record


class _HashingFile(io.RawIOBase):
    """Writes through to a file while counting bytes and hashing them (no second read)."""

    def __init__(self, path: str):
        self.path = path
        self._f = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.sha = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.sha.update(b)
        self.size += len(b)
        try:
            return self._f.write(b)
        except OSError as exc:  # name the file (a failed write says nothing of it)
            raise OSError(exc.errno, exc.strerror, self.path) from exc

    def close(self) -> None:
        if not self._f.closed:  # Output.put_file makes it durable before it renames it
            self._f.close()
        super().close()


@dataclass
class Counters:
    """Per-run tallies that the index reports; additive over shards so --resume can sum them."""

    documents_by_input: Counter = field(default_factory=Counter)
    tokens_by_input: Counter = field(default_factory=Counter)  # full document lengths, by input
    skipped_by_input: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)
    skip_records: list = field(default_factory=list)

    def add_skips(self, skips: Iterable[Any], inputs_display: dict) -> None:
        """Listed skips (sources.Skip): counted, and recorded up to MAX_SKIP_RECORDS."""
        for s in skips:
            self.skipped[s.reason] += s.count
            self.skipped_by_input[s.file_index] += s.count
            if len(self.skip_records) < MAX_SKIP_RECORDS:
                record = {"file": inputs_display[s.file_index], "line": s.line, "reason": s.reason, "detail": s.detail}
                if s.count != 1:
                    record["count"] = s.count
                if s.key is not None:
                    record["key"] = s.key
                self.skip_records.append(record)

    def add_tally(self, file_index: int, reason: str, count: int) -> None:
        """Unlisted skips (empty, filtered): only counted."""
        if count:
            self.skipped[reason] += count
            self.skipped_by_input[file_index] += count

    def to_json(self) -> dict:
        return {
            "documents_by_input": {str(k): v for k, v in self.documents_by_input.items()},
            "tokens_by_input": {str(k): v for k, v in self.tokens_by_input.items()},
            "skipped_by_input": {str(k): v for k, v in self.skipped_by_input.items()},
            "skipped": dict(self.skipped),
            "skip_records": self.skip_records,
        }

    def add_json(self, d: dict) -> None:
        self.documents_by_input.update({int(k): v for k, v in d["documents_by_input"].items()})
        self.tokens_by_input.update({int(k): v for k, v in d.get("tokens_by_input", {}).items()})
        self.skipped_by_input.update({int(k): v for k, v in d["skipped_by_input"].items()})
        self.skipped.update(d["skipped"])
        room = MAX_SKIP_RECORDS - len(self.skip_records)
        self.skip_records.extend(d["skip_records"][: max(0, room)])


class ShardSink:
    """Receives groups in order and writes them into size-limited shards."""

    def __init__(
        self,
        output: Output,
        *,
        prefix: str,
        task: int,
        mode: str,
        shard_size: int,
        shard_samples: int | None,
        first_shard: int = 0,
        first_group: int = 0,
        inputs_display: dict | None = None,
        seq_len: int | None = None,
        note: Callable[[Position | None], dict] | None = None,
    ):
        self.seq_len = seq_len
        self.note = note  # what else a journal record holds, given its cursor
        self.output = output
        self.prefix = prefix
        self.task = task
        self.mode = mode
        self.shard_size = shard_size
        self.shard_samples = shard_samples
        self.number = first_shard
        self.group_counter = first_group
        self.entries: list[fmt.ShardEntry] = []
        self.inputs_display = inputs_display or {}
        self.pending = Counters()  # documents written since the last finished shard
        self.pending_skips: list = []  # skipped input not yet vouched for by a shard record
        self.pending_tallies: list[tuple[int, str, np.ndarray]] = []  # (file, reason, lines), the same for tallies
        self._tar = None
        self._file: _HashingFile | None = None
        self._tmp_path = ""
        self._cur: dict[str, int] = {}
        self._lengths: list[np.ndarray] = []
        self._groups: list[list[int]] = []  # the shard's groups.npy rows (format.GROUP_COLUMNS each)
        self._position: Position | None = None
        self.max_row_segments = 0  # packed mode: most documents (incl. a continuation) in one row
        self.short_rows = 0

    # -- writing ------------------------------------------------------------------------------
    def write(self, group: GroupData) -> None:
        key = fmt.group_key(self.task, self.group_counter)
        meta = {"documents": group.documents, "provenance": fmt.provenance_runs(group.files, group.lines, group.pieces)}
        if group.keys is not None:
            meta["source_keys"] = group.keys.tolist()
        if self.mode == "packed":
            meta["rows"] = group.rows
            sample = fmt.encode_group(key, group.tokens, starts=group.starts, meta=meta)
        else:
            sample = fmt.encode_group(key, group.tokens, lengths=group.lengths, meta=meta)
        size = member_bytes(sample)
        items = group.rows if self.mode == "packed" else group.documents
        if self._tar is not None and (
            tar_file_bytes(self._cur["bytes"] + size) > self.shard_size
            or (self.shard_samples and self._cur["items"] + items > self.shard_samples)
        ):
            self.finish_shard()
        if self._tar is None:
            self._open()
        written = self._tar.write(sample)
        group_row = [self._cur["bytes"], self._cur["items"], self._cur["documents"], len(written)]
        self._groups.append([*group_row, fmt.group_checksum(written)])
        self.group_counter += 1
        self._cur["bytes"] += size
        self._cur["items"] += items
        self._cur["samples"] += 1
        self._cur["documents"] += group.documents
        self._cur["tokens"] += len(group.tokens)
        self._cur["rows"] += group.rows
        self._lengths.append(np.asarray(group.doc_lengths, dtype=np.uint32))
        if self.mode == "packed" and group.rows:
            self._note_rows(group)
        files, which, counts = np.unique(group.files, return_inverse=True, return_counts=True)
        tokens = np.bincount(which, weights=np.asarray(group.doc_lengths, np.float64), minlength=len(files))
        for f, c, t in zip(files.tolist(), counts.tolist(), tokens.tolist()):
            self.pending.documents_by_input[f] += c
            self.pending.tokens_by_input[f] += int(t)
        self._position = group.position

    def _open(self) -> None:
        name = fmt.shard_name(self.prefix, self.number)
        self._tmp_path = os.path.join(self.output.local_staging_dir(), f".{name}.tmp")
        self._file = _HashingFile(self._tmp_path)
        self._tar = SampleTarWriter(self._file)
        self._cur = Counter(bytes=0, items=0, samples=0, documents=0, tokens=0, rows=0)
        self._lengths = []
        self._groups = []

    def _note_rows(self, group: GroupData) -> None:
        seq_len = (len(group.tokens) + group.rows - 1) // group.rows if group.rows > 1 else len(group.tokens)
        seq_len = self.seq_len or seq_len
        starts = np.asarray(group.starts, dtype=np.int64)
        per_row = np.bincount(starts // seq_len, minlength=group.rows)
        continues = np.ones(group.rows, np.int64)
        continues[(starts[starts % seq_len == 0] // seq_len)] = 0
        self.max_row_segments = max(self.max_row_segments, int((per_row + continues).max()))
        self.short_rows += int(len(group.tokens) % seq_len != 0)

    def add_skips(self, skips: Iterable[Any], tallies: Iterable[tuple[int, str, np.ndarray]] = ()) -> None:
        self.pending_skips.extend(skips)
        self.pending_tallies.extend(t for t in tallies if len(t[2]))

    def _take_skips(self, final: bool) -> None:
        """Move skips at or before the written position into the pending counters.

        Chunks are parsed ahead of the groups being written, so a skip may lie past the last
        written document; it must then be counted by a later record, or --resume counts it twice.
        """
        if final:
            taken, self.pending_skips = self.pending_skips, []
            tallies, self.pending_tallies = self.pending_tallies, []
        elif self._position is None:
            return
        else:
            p = (self._position.file, self._position.line)
            taken = [s for s in self.pending_skips if (s.file_index, s.line) <= p]
            self.pending_skips = [s for s in self.pending_skips if (s.file_index, s.line) > p]
            tallies, later = [], []
            for file_index, reason, lines in self.pending_tallies:
                if file_index < p[0]:
                    tallies.append((file_index, reason, lines))
                elif file_index > p[0]:
                    later.append((file_index, reason, lines))
                else:
                    at = lines <= p[1]
                    tallies.append((file_index, reason, lines[at]))
                    if not at.all():
                        later.append((file_index, reason, lines[~at]))
            self.pending_tallies = later
        self.pending.add_skips(taken, self.inputs_display)
        for file_index, reason, lines in tallies:
            self.pending.add_tally(file_index, reason, len(lines))

    def leftover_counters(self) -> Counters:
        """Tallies not in any shard record (a pack with no documents at all)."""
        self._take_skips(final=True)
        left, self.pending = self.pending, Counters()
        return left

    def finish_shard(self, final: bool = False) -> fmt.ShardEntry | None:
        if self._tar is None:
            return None
        self._take_skips(final)
        self._tar.close()
        self._file.close()
        name = fmt.shard_name(self.prefix, self.number)
        entry = fmt.ShardEntry(
            name=name,
            samples=self._cur["samples"],
            documents=self._cur["documents"],
            tokens=self._cur["tokens"],
            bytes=self._file.size,
            sha256=self._file.sha.hexdigest(),
            rows=self._cur["rows"],
        )
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.uint32)
        # Order matters for --resume: the shard, then the record that vouches for it.
        self.output.put_file(self._tmp_path, name)
        record = {
            "entry": asdict(entry),
            "position": self._position.to_json() if self._position else None,
            "next_group": self.group_counter,
            "max_row_segments": self.max_row_segments,
            "short_rows": self.short_rows,
            "counters": self.pending.to_json(),
            "groups": self._groups,
        }
        if self.note is not None:
            record.update(self.note(self._position))
        self.output.put_bytes(journal_record_name(self.number), encode_record(record, lengths))
        self.entries.append(entry)
        self._tar = None
        self._file = None
        self.number += 1
        self.pending = Counters()
        log.info("wrote %s (%d documents, %d tokens, %d bytes)", name, entry.documents, entry.tokens, entry.bytes)
        return entry

    def abort(self) -> None:
        """Drop the unfinished shard so that nothing half-written remains."""
        if self._tar is not None:
            try:
                self._tar.close()
                self._file.close()
            except Exception:
                pass
            self._tar = None
        if self._tmp_path and os.path.exists(self._tmp_path):
            os.remove(self._tmp_path)


def iter_journal(output: Output, *, lengths: bool = True) -> Iterator[dict]:
    """Journal records of finished shards, in order, stopping at the first gap, read one at a time
    (``lengths=False``: without their document lengths, which only the final lengths.npy needs)."""
    numbers = sorted(
        int(n[len(JOURNAL_PREFIX) + 6 : len(JOURNAL_PREFIX) + 12])
        for n in output.list_names()
        if n.startswith(JOURNAL_PREFIX + "shard-") and n.endswith(JOURNAL_RECORD_SUFFIX)
    )
    for expected, number in enumerate(numbers):
        if number != expected:
            break
        name = journal_record_name(number)
        data = output.get_bytes(name)
        if data is None:
            break
        record = decode_record(data, name)
        if not lengths:
            del record["lengths"]
        yield record


def read_journal(output: Output, *, lengths: bool = True) -> list[dict]:
    """Every record of ``iter_journal``."""
    return list(iter_journal(output, lengths=lengths))
