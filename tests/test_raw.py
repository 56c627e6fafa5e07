"""Raw text straight into training (#15): txt, jsonl(.gz), Parquet and raw-text tars read in units,
tokenized in the workers, with the packed-dataset guarantees (exactly once, reshuffled epochs,
exact resume without replay, equal batches from a count sidecar, bad input named or counted)."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from pack_helpers import GPT2, cli, encode_texts, jsonl, wiki_lines, write_parquet
from test_distributed import torchrun

import wdsllm
from wdsllm.errors import ConfigError, SourceError, SteeringError
from wdsllm.load import rawread
from wdsllm.load.block import split_id

SHAKESPEARE = Path(__file__).parent.parent.parent / "shared" / "data" / "corpora" / "tinyshakespeare.txt"
TOK = str(GPT2)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """Three inputs of three kinds (fewer files than consumers): a jsonl.gz (one unit: compressed),
    a plain jsonl (byte-range units) and a Parquet file (row-group units); and each document's text."""
    d = tmp_path_factory.mktemp("raw")
    lines = wiki_lines(600)
    with gzip.open(d / "a.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(lines[:150]) + "\n")
    (d / "b.jsonl").write_text("\n".join(lines[150:450]) + "\n", encoding="utf-8")
    records = [json.loads(x) for x in lines[450:]]
    write_parquet(d / "c.parquet", records, row_group_size=20)
    inputs = [str(d / "a.jsonl.gz"), str(d / "b.jsonl"), str(d / "c.parquet")]
    texts = {}
    for file, chunk in enumerate((lines[:150], lines[150:450], lines[450:])):
        for line, raw in enumerate(chunk, 1):
            text = json.loads(raw)["text"]
            if text.strip():
                texts[(file, line)] = text
    counts = str(d / "counts.npz")
    cli("count", *inputs, "-t", TOK, "--unit-bytes", "40000", "-o", counts)
    return {"inputs": inputs, "texts": texts, "counts": counts, "dir": d}


def _loader(corpus, **kw):
    options = dict(tokenizer=TOK, unit_bytes=40_000, batch_size=4, seed=1, shuffle_buffer=64)
    options.update(kw)
    return wdsllm.loader(corpus["inputs"], **options)


def _docs(batches) -> list[tuple[int, int]]:
    return [split_id(d) for b in batches for d in b["docs"][:, 0].tolist()]


def test_units_divide_files_and_every_document_comes_once_with_its_tokens(corpus):
    loader = _loader(corpus)
    kinds = Counter(u.unit for u in loader.catalog.units)
    assert kinds["bytes"] >= 3 and kinds["row_groups"] >= 2 and kinds[None] == 1  # gz: a whole file
    seen = []
    expected = {}
    for batch in loader:
        for row, (doc, n) in enumerate(zip(batch["docs"][:, 0].tolist(), batch["lengths"].tolist())):
            place = split_id(doc)
            seen.append(place)
            expected[place] = batch["input_ids"][row, :n].tolist()
    assert sorted(seen) == sorted(corpus["texts"])  # exactly once; identity = (file, line or row)
    places = sorted(expected)[:40:3]
    direct = encode_texts([corpus["texts"][p] for p in places])
    assert [expected[p] for p in places] == direct  # pack's tokenization: no specials, EOS appended
    assert loader.tokenizer.decode(direct[0][:-1]) == corpus["texts"][places[0]]


@pytest.mark.parametrize(("world", "workers"), [(1, 3), (2, 2), (3, 1)])
@pytest.mark.parametrize("with_counts", [False, True])
def test_exactly_once_across_ranks_and_workers(corpus, world, workers, with_counts):
    seen = []
    for rank in range(world):
        loader = _loader(
            corpus,
            rank=rank,
            world_size=world,
            num_workers=workers,
            _in_process=True,
            equal_batches=False,
            counts=corpus["counts"] if with_counts else None,
        )
        seen += _docs(loader)
    assert sorted(seen) == sorted(corpus["texts"])


def test_order_is_seeded_and_reshuffled_each_epoch(corpus):
    a, b = _loader(corpus, epochs=2), _loader(corpus, epochs=2)
    first = _docs(a)
    assert first == _docs(b)
    a.set_epoch(1)
    second = _docs(a)
    assert sorted(second) == sorted(first) and second != first


@pytest.mark.parametrize(
    "options",
    [
        {"batching": "fixed"},
        {"batching": "bucket", "window": 40},
        {"batching": "pack", "seq_len": 128, "window": 40},
        {"batching": "concat", "seq_len": 128},
        {"batching": "fixed", "max_len": 32},
    ],
    ids=["fixed", "bucket", "pack", "concat", "fixed-split"],
)
def test_resume_is_exact_and_does_not_tokenize_again(corpus, options, monkeypatch):
    full = [b["input_ids"].tolist() for b in _loader(corpus, counts=corpus["counts"], num_workers=2, **options)]
    cut = int(len(full) * 0.9)
    first = _loader(corpus, counts=corpus["counts"], num_workers=2, **options)
    it = iter(first)
    for _ in range(cut):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))
    encoded = []
    real = rawread.Encoder.encode
    monkeypatch.setattr(rawread.Encoder, "encode", lambda self, texts: encoded.append(len(texts)) or real(self, texts))
    second = _loader(corpus, counts=corpus["counts"], num_workers=2, _in_process=True, **options)
    second.load_state_dict(state)
    rest = [b["input_ids"].tolist() for b in second]
    assert full[cut:] == rest
    assert sum(encoded) < 0.5 * len(corpus["texts"])  # only the units still being read, not the epoch


def test_counts_give_equal_batches_and_len(corpus):
    lens, counts = set(), []
    for rank in range(3):
        loader = _loader(corpus, counts=corpus["counts"], rank=rank, world_size=3, num_workers=2, _in_process=True)
        n = sum(1 for _ in loader)
        counts.append(n)
        lens.add(len(loader))
    assert len(set(counts)) == 1 and lens == {counts[0]}


def test_ranks_without_counts_or_steps_are_refused(corpus):
    with pytest.raises(ConfigError, match="wdsllm count"):
        _loader(corpus, rank=0, world_size=2)
    with pytest.raises(ConfigError, match="wdsllm count"):
        wdsllm.dataset(corpus["inputs"], tokenizer=TOK, rank=0, world_size=2)
    loader = _loader(corpus, rank=0, world_size=2, steps_per_epoch=5, epochs=None)
    assert sum(1 for _ in loader) == 5


def test_a_sidecar_of_other_settings_is_refused(corpus):
    with pytest.raises(ConfigError, match="wdsllm count"):
        _loader(corpus, counts=corpus["counts"], unit_bytes=30_000)
    with pytest.raises(ConfigError, match="other inputs or settings"):
        _loader(corpus, counts=corpus["counts"], eos=False)


def test_bad_lines_are_named_or_skipped_and_counted(tmp_path):
    lines = wiki_lines(60)
    bad = [*lines[:10], "{not json", *lines[10:30], json.dumps({"title": "no text"}), *lines[30:]]
    path = jsonl(tmp_path / "bad.jsonl", bad)
    with pytest.raises(SourceError, match=r"bad\.jsonl:11: invalid JSON"):
        list(wdsllm.loader(str(path), tokenizer=TOK, batch_size=4, num_workers=1))
    loader = wdsllm.loader(str(path), tokenizer=TOK, batch_size=4, num_workers=2, on_error="skip", unit_bytes=8000)
    docs = _docs(loader)
    assert loader.skipped_docs == 2
    assert 11 not in {line for _, line in docs} and 32 not in {line for _, line in docs}


def test_raw_text_tars_and_txt(tmp_path):
    import webdataset as wds

    texts = [json.loads(x)["text"] for x in wiki_lines(80)]
    with wds.TarWriter(str(tmp_path / "raw.tar")) as w:
        for i, t in enumerate(texts):
            w.write({"__key__": f"s{i:04d}", "txt": t})
    got = _docs(wdsllm.loader(str(tmp_path / "raw.tar"), tokenizer=TOK, batch_size=8))
    assert sorted(got) == [(0, i + 1) for i, t in enumerate(texts) if t.strip()]
    pipe = wdsllm.dataset(str(SHAKESPEARE), tokenizer=TOK, batch_size=16, unit_bytes=200_000)
    lines = SHAKESPEARE.read_text().split("\n")
    n = sum(1 for x in lines if x.strip())
    assert sum(len(b["docs"]) for b in pipe) == n


def test_raw_options_need_a_tokenizer(corpus):
    with pytest.raises(ConfigError, match="tokenizer="):
        wdsllm.loader(corpus["inputs"], text_field="body")


@pytest.mark.timeout(300)
def test_torchrun_two_ranks_raw_text_with_counts(corpus, tmp_path):
    torchrun(
        "ddp_raw.py",
        2,
        "--data",
        *corpus["inputs"],
        "--tokenizer",
        TOK,
        "--counts",
        corpus["counts"],
        "--out",
        str(tmp_path),
    )
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert reports[0]["batches"] == reports[1]["batches"] == reports[0]["len"]
    ids = [split_id(i) for r in reports for i in r["ids"]]
    assert len(ids) == len(set(ids))
    dropped = sum(r["dropped"] for r in reports)
    assert len(ids) >= len(corpus["texts"]) - 4 * 2 * 2 * max(1, dropped)  # what is dropped is reported
    assert set(ids) <= set(corpus["texts"])
    np.testing.assert_array_equal(reports[0]["len"], reports[1]["len"])


def test_remote_inputs_over_http_with_faults(corpus, http_server):
    import shutil

    for name in ("b.jsonl", "c.parquet"):
        shutil.copy(corpus["dir"] / name, http_server.root / name)
    urls = [http_server.url_for("b.jsonl"), http_server.url_for("c.parquet")]
    local = _docs(wdsllm.loader(corpus["inputs"][1:], tokenizer=TOK, batch_size=4, unit_bytes=40_000, num_workers=2))
    http_server.faults.add("*/b.jsonl", "drop_after", bytes=9000, times=3)  # bodies that break: reads resume
    http_server.faults.add("*/c.parquet", "status", status=503, times=2)  # transient answers: retried
    remote = _docs(wdsllm.loader(urls, tokenizer=TOK, batch_size=4, unit_bytes=40_000, num_workers=2))
    assert remote == local


def test_resume_without_counts_reads_again_and_is_exact(corpus):
    full = [b["input_ids"].tolist() for b in _loader(corpus, num_workers=2)]
    first = _loader(corpus, num_workers=2)
    it = iter(first)
    for _ in range(len(full) // 2):
        next(it)
    second = _loader(corpus, num_workers=2)
    second.load_state_dict(first.state_dict())
    assert [b["input_ids"].tolist() for b in second] == full[len(full) // 2 :]


def test_elastic_resume_with_counts_three_ranks_to_two(corpus):
    kw = dict(counts=corpus["counts"], num_workers=2, _in_process=True)
    consumed, states = [], []
    for r in range(3):
        loader = _loader(corpus, rank=r, world_size=3, **kw)
        it = iter(loader)
        for _ in range(5):
            consumed += _docs([next(it)])
        states.append(loader.state_dict())
    rest = []
    for r in range(2):
        loader = _loader(corpus, rank=r, world_size=2, **{**kw, "num_workers": 3})
        loader.load_state_dict(states[2])
        rest += _docs(loader)
    seen = Counter(consumed + rest)
    assert max(seen.values()) == 1
    assert len(set(corpus["texts"]) - set(seen)) < 2 * 3 * 4  # at most the equal-batches remainder


def test_raw_text_with_counts_takes_a_skip_and_resumes(corpus):
    """Steering (issue #42) over raw text: the count sidecar says where a planned step is; its
    documents are named by file and line, so an exclusion by id is refused, saying why."""
    options = dict(counts=corpus["counts"], num_workers=2, _in_process=True)
    plain = list(_loader(corpus, **options))

    def steered():
        loader = _loader(corpus, **options)
        loader.skip(2, 4)
        return loader

    got = list(steered())
    assert [b["docs"].tolist() for b in got] == [b["docs"].tolist() for b in plain[:2] + plain[4:]]
    first = steered()
    it = iter(first)
    part = [next(it) for _ in range(3)]
    with pytest.raises(SteeringError, match="input file and line"):
        first.exclude(docs=[int(plain[0]["docs"][0, 0])])
    second = _loader(corpus, **options)
    second.load_state_dict(first.state_dict())
    assert [b["docs"].tolist() for b in part + list(second)] == [b["docs"].tolist() for b in got]
