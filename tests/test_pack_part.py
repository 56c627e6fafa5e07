"""pack_part: one committing, idempotent call that packs records into a part; merge of parts."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
from cluster_helpers import GPT2, SMALL, documents_by_origin, local_pack, source_records, visible_files
from pack_helpers import cached, cli, dataset_files, groups, load_index, pack_api

import wdsllm.pack.lock as lock_module
import wdsllm.pack.part as part_module
from wdsllm import storage
from wdsllm.errors import MergeError, OtherRowsError, PackError, SourceError, WdsllmError
from wdsllm.pack.lock import OutputLock
from wdsllm.pack.merge import merge
from wdsllm.pack.part import TOKENIZERS, PartOptions, pack_part, pack_part_files, part_url

N = 2000


class Preempted(Exception):
    """Stands for the signal that stops a preempted task."""


def preempted_after(records: list[dict], n: int):
    yield from records[:n]
    raise Preempted(f"preempted after {n} records")


def options(sources=None, **kw) -> PartOptions:
    return PartOptions.of(str(GPT2), sources=sources, **{**SMALL, **kw})


def split(records: list[dict], parts: int) -> list[list[dict]]:
    """Interleaved shares, as an engine's blocks may be: each part holds records of every stretch."""
    return [records[i::parts] for i in range(parts)]


def test_parts_merged_equal_a_local_pack(tmp_path):
    name, records = source_records(N)
    opts = options(sources=[name])
    manifests = [pack_part(share, i, str(tmp_path), opts) for i, share in enumerate(split(records, 3))]
    assert sum(m.documents for m in manifests) == N
    assert all(m.sources[name]["documents"] == m.documents for m in manifests)
    assert all(m.sources[name]["tokens"] == m.tokens for m in manifests)
    index, parts = merge([str(tmp_path)], str(tmp_path))
    assert len(parts) == 3 and index.documents == N
    assert documents_by_origin(tmp_path) == documents_by_origin(local_pack(N))
    merged_input = load_index(tmp_path).inputs
    assert [(i["path"], i["documents"], i["tokens"]) for i in merged_input] == [(name, N, index.tokens)]
    # nothing left of the parts: their shards moved, their manifests and side files retired
    assert not [f for f in visible_files(tmp_path) if f.startswith("part-")]


def test_a_second_run_gives_byte_identical_parts(tmp_path):
    name, records = source_records(N)
    for run in ("a", "b"):
        pack_part(records[:700], 4, str(tmp_path / run), options(sources=[name]))
    assert dataset_files(tmp_path / "a" / "part-00004") == dataset_files(tmp_path / "b" / "part-00004")


@pytest.mark.parametrize(
    "shape",
    [{"mode": "docs", "max_doc_tokens": 300}, {"mode": "packed", "seq_len": 512}],
    ids=["docs-pieces", "packed"],
)
def test_a_preempted_part_continues_from_its_cursor(tmp_path, caplog, shape):
    name, records = source_records(N)
    records = records[:1000]
    opts = options(sources=[name], **shape)
    whole = pack_part(records, 0, str(tmp_path / "whole"), opts)
    with pytest.raises(Preempted):
        pack_part(preempted_after(records, 600), 0, str(tmp_path / "cut"), opts)
    cut = tmp_path / "cut" / "part-00000"
    assert not (cut / "index.json").exists() and not list(cut.glob(".*.tmp"))
    with caplog.at_level(logging.INFO, logger="wdsllm.pack.part"):
        resumed = pack_part(records, 0, str(tmp_path / "cut"), opts)
    said = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert said and "records already packed" in said[0]
    skipped = int(said[0].split("skipping ")[1].split()[0])
    assert 0 < skipped < 600 and resumed.resumed_shards > 0
    assert resumed.digest == whole.digest
    assert dataset_files(cut) == dataset_files(tmp_path / "whole" / "part-00000")


def blocks(records: list[dict], n: int) -> list[list[dict]]:
    """Contiguous blocks, as Ray splits a dataset: another n moves every boundary."""
    size = -(-len(records) // n)
    return [records[i : i + size] for i in range(0, len(records), size)]


def test_a_committed_part_is_reused_only_for_the_same_records_which_are_read_not_tokenized(tmp_path, monkeypatch):
    _, records = source_records(N)
    first = pack_part(records[:300], 2, str(tmp_path), options())
    before = dataset_files(tmp_path / "part-00002")
    monkeypatch.setattr(part_module, "encode_parsed", lambda *a, **kw: pytest.fail("a committed part was tokenized"))
    assert pack_part(iter(records[:300]), 2, str(tmp_path), options()) == first
    others = {
        "fewer": records[:299],
        "more": records[:301],
        "shifted": records[1:301],
        "reordered": records[299::-1],
        "edited": [*records[:299], {**records[299], "text": "changed"}],
    }
    for name, other in others.items():
        with pytest.raises(PackError, match=r"part-00002 holds other input than this task's \(300 records") as refused:
            pack_part(other, 2, str(tmp_path), options())
        assert f"this task: {len(other)} records" in str(refused.value), name
        assert "remove every part-*/" in str(refused.value)
    assert dataset_files(tmp_path / "part-00002") == before


def test_a_rerun_split_otherwise_reuses_nothing_it_does_not_hold_and_merges_no_document_twice(tmp_path):
    """#43: a re-run with another number of blocks (Ray's default follows the cluster's size) found
    parts of the first run and returned them without reading its rows: documents were packed twice."""
    name, records = source_records(N)
    records, opts = records[:1200], options(sources=[name])
    for i, block in enumerate(blocks(records, 2)):
        pack_part(block, i, str(tmp_path / "two"), opts)
    for i, block in enumerate(blocks(records, 4)[:2]):  # tasks 0 and 1 of four find parts of two
        with pytest.raises(PackError, match=rf"part-0000{i} holds other input than this task's \(600 records"):
            pack_part(block, i, str(tmp_path / "two"), opts)
    for i, block in enumerate(blocks(records, 4)):
        pack_part(block, i, str(tmp_path / "four"), opts)
    for i, block in enumerate(blocks(records, 2)):  # the reverse change: tasks of two find parts of four
        with pytest.raises(PackError, match=r"300 records.*this task: 600 records"):
            pack_part(block, i, str(tmp_path / "four"), opts)
    manifests = [pack_part(block, i, str(tmp_path / "two"), opts) for i, block in enumerate(blocks(records, 2))]
    assert [m.resumed_shards for m in manifests] == [0, 0]  # the same split: both parts reused as they are
    merge([str(tmp_path / "two")], str(tmp_path / "two"))
    merge([str(tmp_path / "four")], str(tmp_path / "four"))
    assert documents_by_origin(tmp_path / "two") == documents_by_origin(tmp_path / "four")
    assert len(documents_by_origin(tmp_path / "two")) == 1200


def test_an_interrupted_part_continues_only_over_the_records_it_packed(tmp_path):
    name, records = source_records(N)
    opts = options(sources=[name])
    with pytest.raises(Preempted):
        pack_part(preempted_after(records[:1000], 600), 0, str(tmp_path), opts)
    journal = sorted((tmp_path / "part-00000").glob(".pack-*"))
    with pytest.raises(PackError, match=r"part-00000 \(an interrupted attempt's shards\) holds other input"):
        pack_part(records[500:1500], 0, str(tmp_path), opts)
    assert sorted((tmp_path / "part-00000").glob(".pack-*")) == journal  # refused, nothing changed
    resumed = pack_part(records[:1000], 0, str(tmp_path), opts)
    assert resumed.resumed_shards > 0 and resumed.documents == 1000


def test_a_part_of_other_options_is_replaced(tmp_path):
    _, records = source_records(N)
    pack_part(records[:300], 2, str(tmp_path), options())
    other = pack_part(records[:300], 2, str(tmp_path), options(sample_tokens=2048))
    assert load_index(tmp_path / "part-00002").options["sample_tokens"] == 2048
    assert other.documents == 300


def test_without_sources_a_part_is_its_own_input(tmp_path):
    _, records = source_records(N)
    texts = [{"text": r["text"]} for r in records[:500]]
    pack_part(texts[:250], 0, str(tmp_path), options())
    pack_part(texts[250:], 1, str(tmp_path), options())
    empty = pack_part([], 2, str(tmp_path), options())  # a task that got no rows
    assert (empty.documents, empty.shards) == (0, 0)
    merge([str(tmp_path)], str(tmp_path / "merged"))
    docs = documents_by_origin(tmp_path / "merged")
    assert sorted({k[0] for k in docs}) == ["part-00000", "part-00001"]
    assert sorted(ln for part, ln, _ in docs if part == "part-00001") == list(range(1, 251))


def test_bad_records_name_the_part_and_record(tmp_path):
    records = [{"text": "fine"}, {"body": "no text field"}, {"text": "fine again"}]
    with pytest.raises(SourceError, match=r"part-00007: record 2: text field 'text' is missing"):
        pack_part(records, 7, str(tmp_path), options())
    manifest = pack_part(records, 7, str(tmp_path / "skip"), options(on_error="skip"))
    assert manifest.documents == 2 and manifest.skipped == 1
    with pytest.raises(PackError, match="not in sources"):
        pack_part([{"text": "a", "source": "elsewhere", "line": 1}], 0, str(tmp_path / "s"), options(sources=["x"]))


def test_shard_size_in_tokens(tmp_path):
    _, records = source_records(N)
    pack_part(records[:1000], 0, str(tmp_path), options(shard_tokens=20_000, sample_tokens=2048))
    shards = load_index(tmp_path / "part-00000").shards
    assert len(shards) > 4
    tokens = sorted(int(e.tokens) for e in shards)
    assert tokens[-1] <= 20_000 and tokens[len(tokens) // 2] >= 15_000


def test_merge_names_unfinished_parts_and_allow_partial_skips_them(tmp_path):
    _, records = source_records(N)
    for i in range(3):
        pack_part(records[i * 100 : (i + 1) * 100], i, str(tmp_path), options(parts=3))
    (tmp_path / "part-00001" / "index.json").unlink()
    with pytest.raises(MergeError, match=r"part-00001"):
        merge([str(tmp_path)], str(tmp_path / "m"))
    with pytest.raises(MergeError, match=r"tasks \[1\] of 3 are missing"):
        merge([str(tmp_path / "part-00000"), str(tmp_path / "part-00002")], str(tmp_path / "m"))
    index, parts = merge([str(tmp_path)], str(tmp_path / "m"), allow_partial=True)
    assert [p.task for p in parts] == [0, 2] and index.documents == 200


def test_merge_reports_duplicate_ids_and_mismatched_options(tmp_path):
    _, records = source_records(N)
    pack_part(records[:100], 0, str(tmp_path / "a"), options())
    pack_part(records[100:200], 1, str(tmp_path / "a"), options(sample_tokens=2048))
    with pytest.raises(MergeError, match="option sample_tokens differs"):
        merge([str(tmp_path / "a")], str(tmp_path / "m"))
    pack_part(records[:100], 0, str(tmp_path / "b"), options())
    shutil.copytree(part_url(str(tmp_path / "b"), 0), tmp_path / "b" / "part-00001")
    with pytest.raises(MergeError, match="both task 0"):
        merge([str(tmp_path / "b")], str(tmp_path / "m"))


def test_part_errors_are_wdsllm_errors(tmp_path):
    with pytest.raises(WdsllmError):
        pack_part([], -1, str(tmp_path), options())


@pytest.mark.parametrize(
    ("part_id", "message"),
    [
        (2**64, "part_id must be from 0 to 9,223,372,036,854,775,807, not 18,446,744,073,709,551,616"),
        (-1, "part_id must be from 0"),
        (True, r"part_id must be an integer, not True \(bool\)"),
        (1.0, r"part_id must be an integer, not 1.0 \(float\)"),
        ("3", r"part_id must be an integer, not '3' \(str\)"),
        (4, r"part_id 4 is not one of the dataset's 4 parts \(0 to 3\)"),
    ],
)
def test_a_part_id_that_names_no_part_is_refused_before_anything_is_written(tmp_path, part_id, message):
    with pytest.raises(PackError, match=message):
        pack_part([{"text": "a document"}], part_id, str(tmp_path / "out"), options(parts=4))
    assert not (tmp_path / "out").exists()


def test_part_ids_of_ten_thousand_and_more_verify_once_merged(tmp_path):
    """#43: keys are TTTT-GGGGGGGGG with as many digits as the part id needs, and verify takes them."""
    from wdsllm.format.verify import verify

    ids = [9_999, 10_000, 123_456_789, 2**63 - 1]
    for part_id in ids:
        pack_part([{"text": f"document of part {part_id}"}], np.int64(part_id), str(tmp_path), options())
    merge([str(tmp_path)], str(tmp_path))
    report = verify(str(tmp_path))
    assert report.ok, report.errors[:3]
    keys = [g.key for g in groups(tmp_path)]
    assert keys == [f"{part_id:04d}-000000000" for part_id in ids]


class Fields(Mapping):
    """A mapping that is not a dict (what a Spark Row's asDict or a user's own record class may give)."""

    def __init__(self, **fields) -> None:
        self.fields = fields

    def __getitem__(self, key):
        return self.fields[key]

    def __iter__(self):
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)


def test_records_that_are_not_mappings_or_hold_lone_surrogates_are_named_or_skipped(tmp_path):
    records = [
        {"text": "fine"},
        "a string",
        Fields(text="a mapping that is not a dict"),
        None,
        {"text": "a lone \ud800 surrogate"},
        {"meta": Fields(body="nested in a mapping")},
        42,
    ]
    refused = {
        1: r"the record is not a mapping of fields \(str 'a string'\)",
        3: r"the record is not a mapping of fields \(NoneType None\)",
        4: r"text field 'text' holds a lone surrogate \(U\+D800\) at character 7",
        6: r"the record is not a mapping of fields \(int 42\)",
    }
    for at, message in refused.items():
        with pytest.raises(SourceError, match=rf"part-00007: record 3: {message}"):
            pack_part([records[0], records[2], records[at]], 7, str(tmp_path / f"r{at}"), options())
    manifest = pack_part(records, 7, str(tmp_path / "skip"), options(on_error="skip"))
    assert (manifest.documents, manifest.skipped) == (2, 5)  # record 6 has no 'text' field
    counts = load_index(tmp_path / "skip" / "part-00007").skipped["counts"]
    assert counts == {"decode_error": 1, "missing_field": 4}
    nested = pack_part(records[5:6], 0, str(tmp_path / "nested"), options(text_field="meta.body"))
    assert nested.documents == 1


def test_merge_in_place_with_allow_partial_leaves_unfinished_parts_where_they_are(tmp_path):
    _, records = source_records(N)
    for i in range(3):
        pack_part(records[i * 100 : (i + 1) * 100], i, str(tmp_path), options(parts=3))
    with pytest.raises(Preempted):
        pack_part(preempted_after(records[100:200], 50), 1, str(tmp_path / "cut"), options(parts=3))
    shutil.rmtree(tmp_path / "part-00001")
    (tmp_path / "cut" / "part-00001").rename(tmp_path / "part-00001")
    unfinished = visible_files(tmp_path / "part-00001")
    with pytest.raises(MergeError, match="part-00001 has no index.json"):
        merge([str(tmp_path)], str(tmp_path))
    merged = cli("merge", tmp_path, "-o", tmp_path, "--allow-partial")
    assert "merged 2 tasks (moved)" in merged.stdout and "200 documents" in merged.stdout
    assert visible_files(tmp_path / "part-00001") == unfinished  # left where it was, whole
    from wdsllm.format.verify import verify

    assert verify(str(tmp_path)).ok


def test_merge_into_a_directory_of_finished_parts_it_leaves_out_names_them_and_never_drops_them(tmp_path):
    """#43: the advice was --overwrite, which deletes finished parts."""
    _, records = source_records(N)
    for i in range(3):
        pack_part(records[i * 100 : (i + 1) * 100], i, str(tmp_path), options())
    kept = visible_files(tmp_path / "part-00002")
    some = [str(tmp_path / "part-00000"), str(tmp_path / "part-00001")]
    for overwrite in (False, True):
        with pytest.raises(MergeError, match=r"holds finished parts that this merge leaves out \(part-00002\)") as err:
            merge(some, str(tmp_path), overwrite=overwrite)
        assert "pass --overwrite" not in str(err.value) and f"wdsllm merge {tmp_path} -o {tmp_path}" in str(err.value)
    assert visible_files(tmp_path / "part-00002") == kept
    index, _ = merge([str(tmp_path)], str(tmp_path))
    assert index.documents == 300


def test_parts_of_input_files_merge_into_the_local_pack(tmp_path, caplog, monkeypatch):
    name, _ = source_records(N)
    opts = options(sources=[name])
    with pytest.raises(PackError, match="needs sources"):
        pack_part_files([name], 0, str(tmp_path / "x"), options())
    whole = pack_part_files([name], 0, str(tmp_path / "whole"), opts)
    assert whole.documents == N and whole.sources[name]["documents"] == N
    assert pack_part_files([name], 0, str(tmp_path / "whole"), opts) == whole  # it holds these files: reused
    # a preempted attempt (stopped after 10 chunks), then one that continues where it stopped
    real, calls = part_module.encode_parsed, []

    def preempted_encode(*args, **kw):
        calls.append(1)
        if len(calls) > 10:
            raise Preempted("preempted")
        return real(*args, **kw)

    monkeypatch.setattr(part_module, "encode_parsed", preempted_encode)
    with pytest.raises(Preempted):
        pack_part_files([name], 0, str(tmp_path / "cut"), opts)
    monkeypatch.setattr(part_module, "encode_parsed", real)
    with caplog.at_level(logging.INFO, logger="wdsllm.pack.part"):
        resumed = pack_part_files([name], 0, str(tmp_path / "cut"), opts)
    assert resumed.resumed_shards > 0 and [r for r in caplog.records if "skipping to" in r.getMessage()]
    assert dataset_files(tmp_path / "cut" / "part-00000") == dataset_files(tmp_path / "whole" / "part-00000")
    merge([str(tmp_path / "whole")], str(tmp_path / "merged"))
    assert documents_by_origin(tmp_path / "merged") == documents_by_origin(local_pack(N))
    again = pack_part_files([name], 1, str(tmp_path / "twice"), opts)
    pack_part_files([name], 0, str(tmp_path / "twice"), opts)
    with pytest.raises(MergeError, match="is in both"):
        merge([str(tmp_path / "twice")], str(tmp_path / "m2"))
    assert again.digest != whole.digest  # keys name the part


def test_where_filters_records_as_it_filters_json_lines(tmp_path):
    _, records = source_records(N)
    scored = [{**r, "score": (r["line"] % 3) / 2} for r in records[:600]]
    jsonl = tmp_path / "scored.jsonl"
    jsonl.write_text("".join(json.dumps({"text": r["text"], "score": r["score"]}) + "\n" for r in scored))
    where = "score >= 0.5"
    local = pack_api([jsonl], tmp_path / "local", where=where, **SMALL).output
    name = load_index(local).inputs[0]["path"]
    opts = options(sources=[name], where=where)
    manifest = pack_part([{**r, "source": name} for r in scored], 0, str(tmp_path / "parts"), opts)
    assert (manifest.documents, manifest.skipped) == (400, 200)
    merge([str(tmp_path / "parts")], str(tmp_path / "merged"))
    assert documents_by_origin(tmp_path / "merged") == documents_by_origin(local)
    assert load_index(tmp_path / "merged").skipped["counts"] == {"filtered": 200}
    with pytest.raises(PackError, match="split and input_format say how to read input files"):
        pack_part(scored, 0, str(tmp_path / "x"), options(split="paragraph"))


def test_the_tokenizer_is_loaded_once_per_process(tmp_path, monkeypatch):
    _, records = source_records(N)
    loads = []

    def counted(*args, **kw):
        loads.append(args)
        return real(*args, **kw)

    real = part_module.load_tokenizer
    monkeypatch.setattr(part_module, "load_tokenizer", counted)
    TOKENIZERS.reset()
    for part in range(3):
        pack_part(records[part * 10 : part * 10 + 10], part, str(tmp_path), options())
    assert len(loads) == 1
    pack_part(records[:10], 0, str(tmp_path / "other"), options(eos_token="<|endoftext|>"))
    assert len(loads) == 2  # other special tokens: another tokenizer


def test_a_duplicate_attempt_waits_for_the_part_and_finds_it_committed(tmp_path, monkeypatch):
    _, records = source_records(N)
    first = pack_part(records[:100], 3, str(tmp_path), options())
    monkeypatch.setattr(part_module, "LOCK_POLL_S", 0.05)
    running = OutputLock(storage.Output(part_url(str(tmp_path), 3)), "pack part").acquire()  # another attempt
    found = {}
    duplicate = threading.Thread(target=lambda: found.update(m=pack_part(records[:100], 3, str(tmp_path), options())))
    duplicate.start()
    time.sleep(0.3)
    assert duplicate.is_alive()  # waiting for the running attempt, not refused
    running.release()
    duplicate.join(30)
    assert found["m"] == first  # the committed part, its records read again, none tokenized
    monkeypatch.setattr(part_module, "LOCK_WAIT_S", 0.2)
    held = pytest.raises(PackError, match=r"being written by another .* \(waited 0 s for it\)")
    with OutputLock(storage.Output(part_url(str(tmp_path), 3)), "pack part"), held:
        pack_part(records[:100], 3, str(tmp_path), options())


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda ix: ix["options"].update(prefix="../../escaped"), "prefix '../../escaped' cannot name shards"),
        (lambda ix: ix["options"].update(parts=10**12), "parts must be an integer from 1 to 1,000,000"),
        (lambda ix: ix["options"].update(part_id="0"), "part_id"),
        (lambda ix: ix["inputs"][0].update(index=[0]), r"inputs\[0\] is not an input entry"),
        (lambda ix: ix["inputs"].append("x"), r"inputs\[1\] is not an input entry"),
        (lambda ix: ix["skipped"].update(records=[{"file": ["x"], "line": 1}]), r"skipped.records\[0\]"),
        (lambda ix: ix["skipped"].update(counts={"empty": -1}), "skipped.counts"),
        (lambda ix: ix["shards"][0].update(name="../outside.tar"), "refusing shard name"),
        (lambda ix: ix["lengths_file"].update(name="/etc/passwd"), "refusing shard name"),
    ],
    ids=["prefix", "parts", "part_id", "input", "inputs", "skip-record", "skip-count", "shard", "side-file"],
)
def test_merge_refuses_a_hostile_part_manifest_by_name(tmp_path, edit, message):
    _, records = source_records(N)
    good = _cached_part(records)
    shutil.copytree(good, tmp_path / "in" / "part-00000")
    manifest = tmp_path / "in" / "part-00000" / "index.json"
    body = json.loads(manifest.read_text())
    edit(body)
    manifest.write_text(json.dumps(body))
    with pytest.raises(WdsllmError, match=message) as refused:
        merge([str(tmp_path / "in")], str(tmp_path / "out"))
    assert str(manifest) in str(refused.value)
    assert not (tmp_path / "out").exists() or not visible_files(tmp_path / "out")
    assert sorted(p.name for p in good.iterdir()) == sorted(p.name for p in manifest.parent.iterdir())


def test_merge_refuses_a_shard_that_is_a_symbolic_link(tmp_path):
    _, records = source_records(N)
    shutil.copytree(_cached_part(records), tmp_path / "in" / "part-00000")
    shard = tmp_path / "in" / "part-00000" / "shard-000000.tar"
    outside = tmp_path / "outside.tar"
    shard.rename(outside)
    shard.symlink_to(outside)
    with pytest.raises(MergeError, match="shard-000000.tar is a symbolic link"):
        merge([str(tmp_path / "in")], str(tmp_path / "out"))


def _cached_part(records: list[dict]):
    """One small committed part, packed once for the session (copied before a test edits it)."""
    return cached("pack-part-100", lambda d: Path(pack_part(records[:100], 0, str(d), options()).url))


def test_a_retry_on_another_node_takes_over_the_dead_attempts_remote_part(tmp_path, s3_bucket, monkeypatch, caplog):
    """On an object store the dead attempt's lock stays (no kernel releases it): the retry waits
    until its heartbeat is stale, takes it over and continues the part from its cursor."""
    _, records = source_records(N)
    records = records[:300]
    whole = pack_part(records, 0, str(tmp_path), options())
    out = f"{s3_bucket}/packed"
    with pytest.raises(Preempted):
        pack_part(preempted_after(records, 200), 0, out, options())
    ghost = {"pid": 1, "host": "another-node", "job": "pack part", "heartbeat": time.time()}
    storage.Output(part_url(out, 0)).put_bytes(lock_module.LOCK_NAME, json.dumps(ghost).encode())
    monkeypatch.setattr(lock_module, "STALE_AFTER", 1.0)
    monkeypatch.setattr(part_module, "LOCK_POLL_S", 0.2)
    with caplog.at_level(logging.INFO, logger="wdsllm.pack"):
        retried = pack_part(records, 0, out, options())
    said = [r.getMessage() for r in caplog.records]
    assert [m for m in said if "another-node" in m and "waiting up to" in m]
    assert [m for m in said if "taking over a lock" in m]
    assert retried.resumed_shards > 0 and retried.digest == whole.digest


def test_merge_refuses_the_parts_a_refused_run_wrote_beside_another_splits(tmp_path):
    """#43: a re-run split otherwise is refused by the task that finds a part of other rows, but
    its other tasks may have written parts first (at indexes the first run has no part for): a
    hand-run merge combined both splits and packed documents twice. Each part records its run,
    the refusal is recorded in the output, and merge refuses that run's parts by name; the run's
    tasks that start after the refusal write nothing."""
    name, records = source_records(N)
    records, out = records[:1200], str(tmp_path)
    first, second = options(sources=[name], run="first"), options(sources=[name], run="second")
    for i, block in enumerate(blocks(records, 2)):
        pack_part(block, i, out, first)
    four = blocks(records, 4)
    pack_part(four[3], 3, out, second)  # a task of the second run that found no part at its index
    with pytest.raises(OtherRowsError, match=r"part-00000 holds other input than this task's"):
        pack_part(four[0], 0, out, second)
    with pytest.raises(OtherRowsError, match=r"part-00002: not packed, as run 'second' was refused at part-00000"):
        pack_part(four[2], 2, out, second)  # started after the refusal: stops before writing
    assert not (tmp_path / "part-00002").exists()
    with pytest.raises(MergeError) as refused:
        merge([out], out)
    message = str(refused.value)
    assert "part-00003 were written by run 'second', which was refused at part-00000" in message
    assert "part-00001" not in message.split(" were written")[0] and "pack some documents twice" in message
    assert "holds other input than this task's (600 records" in message and "Remove that run's parts" in message
    with pytest.raises(MergeError, match="part-00003 were written by run 'second'"):
        merge([str(tmp_path / "part-00003"), str(tmp_path / "part-00000")], str(tmp_path / "merged"))
    shutil.rmtree(tmp_path / "part-00003")  # the remedy: the refused run's parts removed
    index, parts = merge([out], out)
    assert len(parts) == 2 and index.documents == 1200 and len(documents_by_origin(tmp_path)) == 1200
    assert "run" not in load_index(tmp_path).options  # the merged dataset keeps no run
    assert not [f for f in visible_files(tmp_path) if f.startswith("_refused")]  # the record retired with the parts


def test_a_rerun_reuses_parts_of_another_run_of_the_same_split_and_merges_them(tmp_path):
    """Runs are not compared: a re-run after a crash reuses the parts of the run before it (each
    holds its task's rows) and writes the rest under its own name; one merge takes them all."""
    _, records = source_records(N)
    records, out = records[:900], str(tmp_path)
    three = blocks(records, 3)
    pack_part(three[1], 1, out, options(run="crashed"))
    manifests = [pack_part(block, i, out, options(run="rerun")) for i, block in enumerate(three)]
    assert [m.resumed_shards for m in manifests] == [0, 0, 0]
    assert load_index(tmp_path / "part-00001").options["run"] == "crashed"  # reused as it was
    assert load_index(tmp_path / "part-00002").options["run"] == "rerun"
    index, _ = merge([out], out)
    assert index.documents == 900


def test_parts_of_two_numbers_of_parts_are_parts_of_two_splits_and_never_merged(tmp_path):
    """Engines that know their number of parts (datatrove's world size, ``parts=``) need no run:
    a relaunch with another number is refused where it finds a part of the other number (it was
    replaced as a part of other options before), and the parts it wrote before that say another
    number, which merge refuses as another split."""
    _, records = source_records(N)
    records, out = records[:600], str(tmp_path)
    for i, block in enumerate(blocks(records, 2)):
        pack_part(block, i, out, options(parts=2))
    three = blocks(records, 3)
    pack_part(three[2], 2, out, options(parts=3))  # no part at index 2 yet: written
    before = dataset_files(tmp_path / "part-00000")
    with pytest.raises(OtherRowsError, match="part-00000 is one of 2 parts; this task is one of 3: a run that split"):
        pack_part(three[0], 0, out, options(parts=3))
    assert dataset_files(tmp_path / "part-00000") == before  # refused, never replaced
    with pytest.raises(MergeError, match=r"part-00002 with .*part-00000: they are parts of two splits of the input"):
        merge([out], out)


def test_merge_refuses_a_refusal_record_it_did_not_write(tmp_path):
    _, records = source_records(N)
    pack_part(records[:100], 0, str(tmp_path), options(run="one"))
    (tmp_path / "_refused").mkdir()
    (tmp_path / "_refused" / "run-0.json").write_bytes(b"[" * 100_000)
    with pytest.raises(MergeError, match=r"_refused/run-0.json is not a refusal record wdsllm wrote"):
        merge([str(tmp_path)], str(tmp_path))
