"""Steering over raw text (issue #42): a mixture of a packed source and raw tinyshakespeare planned
from its count sidecar takes new weights (made ahead for a later step, or at once), a skip and an
exclusion of the raw source's units, each exactly on resume; a raw source's documents cannot be
excluded by id (refused, saying what to do instead)."""

from __future__ import annotations

import functools

import pytest
import test_mixture_raw as raw_mix
from pack_helpers import GPT2, SHAKESPEARE
from test_steering_plans import assert_same_run, resumed_run, same, steered_run

import wdsllm
from wdsllm.errors import SteeringError

KW = dict(batch_size=8, seed=2, shuffle_buffer=64, _in_process=True)
parts = raw_mix.parts  # the fixture: a packed wiki source and tinyshakespeare's count sidecar


def _loader(made: dict, workers: int = 2):
    return wdsllm.loader(raw_mix._mix(made, epoch_tokens=40_000), num_workers=workers, **KW)


def _steered(made: dict, change, after: int, workers: int = 2):
    out, loader = steered_run(None, change, after, loader=_loader(made, workers))
    metrics = loader.metrics()
    loader.close()
    return out, metrics


def test_weights_made_ahead_over_raw_text_are_the_weights_made_at_their_step(parts):
    now, _ = _steered(parts, lambda ld: ld.set_weights({"wiki": 0.2, "lines": 0.8}), 9)
    ahead, metrics = _steered(parts, lambda ld: ld.set_weights({"wiki": 0.2, "lines": 0.8}, at=9), 3)
    assert len(ahead) == len(now) > 9 and all(same(a, b) for a, b in zip(ahead, now))
    assert metrics["steer_replans_ahead"] == 1
    lines = [float((b["sources"] == 1).float().mean()) for b in ahead]
    assert sum(lines[:9]) / 9 < sum(lines[9:]) / len(lines[9:])  # the raw source's share rose


@pytest.mark.parametrize("cut", [2, 5, 12])
def test_resume_around_a_skip_and_an_exclusion_of_the_raw_source_equals_uninterrupted(parts, cut):
    def change(loader):
        loader.skip(6, 8)
        loader.exclude(sources=["lines"], at=10)

    full, _ = _steered(parts, change, 4)
    after = full[8:]  # planned steps 10 on: 8 batches yielded before (two skipped)
    assert any((b["sources"] == 1).any() for b in full[:8])
    assert not any((b["sources"] == 1).any() for b in after)
    build = functools.partial(_loader, parts)
    assert_same_run(resumed_run(build, change, 4, cut), full, cut)


def test_raw_documents_cannot_be_excluded_by_id(parts):
    loader = _loader(parts, workers=0)
    batch = next(iter(loader))
    raw_doc = int(batch["docs"][(batch["sources"] == 1).nonzero()[0, 0], 0]) if (batch["sources"] == 1).any() else 0
    with pytest.raises(SteeringError, match="raw text names its documents by input file and line"):
        loader.exclude(docs=[raw_doc])
    loader.close()


def test_a_raw_unit_excluded_ahead_is_the_unit_excluded_at_its_step(parts):
    """One raw source: its units are its shards; made ahead or at step 6, the same run, without
    the unit's documents from there on."""
    source = wdsllm.RawTextSource(
        str(SHAKESPEARE), tokenizer=str(GPT2), counts=parts["counts"], unit_bytes=raw_mix.UNIT_BYTES
    )

    def run(change, after):
        loader = wdsllm.loader(source, num_workers=2, **{**KW, "batch_size": 64})
        out, loader = steered_run(None, change, after, epochs=(0,), loader=loader)
        loader.close()
        return [d for b in out for d in b["docs"][:, 0].tolist()]

    plain = run(lambda ld: None, 10**9)
    now = run(lambda ld: ld.exclude(shards=[1]), 6)
    ahead = run(lambda ld: ld.exclude(shards=[1], at=6), 2)
    assert ahead == now and now[: 6 * 64] == plain[: 6 * 64] and len(now) < len(plain)
    assert set(now) < set(plain)
