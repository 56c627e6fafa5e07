"""One description of a loader: every setting that shapes what it yields or which collectives it runs.

Ranks that must agree compare it once, before the loader's first collective (``agree.py``): a
peer built with another worker count, ``agree_every``, ``replicas`` mode, ``cp_split`` or dims
named in another order otherwise yields other batches from the second batch on, or runs
collectives its peers do not, and the run hangs until the process group's timeout.

The description is made from the option records themselves: every field of every record a face
takes (``options.FACE_RECORDS``) is in it, unless the field's declaration says otherwise
(``option(agree=...)``), so an option added later is compared without anyone remembering to add
it. Each entry has a scope: ``all`` (every rank of the layout: data-parallel ranks as well as
replica peers) or ``peers`` (the replica peers of one data-parallel coordinate: its coordinate).
Beside the options come facts the options do not hold: the resolved settings, the dataset's
identity and the layout's facts (the dims named and their order, the sizes), each with its scope.
No torch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from .options import AGREE_ALL, AGREE_NONE, AGREE_PEERS, FACE_RECORDS, FaceOptions

#: a fact beside the options: (scope, value)
Fact = tuple[str, Any]


@dataclass(frozen=True)
class Description:
    """What one rank says of itself: ``shared`` (every rank of the layout compares it) and
    ``peers`` (the replica peers of one data-parallel coordinate compare it as well)."""

    shared: dict[str, str]
    peers: dict[str, str]

    def digest(self, scope: str) -> int:
        """The 64-bit digest of one scope's entries (what is all-gathered), as a signed int64."""
        entries = self.shared if scope == AGREE_ALL else self.peers
        text = json.dumps(sorted(entries.items())).encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)

    def settings(self) -> dict[str, str]:
        """Every entry, both scopes: what the batch check names when a field differs."""
        return {**self.shared, **self.peers}

    def with_facts(self, facts: Mapping[str, Fact]) -> Description:
        """This description with more facts (each replacing an entry of the same name)."""
        shared, peers = dict(self.shared), dict(self.peers)
        for name, (scope, value) in facts.items():
            shared.pop(name, None)
            peers.pop(name, None)
            if scope != AGREE_NONE:
                (shared if scope == AGREE_ALL else peers)[name] = _shown(value)
        return Description(shared, peers)


def _shown(value: Any) -> str:
    if isinstance(value, list):  # a tuple and a list of dims say the same
        value = tuple(value)
    return repr(value)


def describe(face: FaceOptions, resolved: Mapping[str, Any], facts: Mapping[str, Fact]) -> Description:
    """The description of a loader built from ``face``: each option's value (``resolved``'s where
    the loader resolved it, e.g. ``Config``'s defaults taken from the dataset) in its declared
    scope, then ``facts``."""
    shared: dict[str, str] = {}
    peers: dict[str, str] = {}
    for record in FACE_RECORDS:
        given = getattr(face, record.KEYWORD)
        for f in fields(record):
            scope = f.metadata.get("agree", AGREE_ALL)
            if scope == AGREE_NONE:
                continue
            value = resolved[f.name] if f.name in resolved else getattr(given, f.name)
            (shared if scope == AGREE_ALL else peers)[f.name] = _shown(value)
    return Description(shared, peers).with_facts(facts)


def first_difference(peers: Iterable[tuple[str, Description]], scope: str) -> tuple[str, str] | None:
    """(the first entry of ``scope`` that differs between ``peers`` (where, description), and how:
    each value with the coordinates of a rank that holds it), or None where none differs."""
    peers = list(peers)
    pick = (lambda d: d.shared) if scope == AGREE_ALL else (lambda d: d.settings())
    names = sorted({name for _, d in peers for name in pick(d)})
    for name in names:
        holders: dict[str | None, list[str]] = {}
        for where, d in peers:
            holders.setdefault(pick(d).get(name), []).append(where)
        if len(holders) > 1:
            sides = [
                f"{value if value is not None else '(absent)'} at {_some(wheres)}" for value, wheres in holders.items()
            ]
            return name, "; ".join(sides)
    return None


def _some(wheres: list[str], shown: int = 3) -> str:
    """A few coordinates of the ranks holding a value (and how many more)."""
    more = len(wheres) - shown
    return ", ".join(wheres[:shown]) + (f" and {more} more" if more > 0 else "")


__all__ = ["AGREE_ALL", "AGREE_PEERS", "Description", "Fact", "describe", "first_difference"]
