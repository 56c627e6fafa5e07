"""JSON read from datasets and states is bounded in size and nesting (#31): a named error, never a
raw RecursionError, and a huge index.json is not read whole."""

from __future__ import annotations

import json

import pytest

from wdsllm.errors import FormatError, StateError
from wdsllm.format.index import MAX_INDEX_BYTES, read_index, read_index_bytes

DEEP = "[" * 200_000 + "]" * 200_000


def test_a_deeply_nested_index_is_a_named_error(tmp_path):
    (tmp_path / "index.json").write_text('{"format": "wdsllm", "version": 3, "x": ' + DEEP + "}")
    with pytest.raises(FormatError, match=r"index\.json: JSON nested too deeply"):
        read_index(str(tmp_path))


def test_an_index_with_a_huge_unknown_key_is_refused_unread(tmp_path):
    path = tmp_path / "index.json"
    with open(path, "w") as f:
        f.write('{"format": "wdsllm", "version": 3, "junk": "')
        f.write("x" * (MAX_INDEX_BYTES + (4 << 20)))
        f.write('"}')
    with pytest.raises(FormatError, match=rf"index\.json: more than {MAX_INDEX_BYTES} bytes"):
        read_index_bytes(str(path))
    with pytest.raises(FormatError, match=r"more than"):
        read_index(str(tmp_path))
    from wdsllm.format import verify
    from wdsllm.load.sources.packed import _read_index

    with pytest.raises(FormatError, match=rf"index\.json: more than {MAX_INDEX_BYTES} bytes"):
        _read_index(str(tmp_path))  # what the loader opens a dataset with
    with pytest.raises(FormatError, match=rf"index\.json: more than {MAX_INDEX_BYTES} bytes"):
        verify.load(str(tmp_path))  # what info and verify open it with


def test_a_deeply_nested_state_is_a_named_error():
    from wdsllm.load.state import LOADER_KIND, unseal

    with pytest.raises(StateError, match=r"nested too deeply"):
        unseal({"format": f"{LOADER_KIND}/2", "state": DEEP})
    nested: list = []
    for _ in range(100_000):
        nested = [nested]
    with pytest.raises(StateError, match=r"nested too deeply"):
        unseal({"kind": LOADER_KIND, "version": 2, "digest": "x", "junk": nested})


def test_a_damaged_state_quotes_little_of_it():
    from wdsllm.load.state import LOADER_KIND, unseal

    with pytest.raises(StateError, match=r"damaged") as exc:
        unseal({"format": f"{LOADER_KIND}/2", "state": json.dumps({"a": 1})[:-1] + "x" * 10_000})
    assert len(str(exc.value)) < 400
