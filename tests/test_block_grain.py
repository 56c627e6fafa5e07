"""An epoch's blocks are cut on group edges where groups hold MIN_BLOCK_TOKENS tokens (packed rows
at the default --sample-tokens): each group is then read, checked and decoded by one block, and a
remote block's ranged read does not fetch its neighbours' groups too."""

from __future__ import annotations

import numpy as np
import pytest
from pack_helpers import SHAKESPEARE, pack_api

import wdsllm
from wdsllm import format as fmt
from wdsllm.load import plan
from wdsllm.load.sources.open import open_source

SAMPLE_TOKENS = 512
SEQ_LEN = 64


@pytest.fixture
def packed(tmp_path, monkeypatch):
    """One shard of packed rows, 8 rows a group, blocks of the groups' size."""
    text = tmp_path / "in.txt"
    text.write_bytes(SHAKESPEARE.read_bytes()[:120_000])
    pack_api([text], tmp_path / "ds", mode="packed", seq_len=SEQ_LEN, sample_tokens=SAMPLE_TOKENS)
    monkeypatch.setattr(plan, "MIN_BLOCK_TOKENS", SAMPLE_TOKENS)
    return tmp_path / "ds"


def test_blocks_start_on_group_edges_and_cover_every_row_once(packed):
    source = open_source(str(packed))
    groups = source.group_table(0)
    edges = set(groups[:, fmt.ITEMS].tolist())
    assert len(edges) > 8
    for epoch in range(3):
        blocks = plan.epoch_blocks(source.items_per_shard, source.tokens_per_shard, 5, epoch, True)
        assert len(blocks.shards) > 8
        assert set(blocks.firsts.tolist()) <= edges
        rows = np.concatenate([np.arange(a, a + k) for a, k in zip(blocks.firsts, blocks.counts)])
        assert np.array_equal(np.sort(rows), np.arange(int(source.items_per_shard[0])))


def test_an_epoch_over_aligned_blocks_yields_every_row_once(packed):
    rows = int(open_source(str(packed)).items_per_shard[0])
    loader = wdsllm.loader(str(packed), batch_size=4, seed=5, _in_process=True)
    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        epochs.append([tuple(row.tolist()) for batch in loader for row in batch["input_ids"]])
    assert len(epochs[0]) == len(epochs[1]) == rows == len(set(epochs[0]))
    assert sorted(epochs[0]) == sorted(epochs[1]) and epochs[0] != epochs[1]


def test_a_group_that_two_blocks_share_is_checked_and_decoded_once(tmp_path, monkeypatch):
    """Documents' groups are cut by tokens, so blocks (cut by items) start and stop inside them:
    the block that reads a group's other part finds it among the edge groups checked before."""
    from wdsllm import storage
    from wdsllm.format import shard as shard_format

    text = tmp_path / "in.txt"
    text.write_bytes(SHAKESPEARE.read_bytes()[:120_000])
    pack_api([text], tmp_path / "ds", mode="docs", sample_tokens=SAMPLE_TOKENS)
    monkeypatch.setattr(plan, "MIN_BLOCK_TOKENS", SAMPLE_TOKENS)
    source = open_source(str(tmp_path / "ds"))
    groups = len(source.group_table(0))
    blocks = plan.epoch_blocks(source.items_per_shard, source.tokens_per_shard, 5, 1, True)
    edges = set(source.group_table(0)[:, fmt.ITEMS].tolist())
    assert groups > 16 and not set(blocks.firsts.tolist()) <= edges  # blocks start inside groups
    decoded = []
    decode = shard_format._decode_one
    monkeypatch.setattr(shard_format, "_decode_one", lambda *a: decoded.append(a[1]) or decode(*a))
    storage.reset()
    loader = wdsllm.loader(str(tmp_path / "ds"), batch_size=4, seed=5, _in_process=True)
    loader.set_epoch(1)
    documents = sum(len(batch["lengths"]) for batch in loader)
    assert documents == int(source.items_per_shard[0])
    assert sorted(decoded) == sorted(set(decoded)) and len(decoded) == groups


def test_a_pass_maps_a_local_shard_once_and_the_next_pass_sees_it_replaced(packed, monkeypatch):
    """A pass's blocks of one local shard share the mapping its first block found (one stat, not
    one per block); the pass after finds the file again, so a shard replaced meanwhile is read
    from its new file."""
    import os
    import shutil

    from wdsllm.format import tar as tario
    from wdsllm.load.read import ReadOptions, read_slice

    found = []
    real = tario.mapped_again
    monkeypatch.setattr(tario, "mapped_again", lambda *a: found.append(real(*a)) or found[-1])
    source = open_source(str(packed))
    blocks = plan.epoch_blocks(source.items_per_shard, source.tokens_per_shard, 5, 0, True)
    slices = [plan.Slice(int(s), int(f), int(f + n)) for s, f, n in zip(blocks.shards, blocks.firsts, blocks.counts)]

    def one_pass() -> list:
        held: dict = {}
        return [b for sl in slices for b in read_slice(source, sl, options=ReadOptions(), held=held)]

    one_pass()  # maps the shard: opened, then found mapped by the next block
    found.clear()
    first = one_pass()
    assert len(first) > 8
    assert len(found) == 1 and found[0] is not None  # one stat for all of the pass's blocks
    old_mapping = found[0].mm
    shard = next(packed.glob("*.tar"))
    shutil.copy(shard, shard.with_suffix(".new"))
    os.replace(shard.with_suffix(".new"), shard)  # the same bytes in a new file
    found.clear()
    again = one_pass()
    # the new file is not the mapping kept: the pass's first block opens it, the next find it mapped
    assert found[0] is None and len(found) == 2 and found[1].mm is not old_mapping
    assert [b.ids.tolist() for b in again] == [b.ids.tolist() for b in first]


def test_a_local_shards_groups_are_checked_once_per_process_until_the_file_changes(tmp_path, monkeypatch):
    """Groups of a mapped local file stay checked from one epoch to the next (their tokens are
    views of the page cache, not the process's memory), more of them than the last few read; a
    file rewritten in place is read and checked again."""
    import os

    from wdsllm import storage
    from wdsllm.format import shard as shard_format

    text = tmp_path / "in.txt"
    text.write_bytes(SHAKESPEARE.read_bytes()[:400_000])
    # groups of 4,096 tokens: payloads of 8 KiB, read as views of the mapping (not copied)
    pack_api([text], tmp_path / "ds", mode="packed", seq_len=SEQ_LEN, sample_tokens=4096)
    monkeypatch.setattr(plan, "MIN_BLOCK_TOKENS", 4096)  # blocks of whole groups: none is an edge
    groups = len(open_source(str(tmp_path / "ds")).group_table(0))
    assert groups > shard_format._recent.recent.max_groups
    decoded = []
    decode = shard_format._decode_one
    monkeypatch.setattr(shard_format, "_decode_one", lambda *a: decoded.append(a[1]) or decode(*a))
    storage.reset()
    loader = wdsllm.loader(str(tmp_path / "ds"), batch_size=4, seed=5)

    def decoded_in(epoch: int) -> int:
        loader.set_epoch(epoch)
        before = len(decoded)
        assert sum(len(batch["lengths"]) for batch in loader) > 0
        return len(decoded) - before

    assert [decoded_in(epoch) for epoch in range(3)] == [groups, 0, 0]
    shard = next((tmp_path / "ds").glob("*.tar"))
    data = shard.read_bytes()
    with open(shard, "r+b") as f:  # the same bytes written over the file, which keeps its inode
        f.write(data)
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert decoded_in(3) == groups


def test_the_group_rows_kept_are_bounded_by_their_groups(tmp_path, monkeypatch):
    from synth import write_dataset

    from wdsllm.load.sources import packed as packedmod

    write_dataset(tmp_path, [30, 12, 25, 20, 18], mode="packed", seq_len=16, seed=3)
    source = open_source(str(tmp_path))
    sizes = [len(source.group_rows(s)) for s in range(5)]
    assert all(sizes) and len(source._tables) == 5
    budget = sizes[3] + sizes[4]
    monkeypatch.setattr(packedmod, "GROUP_ROWS_KEPT", budget)
    source = open_source(str(tmp_path))
    for shard in range(5):
        rows = source.group_rows(shard)
        assert rows.rows == rows.array.tolist() and source.group_table(shard) is rows.array
        assert sum(len(t) for t in source._tables.values()) <= max(budget, len(rows))
    assert 4 in source._tables
