"""Storage: reading and writing datasets on local disks, http(s), s3, gs, az, hf and ``pipe:``.

Every store is one backend module behind one table (:mod:`.backends`), each a thin layer over
a maintained client (fsspec's HTTP filesystem, s3fs, gcsfs, adlfs, huggingface_hub); above them,
:mod:`.resumable` turns faults into either exactly an object's bytes or a named error,
:mod:`.cache` keeps verified local copies, :mod:`.prefetch` overlaps the next shard's latency,
and :mod:`.output` writes datasets atomically. A read may be pinned to the version a listing
gave (:mod:`.versions`): another version is a named error. This package moves bytes; it never
decodes them.

Process-global state (connection pools, clients, counters, measured store speeds, parked spools,
the fetch process) lives in one owned object per concern, registered with :mod:`.state`, which
has the one fork hook; :func:`reset` drops all of it. :func:`release` is what a loader's
``close()`` calls: what was started for it stops.
"""

from __future__ import annotations

from ..errors import NotFoundError, StorageError, TransientError
from . import azure as _azure  # noqa: F401 - registers az://, abfs://, abfss://
from . import gcs as _gcs  # noqa: F401 - registers gs://
from . import hf as _hf  # noqa: F401 - registers hf://
from . import http as _http  # noqa: F401 - registers http(s)://
from . import local as _local  # noqa: F401 - registers local paths, file:// and pipe:
from . import s3 as _s3  # noqa: F401 - registers s3://
from .backends import CHUNK_SIZE, backend_for, is_remote, prepare_workers
from .cache import ShardCache
from .counters import reset_stats, stats, store_stats
from .helpers import release
from .listing import ObjectInfo, glob_objects, has_magic, list_prefix, stat_object
from .output import Output
from .parking import WarmKey
from .prefetch import OpenSpec, Prefetcher, PrefetchOptions, ReadAhead, prefetch_iter
from .ranged import RangedFile, open_ranged
from .resumable import STREAM_BUFFER, exists, open_stream, read_bytes
from .retry import DEFAULT_RETRY, RetryPolicy
from .s3 import MULTIPART_THRESHOLD, s3_endpoint
from .spool import Spool, SpooledRange
from .state import reset
from .urls import (
    check_name,
    dirname_url,
    expand_urls,
    join_url,
    local_path,
    redact,
    redact_text,
    scheme_of,
    split_query,
)
from .versions import VersionChangedError

__all__ = [
    "CHUNK_SIZE",
    "DEFAULT_RETRY",
    "MULTIPART_THRESHOLD",
    "STREAM_BUFFER",
    "NotFoundError",
    "ObjectInfo",
    "OpenSpec",
    "Output",
    "PrefetchOptions",
    "Prefetcher",
    "RangedFile",
    "ReadAhead",
    "RetryPolicy",
    "ShardCache",
    "Spool",
    "SpooledRange",
    "StorageError",
    "TransientError",
    "VersionChangedError",
    "WarmKey",
    "backend_for",
    "check_name",
    "dirname_url",
    "exists",
    "expand_urls",
    "glob_objects",
    "has_magic",
    "is_remote",
    "join_url",
    "list_prefix",
    "local_path",
    "open_ranged",
    "open_stream",
    "prefetch_iter",
    "prepare_workers",
    "read_bytes",
    "redact",
    "redact_text",
    "release",
    "reset",
    "reset_stats",
    "s3_endpoint",
    "scheme_of",
    "split_query",
    "stat_object",
    "stats",
    "store_stats",
]
