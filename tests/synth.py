"""Small real datasets with chosen shard sizes, written in-process for property tests.

They are real wdsllm datasets (USTAR shards written by webdataset.TarWriter, an index.json and a
lengths.npy, read back by the real loader); only the token ids are synthetic, so that each
document's content tells which document it is: document g (dataset order) holds tokens
[g % 60000, ...] of a length drawn from a seeded generator.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import webdataset as wds

from wdsllm import format as fmt
from wdsllm.format import tar as tario


def doc_tokens(g: int, length: int) -> np.ndarray:
    return ((np.arange(length, dtype=np.int64) * 7 + g) % 60000).astype(np.uint16)


def write_dataset(
    out: str | os.PathLike,
    docs_per_shard: list[int],
    *,
    seed: int = 0,
    max_len: int = 40,
    group_docs: int = 5,
    mode: str = "docs",
    seq_len: int = 16,
    rows_per_group: int = 3,
    write_index: bool = True,
    version: int = fmt.FORMAT_VERSION,
    task: int = 0,
    options: dict | None = None,
) -> dict:
    """Write shards; return {"ids": composite item ids per shard, "lengths": ..., "tokens": {id: array}}.

    In packed mode ``docs_per_shard`` gives the number of *rows* per shard (the last shard may end
    with a short row). ``task`` qualifies the sample keys and ``options`` are the index's (a pack
    task's output, for ``wdsllm merge``).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    entries, all_lengths, tables = [], [], []
    expect: dict[int, np.ndarray] = {}
    g = 0
    if mode == "packed":
        total_rows = sum(docs_per_shard)
        stream_len = total_rows * seq_len - (seq_len // 3 if total_rows else 0)
        lengths = []
        while sum(lengths) < stream_len:
            lengths.append(int(rng.integers(1, max_len + 1)))
        lengths[-1] -= sum(lengths) - stream_len
        if lengths and lengths[-1] <= 0:
            lengths.pop()
        stream = (
            np.concatenate([doc_tokens(i, n) for i, n in enumerate(lengths)]) if lengths else np.zeros(0, np.uint16)
        )
        doc_starts = (
            np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if lengths else np.zeros(0, np.int64)
        )
        all_lengths = lengths
    offset = 0
    for s, n in enumerate(docs_per_shard):
        name = fmt.shard_name("shard", s)
        path = out / name
        tokens_total = docs_total = samples = 0
        with open(path, "wb") as f:
            tw = wds.TarWriter(
                f, user=tario.TAR_USER, group=tario.TAR_USER, mode=tario.TAR_MODE, encoder=False, mtime=0
            )
            if mode == "docs":
                lengths = rng.integers(1, max_len + 1, n)
                for gstart in range(0, n, group_docs):
                    ls = lengths[gstart : gstart + group_docs]
                    toks = np.concatenate([doc_tokens(g + i, int(n_tok)) for i, n_tok in enumerate(ls)])
                    for i, n_tok in enumerate(ls):
                        expect[(s << 32) | (gstart + i)] = doc_tokens(g + i, int(n_tok))
                    g += len(ls)
                    meta = {"documents": len(ls), "provenance": [[0, gstart + 1, len(ls)]]}
                    tw.write(fmt.encode_group(fmt.group_key(task, samples + 1000 * s), toks, lengths=ls, meta=meta))
                    samples += 1
                    tokens_total += len(toks)
                    docs_total += len(ls)
                all_lengths.extend(int(x) for x in lengths)
                rows = 0
            else:
                rows = n
                for r0 in range(0, n, rows_per_group):
                    r1 = min(n, r0 + rows_per_group)
                    a, b = offset + r0 * seq_len, min(offset + r1 * seq_len, len(stream))
                    toks = stream[a:b]
                    for r in range(r0, r1):
                        expect[(s << 32) | r] = stream[
                            offset + r * seq_len : min(offset + (r + 1) * seq_len, len(stream))
                        ]
                    starts = doc_starts[(doc_starts >= a) & (doc_starts < b)] - a
                    meta = {
                        "documents": len(starts),
                        "rows": r1 - r0,
                        "provenance": [[0, 1, len(starts)]] if len(starts) else [],
                    }
                    tw.write(fmt.encode_group(fmt.group_key(task, samples + 1000 * s), toks, starts=starts, meta=meta))
                    samples += 1
                    tokens_total += len(toks)
                    docs_total += len(starts)
                offset += n * seq_len
            tw.close()
        data = path.read_bytes()
        tables.append(group_rows(data, mode))
        entries.append(
            fmt.ShardEntry(
                name=name,
                samples=samples,
                documents=docs_total,
                tokens=tokens_total,
                bytes=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
                rows=rows,
            )
        )
    lengths_bytes = fmt.npy_bytes(np.asarray(all_lengths, dtype=np.uint32))
    if version < 3:  # format 2: offsets and counts only, no sizes or checksums
        tables = [t[:, : fmt.GROUP_COLUMNS_V2] for t in tables]
    groups_bytes = fmt.group_table_bytes(tables)
    if write_index:
        (out / fmt.LENGTHS_NAME).write_bytes(lengths_bytes)
        (out / fmt.GROUPS_NAME).write_bytes(groups_bytes)
        index = fmt.Index(
            mode=mode,
            dtype="uint16",
            seq_len=seq_len if mode == "packed" else None,
            tokenizer=fmt.TokenizerInfo(
                source="synthetic", sha256="0" * 64, vocab_size=60000, bos_id=None, eos_id=59999, pad_id=None
            ),
            shards=entries,
            doc_lengths=fmt.length_histogram(np.asarray(all_lengths)),
            options=dict(options or {}),
            inputs=[],
            skipped={},
            lengths_file=fmt.SideFile.of(fmt.LENGTHS_NAME, lengths_bytes),
            groups_file=fmt.SideFile.of(fmt.GROUPS_NAME, groups_bytes),
            checksum=fmt.CHECKSUM_NAME if version >= 3 else None,
            version=version,
            packed={"max_row_segments": seq_len, "short_rows": 1} if mode == "packed" else None,
        )
        (out / fmt.INDEX_NAME).write_text(index.to_json())
    info = {"expect": expect, "entries": entries}
    if mode == "packed":
        info["row_docs"] = _row_docs(docs_per_shard, seq_len, doc_starts, all_lengths)
    return info


def group_rows(data: bytes, mode: str) -> np.ndarray:
    """groups.npy rows of a shard written by another tar writer: where each sample starts, the
    items and documents before it, its bytes and their checksum."""
    rows, items, docs = [], 0, 0
    ends = [0]
    reader = tario.MappedReader(data)
    for _, offset, size in tario.iter_members(reader, "synth"):
        reader.seek(size, 1)  # the caller consumes each member's data
        ends.append(offset + tario.BLOCK + -(-size // tario.BLOCK) * tario.BLOCK)
    for raw in tario.iter_samples(tario.MappedReader(data), "synth"):
        rows.append([raw.offset, items, docs])
        items += raw.meta["rows"] if mode == "packed" else raw.meta["documents"]
        docs += raw.meta["documents"]
    starts = [r[0] for r in rows] + [ends[-1]]
    out = []
    for (offset, before, docs_before), end in zip(rows, starts[1:]):
        out.append([offset, before, docs_before, end - offset, fmt.group_checksum(data[offset:end])])
    return np.asarray(out, np.int64).reshape(-1, fmt.GROUP_COLUMNS)


def _row_docs(
    rows_per_shard: list[int], seq_len: int, doc_starts: np.ndarray, lengths: list[int]
) -> dict[int, list[int]]:
    """Ground truth of a packed dataset: row id -> ids of the documents its tokens belong to."""
    shard_offsets = np.concatenate([[0], np.cumsum(rows_per_shard)]) * seq_len
    doc_shard = np.searchsorted(shard_offsets, doc_starts, side="right") - 1
    doc_ids = [(int(s) << 32) | int(np.sum(doc_shard[:i] == s)) for i, s in enumerate(doc_shard)]
    doc_ends = doc_starts + np.asarray(lengths, np.int64)
    out = {}
    for s, n in enumerate(rows_per_shard):
        for r in range(n):
            a = int(shard_offsets[s]) + r * seq_len
            b = min(a + seq_len, int(doc_ends[-1]))
            if a >= b:
                continue
            out[(s << 32) | r] = [doc_ids[i] for i in np.flatnonzero((doc_starts < b) & (doc_ends > a))]
    return out


def all_ids(info: dict) -> set[int]:
    return set(info["expect"].keys())
