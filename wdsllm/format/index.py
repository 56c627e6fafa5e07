"""The dataset index (index.json) and its side files: what a loader plans an epoch from without
opening a shard. An index is untrusted data: every name in it is checked before use, and every side
file is read through :func:`read_side_file`, which checks its size and sha256 against the index.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import xxhash

from ..errors import FormatError, UnfinishedError
from .group import CHECKSUM_NAME, GROUP_COLUMNS, GROUP_COLUMNS_V2, npy_array

FORMAT_NAME = "wdsllm"
FORMAT_VERSION = 4
#: Versions this code reads. Add a reader here, never drop one, when the version is bumped.
#: 1: no groups.npy (a reader then finds groups by reading the shard from its start).
#: 2: groups.npy without group sizes and checksums (content unchecked by the loader).
READABLE_VERSIONS = (1, 2, 3, 4)

INDEX_NAME = "index.json"
#: The most bytes an index.json may have: far above any index written (a large one keeps its shard
#: table in shards.npy), and read no further, so a hostile index cannot fill memory.
MAX_INDEX_BYTES = 64 << 20
#: Per-document token counts of a docs-mode dataset, in dataset order (uint32 .npy).
LENGTHS_NAME = "lengths.npy"
#: Where each group (tar sample) starts, per shard in shard order (int64 .npy, GROUP_COLUMNS per
#: group); version 2 on. Lets a reader start a shard at any group with a ranged read.
GROUPS_NAME = "groups.npy"
#: The tokenizer the dataset was packed with (its JSON text, as hashed in ``tokenizer.sha256``);
#: optional, named by the index's ``tokenizer_file`` (written by packs since format 3's second release).
TOKENIZER_NAME = "tokenizer.json"
#: The shard table of a large dataset (version 4, more than INLINE_SHARDS_MAX shards): SHARD_COLUMNS
#: int64 per shard, in shard order (1-D .npy). Smaller datasets keep the table in index.json.
SHARDS_NAME = "shards.npy"
#: Writers keep the shard table in index.json up to this many shards (readable, and cheap to
#: parse: 0.4 s at 40,000 shards), and move it to shards.npy beyond (10.5 s and 2 GiB at 1e6).
INLINE_SHARDS_MAX = 10_000
#: Columns of shards.npy: the counts of a ShardEntry, then its sha256 as four int64 words.
SHARD_COLUMNS = ("samples", "documents", "tokens", "bytes", "rows", "sha0", "sha1", "sha2", "sha3")
#: Side files carry the xxh3_64 of every chunk of this many bytes (version 4), so that a reader
#: checks the parts it reads, not a 4 GB file in every process.
CHUNK_BYTES = 1 << 22
#: Written first by a pack and removed after index.json: a directory holding it is unfinished.
JOURNAL_START = ".pack-start.json"
SHARD_PATTERN = "{prefix}-{number:06d}.tar"
SHARD_RE = re.compile(r"^(?P<prefix>[A-Za-z0-9_]+(?:[A-Za-z0-9_-]*[A-Za-z0-9_])?)-(?P<number>\d{6,})\.tar$")
MODES = ("docs", "packed")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab <= 65,536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def shard_name(prefix: str, number: int) -> str:
    return SHARD_PATTERN.format(prefix=prefix, number=number)


def chunk_digest(data: bytes | memoryview) -> str:
    """The digest of one chunk of a side file: xxh3_64, 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


@dataclass(frozen=True)
class SideFile:
    """A file beside index.json that the index vouches for (lengths.npy, groups.npy, shards.npy):
    by size and sha256, and (version 4) by the xxh3_64 of every ``chunk_bytes`` bytes, so that a
    reader can check just the parts it reads."""

    name: str
    bytes: int
    sha256: str
    chunks: tuple[str, ...] = field(default=(), compare=False)
    chunk_bytes: int = CHUNK_BYTES

    @classmethod
    def of(cls, name: str, data: bytes) -> SideFile:
        """The reference an index stores for ``data`` written under ``name``."""
        view = memoryview(data)
        chunks = tuple(chunk_digest(view[a : a + CHUNK_BYTES]) for a in range(0, len(data), CHUNK_BYTES))
        return cls(name, len(data), hashlib.sha256(data).hexdigest(), chunks)

    @classmethod
    def of_file(cls, name: str, path: str) -> SideFile:
        """The reference for a file already written (read back a chunk at a time: a side file of
        any size is described in bounded memory)."""
        sha, chunks, size = hashlib.sha256(), [], 0
        with open(path, "rb") as f:
            while data := f.read(CHUNK_BYTES):
                sha.update(data)
                chunks.append(chunk_digest(data))
                size += len(data)
        return cls(name, size, sha.hexdigest(), tuple(chunks))

    @classmethod
    def from_json(cls, body: Any, where: str) -> SideFile | None:
        if body is None:
            return None
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise FormatError(f"{where}: a side file reference must be an object with a name, not {body!r:.80}")
        size, sha = body.get("bytes"), body.get("sha256")
        if not isinstance(size, int) or size < 0 or not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise FormatError(f"{where}: the reference to {body['name']!r} needs its size in bytes and a sha256")
        chunks, chunk_bytes = body.get("chunks") or [], body.get("chunk_bytes", CHUNK_BYTES)
        if chunks and (
            not _count(chunk_bytes)
            or chunk_bytes == 0
            or not isinstance(chunks, list)
            or len(chunks) != -(-size // chunk_bytes)
            or not all(isinstance(c, str) and re.fullmatch(r"[0-9a-f]{16}", c) for c in chunks)
        ):
            raise FormatError(f"{where}: the chunk digests of {body['name']!r} do not cover its {size} bytes")
        return cls(check_shard_name(body["name"], where), size, sha, tuple(chunks), chunk_bytes)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "bytes": self.bytes, "sha256": self.sha256}
        if self.chunks:
            out["chunk_bytes"] = self.chunk_bytes
            out["chunks"] = list(self.chunks)
        return out

    def check(self, data: bytes, where: str) -> bytes:
        """``data`` if it is what the index vouches for, else a FormatError naming the file."""
        if len(data) != self.bytes:
            raise FormatError(f"{where}: {len(data)} bytes, index.json says {self.bytes}")
        if hashlib.sha256(data).hexdigest() != self.sha256:
            raise FormatError(f"{where} does not match its checksum in index.json")
        return data

    def check_chunks(self, data: bytes, where: str) -> bytes:
        """``check`` by the chunk digests where the index has them (as a large side file is
        checked as it is read: every chunk, at a fraction of sha256's cost), else by sha256."""
        if not self.chunks:
            return self.check(data, where)
        if len(data) != self.bytes:
            raise FormatError(f"{where}: {len(data)} bytes, index.json says {self.bytes}")
        view = memoryview(data)
        for c, digest in enumerate(self.chunks):
            if chunk_digest(view[c * self.chunk_bytes : (c + 1) * self.chunk_bytes]) != digest:
                raise FormatError(f"{where} does not match its checksum in index.json (chunk {c})")
        return data


def check_finished(root: str, *, retry: Any = None) -> None:
    """Refuse a dataset directory whose pack never finished (UnfinishedError), naming what to run."""
    from .. import storage

    try:
        unfinished = storage.exists(storage.join_url(root, JOURNAL_START), retry=retry)
    except storage.StorageError:
        return  # cannot tell (e.g. pipe:); the caller reports the missing index
    if unfinished:
        raise UnfinishedError(
            f"{root} holds an unfinished pack ({JOURNAL_START} is there, {INDEX_NAME} is not): finish it by running "
            "the same `wdsllm pack ... -o ...` command with --resume, then load it"
        )


def read_side_bytes(root: str, ref: SideFile, *, retry: Any = None) -> bytes:
    """The side file's bytes, read from the dataset root and checked against the index."""
    from .. import storage

    url = storage.join_url(root, ref.name)
    return ref.check(storage.read_bytes(url, retry=retry), url)


def read_side_file(root: str, ref: SideFile, *, retry: Any = None) -> np.ndarray:
    """The side file's array, read from the dataset root and checked against the index."""
    from .. import storage

    return npy_array(read_side_bytes(root, ref, retry=retry), storage.join_url(root, ref.name))


def read_tokenizer_json(root: str, index: Index, *, retry: Any = None) -> str | None:
    """The JSON text of the tokenizer the dataset carries (checked), or None if it carries none."""
    if index.tokenizer_file is None:
        return None
    return read_side_bytes(root, index.tokenizer_file, retry=retry).decode("utf-8")


@dataclass
class TokenizerInfo:
    source: str
    sha256: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None = None


@dataclass
class ShardEntry:
    name: str
    samples: int  # tar samples (groups)
    documents: int  # docs mode: documents (pieces count); packed: documents that start here
    tokens: int
    bytes: int
    sha256: str
    rows: int = 0  # packed mode: rows of seq_len (the last row of a shard may be short)


class ShardTable(Sequence):
    """The index's shards as int64 columns (``SHARD_COLUMNS``), read as a sequence of ShardEntry.

    Loaders ask for whole columns (``column``), never for a million ShardEntry objects; a table
    from shards.npy names its shards by position (``PREFIX-%06d.tar``, a format invariant), so no
    name is stored or built until asked for.
    """

    def __init__(self, columns: np.ndarray | None, names: Sequence[str] | None = None, prefix: str | None = None):
        self._columns = (
            None if columns is None else _frozen(np.asarray(columns, np.int64).reshape(-1, len(SHARD_COLUMNS)))
        )
        self._names = list(names) if names is not None else None
        self._entries: list[ShardEntry] | None = None
        self._totals: dict[str, int] = {}
        self.prefix = prefix
        if (self._names is None) == (prefix is None):
            raise ValueError("a shard table takes names or a prefix")

    @classmethod
    def of(cls, entries: Sequence[ShardEntry]) -> ShardTable:
        """A table of entries (as index.json lists them; their columns are made when first asked
        for, after the index checked the entries)."""
        if isinstance(entries, ShardTable):
            return entries
        table = cls(None, names=[e.name for e in entries])
        table._entries = list(entries)
        return table

    @property
    def columns(self) -> np.ndarray:
        """[shards, SHARD_COLUMNS] int64."""
        if self._columns is None:
            columns = np.zeros((len(self._entries), len(SHARD_COLUMNS)), np.int64)
            for i, e in enumerate(self._entries):
                columns[i, :5] = (e.samples, e.documents, e.tokens, e.bytes, e.rows)
                columns[i, 5:] = _sha_words(e.sha256, strict=False)
            self._columns = _frozen(columns)
        return self._columns

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, prefix: str, where: str) -> ShardTable:
        from .group import npy_array

        flat = npy_array(data, where)
        if flat.dtype != np.int64 or len(flat) % len(SHARD_COLUMNS):
            raise FormatError(f"{where}: a shard table holds {len(SHARD_COLUMNS)} int64 per shard")
        return cls(flat.reshape(-1, len(SHARD_COLUMNS)), prefix=prefix)

    def to_bytes(self) -> bytes:
        from .group import npy_bytes

        if self._entries is not None:
            for e in self._entries:
                _sha_words(e.sha256)
        return npy_bytes(self.columns.reshape(-1))

    def column(self, name: str) -> np.ndarray:
        """One count per shard (samples, documents, tokens, bytes, rows), int64."""
        return self.columns[:, SHARD_COLUMNS.index(name)]

    def total(self, name: str) -> int:
        """A column's sum (kept: a table's counts do not change once it is made)."""
        if name not in self._totals:
            self._totals[name] = int(self.column(name).sum())
        return self._totals[name]

    def name(self, i: int) -> str:
        return self._names[i] if self._names is not None else shard_name(self.prefix, i)

    def position(self, name: str) -> int | None:
        """The shard's position in the table, or None when it is not one of them."""
        if self._names is not None:
            if not hasattr(self, "_positions"):
                self._positions = {n: i for i, n in enumerate(self._names)}
            return self._positions.get(name)
        m = SHARD_RE.match(name)
        if m is None or m.group("prefix") != self.prefix:
            return None
        i = int(m.group("number"))
        return i if i < len(self) and shard_name(self.prefix, i) == name else None

    def __len__(self) -> int:
        return len(self._entries) if self._entries is not None else len(self._columns)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if self._entries is not None:
            return self._entries[i]
        i = range(len(self))[i]
        samples, documents, tokens, size, rows = (int(x) for x in self.columns[i, :5])
        sha = self.columns[i, 5:].astype("<i8").tobytes().hex()
        return ShardEntry(self.name(i), samples, documents, tokens, size, sha, rows)

    def __iter__(self) -> Iterator[ShardEntry]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"ShardTable({len(self)} shards)"


def _frozen(columns: np.ndarray) -> np.ndarray:
    """A read-only view: a table's counts do not change once it is made (its totals are kept, and
    planners keep what they worked out from its columns)."""
    view = columns.view()
    view.setflags(write=False)
    return view


def _sha_words(sha256: str, strict: bool = True) -> np.ndarray:
    """A sha256 as four int64 words (zeros for one that is not 64 hex digits, unless ``strict``)."""
    try:
        raw = bytes.fromhex(sha256) if isinstance(sha256, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != 32:
        if not strict:
            return np.zeros(4, np.int64)
        raise FormatError(f"a shard's sha256 must be 64 hex digits, not {sha256!r:.80}")
    return np.frombuffer(raw, "<i8")


@dataclass
class Index:
    """index.json: everything a loader needs to plan an epoch without opening a shard."""

    mode: str
    dtype: str
    seq_len: int | None
    tokenizer: TokenizerInfo
    shards: ShardTable  # a list of ShardEntry is accepted and made a table
    doc_lengths: dict[str, Any]
    options: dict[str, Any]
    inputs: list[dict[str, Any]]
    skipped: dict[str, Any]
    lengths_file: SideFile | None = None
    packed: dict[str, Any] | None = None  # packed mode: {"max_row_segments": k, "short_rows": n}
    groups_file: SideFile | None = None  # version 2 on
    tokenizer_file: SideFile | None = None  # tokenizer.json beside the index (optional)
    checksum: str | None = CHECKSUM_NAME  # version 3 on: the checksum of every group in groups.npy
    version: int = FORMAT_VERSION
    format: str = FORMAT_NAME
    created_by: str = ""
    shards_file: SideFile | None = None  # version 4 with a binary shard table: shards.npy

    def __post_init__(self) -> None:
        if not isinstance(self.shards, ShardTable):
            try:
                self.shards = ShardTable.of(list(self.shards))
            except FormatError as exc:
                raise FormatError(f"{INDEX_NAME}: {exc}") from None

    # -- derived ------------------------------------------------------------------------------
    @property
    def group_columns(self) -> int:
        """Columns per group in groups.npy (format 2 had no sizes and checksums)."""
        return GROUP_COLUMNS if self.version >= 3 else GROUP_COLUMNS_V2

    @property
    def checks_groups(self) -> bool:
        """Whether every group's bytes can be checked against a checksum the index vouches for."""
        return self.version >= 3 and self.groups_file is not None and self.checksum == CHECKSUM_NAME

    @property
    def samples(self) -> int:
        return self.shards.total("samples")

    @property
    def documents(self) -> int:
        return self.shards.total("documents")

    @property
    def tokens(self) -> int:
        return self.shards.total("tokens")

    @property
    def rows(self) -> int:
        return self.shards.total("rows")

    @property
    def items_per_shard(self) -> np.ndarray:
        """What the loader counts per shard: documents in docs mode, rows in packed mode."""
        return self.shards.column("rows" if self.mode == "packed" else "documents")

    def totals(self) -> dict[str, int]:
        out = {
            "shards": len(self.shards),
            "samples": self.samples,
            "documents": self.documents,
            "tokens": self.tokens,
            "bytes": self.shards.total("bytes"),
        }
        if self.mode == "packed":
            out["rows"] = self.rows
        return out

    def move_shard_table(self, limit: int = INLINE_SHARDS_MAX) -> list[tuple[str, bytes]]:
        """Move the shard table of a dataset of more than ``limit`` shards to shards.npy; returns
        (name, bytes) of the side files ``to_json`` then refers to, which a writer puts before
        index.json."""
        self.shards_file = None
        if self.version < 4 or len(self.shards) <= limit:
            return []
        first = SHARD_RE.match(self.shards.name(0))
        prefix = first.group("prefix") if first else None
        if prefix is None or any(self.shards.name(i) != shard_name(prefix, i) for i in range(len(self.shards))):
            return []  # names that do not follow PREFIX-%06d stay in index.json
        data = self.shards.to_bytes()
        self.shards_file = SideFile.of(SHARDS_NAME, data)
        self.shards = ShardTable(self.shards.columns, prefix=prefix)
        return [(SHARDS_NAME, data)]

    # -- serialisation ------------------------------------------------------------------------
    def to_json(self) -> str:
        body = {
            "format": self.format,
            "version": self.version,
            "created_by": self.created_by,
            "mode": self.mode,
            "dtype": self.dtype,
            "seq_len": self.seq_len,
            "tokenizer": asdict(self.tokenizer),
            "totals": self.totals(),
            "doc_lengths": self.doc_lengths,
            "lengths_file": self.lengths_file.to_json() if self.lengths_file else None,
            "groups_file": self.groups_file.to_json() if self.groups_file else None,
            **({"tokenizer_file": self.tokenizer_file.to_json()} if self.tokenizer_file else {}),
            "checksum": self.checksum,
            "packed": self.packed,
            "options": self.options,
            "inputs": self.inputs,
            "skipped": self.skipped,
        }
        if self.shards_file is not None:
            body["shards_file"] = self.shards_file.to_json()
            body["shard_prefix"] = self.shards.prefix
        else:
            body["shards"] = [asdict(s) for s in self.shards]
        return json.dumps(body, indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_json(
        cls,
        text: str | bytes,
        where: str = INDEX_NAME,
        *,
        check_totals: bool = True,
        shard_table: Callable[[SideFile], bytes] | None = None,
    ) -> Index:
        """The index, checked (``check_totals``: also against its own totals; ``wdsllm verify``
        reports a mismatch among the other problems instead). ``shard_table(ref)``: the bytes of
        shards.npy, checked against ``ref``, for an index whose shard table is there (see
        :func:`read_index`)."""
        body = parse_json(text, where)
        return cls.from_body(body, where, check_totals=check_totals, shard_table=shard_table)

    @classmethod
    def from_body(
        cls,
        body: Any,
        where: str = INDEX_NAME,
        *,
        check_totals: bool = True,
        shard_table: Callable[[SideFile], bytes] | None = None,
    ) -> Index:
        """The index from its parsed JSON (see ``from_json``)."""
        if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
            raise FormatError(
                f"{where}: not a wdsllm index (format field is "
                f"{body.get('format') if isinstance(body, dict) else None!r})"
            )
        version = body.get("version")
        if version not in READABLE_VERSIONS:
            raise FormatError(
                f"{where}: format version {version} is not readable by this wdsllm (reads "
                f"{list(READABLE_VERSIONS)}); upgrade wdsllm"
            )
        try:
            shards_file = SideFile.from_json(body.get("shards_file"), where) if version >= 4 else None
            if shards_file is not None:
                prefix = body.get("shard_prefix")
                if not isinstance(prefix, str) or not SHARD_RE.match(shard_name(prefix, 0)):
                    raise FormatError(f"{where}: shard_prefix must be a plain shard name prefix")
                if shard_table is None:
                    raise FormatError(f"{where}: its shard table is in {shards_file.name}: read it with read_index")
                shards = ShardTable.from_bytes(shard_table(shards_file), prefix, shards_file.name)
            else:
                shards = [ShardEntry(**s) for s in body["shards"]]
            checksum = body.get("checksum") if version >= 3 else None
            index = cls(
                mode=body["mode"],
                dtype=body["dtype"],
                seq_len=body.get("seq_len"),
                tokenizer=TokenizerInfo(**body["tokenizer"]),
                shards=shards,
                doc_lengths=body.get("doc_lengths", {}),
                options=body.get("options", {}),
                inputs=body.get("inputs", []),
                skipped=body.get("skipped", {}),
                lengths_file=SideFile.from_json(body.get("lengths_file"), where),
                groups_file=SideFile.from_json(body.get("groups_file"), where) if version >= 2 else None,
                tokenizer_file=SideFile.from_json(body.get("tokenizer_file"), where),
                packed=body.get("packed"),
                checksum=checksum,
                version=version,
                format=body["format"],
                created_by=body.get("created_by", ""),
                shards_file=shards_file,
            )
        except (KeyError, TypeError) as exc:
            raise FormatError(f"{where}: malformed index: {type(exc).__name__} {exc}") from exc
        index._check(body if check_totals else {}, where)
        return index

    def _check(self, body: dict, where: str) -> None:
        """The index is untrusted data: types, ranges and its own totals, before anything uses it."""
        if self.mode not in MODES:
            raise FormatError(f"{where}: unknown mode {self.mode!r:.40}")
        if self.dtype not in ("uint16", "uint32"):
            raise FormatError(f"{where}: token dtype must be uint16 or uint32, not {self.dtype!r:.40}")
        if self.version >= 3 and self.checksum != CHECKSUM_NAME:
            raise FormatError(
                f"{where}: group checksum {self.checksum!r:.40} is not known (this wdsllm checks {CHECKSUM_NAME})"
            )
        tok = self.tokenizer
        if not _count(tok.vocab_size) or tok.vocab_size == 0 or tok.vocab_size > 1 << 32:
            raise FormatError(f"{where}: tokenizer.vocab_size must be a positive integer")
        if tok.vocab_size > np.iinfo(self.dtype).max + 1:
            raise FormatError(f"{where}: dtype {self.dtype} cannot hold ids of a {tok.vocab_size:,}-token vocabulary")
        for name in ("bos_id", "eos_id", "pad_id"):
            value = getattr(tok, name)
            if value is not None and not (_count(value) and value < tok.vocab_size):
                raise FormatError(f"{where}: tokenizer.{name} must be an id below the vocabulary size, or null")
        if self.tokenizer_file is not None and self.tokenizer_file.sha256 != tok.sha256:
            raise FormatError(f"{where}: tokenizer_file's sha256 is not tokenizer.sha256: they name two tokenizers")
        if self.mode == "packed" and not (_count(self.seq_len) and self.seq_len > 0):
            raise FormatError(f"{where}: a packed dataset needs a positive seq_len")
        if self.shards_file is None:
            for i, s in enumerate(self.shards):
                check_shard_name(s.name, where)
                bad = [f for f in ("samples", "documents", "tokens", "bytes", "rows") if not _count(getattr(s, f))]
                if bad or not isinstance(s.sha256, str):
                    raise FormatError(
                        f"{where}: shard {i} ({s.name}): {', '.join(bad) or 'sha256'} must be "
                        "non-negative integers (sha256 a string)"
                    )
        elif len(self.shards) and int(self.shards.columns[:, :5].min()) < 0:
            bad = int(np.flatnonzero((self.shards.columns[:, :5] < 0).any(axis=1))[0])
            raise FormatError(f"{where}: shard {bad} ({self.shards.name(bad)}): counts must be non-negative")
        totals = body.get("totals")
        if isinstance(totals, dict):
            for key, value in self.totals().items():
                if key in totals and totals[key] != value:
                    raise FormatError(
                        f"{where}: totals.{key} is {totals[key]!r:.40}, the shard entries add up to {value:,}; "
                        "the index was edited or truncated"
                    )
        elif totals is not None:
            raise FormatError(f"{where}: totals must be an object")


def read_index_bytes(url: str, *, retry: Any = None) -> bytes:
    """The bytes of the index.json at ``url``, read no further than :data:`MAX_INDEX_BYTES`."""
    from .. import storage

    with storage.open_stream(url, retry=retry) as f:
        data = f.read(MAX_INDEX_BYTES + 1)
    if len(data) > MAX_INDEX_BYTES:
        raise FormatError(f"{storage.redact(url)}: more than {MAX_INDEX_BYTES} bytes, too large for an index")
    return data


def parse_json(data: str | bytes, where: str, max_bytes: int = MAX_INDEX_BYTES) -> Any:
    """JSON from a dataset or a state, bounded in size and nesting: a hostile file is a
    :class:`FormatError` naming ``where``, never a MemoryError or a RecursionError."""
    if len(data) > max_bytes:
        raise FormatError(f"{where}: {len(data)} bytes of JSON, more than the {max_bytes} allowed")
    try:
        return json.loads(data)
    except RecursionError:
        raise FormatError(f"{where}: JSON nested too deeply to be a wdsllm file") from None
    except ValueError as exc:
        raise FormatError(f"{where}: not JSON: {str(exc)[:200]}") from None


def read_index(
    root: str, *, retry: Any = None, check_totals: bool = True, data: bytes | None = None
) -> tuple[Index, dict]:
    """(the index of the dataset at ``root``, its parsed JSON), with its shard table wherever it
    is (index.json, or shards.npy checked against the index). ``data``: index.json already read."""
    from .. import storage

    url = storage.join_url(root, INDEX_NAME)
    if data is None:
        data = read_index_bytes(url, retry=retry)
    body = parse_json(data, url)

    def table(ref: SideFile) -> bytes:
        side = storage.join_url(root, ref.name)
        return ref.check_chunks(storage.read_bytes(side, retry=retry), side)

    return Index.from_body(body, url, check_totals=check_totals, shard_table=table), body


def _count(value: Any) -> bool:
    """A non-negative JSON integer (not a bool, not a float, not a string)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_shard_name(name: str, where: str = INDEX_NAME) -> str:
    """An index is untrusted data: its shard names must be plain relative file names."""
    if (
        not isinstance(name, str)
        or not name
        or "/" in name
        or "\\" in name
        or ":" in name
        or name in (".", "..")
        or name.startswith((".", "-", "|"))
        or any(ord(c) < 32 for c in name)
    ):
        raise FormatError(f"{where}: refusing shard name {name!r}: shard names must be plain relative file names")
    return name


def length_histogram(lengths: np.ndarray) -> dict[str, Any]:
    """Counts per power-of-two bucket [2^k, 2^(k+1)), plus summary statistics."""
    return LengthSummary().add(lengths).to_json()


class LengthSummary:
    """``length_histogram`` of lengths given a piece at a time: a writer of lengths.npy summarises
    a billion documents without holding them. Lengths below ``SMALL`` are counted per value (their
    percentiles are exact order statistics of those counts); the rare longer ones are kept."""

    SMALL = 1 << 20

    def __init__(self) -> None:
        self._small = np.zeros(0, np.int64)  # documents per length, lengths < SMALL
        self._large: list[np.ndarray] = []
        self.count = 0
        self.total = 0

    def add(self, lengths: np.ndarray) -> LengthSummary:
        values = np.asarray(lengths)
        if not len(values):
            return self
        if values.dtype.kind not in "iu":
            values = values.astype(np.int64)
        small = values if int(values.max()) < self.SMALL else values[values < self.SMALL]
        if len(small) < len(values):
            self._large.append(np.asarray(values[values >= self.SMALL], np.int64))
        counts = np.bincount(small)
        if len(counts) > len(self._small):
            self._small = np.concatenate([self._small, np.zeros(len(counts) - len(self._small), np.int64)])
        self._small[: len(counts)] += counts
        self.count += len(values)
        self.total += int(values.sum(dtype=np.int64))
        return self

    def _ordered(self, ranks: list[int]) -> list[int]:
        """The values at these 0-based ranks of the sorted lengths."""
        below = np.cumsum(self._small)
        large = np.sort(np.concatenate(self._large)) if self._large else np.zeros(0, np.int64)
        n_small = int(below[-1]) if len(below) else 0
        return [int(np.searchsorted(below, r, side="right")) if r < n_small else int(large[r - n_small]) for r in ranks]

    def _percentile(self, q: float) -> float:
        """np.percentile's default (linear) method, from the order statistics."""
        virtual = (self.count - 1) * np.true_divide(q, 100)
        lo = int(np.floor(virtual))
        gamma = np.float64(virtual - lo)
        a, b = (np.int64(v) for v in self._ordered([lo, min(lo + 1, self.count - 1)]))
        diff = b - a
        return float(b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma)

    def to_json(self) -> dict[str, Any]:
        if not self.count:
            return {"edges": [], "counts": [], "count": 0}
        large = np.concatenate(self._large) if self._large else np.zeros(0, np.int64)
        present = np.flatnonzero(self._small)
        low = int(present[0]) if len(present) else int(large.min())
        top = int(large.max()) if len(large) else int(present[-1])
        nb = max(1, top.bit_length())
        edges = [0] + [1 << k for k in range(nb + 1)]
        counts = [int(self._small[a:b].sum()) for a, b in itertools.pairwise(edges)]
        counts = (np.asarray(counts, np.int64) + np.histogram(large, bins=edges)[0]).tolist()
        return {
            "edges": edges,
            "counts": counts,
            "count": self.count,
            "min": low,
            "max": top,
            "mean": round(self.total / self.count, 3),
            "p50": self._percentile(50),
            "p90": self._percentile(90),
            "p99": self._percentile(99),
        }
