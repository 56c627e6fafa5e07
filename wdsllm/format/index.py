"""The dataset index (index.json) and its side files: what a loader plans an epoch from without
opening a shard. An index is untrusted data: every name in it is checked before use, and every side
file is read through :func:`read_side_file`, which checks its size and sha256 against the index.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..errors import FormatError, UnfinishedError
from .group import CHECKSUM_NAME, GROUP_COLUMNS, GROUP_COLUMNS_V2, npy_array

FORMAT_NAME = "wdsllm"
FORMAT_VERSION = 3
#: Versions this code reads. Add a reader here, never drop one, when the version is bumped.
#: 1: no groups.npy (a reader then finds groups by reading the shard from its start).
#: 2: groups.npy without group sizes and checksums (content unchecked by the loader).
READABLE_VERSIONS = (1, 2, 3)

INDEX_NAME = "index.json"
#: Per-document token counts of a docs-mode dataset, in dataset order (uint32 .npy).
LENGTHS_NAME = "lengths.npy"
#: Where each group (tar sample) starts, per shard in shard order (int64 .npy, GROUP_COLUMNS per
#: group); version 2 on. Lets a reader start a shard at any group with a ranged read.
GROUPS_NAME = "groups.npy"
#: The tokenizer the dataset was packed with (its JSON text, as hashed in ``tokenizer.sha256``);
#: optional, named by the index's ``tokenizer_file`` (written by packs since format 3's second release).
TOKENIZER_NAME = "tokenizer.json"
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


@dataclass(frozen=True)
class SideFile:
    """A file beside index.json that the index vouches for (lengths.npy, groups.npy)."""

    name: str
    bytes: int
    sha256: str

    @classmethod
    def of(cls, name: str, data: bytes) -> SideFile:
        """The reference an index stores for ``data`` written under ``name``."""
        return cls(name, len(data), hashlib.sha256(data).hexdigest())

    @classmethod
    def from_json(cls, body: Any, where: str) -> SideFile | None:
        if body is None:
            return None
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise FormatError(f"{where}: a side file reference must be an object with a name, not {body!r:.80}")
        size, sha = body.get("bytes"), body.get("sha256")
        if not isinstance(size, int) or size < 0 or not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise FormatError(f"{where}: the reference to {body['name']!r} needs its size in bytes and a sha256")
        return cls(check_shard_name(body["name"], where), size, sha)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def check(self, data: bytes, where: str) -> bytes:
        """``data`` if it is what the index vouches for, else a FormatError naming the file."""
        if len(data) != self.bytes:
            raise FormatError(f"{where}: {len(data)} bytes, index.json says {self.bytes}")
        if hashlib.sha256(data).hexdigest() != self.sha256:
            raise FormatError(f"{where} does not match its checksum in index.json")
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


@dataclass
class Index:
    """index.json: everything a loader needs to plan an epoch without opening a shard."""

    mode: str
    dtype: str
    seq_len: int | None
    tokenizer: TokenizerInfo
    shards: list[ShardEntry]
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
    def documents(self) -> int:
        return sum(s.documents for s in self.shards)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def items_per_shard(self) -> list[int]:
        """What the loader counts per shard: documents in docs mode, rows in packed mode."""
        return [s.rows if self.mode == "packed" else s.documents for s in self.shards]

    def totals(self) -> dict[str, int]:
        out = {
            "shards": len(self.shards),
            "samples": sum(s.samples for s in self.shards),
            "documents": self.documents,
            "tokens": self.tokens,
            "bytes": sum(s.bytes for s in self.shards),
        }
        if self.mode == "packed":
            out["rows"] = self.rows
        return out

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
            "shards": [asdict(s) for s in self.shards],
        }
        return json.dumps(body, indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, where: str = INDEX_NAME, *, check_totals: bool = True) -> Index:
        """The index, checked (``check_totals``: also against its own totals; ``wdsllm verify``
        reports a mismatch among the other problems instead)."""
        try:
            body = json.loads(text)
        except ValueError as exc:
            raise FormatError(f"{where}: not JSON: {exc}") from exc
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
        for i, s in enumerate(self.shards):
            check_shard_name(s.name, where)
            bad = [f for f in ("samples", "documents", "tokens", "bytes", "rows") if not _count(getattr(s, f))]
            if bad or not isinstance(s.sha256, str):
                raise FormatError(
                    f"{where}: shard {i} ({s.name}): {', '.join(bad) or 'sha256'} must be "
                    "non-negative integers (sha256 a string)"
                )
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
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return {"edges": [], "counts": [], "count": 0}
    top = int(lengths.max())
    nb = max(1, int(top).bit_length())
    edges = [0] + [1 << k for k in range(nb + 1)]
    counts, _ = np.histogram(lengths, bins=edges)
    qs = np.percentile(lengths, [50, 90, 99]).tolist()
    return {
        "edges": edges,
        "counts": counts.tolist(),
        "count": len(lengths),
        "min": int(lengths.min()),
        "max": top,
        "mean": round(float(lengths.mean()), 3),
        "p50": qs[0],
        "p90": qs[1],
        "p99": qs[2],
    }
