"""The index is untrusted, decoding never unpickles, and ``pipe:`` runs only what the user typed.

A dataset's index.json may come from anyone who can write to a bucket or serve a URL. Its shard
names must never make the loader run a command, open a file outside the dataset root or reach
another host; its shards must never make it unpickle.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pytest
import webdataset as wds
from synth import write_dataset

import wdsllm
from wdsllm import format as fmt
from wdsllm import storage
from wdsllm.load.sources.open import open_source

LOAD = dict(batch_size=8, seed=1)


class RunsOnUnpickle:
    """Unpickling this runs ``touch PATH``: the marker file proves that something unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def dataset(tmp_path):
    """A small real dataset: (directory, {id: tokens})."""
    info = write_dataset(tmp_path / "ds", [12, 9, 14], seed=5)
    return tmp_path / "ds", info["expect"]


@pytest.fixture
def opened(monkeypatch):
    """Every URL that storage.open_stream is asked for (index, lengths, shards), in order."""
    urls: list[str] = []
    real = storage.open_stream

    def spy(url, **kwargs):
        urls.append(url)
        return real(url, **kwargs)

    # the package's name (what readers call) and the module's (what read_bytes and prefetch call)
    monkeypatch.setattr(storage, "open_stream", spy)
    monkeypatch.setattr(storage.resumable, "open_stream", spy)
    monkeypatch.setattr(storage.prefetch, "open_stream", spy)
    return urls


def hostile_names(marker: Path) -> list[str]:
    return [
        f"pipe:touch {marker}",
        f"|touch {marker}",
        "../../etc/passwd",
        "/etc/passwd",
        "http://evil.invalid/x.tar",
        "s3://evil/x.tar",
        "file:///etc/passwd",
        "a/../../b.tar",
        "..",
        "sub\\..\\..\\b.tar",
        "-rf.tar",
        ".hidden.tar",
        "shard\n.tar",
        "",
    ]


def set_shard_name(directory: Path, position: int, name) -> None:
    index = json.loads((directory / "index.json").read_text())
    index["shards"][position]["name"] = name
    (directory / "index.json").write_text(json.dumps(index))


def read_all(source, **kwargs) -> dict[int, np.ndarray]:
    out = {}
    for batch in wdsllm.dataset(source, **LOAD, **kwargs):
        for i, n in enumerate(batch["lengths"].tolist()):
            out[int(batch["docs"][i, 0])] = batch["input_ids"][i, :n].numpy()
    return out


# ----------------------------------------------------------------------------------------------
# A hostile index


def test_hostile_shard_names_in_a_local_index_are_refused_and_nothing_runs(dataset, tmp_path, opened):
    directory, _ = dataset
    marker = tmp_path / "marker"
    for name in hostile_names(marker):
        set_shard_name(directory, 1, name)
        opened.clear()
        with pytest.raises(fmt.FormatError, match="refusing shard name") as info:
            wdsllm.dataset(str(directory), **LOAD)
        assert repr(name) in str(info.value) and "index.json" in str(info.value)
        assert opened == [str(directory / "index.json")], f"{name!r}: only the index may be read, not {opened}"
    for name in (None, 7, ["x.tar"]):
        set_shard_name(directory, 1, name)
        with pytest.raises(fmt.FormatError):
            open_source(str(directory))
    assert not marker.exists()


def test_hostile_shard_names_served_over_http_are_refused_and_nothing_else_is_requested(dataset, tmp_path, http_server):
    marker = tmp_path / "marker"
    shutil.copytree(dataset[0], http_server.root / "ds")
    root = http_server.url_for("ds")
    for name in hostile_names(marker):
        http_server.reset()
        set_shard_name(http_server.root / "ds", 0, name)
        with pytest.raises(fmt.FormatError, match="refusing shard name") as info:
            for _ in wdsllm.loader(root, **LOAD):
                pass
        assert f"{root.rstrip('/')}/index.json" in str(info.value)
        assert [r.path for r in http_server.log(method=None)] == ["/ds/index.json"], name
    assert not marker.exists()


def test_a_hostile_lengths_file_name_is_refused(dataset, tmp_path, opened):
    directory, _ = dataset
    index = json.loads((directory / "index.json").read_text())
    index["lengths_file"]["name"] = "../../etc/passwd"
    (directory / "index.json").write_text(json.dumps(index))
    with pytest.raises(fmt.FormatError, match="refusing shard name '../../etc/passwd'"):
        open_source(str(directory))  # refused as the index is read, before any side file
    assert opened == [str(directory / "index.json")]


@pytest.mark.parametrize("scheme", ["http", "file"])
def test_percent_encoded_names_stay_literal_names_inside_the_root(scheme, dataset, tmp_path, http_server):
    # The dataset lives at a/b/ds; a valid shard sits outside it at a/b/secret.tar. A name that a
    # server (or file:// decoding) would turn into "../secret.tar" must not reach it.
    base = http_server.root if scheme == "http" else tmp_path / "files"
    ds = base / "a" / "b" / "ds"
    shutil.copytree(dataset[0], ds)
    shutil.copy(ds / "shard-000000.tar", base / "a" / "b" / "secret.tar")
    name = "%2e%2e%2fsecret.tar"
    assert fmt.check_shard_name(name) == name  # the format allows it: it is a plain name
    set_shard_name(ds, 0, name)
    root = http_server.url_for("a/b/ds") if scheme == "http" else f"file://{ds}"
    with pytest.raises(storage.NotFoundError, match="secret"):
        for _ in wdsllm.loader(root, **LOAD):
            pass
    if scheme == "http":
        for request in http_server.log(method=None):
            path = unquote(request.path)  # what a decoding server sees
            assert path.startswith("/a/b/ds/") and ".." not in path.split("/"), path


def test_a_hostile_index_beside_user_typed_shards_is_ignored(dataset, tmp_path, http_server, caplog):
    marker = tmp_path / "marker"
    shutil.copytree(dataset[0], http_server.root / "ds")
    set_shard_name(http_server.root / "ds", 2, f"pipe:touch {marker}")
    pattern = http_server.url_for("ds/shard-{000000..000002}.tar")
    catalog = open_source(pattern)
    assert not catalog.index is not None and catalog.urls == storage.expand_urls(pattern)
    assert any("unusable" in r.message and "refusing" in r.message for r in caplog.records)
    got = read_all(pattern)
    assert sorted(got) == sorted(dataset[1]) and all(np.array_equal(got[i], dataset[1][i]) for i in got)
    assert not marker.exists()


# ----------------------------------------------------------------------------------------------
# Decoding never unpickles


def write_shard(path: Path, extra: dict[str, bytes] | None = None, tokens_npy: bytes | None = None) -> None:
    """One-group docs-mode shard, with extra members or a replaced tokens.npy."""
    tokens = np.arange(10, dtype=np.uint16)
    sample = fmt.encode_group(
        fmt.group_key(0, 0),
        tokens,
        lengths=np.array([4, 6], np.uint32),
        meta={"documents": 2, "provenance": [[0, 1, 2]]},
    )
    sample.update(extra or {})
    if tokens_npy is not None:
        sample[fmt.TOKENS] = tokens_npy
    with open(path, "wb") as f:
        writer = wds.TarWriter(f, encoder=False, mtime=0)
        writer.write(sample)
        writer.close()


def test_pickle_members_are_never_loaded(tmp_path):
    marker = tmp_path / "marker"
    payload = pickle.dumps(RunsOnUnpickle(marker))
    shard = tmp_path / "shard-000000.tar"
    write_shard(shard, extra={"pyd": payload, "pickle": payload, "pth": payload})
    got = read_all([str(shard)])
    assert [got[0].tolist(), got[1].tolist()] == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]]
    assert not marker.exists()


def object_npy(marker: Path) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.array([RunsOnUnpickle(marker)], dtype=object), allow_pickle=True)
    return buf.getvalue()


def test_an_object_array_in_a_shard_is_rejected_unread(tmp_path):
    marker = tmp_path / "marker"
    shard = tmp_path / "shard-000000.tar"
    write_shard(shard, tokens_npy=object_npy(marker))
    with pytest.raises(fmt.FormatError, match=r"shard-000000\.tar.*expected a 1-D numeric array"):
        read_all([str(shard)])
    loader = wdsllm.loader([str(shard)], on_error="skip", **LOAD)
    assert list(loader) == [] and loader.skipped_shards == [str(shard)]
    assert not marker.exists()


def test_an_object_array_as_the_lengths_file_is_rejected_unread(dataset, tmp_path):
    import hashlib

    directory, _ = dataset
    marker = tmp_path / "marker"
    data = object_npy(marker)
    (directory / "lengths.npy").write_bytes(data)
    index = json.loads((directory / "index.json").read_text())
    index["lengths_file"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (directory / "index.json").write_text(json.dumps(index))
    with pytest.raises(fmt.FormatError, match="lengths.npy.*expected a 1-D numeric array"):
        open_source(str(directory)).lengths()
    assert not marker.exists()


# ----------------------------------------------------------------------------------------------
# pipe: only from the user


def test_pipe_runs_where_the_user_typed_it(dataset):
    directory, expect = dataset
    got = read_all(f"pipe:cat {directory}/shard-{{000000..000002}}.tar")
    assert sorted(got) == sorted(expect)


def test_pipe_is_refused_where_the_user_did_not_type_it(tmp_path):
    marker = tmp_path / "marker"
    with pytest.raises(storage.StorageError, match="only accepted from the user"):
        storage.open_stream(f"pipe:touch {marker}")
    with pytest.raises(storage.StorageError, match="only accepted from the user"):
        storage.read_bytes(f"pipe:touch {marker}")
    assert not marker.exists()


@pytest.mark.parametrize("how", ["glob", "directory without index"])
def test_a_file_named_like_a_pipe_is_read_as_a_file(how, dataset, tmp_path, monkeypatch):
    directory, _ = dataset
    work = tmp_path / "work"
    work.mkdir()
    name = "pipe:touch marker.tar"  # run by sh, this would create work/marker.tar
    shutil.copy(directory / "shard-000000.tar", work / name)
    monkeypatch.chdir(work)
    source = "*.tar" if how == "glob" else "."
    catalog = open_source(source)
    assert [storage.scheme_of(u) for u in catalog.urls] == ["file"]
    got = read_all(source)
    assert len(got) == 12
    assert not (work / "marker.tar").exists()
