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

A run that was refused may have written parts beside the old run's before the refusal (its other
tasks found no part at their index): the output then holds parts of two splits, and merging them
would pack documents twice. Where the engine names its runs (``PartOptions.run``: the Ray sink
does), each part records its run and the refused task leaves a record of the refusal in the
output (``_refused/run-RUN.json``); :func:`refused_parts` names the refused run's parts for merge,
which refuses them, and the run's later tasks stop before writing (:func:`refusal_of`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import storage
from ..errors import OtherRowsError, PackError

log = logging.getLogger(__name__)

#: the index option (of a part) that says what the part holds
HOLDS = "holds"
#: the journal record's field: the digest of the records up to its cursor
JOURNAL_FIELD = "records"
#: the index option (of a part) that names the run that wrote it (an engine's identity of a run)
RUN = "run"
#: where a refused run's record is kept, in the output beside the parts
REFUSED_DIR = "_refused"
#: the most bytes of a refusal record read back (records are small; an output is untrusted)
MAX_REFUSAL_BYTES = 64 << 10


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


def other_rows(url: str, out: str, found: Any, here: dict) -> OtherRowsError:
    """The refusal of a part found holding other input than the attempt's (see the module's doc)."""
    if not isinstance(found, dict):
        return OtherRowsError(
            f"{url} was packed by a wdsllm that did not record the rows a part holds, so whether it holds this "
            f"task's ({_describe(here)}) cannot be told; remove every part-*/ of {out} to pack them anew"
        )
    return OtherRowsError(
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


def _refusal_name(run: str) -> str:
    return f"{REFUSED_DIR}/run-{hashlib.sha256(run.encode()).hexdigest()[:16]}.json"


def record_refusal(out: str, run: str, part: str, refused: PackError) -> None:
    """Leave in ``out`` the record that run ``run`` was refused at ``part`` (best effort: the
    refusal is raised whatever happens here)."""
    record = {"run": run, "part": part, "reason": str(refused)}
    try:
        with storage.Output(out) as output:
            output.put_bytes(_refusal_name(run), json.dumps(record, sort_keys=True).encode())
    except (OSError, PackError) as exc:
        log.warning("%s: could not record that run %s was refused at %s: %s", out, run, part, exc)


def refusal_of(out: str, run: str) -> dict | None:
    """The record of run ``run``'s refusal in ``out`` (None: it was not refused there)."""
    url = storage.join_url(out, _refusal_name(run))
    return _parse_refusal(_read_bounded(url), url) if storage.exists(url) else None


def refusals(out: str, names: list[str]) -> list[tuple[str, dict]]:
    """The refusal records among ``names`` (``out``'s listing), as (name, record)."""
    found = []
    for name in sorted(n for n in names if n.startswith(REFUSED_DIR + "/") and n.endswith(".json")):
        url = storage.join_url(out, name)
        found.append((name, _parse_refusal(_read_bounded(url), url)))
    return found


def _read_bounded(url: str) -> bytes:
    with storage.open_stream(url) as f:
        return f.read(MAX_REFUSAL_BYTES + 1)


def _parse_refusal(data: bytes, url: str) -> dict:
    """A refusal record, checked (an output is untrusted: read no further than its bound)."""
    try:
        record = json.loads(data) if len(data) <= MAX_REFUSAL_BYTES else None
    except ValueError:
        record = None
    if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in ("run", "part", "reason")):
        raise PackError(f"{url} is not a refusal record wdsllm wrote (remove it if it is not yours)")
    return record


def refused_parts(record: dict, runs: dict[str, str | None]) -> list[str]:
    """The parts (``runs``: each part's name or URL to the run that wrote it) that the refused run
    wrote."""
    return sorted(part for part, run in runs.items() if run == record["run"])
