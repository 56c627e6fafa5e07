"""Inputs in object stores: ``wdsllm pack s3://b/raw/*.jsonl.zst``, gs://, az://, http(s):// and
hf:// inputs, against the real emulators (moto, gcp-storage-emulator, Azurite, the fake Hub) and
the fault-injecting HTTP server. The same bytes packed from a store and from a local disk give the
same shards; globs are expanded by listing the store; Parquet reads only the byte ranges of the
columns and row groups it needs; broken connections are resumed; bad remote objects are named by
URL and line; and no secret reaches a message or the index."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import zstandard
from pack_helpers import (
    GPT2,
    cached,
    cli,
    dataset_files,
    load_index,
    pack_api,
    provenance,
    wiki_lines,
    wiki_records,
    write_parquet,
)

from wdsllm import storage
from wdsllm.errors import SourceError, StorageError

ROWS = 900


def corpus() -> Path:
    """Three .jsonl.zst files, a Parquet file of 6 row groups with a large column the pack never
    needs, and a raw-text tar: the same kind of inputs the big corpora ship as."""

    def build(d: Path) -> Path:
        raw = d / "raw"
        raw.mkdir()
        for n in range(3):
            data = ("\n".join(wiki_lines(300, n)) + "\n").encode()
            (raw / f"part-{n}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
        (raw / "README.md").write_text("not an input")
        records = wiki_records(ROWS)
        for i, r in enumerate(records):  # incompressible, and never read: only the text column is
            r["blob"] = random.Random(i).randbytes(1500)
        pq = d / "pq"
        pq.mkdir()
        write_parquet(pq / "wiki.parquet", records, ROWS // 6)
        return d

    return cached("remote-inputs", build)


def local_pack(name: str, inputs: list[Path], **options) -> Path:
    return cached(f"remote-ref-{name}", lambda d: pack_api(inputs, d / "out", **options) and d / "out")


def same_dataset(a: Path, b: Path) -> None:
    """Every file equal but the index, whose input list names other paths; its shards equal too."""
    fa, fb = dataset_files(a), dataset_files(b)
    ia, ib = json.loads(fa.pop("index.json")), json.loads(fb.pop("index.json"))
    assert fa == fb
    assert ia["shards"] == ib["shards"]
    assert [i["bytes"] for i in ia["inputs"]] == [i["bytes"] for i in ib["inputs"]]


def zst_files() -> list[Path]:
    return sorted((corpus() / "raw").glob("*.jsonl.zst"))


def parquet_file() -> Path:
    return corpus() / "pq" / "wiki.parquet"


def upload(url: str, files: list[Path]) -> None:
    out = storage.Output(url)
    try:
        for f in files:
            out.put_bytes(f.name, f.read_bytes())
    finally:
        out.close()


# ----------------------------------------------------------------------------------------------
# Each store: a glob listed from the store, packed as the same files from disk are.


def test_s3_glob_of_jsonl_zst_equals_the_local_pack(s3_server, s3_bucket, tmp_path):
    upload(f"{s3_bucket}/raw/", [*zst_files(), corpus() / "raw" / "README.md"])
    upload(f"{s3_bucket}/raw/deeper/", zst_files()[:1])  # `*` stays in one directory
    result = pack_api([f"{s3_bucket}/raw/*.jsonl.zst"], tmp_path / "out", chunk_bytes=64 << 10)
    same_dataset(tmp_path / "out", local_pack("zst", zst_files(), chunk_bytes=64 << 10))
    assert [i["path"] for i in result.index.inputs] == [f"{s3_bucket}/raw/{f.name}" for f in zst_files()]


def test_s3_directory_and_double_star_globs_list_the_store(s3_server, s3_bucket):
    upload(f"{s3_bucket}/raw/", [*zst_files()[1:], corpus() / "raw" / "README.md"])
    upload(f"{s3_bucket}/raw/deeper/", zst_files()[:1])
    from wdsllm.inputs.sources import expand_inputs

    by_dir = [i.path for i in expand_inputs([f"{s3_bucket}/raw/"])]  # every input kind under it, sorted
    assert by_dir == [
        f"{s3_bucket}/raw/deeper/part-0.jsonl.zst",
        *[f"{s3_bucket}/raw/part-{n}.jsonl.zst" for n in (1, 2)],
    ]
    assert [i.path for i in expand_inputs([f"{s3_bucket}/**/part-0.jsonl.zst"])] == by_dir[:1]
    braces = expand_inputs([f"{s3_bucket}/raw/part-{{2,1}}.jsonl.zst"])
    assert [i.path for i in braces] == by_dir[:0:-1] and braces[0].size == zst_files()[2].stat().st_size
    assert all(i.version for i in braces)  # the ETag: a resumed pack refuses a changed input
    with pytest.raises(SourceError, match="no input files match"):
        expand_inputs([f"{s3_bucket}/raw/*.parquet"])
    with pytest.raises(SourceError, match="input not found"):
        expand_inputs([f"{s3_bucket}/nothing.jsonl"])


def test_gcs_glob_of_parquet_equals_the_local_pack(gcs_bucket, tmp_path):
    # the session's gcs_server fixture has pointed the environment at the emulator: a test that
    # restored it here took it away from every later test
    upload(f"{gcs_bucket}/pq/", [parquet_file()])
    pack_api([f"{gcs_bucket}/pq/*.parquet"], tmp_path / "out", on_error="skip")
    same_dataset(tmp_path / "out", local_pack("parquet", [parquet_file()], on_error="skip"))


def test_azure_jsonl_zst_and_parquet_equal_the_local_pack(azurite, az_container, tmp_path):
    upload(f"{az_container}/data/", [*zst_files(), parquet_file()])
    pack_api([f"{az_container}/data/*.jsonl.zst"], tmp_path / "zst", chunk_bytes=64 << 10)
    same_dataset(tmp_path / "zst", local_pack("zst", zst_files(), chunk_bytes=64 << 10))
    pack_api([f"{az_container}/data/wiki.parquet"], tmp_path / "pq", on_error="skip")
    same_dataset(tmp_path / "pq", local_pack("parquet", [parquet_file()], on_error="skip"))


def test_hf_glob_of_parquet_at_the_revisions_commit(fake_hub, tmp_path):
    files = {"data/train-0.parquet": parquet_file().read_bytes(), "data/notes.txt": b"x", "README.md": b"# card"}
    fake_hub.add_repo("org/corpus", files)
    pack_api(["hf://datasets/org/corpus/data/*.parquet"], tmp_path / "out", on_error="skip")
    same_dataset(tmp_path / "out", local_pack("parquet", [parquet_file()], on_error="skip"))
    index = load_index(tmp_path / "out")
    assert [i["path"] for i in index.inputs] == ["hf://datasets/org/corpus/data/train-0.parquet"]


def test_the_issues_example_hf_glob_packed_into_s3_by_the_cli(fake_hub, s3_server, s3_bucket):
    """`wdsllm pack "hf://datasets/ORG/NAME/data/*.parquet" -o s3://b/fw/ -t tok.json`."""
    fake_hub.add_repo("org/fineweb", {f"sample/10BT/{n:03d}.parquet": parquet_file().read_bytes() for n in range(2)})
    inputs = "hf://datasets/org/fineweb/sample/10BT/*.parquet"
    cli("pack", inputs, "-o", f"{s3_bucket}/fw/", "-t", GPT2, "--on-error", "skip", "--workers", "1", "-q")
    twice = cached(
        "remote-parquet-twice", lambda d: [shutil.copy(parquet_file(), d / f"{n:03d}.parquet") for n in range(2)]
    )
    reference = local_pack("parquet-twice", twice, on_error="skip")
    index = json.loads(s3_server.get(f"{s3_bucket}/fw/index.json"))
    assert [i["path"] for i in index["inputs"]] == [
        f"hf://datasets/org/fineweb/sample/10BT/{n:03d}.parquet" for n in range(2)
    ]
    assert index["totals"] == json.loads((reference / "index.json").read_text())["totals"]
    for shard in load_index(reference).shards:
        assert s3_server.get(f"{s3_bucket}/fw/{shard.name}") == (reference / shard.name).read_bytes()


# ----------------------------------------------------------------------------------------------
# http(s): ranged reads, retries, the work divided by row groups, errors, secrets.


@pytest.fixture
def served(http_server, tmp_path):
    www = tmp_path / "www"
    shutil.copytree(corpus(), www, dirs_exist_ok=True)
    http_server.root = www
    return http_server


def test_parquet_over_http_reads_only_the_needed_column_chunks(served, tmp_path):
    import pyarrow.parquet as pq

    url = served.url_for("pq/wiki.parquet")
    pack_api([url], tmp_path / "out", on_error="skip")
    same_dataset(tmp_path / "out", local_pack("parquet", [parquet_file()], on_error="skip"))
    md = pq.ParquetFile(parquet_file()).metadata
    blob = sum(
        md.row_group(g).column(c).total_compressed_size
        for g in range(md.num_row_groups)
        for c in range(md.num_columns)
        if md.schema.column(c).path == "blob"
    )
    size = parquet_file().stat().st_size
    asked = sum(_range_bytes(r.range, size) for r in served.log("*/wiki.parquet"))
    assert blob > size // 2  # the column the pack does not need is most of the file ...
    assert asked < size - blob  # ... and none of it was downloaded
    assert all(r.range for r in served.log("*/wiki.parquet"))  # ranged reads only


def test_tasks_over_one_remote_parquet_file_share_its_row_groups(served, tmp_path):
    url = served.url_for("pq/wiki.parquet")
    size = parquet_file().stat().st_size
    outs = []
    for t in range(3):
        served.reset()
        pack_api([url], tmp_path / f"t{t}", on_error="skip", num_tasks=3, task_index=t)
        outs.append(tmp_path / f"t{t}" / f"task-{t:05d}")
        asked = sum(_range_bytes(r.range, size) for r in served.log("*/wiki.parquet"))
        assert asked < size // 2  # two of six row groups, text column only (and the footer)
    lines = [p[1] for o in outs for p in provenance(o)]
    assert lines == [p[1] for p in provenance(local_pack("parquet", [parquet_file()], on_error="skip"))]


def test_broken_connections_resume_and_give_the_same_dataset(served, tmp_path):
    served.faults.add("*/part-1.jsonl.zst", "drop_after", bytes=20000, times=2)
    served.faults.add("*/wiki.parquet", "drop_after", bytes=3000, times=3)
    served.faults.add("*/part-2.jsonl.zst", "status", status=503, times=2)
    urls = [served.url_for(f"raw/{f.name}") for f in zst_files()]
    storage.reset_stats()
    pack_api(urls, tmp_path / "zst", chunk_bytes=64 << 10)
    same_dataset(tmp_path / "zst", local_pack("zst", zst_files(), chunk_bytes=64 << 10))
    pack_api([served.url_for("pq/wiki.parquet")], tmp_path / "pq", on_error="skip")
    same_dataset(tmp_path / "pq", local_pack("parquet", [parquet_file()], on_error="skip"))
    assert all(f.exhausted for f in served.faults) and storage.stats()["retries"] >= 5
    assert any(r and not r.startswith("bytes=0-") for r in served.ranges("*/part-1.jsonl.zst"))  # resumed mid-object


def test_a_remote_object_cut_short_is_named_by_url_and_line(served, tmp_path, monkeypatch):
    """A connection that always breaks at the same byte: the retries give up, and the rest of the
    file is one 'unreadable' skip at the line where it broke (or the error, with --on-error raise)."""
    monkeypatch.setattr(storage.DEFAULT_RETRY, "attempts", 2)
    monkeypatch.setattr(storage.DEFAULT_RETRY, "base_delay", 0.01)
    monkeypatch.setattr(storage.retry, "DEFAULT_RETRY", storage.DEFAULT_RETRY)
    url = served.url_for("raw/part-0.jsonl.zst")

    def break_at_30000():
        served.faults.clear()
        served.faults.add("*/part-0.jsonl.zst", "drop_after", bytes=30000, times=2)  # the size probe, the read
        served.faults.add("*/part-0.jsonl.zst", "status", status=500, times=None)  # and every retry

    break_at_30000()
    with pytest.raises(SourceError, match=r"part-0\.jsonl\.zst:\d+: cannot decompress after line \d+"):
        pack_api([url], tmp_path / "raise")
    break_at_30000()
    result = pack_api([url], tmp_path / "skip", on_error="skip")
    (skip,) = result.index.skipped["records"]
    assert skip["reason"] == "unreadable" and skip["file"] == url
    assert len(provenance(tmp_path / "skip")) == skip["line"] - 1  # the lines before it are kept

    # Parquet: the row groups read before the store broke are kept, the rest is one skip
    served.faults.clear()
    served.faults.add("*/wiki.parquet", "delay", seconds=0, times=6)  # the probe, the footer, some row groups
    served.faults.add("*/wiki.parquet", "status", status=500, times=None)
    result = pack_api([served.url_for("pq/wiki.parquet")], tmp_path / "pq", on_error="skip")
    unreadable = [r for r in result.index.skipped["records"] if r["reason"] == "unreadable"]
    first = unreadable[0]["line"]  # one skip per row group it could not read, to the end of the file
    assert first > 1 and sum(r["count"] for r in unreadable) == ROWS - first + 1
    assert all(r["file"].endswith("wiki.parquet") and "byte" in r["detail"] for r in unreadable)
    rows = [line for _, line, _ in provenance(tmp_path / "pq")]
    assert rows and max(rows) < first


def test_a_damaged_remote_parquet_footer_is_named(served, tmp_path):
    (served.root / "pq" / "bad.parquet").write_bytes(parquet_file().read_bytes()[:-100])
    with pytest.raises(SourceError, match=r"bad\.parquet"):
        pack_api([served.url_for("pq/bad.parquet")], tmp_path / "out")


def test_http_globs_need_a_listing_and_say_so(served, tmp_path):
    with pytest.raises(StorageError, match="cannot be listed"):
        pack_api([served.url_for("raw/*.jsonl.zst")], tmp_path / "out")


def test_no_secret_reaches_the_index_or_a_message(served, tmp_path):
    served.require_basic_auth("reader", "pa55word")
    good = served.url_for("raw/part-0.jsonl.zst").replace("://", "://reader:pa55word@") + "?sig=T0KEN"
    result = cli("pack", good, "-t", GPT2, "-o", tmp_path / "out", "--workers", "1")
    index_text = (tmp_path / "out" / "index.json").read_text()
    assert "pa55word" not in index_text and "T0KEN" not in index_text
    assert "pa55word" not in result.stdout + result.stderr
    missing = good.replace("part-0", "part-9")
    failed = cli("pack", missing, "-t", GPT2, "-o", tmp_path / "out2", check=False)
    assert failed.returncode != 0 and "part-9" in failed.stderr
    assert "pa55word" not in failed.stderr and "T0KEN" not in failed.stderr


def _range_bytes(value: str | None, size: int) -> int:
    if not value:
        return size
    lo, _, hi = value.removeprefix("bytes=").partition("-")
    if not lo:
        return int(hi)
    return (int(hi) + 1 if hi else size) - int(lo)


def test_a_killed_pack_of_remote_parquet_resumes_byte_identically_unless_the_input_changed(served, tmp_path):
    from test_pack_resume import SMALL, SMALL_API, kill_midway

    expected = cached(
        "remote-resume-ref",
        lambda d: (pack_api([parquet_file()], d / "out", on_error="skip", **SMALL_API), dataset_files(d / "out"))[1],
    )
    url = served.url_for("pq/wiki.parquet")
    args = [url, "-t", GPT2, *SMALL, "--on-error", "skip"]
    out = tmp_path / "out"
    kill_midway(args, out, expected, min_shards=3)
    cli("pack", *args, "-o", out, "--resume", "-q")
    got = dataset_files(out)
    assert got.pop("index.json") != expected["index.json"]  # it names the URL
    assert got == {k: v for k, v in expected.items() if k != "index.json"}

    again = tmp_path / "again"
    kill_midway(args, again, expected, min_shards=3)
    served_file = served.root / "pq" / "wiki.parquet"
    served_file.write_bytes(served_file.read_bytes())  # a new version (ETag) of the same bytes
    refused = cli("pack", *args, "-o", again, "--resume", "-q", check=False)
    assert refused.returncode != 0 and "differ from the interrupted pack" in refused.stderr


def test_arrow_files_and_raw_text_tars_over_http_equal_the_local_pack(http_server, tmp_path):
    from pack_helpers import write_arrow
    from test_pack_tars import tars

    local = [
        *tars(),
        cached("remote-arrow", lambda d: write_arrow(d / "wiki.arrow", wiki_records(400), 90)),
    ]
    www = tmp_path / "www"
    for f in local:
        shutil.copy(f, www / f.name)
    http_server.root = www
    options = {"on_error": "skip", "text_field": "body.text"}
    pack_api([http_server.url_for(f.name) for f in local[:2]], tmp_path / "tars", **options)
    same_dataset(tmp_path / "tars", local_pack("tars", local[:2], **options))
    pack_api([http_server.url_for("wiki.arrow")], tmp_path / "arrow", on_error="skip", num_tasks=2, task_index=1)
    reference = cached(
        "remote-arrow-ref",
        lambda d: pack_api(local[2:], d / "out", on_error="skip", num_tasks=2, task_index=1) and d / "out",
    )
    same_dataset(tmp_path / "arrow" / "task-00001", reference / "task-00001")
    assert all(r.range for r in http_server.log("*/wiki.arrow"))


def test_tasks_over_one_remote_jsonl_file_split_it_by_byte_ranges(http_server, tmp_path):
    data = ("\n".join(wiki_lines(600)) + "\n").encode()
    (http_server.root / "wiki.jsonl").write_bytes(data)
    local = tmp_path / "wiki.jsonl"
    local.write_bytes(data)
    whole = pack_api([local], tmp_path / "whole")
    lines = []
    for t in range(3):
        pack_api([http_server.url_for("wiki.jsonl")], tmp_path / f"t{t}", num_tasks=3, task_index=t)
        part = [p[1] for p in provenance(tmp_path / f"t{t}" / f"task-{t:05d}")]
        assert part and (not lines or part[0] > lines[-1])
        lines.extend(part)
    assert lines == [p[1] for p in provenance(whole.output)]
