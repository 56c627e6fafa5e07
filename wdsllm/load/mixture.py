"""``wdsllm.Mixture``: what a mixture is (sources, weights, unit, epoch size, schedule), from Python
or from a YAML file, checked with errors that name the key. No torch, no I/O but the file itself.

The weights are normalised to sum to one. A schedule is a list of phases, each giving the weights
from a point of the run on (``at_tokens`` in the mixture's unit, ``at_step`` in batches); the
mixture's own ``weights`` hold from the start until the first phase. What an epoch takes of each
source (quotas, repeats, subsets) is decided in ``mixplan.py``; how the sources become one source
in ``sources/mixture.py``.
"""

from __future__ import annotations

import math
import os
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import storage
from ..errors import MixtureError

UNITS = ("tokens", "items")
FILE_SUFFIXES = (".yaml", ".yml")
_FILE_KEYS = ("sources", "weights", "unit", "epoch_tokens", "epoch_items", "schedule", "stratified")
#: a raw-text source (``{raw: PATTERNS, counts: SIDECAR, ...}``): its inputs, its count sidecar, and
#: the options of ``wdsllm.loader``'s raw text (``load/raw.py``), each with the types it takes
RAW_SOURCE_KEYS: dict[str, tuple[type, ...]] = {
    "raw": (str, list),
    "counts": (str,),
    "tokenizer": (str,),
    "text_field": (str,),
    "split": (str,),
    "where": (str,),
    "bos": (bool,),
    "eos": (bool,),
    "bos_token": (str,),
    "eos_token": (str,),
    "max_doc_bytes": (int,),
    "input_format": (str,),
    "unit_bytes": (int,),
    "on_error": (str,),
}
_CHOICES = {"split": ("line", "paragraph", "file"), "on_error": ("raise", "skip")}
#: the largest weight: far above any count of tokens, far below where a sum of floats overflows
MAX_WEIGHT = 1e18
#: the largest epoch and schedule positions: an epoch's plan holds an entry per item
MAX_EPOCH_ITEMS = 1 << 40
MAX_EPOCH_TOKENS = 1 << 56
#: the most phases a schedule may have (each is integrated over at every epoch's planning)
MAX_PHASES = 1024
#: a mixture file: its bytes, and the values it may expand to (YAML aliases repeat a value)
MAX_FILE_BYTES = 1 << 20
MAX_FILE_VALUES = 100_000
_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxlist, _SHOW.maxtuple, _SHOW.maxdict, _SHOW.maxset = 2, 4, 4, 4, 4
_SHOW.maxstring, _SHOW.maxother, _SHOW.maxlong = 60, 60, 40


def _show(value: Any) -> str:
    """A value in a message, never whole: a mixture file's value can be huge (YAML aliases)."""
    return _SHOW.repr(value)


@dataclass(frozen=True)
class Phase:
    """Weights from a point of the run on: ``at`` in the mixture's unit, or ``at_step`` in batches."""

    weights: tuple[float, ...]  # normalised, in source order
    at: int | None = None
    at_step: int | None = None


@dataclass(frozen=True)
class Mixture:
    """A weighted blend of datasets (see docs/mixtures.md).

    ``sources`` maps a name to a dataset (a root, an index.json URL, shard URLs, or an opened
    catalog), or to raw text: its options ``{"raw": PATTERNS, "counts": SIDECAR, ...}`` (keys
    ``RAW_SOURCE_KEYS``) or an opened raw source (``load.raw.open_raw``); ``weights`` maps the
    same names to non-negative numbers (default: equal). ``unit`` says what the weights count:
    ``"tokens"`` (default) or ``"items"`` (documents, or rows of packed datasets). An epoch holds
    ``epoch_tokens`` tokens (``epoch_items`` items with unit="items"); default: the sum of all
    sources' sizes. ``schedule`` is a list of ``{"at_tokens": N,
    "weights": {...}}`` (``at_items`` with unit="items", or ``at_step``). ``stratified=True`` makes
    every batch's composition match the weights to within one item per source (fixed batching).
    """

    sources: Mapping[str, Any]
    weights: Mapping[str, float] | None = None
    unit: str = "tokens"
    epoch_tokens: int | None = None
    epoch_items: int | None = None
    schedule: Any = None
    stratified: bool = False
    where: str = field(default="", compare=False)  # the file it came from, for messages

    def __post_init__(self) -> None:
        if not isinstance(self.sources, Mapping) or not self.sources:
            raise MixtureError(f"{self._at('sources')} must map at least one name to a dataset")
        for name, src in self.sources.items():
            if not isinstance(name, str) or not name:
                raise MixtureError(f"{self._at('sources')}: every source needs a non-empty name, not {_show(name)}")
            if isinstance(src, Mapping):
                self._check_raw(name, src)
            elif is_mixture_source(src):
                raise MixtureError(
                    f"{self._at(f'sources.{name}')} names a mixture ({_show(_named(src))}): mixtures do not nest "
                    "(a file that names itself would never end); list its sources instead"
                )
        if self.unit not in UNITS:
            raise MixtureError(f"{self._at('unit')} must be one of {UNITS}, not {_show(self.unit)}")
        if self.unit == "items" and self.epoch_tokens is not None:
            raise MixtureError(f"{self._at('epoch_tokens')} counts tokens; with unit 'items' give epoch_items")
        if self.unit == "tokens" and self.epoch_items is not None:
            raise MixtureError(f"{self._at('epoch_items')} counts items; with unit 'tokens' give epoch_tokens")
        for key, most in (("epoch_tokens", MAX_EPOCH_TOKENS), ("epoch_items", MAX_EPOCH_ITEMS)):
            value = getattr(self, key)
            if value is not None and (not _is_int(value) or not 1 <= value <= most):
                raise MixtureError(f"{self._at(key)} must be an integer from 1 to {most}, not {_show(value)}")
        if not isinstance(self.stratified, bool):
            raise MixtureError(f"{self._at('stratified')} must be true or false, not {_show(self.stratified)}")
        object.__setattr__(self, "_base", self._weights(self.weights, "weights"))
        object.__setattr__(self, "_phases", self._parse_schedule(self.schedule))

    # -- what the rest of the loader reads ------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self.sources)

    @property
    def base_weights(self) -> tuple[float, ...]:
        """The weights from the start of the run (normalised, in source order)."""
        return self._base

    @property
    def phases(self) -> tuple[Phase, ...]:
        """The schedule's phases, in the order given (positions rise)."""
        return self._phases

    @property
    def epoch_size(self) -> int | None:
        """The epoch's size in the unit, when given."""
        return self.epoch_tokens if self.unit == "tokens" else self.epoch_items

    def describe(self) -> dict:
        """A JSON-able form of everything that decides the batches (part of the data's fingerprint)."""
        return {
            "names": self.names,
            "weights": list(self.base_weights),
            "unit": self.unit,
            "epoch": self.epoch_size,
            "schedule": [[list(p.weights), p.at, p.at_step] for p in self.phases],
            "stratified": self.stratified,
        }

    def where_key(self, key: str) -> str:
        """How a message names ``key`` of this mixture (in its file, when it came from one)."""
        return self._at(key)

    # -- checks ---------------------------------------------------------------------------------
    def _at(self, key: str) -> str:
        key = key if len(key) <= 100 else key[:100] + "..."
        return f"{self.where}: key '{key}'" if self.where else f"mixture key '{key}'"

    def _check_raw(self, name: str, spec: Mapping) -> None:
        """A raw-text source's options: known keys of the right types, inputs, and a count sidecar
        (a mixture plans from counts, as from an index)."""
        for key, value in spec.items():
            where = self._at(f"sources.{name}.{key}")
            if key not in RAW_SOURCE_KEYS:
                raise MixtureError(f"{where} is not a raw source key ({', '.join(RAW_SOURCE_KEYS)})")
            types = RAW_SOURCE_KEYS[key]
            if value is None and key in ("bos", "where", "tokenizer", "bos_token", "eos_token", "input_format"):
                continue
            if not isinstance(value, types) or (int in types and isinstance(value, bool)):
                raise MixtureError(f"{where} must be {' or '.join(t.__name__ for t in types)}, not {_show(value)}")
            if key == "raw" and (
                not value or (isinstance(value, list) and not all(isinstance(v, str) and v for v in value))
            ):
                raise MixtureError(f"{where} must name input files or patterns, not {_show(value)}")
            if int in types and value < 1:
                raise MixtureError(f"{where} must be a positive integer, not {_show(value)}")
            if key in _CHOICES and value not in _CHOICES[key]:
                raise MixtureError(f"{where} must be one of {_CHOICES[key]}, not {_show(value)}")
        if "raw" not in spec:
            raise MixtureError(f"{self._at(f'sources.{name}.raw')} is missing: a source given by options is raw text")
        if not spec.get("counts"):
            raise MixtureError(
                f"{self._at(f'sources.{name}.counts')} is missing: raw source {_show(name)} needs a count sidecar "
                f"to be planned in a mixture; run `wdsllm count {_inputs(spec['raw'])} -t TOKENIZER "
                f"-o {name}.counts.npz` and give it as counts"
            )

    def _weights(self, weights: Any, key: str) -> tuple[float, ...]:
        names = self.names
        if weights is None:
            return tuple(1.0 / len(names) for _ in names)
        if not isinstance(weights, Mapping):
            raise MixtureError(f"{self._at(key)} must map source names to numbers")
        unknown = [k for k in weights if k not in self.sources]
        if unknown:
            where = self._at(f"{key}.{unknown[0]}")
            raise MixtureError(f"{where}: no source is named {_show(unknown[0])} (sources: {names})")
        missing = [n for n in names if n not in weights]
        if missing:
            where = self._at(f"{key}.{missing[0]}")
            raise MixtureError(f"{where} is missing: give every source a weight (0 leaves it out)")
        values = []
        for n in names:
            w = weights[n]
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= MAX_WEIGHT:
                raise MixtureError(
                    f"{self._at(f'{key}.{n}')} must be a number from 0 to {MAX_WEIGHT:g}, not {_show(w)}"
                )
            values.append(float(w))
        total = math.fsum(values)
        if total <= 0:
            raise MixtureError(f"{self._at(key)}: at least one weight must be positive")
        return tuple(v / total for v in values)

    def _parse_schedule(self, schedule: Any) -> tuple[Phase, ...]:
        if schedule is None:
            return ()
        if not isinstance(schedule, (list, tuple)):
            raise MixtureError(f"{self._at('schedule')} must be a list of {{at_tokens: N, weights: {{...}}}}")
        if len(schedule) > MAX_PHASES:
            raise MixtureError(f"{self._at('schedule')} has {len(schedule):,} phases; at most {MAX_PHASES} are planned")
        at_key = "at_tokens" if self.unit == "tokens" else "at_items"
        phases: list[Phase] = []
        last = (-1, -1)
        for i, entry in enumerate(schedule):
            key = f"schedule[{i}]"
            if not isinstance(entry, Mapping):
                raise MixtureError(f"{self._at(key)} must be a mapping with {at_key} (or at_step) and weights")
            extra = [k for k in entry if k not in (at_key, "at_step", "weights")]
            if extra:
                where = self._at(f"{key}.{extra[0]}")
                raise MixtureError(f"{where} is not a schedule key ({at_key}, at_step, weights)")
            given = [k for k in (at_key, "at_step") if k in entry]
            if len(given) != 1:
                raise MixtureError(f"{self._at(key)} needs exactly one of {at_key} and at_step")
            at = entry[given[0]]
            if not _is_int(at) or not 0 <= at <= MAX_EPOCH_TOKENS:
                where = self._at(f"{key}.{given[0]}")
                raise MixtureError(f"{where} must be an integer from 0 to {MAX_EPOCH_TOKENS}, not {_show(at)}")
            if "weights" not in entry:
                raise MixtureError(f"{self._at(f'{key}.weights')} is missing")
            weights = self._weights(entry["weights"], f"{key}.weights")
            order = (0, at) if given[0] == at_key else (1, at)
            if phases and order[0] == last[0] and order[1] <= last[1]:
                raise MixtureError(f"{self._at(f'{key}.{given[0]}')}: phases must come in rising order")
            if phases and order[0] != last[0]:
                raise MixtureError(f"{self._at(key)}: a schedule uses {at_key} or at_step, not both")
            last = order
            phases.append(
                Phase(
                    weights,
                    at=int(at) if given[0] == at_key else None,
                    at_step=int(at) if given[0] == "at_step" else None,
                )
            )
        return tuple(phases)


def _inputs(raw: Any) -> str:
    return " ".join(f"'{r}'" for r in ([raw] if isinstance(raw, str) else raw))


def _named(src: Any) -> Any:
    return src.where or "a Mixture" if isinstance(src, Mixture) else src


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_mixture_source(source: Any) -> bool:
    """Whether a loader's ``source`` is a mixture: a Mixture, or the path or URL of a YAML file."""
    if isinstance(source, Mixture):
        return True
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    return isinstance(source, str) and storage.split_query(source)[0].lower().endswith(FILE_SUFFIXES)


def load_mixture_file(url: str, retry: storage.RetryPolicy | None = None) -> Mixture:
    """A Mixture from a YAML file (local or any storage URL). Relative source paths are relative to
    the file's directory. Errors name the file and the key."""
    url = os.fspath(url)
    where = storage.redact(url)
    with storage.open_stream(url, retry=retry) as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise MixtureError(f"{where}: more than {MAX_FILE_BYTES} bytes, too large for a mixture file")
    doc = _parse_yaml(bytes(data), where)
    if not isinstance(doc, Mapping):
        raise MixtureError(f"{where}: a mixture file holds a mapping with 'sources' and 'weights'")
    unknown = [k for k in doc if k not in _FILE_KEYS]
    if unknown:
        raise MixtureError(f"{where}: key '{unknown[0]}' is not a mixture key ({', '.join(_FILE_KEYS)})")
    if "sources" not in doc:
        raise MixtureError(f"{where}: key 'sources' is missing")
    sources = doc["sources"]
    if not isinstance(sources, Mapping):
        raise MixtureError(f"{where}: key 'sources' must map names to dataset paths or URLs")
    base = storage.dirname_url(url)
    resolved = {}
    for name, path in sources.items():
        if isinstance(path, Mapping):  # raw text: its inputs, sidecar and tokenizer file are paths too
            resolved[str(name)] = _raw_relative_to(base, path)
            continue
        if not isinstance(path, str) or not path:
            raise MixtureError(
                f"{where}: key 'sources.{name}' must be a path or URL, or a raw source {{raw: ..., counts: ...}}, "
                f"not {_show(path)}"
            )
        resolved[str(name)] = _relative_to(base, path)
        if _same_file(resolved[str(name)], url):
            raise MixtureError(f"{where}: key 'sources.{name}' names this mixture file itself")
    kwargs = {k: doc[k] for k in _FILE_KEYS[1:] if k in doc}
    return Mixture(resolved, where=where, **kwargs)


def _parse_yaml(data: bytes, where: str) -> Any:
    """The document of a mixture file: YAML with unique keys, expanding to at most
    :data:`MAX_FILE_VALUES` values (aliases counted each time they are used)."""
    import yaml  # a real YAML parser, as mixture files are hand-written

    try:
        loader = _strict_loader(yaml)(data.decode("utf-8"))
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _check_expansion(node, where)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except UnicodeDecodeError as exc:
        raise MixtureError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        line = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise MixtureError(f"{where}: not valid YAML{line}: {str(exc.problem or exc)[:200]}") from None
    except yaml.YAMLError as exc:
        raise MixtureError(f"{where}: not valid YAML: {str(exc)[:200]}") from None


def _strict_loader(yaml: Any) -> type:
    """yaml.SafeLoader that refuses a key given twice in one mapping (SafeLoader keeps the last)."""

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            seen: set = set()
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = (key_node.tag, key_node.value)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {_show(key_node.value)} is given twice", key_node.start_mark
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def _check_expansion(root: Any, where: str) -> None:
    """Refuse a document whose values, with every alias expanded, are more than MAX_FILE_VALUES
    (a few hundred bytes of nested aliases expand to gigabytes)."""
    import yaml

    count, stack = 0, [root]
    while stack:
        node = stack.pop()
        count += 1
        if count > MAX_FILE_VALUES:
            raise MixtureError(
                f"{where}: expands to more than {MAX_FILE_VALUES} values (YAML aliases?); a mixture file is small"
            )
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                stack.append(key)
                stack.append(value)


def _same_file(path: str, url: str) -> bool:
    """Whether a source path names the mixture file itself."""
    if storage.scheme_of(path) == "file" and storage.scheme_of(url) == "file":
        return os.path.realpath(path.removeprefix("file://")) == os.path.realpath(url.removeprefix("file://"))
    return path == url


def _relative_to(base: str, path: str) -> str:
    """A source path of a mixture file: URLs and absolute paths as written, others from the file's directory."""
    if storage.scheme_of(path) != "file" or path.startswith("file://") or os.path.isabs(path):
        return path
    if storage.scheme_of(base) == "file" and not base.startswith("file://"):
        return os.path.normpath(os.path.join(base or ".", path))
    return storage.join_url(base, path) if "/" not in path.strip("/") else base.rstrip("/") + "/" + path


def _raw_relative_to(base: str, spec: Mapping) -> dict:
    """A raw source of a mixture file with its paths from the file's directory (a tokenizer given
    by a hub name stays a name)."""
    out = dict(spec)
    raw = out.get("raw")
    if isinstance(raw, str) and raw:
        out["raw"] = _relative_to(base, raw)
    elif isinstance(raw, list):
        out["raw"] = [_relative_to(base, r) if isinstance(r, str) and r else r for r in raw]
    if isinstance(out.get("counts"), str) and out["counts"]:
        out["counts"] = _relative_to(base, out["counts"])
    tok = out.get("tokenizer")
    if isinstance(tok, str) and tok:
        near = _relative_to(base, tok)
        if tok.endswith(".json") or os.path.exists(near):
            out["tokenizer"] = near
    return out
