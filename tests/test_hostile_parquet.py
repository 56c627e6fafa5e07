"""Parquet pages written with CRCs are checked as they are read (#31): a damaged page is a named
error, or its row group is skipped and counted, never garbage rows."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from wdsllm.errors import SourceError
from wdsllm.inputs.registry import reader_for
from wdsllm.inputs.sources import ParseOptions, Part, expand_inputs


def _read(path, on_error: str):
    (inp,) = expand_inputs([str(path)])
    opts = ParseOptions(on_error=on_error)
    texts, skips = [], []
    for chunk in reader_for(inp.kind).chunks(Part(inp, size=inp.size), opts, 1 << 20, 1):
        parsed = chunk.parse(opts, inp.display)
        texts.extend(parsed.texts)
        skips.extend(parsed.skips)
    return texts, skips


def test_a_damaged_page_with_a_crc_is_named_or_skipped_whole(tmp_path):
    texts = [f"row {i} " + "lorem ipsum " * (i % 20) for i in range(100)]
    path = tmp_path / "crc.parquet"
    pq.write_table(
        pa.table({"text": texts}),
        path,
        write_page_checksum=True,
        compression="none",
        use_dictionary=False,
        data_page_size=1024,
        row_group_size=50,
    )
    data = bytearray(path.read_bytes())
    data[data.index(b"row 70 ") + 4] ^= 1  # "row 70" reads "row 60": wrong, and still valid text
    path.write_bytes(bytes(data))
    unchecked = pq.read_table(path).column("text").to_pylist()
    assert unchecked != texts and len(unchecked) == 100  # what a reader that ignores the CRCs gets
    with pytest.raises(SourceError, match=r"crc\.parquet: row 51: cannot read row group 1: .*CRC checksum"):
        _read(path, "raise")
    kept, skips = _read(path, "skip")
    assert kept == texts[:50]
    assert [(s.line, s.reason, s.count) for s in skips] == [(51, "unreadable", 50)]
