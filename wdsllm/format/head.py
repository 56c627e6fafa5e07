"""`wdsllm head`: the first documents (docs mode) or rows (packed mode) of a dataset, with their
identity (key and index within the sample) and provenance (input file and line), read in order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

from .. import format as fmt
from .. import storage
from ..format import tar as tario
from .shard import GroupRows, expect_of, read_checked, sequential_fetch, shard_tables


@dataclass
class Item:
    """One document (docs mode) or one row (packed mode), where it is and where it came from."""

    shard: str
    key: str
    index: int  # document (or row) number within the sample: the stable identity with the key
    tokens: np.ndarray
    input: str | None  # docs mode: the document's input; packed: of the row's first token
    line: int | None
    piece: int = 0
    segments: list[dict] = field(default_factory=list)  # packed: the documents in the row
    source_key: str | None = None  # the input sample's key (tar inputs)


def iter_items(root: str, index: fmt.Index) -> Iterator[Item]:
    """Documents or rows in dataset order, read shard by shard (lazily: stop whenever); every group
    checked against groups.npy when the dataset has checksums (format 3)."""
    paths = {i["index"]: i["path"] for i in index.inputs}
    carry: dict | None = None  # packed: the document that runs into the next row
    tables = None
    if index.checks_groups:
        flat = fmt.read_side_file(root, index.groups_file)
        tables = shard_tables(index, flat, storage.join_url(root, index.groups_file.name))
    for entry in index.shards:
        with storage.open_stream(storage.join_url(root, entry.name), expected_size=entry.bytes) as stream:
            for group in _groups(stream, entry, index, tables):
                files, lines, pieces = fmt.expand_provenance(
                    group.meta.get("provenance", []), group.documents, entry.name
                )
                keys = _source_keys(group.meta, group.documents)
                origins = [
                    {"input": paths.get(int(f), f"#{int(f)}"), "line": int(ln), "piece": int(p)}
                    | ({"key": keys[k]} if keys[k] is not None else {})
                    for k, (f, ln, p) in enumerate(zip(files, lines, pieces))
                ]
                if index.mode == "docs":
                    yield from _documents(entry.name, group, origins)
                else:
                    for item in _rows(entry.name, group, origins, index.seq_len, carry):
                        carry = item.segments[-1] if item.segments else carry
                        yield item


def _source_keys(meta: dict, documents: int) -> list[str | None]:
    """The documents' input sample keys (``source_keys``, tar inputs), None where there are none.
    The metadata comes from a shard, which may be a stranger's: anything malformed is ignored."""
    keys = meta.get("source_keys")
    if not isinstance(keys, list) or len(keys) != documents:
        return [None] * documents
    return [k[:200] if isinstance(k, str) else None for k in keys]


def _groups(stream: BinaryIO, entry: fmt.ShardEntry, index: fmt.Index, tables: dict | None) -> Iterator[fmt.Group]:
    if tables is None:  # no checksums (format 1 or 2): parsed as it streams
        for _, group in tario.iter_groups(stream, entry.name, end=entry.bytes):
            yield group
        return
    source = tario.mapped(stream) or stream
    table = tables[entry.name]
    items = entry.rows if index.mode == "packed" else entry.documents
    checked = read_checked(
        sequential_fetch(source),
        GroupRows(table),
        0,
        len(table),
        items_total=items,
        docs_total=entry.documents,
        expect=expect_of(index),
        where=entry.name,
    )
    for c in checked:
        yield c.group


def _documents(shard: str, group: fmt.Group, origins: list[dict]) -> Iterator[Item]:
    ends = np.cumsum(group.lengths.astype(np.int64))
    for i, (start, end) in enumerate(zip(np.concatenate([[0], ends[:-1]]), ends)):
        o = origins[i] if i < len(origins) else {"input": None, "line": None, "piece": 0}
        yield Item(
            shard, group.key, i, group.tokens[start:end], o["input"], o["line"], o["piece"], source_key=o.get("key")
        )


def _rows(shard: str, group: fmt.Group, origins: list[dict], seq_len: int, carry: dict | None) -> Iterator[Item]:
    starts = group.starts.astype(np.int64)
    for r in range(-(-len(group.tokens) // seq_len)):
        lo, hi = r * seq_len, min((r + 1) * seq_len, len(group.tokens))
        inside = [k for k in np.flatnonzero((starts >= lo) & (starts < hi))]
        segments = []
        if (not inside or starts[inside[0]] > lo) and carry is not None:  # the row opens inside an earlier document
            segments.append({**carry, "offset": 0, "continues": True})
        for k in inside:
            segments.append({**origins[k], "offset": int(starts[k] - lo), "continues": False})
        first = segments[0] if segments else {"input": None, "line": None, "piece": 0}
        yield Item(
            shard,
            group.key,
            r,
            group.tokens[lo:hi],
            first["input"],
            first["line"],
            first.get("piece", 0),
            segments,
            source_key=first.get("key"),
        )
        if segments:
            carry = {k: v for k, v in segments[-1].items() if k not in ("offset", "continues")}
