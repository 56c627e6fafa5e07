"""Count sidecars and the raw inputs they count (#31): a sidecar is sealed by a digest of its own,
records each input's version, and is refused by name when truncated, bit-flipped, edited, or
when an input was rewritten (even at the same size, locally or in S3/GCS)."""

from __future__ import annotations

import io
import json
import logging
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
from pack_helpers import GPT2

import wdsllm
from wdsllm import storage
from wdsllm.errors import ConfigError, SourceError
from wdsllm.load.options import RawTextSource
from wdsllm.load.raw import open_raw
from wdsllm.load.rawcount import count_raw, load_counts, save_counts


def _corpus(path, n: int = 200, word: str = "alpha") -> None:
    path.write_text("".join(json.dumps({"text": f"{word} document {i:05d}"}) + "\n" for i in range(n)))


def _counted(tmp_path, inputs=None):
    inputs = inputs or str(tmp_path / "docs.jsonl")
    catalog = open_raw(inputs, tokenizer=str(GPT2), unit_bytes=2000)
    sidecar = str(tmp_path / "counts.npz")
    save_counts(count_raw(catalog), catalog, sidecar)
    return inputs, sidecar


@pytest.fixture
def counted(tmp_path):
    _corpus(tmp_path / "docs.jsonl")
    return _counted(tmp_path)


def _load(inputs, sidecar):
    return load_counts(sidecar, open_raw(inputs, tokenizer=str(GPT2), unit_bytes=2000))


def test_a_sidecar_loads_and_records_versions(counted):
    inputs, sidecar = counted
    counts = _load(inputs, sidecar)
    assert int(counts.documents.sum()) == 200 and len(counts.documents) > 1
    with np.load(sidecar) as z:
        meta = json.loads(z["meta"].tobytes())
    assert meta["version"] == 3 and meta["paths"] == [os.path.realpath(inputs)] and len(meta["digest"]) == 64
    assert meta["inputs"] == [f"size={os.path.getsize(inputs)} mtime_ns={os.stat(inputs).st_mtime_ns}"]


@pytest.mark.parametrize("cut", [0.3, 0.6, 0.95])
def test_a_truncated_sidecar_is_a_named_error(counted, cut):
    inputs, sidecar = counted
    data = Path(sidecar).read_bytes()
    Path(sidecar).write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(ConfigError, match=r"counts\.npz: not a wdsllm count sidecar"):
        _load(inputs, sidecar)


def test_every_flipped_bit_region_is_a_named_error(counted):
    inputs, sidecar = counted
    data = Path(sidecar).read_bytes()
    catalog = open_raw(inputs, tokenizer=str(GPT2), unit_bytes=2000)
    for at in range(0, len(data), max(1, len(data) // 40)):
        bad = bytearray(data)
        bad[at] ^= 0x10
        Path(sidecar).write_bytes(bytes(bad))
        try:
            counts = load_counts(sidecar, catalog)
        except ConfigError as exc:
            assert "counts.npz" in str(exc)
        else:  # a flip that changes nothing read (zip padding, an unused header field) must leave it equal
            assert int(counts.documents.sum()) == 200


def _rewrite(sidecar, edit) -> None:
    """The sidecar re-saved as a valid npz after ``edit(arrays, meta)``."""
    with np.load(sidecar) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays.pop("meta").tobytes())
    edit(arrays, meta)
    buf = io.BytesIO()
    np.savez(buf, **arrays, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))
    Path(sidecar).write_bytes(buf.getvalue())


def test_an_edited_count_is_refused(counted):
    inputs, sidecar = counted

    def minus_ten(arrays, meta):
        arrays["documents"] = arrays["documents"].copy()
        arrays["documents"][0] -= 10

    _rewrite(sidecar, minus_ten)
    with pytest.raises(ConfigError, match=r"does not match its digest: it was edited or damaged"):
        _load(inputs, sidecar)

    def unsealed(arrays, meta):  # an old (version 1) sidecar: no digest, its counts must still add up
        meta["version"] = 1
        del meta["digest"], meta["inputs"]

    _rewrite(sidecar, unsealed)
    with pytest.raises(ConfigError, match=r"lists 200 lengths for 190 documents"):
        _load(inputs, sidecar)


def test_a_version_1_sidecar_still_loads_with_a_warning(counted, caplog):
    inputs, sidecar = counted

    def old(arrays, meta):
        meta["version"] = 1
        del meta["digest"], meta["inputs"]

    _rewrite(sidecar, old)
    with caplog.at_level(logging.WARNING, logger="wdsllm.load.rawcount"):
        assert int(_load(inputs, sidecar).documents.sum()) == 200
    assert "version 1 count sidecar" in caplog.text


def test_an_input_rewritten_at_the_same_size_is_refused(counted, tmp_path):
    inputs, sidecar = counted
    size = os.path.getsize(inputs)
    _corpus(tmp_path / "docs.jsonl", word="omega")  # same length, other text
    assert os.path.getsize(inputs) == size
    with pytest.raises(ConfigError, match=r"docs\.jsonl changed since it was counted"):
        _load(inputs, sidecar)


def test_an_input_rewritten_while_a_loader_reads_it_is_named(tmp_path):
    path = tmp_path / "docs.jsonl"
    _corpus(path, 20_000)
    source = RawTextSource(str(path), tokenizer=str(GPT2), unit_bytes=20_000)
    loader = wdsllm.loader(source, batch_size=8, num_workers=0, shuffle_buffer=16)
    batches = iter(loader)
    next(batches)
    _corpus(path, 20_000, word="omega")
    with pytest.raises(SourceError, match=r"docs\.jsonl: changed since it was listed"):
        list(batches)


def _replace_object(url: str, data: bytes) -> None:
    root, _, name = url.rpartition("/")
    out = storage.Output(root)
    try:
        out.put_bytes(name, data)
    finally:
        out.close()


@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_a_remote_object_replaced_at_the_same_size_is_refused(request, tmp_path, store):
    bucket = request.getfixturevalue("s3_bucket" if store == "s3" else "gcs_bucket")
    _corpus(tmp_path / "docs.jsonl")
    url = f"{bucket}/raw/docs.jsonl"
    _replace_object(url, (tmp_path / "docs.jsonl").read_bytes())
    _, sidecar = _counted(tmp_path, url)
    assert int(_load(url, sidecar).documents.sum()) == 200
    _corpus(tmp_path / "other.jsonl", word="omega")
    _replace_object(url, (tmp_path / "other.jsonl").read_bytes())
    with pytest.raises(ConfigError, match=r"docs\.jsonl changed since it was counted"):
        _load(url, sidecar)


def test_a_sidecar_that_is_not_a_zip_or_lacks_arrays_is_named(counted):
    inputs, sidecar = counted
    Path(sidecar).write_bytes(b"not a zip at all")
    with pytest.raises(ConfigError, match=r"counts\.npz: not a wdsllm count sidecar"):
        _load(inputs, sidecar)
    with zipfile.ZipFile(sidecar, "w") as z:
        z.writestr("meta.npy", b"")
    with pytest.raises(ConfigError, match=r"counts\.npz: not a wdsllm count sidecar"):
        _load(inputs, sidecar)


def test_an_input_rewritten_with_its_old_mtime_is_caught_by_its_token_counts(tmp_path):
    """A copy that keeps the old mtime (cp -p, rsync -t) passes the version check; every document
    read is still checked against the tokens the sidecar counted for it."""
    path = tmp_path / "docs.jsonl"
    _corpus(path, 2000, word="alphaalpha")
    inputs, sidecar = _counted(tmp_path)
    st = os.stat(path)
    _corpus(path, 2000, word="a,b,c,d,e,")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size
    source = RawTextSource(inputs, tokenizer=str(GPT2), unit_bytes=2000, counts=sidecar)
    with pytest.raises(
        SourceError,
        match=r"docs\.jsonl#bytes=\d+-\d+: the document at line \d+ has \d+ tokens, the count sidecar counted \d+",
    ):
        list(wdsllm.loader(source, batch_size=8, num_workers=0))


def test_a_changed_text_of_the_same_token_lengths_is_caught_by_the_unit_digest(tmp_path):
    """Raw text has no checksum of its own: `wdsllm count` records an xxh3 of each unit's parsed
    texts, and a unit read to its end is compared with it (a corrupting transport, or two lines
    swapped in place keeping the size, the mtime and every document's token count)."""
    path = tmp_path / "docs.jsonl"
    _corpus(path, 400)
    inputs, sidecar = _counted(tmp_path)
    lines = path.read_text().splitlines(keepends=True)
    lengths = load_counts(sidecar, open_raw(inputs, tokenizer=str(GPT2), unit_bytes=2000)).lengths
    i = next(k for k in range(1, 50) if lengths[k] == lengths[k + 1] and len(lines[k]) == len(lines[k + 1]))
    lines[i], lines[i + 1] = lines[i + 1], lines[i]
    st = os.stat(path)
    path.write_text("".join(lines))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    source = RawTextSource(inputs, tokenizer=str(GPT2), unit_bytes=2000, counts=sidecar)
    with pytest.raises(
        SourceError, match=r"docs\.jsonl#bytes=0-\d+: its documents' text differs from what `wdsllm count` read"
    ):
        list(wdsllm.loader(source, batch_size=8, num_workers=0))


def test_a_sidecar_counted_over_a_relative_path_serves_the_absolute_path(tmp_path, monkeypatch):
    """#43: it was refused, the message printing identical settings on both sides."""
    monkeypatch.chdir(tmp_path)
    _corpus(tmp_path / "docs.jsonl")
    _, sidecar = _counted(tmp_path, "docs.jsonl")
    absolute = str(tmp_path / "docs.jsonl")
    assert int(_load(absolute, sidecar).documents.sum()) == 200
    (tmp_path / "sub").mkdir()
    assert int(_load("sub/../docs.jsonl", sidecar).documents.sum()) == 200
    source = RawTextSource(absolute, tokenizer=str(GPT2), counts=sidecar, unit_bytes=2000)
    loader = wdsllm.loader(source, batch_size=8, num_workers=0)
    assert sum(len(b["docs"]) for b in loader) == 200 and len(loader) == 25


def test_a_sidecar_of_other_inputs_or_settings_names_what_differs(counted, tmp_path):
    inputs, sidecar = counted
    with pytest.raises(
        ConfigError, match=r"counts other inputs or settings: eos_id differs \(counted: 50256; here: None\)"
    ):
        load_counts(sidecar, open_raw(inputs, tokenizer=str(GPT2), unit_bytes=2000, eos=False))
    with pytest.raises(ConfigError, match=r"it counts \d+ units, the source has 1 \(another unit_bytes\?\)"):
        load_counts(sidecar, open_raw(inputs, tokenizer=str(GPT2)))
    _corpus(tmp_path / "other.jsonl")
    other = str(tmp_path / "other.jsonl")
    with pytest.raises(ConfigError, match=rf"input file 0 differs \(counted: '{inputs}'; here: '{other}'\)"):
        _load(other, sidecar)


def test_a_version_2_sidecar_still_loads_with_the_paths_it_was_given(tmp_path, monkeypatch):
    import wdsllm.load.rawcount as rawcount

    monkeypatch.chdir(tmp_path)
    _corpus(tmp_path / "docs.jsonl")
    monkeypatch.setattr(rawcount, "COUNTS_VERSION", 2)
    _, sidecar = _counted(tmp_path, "docs.jsonl")
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert int(_load("docs.jsonl", sidecar).documents.sum()) == 200
    absolute = str(tmp_path / "docs.jsonl")
    with pytest.raises(
        ConfigError, match=r"unit 0 differs \(counted: 'docs.jsonl#bytes=0-\d+'; here: '/.*before version 3"
    ):
        _load(absolute, sidecar)
