"""`wdsllm merge`: the outputs of a multi-task pack become one dataset with one index.

Each task of ``wdsllm pack --num-tasks K`` writes a complete dataset of its own (``task-%05d/``
with shards, ``lengths.npy`` and ``index.json``), and so does each ``pack_part`` call of a cluster
engine (``part-%05d/``, see :mod:`wdsllm.pack.part`). Their sample keys are already task-qualified
(``TTTT-GGGGGGGGG``), so merging never rewrites a tar: shards are moved (or copied) under a
contiguous ``PREFIX-%06d.tar`` numbering, task order then shard order, and a new index is written
last. A plan file (``.merge-plan.json``) makes an interrupted merge safe to run again: shards
already moved are recognised and skipped.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

from .. import __version__, storage
from .. import format as fmt
from ..errors import MergeError, PackError
from ..format.side import SideArray
from .lock import OutputLock
from .rows import RUN, refusals, refused_parts
from .sidefiles import SideFiles
from .writer import MAX_SKIP_RECORDS, records_truncated

log = logging.getLogger(__name__)

PLAN_NAME = ".merge-plan.json"
TASK_DIR_PREFIX = "task-"
PART_DIR_PREFIX = "part-"
#: Options that legitimately differ between the tasks of one pack (or the parts of one dataset).
PER_TASK_OPTIONS = ("task_index", "part_id", "holds", RUN)
#: Options compared another way: the tokenizer by its sha256, not by how it was named.
NOT_COMPARED = (*PER_TASK_OPTIONS, "tokenizer")
#: the most tasks (or parts) a part may say its dataset has: merge lists the missing ones
MAX_PARTS = 1_000_000
#: the largest tokenizer.json a merge carries over from a part
MAX_TOKENIZER_BYTES = 256 << 20


@dataclass
class Part:
    """One task's finished output."""

    url: str
    index: fmt.Index

    @property
    def task(self) -> int | None:
        options = self.index.options
        return options.get("task_index", options.get("part_id"))

    @property
    def from_records(self) -> bool:
        """A ``pack_part`` part: its inputs are record sources, not byte ranges of input files."""
        return "part_id" in self.index.options


@dataclass
class Move:
    part: Part
    entry: fmt.ShardEntry
    target: str  # the shard's name in the merged dataset


def _norm(url: str) -> str:
    return url.rstrip("/") if storage.is_remote(url) else os.path.abspath(url)


def _has_index(url: str) -> bool:
    return storage.exists(storage.join_url(url, fmt.INDEX_NAME))


def _task_dirs(url: str, allow_partial: bool) -> list[str]:
    """The ``task-*/`` and ``part-*/`` parts under a parent directory, in name order; a part without
    its manifest (``index.json``) is unfinished, and named."""
    names = storage.Output(url).list_names()
    prefixes = (TASK_DIR_PREFIX, PART_DIR_PREFIX)
    dirs = sorted({n.split("/", 1)[0] for n in names if n.startswith(prefixes) and "/" in n})
    complete = {n.split("/", 1)[0] for n in names if n.count("/") == 1 and n.endswith("/" + fmt.INDEX_NAME)}
    unfinished = [d for d in dirs if d not in complete]
    if unfinished:
        shown = ", ".join(unfinished[:20]) + (f" and {len(unfinished) - 20} more" if len(unfinished) > 20 else "")
        if not allow_partial:
            others = f"; {len(unfinished)} parts have not finished: {shown}" if len(unfinished) > 1 else ""
            raise MergeError(
                f"{storage.join_url(url, unfinished[0])} has no {fmt.INDEX_NAME}: that part has not finished{others} "
                "(finish it with --resume for a pack task, a rerun for a cluster part; or pass --allow-partial)"
            )
        log.warning("%s: leaving out %d unfinished part(s): %s", url, len(unfinished), shown)
    return [storage.join_url(url, d) for d in dirs if d in complete]


def find_parts(sources: list[str], allow_partial: bool = False) -> list[Part]:
    """Each source is a task's output, or a directory holding ``task-*/`` outputs."""
    urls: list[str] = []
    for source in sources:
        if _has_index(source):
            urls.append(source)
            continue
        found = _task_dirs(source, allow_partial)
        if not found:
            raise MergeError(
                f"{source}: neither a pack output ({fmt.INDEX_NAME}) nor a directory of {TASK_DIR_PREFIX}*/ or "
                f"{PART_DIR_PREFIX}*/ outputs"
            )
        urls.extend(found)
    parts = [_load_part(url) for url in urls]
    return sorted(parts, key=lambda p: p.task if p.task is not None else -1)


def _load_part(url: str) -> Part:
    index_url = storage.join_url(url, fmt.INDEX_NAME)
    index, _ = fmt.read_index(url)
    if index.lengths_file is None:
        raise MergeError(f"{index_url} names no {fmt.LENGTHS_NAME}: not the output of a pack")
    _check_merged_fields(index, index_url)
    return Part(url=url, index=index)


def _count(value: object) -> bool:
    """A non-negative JSON integer (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_merged_fields(index: fmt.Index, where: str) -> None:
    """A part is untrusted (it may be a stranger's): what merge reads of its index beyond what
    ``fmt.read_index`` checks is checked before use, so a bad value is a MergeError naming the
    index, never a KeyError, an output name outside the output, or a count too large to list."""
    options = index.options
    if not isinstance(options, dict):
        raise MergeError(f"{where}: options must be an object")
    task = options.get("task_index", options.get("part_id"))
    if task is not None and not _count(task):
        raise MergeError(f"{where}: task_index (part_id) must be a non-negative integer, not {task!r:.40}")
    for key in ("num_tasks", "parts"):
        value = options.get(key)
        if value is not None and not (_count(value) and 0 < value <= MAX_PARTS):
            raise MergeError(f"{where}: {key} must be an integer from 1 to {MAX_PARTS:,}, not {value!r:.40}")
    prefix = options.get("prefix", "shard")
    if not isinstance(prefix, str) or not fmt.SHARD_RE.match(fmt.shard_name(prefix, 0)):
        raise MergeError(f"{where}: prefix {prefix!r:.40} cannot name shards (letters, digits, '_', inner '-')")
    for i, inp in enumerate(index.inputs if isinstance(index.inputs, list) else [None]):
        if not _input_entry_ok(inp):
            raise MergeError(f"{where}: inputs[{i}] is not an input entry (index, path, documents, skipped)")
    _check_skipped(index.skipped, where)
    packed = index.packed if index.packed is not None else {}
    if not isinstance(packed, dict) or not all(_count(packed.get(k, 0)) for k in ("max_row_segments", "short_rows")):
        raise MergeError(f"{where}: packed must hold max_row_segments and short_rows counts")
    tokenizer = index.tokenizer_file
    if tokenizer is not None and tokenizer.bytes > MAX_TOKENIZER_BYTES:
        raise MergeError(f"{where}: its {tokenizer.name} of {tokenizer.bytes:,} bytes is larger than a tokenizer")


def _input_entry_ok(inp: object) -> bool:
    if not isinstance(inp, dict) or not _count(inp.get("index")) or not isinstance(inp.get("path"), str):
        return False
    if not (_count(inp.get("documents")) and _count(inp.get("skipped")) and _count(inp.get("tokens", 0))):
        return False
    share = inp.get("part")
    if share is None:
        return "part" not in inp
    return (
        isinstance(share, dict)
        and isinstance(share.get("unit"), str)
        and _count(share.get("start"))
        and _count(share.get("stop"))
        and share["start"] <= share["stop"]
        and _count(inp.get("bytes"))
    )


def _check_skipped(skipped: object, where: str) -> None:
    """The part's skip counts and its listed skips (a part lists at most ``MAX_SKIP_RECORDS``)."""
    counts = skipped.get("counts", {}) if isinstance(skipped, dict) else None
    if not isinstance(counts, dict) or not all(isinstance(k, str) and _count(n) for k, n in counts.items()):
        raise MergeError(f"{where}: skipped.counts must map reasons to counts")
    records = skipped.get("records", [])
    if not isinstance(records, list) or len(records) > MAX_SKIP_RECORDS:
        raise MergeError(f"{where}: skipped.records must be a list of at most {MAX_SKIP_RECORDS:,} skips")
    for i, record in enumerate(records):
        if not (
            isinstance(record, dict)
            and isinstance(record.get("file"), str)
            and _count(record.get("line"))
            and _count(record.get("count", 1))
        ):
            raise MergeError(f"{where}: skipped.records[{i}] needs a file and a line")


def _stage_side_files(parts: list[Part], out: storage.Output) -> SideFiles:
    """The merged lengths.npy and groups.npy, staged a piece at a time from the parts' (each part
    checked against its index as it is read): shards keep their order (parts in task order, each
    part's shards in order), so the parts' files concatenate. A part from before format 2 has no
    groups.npy, and then neither has the merged dataset. Done before any shard moves, so a part
    whose side files are damaged stops the merge while the parts are intact."""
    documents = sum(p.index.documents for p in parts)
    groups = sum(int(p.index.shards.column("samples").sum()) for p in parts)
    sides = SideFiles(out, documents, groups, parts[0].index.group_columns if parts else fmt.GROUP_COLUMNS)
    try:
        for part in parts:
            index_url = storage.join_url(part.url, fmt.INDEX_NAME)
            lengths = SideArray.open(part.url, part.index.lengths_file)
            if lengths.count != part.index.documents:
                raise MergeError(
                    f"{lengths.url} has {lengths.count} lengths, {index_url} counts {part.index.documents} documents"
                )
            table = None
            if part.index.groups_file:
                table = SideArray.open(part.url, part.index.groups_file)
                if table.count != part.index.group_columns * int(part.index.shards.column("samples").sum()):
                    raise MergeError(f"{table.url} does not list every group that {index_url} counts")
            for _, piece in lengths.chunks():
                sides.add_lengths(piece)
            if table is None:
                sides.add_groups(None)
            for _, rows in table.chunks() if table is not None else ():
                sides.add_groups(rows)
    except BaseException:
        sides.abort()
        raise
    return sides


def check_compatible(parts: list[Part], allow_partial: bool = False) -> None:
    """Refuse parts that are not tasks of one pack: they would not make one dataset."""
    if not parts:
        raise MergeError("nothing to merge")
    first = parts[0]
    for part in parts:
        if part.task is None:
            raise MergeError(
                f"{part.url} is not the output of one pack task (its index has no task_index); it may be merged already"
            )
        for what, a, b in _differences(first.index, part.index):
            if what == "option parts":  # the split's identity, where the engine knows it
                raise MergeError(
                    f"cannot merge {part.url} with {first.url}: they are parts of two splits of the input ({b!r} "
                    f"parts here, {a!r} there), so merging them would pack some documents twice. Remove the parts "
                    "of the run that split otherwise (all the parts of one number), then merge; or remove every "
                    "part-*/ and pack anew"
                )
            raise MergeError(f"cannot merge {part.url} with {first.url}: {what} differs ({b!r} here, {a!r} there)")
    tasks = [p.task for p in parts]
    for a, b in itertools.pairwise(parts):
        if a.task == b.task:
            raise MergeError(f"{a.url} and {b.url} are both task {a.task}; their keys would collide")
    num_tasks = _expected_parts(first, len(parts))
    present = set(tasks)
    missing = [t for t in range(num_tasks) if t not in present] if num_tasks is not None else []
    if missing and not allow_partial:
        shown = f"{missing[:20]}{' and more' if len(missing) > 20 else ''}"
        raise MergeError(
            f"tasks {shown} of {num_tasks} are missing, so their documents would be; pass them too, or --allow-partial"
        )
    _check_disjoint(parts)


def check_refusals(parts: list[Part]) -> list[tuple[str, str]]:
    """Refuse the parts of a run that was refused (:mod:`.rows`): they hold rows split otherwise
    than the other parts, so merging both would pack documents twice. Returns the refusal records
    that no merged part answers to (that run's parts were removed), as (folder, name): a merge in
    place retires them."""
    by_dir: dict[str, dict[str, str | None]] = {}
    for part in parts:
        run = part.index.options.get(RUN)
        folder = storage.dirname_url(part.url.rstrip("/"))
        by_dir.setdefault(folder, {})[part.url] = run if isinstance(run, str) else None
    stale = []
    for folder, runs in by_dir.items():
        try:
            found = refusals(folder, storage.Output(folder).list_names())
        except PackError as exc:
            raise MergeError(str(exc)) from None
        for name, record in found:
            culprits = refused_parts(record, runs)
            if not culprits:
                stale.append((folder, name))
                continue
            url = storage.join_url(folder, name)
            shown = ", ".join(culprits[:10]) + (f" and {len(culprits) - 10} more" if len(culprits) > 10 else "")
            raise MergeError(
                f"{shown} were written by run {record['run']!r}, which was refused at {record['part']} ({url}): "
                f"{record['reason']} That run split the input otherwise than the other parts, so merging its parts "
                "with theirs would pack some documents twice. Remove that run's parts (those named here), then "
                "merge (or re-run with the first run's split); or remove every part-*/ and pack anew"
            )
    return stale


def _records_in(out_url: str, records: list[tuple[str, str]]) -> list[str]:
    """The names, inside the output, of the refusal records that lie in it (a merge in place)."""
    root = _norm(out_url)
    return [name for folder, name in records if _norm(folder) == root]


def _expected_parts(part: Part, default: int) -> int | None:
    """How many tasks (or parts) the dataset has, where the pack knew it."""
    options = part.index.options
    return options.get("parts") if part.from_records else options.get("num_tasks", default)


def _check_disjoint(parts: list[Part]) -> None:
    """Pack tasks divide input files by byte ranges: no two may hold the same share. Record sources
    (no ``part``) of cluster parts are shared by many parts."""
    seen: dict[int, list[tuple[dict, str]]] = {}
    for part in parts:
        for inp in part.index.inputs:
            if part.from_records and "part" not in inp:
                continue
            for other, url in seen.get(inp["index"], []):
                if not _disjoint(inp.get("part"), other.get("part")):
                    raise MergeError(f"input {inp['index']} ({inp['path']}) is in both {url} and {part.url}")
            seen.setdefault(inp["index"], []).append((inp, part.url))


def _disjoint(a: dict | None, b: dict | None) -> bool:
    """Whether two tasks' shares of one input (``inputs[].part``) do not overlap."""
    if a is None or b is None or a.get("unit") != b.get("unit"):
        return False
    return a["stop"] <= b["start"] or b["stop"] <= a["start"]


def merged_inputs(parts: list[Part]) -> list[dict]:
    """The parts' input entries, one per input: a file divided between tasks sums its shares' counts."""
    by_index: dict[int, dict] = {}
    for p in parts:
        for inp in p.index.inputs:
            entry = by_index.get(inp["index"])
            if entry is None:
                by_index[inp["index"]] = entry = {k: v for k, v in inp.items() if k != "part"}
                if "part" in inp:
                    entry["parts"] = [inp["part"]]
                continue
            entry["documents"] += inp["documents"]
            entry["skipped"] += inp["skipped"]
            if "tokens" in entry:
                entry["tokens"] += inp.get("tokens", 0)
            if "part" in inp:
                entry.setdefault("parts", []).append(inp["part"])
    for entry in by_index.values():
        shares = sorted(entry.pop("parts", []), key=lambda s: s["start"])
        contiguous = all(a["stop"] == b["start"] for a, b in itertools.pairwise(shares))
        if shares and not (contiguous and shares[0]["start"] == 0 and _covers_file(shares[-1], entry)):
            entry["parts"] = shares  # some shares of it were not merged (--allow-partial)
    return [by_index[k] for k in sorted(by_index)]


def _covers_file(last: dict, entry: dict) -> bool:
    """Whether a share reaches the end of its file (bytes; row groups and batches are only known
    to end there when every task was merged, which check_compatible ensures without --allow-partial)."""
    return last["unit"] != "bytes" or last["stop"] >= entry["bytes"]


def _shard_format(version: int) -> int:
    """What a version says about the shards and groups.npy: 3 and 4 share them (4 changed only
    the index and how its side files are vouched for)."""
    return min(version, 3)


def _differences(a: fmt.Index, b: fmt.Index):
    """(what, value in a, value in b) for everything that must be equal across tasks."""
    for what in ("format", "mode", "dtype", "seq_len"):
        if getattr(a, what) != getattr(b, what):
            yield what, getattr(a, what), getattr(b, what)
    if _shard_format(a.version) != _shard_format(b.version):
        yield "version", a.version, b.version
    if a.tokenizer.sha256 != b.tokenizer.sha256:
        yield "tokenizer (sha256)", a.tokenizer.sha256[:16], b.tokenizer.sha256[:16]
    for key in sorted(set(a.options) | set(b.options)):
        if key not in NOT_COMPARED and a.options.get(key) != b.options.get(key):
            yield f"option {key}", a.options.get(key), b.options.get(key)


# ----------------------------------------------------------------------------------------------
# The merge.


def plan_moves(parts: list[Part]) -> list[Move]:
    prefix = parts[0].index.options.get("prefix", "shard")
    moves = []
    for part in parts:
        for entry in part.index.shards:
            moves.append(Move(part, entry, fmt.shard_name(prefix, len(moves))))
    return moves


def _plan_json(moves: list[Move], copy: bool) -> bytes:
    body = {
        "copy": copy,
        "moves": [[storage.join_url(m.part.url, m.entry.name), m.target, m.entry.bytes, m.entry.sha256] for m in moves],
    }
    return json.dumps(body, indent=0).encode()


def _protected(out_url: str, parts: list[Part]) -> list[str]:
    """Name prefixes inside the output that belong to parts (merging in place)."""
    root = _norm(out_url)
    prefixes = []
    for part in parts:
        url = _norm(part.url)
        if url == root or root.startswith(url + "/"):
            raise MergeError(f"the output {out_url} must not be a part or lie inside one ({part.url})")
        if url.startswith(root + "/"):
            prefixes.append(url[len(root) + 1 :] + "/")
    return prefixes


def _prepare_output(
    out: storage.Output, parts: list[Part], plan: bytes, overwrite: bool, allow_partial: bool, retired: list[str]
) -> None:
    """Refuse a non-empty output (or clear it with --overwrite), unless this merge was interrupted.
    Parts in the output that this merge leaves out are never cleared: unfinished ones stay where
    they are with --allow-partial, and finished ones are refused by name. ``retired``: refusal
    records in the output that the merge removes once done (:func:`check_refusals`)."""
    protected = (*_protected(out.url, parts), *retired)
    if out.get_bytes(PLAN_NAME) == plan:
        log.info("continuing an interrupted merge into %s", out.url)
        return
    others = [n for n in out.list_names() if not n.startswith(protected)] if protected else out.list_names()
    unfinished = _parts_left_out(out, others, allow_partial)
    others = [n for n in others if n.split("/", 1)[0] not in unfinished]
    if others:
        if not overwrite:
            raise MergeError(f"output {out.url} is not empty ({others[0]}, ...); pass --overwrite to replace it")
        for name in others:
            out.delete(name)
    out.put_bytes(PLAN_NAME, plan)


def _parts_left_out(out: storage.Output, names: list[str], allow_partial: bool) -> set[str]:
    """The unfinished parts among ``names`` (the output's names outside the merged parts), which
    --allow-partial leaves where they are; a finished part left out is refused, with or without
    --overwrite: its documents would be missing from the dataset, or deleted with it."""
    dirs = {n.split("/", 1)[0] for n in names if n.startswith((TASK_DIR_PREFIX, PART_DIR_PREFIX)) and "/" in n}
    finished = sorted(d for d in dirs if f"{d}/{fmt.INDEX_NAME}" in names)
    unfinished = dirs.difference(finished)
    if finished:
        shown = ", ".join(finished[:10]) + (f" and {len(finished) - 10} more" if len(finished) > 10 else "")
        raise MergeError(
            f"output {out.url} holds finished parts that this merge leaves out ({shown}): their documents would not "
            f"be in the dataset, and --overwrite would delete them. Merge them too (wdsllm merge {out.url} -o "
            f"{out.url} merges every part in it), or, if a run that split its input otherwise left them, remove "
            "that run's parts and pack them again"
        )
    if unfinished and not allow_partial:
        shown = ", ".join(sorted(unfinished)[:10]) + (
            f" and {len(unfinished) - 10} more" if len(unfinished) > 10 else ""
        )
        raise MergeError(
            f"output {out.url} holds unfinished parts that this merge leaves out ({shown}); finish them and merge "
            "them too, or pass --allow-partial to merge without them (they stay where they are)"
        )
    return unfinished


def _local_path(url: str) -> str | None:
    if storage.is_remote(url) or url.startswith(("pipe:", "file://")):
        return None
    return url


def _transfer(move: Move, out: storage.Output, copy: bool) -> None:
    """Put one shard into place under its new name (idempotent when run again)."""
    source = storage.join_url(move.part.url, move.entry.name)
    local = _local_path(source)
    source_there = os.path.exists(local) if local else storage.exists(source)
    if storage.exists(out.url_of(move.target)) and (copy or not source_there):
        return  # done by an interrupted run: names appear only complete (Output is atomic)
    if not source_there:
        raise MergeError(f"{source} is missing; the part is incomplete (run wdsllm verify on it)")
    staging = os.path.join(out.local_staging_dir(), f".{move.target}.tmp")
    if local:
        if os.path.islink(local):  # moved, the link would lead the dataset's readers outside it
            raise MergeError(f"{source} is a symbolic link; a part's shards must be files in it")
        size = os.path.getsize(local)
        if size != move.entry.bytes:
            raise MergeError(f"{source} is {size} bytes, its index says {move.entry.bytes}")
        if copy:
            _copy_checked(source, staging, move.entry)
            out.put_file(staging, move.target)
        else:
            out.put_file(local, move.target)  # a rename when both are on one file system
        return
    if out.copy_in(source, move.target):  # server-side: no byte is downloaded and uploaded again
        _check_copy(out, move)
    else:
        _copy_checked(source, staging, move.entry)
        out.put_file(staging, move.target)
    if not copy:
        storage.Output(move.part.url).delete(move.entry.name)


def _check_copy(out: storage.Output, move: Move) -> None:
    """A server-side copy is checked against the index's sha256 as a copy through this machine is
    (a corrupt part's shard must not be carried into the merged dataset): the copy is read back
    once (downloaded, never uploaded again) and removed when it does not match."""
    target = out.url_of(move.target)
    sha = hashlib.sha256()
    with storage.open_stream(target, expected_size=move.entry.bytes) as src:
        while chunk := src.read(1 << 20):
            sha.update(chunk)
    if sha.hexdigest() != move.entry.sha256:
        out.delete(move.target)
        source = storage.redact(storage.join_url(move.part.url, move.entry.name))
        raise MergeError(
            f"{source} does not match the sha256 its index gives; the part is damaged (run wdsllm verify on it)"
        )


def _copy_checked(source: str, staging: str, entry: fmt.ShardEntry) -> None:
    """Copy a shard, checking its sha256 against its index entry on the way: a corrupt part's shard
    is not carried into the merged dataset."""
    sha = hashlib.sha256()
    with storage.open_stream(source, expected_size=entry.bytes) as src, open(staging, "wb") as dst:
        while chunk := src.read(1 << 20):
            sha.update(chunk)
            dst.write(chunk)
    if sha.hexdigest() != entry.sha256:
        os.unlink(staging)
        raise MergeError(
            f"{source} does not match the sha256 its index gives; the part is damaged (run wdsllm verify on it)"
        )


def merged_index(
    parts: list[Part],
    moves: list[Move],
    doc_lengths: dict,
    lengths_file: fmt.SideFile,
    groups_file: fmt.SideFile | None = None,
) -> fmt.Index:
    first = parts[0].index
    options = {k: v for k, v in first.options.items() if k not in PER_TASK_OPTIONS}
    inputs = merged_inputs(parts)
    counts: dict[str, int] = {}
    for p in parts:
        for reason, n in p.index.skipped.get("counts", {}).items():
            counts[reason] = counts.get(reason, 0) + n
    order = {inp["path"]: inp["index"] for inp in inputs}
    records = heapq.nsmallest(  # the first in input order: a merged index lists as many as a part
        MAX_SKIP_RECORDS + 1,
        (r for p in parts for r in p.index.skipped.get("records", [])),
        key=lambda r: (order.get(r["file"], -1), r["line"]),
    )
    packed = None
    if first.mode == "packed":
        packed = {
            "max_row_segments": max((p.index.packed or {}).get("max_row_segments", 0) for p in parts),
            "short_rows": sum((p.index.packed or {}).get("short_rows", 0) for p in parts),
        }
    return fmt.Index(
        mode=first.mode,
        dtype=first.dtype,
        seq_len=first.seq_len,
        tokenizer=first.tokenizer,
        shards=[replace(m.entry, name=m.target) for m in moves],
        doc_lengths=doc_lengths,
        options=options,
        inputs=inputs,
        skipped={
            "counts": dict(sorted(counts.items())),
            "total": sum(counts.values()),
            "records": records[:MAX_SKIP_RECORDS],
            "records_truncated": records_truncated(counts, records[:MAX_SKIP_RECORDS]),
        },
        lengths_file=lengths_file,
        packed=packed,
        groups_file=groups_file,
        checksum=first.checksum,
        # The shards are not rewritten: they keep the parts' format. Versions 3 and 4 differ only in
        # the index and its side files, which a merge writes anew, so their parts merge into 4.
        version=fmt.FORMAT_VERSION if _shard_format(first.version) == 3 else first.version,
        created_by=f"wdsllm {__version__}",
    )


def merge(
    sources: list[str],
    output: str,
    *,
    copy: bool = False,
    overwrite: bool = False,
    allow_partial: bool = False,
    on_shard: Callable[[int, int], None] | None = None,
) -> tuple[fmt.Index, list[Part]]:
    """Merge task outputs into ``output``; returns the merged index and the parts used."""
    parts = find_parts(sources, allow_partial)
    check_compatible(parts, allow_partial)
    stale = check_refusals(parts)
    moves = plan_moves(parts)
    out = storage.Output(output)
    lock = OutputLock(out, "merge")
    try:
        lock.acquire()
        retired = _records_in(out.url, stale)
        _prepare_output(out, parts, _plan_json(moves, copy), overwrite, allow_partial, retired)
        sides = _stage_side_files(parts, out)
        try:
            for i, move in enumerate(moves):
                _transfer(move, out, copy)
                if on_shard:
                    on_shard(i + 1, len(moves))
            lengths_file, groups_file = sides.put()
        except BaseException:
            sides.abort()
            raise
        tokenizer_bytes = _tokenizer_bytes(parts)
        index = merged_index(parts, moves, sides.summary.to_json(), lengths_file, groups_file)
        if tokenizer_bytes is not None:
            out.put_bytes(fmt.TOKENIZER_NAME, tokenizer_bytes)
            index.tokenizer_file = fmt.SideFile.of(fmt.TOKENIZER_NAME, tokenizer_bytes)
        for name, data in index.move_shard_table():  # a large dataset's shard table: shards.npy
            out.put_bytes(name, data)
        out.put_bytes(fmt.INDEX_NAME, index.to_json().encode())
        if not copy:
            _retire_parts(parts)
            for name in retired:  # the refused run's parts are gone: its record has nothing left to name
                out.delete(name)
        out.delete(PLAN_NAME)
    finally:
        lock.release()
        out.close()
    log.info("merged %d parts into %s: %d shards", len(parts), output, len(moves))
    return index, parts


def _tokenizer_bytes(parts: list[Part]) -> bytes | None:
    """The tokenizer.json the parts carry (they share one tokenizer), or None if any lacks it."""
    if not parts or any(p.index.tokenizer_file is None for p in parts):
        return None
    return fmt.read_side_bytes(parts[0].url, parts[0].index.tokenizer_file)


def _retire_parts(parts: list[Part]) -> None:
    """After a move the parts' indexes point at nothing: remove them (and empty local dirs)."""
    for part in parts:
        remains = storage.Output(part.url)
        sides = (part.index.lengths_file, part.index.groups_file, part.index.tokenizer_file, part.index.shards_file)
        names = [fmt.INDEX_NAME] + [f.name for f in sides if f is not None]
        for name in names:
            remains.delete(name)
        local = _local_path(part.url)
        if local and os.path.isdir(local) and not os.listdir(local):
            os.rmdir(local)
