"""A pass that reads several blocks of one remote shard downloads the shard once: one spool,
a view of it per block (``storage/sharing.py``), the same items as ranged reads give."""

from __future__ import annotations

import numpy as np
import pytest
from pack_helpers import SHAKESPEARE, pack_api

import wdsllm
from wdsllm import storage
from wdsllm.load import plan, stream
from wdsllm.storage import RetryPolicy

FAST = RetryPolicy(attempts=5, base_delay=0.01, max_delay=0.05, timeout=2.0)
SAMPLE_TOKENS = 512


@pytest.fixture(autouse=True)
def fresh_storage():
    storage.reset()
    yield
    storage.reset()


def test_views_of_one_spool_read_the_object_once(http_server):
    data = np.random.default_rng(3).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    (http_server.root / "a.bin").write_bytes(data)
    item = (http_server.url_for("a.bin"), dict(expected_size=len(data), retry=FAST))
    views = storage.prefetch_iter([item] * 5, spool=True, ahead_bytes=1 << 20, shared={item[0]})
    seen = []
    for view in views:
        assert view.read() == data
        seen.append(view)
    assert len({id(v.mm) for v in seen}) == 1  # one buffer under every view
    assert http_server.count("/a.bin") == 1
    assert all(v.closed for v in seen) and seen[0].share.spool.closed  # the pass ended


def test_a_pass_that_stops_early_closes_the_shared_spool(http_server):
    data = bytes(range(256)) * 1000
    (http_server.root / "b.bin").write_bytes(data)
    item = (http_server.url_for("b.bin"), dict(expected_size=len(data), retry=FAST))
    views = storage.prefetch_iter([item] * 4, spool=True, ahead_bytes=1 << 20, shared={item[0]})
    first = next(views)
    assert first.read(10) == data[:10]
    views.close()
    assert first.closed and first.share.spool.closed and http_server.count("/b.bin") == 1


@pytest.fixture
def served(http_server, tmp_path, monkeypatch):
    """One shard of documents, cut into many blocks, served over HTTP."""
    text = tmp_path / "in.txt"
    text.write_bytes(SHAKESPEARE.read_bytes()[:200_000])
    pack_api([text], http_server.root / "ds", mode="docs", sample_tokens=SAMPLE_TOKENS)
    monkeypatch.setattr(plan, "MIN_BLOCK_TOKENS", SAMPLE_TOKENS)
    return http_server.url_for("ds"), http_server.root / "ds"


def epoch_rows(url: str) -> list[tuple[int, ...]]:
    loader = wdsllm.loader(url, batch_size=4, seed=5, max_len=64, retry=FAST, _in_process=True)
    loader.set_epoch(1)
    rows = [tuple(row.tolist()) for batch in loader for row in batch["input_ids"]]
    loader.close()
    return rows


def test_an_epoch_of_one_shard_gets_it_once_and_yields_what_ranged_reads_do(served, http_server, monkeypatch):
    url, local = served
    shared = epoch_rows(url)
    assert http_server.count("*.tar") == 1
    assert shared == epoch_rows(str(local))
    http_server.reset()
    monkeypatch.setattr(stream, "MAX_SHARED_SLICES", 0)  # a ranged read per block
    assert epoch_rows(url) == shared
    assert http_server.count("*.tar") > 8


def test_the_next_pass_adopts_a_shared_spool_it_reads_first(http_server):
    data = bytes(range(256)) * 2000
    (http_server.root / "c.bin").write_bytes(data)
    item = (http_server.url_for("c.bin"), dict(expected_size=len(data), retry=FAST))
    owner = storage.WarmKey("loader", 0)
    for _ in range(3):  # three passes, each warming the next: one download in all
        views = storage.prefetch_iter([item] * 3, spool=True, ahead_bytes=1 << 20, shared={item[0]}, owner=owner)
        got = []
        for view in views:
            if views.all_started:
                views.warm([item])
            got.append(bytes(view.read()))
        assert got == [data] * 3
    assert http_server.count("/c.bin") == 1
    storage.reset()  # what a closed loader releases


def test_epochs_of_one_small_shard_download_it_once_each_after_the_first(served, http_server):
    """The first pass does not warm the next (a fresh DataLoader worker ends with it); every later
    one hands its shared spool to the next, which reads the same shard."""
    url, local = served
    (shard,) = local.glob("*.tar")
    loader = wdsllm.loader(url, batch_size=4, seed=5, max_len=64, retry=FAST, _in_process=True)
    for epoch in range(4):
        loader.set_epoch(epoch)
        assert sum(len(batch["input_ids"]) for batch in loader)
    loader.close()
    assert http_server.ranges("*.tar") == [f"bytes=0-{shard.stat().st_size - 1}"] * 2


def test_every_epochs_blocks_share_the_spool_they_read(http_server, tmp_path, monkeypatch):
    """Groups kept from an earlier pass's spool are read again from this pass's one: a window of
    blocks then sits on one buffer (joined without a copy), and no old spool stays alive."""
    from wdsllm.format.tar import MappedReader
    from wdsllm.load import block as block_mod

    text = tmp_path / "in.txt"
    text.write_bytes(SHAKESPEARE.read_bytes()[:200_000])
    big = MappedReader.SMALL  # groups whose tokens are views of the spool, not small copies
    pack_api([text], http_server.root / "big", mode="docs", sample_tokens=big)
    monkeypatch.setattr(plan, "MIN_BLOCK_TOKENS", big)
    url = http_server.url_for("big")
    windows: list[bool] = []
    join = block_mod.concat_blocks

    def joined(blocks):
        windows.append(all(block_mod.same_buffer(b.tokens, blocks[0].tokens) for b in blocks))
        return join(blocks)

    monkeypatch.setattr(block_mod, "concat_blocks", joined)  # what block.windows joins with
    loader = wdsllm.loader(url, batch_size=4, seed=5, max_len=64, shuffle_buffer=64, retry=FAST, _in_process=True)
    for epoch in range(3):  # the first spool, a second one, then the second handed on
        loader.set_epoch(epoch)
        windows.clear()
        assert sum(len(batch["input_ids"]) for batch in loader)
        assert windows and all(windows), epoch
    loader.close()
