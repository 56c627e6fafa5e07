"""One short batch per rank over raw text without a count sidecar, with real DataLoader workers.

No lengths are known before reading, so no worker can hand its tail to another; each worker
flags the batches it made after its stream ended, and the loader merges them into full batches
and at most one short one (``load/tails.py``): with 2 workers and ``batch_size=4`` an epoch ends
4, 4, 4, 2, not 4, 3, 1. A resume inside the held or the merged tails equals the uninterrupted
epoch.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from pack_helpers import GPT2, wiki_lines

import wdsllm
from wdsllm import RawTextSource
from wdsllm.errors import StateError
from wdsllm.load.state import seal, unseal

MODES = {
    "fixed": dict(batch_size=4),
    "bucket": dict(batching="bucket", batch_size=4, window=12),
    "budget": dict(batching="bucket", max_tokens=512, window=8, batch_size=None),
    "pieces": dict(batch_size=4, max_len=64),
    "pack": dict(batching="pack", seq_len=128, batch_size=2, window=12),
    "concat": dict(batching="concat", seq_len=64, batch_size=3),
}


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> str:
    """A jsonl of 50 wiki articles, read as byte-range units (several per worker), no sidecar."""
    path = tmp_path_factory.mktemp("raw-tails") / "wiki.jsonl"
    path.write_text("\n".join(wiki_lines(50)) + "\n", encoding="utf-8")
    return str(path)


def _loader(path: str, options: dict, workers: int = 2, **extra):
    source = RawTextSource([path], tokenizer=str(GPT2), unit_bytes=12_000)
    return wdsllm.loader(source, seed=1, shuffle_buffer=8, num_workers=workers, **options, **extra)


def _rows(batch: dict) -> list[list[int]]:
    ids = batch["input_ids"]
    return [ids[i, : int(n)].tolist() for i, n in enumerate(batch["lengths"].tolist())]


def _short(name: str, rows: list[list[int]], rows_only: bool = False) -> bool:
    """Below the mode's full batch (a token budget: room left for another item as long as its
    longest; concat: a row short of seq_len too, unless ``rows_only``: ``drop_last`` keeps a
    batch of whole count whose last row is short, as one process does)."""
    options = MODES[name]
    if name == "budget":
        return (len(rows) + 1) * max(len(r) for r in rows) <= options["max_tokens"]
    if name == "concat" and not rows_only and any(len(r) < options["seq_len"] for r in rows):
        return True
    return len(rows) < options["batch_size"]


def _tokens(batches: list[list[list[int]]]) -> Counter:
    return Counter(t for rows in batches for row in rows for t in row)


@pytest.fixture(scope="module")
def reference(text) -> dict[str, Counter]:
    """Every token of each mode's epoch, from one process (no tails to merge)."""
    out = {}
    for name, options in MODES.items():
        with _loader(text, options, workers=0) as loader:
            out[name] = _tokens([_rows(b) for b in loader])
    return out


@pytest.mark.parametrize("name", sorted(MODES))
def test_two_workers_end_a_raw_epoch_with_one_short_batch(text, reference, name):
    for drop_last in (False, True):
        with _loader(text, MODES[name], drop_last=drop_last) as loader:
            batches = [_rows(b) for b in loader]
            merged = loader.cursor.tails
        short = [i for i, rows in enumerate(batches) if _short(name, rows, rows_only=drop_last)]
        got = _tokens(batches)
        if not drop_last:
            assert got == reference[name]  # every token once: the tails merged, nothing lost or repeated
            assert merged >= 1
            if name == "budget":  # a budget's merged batches come shuffled: the short one anywhere among them
                assert len(short) <= merged
            elif name == "bucket":
                assert len(short) <= 1 and all(i >= len(batches) - merged for i in short)
            else:
                assert short in ([], [len(batches) - 1]), short
            whole = batches
        else:
            dropped = reference[name] - got
            assert not got - reference[name]
            if name == "budget":
                assert sum(dropped.values()) <= MODES[name]["max_tokens"]  # one under-full batch at most
            else:
                assert not short and len(whole) - len(batches) <= 1


@pytest.mark.parametrize("name", sorted(MODES))
def test_a_resume_among_the_held_and_the_merged_tails_equals_the_uninterrupted_epoch(text, name):
    """Real workers for two modes; the others run the same stages in this process."""
    in_process = name not in ("fixed", "pack")
    with _loader(text, MODES[name], _in_process=in_process) as loader:
        whole, merged_so_far = [], []
        for batch in loader:
            whole.append(_rows(batch))
            merged_so_far.append(loader.cursor.tails)
    first_merged = merged_so_far.index(1)
    assert first_merged > 0  # batches of the workers' own came first
    # saved while the loader holds tails it has not merged yet, then after one merged batch
    cuts = sorted({first_merged, min(first_merged + 1, len(whole) - 1)})
    for cut in cuts:
        with _loader(text, MODES[name], _in_process=in_process) as loader:
            it = iter(loader)
            head = [_rows(next(it)) for _ in range(cut)]
            state = json.loads(json.dumps(loader.state_dict()))
        assert json.loads(state["state"])["tails"] == (merged_so_far[cut - 1] if cut else 0)
        with _loader(text, MODES[name], _in_process=in_process) as resumed:
            resumed.load_state_dict(state)
            rest = [_rows(b) for b in resumed]
        assert head + rest == whole, (name, cut)


def test_a_state_with_merged_tails_is_refused_where_nothing_merges(text):
    with _loader(text, MODES["fixed"], _in_process=True) as loader:
        batches = list(loader)
        assert loader.cursor.tails >= 1
    with _loader(text, MODES["fixed"], _in_process=True) as loader:
        it = iter(loader)
        for _ in range(len(batches) - 1):
            next(it)
        body = unseal(loader.state_dict())
    assert body["tails"] >= 1
    with _loader(text, MODES["fixed"], workers=0) as one:  # no workers: no tails to merge
        body_one = dict(body, num_workers=1, workers={"0": body["workers"]["0"]}, turn=0, active=[0])
        with pytest.raises(StateError, match="tails"):
            one.load_state_dict(seal(body_one))
    older = dict(body, version=4)
    older.pop("tails")
    # version 4 had no merged tails: its count of batches handed out is off
    with _loader(text, MODES["fixed"], _in_process=True) as again, pytest.raises(StateError, match="add up"):
        again.load_state_dict(seal(older))


def test_the_merged_tails_hold_every_document_once(text):
    """Rows merged from the workers' tails (pack) keep each document whole and once."""
    with _loader(text, MODES["pack"]) as loader:
        docs = Counter()
        for batch in loader:
            for row in batch["docs"].tolist():
                docs.update(d for d in row if d >= 0)
    with _loader(text, MODES["pack"], workers=0) as one:
        alone = Counter(d for b in one for row in b["docs"].tolist() for d in row if d >= 0)
    assert docs == alone  # each document in as many rows as one process packs it into (pieces of seq_len)
