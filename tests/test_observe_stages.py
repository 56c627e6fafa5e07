"""The stages a reader times on its own: checksums (check), groups decoded (decode) and raw text
tokenized (tokenize), in the process that reads, beside the rest of the read."""

from __future__ import annotations

from pack_helpers import GPT2, SHAKESPEARE, pack_api

import wdsllm
from wdsllm import RawTextSource
from wdsllm.observe import stages


def moved_over_an_epoch(source) -> dict[str, float]:
    before = stages.CLOCK.snapshot()
    loader = wdsllm.loader(source, batch_size=4, max_len=128, seed=1)
    assert sum(len(batch["lengths"]) for batch in loader)
    loader.close()
    return stages.moved(before, stages.CLOCK.snapshot())


def test_a_packed_read_times_its_checks_and_decoding(tmp_path):
    text = tmp_path / "in.txt"
    text.write_bytes(SHAKESPEARE.read_bytes()[:60_000])
    pack_api([text], tmp_path / "ds", mode="docs", sample_tokens=2048)
    moved = moved_over_an_epoch(str(tmp_path / "ds"))
    assert moved.get("check", 0) > 0 and moved.get("decode", 0) > 0
    assert "tokenize" not in moved


def test_raw_text_times_its_tokenizing(tmp_path):
    text = tmp_path / "in.txt"
    text.write_bytes(SHAKESPEARE.read_bytes()[:60_000])
    moved = moved_over_an_epoch(RawTextSource([str(text)], tokenizer=str(GPT2)))
    assert moved.get("tokenize", 0) > 0 and "decode" not in moved
