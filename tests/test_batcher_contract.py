"""One contract for every batcher, on blocks of synthetic items (no shard, no tar): as torchdata's
``run_test_save_load_state`` does for nodes, a new batching mode gets the whole contract by adding
one line to ``BATCHERS``.

The contract:
- ``count`` equals the number of batches ``batches`` makes and the number ``dry_batches`` plans;
- planning from lengths alone (``dry_batches``) names exactly the items each real batch holds;
- resuming at every batch (from ``start_position``, with and without the hint the batch before
  it gave) yields exactly the rest of the uninterrupted stream;
- batches do not depend on how the stream is cut into blocks.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wdsllm.load.batching import (
    MODES,
    Batcher,
    BucketBatcher,
    ConcatBatcher,
    FixedBatcher,
    ItemChunker,
    PackBatcher,
)
from wdsllm.load.block import Block
from wdsllm.load.stream import StreamSpec

BATCHERS: dict[str, Callable[[], Batcher]] = {
    "fixed": lambda: FixedBatcher(4),
    "fixed_drop_last": lambda: FixedBatcher(4, drop_last=True),
    "items": lambda: ItemChunker(),
    "bucket": lambda: BucketBatcher(9, batch_size=4),
    "bucket_drop_last": lambda: BucketBatcher(9, batch_size=4, drop_last=True),
    "budget": lambda: BucketBatcher(11, max_tokens=60),
    "budget_multiple": lambda: BucketBatcher(11, max_tokens=64, pad_to_multiple_of=8, drop_last=True),
    "pack": lambda: PackBatcher(7, seq_len=24, batch_size=3),
    "pack_drop_last": lambda: PackBatcher(7, seq_len=24, batch_size=3, drop_last=True),
    "concat": lambda: ConcatBatcher(seq_len=24, batch_size=2),
    "concat_drop_last": lambda: ConcatBatcher(seq_len=24, batch_size=2, drop_last=True),
}
SPEC = StreamSpec(seed=3, epoch=1, rank=0, world=1, worker=0, workers=1)
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_every_registered_mode_has_contract_cases():
    names = {name.split("_")[0] for name in BATCHERS} - {"items", "budget"}
    assert names == set(MODES)


def item_tokens(position: int, length: int) -> np.ndarray:
    """Item ``position``'s tokens say which item and which token they are."""
    return (position * 1000 + np.arange(length)).astype(np.int64)


def stream(lengths: np.ndarray, cuts: list[int], start: int = 0) -> Iterator[tuple[int, Block]]:
    """The shuffled stream from position ``start``, as blocks cut at ``cuts``."""
    tokens = np.concatenate([item_tokens(p, int(n)) for p, n in enumerate(lengths)]) if len(lengths) else np.zeros(0)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    edges = sorted({start, len(lengths), *[c for c in cuts if start < c < len(lengths)]})
    for a, b in itertools.pairwise(edges):
        ids = np.arange(a, b, dtype=np.int64)
        yield a, Block(tokens, starts[a:b], lengths[a:b].astype(np.int64), ids)


def batch_items(batcher: Batcher, items: Block) -> np.ndarray:
    """Positions of the items a batch holds (rows: of the items their segments belong to)."""
    if isinstance(batcher, (PackBatcher, ConcatBatcher)):
        _, src = items.segments()
        return np.unique(items.seg_ids[src])
    return np.sort(items.ids)


def fingerprint(items: Block) -> tuple:
    out = (items.ids.tolist(), items.lengths.tolist(), items.gather_tokens().tolist())
    if items.seg_lo is not None:
        counts, src = items.segments()
        out += (counts.tolist(), items.seg_starts[src].tolist(), items.seg_ids[src].tolist())
    return out


def run_contract(batcher: Batcher, lengths: np.ndarray, cuts: list[int], other_cuts: list[int]) -> None:
    known = lengths if batcher.needs_lengths else None
    full = list(batcher.batches(stream(lengths, cuts), 0, SPEC, known, None))
    n = batcher.count(len(lengths), known)
    if isinstance(batcher, ItemChunker):  # counts and positions are per item; chunks carry several
        assert n == sum(len(items) for _, items, _ in full) == len(lengths)
        return
    dry = list(batcher.dry_batches(lengths, SPEC))
    assert n == len(full) == len(dry), (n, len(full), len(dry))
    assert [index for index, _, _ in full] == list(range(n))
    for (_, items, _), planned in zip(full, dry):
        assert batch_items(batcher, items).tolist() == np.unique(planned).tolist()
    # the same batches however the stream is cut into blocks
    recut = list(batcher.batches(stream(lengths, other_cuts), 0, SPEC, known, None))
    assert [fingerprint(b) for _, b, _ in recut] == [fingerprint(b) for _, b, _ in full]
    # a resume at every batch, from lengths alone and from the previous batch's hint
    for j in range(n):
        hints = [None] + ([full[j - 1][2]] if j and full[j - 1][2] is not None else [])
        for hint in hints:
            start = batcher.start_position(j, known, hint)
            rest = list(batcher.batches(stream(lengths, cuts, start), j, SPEC, known, hint))
            assert [i for i, _, _ in rest] == list(range(j, n)), (j, hint)
            assert [fingerprint(b) for _, b, _ in rest] == [fingerprint(b) for _, b, _ in full[j:]], (j, hint)


@pytest.mark.parametrize("name", sorted(BATCHERS))
@SETTINGS
@given(
    lengths=st.lists(st.integers(1, 30), min_size=0, max_size=45),
    cuts=st.lists(st.integers(1, 44), max_size=8),
    other_cuts=st.lists(st.integers(1, 44), max_size=8),
)
def test_batcher_contract(name, lengths, cuts, other_cuts):
    lengths = np.asarray(lengths, np.int64)
    if name.startswith("pack"):
        lengths = np.minimum(lengths, 24)  # the stream splits longer documents before packing
    run_contract(BATCHERS[name](), lengths, cuts, other_cuts)
