"""Mixtures (#12): weighted blends of datasets with every loader guarantee kept.

The main fixture packs three real sources with one tokenizer (GPT-2) and very different document
lengths: wiki articles (a few long, many stubs), wikitext paragraphs, Shakespeare lines. Layout
properties over many shapes use small synthetic datasets (real tars, written by the format's
writer), as the other loader tests do.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pack_helpers import DATA, LLAMA, SHAKESPEARE, cached, pack_api, wiki_subset
from synth import write_dataset

import wdsllm
from wdsllm.errors import ConfigError, MixtureError, StateError
from wdsllm.load.mixplan import smooth_pattern, smooth_prefix, smooth_prefixes, stratified_pattern

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WEIGHTS = {"wiki": 0.5, "para": 0.3, "lines": 0.2}


def _pack_sources(d: Path) -> dict[str, str]:
    out = {
        "wiki": d / "wiki",
        "para": d / "para",
        "lines": d / "lines",
    }
    pack_api([wiki_subset(1500)], out["wiki"], shard_size=120_000, sample_tokens=4096)
    pack_api([DATA / "corpora" / "wikitext-2-valid.txt"], out["para"], split="paragraph", shard_size=250_000)
    pack_api([SHAKESPEARE], out["lines"], shard_size=100_000, sample_tokens=2048)
    return {k: str(v) for k, v in out.items()}


@pytest.fixture(scope="session")
def sources() -> dict[str, str]:
    return cached("mixture-sources", _pack_sources)


def mixture(sources, **kw) -> wdsllm.Mixture:
    kw.setdefault("weights", WEIGHTS)
    kw.setdefault("epoch_tokens", 300_000)
    return wdsllm.Mixture(sources, **kw)


def run(pipe, world: int = 1, workers: int = 1, rank: int = 0) -> list[dict]:
    out = []
    for w in range(workers):
        out.extend(pipe.worker_iter(w, workers))
    return out


def tally(batches: list[dict], k: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and items per source of docs batches."""
    tokens, items = np.zeros(k, np.int64), np.zeros(k, np.int64)
    for b in batches:
        src, lengths = b["sources"].numpy(), b["lengths"].numpy()
        np.add.at(tokens, src, lengths)
        np.add.at(items, src, 1)
    return tokens, items


def longest(sources) -> list[int]:
    return [wdsllm.dataset(s, batch_size=1).catalog.index.doc_lengths["max"] for s in sources.values()]


# ----------------------------------------------------------------------------------------------
# Quotas


@pytest.mark.parametrize("epoch", [0, 1])
def test_token_shares_per_epoch_equal_the_quotas(sources, epoch):
    mix = mixture(sources)
    pipe = wdsllm.dataset(mix, batch_size=16, seed=1, rank=0, world_size=1)
    pipe.set_epoch(epoch)
    tokens, items = tally(run(pipe))
    planner = pipe.catalog.planner
    quotas = planner.unit_quotas(epoch)
    assert quotas == [150_000, 90_000, 60_000]
    # cut where the run's cumulative quota is reached: each epoch within one document of its own
    for got, want, most in zip(tokens.tolist(), quotas, longest(sources)):
        assert abs(got - want) < most
    assert items.tolist() == planner.quotas(epoch)


def test_item_weights_give_exact_item_quotas(sources):
    mix = mixture(sources, unit="items", epoch_tokens=None, epoch_items=6000)
    pipe = wdsllm.dataset(mix, batch_size=16, rank=0, world_size=1)
    _, items = tally(run(pipe))
    assert items.tolist() == [3000, 1800, 1200]


def _doc_counts(batches, source: int) -> Counter:
    return Counter(
        int(d) for b in batches for d, s in zip(b["docs"][:, 0].tolist(), b["sources"].tolist()) if s == source
    )


def test_repeats_and_subsets(sources):
    """wiki (1500 docs) gets 3000: every document exactly twice (floor/floor+1 with q/size = 2);
    para gets 1.5x its items, lines a subset that walks the whole source before repeating."""
    sizes = {n: wdsllm.dataset(s, batch_size=1).catalog.index.documents for n, s in sources.items()}
    mix = mixture(sources, unit="items", epoch_tokens=None, epoch_items=6000)
    pipe = wdsllm.dataset(mix, batch_size=16, rank=0, world_size=1)
    epochs = []
    for e in range(4):
        pipe.set_epoch(e)
        epochs.append(run(pipe))
    wiki = _doc_counts(epochs[0], 0)
    assert len(wiki) == sizes["wiki"] and set(wiki.values()) == {2}
    para = _doc_counts(epochs[0], 1)
    q = 1800
    lo = q // sizes["para"]
    assert set(para.values()) <= {lo, lo + 1} and sum(para.values()) == q and len(para) == sizes["para"]
    # lines: 1200 a epoch out of many more: no repeat until the whole source was walked
    seen: Counter = Counter()
    for batches in epochs:
        here = _doc_counts(batches, 2)
        assert max(here.values()) == 1 and sum(here.values()) == 1200
        assert not (set(here) & set(seen))  # 4 x 1200 < the source: nothing repeats yet
        seen.update(here)


def test_subset_walks_the_whole_source_before_repeating(tmp_path):
    write_dataset(tmp_path / "a", [7, 5, 9], seed=1)
    write_dataset(tmp_path / "b", [4, 6], seed=2)
    mix = wdsllm.Mixture(
        {"a": str(tmp_path / "a"), "b": str(tmp_path / "b")}, weights={"a": 1, "b": 1}, unit="items", epoch_items=8
    )
    pipe = wdsllm.dataset(mix, batch_size=2, rank=0, world_size=1)
    epochs = []
    for e in range(6):
        pipe.set_epoch(e)
        epochs.append([int(d) for b in run(pipe) for d, s in zip(b["docs"][:, 0].tolist(), b["sources"]) if s == 0])
    # source a (21 documents) gives 4 an epoch: five epochs walk 20 distinct documents; the sixth
    # takes the last one of the pass and 3 of the next pass (a fresh order)
    assert [len(e) for e in epochs] == [4] * 6
    walked = [d for e in epochs[:5] for d in e]
    assert len(set(walked)) == 20
    assert len(set(epochs[5]) - set(walked)) == 1


# ----------------------------------------------------------------------------------------------
# Interleaving


def test_windows_of_batches_hold_the_weights(sources):
    mix = mixture(sources, unit="items", epoch_tokens=None, epoch_items=6000)
    pipe = wdsllm.dataset(mix, batch_size=16, rank=0, world_size=1)
    batches = run(pipe)
    want = np.array([0.5, 0.3, 0.2])
    for a in range(0, len(batches) - 10, 10):
        window = np.concatenate([b["sources"].numpy() for b in batches[a : a + 10]])
        counts = np.bincount(window, minlength=3)
        assert np.abs(counts - want * len(window)).max() <= 2, counts


def test_token_weights_hold_in_windows(sources):
    """unit=tokens: windows of 10 batches of items hold the epoch's item proportions, so their
    token shares follow the weights as closely as documents' lengths let them."""
    mix = mixture(sources)
    pipe = wdsllm.dataset(mix, batch_size=16, rank=0, world_size=1)
    batches = run(pipe)
    item_share = np.array(pipe.catalog.planner.quotas(0)) / sum(pipe.catalog.planner.quotas(0))
    for a in range(0, len(batches) - 10, 10):
        window = np.concatenate([b["sources"].numpy() for b in batches[a : a + 10]])
        assert np.abs(np.bincount(window, minlength=3) - item_share * len(window)).max() <= 2


def test_stratified_batches_are_exact(sources):
    mix = mixture(sources, unit="items", epoch_tokens=None, epoch_items=6000, stratified=True)
    pipe = wdsllm.dataset(mix, batch_size=10, rank=0, world_size=1)
    for b in run(pipe):
        counts = np.bincount(b["sources"].numpy(), minlength=3)
        if len(b["sources"]) == 10:
            assert np.abs(counts - np.array([5, 3, 2])).max() <= 1, counts
    with pytest.raises(ConfigError, match="stratified"):
        wdsllm.dataset(mix, batching="pack", seq_len=64, batch_size=2)


def test_patterns():
    counts = np.array([50, 30, 20])
    p = smooth_pattern(counts)
    for n in range(1, 101):
        assert smooth_prefix(counts, n) == np.bincount(p[:n], minlength=3).tolist()
    for x in range(0, 100, 10):
        assert np.abs(np.bincount(p[x : x + 10], minlength=3) - counts / 10).max() <= 1.0
    s = stratified_pattern(np.array([41, 23, 16]), 8)
    for a in range(0, 80, 8):
        assert np.abs(np.bincount(s[a : a + 8], minlength=3) - np.array([41, 23, 16]) / 10).max() <= 1


# ----------------------------------------------------------------------------------------------
# Determinism, layouts, modes


def test_deterministic_and_a_new_order_each_epoch(sources):
    mix = mixture(sources)

    def ids(epoch, seed=0):
        pipe = wdsllm.dataset(mix, batch_size=16, seed=seed, rank=0, world_size=1)
        pipe.set_epoch(epoch)
        return [d for b in run(pipe) for d in b["docs"][:, 0].tolist()]

    first = ids(0)
    assert first == ids(0)
    assert first != ids(1) and first != ids(0, seed=1)


def _source_dirs(tmp: Path, shards: list[list[int]]) -> dict[str, str]:
    out = {}
    for i, sizes in enumerate(shards):
        write_dataset(tmp / f"s{i}", sizes, seed=10 + i, max_len=12 + 20 * i)
        out[f"s{i}"] = str(tmp / f"s{i}")
    return out


def _delivered(mix, world: int, workers: int, **kw) -> Counter:
    seen: Counter = Counter()
    for r in range(world):
        pipe = wdsllm.dataset(mix, rank=r, world_size=world, equal_batches=False, seed=4, **kw)
        for b in run(pipe, workers=max(1, workers)):
            seen.update((int(d), int(p)) for d, p in b["docs"].tolist())
    return seen


@SETTINGS
@given(
    shards=st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=17), min_size=2, max_size=3),
    weights=st.lists(st.integers(1, 5), min_size=3, max_size=3),
    world=st.integers(1, 4),
    workers=st.integers(0, 3),
    unit=st.sampled_from(["items", "tokens"]),
    scale=st.sampled_from([0.3, 1.0, 2.5]),
)
def test_exactly_once_within_the_quota_for_any_layout(shards, weights, world, workers, unit, scale):
    with tempfile.TemporaryDirectory() as tmp:
        dirs = _source_dirs(Path(tmp), shards)
        names = list(dirs)
        sizes = [sum(s) for s in shards]
        w = dict(zip(names, weights))
        epoch = max(1, int(scale * sum(sizes))) if unit == "items" else max(1, int(scale * sum(sizes) * 20))
        key = "epoch_items" if unit == "items" else "epoch_tokens"
        mix = wdsllm.Mixture(dirs, weights=w, unit=unit, **{key: epoch})
        alone = _delivered(mix, 1, 0, batch_size=3)
        assert _delivered(mix, world, workers, batch_size=3) == alone
        quotas = wdsllm.dataset(mix, batch_size=3, seed=4).catalog.planner.quotas(0)
        for s, (size, q) in enumerate(zip(sizes, quotas)):
            mine = [c for (d, _), c in alone.items() if d >> 32 in range(*_range(mix, s))]
            assert sum(mine) == q
            if q:
                assert set(mine) <= {q // size, q // size + 1}
                assert len(mine) == min(size, q)


def _range(mix, s):
    bases = wdsllm.dataset(mix, batch_size=1).catalog.bases
    return int(bases[s]), int(bases[s + 1])


MODES = {
    "fixed": dict(batch_size=4),
    "split": dict(batch_size=4, max_len=64),
    "bucket": dict(batching="bucket", batch_size=4, window=32),
    "budget": dict(batching="bucket", max_tokens=512, window=32, batch_size=None),
    "pack": dict(batching="pack", seq_len=128, window=16, batch_size=2),
    "concat": dict(batching="concat", seq_len=128, batch_size=2, boundaries=True),
}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def _small_mix(sources, **kw):
    kw.setdefault("schedule", [{"at_tokens": 20_000, "weights": {"wiki": 0.1, "para": 0.1, "lines": 0.8}}])
    kw.setdefault("epoch_tokens", 40_000)
    return mixture(sources, **kw)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_resume_is_bit_exact_before_at_and_after_a_schedule_change(sources, mode):
    mix = _small_mix(sources)
    kw = dict(MODES[mode], seed=2, num_workers=2, _in_process=True, rank=1, world_size=2, shuffle_buffer=64)
    full = list(wdsllm.loader(mix, **kw))
    assert full
    # where the change is: the first batch after which lines dominate
    _resumes_exactly(mix, kw, full, sorted({1, len(full) // 2 - 1, len(full) // 2, len(full) // 2 + 1, len(full) - 1}))


def _resumes_exactly(mix, kw: dict, full: list[dict], points) -> None:
    """A loader stopped after each of ``points`` batches and resumed from its (JSON-round-tripped)
    state gives the uninterrupted run's batches, bit for bit."""
    for k in points:
        first = wdsllm.loader(mix, **kw)
        it = iter(first)
        got = [next(it) for _ in range(k)]
        state = json.loads(json.dumps(first.state_dict()))
        second = wdsllm.loader(mix, **kw)
        second.load_state_dict(state)
        rest = list(second)
        assert len(got) + len(rest) == len(full)
        assert all(_same(a, b) for a, b in zip(got + rest, full)), k


def test_schedule_takes_effect_where_it_says(sources):
    mix = mixture(
        sources,
        unit="items",
        epoch_tokens=None,
        epoch_items=4000,
        schedule=[{"at_items": 2000, "weights": {"wiki": 0.0, "para": 0.0, "lines": 1.0}}],
    )
    pipe = wdsllm.dataset(mix, batch_size=10, rank=0, world_size=1, shuffle=False)
    src = np.concatenate([b["sources"].numpy() for b in run(pipe)])
    assert (src[2000:] == 2).all()
    assert np.bincount(src[:2000], minlength=3).tolist() == [1000, 600, 400]
    pipe.set_epoch(1)
    assert (np.concatenate([b["sources"].numpy() for b in run(pipe)]) == 2).all()


def test_mix_stats_target_is_the_current_phase_under_a_schedule(sources):
    """target_share is the phase in force at the current step; epoch_target_share the epoch's average."""
    mix = mixture(
        sources,
        unit="items",
        epoch_tokens=None,
        epoch_items=4000,
        schedule=[{"at_items": 2000, "weights": {"wiki": 0.0, "para": 0.0, "lines": 1.0}}],
    )
    ld = wdsllm.loader(mix, batch_size=10, rank=0, world_size=1, shuffle=False)
    it = iter(ld)
    for _ in range(100):  # 1000 items: in the first phase
        next(it)
    early = ld.mix_stats()
    assert [early[n]["target_share"] for n in WEIGHTS] == pytest.approx(list(WEIGHTS.values()))
    assert early["lines"]["epoch_target_share"] == pytest.approx(0.5 + 0.5 * WEIGHTS["lines"])
    for _ in range(150):  # 2500 items: in the second phase
        next(it)
    late = ld.mix_stats()
    assert [late[n]["target_share"] for n in WEIGHTS] == pytest.approx([0.0, 0.0, 1.0])
    assert late["lines"]["epoch_target_share"] == pytest.approx(early["lines"]["epoch_target_share"])
    ld.close()


def test_elastic_resume_three_ranks_to_two(sources):
    schedule = [{"at_tokens": 30_000, "weights": {"wiki": 0.2, "para": 0.2, "lines": 0.6}}]
    mix = mixture(sources, epoch_tokens=60_000, schedule=schedule)
    kw = dict(batch_size=4, seed=5, _in_process=True)
    per = [Counter() for _ in range(3)]
    states = []
    for r in range(3):
        ld = wdsllm.loader(mix, rank=r, world_size=3, num_workers=2, **kw)
        it = iter(ld)
        for _ in range(7):
            per[r].update(tuple(x) for x in next(it)["docs"].tolist())
        states.append(ld.state_dict())
    consumed = sum(per, Counter())
    rest: Counter = Counter()
    for r in range(2):
        ld = wdsllm.loader(mix, rank=r, world_size=2, num_workers=3, equal_batches=False, **kw)
        ld.load_state_dict(states[0])
        for b in ld:
            rest.update(tuple(x) for x in b["docs"].tolist())
    whole: Counter = Counter()
    for b in wdsllm.loader(mix, rank=0, world_size=1, **kw):
        whole.update(tuple(x) for x in b["docs"].tolist())
    assert consumed + rest == whole


def test_elastic_resume_refused_with_an_at_step_schedule(sources):
    """at_step points are converted with the world size: another world size would move them (and
    the plan of the epoch being resumed), so the resume is refused, naming the way out."""
    schedule = [{"at_step": 5, "weights": {"wiki": 0.2, "para": 0.2, "lines": 0.6}}]
    mix = mixture(sources, epoch_tokens=None, epoch_items=6_000, unit="items", schedule=schedule)
    kw = dict(batch_size=4, seed=5, _in_process=True, num_workers=1)
    ld = wdsllm.loader(mix, rank=0, world_size=3, **kw)
    it = iter(ld)
    for _ in range(3):
        next(it)
    state = ld.state_dict()
    same = wdsllm.loader(mix, rank=0, world_size=3, **kw)
    same.load_state_dict(state)  # the same world size resumes as ever
    with pytest.raises(StateError, match="at_tokens / at_items"):
        wdsllm.loader(mix, rank=0, world_size=2, **kw).load_state_dict(state)


# ----------------------------------------------------------------------------------------------
# What batches say, and the realized mix


def test_sources_align_with_docs_in_rows(sources):
    mix = mixture(sources, epoch_tokens=30_000)
    pipe = wdsllm.dataset(mix, batching="pack", seq_len=256, batch_size=4, rank=0, world_size=1)
    bases = pipe.catalog.bases
    mixed_rows = 0
    for b in run(pipe):
        docs, src = b["docs"].numpy(), b["sources"].numpy()
        assert src.shape == docs.shape
        assert ((src == -1) == (docs == -1)).all()
        real = docs >= 0
        assert (src[real] == np.searchsorted(bases, docs[real] >> 32, side="right") - 1).all()
        mixed_rows += sum(len(set(row[row >= 0].tolist())) > 1 for row in src)
    assert mixed_rows  # a packed row may hold documents of several sources


@pytest.mark.parametrize("workers", [0, 2])
def test_mix_stats(sources, workers):
    """Counted where batches are made (real forked DataLoader workers too), reported by the loader."""
    mix = mixture(sources, epoch_tokens=50_000)
    ld = wdsllm.loader(mix, batch_size=8, rank=0, world_size=1, num_workers=workers)
    tokens, items = tally(list(ld))
    stats = ld.mix_stats()
    assert [stats[n]["epoch_tokens"] for n in WEIGHTS] == tokens.tolist()
    assert [stats[n]["items"] for n in WEIGHTS] == items.tolist()
    assert [stats[n]["epoch_quota"] for n in WEIGHTS] == [25_000, 15_000, 10_000]
    for n, w in WEIGHTS.items():
        assert abs(stats[n]["share"] - w) < 0.02 and stats[n]["target_share"] == pytest.approx(w)
    with pytest.raises(ConfigError):
        wdsllm.loader(sources["wiki"], batch_size=8).mix_stats()


# ----------------------------------------------------------------------------------------------
# The file, and refusals


def test_mixture_file_equals_the_python_spec(sources, tmp_path):
    path = tmp_path / "mix.yaml"
    rel = {n: str(Path(s).relative_to(Path(s).parent.parent)) for n, s in sources.items()}
    (tmp_path / "data").symlink_to(Path(sources["wiki"]).parent.parent)
    path.write_text(
        "sources:\n"
        + "".join(f"  {n}: data/{r}\n" for n, r in rel.items())
        + "weights: {wiki: 5, para: 3, lines: 2}\nunit: tokens\nepoch_tokens: 30000\n"
        + "schedule:\n  - at_tokens: 15000\n    weights: {wiki: 1, para: 1, lines: 1}\n"
    )
    from_file = run(wdsllm.dataset(str(path), batch_size=8, rank=0, world_size=1))
    spec = mixture(
        sources,
        epoch_tokens=30_000,
        schedule=[{"at_tokens": 15000, "weights": {"wiki": 1, "para": 1, "lines": 1}}],
    )
    from_spec = run(wdsllm.dataset(spec, batch_size=8, rank=0, world_size=1))
    assert len(from_file) == len(from_spec)
    assert all(_same(a, b) for a, b in zip(from_file, from_spec))


@pytest.mark.parametrize(
    "text, key",
    [
        ("sources: {a: x}\nweights: {b: 1}\n", "weights.b"),
        ("sources: {a: x}\nweights: {a: -1}\n", "weights.a"),
        ("sources: {a: x, b: y}\nweights: {a: 1}\n", "weights.b"),
        ("sources: {a: x}\nunit: bytes\n", "unit"),
        ("sources: {a: x}\nepoch_tokens: many\n", "epoch_tokens"),
        ("sources: {a: x}\nschedule: [{at_tokens: 5}]\n", "schedule[0].weights"),
        ("sources: {a: x}\nschedule: [{at_tokens: 5, weights: {a: 1}, when: 3}]\n", "schedule[0].when"),
        ("sources: {a: x}\nwieghts: {a: 1}\n", "wieghts"),
        ("weights: {a: 1}\n", "sources"),
    ],
)
def test_file_errors_name_the_key(tmp_path, text, key):
    path = tmp_path / "m.yml"
    path.write_text(text)
    with pytest.raises(MixtureError, match=rf"m\.yml: key '{__import__('re').escape(key)}'"):
        wdsllm.loader(str(path), batch_size=4)


def test_bad_yaml_names_the_line(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("sources:\n  a: x\n weights: [\n")
    with pytest.raises(MixtureError, match=r"m\.yaml: not valid YAML at line \d+"):
        wdsllm.dataset(str(path))


def _tiny(d: Path, tokenizer=None, **kw) -> str:
    text = d.parent / f"{d.name}.txt"
    text.write_text("".join(f"line {i} of the text\n" for i in range(40)))
    if tokenizer:
        kw["tokenizer"] = tokenizer
    pack_api([text], d, **kw)
    return str(d)


def test_refusals(sources, tmp_path):
    llama = _tiny(tmp_path / "llama", LLAMA)
    with pytest.raises(MixtureError, match="'wiki' and 'other' were packed with different tokenizers"):
        wdsllm.dataset(wdsllm.Mixture({"wiki": sources["wiki"], "other": llama}))
    rows = _tiny(tmp_path / "rows", mode="packed", seq_len=16)
    with pytest.raises(MixtureError, match=r"'wiki' \(docs\) and 'rows' \(packed\) differ in mode"):
        wdsllm.dataset(wdsllm.Mixture({"wiki": sources["wiki"], "rows": rows}))
    rows32 = _tiny(tmp_path / "rows32", mode="packed", seq_len=32)
    with pytest.raises(MixtureError, match="different seq_len"):
        wdsllm.dataset(wdsllm.Mixture({"rows": rows, "rows32": rows32}))
    with pytest.raises(ConfigError, match="resample"):
        wdsllm.dataset(wdsllm.Mixture(sources), resample=True)


def test_packed_sources_mix_rows(tmp_path):
    a = _tiny(tmp_path / "a", mode="packed", seq_len=16)
    b = _tiny(tmp_path / "b", mode="packed", seq_len=16)
    mix = wdsllm.Mixture({"a": a, "b": b}, weights={"a": 3, "b": 1}, unit="items", epoch_items=40)
    batches = run(wdsllm.dataset(mix, batch_size=4, rank=0, world_size=1))
    rows = torch.cat([b["sources"][:, 0] for b in batches])
    assert np.bincount(rows.numpy()).tolist() == [30, 10]
    from wdsllm.load import counts as countsmod

    pipe = wdsllm.dataset(mix, batch_size=3, rank=0, world_size=3)
    counts = countsmod.EpochCounts.create(pipe.catalog, pipe.cfg, 0, 3, 2)
    assert counts.ready()  # fixed batches of rows: exact at once, from the stretches
    plan = pipe.catalog.default_plan(0)
    assert np.array_equal(counts.exact(), countsmod._shares_exact(pipe.catalog, pipe.cfg, 0, 3, 2, plan, None))


# ----------------------------------------------------------------------------------------------
# A real multi-process run


@pytest.fixture(scope="module")
def mixture_file_runs(sources) -> tuple[Path, Path]:
    """One torchrun launch (gloo, 3 ranks x 2 DataLoader workers) over a mixture file, with equal
    batches, then without: the mixture file and the directory of OUT/equal{1,0}/rank{r}.json
    (once per test run, its xdist workers included)."""
    return cached("mixture-file-runs", lambda tmp: _mixture_file_runs(sources, tmp))


def _mixture_file_runs(sources: dict[str, str], tmp: Path) -> tuple[Path, Path]:
    from test_distributed import torchrun

    mix = tmp / "mix.yaml"
    mix.write_text(
        "sources:\n"
        + "".join(f"  {n}: {p}\n" for n, p in sources.items())
        + "weights: {wiki: 0.5, para: 0.3, lines: 0.2}\nepoch_tokens: 40000\n"
    )
    args = []
    for equal in (1, 0):
        (tmp / f"equal{equal}").mkdir()
        args += [*(["--then"] if args else []), "--data", str(mix), "--out", str(tmp / f"equal{equal}")]
        args += ["--workers", "2", "--batch-size", "4", "--equal-batches", str(equal)]
    torchrun("ddp_epoch.py", 3, *args)
    return mix, tmp


@pytest.mark.timeout(300)
@pytest.mark.parametrize("equal", [1, 0])
def test_torchrun_three_ranks_two_workers_a_mixture_file(mixture_file_runs, equal):
    """torchrun (gloo) 3 ranks x 2 DataLoader workers over a mixture file: with equal batches
    every rank yields the same count (a per-step all_reduce never hangs) and no document is read
    more often than the mixture's quota says; without, the ranks' union is the single-process epoch."""
    mix, tmp = mixture_file_runs
    reports = [json.loads((tmp / f"equal{equal}" / f"rank{r}.json").read_text()) for r in range(3)]
    for epoch in range(2):
        pipe = wdsllm.dataset(str(mix), batch_size=4, seed=3, shuffle_buffer=16, rank=0, world_size=1)
        pipe.set_epoch(epoch)
        whole = Counter(d for b in run(pipe) for d in b["docs"][:, 0].tolist())
        seen = Counter(i for rep in reports for i in rep["epochs"][epoch]["ids"])
        counts = [rep["epochs"][epoch]["batches"] for rep in reports]
        if equal:
            assert len(set(counts)) == 1, f"ranks yielded different batch counts: {counts}"
            assert not seen - whole
            dropped = sum(rep["epochs"][epoch]["dropped_batches"] for rep in reports)
            assert (whole - seen).total() <= dropped * 4
        else:
            assert seen == whole


def test_schedule_at_step(sources):
    """at_step with fixed batching: step k is k batches of every rank (here 1 rank of 10 items)."""
    mix = mixture(
        sources,
        unit="items",
        epoch_tokens=None,
        epoch_items=3000,
        schedule=[{"at_step": 100, "weights": {"wiki": 0, "para": 1, "lines": 0}}],
    )
    src = np.concatenate([b["sources"].numpy() for b in run(wdsllm.dataset(mix, batch_size=10, rank=0, world_size=1))])
    assert (src[1000:] == 1).all() and (src[:1000] != 1).any()
    with pytest.raises(ConfigError, match="at_step"):
        wdsllm.dataset(mix, batching="bucket", batch_size=4)


def test_stats_on_a_mixture_file(sources, tmp_path):
    from pack_helpers import cli

    path = tmp_path / "mix.yaml"
    path.write_text(
        "sources:\n"
        + "".join(f"  {n}: {p}\n" for n, p in sources.items())
        + "weights: {wiki: 0.5, para: 0.3, lines: 0.2}\nunit: items\nepoch_items: 6000\n"
    )
    out = json.loads(cli("stats", path, "--json", "--seq-len", "256").stdout)
    rows = {r["source"]: r for r in out["mixture"]}
    assert rows["wiki"]["quota"] == 3000 and rows["wiki"]["repeats"] == pytest.approx(2.0)
    assert rows["lines"]["subset"] == pytest.approx(1200 / rows["lines"]["items"])
    assert {m["mode"] for m in out["modes"]} >= {"bucket", "pack", "concat"}
    text = cli("stats", path, "--seq-len", "256", "--plot", tmp_path / "shares.png").stdout
    assert "x2.00 (repeats)" in text and "% subset" in text
    assert "planned shares drawn to" in text and (tmp_path / "shares.png").read_bytes()[:4] == b"\x89PNG"


def test_endless_stream_continues_the_passes_and_resumes(sources):
    mix = mixture(sources, epoch_tokens=20_000)
    kw = dict(batch_size=8, epochs=None, seed=3, rank=0, world_size=1, num_workers=2, _in_process=True)
    full_it = iter(wdsllm.loader(mix, **kw))
    full = [next(full_it) for _ in range(160)]  # several epochs of the mixture
    assert len({b["epoch"] for b in full}) > 2
    first = wdsllm.loader(mix, **kw)
    it = iter(first)
    got = [next(it) for _ in range(77)]
    second = wdsllm.loader(mix, **kw)
    second.load_state_dict(first.state_dict())
    it2 = iter(second)
    rest = [next(it2) for _ in range(160 - 77)]
    assert all(_same(a, b) for a, b in zip(got + rest, full))


# ----------------------------------------------------------------------------------------------
# Counts at start-up: a lower bound at once from the plan's stretches, the exact table later


@SETTINGS
@given(
    shards=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=12), min_size=2, max_size=3),
    weights=st.lists(st.integers(0, 5), min_size=3, max_size=3).filter(lambda w: w[0] + w[1] > 0),
    world=st.integers(1, 4),
    workers=st.integers(1, 3),
    mode=st.sampled_from(sorted(MODES)),
    unit=st.sampled_from(["items", "tokens"]),
    scale=st.sampled_from([0.4, 1.0, 2.5]),
    epoch=st.integers(0, 2),
)
def test_a_mixtures_shares_and_bounds_at_once_agree_with_its_slices(
    shards, weights, world, workers, mode, unit, scale, epoch
):
    """The shares' items and tokens from the stretches alone are those of the consumers' slices;
    the bound at once never exceeds the exact count (counted from the slices, in the background),
    and a worker's streaming bound never exceeds its share of the equal count."""
    from wdsllm.load import counts as countsmod
    from wdsllm.load.stream import ShareLengths

    with tempfile.TemporaryDirectory() as tmp:
        dirs = _source_dirs(Path(tmp), shards)
        sizes = [sum(s) for s in shards]
        if not all(sizes[i] or not weights[i] for i in range(len(sizes))):
            return  # an empty source with a weight is refused (test_refusals)
        w = dict(zip(dirs, weights))
        total = max(1, int(scale * sum(sizes) * (1 if unit == "items" else 20)))
        key = "epoch_items" if unit == "items" else "epoch_tokens"
        mix = wdsllm.Mixture(dirs, weights=w, unit=unit, **{key: total})
        pipe = wdsllm.dataset(mix, rank=0, world_size=world, seed=5, shuffle_buffer=7, **MODES[mode])
        catalog, cfg = pipe.catalog, pipe.cfg
        plan = catalog.default_plan(epoch)
        items, tokens, _ = countsmod._plan_sizes(catalog, plan, world, workers, True)
        for r in range(world):
            for wk in range(workers):
                spec = cfg.spec(epoch, r, world, wk, workers)
                slices = countsmod.planmod.slices_for(catalog, cfg, spec, plan)  # its own share
                assert items[r, wk] == sum(sl.count for sl in slices)
                whole = wdsllm.load.config.Config(seed=5).spec(epoch, r, world, wk, workers)  # no max_len
                assert tokens[r, wk] == ShareLengths(catalog, slices, whole).total()
        table = countsmod.EpochCounts.create(catalog, cfg, epoch, world, workers)
        exact = table.exact()
        assert np.array_equal(exact, countsmod._shares_exact(catalog, cfg, epoch, world, workers, plan, None))
        assert (table.bound <= exact).all()
        limits = countsmod.EpochLimits(
            countsmod.EpochCounts(table.bound, None, countsmod._Background(lambda: exact)), 0, workers
        )
        share = countsmod.round_robin_share(exact[0], int(exact.sum(axis=1).min()))
        for wk in range(workers):
            assert limits.worker_limit(wk).bound <= share[wk] == limits.worker_limit(wk).value()


@pytest.mark.parametrize("mode", ["budget", "pack", "split"])
def test_equal_batches_on_every_rank_with_the_count_in_the_background(sources, mode, tmp_path, monkeypatch):
    """Three ranks of two workers stream from the bound and stop at the same exact count, which
    every rank (and its workers) reads from one node-wide cache file keyed by the mixture."""
    import tempfile as tf

    from wdsllm.load import counts as countsmod

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tf, "tempdir", None)  # gettempdir() follows TMPDIR again
    mix = _small_mix(sources)
    world, workers = 3, 2
    per_rank = []
    for rank in range(world):
        opts = dict(rank=rank, world_size=world, num_workers=workers, _in_process=True, seed=2)
        loader = wdsllm.loader(mix, **opts, **MODES[mode])
        n = sum(1 for _ in loader)  # streamed from the bound, not waiting for the count
        # (len() of an epoch's end is the next epoch's: asked of a fresh loader)
        assert loader.limits.ready() and n == loader.limits.per_rank == len(wdsllm.loader(mix, **opts, **MODES[mode]))
        per_rank.append(n)
    assert len(set(per_rank)) == 1, per_rank
    catalog, cfg = loader.catalog, loader.cfg
    counts = countsmod.EpochCounts.create(catalog, cfg, 0, world, workers)
    assert (counts.bound < counts.exact()).any()  # a bound at once, not the exact table
    cached = list(Path(countsmod.counts_cache_dir(catalog)).glob("counts-*.npy"))
    assert len(cached) == 1 and np.array_equal(np.load(cached[0]), counts.exact())
    # another mixture of the same sources is another table
    other = wdsllm.loader(_small_mix(sources, weights={"wiki": 0.2, "para": 0.2, "lines": 0.6}), seed=2, **MODES[mode])
    other_counts = countsmod.EpochCounts.create(other.catalog, other.cfg, 0, world, workers)
    other_counts.exact()
    assert len(list(Path(countsmod.counts_cache_dir(catalog)).glob("counts-*.npy"))) == 2


@SETTINGS
@given(counts=st.lists(st.integers(0, 400), min_size=1, max_size=5), step=st.integers(1, 97))
def test_smooth_prefixes_at_once_equal_one_at_a_time(counts, step):
    xs = np.arange(0, sum(counts) + 2 * step, step, dtype=np.int64)
    assert smooth_prefixes(counts, xs).tolist() == [smooth_prefix(counts, int(x)) for x in xs]


@SETTINGS
@given(
    shards=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=12), min_size=2, max_size=3),
    world=st.integers(1, 3),
    workers=st.integers(1, 3),
    block=st.integers(1, 40),
    scale=st.sampled_from([0.4, 2.5]),
)
def test_a_consumers_slices_are_its_rounds_of_each_sources_stream(shards, world, workers, block, scale):
    """``MixPlanner.slices`` (one walk over each source's part) equals the plain rule: in every
    round, each source's next run of stream positions, as ``PassStream.slices`` gives it."""
    from wdsllm.load.plan import Slice, split_range

    with tempfile.TemporaryDirectory() as tmp:
        dirs = _source_dirs(Path(tmp), [s if sum(s) else [1] for s in shards])
        total = max(1, int(scale * sum(sum(s) or 1 for s in shards)))
        mix = wdsllm.Mixture(dirs, unit="items", epoch_items=total)
        planner = wdsllm.dataset(mix, batch_size=2, seed=3).catalog.planner
        for r in range(world):
            for w in range(workers):
                want = []
                for group, seg in enumerate(planner.segments(0)):
                    firsts, counts = [], []
                    for first, n in seg:
                        ra, rb = split_range(n, world, r)
                        wa, wb = split_range(rb - ra, workers, w)
                        firsts.append(first + ra + wa)
                        counts.append(wb - wa)
                    done = [0] * len(counts)
                    for k in range(-(-sum(counts) // block)):
                        upto = smooth_prefix(counts, min(sum(counts), (k + 1) * block))
                        for s, (x, y) in enumerate(zip(done, upto)):
                            for sl in planner.streams[s].slices(firsts[s] + x, firsts[s] + y):
                                want.append(Slice(sl.shard + int(planner.bases[s]), sl.start, sl.stop, group=group))
                        done = upto
                got = planner.slices(0, r, world, w, workers, block)
                assert [(x.key(), x.group) for x in got] == [(x.key(), x.group) for x in want]
