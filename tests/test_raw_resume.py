"""A raw-text resume without a count sidecar passes over what came before by parsing, never by
tokenizing (#31): a .jsonl.zst is one unit, so a resume at 90% of it tokenizes only the shuffle
block it stands in and what follows, and its batches are those of the uninterrupted run, in every
batching mode (documents split into pieces at max_len, pack and concat included)."""

from __future__ import annotations

import json

import pytest
import zstandard
from pack_helpers import GPT2, wiki_lines

import wdsllm
from wdsllm import RawTextSource
from wdsllm.load import rawread

MODES = {
    "fixed": dict(batch_size=4),
    "bucket": dict(batching="bucket", batch_size=4, window=40),
    "budget": dict(batching="bucket", max_tokens=4096, window=40, batch_size=None),
    # items are pieces of documents, or rows cut across them: the state marks where its position
    # stands in documents (and concat's hint the token of the document its next row starts at)
    "pieces": dict(batch_size=4, max_len=64),
    "pack": dict(batching="pack", seq_len=256, batch_size=2, window=40),
    "concat": dict(batching="concat", seq_len=256, batch_size=2),
}


@pytest.fixture(scope="module")
def compressed(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("raw-resume") / "wiki.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(("\n".join(wiki_lines(400)) + "\n").encode()))
    return str(path)


def _loader(path: str, options: dict):
    source = RawTextSource(path, tokenizer=str(GPT2))
    return wdsllm.loader(source, seed=1, shuffle_buffer=64, num_workers=1, _in_process=True, **options)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_resume_at_ninety_percent_tokenizes_only_what_is_left(compressed, mode, monkeypatch):
    full = [b["input_ids"].tolist() for b in _loader(compressed, MODES[mode])]
    cut = int(len(full) * 0.9)
    first = _loader(compressed, MODES[mode])
    it = iter(first)
    for _ in range(cut):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))
    encoded: list[int] = []
    real = rawread.Encoder.encode
    monkeypatch.setattr(rawread.Encoder, "encode", lambda self, texts: encoded.append(len(texts)) or real(self, texts))
    second = _loader(compressed, MODES[mode])
    second.load_state_dict(state)
    assert [b["input_ids"].tolist() for b in second] == full[cut:]
    # the rest of the epoch, the shuffle block it starts in and the batcher's window
    assert sum(encoded) <= 0.1 * 400 + 64 + MODES[mode].get("window", 0)
