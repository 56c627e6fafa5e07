"""Process-global state: one owned object per concern with one fork hook and a public reset();
the library leaves the user's environment alone; the counts cache is bounded and evicted."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_storage import FAST, payload

import wdsllm
from wdsllm import storage
from wdsllm.load import counts as countsmod
from wdsllm.storage import offload, parking

PACKAGE = Path(wdsllm.__file__).parent


def test_one_fork_hook_in_the_whole_library():
    hooks = [
        f"{path.relative_to(PACKAGE)}:{n}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"register_at_fork\(", line)
    ]
    assert [hook.split(":")[0] for hook in hooks] == ["storage/state.py"], hooks


def test_reset_drops_every_concerns_state(http_server):
    data = payload(300_000)
    (http_server.root / "a.bin").write_bytes(data)
    (http_server.root / "b.bin").write_bytes(data[::-1])
    a = (http_server.url_for("a.bin"), dict(expected_size=len(data), retry=FAST))
    b = (http_server.url_for("b.bin"), dict(expected_size=len(data), retry=FAST))
    assert [s.read() for s in storage.prefetch_iter([a], spool=True, ahead_bytes=1 << 20, then=[b])] == [data]
    assert storage.stats()["requests"] > 0 and parking.parked_count() == 1
    if offload.SUPPORTED:
        spool = offload.offloaded_spool(*a, 0, len(data))
        spool.wait(len(data))
        spool.close()
        assert offload.running_pid() is not None
    storage.reset()
    assert set(storage.stats().values()) == {0}
    assert parking.parked_count() == 0
    assert offload.running_pid() is None
    deadline = time.monotonic() + 10
    while any(t.name.startswith("wdsllm-block") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("wdsllm-block")]
    assert storage.read_bytes(a[0], retry=FAST) == data, "and everything starts again on use"


IMPORTS = r"""
import json, os, sys
before = dict(os.environ)
import wdsllm, wdsllm.storage, wdsllm.storage.gcs, wdsllm.storage.offload, wdsllm.pack.tokenizer
try:
    import gcsfs.core
except ImportError:
    pass
print(json.dumps({k: v for k, v in os.environ.items() if before.get(k) != v}))
"""


def test_importing_the_library_changes_no_environment_variable():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GCSFS_", "TOKENIZERS_", "RAYON_"))}
    out = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}


def test_the_pack_tokenizer_settings_are_set_only_in_its_spawned_workers():
    from wdsllm.pack import tokenizer

    before = dict(os.environ)
    with pytest.raises(RuntimeError, match="spawned"):
        tokenizer.init_worker("unused.json", "uint16", None, None, None, 2, os.getpid())
    assert dict(os.environ) == before
    assert tokenizer.worker_environment(1) == {"TOKENIZERS_PARALLELISM": "false"}
    assert tokenizer.worker_environment(4) == {"TOKENIZERS_PARALLELISM": "true", "RAYON_NUM_THREADS": "4"}


def test_the_counts_cache_keeps_its_most_recently_used_tables_within_its_bounds(tmp_path, monkeypatch):
    monkeypatch.setattr(countsmod, "COUNTS_KEEP", 3)
    monkeypatch.setattr(countsmod, "COUNTS_KEEP_BYTES", 10_000)
    now = time.time()
    for n in range(6):
        table = tmp_path / f"counts-{n}.npy"
        table.write_bytes(b"x" * 1000)
        (tmp_path / f"counts-{n}.npy.lock").write_bytes(b"")
        os.utime(table, (now - 100 + n, now - 100 + n))  # 5 is the newest
    os.utime(tmp_path / "counts-0.npy", (now, now))  # 0 was just read (a hit touches its table)
    stale = tmp_path / "counts-9.npy.123.456.tmp"
    stale.write_bytes(b"half")
    os.utime(stale, (now - 7200, now - 7200))
    countsmod.evict_counts(str(tmp_path), keep=str(tmp_path / "counts-1.npy"))
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [
        "counts-0.npy",
        "counts-0.npy.lock",
        "counts-1.npy",  # kept: the table just written
        "counts-1.npy.lock",
        "counts-4.npy",
        "counts-4.npy.lock",
        "counts-5.npy",
        "counts-5.npy.lock",
    ]
    monkeypatch.setattr(countsmod, "COUNTS_KEEP", 100)
    monkeypatch.setattr(countsmod, "COUNTS_KEEP_BYTES", 2500)  # bytes bound: the two newest
    countsmod.evict_counts(str(tmp_path))
    assert sorted(p.name for p in tmp_path.glob("*.npy")) == ["counts-0.npy", "counts-5.npy"]
