"""A raw-text source in a mixture (#15 with #12): tinyshakespeare read raw, tokenized in the
workers and planned from its count sidecar, next to a packed wiki source with the same tokenizer;
and the mixture cases a single source does not show (an unreadable shard skipped, uint16 and
uint32 sources widened into one batch)."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from pack_helpers import GPT2, LLAMA, SHAKESPEARE, cached, encode_texts, pack_api, shakespeare_counts
from synth import write_dataset
from test_mixtures import _pack_sources, _resumes_exactly, _same

import wdsllm
from wdsllm.errors import MixtureError, PackError
from wdsllm.load.block import split_id
from wdsllm.load.raw import open_raw
from wdsllm.load.rawcount import count_raw, save_counts

UNIT_BYTES = 200_000  # tinyshakespeare (1.1 MB) in 6 units: more units than consumers of world 2 x 2
WEIGHTS = {"wiki": 0.6, "lines": 0.4}


def _sidecar(d: Path, inputs, tokenizer=GPT2, **kw) -> str:
    """``wdsllm count``'s sidecar, made through the Python API (the CLI is tested in test_raw.py)."""
    d.mkdir(parents=True, exist_ok=True)
    catalog = open_raw([str(i) for i in inputs], tokenizer=str(tokenizer), unit_bytes=UNIT_BYTES, **kw)
    path = str(d / f"{d.name}.counts.npz")
    save_counts(count_raw(catalog), catalog, path)
    return path


@pytest.fixture(scope="module")
def parts() -> dict:
    wiki = cached("mixture-sources", _pack_sources)["wiki"]
    return {"wiki": wiki, "counts": shakespeare_counts(UNIT_BYTES)}


def _raw(parts, **kw) -> dict:
    return {"raw": str(SHAKESPEARE), "counts": parts["counts"], "unit_bytes": UNIT_BYTES, **kw}


def _mix(parts, **kw) -> wdsllm.Mixture:
    kw.setdefault("weights", WEIGHTS)
    kw.setdefault("epoch_tokens", 100_000)
    return wdsllm.Mixture({"wiki": parts["wiki"], "lines": _raw(parts)}, **kw)


def _run(pipe, workers: int = 1) -> list[dict]:
    return [b for w in range(workers) for b in pipe.worker_iter(w, workers)]


def test_realized_quotas_and_raw_documents(parts):
    pipe = wdsllm.dataset(_mix(parts), batch_size=16, seed=1, rank=0, world_size=1)
    catalog = pipe.catalog
    assert catalog.index.tokenizer.sha256 == wdsllm.dataset(parts["wiki"]).catalog.index.tokenizer.sha256
    tokens, items = np.zeros(2, np.int64), np.zeros(2, np.int64)
    texts = SHAKESPEARE.read_text(encoding="utf-8").split("\n")
    raw_docs = {}
    for b in _run(pipe):
        src, lengths = b["sources"].numpy(), b["lengths"].numpy()
        np.add.at(tokens, src, lengths)
        np.add.at(items, src, 1)
        for row in np.nonzero(src == 1)[0][:2].tolist() if len(raw_docs) < 20 else ():
            raw_docs[int(b["docs"][row, 0])] = b["input_ids"][row, : lengths[row]].tolist()
    quotas = catalog.planner.unit_quotas(0)
    assert quotas == [60_000, 40_000]
    longest = [int(wdsllm.dataset(parts["wiki"]).catalog.index.doc_lengths["max"]), 40]
    assert all(abs(int(got) - want) < most for got, want, most in zip(tokens, quotas, longest))
    assert items.tolist() == catalog.planner.quotas(0)
    # a raw document's id is its (file, line), moved by the source's first shard as a shard id is
    base = int(catalog.bases[1])
    places = [split_id(doc) for doc in raw_docs]
    assert len(places) == 20 and all(file == base + 0 for file, _ in places)  # the one input file
    # pack's rules (EOS appended, as wiki's), the text of that line
    assert list(raw_docs.values()) == encode_texts([texts[line - 1] for _, line in places])


def _delivered(mix, world: int, workers: int, **kw) -> tuple[Counter, list[int]]:
    seen: Counter = Counter()
    batches = []
    for r in range(world):
        pipe = wdsllm.dataset(mix, rank=r, world_size=world, seed=4, **kw)
        got = _run(pipe, workers=max(1, workers))
        batches.append(len(got))
        if kw.get("batching") != "pack":
            seen.update((int(d), int(p)) for b in got for d, p in b["docs"].tolist())
    return seen, batches


def test_exactly_once_within_the_quota_across_ranks_and_workers(parts):
    mix = _mix(parts, epoch_tokens=60_000, weights={"wiki": 0.3, "lines": 0.7})
    alone, _ = _delivered(mix, 1, 0, batch_size=8, equal_batches=False)
    spread, _ = _delivered(mix, 2, 2, batch_size=8, equal_batches=False)
    assert spread == alone
    planner = wdsllm.dataset(mix, batch_size=8, seed=4).catalog.planner
    bases = wdsllm.dataset(mix, batch_size=8).catalog.bases
    per_source = [sum(c for (d, _), c in alone.items() if bases[s] <= d >> 32 < bases[s + 1]) for s in range(2)]
    assert per_source == planner.quotas(0)
    assert max(alone.values()) == 1  # both quotas are subsets here: nothing twice
    # equal batches per rank, in a mode whose count depends on every document's length
    _, counts = _delivered(mix, 2, 2, batching="pack", seq_len=256, batch_size=4)
    assert counts[0] == counts[1] > 0


def test_resume_is_bit_exact_in_pack_mode(parts):
    mix = _mix(parts, epoch_tokens=30_000)
    kw = dict(batching="pack", seq_len=128, window=16, batch_size=2, seed=2, num_workers=2, _in_process=True)
    kw.update(rank=1, world_size=2, shuffle_buffer=64)
    full = list(wdsllm.loader(mix, **kw))
    assert len(full) > 8 and any((b["sources"] == 1).any() for b in full)
    _resumes_exactly(mix, kw, full, (1, len(full) // 2, len(full) - 1))


def test_mixture_file_with_a_raw_source(parts, tmp_path):
    path = tmp_path / "mix.yaml"
    Path(tmp_path / "lines.counts.npz").write_bytes(Path(parts["counts"]).read_bytes())  # relative to the file
    path.write_text(
        f"sources:\n  wiki: {parts['wiki']}\n"
        f"  lines: {{raw: '{SHAKESPEARE}', counts: lines.counts.npz, unit_bytes: {UNIT_BYTES}}}\n"
        "weights: {wiki: 6, lines: 4}\nepoch_tokens: 100000\n"
    )
    from_file = _run(wdsllm.dataset(str(path), batch_size=8, rank=0, world_size=1))
    from_spec = _run(wdsllm.dataset(_mix(parts), batch_size=8, rank=0, world_size=1))
    assert len(from_file) == len(from_spec) and all(_same(a, b) for a, b in zip(from_file, from_spec))


@pytest.mark.parametrize(
    "spec, key",
    [
        ("{raw: a.txt, counts: c.npz, unit_byte: 5}", "sources.lines.unit_byte"),
        ("{raw: a.txt, counts: c.npz, eos: 'yes'}", "sources.lines.eos"),
        ("{raw: a.txt, counts: c.npz, split: words}", "sources.lines.split"),
        ("{raw: a.txt, counts: c.npz, unit_bytes: 0}", "sources.lines.unit_bytes"),
        ("{raw: [], counts: c.npz}", "sources.lines.raw"),
        ("{counts: c.npz}", "sources.lines.raw"),
        ("{raw: a.txt}", "sources.lines.counts"),
    ],
)
def test_raw_source_keys_are_checked(tmp_path, spec, key):
    path = tmp_path / "m.yaml"
    path.write_text(f"sources:\n  wiki: w\n  lines: {spec}\n")
    with pytest.raises(MixtureError, match=rf"m\.yaml: key '{key}'"):
        wdsllm.loader(str(path), batch_size=4)


def test_refused_without_a_sidecar(parts):
    with pytest.raises(MixtureError, match=r"'sources\.lines\.counts' is missing: raw source 'lines'.*wdsllm count"):
        wdsllm.Mixture({"wiki": parts["wiki"], "lines": {"raw": str(SHAKESPEARE)}})
    opened = open_raw(str(SHAKESPEARE), tokenizer=str(GPT2), unit_bytes=UNIT_BYTES)
    with pytest.raises(MixtureError, match=r"'lines' is raw text without a count sidecar.*wdsllm count"):
        wdsllm.dataset(wdsllm.Mixture({"wiki": parts["wiki"], "lines": opened}))


def _small_text(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    text = d / "small.txt"
    text.write_text("".join(f"line {i} of a small raw source\n" for i in range(60)))
    return text


def test_refused_with_another_tokenizer_or_other_specials(parts, tmp_path):
    text = _small_text(tmp_path / "t")
    llama = _sidecar(tmp_path / "llama", [text], tokenizer=LLAMA)
    spec = {"raw": str(text), "counts": llama, "tokenizer": str(LLAMA), "bos": True, "unit_bytes": UNIT_BYTES}
    with pytest.raises(MixtureError, match=r"'wiki' and 'small' tokenize with different tokenizers.*openllama"):
        wdsllm.dataset(wdsllm.Mixture({"wiki": parts["wiki"], "small": spec}))
    no_eos = _sidecar(tmp_path / "noeos", [text], eos=False)
    spec = {"raw": str(text), "counts": no_eos, "eos": False, "unit_bytes": UNIT_BYTES}
    with pytest.raises(MixtureError, match=r"'wiki' \(EOS added\) and 'small' \(EOS not added\).*BOS/EOS rules"):
        wdsllm.dataset(wdsllm.Mixture({"wiki": parts["wiki"], "small": spec}))
    # the default follows the packed source: EOS added, so its sidecar (made with eos) fits
    ok = _sidecar(tmp_path / "ok", [text])
    spec = {"raw": str(text), "counts": ok, "unit_bytes": UNIT_BYTES}
    batches = _run(wdsllm.dataset(wdsllm.Mixture({"wiki": parts["wiki"], "small": spec}, epoch_tokens=5000)))
    assert torch.cat([b["sources"] for b in batches]).eq(1).sum() > 0


# ----------------------------------------------------------------------------------------------
# Mixture cases a single source does not show


def test_unreadable_shard_of_one_source_is_skipped(tmp_path):
    """on_error="skip": a truncated shard of source a is skipped and named; b's quota comes whole;
    every rank still yields the same number of batches (topped up), so nothing waits."""
    write_dataset(tmp_path / "a", [9, 8, 7, 9], seed=1)
    write_dataset(tmp_path / "b", [6, 5, 7], seed=2)
    bad = sorted((tmp_path / "a").glob("*.tar"))[1]
    bad.write_bytes(bad.read_bytes()[:700])  # cut inside its first group
    mix = wdsllm.Mixture(
        {"a": str(tmp_path / "a"), "b": str(tmp_path / "b")}, weights={"a": 1, "b": 1}, unit="items", epoch_items=36
    )
    counts, skipped = [], []
    for rank in range(2):
        ld = wdsllm.loader(mix, batch_size=2, rank=rank, world_size=2, num_workers=2, _in_process=True, on_error="skip")
        counts.append(len(list(ld)))
        skipped.extend(ld.skipped_shards)
    # the lost documents leave holes (their batches smaller, the counts kept; a batch of them only is
    # made up by repeats, in loader.refilled_batches): no rank waits
    assert counts[0] == counts[1] > 0
    assert skipped and all(s.endswith(bad.name) for s in skipped)
    # without equal batches: b's quota exactly once, a's quota less the lost shard's documents
    docs = Counter()
    for rank in range(2):
        ld = wdsllm.loader(
            mix, batch_size=2, rank=rank, world_size=2, num_workers=2, on_error="skip", equal_batches=False
        )
        for b in ld:
            docs.update(zip(b["sources"].tolist(), b["docs"][:, 0].tolist()))
    per_source = Counter(s for s, _ in docs.elements())
    assert per_source[1] == 18 and max(docs.values()) == 1
    assert 18 - 9 <= per_source[0] < 18  # a lost what the cut shard held of its quota
    with pytest.raises(wdsllm.errors.WdsllmError, match=bad.name):
        list(wdsllm.loader(mix, batch_size=2, rank=0, world_size=1))


def test_uint16_and_uint32_sources_widen_into_one_batch(tmp_path):
    """One tokenizer, two token dtypes (`wdsllm pack --dtype uint32`): batches hold the right tokens
    of both, documents and rows mixing them, through forked workers too."""
    texts = {}
    for name, dtype in (("narrow", None), ("wide", "uint32")):
        path = tmp_path / f"{name}.txt"
        lines = [f"{name} document {i}: " + "word " * (i % 7) for i in range(40)]
        path.write_text("\n".join(lines) + "\n")
        pack_api([path], tmp_path / name, dtype=dtype)
        texts[name] = {tuple(t) for t in encode_texts(lines)}
    with pytest.raises(PackError, match="--dtype must be one of"):
        pack_api([tmp_path / "wide.txt"], tmp_path / "int8", dtype="int8")
    assert wdsllm.dataset(str(tmp_path / "wide")).catalog.index.dtype == "uint32"
    assert wdsllm.dataset(str(tmp_path / "narrow")).catalog.index.dtype == "uint16"
    mix = wdsllm.Mixture({"narrow": str(tmp_path / "narrow"), "wide": str(tmp_path / "wide")}, unit="items")
    assert wdsllm.dataset(mix).catalog.index.dtype == "uint32"
    got = {"narrow": set(), "wide": set()}
    for b in wdsllm.loader(mix, batch_size=4, num_workers=2, seed=3):
        for row, (src, n) in enumerate(zip(b["sources"].tolist(), b["lengths"].tolist())):
            got[mix.names[src]].add(tuple(b["input_ids"][row, :n].tolist()))
    assert got == texts
    rows = list(wdsllm.loader(mix, batching="pack", seq_len=64, batch_size=2, num_workers=2, seed=3, boundaries=True))
    mixed = 0
    for b in rows:
        for ids, src, pos in zip(b["input_ids"], b["sources"], b["position_ids"]):
            real = src[src >= 0].tolist()
            mixed += len(set(real)) > 1
            starts = [*torch.nonzero(pos == 0).flatten().tolist(), len(ids)]
            for k, (a, z) in enumerate(itertools.pairwise(starts[: len(real) + 1])):
                piece = tuple(ids[a:z].tolist())  # a document, or its end or start where rows cut it
                assert any(piece in (t[: len(piece)], t[-len(piece) :]) for t in texts[mix.names[real[k]]])
    assert mixed


def test_loader_on_error_reaches_a_raw_source(parts, tmp_path):
    """The loader's on_error="skip" is what a raw source of a mixture parses with (unless the
    source sets its own): a bad line is skipped and counted, not fatal; without it, named."""
    lines = [json.dumps({"text": f"line {i} of a small raw source"}) for i in range(200)]
    lines[57] = '{"text": "a broken line'
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n", encoding="utf-8")
    counts = _sidecar(tmp_path / "side", [bad], on_error="skip")
    mix = wdsllm.Mixture(
        {"wiki": parts["wiki"], "bad": {"raw": str(bad), "counts": counts, "unit_bytes": UNIT_BYTES}},
        weights={"wiki": 0.6, "bad": 0.4},
        epoch_tokens=20_000,
    )
    loader = wdsllm.loader(mix, batch_size=16, seed=0, rank=0, world_size=1, on_error="skip")
    sources = np.concatenate([b["sources"].numpy() for b in loader])
    assert loader.skipped_docs >= 1  # once per reading of its unit: the source repeats here
    assert (sources == 1).sum() == loader.catalog.planner.quotas(0)[1]
    with pytest.raises(wdsllm.WdsllmError, match=r"bad\.jsonl:58"):
        list(wdsllm.loader(mix, batch_size=16, seed=0, rank=0, world_size=1))
