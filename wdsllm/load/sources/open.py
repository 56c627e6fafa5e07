"""Opening a source from what the user gave: a packed dataset (a root, an index URL, shard URLs or
patterns), raw text (its options), a mixture (a ``Mixture`` or a mixture file), or a source
already opened."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ... import format as fmt
from ... import storage
from ...errors import MixtureError, WdsllmError
from ..mixture import Mixture, is_mixture_source, load_mixture_file
from ..raw import open_raw
from .mixraw import open_raw_part
from .mixture import MixturePart, MixtureSource
from .packed import open_packed
from .protocol import Source


def open_source(
    given: Any, *, index_for_shards: bool = True, retry: storage.RetryPolicy | None = None, on_error: str = "raise"
) -> Source:
    """Resolve what a face was given into a Source.

    A ``Mixture``, or the path or URL of a mixture file (``.yaml``/``.yml``), becomes a
    ``MixtureSource``; raw-text options (a mapping with ``raw``: the inputs) a ``RawSource``;
    anything else a ``PackedSource`` (``packed.open_packed``). ``retry`` governs reading indexes
    and side files; ``on_error`` is the loader's: raw text parses with it unless it sets its own.
    """
    if isinstance(given, Source):
        return given
    if is_mixture_source(given):
        return open_mixture(given, retry=retry, on_error=on_error)
    if isinstance(given, Mapping):
        options = dict(given)
        options.setdefault("on_error", on_error)
        return open_raw(options.pop("raw"), **options)
    return open_packed(given, index_for_shards=index_for_shards, retry=retry)


def _opened(value: Any) -> bool:
    """Whether a mixture's source is given opened (a source object), not as a path, URL, list
    of shards or raw-text options."""
    return not isinstance(value, (str, os.PathLike, list, tuple, Mapping))


def open_mixture(source: Any, retry: storage.RetryPolicy | None = None, on_error: str = "raise") -> MixtureSource:
    """A Mixture, or the path or URL of a mixture file, as one source. Raw-text sources (options)
    are opened once the others are, their tokenizer defaulting to those's; ``on_error``: the
    loader's, what a raw-text source that sets none parses with."""
    mixture = source if isinstance(source, Mixture) else load_mixture_file(source, retry=retry)
    opened: dict[str, MixturePart] = {}
    for name, value in mixture.sources.items():
        if isinstance(value, Mapping):
            continue  # raw text: opened once the others are, whose tokenizer is its default
        try:
            src = value if _opened(value) else open_source(value, retry=retry)
            opened[name] = MixturePart(name, src, src.describe_for_mixture(name))
        except (storage.StorageError, fmt.FormatError) as exc:
            raise _renamed(exc, name)  # noqa: B904 - the same error, its message naming the source
    others = [p.source for p in opened.values()]
    for name, value in mixture.sources.items():
        if isinstance(value, Mapping):
            try:
                opened[name] = open_raw_part(name, value, others, on_error=on_error)
            except MixtureError:
                raise
            except WdsllmError as exc:  # a missing input, a sidecar of other inputs, a tokenizer
                raise _renamed(exc, name)  # noqa: B904 - the same error, its message naming the source
    return MixtureSource.build(mixture, [opened[name] for name in mixture.names])


def _renamed(exc: Exception, name: str) -> Exception:
    """The error, its message prefixed with the source's name (the same class, so handlers match)."""
    exc.args = (f"mixture source {name!r}: {exc.args[0] if exc.args else exc}", *exc.args[1:])
    return exc
