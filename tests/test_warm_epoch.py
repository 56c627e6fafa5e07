"""Warming the next epoch: a process that reads epoch after epoch starts the next one's first
remote shards while the last ones of this one are read, and the next pass adopts them."""

from __future__ import annotations

import multiprocessing as mp
import shutil
import time

import numpy as np
import pytest
from synth import write_dataset

import wdsllm
from wdsllm import storage
from wdsllm.format import shard as shard_format
from wdsllm.storage import RetryPolicy, parking

FAST = RetryPolicy(attempts=5, base_delay=0.01, max_delay=0.05, timeout=2.0)
LOAD = dict(batch_size=8, seed=7, shuffle_buffer=64)


def payload(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def served_file(http_server, name: str, size: int, seed: int) -> tuple[str, dict, bytes]:
    data = payload(size, seed)
    (http_server.root / name).write_bytes(data)
    return http_server.url_for(name), dict(expected_size=size, retry=FAST), data


def read_all(items, then=()) -> list[bytes]:
    return [s.read() for s in storage.prefetch_iter(items, spool=True, ahead_bytes=1 << 20, then=then)]


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition()


@pytest.fixture(autouse=True)
def nothing_parked():
    storage.reset()
    yield
    storage.reset()


def test_the_next_pass_adopts_the_shards_the_last_one_warmed(http_server):
    a_url, a_kw, a = served_file(http_server, "a.bin", 300_000, 1)
    b_url, b_kw, b = served_file(http_server, "b.bin", 200_000, 2)
    assert read_all([(a_url, a_kw)], then=[(b_url, b_kw)]) == [a]
    assert parking.parked_count() == 1, "b was started while a was read"
    wait_for(lambda: http_server.count("/b.bin") == 1)
    http_server.reset()
    assert read_all([(b_url, b_kw), (a_url, a_kw)]) == [b, a]
    assert http_server.count("/b.bin") == 0 and http_server.count("/a.bin") == 1
    assert parking.parked_count() == 0


def test_what_the_next_pass_does_not_read_is_dropped_at_its_end(http_server):
    a_url, a_kw, a = served_file(http_server, "a.bin", 300_000, 1)
    b_url, b_kw, _ = served_file(http_server, "b.bin", 200_000, 2)
    read_all([(a_url, a_kw)], then=[(b_url, b_kw)])
    assert parking.parked_count() == 1
    other_kw = {**b_kw, "offset": 1000, "length": 5000}  # another range of b: not the warmed one
    assert read_all([(b_url, other_kw), (a_url, a_kw)]) == [payload(200_000, 2)[1000:6000], a]
    assert parking.parked_count() == 0


def test_warming_stays_within_the_bytes_ahead(http_server):
    a_url, a_kw, _ = served_file(http_server, "a.bin", 300_000, 1)
    then = [served_file(http_server, f"t{i}.bin", 400_000, 10 + i)[:2] for i in range(4)]
    read_all([(a_url, a_kw)], then=then)
    # 1 MiB ahead: two of 400 kB fit (at least one is started, whatever its size)
    assert parking.parked_count() == 2
    wait_for(lambda: http_server.count("/t1.bin") == 1)
    time.sleep(0.1)
    assert [http_server.count(f"/t{i}.bin") for i in range(4)] == [1, 1, 0, 0]


def _child_reads(url: str, kwargs: dict, queue) -> None:
    queue.put(read_all([(url, kwargs)])[0])


def test_a_forked_child_adopts_nothing_of_its_parent(http_server):
    a_url, a_kw, _ = served_file(http_server, "a.bin", 300_000, 1)
    b_url, b_kw, b = served_file(http_server, "b.bin", 200_000, 2)
    read_all([(a_url, a_kw)], then=[(b_url, b_kw)])
    wait_for(lambda: http_server.count("/b.bin") == 1)
    http_server.reset()
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_reads, args=(b_url, b_kw, queue))
    child.start()
    assert queue.get(timeout=30) == b
    child.join(30)
    assert http_server.count("/b.bin") == 1, "the child downloaded b itself"
    assert parking.parked_count() == 1, "the parent's warmed spool is still its own"


def _child_collects(queue) -> None:
    import gc

    gc.collect()  # the parent's parked streams, copied here, are not closed
    queue.put(parking.parked_count())


def test_a_forked_child_leaves_its_parents_fetch_process_memories_alone(http_server, monkeypatch):
    from wdsllm.storage import offload

    monkeypatch.setattr(offload, "KEEP", 1)  # one idle memory kept: a second given back drops the first
    a_url, a_kw, a = served_file(http_server, "a.bin", 300_000, 1)
    b_url, b_kw, b = served_file(http_server, "b.bin", 200_000, 2)
    c_url, c_kw, c = served_file(http_server, "c.bin", 250_000, 3)
    streams = storage.prefetch_iter(
        [(a_url, a_kw)], spool=True, ahead_bytes=4 << 20, offload=True, then=[(b_url, b_kw)]
    )
    assert [s.read() for s in streams] == [a]  # a's memory is now idle, b's holds b, parked
    parked = parking.PARKING.adopt(storage.WarmKey(), b_url, b_kw)
    parking.PARKING.park(storage.WarmKey(), b_url, b_kw, parked)
    parked.wait(parked.end)
    wait_for(lambda: not offload.SERVICE.busy())  # its download reported done: only the parking holds it
    del parked
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_collects, args=(queue,))
    child.start()
    assert queue.get(timeout=30) == 0
    child.join(30)
    # had the child closed its copy of b, it would have given b's memory back and dropped a's,
    # in the fetch process the parent shares with it
    got = [s.read() for s in storage.prefetch_iter([(b_url, b_kw), (c_url, c_kw)], spool=True, offload=True)]
    assert got == [b, c] and http_server.count("/b.bin") == 1


# ----------------------------------------------------------------------------------------------
# The loader


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    root = tmp_path_factory.mktemp("warm")
    write_dataset(root / "ds", [40, 25, 55, 30, 50], seed=3)
    return root / "ds"


@pytest.fixture
def served(synth, http_server, monkeypatch):
    """The dataset over HTTP, its groups never served from the process's recently checked ones
    (this dataset's are few enough to stay there from one epoch to the next)."""
    shutil.copytree(synth, http_server.root / "ds")
    monkeypatch.setattr(shard_format, "_recent", shard_format._RecentGroups(max_groups=0, edge_groups=0))
    return http_server.url_for("ds").rstrip("/")


def tokens(batches) -> list[bytes]:
    return [b["input_ids"].numpy().tobytes() + b["lengths"].numpy().tobytes() for b in batches]


def epochs_of(loader, epochs: list[int]) -> list[list[bytes]]:
    out = []
    for epoch in epochs:
        loader.set_epoch(epoch)
        out.append(tokens(loader))
    return out


def settles_at(http_server, expected) -> None:
    """The GETs of shards come to ``expected()`` and stay there."""
    wait_for(lambda: http_server.count("*.tar") == expected())
    time.sleep(0.3)
    assert http_server.count("*.tar") == expected()


@pytest.mark.parametrize("fetch_process", [True, False])
def test_a_loader_without_workers_warms_each_next_epoch_from_the_second_on(served, synth, http_server, fetch_process):
    loader = wdsllm.loader(served, retry=FAST, fetch_process=fetch_process, **LOAD)
    reference = wdsllm.loader(str(synth), **LOAD)
    shards = 5
    assert epochs_of(loader, [0]) == epochs_of(reference, [0])
    assert parking.parked_count() == 0, "one pass may be the only one: nothing is warmed after it"
    settles_at(http_server, lambda: shards)
    assert epochs_of(loader, [1]) == epochs_of(reference, [1])
    assert parking.parked_count() >= 1, "epoch 2's first shards, started already"
    settles_at(http_server, lambda: 2 * shards + parking.parked_count())
    assert epochs_of(loader, [2]) == epochs_of(reference, [2])
    # epoch 2 adopted what was warmed for it (no second GET), and warmed epoch 3's first shards
    settles_at(http_server, lambda: 3 * shards + parking.parked_count())


def test_a_pass_of_another_epoch_than_the_next_reads_the_right_shards(served, synth, http_server):
    loader = wdsllm.loader(served, retry=FAST, **LOAD)
    reference = wdsllm.loader(str(synth), **LOAD)
    assert epochs_of(loader, [0, 1, 7, 3]) == epochs_of(reference, [0, 1, 7, 3])
    assert parking.parked_count() <= 5


def test_fresh_dataloader_workers_warm_nothing(served, http_server):
    loader = wdsllm.loader(served, retry=FAST, num_workers=2, persistent_workers=False, **LOAD)
    counts = []
    for epoch in range(3):
        epochs_of(loader, [epoch])
        time.sleep(0.3)
        counts.append(http_server.count("*.tar"))
    assert counts == [counts[0], 2 * counts[0], 3 * counts[0]], "a worker that ends with its epoch starts no more"


@pytest.mark.parametrize("persistent", [True, None], ids=["asked", "default"])
def test_persistent_workers_warm_the_next_epoch(served, synth, http_server, persistent):
    loader = wdsllm.loader(served, retry=FAST, num_workers=2, persistent_workers=persistent, **LOAD)
    reference = wdsllm.loader(str(synth), num_workers=2, **LOAD)
    assert epochs_of(loader, [0]) == epochs_of(reference, [0])
    time.sleep(0.3)
    per_epoch = http_server.count("*.tar")
    assert epochs_of(loader, [1]) == epochs_of(reference, [1])
    wait_for(lambda: http_server.count("*.tar") > 2 * per_epoch)  # the workers started epoch 2's first shards
    assert epochs_of(loader, [2]) == epochs_of(reference, [2])


def test_a_pass_of_another_loader_in_between_leaves_the_warmed_shards_alone(served, synth, http_server):
    loader = wdsllm.loader(served, retry=FAST, **LOAD)
    evaluation = wdsllm.loader(served, retry=FAST, batch_size=4)
    reference = wdsllm.loader(str(synth), **LOAD)
    epochs_of(loader, [0, 1])
    warmed = parking.parked_count()
    assert warmed >= 1
    tokens(evaluation)
    assert parking.parked_count() == warmed
    settles_at(http_server, lambda: 15 + warmed)
    http_server.reset()
    assert epochs_of(loader, [2]) == epochs_of(reference, [2])
    settles_at(http_server, lambda: 5 - warmed + parking.parked_count())


def test_a_next_pass_that_cannot_be_planned_leaves_this_one_alone(http_server):
    a_url, a_kw, a = served_file(http_server, "a.bin", 300_000, 1)

    def following():
        raise ValueError("no such epoch")
        yield  # a generator, as read_plan_stream's is

    assert read_all([(a_url, a_kw)], then=following()) == [a]
    assert parking.parked_count() == 0


def test_workers_persist_by_default_over_remote_shards_only(served, synth):
    """Over a store, workers forked afresh each epoch would build their clients and connections
    again and could not start the next epoch; over local shards DataLoader's default stands."""
    assert wdsllm.loader(served, num_workers=2, **LOAD).persistent_workers
    assert not wdsllm.loader(served, num_workers=2, persistent_workers=False, **LOAD).persistent_workers
    assert not wdsllm.loader(served, **LOAD).persistent_workers  # no workers to keep
    assert not wdsllm.loader(str(synth), num_workers=2, **LOAD).persistent_workers
    assert wdsllm.loader(str(synth), num_workers=2, persistent_workers=True, **LOAD).persistent_workers
