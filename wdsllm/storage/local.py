"""Local files (read, and written atomically) and ``pipe:CMD`` (read only, user-typed URLs only)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from typing import Any, BinaryIO

from .backends import discard, register
from .output import Output, is_control
from .retry import make_error
from .urls import check_name, local_path


def open_regular(url: str, buffering: int = -1) -> BinaryIO:
    """A local file opened for reading, refused at once unless it is a regular file (symlinks to
    one included): a FIFO would block forever, ``/dev/zero`` never end, a directory is no shard."""
    path = local_path(url)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the open itself
    except FileNotFoundError:
        raise make_error(url, "no such file", missing=True) from None
    except IsADirectoryError:
        raise make_error(url, "is a directory, not a file") from None
    except OSError as exc:
        raise make_error(url, f"cannot open: {exc.strerror or exc}") from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "a device or socket"
            raise make_error(url, f"is {kind}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


class _FileBody:
    def __init__(self, url: str, start: int) -> None:
        self.file = open_regular(url, buffering=0)
        try:
            self.total = os.fstat(self.file.fileno()).st_size
            self.file.seek(start)
        except BaseException:
            self.file.close()
            raise
        self.etag = None

    def readinto(self, b: Any) -> int:
        return self.file.readinto(b)

    def close(self) -> None:
        self.file.close()


def _local_open(url: str, start: int) -> _FileBody:
    return _FileBody(url, start)


class _PipeBody:
    """stdout of ``sh -c CMD``; a non-zero exit status at the end of the output is an error."""

    def __init__(self, url: str, start: int) -> None:
        self.url = url
        self.proc = subprocess.Popen(url[len("pipe:") :], shell=True, stdout=subprocess.PIPE, bufsize=0)
        self.total = self.etag = None
        try:
            discard(url, self, start)
        except BaseException:
            self.close()
            raise

    def readinto(self, b: Any) -> int:
        n = self.proc.stdout.readinto(b)
        if not n and len(b):
            status = self.proc.wait()
            if status != 0:
                raise make_error(self.url, f"command exited with status {status}")
        return n

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # an early close: the consumer does not want the rest
        self.proc.stdout.close()
        self.proc.wait()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalOutput(Output):
    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url)
        self.path = os.path.abspath(local_path(url))

    def _target(self, name: str) -> str:
        return os.path.join(self.path, *check_name(name).split("/"))

    def is_empty(self) -> bool:
        try:
            with os.scandir(self.path) as it:
                return all(is_control(e.name) for e in it)
        except FileNotFoundError:
            return True

    def list_names(self) -> list[str]:
        names = []
        for root, _, files in os.walk(self.path):
            rel = os.path.relpath(root, self.path)
            for f in files:
                names.append(f if rel == "." else f"{rel.replace(os.sep, '/')}/{f}")
        return sorted(n for n in names if not is_control(n))

    def put_file(self, local_path: str, name: str) -> None:
        target = self._target(name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(local_path, "rb") as f:  # the rename must not outlive the data in a crash
            os.fsync(f.fileno())
        try:
            os.replace(local_path, target)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise make_error(target, f"cannot move {local_path} into place: {exc.strerror}") from exc
            tmp = f"{target}.tmp-{os.getpid()}-{threading.get_ident()}"
            shutil.copyfile(local_path, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, target)
            os.unlink(local_path)

    def put_bytes(self, name: str, data: bytes) -> None:
        target = self._target(name)
        directory = os.path.dirname(target)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        _fsync_dir(directory)

    def get_bytes(self, name: str) -> bytes | None:
        try:
            with open(self._target(name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._target(name))

    def local_staging_dir(self) -> str:
        os.makedirs(self.path, exist_ok=True)
        return self.path

    def clear(self) -> None:
        try:
            entries = list(os.scandir(self.path))
        except FileNotFoundError:
            return
        for entry in entries:
            if is_control(entry.name):
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)


class LocalBackend:
    schemes = ("file",)
    remote = False

    def open(self, url: str, start: int, end: int | None, timeout: float, etag: str | None) -> Any:
        return _local_open(url, start)

    def exists(self, url: str, timeout: float) -> bool:
        return os.path.exists(local_path(url))

    def output_class(self, url: str) -> type[Output]:
        return LocalOutput


class PipeBackend:
    schemes = ("pipe",)
    remote = False

    def open(self, url: str, start: int, end: int | None, timeout: float, etag: str | None) -> Any:
        return _PipeBody(url, start)

    def exists(self, url: str, timeout: float) -> bool:
        raise make_error(url, "cannot tell whether a pipe: URL exists")

    def output_class(self, url: str) -> type[Output]:
        raise make_error(url, "datasets are written to a local directory, s3://, gs:// or az://, not to pipe:")


register(LocalBackend())
register(PipeBackend())
