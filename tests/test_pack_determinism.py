"""Identical input and options give byte-identical output, whatever the workers or the chunking."""

from __future__ import annotations

import gzip

import pytest
from pack_helpers import SHAKESPEARE, cached, dataset_files, pack_api, session_dir, wiki_lines, wiki_subset

SMALL = {"sample_tokens": 4096, "shard_size": 64 * 1024}


def bad_lines_corpus() -> str:
    """Wiki lines with every kind of bad input mixed in, at irregular places (cached)."""

    def build(d):
        path = d / "mixed.jsonl.gz"
        bad = [
            b"{not json",
            b'{"title": "no text"}',
            b'{"text": 7}',
            b'{"text": "caf\xe9 latin-1"}',
            b"",
            b'{"text": "   "}',
        ]
        with gzip.open(path, "wb") as f:
            for i, line in enumerate(wiki_lines(1500, file_number=1)):
                f.write(line.encode() + b"\n")
                if i % 97 == 13:
                    f.write(bad[i % len(bad)] + b"\n")
        return path

    return cached("mixed-bad-lines", build)


def same_pack(name: str, inputs, **options):
    """Pack once per session with a single worker and default chunking: the reference bytes."""
    return cached(name, lambda d: (pack_api(inputs, d / "out", **options), dataset_files(d / "out"))[1])


@pytest.mark.parametrize("variant", [{"workers": 2}, {"chunk_bytes": 777}])
def test_docs_mode_output_is_independent_of_workers_and_chunking(tmp_path, variant):
    reference = same_pack("det-docs", [wiki_subset(2000)], **SMALL)
    pack_api([wiki_subset(2000)], tmp_path / "out", **SMALL, **variant)
    assert dataset_files(tmp_path / "out") == reference
    assert len(reference) > 10  # many shards, so shard and group boundaries are exercised


def test_packed_mode_output_is_independent_of_workers_and_chunking(tmp_path):
    options = {"mode": "packed", "seq_len": 100, **SMALL}
    reference = same_pack("det-packed", [wiki_subset(2000)], **options)
    pack_api([wiki_subset(2000)], tmp_path / "out", workers=2, chunk_bytes=1500, **options)
    assert dataset_files(tmp_path / "out") == reference


def test_paragraph_split_is_independent_of_chunking(tmp_path):
    options = {"split": "paragraph", "sample_tokens": 3000}
    reference = same_pack("det-paragraph", [SHAKESPEARE], **options)
    pack_api([SHAKESPEARE], tmp_path / "out", chunk_bytes=500, **options)
    assert dataset_files(tmp_path / "out") == reference


def test_skipped_input_is_reported_identically_whatever_the_chunking(tmp_path):
    options = {"on_error": "skip", **SMALL}
    reference = same_pack("det-skip", [bad_lines_corpus()], **options)
    pack_api([bad_lines_corpus()], tmp_path / "out", chunk_bytes=900, workers=2, **options)
    assert dataset_files(tmp_path / "out") == reference


def test_many_small_files_in_one_pack(tmp_path):
    """Chunks of several files are in flight together; the order still follows the inputs."""
    lines = wiki_lines(600)
    files = []
    for i in range(6):
        path = session_dir("det-many") / f"part-{i}.jsonl"
        path.write_text("\n".join(lines[i * 100 : (i + 1) * 100]) + "\n")
        files.append(path)
    pack_api(files, tmp_path / "a", **SMALL)
    pack_api(files, tmp_path / "b", workers=2, chunk_bytes=2000, **SMALL)
    assert dataset_files(tmp_path / "a") == dataset_files(tmp_path / "b")
