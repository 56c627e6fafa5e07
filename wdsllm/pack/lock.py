"""The output lock: one pack or merge writes a dataset directory at a time.

A second ``wdsllm pack`` (or ``--resume``, or ``--overwrite``) into a directory that a running pack
is writing would delete its temporary files under it; it is refused instead, naming the holder. A
local output is locked with ``flock`` on a control file inside it (released by the kernel when the
holder dies, however it dies). An object store has no locks: there the lock is an object holding
the holder and a heartbeat refreshed after every shard; one whose heartbeat is older than
``STALE_AFTER`` seconds, or whose holder was a process of this host that is gone (a pack killed,
then resumed), belongs to a pack that died, and is taken over.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time

from .. import storage
from ..errors import PackError
from ..storage.output import CONTROL_PREFIX

log = logging.getLogger(__name__)

LOCK_NAME = CONTROL_PREFIX + "lock"
#: seconds after which a remote lock whose heartbeat stopped is considered abandoned
STALE_AFTER = 600.0


def _dead_here(held: bytes) -> bool:
    """Whether the lock's holder ran on this host and is gone (killed): its lock is abandoned
    at once, without waiting for its heartbeat to go stale."""
    try:
        info = json.loads(held)
        pid, host = int(info["pid"]), info["host"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return False
    if host != socket.gethostname() or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


class OutputLock:
    """Held while a job writes ``out``; a context manager."""

    def __init__(self, out: storage.Output, what: str = "pack") -> None:
        self.out = out
        self.what = what
        self._fd: int | None = None
        self._held = False
        self._remote = not hasattr(out, "path")

    def _holder(self) -> bytes:
        return json.dumps(
            {"pid": os.getpid(), "host": socket.gethostname(), "job": self.what, "heartbeat": time.time()}
        ).encode()

    def _refuse(self, data: bytes | None) -> PackError:
        try:
            held = json.loads(data or b"{}")
        except ValueError:
            held = {}
        who = f"pid {held.get('pid', '?')} on {held.get('host', '?')}"
        return PackError(
            f"{self.out.url} is being written by another wdsllm {held.get('job', 'job')} ({who}); wait for it to "
            "finish, or stop it before packing into this directory again"
        )

    def acquire(self) -> OutputLock:
        if self._remote:
            held = self.out.get_bytes(LOCK_NAME)
            if held is not None:
                try:
                    holder = json.loads(held)
                    beat = float(holder.get("heartbeat", 0))
                except (ValueError, AttributeError, TypeError):
                    beat = 0.0
                if time.time() - beat < STALE_AFTER and not _dead_here(held):
                    raise self._refuse(held)
                log.warning(
                    "%s: taking over a lock whose holder stopped beating %.0f s ago", self.out.url, time.time() - beat
                )
            self.out.put_bytes(LOCK_NAME, self._holder())
            self._held = True
            return self
        path = os.path.join(self.out.local_staging_dir(), LOCK_NAME)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                held = os.pread(fd, 4096, 0)
                os.close(fd)
                raise self._refuse(held) from None
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # its holder removed it as we opened it: lock the file that is there now
        os.ftruncate(fd, 0)
        os.pwrite(fd, self._holder(), 0)
        self._fd = fd
        self._path = path
        self._held = True
        return self

    def refresh(self) -> None:
        """A heartbeat (remote outputs; a local lock needs none)."""
        if self._remote and self._held:
            self.out.put_bytes(LOCK_NAME, self._holder())

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        if self._remote:
            self.out.delete(LOCK_NAME)
            return
        if self._fd is not None:
            # removed while still locked: a waiter that opened it sees another inode there and retries
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
