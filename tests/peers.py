"""A few real torch.distributed processes (gloo on 127.0.0.1) for a test, without torchrun.

Each process is forked from one forkserver per test session, which imported torch and wdsllm
once: a process starts in milliseconds instead of the seconds an interpreter takes to import
torch, and starts clean (the forkserver runs no threads, unlike the test process). Each runs
``case(rank, world, *args)`` (a function at the top level of an importable module: a test
module is) inside a process group with a short timeout, so that a collective that would hang
fails within seconds; its JSON-able report comes back per rank. A process that raises reports
the exception; one that exits without a report (``os._exit``: a peer that dies) reports nothing.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "wdsllm", "wdsllm.load.loader"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(case: Callable, rank: int, world: int, port: int, pg_timeout: float, out: str, args: tuple) -> None:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=pg_timeout)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timeout)
    try:
        report = case(rank, world, *args)
    except BaseException as exc:  # reported, as the test's assertion wants to read it
        report = {"crash": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    os._exit(0)  # no teardown that could wait on a peer that is gone


def run(world: int, case: Callable, *args: Any, timeout: float = 90, pg_timeout: float = 15) -> list[dict | None]:
    """Every rank's report of ``case`` run by ``world`` processes (None: the rank left none)."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="wdsllm-peers-") as out:
        procs = [
            _CONTEXT.Process(target=_child, args=(case, rank, world, port, pg_timeout, out, args))
            for rank in range(world)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.1, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():  # hung: the report says so by its absence
                proc.kill()
                proc.join()
        reports = []
        for rank in range(world):
            path = Path(out, f"rank{rank}.json")
            reports.append(json.loads(path.read_text()) if path.exists() else None)
    return reports


def outcome(fn: Callable[[], Any]) -> dict:
    """What ``fn()`` did on this rank: its error's type and message, or its value, and how long."""
    began = time.monotonic()
    try:
        value = fn()
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - began}
    return {"value": value, "seconds": time.monotonic() - began}
