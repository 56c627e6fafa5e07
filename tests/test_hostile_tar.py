"""Raw-text tars with link members and with hostile headers (#31): a link reads the earlier member
it names or is skipped with its reason, and a metadata header is bounded before it is read."""

from __future__ import annotations

import gzip
import io
import os
import subprocess
import tarfile

import pytest

from wdsllm.errors import SourceError
from wdsllm.inputs.registry import reader_for
from wdsllm.inputs.sources import ParseOptions, Part, expand_inputs


def _read(path, on_error: str = "skip", max_doc_bytes: int = 1 << 20):
    (inp,) = expand_inputs([str(path)])
    opts = ParseOptions(on_error=on_error, max_doc_bytes=max_doc_bytes)
    texts, skips = [], []
    for chunk in reader_for(inp.kind).chunks(Part(inp, size=inp.size), opts, 1 << 20, 1):
        parsed = chunk.parse(opts, inp.display)
        texts.extend(zip(parsed.lines, parsed.texts))
        skips.extend(parsed.skips)
    return texts, skips


def test_gnu_tar_hard_links_read_their_target(tmp_path):
    """GNU tar stores a second name of a file as a hard link member: both documents are packed."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("a", "c"):
        (src / f"{name}.txt").write_text(f"text of {name}")
    os.link(src / "a.txt", src / "b.txt")
    os.link(src / "c.txt", src / "d.txt")
    subprocess.run(
        ["tar", "--format=gnu", "-cf", str(tmp_path / "linked.tar"), "a.txt", "b.txt", "c.txt", "d.txt"],
        cwd=src,
        check=True,
    )
    with tarfile.open(tmp_path / "linked.tar") as tar:
        assert sum(m.islnk() for m in tar.getmembers()) == 2
    texts, skips = _read(tmp_path / "linked.tar")
    assert texts == [(1, "text of a"), (2, "text of a"), (3, "text of c"), (4, "text of c")] and skips == []


def _add(tar: tarfile.TarFile, name: str, data: bytes | None = None, **fields) -> None:
    info = tarfile.TarInfo(name)
    for k, v in fields.items():
        setattr(info, k, v)
    if data is not None:
        info.size = len(data)
    tar.addfile(info, io.BytesIO(data) if data is not None else None)


def test_links_that_cannot_be_read_are_skipped_with_their_reason(tmp_path):
    with tarfile.open(tmp_path / "links.tar", "w", format=tarfile.GNU_FORMAT) as tar:
        _add(tar, "d/s1.txt", b"first")
        _add(tar, "d/s2.txt", type=tarfile.SYMTYPE, linkname="s1.txt")  # relative: d/s1.txt
        _add(tar, "d/s3.txt", type=tarfile.SYMTYPE, linkname="../../etc/passwd")
        _add(tar, "d/s4.txt", type=tarfile.SYMTYPE, linkname="/etc/passwd")
        _add(tar, "d/s5.txt", type=tarfile.LNKTYPE, linkname="d/s9.txt")  # names a later member
        _add(tar, "d/s6.txt", type=tarfile.FIFOTYPE)
        _add(tar, "d/s9.txt", b"last")
    texts, skips = _read(tmp_path / "links.tar")
    assert texts == [(1, "first"), (2, "first"), (7, "last")]
    assert [(s.line, s.reason) for s in skips] == [(n, "unreadable_member") for n in (3, 4, 5, 6)]
    assert "outside the tar" in skips[0].message and "outside the tar" in skips[1].message
    assert "not an earlier" in skips[2].message and "not a regular file" in skips[3].message
    with pytest.raises(SourceError, match=r"links\.tar: sample 3 \(d/s3\): link 'd/s3.txt' points outside"):
        _read(tmp_path / "links.tar", on_error="raise")


def _hostile_header(kind: bytes, claimed: int) -> bytes:
    """A tar whose first member is a metadata header claiming ``claimed`` bytes, then zeros."""
    info = tarfile.TarInfo("././@LongLink" if kind == tarfile.GNUTYPE_LONGNAME else "././@PaxHeader")
    info.type = kind
    info.size = claimed
    header = info.tobuf(format=tarfile.GNU_FORMAT)[:512]
    return header + b"\0" * (4 << 20)


@pytest.mark.parametrize("kind", [tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE])
def test_a_header_claiming_gigabytes_is_refused_before_it_is_read(tmp_path, kind):
    path = tmp_path / "hostile.tar.gz"
    path.write_bytes(gzip.compress(_hostile_header(kind, 1_500_000_000), compresslevel=1))
    assert path.stat().st_size < 64 << 10
    texts, skips = _read(path, max_doc_bytes=1 << 20)
    (skip,) = skips
    assert texts == [] and skip.reason == "unreadable"
    assert "claims 1500000000 bytes" in skip.message and "--max-doc-bytes" in skip.message
    with pytest.raises(SourceError, match=r"hostile\.tar\.gz: sample 1: not a readable tar .* claims 1500000000"):
        _read(path, on_error="raise")


def test_long_names_within_the_bound_still_read(tmp_path):
    name = "x" * 300 + "/doc.txt"
    with tarfile.open(tmp_path / "long.tar", "w", format=tarfile.GNU_FORMAT) as tar:
        _add(tar, name, b"deep")
    with tarfile.open(tmp_path / "pax.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        _add(tar, name, b"pax", pax_headers={"comment": "c" * 1000})
    assert _read(tmp_path / "long.tar") == ([(1, "deep")], [])
    assert _read(tmp_path / "pax.tar") == ([(1, "pax")], [])
