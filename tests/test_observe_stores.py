"""A throttled store, seen from the loader: the data wait rises, fetch is the largest stage, and
the store's requests, retries and 503s are counted exactly as the server served them."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from pack_helpers import cached
from synth import write_dataset

import wdsllm
from wdsllm import storage
from wdsllm.observe.stages import STAGES
from wdsllm.storage.counters import STORE_NAMES

pytestmark = pytest.mark.timeout(120)


def _data() -> Path:
    return cached("observe-stores", lambda d: write_dataset(d, [120, 90, 110, 100], seed=6) and d)


def _epoch(source: str, **options) -> dict[str, float]:
    with wdsllm.loader(source, batch_size=8, num_workers=2, seed=1, watchdog_s=None, **options) as loader:
        steps = sum(1 for _ in loader)
        metrics = loader.metrics()
    assert metrics["steps"] == steps
    return metrics


def test_a_throttled_store_shows_in_the_wait_the_stages_and_the_store(http_server):
    shutil.copytree(_data(), http_server.root / "ds")
    url = http_server.url_for("ds")
    store = url.split("/ds")[0]
    storage.reset_stats()
    fast = _epoch(url)
    http_server.reset()  # faults and log; the same files
    http_server.faults.add("*/shard-000002.tar", "status", status=503, times=2)  # the first matching fault applies
    http_server.faults.add("*.tar", "rate", bytes_per_s=40_000, times=None)
    storage.reset_stats()
    slow = _epoch(url)
    assert slow["data_wait_total_s"] > fast["data_wait_total_s"]
    stages = {stage: slow[f"stage_{stage}_s"] for stage in STAGES}
    assert max(stages, key=stages.get) == "fetch" == STAGES[int(slow["slowest_stage"])], stages
    served = http_server.log("*")
    key = f"store/{store}"
    assert slow[f"{key}/status_503"] == sum(r.status == 503 for r in served) == 2
    assert slow[f"{key}/retries"] == 2 and slow[f"{key}/status_429"] == 0 and slow[f"{key}/other_errors"] == 0
    assert slow[f"{key}/requests"] == len([r for r in served if r.method in ("GET", "HEAD")])
    assert slow[f"{key}/received_bytes"] > 0 and slow[f"{key}/bytes_per_s"] > 0
    assert slow[f"{key}/skipped_shards"] == 0
    waits = {w: slow[f"worker_{w}_wait_s"] for w in (0, 1)}
    assert slow["slowest_worker"] == max(waits, key=waits.get) and sum(waits.values()) <= slow["data_wait_total_s"]
    assert all(slow[f"worker_{w}_queue"] >= 0 and slow[f"worker_{w}_minor_faults"] >= 0 for w in (0, 1))


def test_fetch_time_counts_a_body_read_that_broke_and_the_wait_before_its_retry(http_server):
    """A body that stalls until the client's read times out, then a retry after a backoff: the
    stall and the backoff are both time spent on the store (``fetch_ns``), never read time; the
    whole read's wall time is fetch time within what the bytes themselves took to copy."""
    payload = http_server.root / "blob.bin"
    payload.write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    http_server.faults.add("*/blob.bin", "stall", bytes=100_000, seconds=3.0)
    policy = storage.RetryPolicy(attempts=3, base_delay=0.4, timeout=0.5)
    url = http_server.url_for("blob.bin")
    storage.reset_stats()
    began = time.perf_counter()
    assert storage.read_bytes(url, retry=policy) == payload.read_bytes()
    wall = time.perf_counter() - began
    counts = storage.store_stats()[url.split("/blob.bin")[0]]
    assert counts["retries"] == 1 and counts["requests"] == 2
    fetch = counts["fetch_ns"] / 1e9
    assert fetch >= 0.5 + 0.2, f"the stalled read (timeout 0.5 s) and the backoff (>= 0.2 s) count: {fetch:.3f} s"
    assert fetch <= wall and fetch >= 0.9 * wall, (fetch, wall)


def _expected_store_figures(skipped: dict[str, int]) -> dict[str, float]:
    """The stores' figures made afresh from ``storage.store_stats()``, as docs/observability.md
    defines them."""
    out: dict[str, float] = {}
    counted = storage.store_stats()
    for store in counted.keys() | skipped.keys():
        counts = counted.get(store, dict.fromkeys(STORE_NAMES, 0))
        out.update({f"store/{store}/{name}": float(n) for name, n in counts.items()})
        seconds = counts["fetch_ns"] / 1e9
        out[f"store/{store}/bytes_per_s"] = counts["received_bytes"] / seconds if seconds > 0 else 0.0
        out[f"store/{store}/skipped_shards"] = float(skipped.get(store, 0))
    return out


def test_metrics_follow_every_counter_and_report_between_two_calls():
    """``metrics()`` keeps each store's figures and the workers' stage sums between calls (a call
    must cost a few microseconds); whatever moved between two calls shows in the second, exactly:
    one store's counters, a store that appears, a skipped shard, ``reset_stats``, a worker's report."""
    from wdsllm.load.options import ObserveOptions
    from wdsllm.observe.observer import Observer
    from wdsllm.observe.report import WorkerReport
    from wdsllm.storage.counters import count_in

    storage.reset_stats()
    observer = Observer(ObserveOptions(watchdog_s=None))
    a, b = "https://a.example", "s3://bucket"

    def stores(metrics: dict[str, float]) -> dict[str, float]:
        return {k: v for k, v in metrics.items() if k.startswith("store/")}

    count_in(a, "requests", 3)
    count_in(b, "received_bytes", 1000)
    count_in(b, "fetch_ns", 10**9)
    assert stores(observer.metrics()) == _expected_store_figures({})
    count_in(b, "received_bytes", 500)  # one store moves between two calls
    second = observer.metrics()
    assert second[f"store/{b}/received_bytes"] == 1500.0 and second[f"store/{b}/bytes_per_s"] == 1500.0
    assert stores(second) == _expected_store_figures({}) and second[f"store/{a}/requests"] == 3.0
    count_in("gs://other", "retries")  # a store appears
    skipped = ["https://a.example/x/shard-1.tar", "http://gone.example/shard-2.tar"]  # one store counted nothing
    assert stores(observer.metrics(skipped)) == _expected_store_figures({a: 1, "http://gone.example": 1})
    assert stores(observer.metrics(skipped[:1])) == _expected_store_figures({a: 1})
    storage.reset_stats()  # every store forgotten: none of their figures stays
    assert stores(observer.metrics()) == {}
    count_in(b, "requests")
    assert stores(observer.metrics()) == _expected_store_figures({})

    before = observer.metrics()["stage_read_s"]
    observer.tally.add(WorkerReport(0, 1, {"read": 0.5, "batch": 0.25}, {}, (0, 0)))
    after = observer.metrics()
    assert after["stage_read_s"] == pytest.approx(before + 0.5, abs=1e-9) and after["worker_0_batch_s"] == 0.25
    observer.tally.add(WorkerReport(1, 1, {"read": 2.0}, {}, (0, 0)))
    last = observer.metrics()
    assert last["stage_read_s"] == pytest.approx(before + 2.5, abs=1e-9)
    assert STAGES[int(last["slowest_stage"])] == "read" and last["worker_1_batch_s"] == 0.0
    observer.tally.waited(2, 0.125)  # a worker waited for before it reported: its keys appear
    waited = observer.metrics()
    assert waited["worker_2_wait_s"] == 0.125 and waited["slowest_worker"] == 2.0 and "worker_2_batch_s" in waited
