"""The stores' figures in ``Loader.metrics()``: ``store/<scheme://host>/<counter>`` for every store
this process counted (``storage.counters``), with its receive rate and the shards of it skipped.

A loader without workers reading remote shards moves a store's counters almost every batch, and a
trainer may ask for the figures every step: each store's figures are kept and made again only
when that store's counters moved (its version in ``counters.store_versions``) or a shard of it
was skipped, so a call costs one version check, or one store's figures.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from ..storage.counters import STORE_NAMES, one_store_stats, store_key, store_versions, stores_version


class StoreFigures:
    """Every store's figures in one dict, each store's made again only when it moved."""

    def __init__(self) -> None:
        self._key: tuple[int, int] | None = None  # (all stores' version, shards skipped) last seen
        self._skipped: dict[str, int] = {}  # shards skipped per store, made when the list grows
        self._marks: dict[str, int] = {}  # per store, its counters' version its figures hold
        self._figures: dict[str, float] = {}  # every store's, by store name

    def figures(self, skipped_shards: Sequence[str]) -> dict[str, float]:
        """Every store's figures, by store name (a dict this object keeps and changes: copy it)."""
        key = (stores_version(), len(skipped_shards))
        if key == self._key:
            return self._figures
        versions = store_versions()
        marks, figures = self._marks, self._figures
        if self._key is None or key[1] != self._key[1]:
            self._skipped = _skipped_per_store(skipped_shards)
            marks.clear()  # every store made again: its skipped shards, or it is gone
            figures.clear()
        if self._skipped:
            for store in self._skipped.keys() - versions.keys():
                versions[store] = -1  # a store that counted nothing, but a shard of it was skipped
        if versions.keys() != marks.keys():  # a store appeared, or reset_stats() forgot some
            marks.clear()
            figures.clear()
            versions = dict(sorted(versions.items()))
        for store, version in versions.items():
            if marks.get(store) != version:
                marks[store] = version
                _add_store(figures, store, one_store_stats(store), self._skipped.get(store, 0))
        self._key = key
        return figures


#: each store's keys (its counters, the receive rate, the shards skipped), made once per store
_STORE_KEYS: dict[str, tuple[tuple[str, ...], str, str]] = {}
#: a store's counters in ``STORE_NAMES`` order (the counters hold every name), and none counted
_COUNTS = operator.itemgetter(*STORE_NAMES)
_NONE = dict.fromkeys(STORE_NAMES, 0)


def _store_keys(store: str) -> tuple[tuple[str, ...], str, str]:
    keys = _STORE_KEYS.get(store)
    if keys is None:
        named = tuple(f"store/{store}/{name}" for name in STORE_NAMES)
        keys = _STORE_KEYS[store] = (named, f"store/{store}/bytes_per_s", f"store/{store}/skipped_shards")
    return keys


def _skipped_per_store(skipped_shards: Sequence[str]) -> dict[str, int]:
    skipped: dict[str, int] = {}
    for url in skipped_shards:
        store = store_key(url)
        skipped[store] = skipped.get(store, 0) + 1
    return skipped


def _add_store(figures: dict[str, float], store: str, counts: dict[str, int] | None, skipped: int) -> None:
    """One store's figures into ``figures`` (``counts`` None: it counted nothing, but shards of it
    were skipped)."""
    counts = counts if counts is not None else _NONE
    named, rate, skips = _store_keys(store)
    figures.update(zip(named, map(float, _COUNTS(counts))))
    seconds = counts["fetch_ns"] / 1e9
    figures[rate] = counts["received_bytes"] / seconds if seconds > 0 else 0.0
    figures[skips] = float(skipped)
