"""Parquet and Arrow inputs (Arrow IPC files, Feather v2, and IPC streams), read with pyarrow.

Columnar all the way. The packing process reads only the text column and the columns ``--where``
names, a row group (Parquet) or record batch (Arrow) at a time, in batches of about
``chunk_bytes`` of text, so memory is bounded by a row group whatever the file's size.
``--where``, null texts and ``--max-doc-bytes`` are evaluated with ``pyarrow.compute`` on whole
columns; for Parquet, the ``--where`` columns of a row group are read first, and its text column is
not read at all when no row passes. The kept texts travel to the workers as one buffer plus offsets
(:class:`~.records.RecordChunk`), where they are decoded and encoded.

A row group (Parquet) or record batch (Arrow file) is the unit of a task's share and of
``--resume``. The provenance "line" of a document is its row, 1-based within the file.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import numpy as np

from ..errors import SourceError
from .records import RecordChunk, empty_chunk
from .sources import (
    OPEN_READS,
    STDIN,
    InputFile,
    ParseOptions,
    Part,
    Skip,
    Units,
    check_unchanged,
    close_input,
    open_seekable,
    too_long,
)

log = logging.getLogger(__name__)

UNIT = "row"
#: Text bytes per batch asked of pyarrow. Fixed (not chunk_bytes): a damaged row group then fails
#: at the same batch, and keeps the same rows before it, whatever the chunking.
BATCH_BYTES = 1 << 20


def _pa():
    import pyarrow as pa
    import pyarrow.compute as pc

    return pa, pc


def _arrow_errors() -> tuple[type[BaseException], ...]:
    pa, _ = _pa()
    return (pa.ArrowException, OSError, ValueError)


def resolve(schema, parts: tuple[str, ...]) -> tuple[str, tuple[str, ...], object] | None:
    """(top-level column, struct children, type) that a dotted name reaches, or None.

    A top-level name that itself holds dots wins over a struct path (``a.b`` is the column "a.b"
    if there is one, else field "b" of struct column "a").
    """
    pa, _ = _pa()
    names = set(schema.names)
    for k in range(len(parts), 0, -1):
        top = ".".join(parts[:k])
        if top not in names:
            continue
        typ = schema.field(top).type
        rest = parts[k:]
        for child in rest:
            if not pa.types.is_struct(typ) or typ.get_field_index(child) < 0:
                break
            typ = typ.field(child).type
        else:
            return top, rest, typ
    return None


def _is_text(typ) -> bool:
    pa, _ = _pa()
    if pa.types.is_dictionary(typ):
        typ = typ.value_type
    return (
        pa.types.is_string(typ)
        or pa.types.is_large_string(typ)
        or pa.types.is_binary(typ)
        or pa.types.is_large_binary(typ)
        or getattr(pa.types, "is_string_view", lambda t: False)(typ)
        or getattr(pa.types, "is_binary_view", lambda t: False)(typ)
    )


def _column(batch, top: str, rest: tuple[str, ...]):
    _, pc = _pa()
    arr = batch.column(top)
    for child in rest:
        arr = pc.struct_field(arr, child)  # a null struct gives a null child
    return arr


def _plain_text(arr):
    """A string or binary array with 32- or 64-bit offsets (dictionaries and views decoded)."""
    pa, _ = _pa()
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if getattr(pa.types, "is_string_view", lambda t: False)(arr.type):
        arr = arr.cast(pa.large_string())
    elif getattr(pa.types, "is_binary_view", lambda t: False)(arr.type):
        arr = arr.cast(pa.large_binary())
    return arr


def _payloads(arr) -> tuple[bytes, np.ndarray]:
    """The values of a string array without nulls as one buffer and offsets (a copy of only them)."""
    pa, _ = _pa()
    if len(arr) == 0:
        return b"", np.zeros(1, np.int64)
    width = np.int64 if (pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)) else np.int32
    buffers = arr.buffers()
    offsets = np.frombuffer(buffers[1], width, len(arr) + 1, arr.offset * np.dtype(width).itemsize).astype(np.int64)
    start, stop = int(offsets[0]), int(offsets[-1])
    data = buffers[2][start:stop].to_pybytes() if buffers[2] is not None and stop > start else b""
    return data, offsets - start


class Columns:
    """The columns a pack reads from one Parquet/Arrow schema: the text, and what --where needs."""

    def __init__(self, inp: InputFile, schema, opts: ParseOptions):
        self.inp = inp
        self.opts = opts
        self.text = resolve(schema, tuple(opts.text_field.split(".")))
        self.problem: str | None = None
        if self.text is None:
            names = ", ".join(schema.names[:20]) + (", ..." if len(schema.names) > 20 else "")
            self.problem = f"no column {opts.text_field!r} (it has: {names})"
        elif not _is_text(self.text[2]):
            self.problem = f"column {opts.text_field!r} is {self.text[2]}, not text"
        self.where = opts.where
        self.where_columns: dict = {}  # Field -> (top, rest) or None (absent: read as null)
        if self.where is not None:
            for f in self.where.fields:
                found = resolve(schema, f.path)
                self.where_columns[f] = found[:2] if found else None
                if found is None:
                    log.warning("%s has no column %s; --where reads it as null", inp.display, f.name)

    @property
    def text_path(self) -> str:
        top, rest, _ = self.text
        return ".".join((top, *rest))

    @property
    def where_paths(self) -> list[str]:
        paths = [".".join((t, *r)) for t, r in (v for v in self.where_columns.values() if v is not None)]
        return list(dict.fromkeys(paths))

    def problem_chunk(self, line: int, count: int) -> RecordChunk:
        message = self.problem
        return empty_chunk(
            self.inp.index, UNIT, skips=[Skip(self.inp.index, line, "missing_field", message, message, count=count)]
        )

    def mask(self, batch, length: int) -> np.ndarray:
        """Which rows pass --where (all when there is none)."""
        pa, _ = _pa()
        if self.where is None:
            return np.ones(length, bool)

        def column(f):
            found = self.where_columns.get(f)
            if found is None:
                return pa.nulls(length)
            return _column(batch, *found)

        try:
            result = self.where.mask(column, length)
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            where = f"{self.inp.display}: --where {self.where.text!r}"
            raise SourceError(f"{where} does not fit the columns: {exc}") from None
        return np.asarray(result.to_numpy(zero_copy_only=False), bool)

    def chunks(
        self, batch, first_row: int, keep: np.ndarray, chunk_bytes: int, raw_offset: Callable[[int], int]
    ) -> Iterator[RecordChunk]:
        """The rows of a batch (the first one is row ``first_row``) as chunks of ~chunk_bytes."""
        arr = _plain_text(_column(batch, *self.text[:2]))
        n = len(arr)
        if n == 0:
            return
        step = max(1, int(chunk_bytes * n // max(1, arr.nbytes)))
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            yield self._chunk(arr.slice(lo, hi - lo), first_row + lo, keep[lo:hi], raw_offset(hi))

    def _chunk(self, arr, first_row: int, keep: np.ndarray, raw_offset: int) -> RecordChunk:
        pa, pc = _pa()
        index, limit, name = self.inp.index, self.opts.max_doc_bytes, self.opts.text_field
        rows = np.arange(first_row, first_row + len(arr), dtype=np.int64)
        tallies = {"filtered": rows[~keep].tolist()} if not keep.all() else {}
        valid = np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), bool)
        sizes = pc.fill_null(pc.binary_length(arr), 0).to_numpy(zero_copy_only=False)
        long = keep & valid & (sizes > limit)
        skips = [
            Skip(index, int(r), "missing_field", f"{name!r} null", f"text column {name!r} is null")
            for r in rows[keep & ~valid]
        ]
        skips += [too_long(index, int(r), int(s), limit) for r, s in zip(rows[long], sizes[long])]
        take = keep & valid & ~long
        kept = arr if take.all() else arr.filter(pa.array(take))
        data, offsets = _payloads(kept)
        return RecordChunk(
            index,
            UNIT,
            rows[take],
            data,
            offsets,
            skips=sorted(skips, key=lambda s: s.line),
            tallies=tallies,
            raw_offset=raw_offset,
        )


def _unreadable(inp: InputFile, line: int, what: str, exc: BaseException, count: int = 1) -> RecordChunk:
    message = f"{what}: {exc}"
    return empty_chunk(inp.index, UNIT, skips=[Skip(inp.index, line, "unreadable", str(exc), message, count=count)])


# ----------------------------------------------------------------------------------------------
# Parquet.


def _row_group_start(rg) -> int:
    """Where a row group's bytes begin in the file: its first column chunk's first page."""
    starts = []
    for i in range(rg.num_columns):
        col = rg.column(i)
        offs = [o for o in (col.dictionary_page_offset, col.data_page_offset) if o is not None and o > 0]
        if offs:
            starts.append(min(offs))
    return min(starts) if starts else 0


def _row_group_bytes(rg) -> int:
    return sum(rg.column(i).total_compressed_size for i in range(rg.num_columns))


class ParquetReader:
    """Parquet files: row groups are the unit of work and of --resume."""

    def _open(self, inp: InputFile):
        import pyarrow.parquet as pq

        f = open_seekable(inp.path, inp.size, inp.version)
        try:
            check_unchanged(inp, f)
            return f, pq.ParquetFile(f, page_checksum_verification=True)  # pages written with a CRC are checked
        except BaseException:
            f.close()
            raise

    def units(self, inp: InputFile, opts: ParseOptions) -> Units | None:
        try:
            f, pf = self._open(inp)
        except _arrow_errors():
            return None  # the reader says what is wrong with it; the file goes to one task whole
        try:
            md = pf.metadata
            return Units("row_groups", [_row_group_start(md.row_group(g)) for g in range(md.num_row_groups)])
        finally:
            f.close()

    def chunks(self, part: Part, opts: ParseOptions, chunk_bytes: int, start_line: int) -> Iterator[RecordChunk]:
        return OPEN_READS.track(self._chunks(part, opts, chunk_bytes, start_line))

    def _chunks(self, part: Part, opts: ParseOptions, chunk_bytes: int, start_line: int) -> Iterator[RecordChunk]:
        inp = part.input
        try:
            f, pf = self._open(inp)
        except SourceError:
            raise
        except _arrow_errors() as exc:
            yield _unreadable(inp, 0, "not a readable Parquet file", exc)
            return
        try:
            md = pf.metadata
            groups = range(md.num_row_groups) if part.whole else range(part.start, min(part.stop, md.num_row_groups))
            firsts = np.concatenate([[1], 1 + np.cumsum([md.row_group(g).num_rows for g in range(md.num_row_groups)])])
            cols = Columns(inp, pf.schema_arrow, opts)
            if cols.problem:
                if len(groups):
                    first, rows = int(firsts[groups[0]]), int(firsts[groups[-1] + 1] - firsts[groups[0]])
                    yield cols.problem_chunk(0 if part.whole else first, rows)
                return
            leaf = {md.schema.column(i).path: i for i in range(md.num_columns)}
            text_leaf = leaf.get(cols.text_path)
            done = 0
            for g in groups:
                rg = md.row_group(g)
                n, first = rg.num_rows, int(firsts[g])
                size = _row_group_bytes(rg)
                if first + n <= start_line or n == 0:
                    done += size
                    continue
                yield from self._row_group(pf, cols, rg, g, first, start_line, chunk_bytes, text_leaf, done, size)
                done += size
        finally:
            close_input(inp, f)

    def _row_group(self, pf, cols: Columns, rg, g, first, start_line, chunk_bytes, text_leaf, done, size):
        inp, n = cols.inp, rg.num_rows
        errors = _arrow_errors()
        head = max(0, start_line - first)  # rows already packed before an interruption
        row = first
        try:
            keep = np.ones(n, bool)
            if cols.where is not None:
                paths = cols.where_paths
                table = pf.read_row_group(g, columns=paths) if paths else None
                keep = cols.mask(table, n)
                if not keep[head:].any():  # no row passes: the text column is never read
                    filtered = {"filtered": list(range(first + head, first + n))}
                    yield empty_chunk(inp.index, UNIT, done + size, tallies=filtered)
                    return
            text_bytes = rg.column(text_leaf).total_uncompressed_size if text_leaf is not None else size
            batch_rows = max(1, int(BATCH_BYTES * n // max(1, text_bytes)))
            for batch in pf.iter_batches(batch_size=batch_rows, row_groups=[g], columns=[cols.text_path]):
                m = batch.num_rows
                lo = max(0, first + head - row)
                if lo < m:
                    sub = batch.slice(lo) if lo else batch
                    at = row + lo - first
                    progress = lambda k, at=at: done + size * (at + k) // n  # noqa: E731
                    yield from cols.chunks(sub, row + lo, keep[at : at + m - lo], chunk_bytes, progress)
                row += m
        except errors as exc:
            if isinstance(exc, SourceError):
                raise
            yield _unreadable(inp, row, f"cannot read row group {g}", exc, count=first + n - row)


# ----------------------------------------------------------------------------------------------
# Arrow IPC.


def _open_ipc(inp: InputFile):
    """(file object, reader, random access?) for an Arrow IPC file (or Feather v2), else a stream."""
    pa, _ = _pa()
    if inp.path == STDIN:
        raise SourceError("stdin cannot be read as Arrow here; write it to a file")
    source = pa.memory_map(inp.path) if _local(inp.path) else open_seekable(inp.path, inp.size, inp.version)
    try:
        check_unchanged(inp, source)
        try:
            return source, pa.ipc.open_file(source), True
        except pa.ArrowInvalid:
            source.seek(0)
            return source, pa.ipc.open_stream(source), False
    except BaseException:
        source.close()
        raise


def _local(path: str) -> bool:
    return "://" not in path


class ArrowReader:
    """Arrow IPC files (and Feather v2): record batches are the unit of work and of --resume.
    IPC streams are read from the start, as one unit."""

    def units(self, inp: InputFile, opts: ParseOptions) -> Units | None:
        try:
            source, reader, random_access = _open_ipc(inp)
        except _arrow_errors():
            return None
        try:
            if not random_access:
                return None
            n = reader.num_record_batches
            return Units("batches", [inp.size * j // max(1, n) for j in range(n)])
        finally:
            source.close()

    def chunks(self, part: Part, opts: ParseOptions, chunk_bytes: int, start_line: int) -> Iterator[RecordChunk]:
        return OPEN_READS.track(self._chunks(part, opts, chunk_bytes, start_line))

    def _chunks(self, part: Part, opts: ParseOptions, chunk_bytes: int, start_line: int) -> Iterator[RecordChunk]:
        inp = part.input
        try:
            source, reader, random_access = _open_ipc(inp)
        except SourceError:
            raise
        except _arrow_errors() as exc:
            yield _unreadable(inp, 0, "not a readable Arrow file", exc)
            return
        try:
            cols = Columns(inp, reader.schema, opts)
            if random_access:
                batches = self._file_batches(reader, part, inp.size)
            else:
                batches = self._stream_batches(reader, source)
            row = 1
            problem_rows = []
            errors = _arrow_errors()
            try:
                for batch, take, progress in batches:
                    m = batch.num_rows
                    if not take:
                        pass
                    elif cols.problem:
                        problem_rows.append((row, m))
                    elif row + m > start_line and m:
                        lo = max(0, start_line - row)
                        sub = batch.slice(lo) if lo else batch
                        keep = cols.mask(sub, m - lo)
                        yield from cols.chunks(sub, row + lo, keep, chunk_bytes, lambda k, p=progress: p)
                    row += m
            except errors as exc:
                if isinstance(exc, SourceError):
                    raise
                yield _unreadable(inp, row, "cannot read a record batch", exc)
                return
            if cols.problem and problem_rows:
                yield cols.problem_chunk(0 if part.whole else problem_rows[0][0], sum(m for _, m in problem_rows))
        finally:
            close_input(inp, source)

    def _file_batches(self, reader, part: Part, size: int):
        """(batch, whether it is the part's, input bytes of the part read after it)."""
        total = reader.num_record_batches
        start, stop = (0, total) if part.whole else (part.start, min(part.stop, total))
        for j in range(stop):
            # a batch before the part is read for its row count only: rows count from the file's start
            yield reader.get_batch(j), j >= start, size * (j + 1) // total - size * start // total

    def _stream_batches(self, reader, source):
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                return
            yield batch, True, source.tell()
