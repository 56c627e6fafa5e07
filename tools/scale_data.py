"""Synthetic datasets of any size from one real shard: what ``tools/bench_scale.py`` measures the
loader on (1e9 documents) and what ``tests/test_scale.py`` checks it on (hundreds of shards).

A docs-mode dataset of one shard is copied into N shards that are hardlinks of one file (a new
copy every MAX_LINKS links: ext4 allows 65,000 per inode), with a consistent index (the base's format):
``lengths.npy`` and ``groups.npy`` are the shard's own rows repeated N times, written a chunk at a
time (nothing of the dataset's size is ever in memory), every per-document count of the index is
scaled by N, and the shard table goes to ``shards.npy`` beyond ``table_limit`` shards, as a
writer does. The copies repeat the base shard's sample keys, which ``wdsllm verify`` reports; the
loader never looks at keys (a document's identity is its shard and ordinal).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import time

import numpy as np

from wdsllm import format as fmt

MAX_LINKS = 60_000
BUILD_VERSION = 2
MARKER = ".scale_data.json"


def _npy_header(dtype: np.dtype, count: int) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype.str, "fortran_order": False, "shape": (count,)})
    return buf.getvalue()


def write_repeated(path: str, unit: np.ndarray, times: int, chunk_bytes: int = 64 << 20) -> None:
    """``unit`` repeated ``times`` times as one 1-D .npy, written a chunk at a time."""
    per = max(1, chunk_bytes // max(1, unit.nbytes))
    block = np.tile(unit, per).tobytes()
    with open(path + ".tmp", "wb") as f:
        f.write(_npy_header(unit.dtype, len(unit) * times))
        done = 0
        while done < times:
            k = min(per, times - done)
            f.write(block if k == per else block[: k * unit.nbytes])
            done += k
    os.replace(path + ".tmp", path)


def build(base: str, out: str, shards: int, *, table_limit: int = fmt.INLINE_SHARDS_MAX) -> dict:
    """The dataset of ``shards`` copies of ``base``'s one shard at ``out`` (kept when a previous
    build of the same request is there); returns what was built and how long it took."""
    index, _ = fmt.read_index(base)
    if index.mode != "docs" or len(index.shards) != 1:
        raise ValueError(f"{base}: a docs-mode dataset of one shard is needed")
    entry = index.shards[0]
    want = {
        "version": BUILD_VERSION,
        "format": index.version,  # a dataset built for another format version is built again
        "shards": shards,
        "base_sha256": entry.sha256,
        "table_limit": table_limit,
    }
    marker = os.path.join(out, MARKER)
    if os.path.exists(marker) and os.path.exists(os.path.join(out, fmt.INDEX_NAME)):
        with open(marker) as f:
            info = json.load(f)
        if all(info.get(k) == v for k, v in want.items()):
            return dict(info, cached=True)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    t0 = time.perf_counter()
    names = [fmt.shard_name("shard", i) for i in range(shards)]
    source = os.path.join(base, entry.name)
    for i, name in enumerate(names):
        target = os.path.join(out, name)
        if i % MAX_LINKS == 0:
            shutil.copyfile(source, target)
            os.chmod(target, 0o444)
            first = target
        else:
            os.link(first, target)
    t_links = time.perf_counter() - t0

    t1 = time.perf_counter()
    lengths = fmt.read_side_file(base, index.lengths_file)
    groups = fmt.read_side_file(base, index.groups_file).astype(np.int64)
    write_repeated(os.path.join(out, fmt.LENGTHS_NAME), lengths.astype(np.uint32), shards)
    write_repeated(os.path.join(out, fmt.GROUPS_NAME), groups, shards)
    index.lengths_file = fmt.SideFile.of_file(fmt.LENGTHS_NAME, os.path.join(out, fmt.LENGTHS_NAME))
    index.groups_file = fmt.SideFile.of_file(fmt.GROUPS_NAME, os.path.join(out, fmt.GROUPS_NAME))
    t_side = time.perf_counter() - t1

    t2 = time.perf_counter()
    columns = np.tile(index.shards.columns[0], (shards, 1))
    index.shards = fmt.ShardTable(columns, names=names)
    hist = dict(index.doc_lengths)
    hist["counts"] = [c * shards for c in hist.get("counts", [])]
    hist["count"] = hist.get("count", 0) * shards
    index.doc_lengths = hist
    index.inputs = [dict(i, documents=i.get("documents", 0) * shards) for i in index.inputs]
    for name, data in index.move_shard_table(table_limit):
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    with open(os.path.join(out, fmt.INDEX_NAME + ".tmp"), "w") as f:
        f.write(index.to_json())
    os.replace(os.path.join(out, fmt.INDEX_NAME + ".tmp"), os.path.join(out, fmt.INDEX_NAME))
    t_index = time.perf_counter() - t2
    info = dict(
        want,
        documents=entry.documents * shards,
        tokens=entry.tokens * shards,
        lengths_bytes=index.lengths_file.bytes,
        groups_bytes=index.groups_file.bytes,
        index_bytes=os.path.getsize(os.path.join(out, fmt.INDEX_NAME)),
        build_s=round(time.perf_counter() - t0, 2),
        links_s=round(t_links, 2),
        side_files_s=round(t_side, 2),
        index_s=round(t_index, 2),
    )
    with open(marker, "w") as f:
        json.dump(info, f)
    return info
