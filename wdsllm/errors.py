"""Every error wdsllm raises on purpose, under one root: ``except wdsllm.WdsllmError`` catches them all.

Each class also keeps the builtin base it had before the root existed (``ValueError``,
``OSError``, ``RuntimeError``), so code that caught those still does. Messages name the file,
shard, sample, byte or line where the problem is, and what to do about it.
"""

from __future__ import annotations

import warnings

from .redact import redact_text

#: What to do with bad input or an unreadable shard, in pack and in the loader alike.
ON_ERROR = ("raise", "skip")
_OLD_ON_ERROR = {"stop": "raise"}


class WdsllmError(Exception):
    """The root of wdsllm's errors.

    Its message never carries a secret: URLs in it lose their password and query string
    (``redact.redact_text``), whatever code wrote the message.
    """

    def __init__(self, *args: object) -> None:
        if args and isinstance(args[0], str) and "://" in args[0]:
            args = (redact_text(args[0]), *args[1:])
        super().__init__(*args)


class ConfigError(WdsllmError, ValueError):
    """An option or combination of options that cannot work; the message names the option."""


class FormatError(WdsllmError, ValueError):
    """A shard, sample, index or side file does not follow the format; the message says where."""


class ShardError(FormatError):
    """A shard is truncated or malformed; the message names the shard and the byte offset."""


class UnfinishedError(FormatError):
    """A dataset directory whose pack never finished (its journal is there, its index is not)."""


class ChecksumError(ShardError):
    """A group's bytes do not match the checksum the index vouches for; names the shard, the
    sample and the byte range."""


class StorageError(WdsllmError, OSError):
    """A permanent storage failure. The message always names the URL and the reason.

    ``url`` and ``reason`` are also attributes, so callers can re-word the message. The class
    pickles (DataLoader workers send exceptions to the main process).
    """

    def __init__(self, message: str, url: str | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.reason = reason if reason is not None else message


class TransientError(StorageError):
    """A failure worth retrying (connection reset, timeout, 5xx, throttling, early end).

    It is raised internally and never escapes the retry loop: when the attempts are used up the
    caller gets a plain :class:`StorageError`.
    """


class NotFoundError(StorageError):
    """A permanent failure because the object does not exist (HTTP 404/410, S3 NoSuchKey or
    NoSuchBucket, a missing local file). Callers that probe for optional objects (an index beside
    shards) catch this one and let every other failure through."""


class StateError(WdsllmError, ValueError):
    """A saved loader state does not fit this loader; the message says what differs."""


class UsageError(WdsllmError, TypeError):
    """wdsllm is wired into a training stack in a way that would give wrong data (batches batched
    again, a rank's share split again, a resume that skips batches by replaying them); the message
    says what to do instead (docs/integrations.md)."""


class NotADatasetError(UsageError, AttributeError):
    """An attribute that trainers read from a DataLoader (``dataset``) and that ``wdsllm.Loader``
    deliberately lacks; an AttributeError too, so code that probes for it falls back."""


class MissingDependencyError(WdsllmError, ImportError):
    """A part of wdsllm needs a package that is not installed; the message names the pip command."""


class PackError(WdsllmError, RuntimeError):
    """The pack cannot start or continue; the message says why and what to do."""


class SourceError(WdsllmError, ValueError):
    """Bad input (undecodable bytes, malformed JSON, a missing text field); names file and line."""


class DamagedInputError(SourceError):
    """A compressed input that is truncated or damaged; the message says where in its bytes."""


class VersionChangedError(StorageError, SourceError):
    """A remote object is no longer the version a read is pinned to. A storage failure that is
    never retried, and, as a local input rewritten since it was listed, a source error, never
    damage: the input's documents are not skipped as unreadable with ``on_error="skip"``."""


class TokenizerError(WdsllmError, ValueError):
    """The tokenizer could not be loaded or lacks a token that was asked for."""


class MixtureError(ConfigError):
    """A mixture (its spec or its file) that cannot work; the message names the key or the sources."""


class OtherRowsError(PackError):
    """A cluster part holds other rows than the task that found it: the run split its input
    otherwise than the run that wrote the part (docs/cluster.md)."""


class MergeError(WdsllmError, ValueError):
    """The parts given to ``wdsllm merge`` cannot form one dataset; the message says which and why."""


class WorkerStalledError(WdsllmError, RuntimeError):
    """The loader waited ``ObserveOptions.watchdog_s`` seconds for a batch with
    ``watchdog_raise=True``; the watchdog's warning before it holds every worker's stack."""


class ReplicaError(WdsllmError, RuntimeError):
    """Peers that must yield the same batches (tensor, context, pipeline parallel) cannot: their
    reader failed (``replicas="broadcast"``); the message names the peers' mesh coordinates."""


class ReplicaMismatchError(ReplicaError):
    """Replica peers yield or save different things; the message names each peer's mesh
    coordinates and the first field that differs."""


class SteeringError(ConfigError):
    """A schedule or a change made while the run trains (``skip``, ``exclude``, ``set_weights``)
    cannot be taken; the loader keeps its previous settings (docs/steering.md)."""


def normalize_on_error(value: str) -> str:
    """``on_error`` as one of :data:`ON_ERROR`; the old word "stop" is accepted with a warning."""
    if value in _OLD_ON_ERROR:
        warnings.warn(
            f"on_error={value!r} is deprecated; use {_OLD_ON_ERROR[value]!r}", DeprecationWarning, stacklevel=3
        )
        return _OLD_ON_ERROR[value]
    if value not in ON_ERROR:
        raise ConfigError(f"on_error must be one of {ON_ERROR}, not {value!r}")
    return value
