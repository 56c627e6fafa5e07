"""A raw-text state names the versions of the text it was saved over (#31): a file rewritten at
the same size between the save and the resume is refused when the state is loaded, with or
without a count sidecar; the sidecar itself still loads for untouched inputs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pack_helpers import GPT2, cli, wiki_lines

import wdsllm
from wdsllm import RawTextSource
from wdsllm.errors import ConfigError, StateError


def _loader(inputs: list[str], counts: str | None = None):
    source = RawTextSource(inputs, tokenizer=str(GPT2), unit_bytes=20_000, counts=counts)
    return wdsllm.loader(source, batch_size=4, seed=1, _in_process=True)


def _rewrite_same_size(path: str) -> None:
    """Another text of the same bytes count (letters swapped), with a later mtime."""
    data = Path(path).read_bytes()
    swapped = data.replace(b"e", b"\x00").replace(b"a", b"e").replace(b"\x00", b"a")
    assert swapped != data and len(swapped) == len(data)
    stat = os.stat(path)
    with open(path, "wb") as f:
        f.write(swapped)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


@pytest.mark.parametrize("with_counts", [False, True])
def test_a_state_over_a_file_rewritten_at_the_same_size_is_refused(tmp_path, with_counts):
    path = tmp_path / "wiki.jsonl"
    path.write_text("\n".join(wiki_lines(60)) + "\n", encoding="utf-8")
    inputs = [str(path)]
    kw = {}
    if with_counts:
        kw["counts"] = str(tmp_path / "counts.npz")
        cli("count", *inputs, "-t", str(GPT2), "--unit-bytes", "20000", "-o", kw["counts"])
    loader = _loader(inputs, **kw)
    it = iter(loader)
    next(it)
    next(it)
    state = loader.state_dict()
    _loader(inputs, **kw).load_state_dict(state)  # the same text: resumed
    _rewrite_same_size(str(path))
    if with_counts:  # the sidecar names the change first
        with pytest.raises(ConfigError, match="changed since it was counted"):
            _loader(inputs, **kw)
        return
    with pytest.raises(StateError):
        _loader(inputs).load_state_dict(state)


@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_a_state_over_an_object_replaced_at_the_same_size_is_refused(request, store):
    """The version the store lists (S3 ETag on moto, the GCS emulator's generation or md5) is part
    of the state's fingerprint: an object replaced by other text of the same size is refused."""
    from wdsllm import storage

    bucket = request.getfixturevalue("s3_bucket" if store == "s3" else "gcs_bucket")
    data = ("\n".join(wiki_lines(30)) + "\n").encode()
    swapped = data.replace(b"e", b"\x00").replace(b"a", b"e").replace(b"\x00", b"a")
    out = storage.Output(f"{bucket}/raw")
    try:
        out.put_bytes("wiki.jsonl", data)
    finally:
        out.close()
    inputs = [f"{bucket}/raw/wiki.jsonl"]
    loader = _loader(inputs)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    _loader(inputs).load_state_dict(state)  # the same object: resumed
    out = storage.Output(f"{bucket}/raw")
    try:
        out.put_bytes("wiki.jsonl", swapped)
    finally:
        out.close()
    with pytest.raises(StateError):
        _loader(inputs).load_state_dict(state)
