"""Every source keeps the Source contract (``load/sources/protocol.py``): a packed dataset (whole,
or shards the user listed), raw text with and without its count sidecar, and a mixture of those.

What a source says without reading a unit (its counts, its documents' lengths) is what reading the
unit through its reader gives; its lengths agree with themselves whichever way they are asked; its
fingerprint is the same on every opening and differs between sources. One contract, every source.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pack_helpers import GPT2, SHAKESPEARE, cached, shakespeare_counts
from test_mixtures import _pack_sources

import wdsllm
from wdsllm.errors import ConfigError, MixtureError
from wdsllm.load.config import Config
from wdsllm.load.plan import Slice
from wdsllm.load.read import ReadOptions
from wdsllm.load.sources import Source
from wdsllm.load.sources.open import open_source

UNIT_BYTES = 200_000  # tinyshakespeare in 6 units


@pytest.fixture(scope="module")
def given() -> dict:
    """What each kind of source is opened from."""
    wiki = cached("mixture-sources", _pack_sources)["wiki"]
    counts = shakespeare_counts(UNIT_BYTES)
    listed = [str(p) for p in sorted(Path(wiki).glob("*.tar"))[:3]][::-1]  # a subset, out of index order
    raw = {"raw": str(SHAKESPEARE), "tokenizer": str(GPT2), "unit_bytes": UNIT_BYTES}
    return {
        "packed": wiki,
        "packed-listed": listed,
        "raw-counted": {**raw, "counts": counts},
        "raw": raw,
        "mixture": wdsllm.Mixture(
            {"wiki": wiki, "lines": {"raw": str(SHAKESPEARE), "counts": counts, "unit_bytes": UNIT_BYTES}},
            weights={"wiki": 0.5, "lines": 0.5},
        ),
    }


KINDS = ["packed", "packed-listed", "raw-counted", "raw", "mixture"]


def _read_unit(source: Source, unit: int) -> tuple[int, np.ndarray]:
    """(items, their lengths) of a whole unit, read through the unit's reader."""
    reader, local = source.reader(unit)
    whole = Slice(local)
    options = ReadOptions()
    blocks = list(reader.read(whole, skip=0, options=options, opened=reader.opening(whole, 0, options)))
    lengths = np.concatenate([b.lengths for b in blocks]) if blocks else np.zeros(0, np.int64)
    return len(lengths), lengths


@pytest.mark.parametrize("kind", KINDS)
def test_what_a_source_says_unread_is_what_its_units_hold(given, kind):
    source = open_source(given[kind])
    assert isinstance(source, Source)
    assert source.mode == "docs"
    counts, tokens, lengths = source.items_per_shard, source.tokens_per_shard, source.lengths()
    assert (counts is None) == (kind == "raw") and (lengths is None) == (kind == "raw")
    units = len(source.urls)
    for unit in sorted({0, 1, units - 1}):
        items, read = _read_unit(source, unit)
        assert items > 0
        if counts is not None:
            assert items == int(counts[unit]) and int(read.sum()) == int(tokens[unit])
        if lengths is not None:
            assert np.array_equal(lengths.of_unit(unit), read)
            assert np.array_equal(lengths.of_unit(unit, 2, 5), read[2:5])


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "raw"])
def test_lengths_agree_whichever_way_they_are_asked(given, kind):
    source = open_source(given[kind])
    lengths = source.lengths()
    units = len(source.urls)
    per_unit = [lengths.of_unit(u) for u in range(units)]
    assert np.array_equal(lengths.whole(), np.concatenate(per_unit))
    rng = np.random.default_rng(0)
    chosen = rng.integers(0, units, 12)
    n = np.array([len(per_unit[u]) for u in chosen])
    starts = rng.integers(0, n + 1)
    stops = np.maximum(starts, rng.integers(0, n + 1))
    sums, read = lengths.sums(chosen, starts, stops)
    expected = [int(per_unit[u][a:b].sum()) for u, a, b in zip(chosen, starts, stops)]
    assert sums.tolist() == expected
    lengths.check(read)  # what was read unchecked checks out


def test_fingerprints_are_stable_and_tell_sources_apart(given):
    """The fingerprint names the units' content: raw text with or without its sidecar is the same text."""
    prints = {kind: open_source(given[kind]).fingerprint() for kind in KINDS}
    assert prints == {kind: open_source(given[kind]).fingerprint() for kind in KINDS}
    assert prints["raw"] == prints["raw-counted"]
    distinct = [kind for kind in KINDS if kind != "raw"]
    assert len({prints[kind] for kind in distinct}) == len(distinct)


def test_a_mixture_reads_each_unit_through_its_own_source(given):
    mixture = open_source(given["mixture"])
    wiki, lines = mixture.components()
    assert [p.name for p in mixture.parts] == ["wiki", "lines"]
    assert wiki.opens_units and not lines.opens_units and mixture.opens_units
    first_raw = len(wiki.urls)
    assert mixture.reader(0) == (wiki, 0)
    assert mixture.reader(first_raw + 1) == (lines, 1)
    assert mixture.mixing is not None and mixture.default_plan(0) is not None
    assert open_source(given["packed"]).mixing is None


def test_what_a_source_cannot_do_it_refuses_by_name(given):
    raw = open_source(given["raw"])
    with pytest.raises(ConfigError, match="count sidecar"):
        raw.bind(Config(equal_batches=True), 2)  # ranks could not stay in step
    with pytest.raises(MixtureError, match="'lines' is raw text without a count sidecar"):
        raw.describe_for_mixture("lines")
    with pytest.raises(MixtureError, match="'inner' is itself a mixture"):
        open_source(given["mixture"]).describe_for_mixture("inner")
    assert open_source(raw) is raw  # a source already opened is itself
