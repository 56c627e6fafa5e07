"""Store speed is measured and kept per store (scheme, host): in one process, a fast store and a
slow one are paced each by its own measurement, against two real HTTP servers on 127.0.0.1, one
of them sending no faster than a far store would."""

from __future__ import annotations

import pytest
from remote_fixtures import HttpServer
from test_storage import FAST, payload

from wdsllm import storage
from wdsllm.storage import parallel


@pytest.fixture
def slow_server(tmp_path):
    server = HttpServer()
    server.root = tmp_path / "slow"
    server.root.mkdir()
    server.faults.add("*", "rate", times=None, bytes_per_s=250e3)
    yield server
    server.close()


def spool_of(server, name: str, data: bytes) -> storage.Spool:
    (server.root / name).write_bytes(data)
    url = server.url_for(name)

    def open_range(start: int, length: int):
        return storage.open_stream(
            url, offset=start, length=length, expected_size=len(data), retry=FAST, one_request=True
        )

    return storage.Spool(open_range, 0, len(data), name=url)


def read_whole(spool: storage.Spool) -> bytes:
    spool.wait(spool.end)
    data = bytes(spool.mm[: spool.end])
    spool.close()
    return data


@pytest.fixture
def paced(monkeypatch):
    storage.reset()  # no store measured yet
    monkeypatch.setattr(parallel, "BLOCK_SIZE", 200_000)
    monkeypatch.setattr(parallel, "SERIAL_BLOCK_SIZE", 8_000_000)
    monkeypatch.setattr(parallel, "SERIAL_RATE", 1e6)  # the slow server sends a quarter of that
    yield
    storage.reset()


def test_a_fast_store_and_a_slow_one_are_paced_separately(paced, http_server, slow_server):
    fast_data, slow_data = payload(5_000_000), payload(400_000, seed=1)
    # one mixture's first shards: both downloading at once
    fast, slow = spool_of(http_server, "a.bin", fast_data), spool_of(slow_server, "b.bin", slow_data)
    assert read_whole(fast) == fast_data and read_whole(slow) == slow_data
    queue = parallel.block_queue()
    fast_store, slow_store = parallel.store_of(http_server.url), parallel.store_of(slow_server.url)
    assert fast_store != slow_store
    assert queue.pace_of(fast_store).fast and queue.pace_of(fast_store).want == 1
    assert not queue.pace_of(slow_store).fast and queue.pace_of(slow_store).want == parallel.IN_FLIGHT
    # the slow store measured last: the fast one's next shard is still one large GET
    http_server.reset()
    assert read_whole(spool_of(http_server, "c.bin", fast_data)) == fast_data
    assert http_server.ranges("/c.bin") == ["bytes=0-4999999"]
    # and the slow one's next shard is read in blocks, several at a time
    again = spool_of(slow_server, "d.bin", slow_data)
    assert read_whole(again) == slow_data
    assert sorted(slow_server.ranges("/d.bin")) == ["bytes=0-199999", "bytes=200000-399999"]


def test_the_store_of_a_url():
    assert parallel.store_of("https://user:pw@Host.example:8443/ds/a.tar?sig=x") == ("https", "host.example:8443")
    assert parallel.store_of("s3://bucket/ds/a.tar") == ("s3", "bucket")
    assert parallel.store_of("hf://datasets/org/name@main/ds/a.tar") == ("hf", "datasets/org/name")
    assert parallel.store_of("/local/a.tar") == ("file", "")


def test_small_reads_of_a_fast_store_overlap_their_round_trips(paced, http_server):
    """A store measured fast reads a large object one block at a time; small objects (an epoch's
    blocks of a shard) are round trips, and IN_FLIGHT of them wait out theirs together."""
    data = payload(5_000_000)
    assert read_whole(spool_of(http_server, "big.bin", data)) == data
    queue = parallel.block_queue()
    assert queue.pace_of(parallel.store_of(http_server.url)).want == 1
    small = [payload(40_000, seed=i) for i in range(parallel.IN_FLIGHT)]
    http_server.faults.add("*/small-*", "delay", times=None, seconds=1.0)
    spools = [spool_of(http_server, f"small-{i}.bin", d) for i, d in enumerate(small)]
    assert [read_whole(s) for s in spools] == small
    # every request reached the server before the first was answered: one round trip, not four
    arrived = [r.time for r in http_server.log() if "/small-" in r.path]
    assert len(arrived) == parallel.IN_FLIGHT and max(arrived) - min(arrived) < 1.0
