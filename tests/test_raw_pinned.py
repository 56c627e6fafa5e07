"""Every read of a remote raw input in an epoch is of the version its listing gave (#31): an object
replaced at the same size between two units of one epoch is refused by name, never read as a mix
of two versions' documents. On real servers: moto and Azurite honour ``If-Match`` (a 412), the GCS
emulator ignores ``generation=`` (the generation each answer reports is compared instead), and our
HTTP server sends ETags but ignores ``If-Match`` (its answers' ETags are compared)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pack_helpers import GPT2, cli, wiki_lines

import wdsllm
from wdsllm import RawTextSource, storage
from wdsllm.errors import SourceError, StorageError
from wdsllm.storage import versions

CHANGED = "changed during the epoch or pack that reads it"
STORES = {"s3": "s3_bucket", "gs": "gcs_bucket", "az": "az_container", "http": "http_server"}
#: what refuses the replaced object: the store (a 412 to If-Match) or the version its answer reports
REFUSED_BY = {"s3": "store refused it", "az": "store refused it", "gs": "store now has gen:", "http": "store now has"}


def _text(lines: int = 30) -> tuple[bytes, bytes]:
    """Some JSON lines, and other text of the same size (letters swapped)."""
    data = ("\n".join(wiki_lines(lines)) + "\n").encode()
    swapped = data.replace(b"e", b"\x00").replace(b"a", b"e").replace(b"\x00", b"a")
    assert swapped != data and len(swapped) == len(data)
    return data, swapped


class Place:
    """A folder of one store for one test's objects: ``put`` writes (or replaces) one."""

    def __init__(self, base: str, http_root: Path | None = None) -> None:
        self.base = base.rstrip("/")
        self.http_root = http_root

    @classmethod
    def on(cls, request: pytest.FixtureRequest, store: str) -> Place:
        fixture = request.getfixturevalue(STORES[store])
        if store == "http":
            return cls(fixture.url_for("raw"), fixture.root / "raw")
        return cls(f"{fixture}/raw")

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"

    def put(self, name: str, data: bytes) -> None:
        if self.http_root is not None:  # the server's ETag is size and mtime: a new mtime, a new version
            path = self.http_root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            before = path.stat().st_mtime_ns if path.exists() else 0
            path.write_bytes(data)
            if before:
                os.utime(path, ns=(before + 10**9, before + 10**9))
            return
        out = storage.Output(self.base)
        try:
            out.put_bytes(name, data)
        finally:
            out.close()


def _loader(inputs: list[str], workers: int = 0, **source: object):
    # units of ~1.5 KB: the text is several units, read one after another
    raw = RawTextSource(inputs, tokenizer=str(GPT2), unit_bytes=1500, **source)
    kw = {"num_workers": workers} if workers else {"_in_process": True}
    return wdsllm.loader(raw, batch_size=2, seed=1, shuffle=False, **kw)


def _drain(batches) -> None:
    for _ in batches:
        pass


@pytest.mark.parametrize("store", list(STORES))
def test_an_object_replaced_between_two_units_is_refused_by_name(request, store):
    place = Place.on(request, store)
    data, swapped = _text()
    place.put("wiki.jsonl", data)
    loader = _loader([place.url("wiki.jsonl")])
    assert len(loader.catalog.units) >= 3, "several units, so that one is read after the replacement"
    it = iter(loader)
    next(it)  # unit 0 is read
    place.put("wiki.jsonl", swapped)
    with pytest.raises(StorageError, match=CHANGED) as info:
        _drain(it)
    assert str(info.value).startswith(storage.redact(place.url("wiki.jsonl")) + ":"), info.value
    assert REFUSED_BY[store] in str(info.value), info.value


def test_workers_read_the_version_the_loader_listed(request):
    """Two DataLoader workers read their units at the version listed in the loader's process."""
    place = Place.on(request, "s3")
    data, swapped = _text()
    place.put("wiki.jsonl", data)
    loader = _loader([place.url("wiki.jsonl")], workers=2)
    place.put("wiki.jsonl", swapped)  # after the loader listed it, before a worker reads it
    with pytest.raises(StorageError, match=CHANGED) as info:
        _drain(loader)
    assert storage.redact(place.url("wiki.jsonl")) in str(info.value), info.value


def test_a_counted_object_replaced_mid_epoch_is_refused_by_its_read(request, tmp_path):
    """With a count sidecar the version counted is the version read: the replaced object is
    refused by the pinned read itself, before its text is parsed and compared with the counts."""
    place = Place.on(request, "gs")
    data, swapped = _text()
    place.put("wiki.jsonl", data)
    inputs = [place.url("wiki.jsonl")]
    counts = str(tmp_path / "counts.npz")
    cli("count", *inputs, "-t", str(GPT2), "--unit-bytes", "1500", "-o", counts)
    it = iter(_loader(inputs, counts=counts))
    next(it)
    place.put("wiki.jsonl", swapped)
    with pytest.raises(StorageError, match=CHANGED):
        _drain(it)


def test_a_changed_object_is_never_skipped_as_unreadable(request, monkeypatch):
    """A unit read as several blocks meets the change inside its stream, where damage is
    skipped with on_error="skip": a changed version is an error whatever on_error says."""
    from wdsllm.storage import parallel

    monkeypatch.setattr(parallel, "BLOCK_SIZE", 512)
    place = Place.on(request, "http")
    data, swapped = _text()
    place.put("wiki.jsonl", data)
    it = iter(_loader([place.url("wiki.jsonl")], on_error="skip"))
    next(it)
    place.put("wiki.jsonl", swapped)
    with pytest.raises(SourceError, match=CHANGED):  # a source error too, as a local file rewritten
        _drain(it)


@pytest.mark.parametrize("store", list(STORES))
def test_a_listing_and_an_answer_give_one_version(request, store):
    """The version a listing (or a stat) gives is the one an answer carries, on every store, so
    a read pinned to it reads; a ranged file (Parquet's reads) pinned to it refuses a new one."""
    place = Place.on(request, store)
    data, swapped = _text(10)
    place.put("a.jsonl", data)
    url = place.url("a.jsonl")
    stated = storage.stat_object(url)
    if store != "http":  # http(s) cannot be listed
        assert [o.version for o in storage.list_prefix(place.base + "/")] == [stated.version]
    with storage.open_stream(url, version=stated.version) as f:
        assert f.read() == data
    ranged = storage.open_ranged(url, stated.size, version=stated.version)
    assert ranged.read(100) == data[:100]
    place.put("a.jsonl", swapped)
    with pytest.raises(versions.VersionChangedError, match=CHANGED):
        ranged.read(100)


def test_a_deleted_object_is_refused_as_changed_on_gcs(request):
    """A read pinned to a GCS generation that is gone (404) says the object changed."""
    place = Place.on(request, "gs")
    place.put("a.txt", b"x" * 100)
    listed = storage.stat_object(place.url("a.txt"))
    out = storage.Output(place.base)
    try:
        out.delete("a.txt")
    finally:
        out.close()
    with pytest.raises(versions.VersionChangedError, match="the store refused it"):
        storage.open_stream(place.url("a.txt"), version=listed.version)


def test_a_hub_file_is_read_at_the_commit_listed(fake_hub):
    """A Hub file's version is its commit: a read pinned to it reads that commit's bytes after
    the branch moved on (the Hub keeps both), where an unpinned read sees the new commit."""
    repo = fake_hub.add_repo("org/pinned", {"a.txt": b"first version\n"})
    url = "hf://datasets/org/pinned/a.txt"
    storage.reset()
    listed = storage.list_prefix("hf://datasets/org/pinned/")[0]
    assert listed.version.startswith("commit:")
    repo.commit({"a.txt": b"second, longer version\n"})
    storage.reset()  # a new process: "main" resolves to the new commit
    with storage.open_stream(url, version=listed.version) as f:
        assert f.read() == b"first version\n"
    assert storage.read_bytes(url) == b"second, longer version\n"


def test_versions_are_written_one_way():
    assert versions.entity_tag("abc") == versions.entity_tag('"abc"') == '"abc"'
    assert versions.entity_tag('W/"abc"') == 'W/"abc"'
    assert versions.entity_tag(None) == ""
    assert versions.generation(17) == "gen:17" and versions.pinned_generation("gen:17") == "17"
    assert versions.http_conditions('"abc"') == {"If-Match": '"abc"'}
    assert versions.http_conditions('W/"abc"') == {}  # a weak tag never matches If-Match: compared only
    date = "Wed, 21 Oct 2015 07:28:00 GMT"
    assert versions.http_conditions(versions.modified(date)) == {"If-Unmodified-Since": date}


def test_every_request_of_an_epoch_asks_for_the_listed_version(request, fault_proxy):
    """Over http(s), seen at a proxy: every GET after the listing's carries the listed ETag as
    If-Match, each unit's first one included; a 412 to it is the changed object, by name."""
    place = Place.on(request, "http")
    data, _ = _text()
    place.put("wiki.jsonl", data)
    proxy = fault_proxy(request.getfixturevalue("http_server").url)
    url = f"{proxy.url}/raw/wiki.jsonl"
    loader = _loader([url])
    listed = loader.catalog.inputs[0].version
    assert listed.startswith('"')
    _drain(loader)
    gets = [headers for method, path, headers in proxy.log if method == "GET" and path.endswith("/wiki.jsonl")]
    assert len(gets) > len(loader.catalog.units)  # the listing's probe, then each unit's reads
    assert [h.get("If-Match") for h in gets[1:]] == [listed] * (len(gets) - 1)
    again = _loader([url])  # listed before the store starts refusing
    proxy.add("GET */wiki.jsonl", "status", status=412, times=None)
    with pytest.raises(versions.VersionChangedError, match="store refused it"):
        _drain(again)
