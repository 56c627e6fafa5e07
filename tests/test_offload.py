"""The fetch process (storage/offload.py): remote shards downloaded by a spawned process into shared
memory, for a loader that decodes in the training process itself. Against the real HTTP server on
127.0.0.1: every byte in place, its errors, retries and log records back in this process, the
environment as it is now, its death, recycled memory, and the pacing of a spool's blocks."""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest
from synth import write_dataset
from test_storage import FAST, payload

import wdsllm
from wdsllm import storage
from wdsllm.errors import NotFoundError, StorageError
from wdsllm.storage import offload, parallel

pytestmark = pytest.mark.skipif(not offload.SUPPORTED, reason="the fetch process needs Linux (memfd, SCM_RIGHTS)")


@pytest.fixture(autouse=True)
def fresh_fetch_process(monkeypatch):
    """Each test starts its own fetch process, and stops it."""
    monkeypatch.delenv("WDSLLM_FETCH_PROCESS", raising=False)
    storage.reset()
    yield
    storage.reset()


def spool_of(server, name: str, data: bytes, offset: int = 0) -> offload.OffloadedSpool:
    (server.root / name).write_bytes(data)
    kwargs = dict(expected_size=len(data), retry=FAST)
    spool = offload.offloaded_spool(server.url_for(name), kwargs, offset, len(data))
    assert spool is not None
    return spool


def test_a_spool_arrives_whole_through_the_fetch_process(http_server, caplog):
    data = payload(3_000_000)
    http_server.faults.add("*/cut.bin", "drop_after", bytes=700_000)  # resumed where it broke
    before = storage.stats()["received_bytes"]
    with caplog.at_level(logging.INFO, logger="wdsllm"):
        spool = spool_of(http_server, "cut.bin", data, offset=1000)
        spool.wait(len(data))
        assert spool.available() == len(data)
        assert spool.mm[1000:] == data[1000:]
        assert spool.read(10) == data[1000:1010], "as a stream it reads in order from its offset"
        spool.close()
    pid = offload.running_pid()
    assert pid is not None and pid != os.getpid()
    # its counters are this process's: every byte once, plus the one resumed
    assert storage.stats()["received_bytes"] - before >= len(data) - 1000
    assert any("retry" in r.getMessage() or "resum" in r.getMessage() for r in caplog.records), (
        "its log records are handled here"
    )
    assert any(r.process == pid for r in caplog.records)


def test_its_errors_come_back_named(http_server):
    missing = offload.offloaded_spool(http_server.url_for("gone.bin"), dict(expected_size=10, retry=FAST), 0, 10)
    assert missing is not None
    with pytest.raises(NotFoundError, match="gone.bin.*404"):
        missing.wait(1)
    with pytest.raises(NotFoundError):
        missing.wait(1)  # again, the same answer
    missing.close()
    with pytest.raises(ValueError, match="closed"):
        missing.wait(1)
    short = payload(50_000)
    (http_server.root / "short.bin").write_bytes(short)
    longer = offload.offloaded_spool(
        http_server.url_for("short.bin"), dict(expected_size=60_000, retry=FAST), 0, 60_000
    )
    assert longer is not None
    with pytest.raises(StorageError, match="short.bin"):
        longer.wait(60_000)
    longer.close()


def test_the_environment_is_the_one_of_now(http_server, monkeypatch):
    data = payload(200_000)
    spool_of(http_server, "a.bin", data).wait(len(data))  # the fetch process runs from here on
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(name, "")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens there
    through_proxy = spool_of(http_server, "b.bin", data)
    with pytest.raises(StorageError, match="b.bin"):
        through_proxy.wait(1)
    through_proxy.close()
    monkeypatch.delenv("HTTP_PROXY")
    spool_of(http_server, "c.bin", data).wait(len(data))


def test_its_death_fails_its_spools_by_name_and_later_ones_download_here(http_server, tmp_path):
    data = payload(500_000)
    http_server.faults.add("*/stalled.bin", "stall", bytes=100_000, seconds=30)
    stalled = spool_of(http_server, "stalled.bin", data)
    stalled.wait(100_000)
    os.kill(offload.running_pid(), signal.SIGKILL)
    with pytest.raises(StorageError, match=r"stalled.bin.*fetch process \d+ exited"):
        stalled.wait(len(data))
    assert stalled.mm[:100_000] == data[:100_000], "what arrived stays readable"
    stalled.close()
    assert offload.offloaded_spool(http_server.url_for("stalled.bin"), {}, 0, len(data)) is None
    # a loader goes on reading in this process
    write_dataset(http_server.root / "ds", [12, 9], seed=3)
    local = [b["input_ids"].numpy().tobytes() for b in wdsllm.loader(str(http_server.root / "ds"), batch_size=4)]
    remote = [b["input_ids"].numpy().tobytes() for b in wdsllm.loader(http_server.url_for("ds"), batch_size=4)]
    assert remote == local


def test_a_loader_without_workers_uses_it_and_one_with_workers_does_not(http_server):
    write_dataset(http_server.root / "ds", [30, 12, 25], seed=4, mode="packed", seq_len=16)
    url = http_server.url_for("ds")

    def batches(**options) -> tuple[list[bytes], int | None]:
        """The batches, and the fetch process that ran while the loader was open."""
        with wdsllm.loader(url, batch_size=4, seed=1, **options) as loader:
            return [b["input_ids"].numpy().tobytes() for b in loader], offload.running_pid()

    expected = [
        b["input_ids"].numpy().tobytes() for b in wdsllm.loader(str(http_server.root / "ds"), batch_size=4, seed=1)
    ]
    assert batches(fetch_process=False) == (expected, None), "fetch_process=False reads in this process"
    with_workers = wdsllm.loader(str(http_server.root / "ds"), batch_size=4, seed=1, num_workers=2)
    expected_with_workers = [b["input_ids"].numpy().tobytes() for b in with_workers]
    assert batches(num_workers=2) == (expected_with_workers, None), "DataLoader workers read themselves"
    got, fetch_process = batches()
    assert got == expected and fetch_process is not None, "without workers, a fetch process downloads"
    assert offload.running_pid() is None, "and the loader's close() stopped it"


def test_a_forked_child_does_not_share_its_parents_fetch_process(http_server):
    data = payload(100_000)
    spool_of(http_server, "a.bin", data).wait(len(data))
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as pool:
        assert pool.apply(_has_fetcher) is False


def _has_fetcher() -> bool:
    return offload.running_pid() is not None


def test_shared_memory_is_recycled_once_nothing_writes_or_views_it(http_server):
    one, two = payload(400_000), payload(600_000, seed=1)
    first = spool_of(http_server, "one.bin", one)
    first.wait(len(one))
    tokens = np.frombuffer(first.mm, dtype=np.uint16, count=1000, offset=4000)  # a batch views it
    kept = tokens.copy()
    first.close()
    _wait_free(first)
    second = spool_of(http_server, "two.bin", two)
    second.wait(len(two))
    assert second._memory is not first._memory, "memory an array views is not handed out"
    assert (tokens == kept).all()
    second.close()
    _wait_free(second)
    del tokens
    gc.collect()
    third = spool_of(http_server, "two.bin", two)
    third.wait(len(two))
    assert third._memory in (first._memory, second._memory), "memory nothing views is reused"
    assert third.mm[:] == two, "resized to the object, every byte its own"
    third.close()


def test_a_store_that_sends_fast_after_a_slow_first_byte_is_read_in_larger_blocks_one_get_each(
    http_server, monkeypatch
):
    data = payload(5_000_000)
    (http_server.root / "big.bin").write_bytes(data)
    url = http_server.url_for("big.bin")
    storage.reset()  # no store measured yet
    monkeypatch.setattr(parallel, "BLOCK_SIZE", 1_000_000)
    monkeypatch.setattr(parallel, "SERIAL_BLOCK_SIZE", 2_500_000)
    monkeypatch.setattr(parallel, "SERIAL_RATE", 20e6)  # 4 MiB in the 0.4 s below would be slower
    http_server.faults.add("/big.bin", "delay", seconds=0.4)  # the first GET waits for its first byte

    def spool() -> storage.Spool:
        def open_range(start: int, length: int):
            return storage.open_stream(
                url, offset=start, length=length, expected_size=len(data), retry=FAST, one_request=True
            )

        return storage.Spool(open_range, 0, len(data), name=url)

    first = spool()
    first.wait(len(data))
    first.close()
    assert parallel.block_queue().pace_of(parallel.store_of(url)).fast, "the wait for the first byte is not the rate"
    assert sorted(int(r[6:].split("-")[0]) for r in http_server.ranges("/big.bin")) == [
        0,
        1_000_000,
        2_000_000,
        3_000_000,
        4_000_000,
    ]
    http_server.reset()
    second = spool()
    second.wait(len(data))
    assert second.mm[:] == data
    second.close()
    assert sorted(http_server.ranges("/big.bin")) == ["bytes=0-2499999", "bytes=2500000-4999999"]


def _wait_free(spool: offload.OffloadedSpool, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while spool._memory.written and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not spool._memory.written, "the fetch process says when it writes no more into a memory"


def test_a_closed_spool_stops_its_download_and_frees_its_memory(http_server):
    data = payload(800_000)
    http_server.faults.add("*/slow.bin", "stall", bytes=50_000, seconds=30)
    slow = spool_of(http_server, "slow.bin", data)
    slow.wait(50_000)
    slow.close()
    _wait_free(slow)


def test_spools_read_one_block_at_a_time_while_they_arrive_fast(http_server, monkeypatch):
    data = payload(5_000_000)  # known to be slow or fast after 4 MiB (or 50 ms)
    (http_server.root / "x.bin").write_bytes(data)
    url = http_server.url_for("x.bin")

    def spool() -> storage.Spool:
        def open_range(start: int, length: int):
            return storage.open_stream(url, offset=start, length=length, expected_size=len(data), retry=FAST)

        return storage.Spool(open_range, 0, len(data), name=url, block_size=400_000, in_flight=4)

    storage.reset()  # no store measured yet
    monkeypatch.setattr(parallel, "SERIAL_RATE", 1.0)  # every store is fast
    fast = spool()
    fast.wait(len(data))
    assert parallel.block_queue().pace_of(parallel.store_of(url)).want == 1 and fast.mm[:] == data
    fast.close()
    monkeypatch.setattr(parallel, "SERIAL_RATE", 1e15)  # every store is slow
    slow = spool()
    slow.wait(len(data))
    assert parallel.block_queue().pace_of(parallel.store_of(url)).want == parallel.IN_FLIGHT and slow.mm[:] == data
    slow.close()
