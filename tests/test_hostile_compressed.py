"""Truncated and damaged compressed inputs (#31): every decompressor names the file, in the reader
that `pack`, `count` and the raw loader share, and with on_error="skip" the documents before the
break are kept."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import zlib
from pathlib import Path

import pytest
import zstandard
from pack_helpers import GPT2, pack_api

import wdsllm
from wdsllm.errors import SourceError, WdsllmError
from wdsllm.inputs.registry import reader_for
from wdsllm.inputs.sources import ParseOptions, Part, expand_inputs
from wdsllm.load.options import RawTextSource
from wdsllm.load.raw import open_raw
from wdsllm.load.rawcount import count_raw

COMPRESS = {
    "gz": gzip.compress,
    "bz2": lambda data: bz2.compress(data, 1),  # blocks of 100 kB: a cut in the middle keeps whole blocks
    "xz": lzma.compress,
    "zst": lambda data: zstandard.ZstdCompressor().compress(data),
}
DECOMPRESS_PREFIX = {
    "gz": lambda data: zlib.decompressobj(wbits=31).decompress(data),
    "bz2": lambda data: bz2.BZ2Decompressor().decompress(data),
    "xz": lambda data: lzma.LZMADecompressor().decompress(data),
    "zst": lambda data: zstandard.ZstdDecompressor().decompressobj().decompress(data),
}


def _lines(n: int) -> bytes:
    """n JSON lines of varied words (so that compression leaves some bytes to cut)."""
    out = []
    for i in range(n):
        words = " ".join(f"w{(i * 7919 + j * 104729) % 100003:x}" for j in range(40))
        out.append(json.dumps({"text": f"document {i}: {words}"}))
    return ("\n".join(out) + "\n").encode()


def _read(path, on_error: str = "raise") -> tuple[list[int], list]:
    (inp,) = expand_inputs([str(path)])
    opts = ParseOptions(on_error=on_error)
    lines, skips = [], []
    for chunk in reader_for(inp.kind).chunks(Part(inp, size=inp.size), opts, 1 << 20, 1):
        parsed = chunk.parse(opts, inp.display)
        lines.extend(parsed.lines)
        skips.extend(parsed.skips)
    return lines, skips


@pytest.mark.parametrize("fmt", sorted(COMPRESS))
def test_a_truncated_stream_is_named_and_keeps_the_documents_before_it(tmp_path, fmt):
    data = COMPRESS[fmt](_lines(3000))
    path = tmp_path / f"cut.jsonl.{fmt}"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        SourceError, match=rf"cut\.jsonl\.{fmt}:\d+: cannot decompress after line \d+: .*(truncat|ended)"
    ):
        _read(path)
    lines, skips = _read(path, "skip")
    (skip,) = skips
    assert skip.reason == "unreadable" and lines == list(range(1, skip.line))
    assert len(lines) == DECOMPRESS_PREFIX[fmt](data[: len(data) // 2]).count(b"\n")


@pytest.mark.parametrize("fmt", sorted(COMPRESS))
def test_a_whole_stream_reads_every_document(tmp_path, fmt):
    path = tmp_path / f"whole.jsonl.{fmt}"
    path.write_bytes(COMPRESS[fmt](_lines(500)))
    assert _read(path) == (list(range(1, 501)), [])


def test_zstd_frames_cut_at_every_kind_of_place(tmp_path):
    """Two frames with checksums and a skippable frame between: a cut anywhere but a frame's end is named."""
    first = zstandard.ZstdCompressor(write_checksum=True).compress(_lines(200))
    skippable = (0x184D2A5A).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"12345"
    second = zstandard.ZstdCompressor(write_content_size=False).compress(_lines(100))
    data = first + skippable + second
    for cut in (3, 5, len(first) // 2, len(first) - 2, len(first) + 6, len(first) + len(skippable) + 40, len(data) - 1):
        path = tmp_path / f"cut{cut}.jsonl.zst"
        path.write_bytes(data[:cut])
        with pytest.raises(SourceError, match=rf"cut{cut}\.jsonl\.zst:\d+: .*truncated"):
            _read(path)
    for cut in (len(first), len(first) + len(skippable), len(data)):
        path = tmp_path / f"whole{cut}.jsonl.zst"
        path.write_bytes(data[:cut])
        lines, skips = _read(path)
        assert not skips and len(lines) == (300 if cut == len(data) else 200)


@pytest.mark.parametrize("fmt", sorted(COMPRESS))
def test_a_changed_byte_is_named(tmp_path, fmt):
    """Where the format checks only at a block's end, the text just before may already be wrong
    (an invalid line raises first); the damage itself is always reported."""
    data = bytearray(COMPRESS[fmt](_lines(2000)))
    for at in range(len(data) // 3, len(data) // 3 + 64):
        data[at] ^= 0x55
    path = tmp_path / f"flip.jsonl.{fmt}"
    path.write_bytes(bytes(data))
    with pytest.raises(SourceError, match=rf"flip\.jsonl\.{fmt}:\d+: "):
        _read(path)
    lines, skips = _read(path, "skip")
    assert skips[-1].reason == "unreadable" and "damaged" in skips[-1].message and len(lines) < 2000


def test_pack_count_and_loader_name_a_truncated_zst(tmp_path):
    data = COMPRESS["zst"](_lines(2000))
    path = tmp_path / "half.jsonl.zst"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(SourceError, match=r"half\.jsonl\.zst:\d+: .*truncated"):
        pack_api([path], tmp_path / "out")
    kept = pack_api([path], tmp_path / "skip", on_error="skip")
    (record,) = kept.index.skipped["records"]
    assert record["reason"] == "unreadable" and kept.index.documents == record["line"] - 1 > 100
    with pytest.raises(SourceError, match=r"half\.jsonl\.zst:\d+: .*truncated"):
        count_raw(open_raw(str(path), tokenizer=str(GPT2)))
    with pytest.raises(WdsllmError, match=r"half\.jsonl\.zst:\d+: .*truncated"):
        list(wdsllm.loader(RawTextSource(str(path), tokenizer=str(GPT2)), batch_size=4, num_workers=0))


@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_a_truncated_remote_zst_is_named(request, tmp_path, store):
    from wdsllm import storage

    bucket = request.getfixturevalue("s3_bucket" if store == "s3" else "gcs_bucket")
    data = COMPRESS["zst"](_lines(3000))
    out = storage.Output(f"{bucket}/raw")
    try:
        out.put_bytes("cut.jsonl.zst", data[: len(data) // 2])
    finally:
        out.close()
    url = f"{bucket}/raw/cut.jsonl.zst"
    with pytest.raises(SourceError, match=r"cut\.jsonl\.zst:\d+: cannot decompress after line \d+: truncated"):
        _read(url)
    lines, skips = _read(url, "skip")
    assert [s.reason for s in skips] == ["unreadable"] and lines == list(range(1, skips[0].line)) and len(lines) > 100


def test_skip_keeps_every_document_decompressed_before_the_break_in_pack_count_and_loader(tmp_path):
    """Not the documents up to the last read chunk: every line the decompressor gave whole (#43)."""
    complete, paths = {}, []
    for fmt in ("bz2", "gz", "xz"):
        data = COMPRESS[fmt](_lines(1000))
        paths.append(tmp_path / f"cut.jsonl.{fmt}")
        paths[-1].write_bytes(data[: len(data) // 2])
        complete[paths[-1].name] = DECOMPRESS_PREFIX[fmt](data[: len(data) // 2]).count(b"\n")
    assert min(complete.values()) > 100
    packed = pack_api(paths, tmp_path / "out", on_error="skip")
    assert {Path(i["path"]).name: i["documents"] for i in packed.index.inputs} == complete
    assert {Path(r["file"]).name: r["line"] - 1 for r in packed.index.skipped["records"]} == complete
    counts = count_raw(open_raw([str(p) for p in paths], tokenizer=str(GPT2), on_error="skip"))
    assert (int(counts.documents.sum()), counts.skipped) == (sum(complete.values()), 3)
    source = RawTextSource([str(p) for p in paths], tokenizer=str(GPT2), on_error="skip")
    loader = wdsllm.loader(source, batch_size=64, num_workers=0)
    assert sum(len(b["docs"]) for b in loader) == sum(complete.values()) and loader.skipped_docs == 3


def test_concatenated_and_padded_streams_read_as_the_standard_library_reads_them(tmp_path):
    whole = _lines(300)
    first, second = whole[: len(whole) // 3], whole[len(whole) // 3 :]
    cases = {
        "gz": gzip.compress(first) + b"\x00" * 7 + gzip.compress(second) + b"\x00" * 3,
        "bz2": bz2.compress(first) + bz2.compress(second) + b"not bz2",
        "xz": lzma.compress(first) + lzma.compress(second),
    }
    for fmt, data in cases.items():
        path = tmp_path / f"two.jsonl.{fmt}"
        path.write_bytes(data)
        assert _read(path) == (list(range(1, 301)), []), fmt
    path = tmp_path / "junk.jsonl.gz"
    path.write_bytes(gzip.compress(whole) + b"junk")  # gzip refuses bytes after a member that start none
    with pytest.raises(SourceError, match=r"junk\.jsonl\.gz:301: .*incorrect header check"):
        _read(path)
    path.write_bytes(b"")
    assert _read(path) == ([], [])
