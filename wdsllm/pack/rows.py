"""What ties a cluster part to the rows it holds: a digest of its task's records, in order.

A part is named by its task's index (``part-NNNNN``), and an engine gives the same index to other
rows when a run is split otherwise (Ray's number of blocks follows the cluster's size; another
number of partitions or ranks). A part found by an attempt is therefore used only when it holds
exactly that attempt's records: a committed part's index records the digest and count of the
records it was packed from (``options.holds``), and each journal record the digest of the records
up to its cursor, so a resumed attempt checks the records it skips. Anything else is refused with
:func:`other_rows`, never reused and never replaced: the run that left it also left other parts,
holding some of these rows or missing others, and only the owner of the whole output can decide
to start again.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import PackError

#: the index option (of a part) that says what the part holds
HOLDS = "holds"
#: the journal record's field: the digest of the records up to its cursor
JOURNAL_FIELD = "records"


def record_bytes(record: Any) -> bytes:
    """A record as canonical JSON (sorted keys, ASCII: lone surrogates escaped, never refused);
    values JSON lacks (bytes, numpy scalars and arrays, mappings that are not dicts, sets) are
    written as plain values, anything else by its ``repr``."""
    try:
        text = json.dumps(record, sort_keys=True, separators=(",", ":"), default=_plain)
    except (TypeError, ValueError):  # keys of several types (not sortable), or a value that refers to itself
        text = repr(record)
    return text.encode("ascii", "backslashreplace")


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    return repr(value)


class RowsDigest:
    """sha256 over records in order, each with its length. The digest through each record added
    with ``keep`` stays known (:meth:`through`) until a later one is asked for, so that the journal
    can record it at any shard's cursor: cursors only grow."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self.records = 0
        self._through: deque[tuple[int, bytes]] = deque()  # (record, digest through it)

    def add(self, record: Any, keep: bool = True) -> None:
        data = record_bytes(record)
        self._sha.update(len(data).to_bytes(8, "little"))
        self._sha.update(data)
        self.records += 1
        if keep:
            self._through.append((self.records, self._sha.digest()))

    def through(self, record: int) -> str:
        """The digest of records 1 to ``record`` (kept, and not forgotten); forgets those before it."""
        while self._through and self._through[0][0] < record:
            self._through.popleft()
        if not self._through or self._through[0][0] != record:
            raise PackError(f"internal: the digest through record {record} is not known")
        return self._through[0][1].hex()

    def holds(self) -> dict:
        """What a part packed from the records added holds (its index's ``holds``)."""
        return {"records": self.records, "sha256": self._sha.hexdigest()}


def other_rows(url: str, out: str, found: Any, here: dict) -> PackError:
    """The refusal of a part found holding other input than the attempt's (see the module's doc)."""
    if not isinstance(found, dict):
        return PackError(
            f"{url} was packed by a wdsllm that did not record the rows a part holds, so whether it holds this "
            f"task's ({_describe(here)}) cannot be told; remove every part-*/ of {out} to pack them anew"
        )
    return PackError(
        f"{url} holds other input than this task's ({_describe(found)}; this task: {_describe(here)}). Parts are "
        "named by their task's index, so a run that split its input otherwise (another number of blocks, "
        "partitions or ranks), handed it over in another order, or read it before it changed left it; packing "
        "this task there would leave that run's other parts holding some of these rows, or missing others. "
        "Re-run with that run's split and order (Ray: the same override_num_blocks, and preserve_order=True), "
        f"or remove every part-*/ of {out} to pack them anew"
    )


def _describe(holds: dict) -> str:
    if "files" in holds:
        return f"files {holds['files']!r:.200}"
    return f"{holds.get('records')} records, sha256 {str(holds.get('sha256'))[:12]}"
