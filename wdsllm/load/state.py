"""The saved form of a loader's (or a dataset worker's) position, and its checks. No torch.

A state travels through checkpointers that each keep a different subset of a nested dict:
``torch.distributed.checkpoint`` fills only the leaves of the *fresh* object's state (a fresh
loader has no per-worker keys, so they were dropped) and, across ranks, keeps each leaf from
whichever rank it likes; ``torch.load(weights_only=True)`` refuses anything but plain types. So
``state_dict()`` returns two strings, ``{"format": "wdsllm.loader/8", "state": "<JSON>"}``: one
leaf can be neither truncated nor mixed, and every checkpointer keeps strings. The JSON carries a
digest of itself, so an edited or damaged state is refused rather than trusted.

What it holds is then checked before anything is started: types and ranges of every field, the
dataset and settings fingerprints, and the positions against the epoch's batch counts from the
index (each worker's count, DataLoader's round-robin order, the rank's total). A state that passes
resumes exactly; anything else is a :class:`StateError` naming the field.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import StateError, SteeringError
from . import plan as planmod
from .batching import COUNT_BY_ITEMS
from .config import Config
from .counts import batch_counts, equalised, round_robin_share, worker_batch_count
from .handoff import hands_tails
from .holes import LOST_KEY, lost_batches
from .marks import MARK_KEY
from .resume import RemainderPlan
from .sources.protocol import Source
from .steer.plans import Leaving, SteeredPlan
from .steer.runtime import SavedSteering
from .tails import merges_tails

LOADER_KIND = "wdsllm.loader"
DATASET_KIND = "wdsllm.dataset"
#: 1: a plain nested dict (still read); 2: the same fields sealed in one JSON string; 3: the
#: epoch of an indexed dataset ordered by blocks of shards (``plan.epoch_blocks``); 4: worker
#: shares in whole batches, and documents split at max_len shared by their pieces; 5: ``tails``, the
#: batches of the workers' merged tails handed out (``tails.py``; none before, so 0 in older states); 6: an
#: endless state with ``equal_batches`` is a position in one epoch of whole epochs run one after another
#: (``Config.endless_by_epochs``; an older endless state always streamed on across epochs); 7:
#: ``steering``, the run's planned step and its log of changes (``steer/runtime.py``; older states leave the
#: planned step unknown); 8: ``steering.pending``, changes made for a later planned step (none in older states)
LOADER_VERSION = 8
READABLE_LOADER_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8)
#: 2: blocks of shards, as the loader's 3; 3: whole-batch and piece shares, as the loader's 4; 4: the
#: epochs of an endless stream hand tails over, as the loader's 5
DATASET_VERSION = 4
READABLE_DATASET_VERSIONS = (1, 2, 3, 4)
#: the first loader (and dataset) state versions whose positions are in blocks-of-shards order
BLOCK_ORDER_VERSIONS = {LOADER_KIND: 3, DATASET_KIND: 2}
#: ... and whose mixtures' passes are in blocks-of-shards order (``mixplan.PassStream``)
MIX_BLOCK_ORDER_VERSIONS = {LOADER_KIND: 4, DATASET_KIND: 3}
#: ... whose worker shares are whole batches and whose shares of split documents count pieces
SPLIT_VERSIONS = {LOADER_KIND: 4, DATASET_KIND: 3}
#: ... whose endless streams hand each epoch's tails to a rank's last worker, as finite epochs do
ENDLESS_HANDOFF_VERSIONS = {LOADER_KIND: 5, DATASET_KIND: 4}
#: bounds beyond which a field is refused as damaged (a negated or huge number)
MAX_EPOCH = 1 << 32
MAX_COUNT = 1 << 48
MAX_WORLD = 1 << 20
MAX_WORKERS = 1 << 12
#: the most plans one epoch's plan may be made over (resumes on other layouts, changes while it ran)
MAX_PLAN_DEPTH = 256
#: the most epochs of an endless stream whose batch counts are recomputed to check its positions
MAX_CHECKED_SPAN = 8


# ----------------------------------------------------------------------------------------------
# Sealing: one JSON string with its digest


def _digest(body: Mapping[str, Any]) -> str:
    try:
        text = json.dumps({k: v for k, v in body.items() if k != "digest"}, sort_keys=True, separators=(",", ":"))
    except RecursionError:
        raise StateError("the state is nested too deeply to be a wdsllm state") from None
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def seal(body: Mapping[str, Any], kind: str = LOADER_KIND) -> dict[str, str]:
    """``body`` as the checkpointer-proof form: ``{"format": "KIND/VERSION", "state": JSON}``."""
    inner = dict(body)
    inner["digest"] = _digest(inner)
    version = inner.get("version", LOADER_VERSION if kind == LOADER_KIND else DATASET_VERSION)
    return {"format": f"{kind}/{version}", "state": json.dumps(inner, sort_keys=True, separators=(",", ":"))}


def unseal(saved: Any, kind: str = LOADER_KIND, versions: tuple[int, ...] = READABLE_LOADER_VERSIONS) -> dict:
    """The fields inside what a checkpointer gave back: the sealed form (its digest checked), or a
    plain dict of version 1 (no digest)."""
    what = "loader" if kind == LOADER_KIND else "dataset"
    if not isinstance(saved, Mapping):
        raise StateError(
            f"not a wdsllm {what} state: a {type(saved).__name__}, expected the dict that state_dict() returned"
        )
    if "format" in saved:
        tag = saved["format"]
        if not isinstance(tag, str) or not tag.startswith(kind + "/"):
            raise StateError(f"not a wdsllm {what} state (format {tag!r:.60}, expected {kind}/N)")
        text = saved.get("state")
        if not isinstance(text, str):
            raise StateError(
                f"the {what} state's 'state' entry is missing or not the JSON string state_dict() returned "
                f"({type(text).__name__}); the checkpointer dropped or changed it"
            )
        try:
            body = json.loads(text)
        except RecursionError:
            raise StateError(f"the {what} state's JSON is nested too deeply to be a wdsllm state") from None
        except ValueError as exc:
            raise StateError(f"the {what} state's JSON is damaged: {str(exc)[:200]}") from None
        if not isinstance(body, dict):
            raise StateError(f"the {what} state's JSON is not an object")
        if tag != f"{kind}/{body.get('version')}":
            raise StateError(f"the {what} state's format tag {tag!r:.60} disagrees with its version")
    else:
        body = dict(saved)
    if body.get("kind") != kind:
        raise StateError(f"not a wdsllm {what} state (missing kind {kind!r})")
    version = body.get("version")
    if version not in versions:
        raise StateError(
            f"{what} state version {version!r:.20} is not supported (this wdsllm reads versions {list(versions)}); "
            "a newer wdsllm wrote it"
        )
    if (version >= 2 or "digest" in body) and body.get("digest") != _digest(body):
        raise StateError(
            f"the {what} state does not match its digest: it was edited or damaged after state_dict() made it"
        )
    return body


# ----------------------------------------------------------------------------------------------
# Fields: types and ranges


def _where(key: str) -> str:
    return f"loader state field {key!r}"


def _int(value: Any, key: str, lo: int = 0, hi: int = MAX_COUNT) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise StateError(f"{_where(key)} must be an integer, not {type(value).__name__} {value!r:.40}")
    if not lo <= value < hi:
        raise StateError(f"{_where(key)} is {value}, outside [{lo}, {hi})")
    return value


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise StateError(f"{_where(key)} must be true or false, not {value!r:.40}")
    return value


def _str(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise StateError(f"{_where(key)} must be a string, not {type(value).__name__}")
    return value


def _get(body: Mapping[str, Any], key: str, prefix: str = "") -> Any:
    if key not in body:
        raise StateError(f"{_where(prefix + key)} is missing: the state is incomplete")
    return body[key]


@dataclass(frozen=True)
class Position:
    """Where one worker stands: its epoch, the batches of it handed out, the batcher's hint."""

    epoch: int
    batches: int
    hint: dict | None = None

    @classmethod
    def parse(cls, value: Any, key: str) -> Position:
        if not isinstance(value, (list, tuple)) or len(value) not in (2, 3):
            raise StateError(f"{_where(key)} must be [epoch, batches] or [epoch, batches, hint], not {value!r:.60}")
        hint = value[2] if len(value) == 3 else None
        if hint is not None:
            if not isinstance(hint, dict):
                raise StateError(f"{_where(key + '[2]')} (the batcher's hint) must be an object or null")
            hint = {k: _hint_value(k, v, f"{key}[2].{k}") for k, v in hint.items()}
        return cls(_int(value[0], key + "[0]", hi=MAX_EPOCH), _int(value[1], key + "[1]"), hint)

    def to_json(self) -> list:
        return [self.epoch, self.batches, self.hint]

    def as_tuple(self) -> tuple:
        return (self.epoch, self.batches, self.hint)


def parse_plan(value: Any, key: str = "plan", depth: int = 0) -> RemainderPlan | None:
    """A RemainderPlan from its JSON, every field checked (the plan an epoch was re-planned by)."""
    if value is None:
        return None
    if not isinstance(value, dict) or depth > MAX_PLAN_DEPTH:
        raise StateError(f"{_where(key)} must be an object or null")
    world = _int(_get(value, "world", key + "."), key + ".world", 1, MAX_WORLD)
    workers = _int(_get(value, "workers", key + "."), key + ".workers", 1, MAX_WORKERS)
    consumed = _get(value, "consumed", key + ".")
    if not isinstance(consumed, list) or len(consumed) != world:
        raise StateError(f"{_where(key + '.consumed')} must hold one list per old rank ({world})")
    rows = []
    for r, row in enumerate(consumed):
        if not isinstance(row, list) or len(row) != workers:
            raise StateError(f"{_where(f'{key}.consumed[{r}]')} must hold one count per old worker ({workers})")
        rows.append([_int(c, f"{key}.consumed[{r}][{w}]") for w, c in enumerate(row)])
    epoch = _int(_get(value, "epoch", key + "."), key + ".epoch", hi=MAX_EPOCH)
    base = parse_plan(value.get("base"), key + ".base", depth + 1)
    if "leaving" not in value:
        return RemainderPlan(epoch, world, workers, rows, base)
    try:  # re-planned by a change while the run trained (steer/plans.py)
        leaving = Leaving.from_json(value["leaving"])
    except SteeringError as exc:
        raise StateError(f"{_where(key + '.leaving')}: {exc}") from None
    return SteeredPlan(epoch, world, workers, rows, base, leaving=leaving)


@dataclass
class LoaderState:
    """The fields of a loader state, each checked for type and range (see ``Loader.state_dict``)."""

    dataset: str
    settings: str
    rank: int
    world_size: int
    num_workers: int
    equal_batches: bool
    infinite: bool
    epoch: int
    yielded: int
    steps: int
    workers: dict[int, Position]
    turn: int
    active: list[int] | None
    plan: RemainderPlan | None
    config: dict | None = None
    version: int = LOADER_VERSION
    #: of ``yielded``: batches of the workers' merged tails (``tails.py``)
    tails: int = 0
    #: the run's planned step and its log of changes (None: saved before steering existed)
    steering: SavedSteering | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> LoaderState:
        world = _int(_get(body, "world_size"), "world_size", 1, MAX_WORLD)
        workers_n = _int(_get(body, "num_workers"), "num_workers", 1, MAX_WORKERS)
        raw = _get(body, "workers")
        if not isinstance(raw, dict):
            raise StateError(f"{_where('workers')} must be an object of worker -> position")
        positions = {}
        for w, pos in raw.items():
            if not isinstance(w, str) or not w.isdigit() or int(w) >= workers_n:
                raise StateError(f"{_where('workers')} names worker {w!r:.20}, not one of 0..{workers_n - 1}")
            positions[int(w)] = Position.parse(pos, f"workers.{w}")
        active = _get(body, "active")
        if active is not None:
            if not isinstance(active, list):
                raise StateError(f"{_where('active')} must be a list of workers or null")
            active = [_int(w, "active[]", 0, workers_n) for w in active]
            if active != sorted(set(active)):
                raise StateError(f"{_where('active')} must list distinct workers in order")
        config = body.get("config")
        if config is not None and not isinstance(config, dict):
            raise StateError(f"{_where('config')} must be an object")
        return cls(
            dataset=_str(_get(body, "dataset"), "dataset"),
            settings=_str(_get(body, "settings"), "settings"),
            rank=_int(_get(body, "rank"), "rank", 0, world),
            world_size=world,
            num_workers=workers_n,
            equal_batches=_bool(_get(body, "equal_batches"), "equal_batches"),
            infinite=_bool(_get(body, "infinite"), "infinite"),
            epoch=_int(_get(body, "epoch"), "epoch", hi=MAX_EPOCH),
            yielded=_int(_get(body, "yielded"), "yielded"),
            steps=_int(_get(body, "steps"), "steps"),
            workers=positions,
            turn=_int(_get(body, "turn"), "turn", 0, workers_n),
            active=active,
            plan=parse_plan(_get(body, "plan")),
            config=config,
            version=body.get("version", LOADER_VERSION),
            tails=_int(_get(body, "tails"), "tails") if body.get("version", LOADER_VERSION) >= 5 else 0,
            steering=_steering(body) if body.get("version", LOADER_VERSION) >= 7 else None,
        )

    @property
    def in_epoch(self) -> bool:
        """Whether the state was saved inside an epoch: a worker's batches or merged tails handed out."""
        return bool(self.workers) or self.tails > 0

    @classmethod
    def load(cls, saved: Any) -> LoaderState:
        """Unseal and parse what ``state_dict()`` returned (or a version-1 dict)."""
        return cls.parse(unseal(saved))

    def to_json(self) -> dict:
        return {
            "kind": LOADER_KIND,
            "version": LOADER_VERSION,
            "dataset": self.dataset,
            "settings": self.settings,
            "config": self.config,
            "rank": self.rank,
            "world_size": self.world_size,
            "num_workers": self.num_workers,
            "equal_batches": self.equal_batches,
            "infinite": self.infinite,
            "epoch": self.epoch,
            "yielded": self.yielded,
            "steps": self.steps,
            "tails": self.tails,
            "workers": {str(w): p.to_json() for w, p in sorted(self.workers.items())},
            "turn": self.turn,
            "active": self.active,
            "plan": self.plan.to_json() if self.plan is not None else None,
            "steering": self.steering.to_json() if self.steering is not None else None,
        }

    def sealed(self) -> dict[str, str]:
        return seal(self.to_json())


# ----------------------------------------------------------------------------------------------
# Checks against this loader and the plan


def _steering(body: Mapping[str, Any]) -> SavedSteering:
    try:
        return SavedSteering.parse(_get(body, "steering"))
    except SteeringError as exc:
        raise StateError(str(exc)) from None


def check_identity(st: LoaderState, *, dataset: str, settings: str, infinite: bool) -> None:
    """The state is this dataset's and these settings'."""
    if st.dataset != dataset:
        raise StateError(
            f"the state was saved for another dataset (fingerprint {st.dataset:.20}, this one is {dataset}); "
            "shards or their order differ"
        )
    if st.settings != settings:
        raise StateError(
            "the state was saved with other loader settings (batch size, seed, shuffle, batching, max_len, ...): "
            f"saved {st.config}"
        )
    if st.infinite != infinite:
        raise StateError("the state is from an endless loader and this one is finite, or the other way round")


def check_order(kind: str, version: int, source: Source, cfg: Config) -> None:
    """A state saved before epochs were ordered by blocks of shards names positions in whole-shard
    order: it resumes exactly only where both orders agree (a shard is one block, or no shuffle)."""
    if not cfg.shuffle or cfg.resample:
        return
    if source.mixing is not None:
        _check_mix_order(kind, version, source)
        return
    if version >= BLOCK_ORDER_VERSIONS[kind]:
        return
    if planmod.cuts_shards(source.items_per_shard, planmod.block_tokens(source)):
        raise StateError(
            f"the state was saved by an earlier wdsllm (state version {version}), which ordered this dataset's "
            "epoch by whole shards; this one shuffles blocks of shards (docs/loader.md, 'The shuffle'), so the "
            "saved positions name other documents and cannot be resumed exactly: resume with the wdsllm that "
            "saved it, or start the state's epoch afresh (set_epoch)"
        )


def _hint_value(name: str, value: Any, where: str) -> Any:
    """A hint's value: an integer, or a mark ``[documents, pieces]`` (``marks.MARK_KEY``)."""
    if name != MARK_KEY:
        return _int(value, where)
    if not isinstance(value, list) or len(value) != 2:
        raise StateError(f"{_where(where)} (where the stream stands in documents) must be [documents, pieces]")
    return [_int(value[0], where + "[0]"), _int(value[1], where + "[1]")]


def check_split(
    kind: str, version: int, source: Source, cfg: Config, world: int, workers: int, replanned: bool = False
) -> None:
    """A state saved before worker shares were planned in whole batches and split documents were
    shared by their pieces names positions in the shares of that older split: it resumes only
    where both splits agree (one consumer, or shares of one item each that fall alike), never
    onto other shares. ``replanned``: the state carries the remainder of an interrupted epoch."""
    _check_endless_handoff(kind, version, source, cfg, world, workers)
    if version >= SPLIT_VERSIONS[kind] or cfg.resample:
        return
    spec = cfg.spec(0, 0, world, 0, workers)
    one = source.mixing is None
    pieces = one and spec.splits(source.mode) and world * workers > 1
    by_items = cfg.make_batcher().count_by == COUNT_BY_ITEMS
    handed = hands_tails(source, cfg, spec) and not (by_items and one)  # whole batches of items hand nothing
    unit = cfg.share_unit(source.mode)
    in_units = one and unit > 1 and workers > 1 and (replanned or _batch_shares_move(source, world, workers, unit))
    if pieces or handed or in_units:
        raise StateError(
            f"the state was saved by an earlier wdsllm (state version {version}), which split this epoch among "
            "ranks and workers by documents and let each worker end with its own short batch; this one shares "
            "the pieces of split documents, deals whole batches to workers and hands each worker's tail to its "
            "rank's last worker (docs/batching.md, 'One short batch per rank'), so the saved positions name "
            "other items and cannot be resumed exactly: resume with the wdsllm that saved it, or start the "
            "state's epoch afresh (set_epoch)"
        )


def _check_endless_handoff(kind: str, version: int, source: Source, cfg: Config, world: int, workers: int) -> None:
    """An endless stream's epochs left every worker its own short batch before: where workers now
    hand their tails over (token or row batches, a mixture), its saved positions name other batches."""
    if version >= ENDLESS_HANDOFF_VERSIONS[kind] or not cfg.infinite:
        return
    spec = cfg.spec(0, 0, world, 0, workers)
    by_items = cfg.make_batcher().count_by == COUNT_BY_ITEMS and source.mixing is None
    if hands_tails(source, cfg, spec) and not by_items:
        raise StateError(
            f"the state was saved by an earlier wdsllm (state version {version}), which let every worker of an "
            "endless stream end each epoch with its own short batch; this one hands each worker's tail to its "
            "rank's last worker in every epoch (docs/batching.md, 'One short batch per rank'), so the saved "
            "positions name other batches and cannot be resumed exactly: resume with the wdsllm that saved it, "
            "or start afresh"
        )


def _batch_shares_move(source: Source, world: int, workers: int, unit: int) -> bool:
    """Whether planning workers' shares in whole ``unit``s moves any cut of the epoch's split."""
    if source.items_per_shard is None:
        return False
    total = int(np.sum(source.items_per_shard, dtype=np.int64))
    by_item = planmod.consumer_shares(total, world, workers)
    by_unit = planmod.consumer_shares(total, world, workers, unit=unit)
    return not all(np.array_equal(x, y) for x, y in zip(by_item, by_unit))


def _check_mix_order(kind: str, version: int, source: Source) -> None:
    """A mixture's passes were ordered by whole shards before: the same order only where no
    source's shards are cut into blocks."""
    if version >= MIX_BLOCK_ORDER_VERSIONS[kind]:
        return
    cut = [c for c in source.components() if planmod.cuts_shards(c.items_per_shard, planmod.block_tokens(c))]
    if cut:
        raise StateError(
            f"the state was saved by an earlier wdsllm (state version {version}), which ordered each pass of this "
            "mixture's sources by whole shards; this one shuffles blocks of shards (docs/mixtures.md, 'The "
            "shuffle'), so the saved positions name other documents and cannot be resumed exactly: resume with "
            "the wdsllm that saved it, or start the state's epoch afresh (set_epoch)"
        )


def rank_counts(source: Source, cfg: Config, st: LoaderState) -> np.ndarray | None:
    """[num_workers] batch counts of the state's rank in its epoch, as the saving loader capped
    them (None without an index)."""
    counts = batch_counts(source, cfg, st.epoch, st.world_size, st.num_workers, st.plan)
    if counts is None:
        return None
    return (equalised(counts, cfg.uneven) if st.equal_batches else counts)[st.rank]


def check_positions(st: LoaderState, source: Source, cfg: Config, *, exact_order: bool) -> None:
    """The positions agree with each other and with the epoch's batch counts.

    ``exact_order``: every worker yields its full count (``on_error="raise"``), so the positions
    are exactly DataLoader's round-robin share of the ``yielded`` batches."""
    keys = cfg.mode.hint_keys
    for w, pos in st.workers.items():
        if pos.hint is not None and set(pos.hint) - {MARK_KEY, LOST_KEY} != keys:
            raise StateError(
                f"{_where(f'workers.{w}[2]')} (the batcher's hint) has keys {sorted(pos.hint)}; "
                f"batching={cfg.batching!r} writes {sorted(keys) or 'no hint'}"
            )
    if st.tails and not merges_tails(source, cfg, st.num_workers):
        raise StateError(f"{_where('tails')} is {st.tails}, but this loader's workers have no tails to merge")
    if st.plan is not None:
        _check_plan(st, source, cfg)
    if cfg.steps_per_epoch is not None and st.steps > cfg.steps_per_epoch:
        raise StateError(f"{_where('steps')} is {st.steps}, beyond steps_per_epoch={cfg.steps_per_epoch}")
    if streams_on(st):
        _check_endless(st, source, cfg)
        return
    if st.steps and not st.infinite:
        raise StateError(f"{_where('steps')} is {st.steps}; a finite loader counts no steps")
    if not st.in_epoch:
        if st.yielded:
            raise StateError(f"{_where('yielded')} is {st.yielded} but no worker position is saved: incomplete state")
        return
    for w, pos in st.workers.items():
        if pos.epoch != st.epoch:
            raise StateError(f"{_where(f'workers.{w}')} is in epoch {pos.epoch}, the state in epoch {st.epoch}")
    # a worker's batches of holes only are numbered but never handed out
    handed = sum(p.batches - lost_batches(p.hint) for p in st.workers.values()) + st.tails
    mine = rank_counts(source, cfg, st)
    if mine is None:  # no index: the positions must at least add up
        _check_sum(st, handed)
        return
    total = int(mine.sum())
    if st.yielded > total:
        raise StateError(f"{_where('yielded')} is {st.yielded}, more than the {total} batches of the rank's epoch")
    share = round_robin_share(mine, st.yielded)
    for w in range(st.num_workers):
        got = st.workers[w].batches - lost_batches(st.workers[w].hint) if w in st.workers else 0
        if got > mine[w]:
            raise StateError(f"{_where(f'workers.{w}')} is at batch {got}, beyond the worker's {int(mine[w])} batches")
        if exact_order and got != share[w]:
            raise StateError(
                f"{_where(f'workers.{w}')} is at batch {got}; after {st.yielded} batches in DataLoader's order it "
                f"must be {int(share[w])}: the positions disagree with 'yielded'"
            )
    _check_sum(st, handed)


def streams_on(st: LoaderState) -> bool:
    """Whether the state's workers streamed on across epochs (an endless stream without equal
    batches), rather than standing in one epoch as a finite pass, or a pass of whole epochs, does."""
    return st.infinite and not st.equal_batches


def _check_sum(st: LoaderState, handed: int) -> None:
    if handed != st.yielded:
        raise StateError(f"the workers' positions add up to {handed} batches, {_where('yielded')} says {st.yielded}")


def _check_plan(st: LoaderState, source: Source, cfg: Config) -> None:
    plan = st.plan
    key = "plan"
    while plan is not None:
        if plan.epoch != st.epoch:
            raise StateError(f"{_where(key + '.epoch')} is {plan.epoch}; the state is in epoch {st.epoch}")
        counts = batch_counts(source, cfg, plan.epoch, plan.world, plan.workers, plan.base)
        if counts is not None:
            over = np.asarray(plan.consumed) > counts
            if over.any():
                r, w = (int(x) for x in np.argwhere(over)[0])
                raise StateError(
                    f"{_where(f'{key}.consumed[{r}][{w}]')} is {plan.consumed[r][w]}, beyond that old worker's "
                    f"{int(counts[r, w])} batches"
                )
        plan, key = plan.base, key + ".base"
    if streams_on(st):
        raise StateError(f"{_where('plan')} is set, but a stream across epochs is never re-planned")


def _check_endless(st: LoaderState, source: Source, cfg: Config) -> None:
    """An endless stream's workers never end: the i-th batch came from worker i % W."""
    n = st.num_workers
    if st.turn != st.yielded % n:
        raise StateError(f"{_where('turn')} is {st.turn}; after {st.yielded} batches it must be {st.yielded % n}")
    if st.active is not None and st.active != list(range(n)):
        raise StateError(f"{_where('active')} must list every worker of an endless stream")
    served = [(st.yielded - w + n - 1) // n for w in range(n)]
    for w in range(n):
        if served[w] and w not in st.workers:
            raise StateError(f"{_where('workers')} lacks worker {w}, which yielded {served[w]} batches")
        if not served[w] and w in st.workers:
            raise StateError(f"{_where(f'workers.{w}')} is saved, but that worker yielded no batch yet")
    if not st.workers:
        return
    epochs = [p.epoch for p in st.workers.values()]
    low, high = min(epochs), max(epochs)
    if low < st.epoch:
        raise StateError(f"{_where('workers')} holds epoch {low}, before the stream's first epoch {st.epoch}")
    if low == high == st.epoch or cfg.resample:  # one epoch so far (resampling never ends one)
        _check_served(st, {w: p.batches for w, p in st.workers.items()}, served)
        return
    if high - st.epoch > MAX_CHECKED_SPAN:
        return  # a long-running stream: the digest vouches for it
    counts = {}
    for e in range(st.epoch, high + 1):
        c = batch_counts(source, cfg, e, st.world_size, n)
        if c is None:
            return
        counts[e] = c[st.rank]
    since_start = {}
    for w, p in st.workers.items():
        if p.batches > counts[p.epoch][w]:
            raise StateError(
                f"{_where(f'workers.{w}')} is at batch {p.batches}, beyond the worker's {int(counts[p.epoch][w])} "
                f"batches in epoch {p.epoch}"
            )
        since_start[w] = sum(int(counts[e][w]) for e in range(st.epoch, p.epoch)) + p.batches
    _check_served(st, since_start, served)


def _check_served(st: LoaderState, have: dict[int, int], served: list[int]) -> None:
    for w, got in have.items():
        if got != served[w]:
            raise StateError(
                f"{_where(f'workers.{w}')} is at batch {got}; after {st.yielded} batches taken in turn it must be "
                f"{served[w]}"
            )


# ----------------------------------------------------------------------------------------------
# One dataset worker's state (torchdata's StatefulDataLoader)


@dataclass
class DatasetState:
    """Where one worker of a ``wdsllm.dataset`` pipeline stands (StatefulDataLoader keeps one per
    worker and hands it back to the same worker)."""

    dataset: str
    settings: str
    rank: int
    world_size: int
    worker: int
    num_workers: int
    position: Position
    version: int = DATASET_VERSION

    @classmethod
    def load(cls, saved: Any) -> DatasetState:
        body = unseal(saved, DATASET_KIND, READABLE_DATASET_VERSIONS)
        world = _int(_get(body, "world_size"), "world_size", 1, MAX_WORLD)
        workers = _int(_get(body, "num_workers"), "num_workers", 1, MAX_WORKERS)
        return cls(
            dataset=_str(_get(body, "dataset"), "dataset"),
            settings=_str(_get(body, "settings"), "settings"),
            rank=_int(_get(body, "rank"), "rank", 0, world),
            world_size=world,
            worker=_int(_get(body, "worker"), "worker", 0, workers),
            num_workers=workers,
            position=Position.parse(_get(body, "position"), "position"),
            version=body.get("version", DATASET_VERSION),
        )

    def sealed(self) -> dict[str, str]:
        return seal(
            {
                "kind": DATASET_KIND,
                "version": DATASET_VERSION,
                "dataset": self.dataset,
                "settings": self.settings,
                "rank": self.rank,
                "world_size": self.world_size,
                "worker": self.worker,
                "num_workers": self.num_workers,
                "position": self.position.to_json(),
            },
            DATASET_KIND,
        )

    def check(self, source: Source, cfg: Config, *, dataset: str, settings: str, rank: int, world: int) -> None:
        """The state is this pipeline's, and its position lies within the worker's epoch."""
        if self.dataset != dataset:
            raise StateError("the dataset state was saved for another dataset (shards or their order differ)")
        if self.settings != settings:
            raise StateError("the dataset state was saved with other settings (batch size, seed, batching, ...)")
        check_order(DATASET_KIND, self.version, source, cfg)
        check_split(DATASET_KIND, self.version, source, cfg, self.world_size, self.num_workers)
        if (self.rank, self.world_size) != (rank, world):
            raise StateError(
                f"the dataset state is rank {self.rank} of {self.world_size}'s; this pipeline is rank {rank} of {world}"
            )
        if cfg.infinite:
            return
        spec = cfg.spec(self.position.epoch, rank, world, self.worker, self.num_workers)
        count = worker_batch_count(source, cfg, spec)
        if count is not None and self.position.batches > count:
            raise StateError(
                f"{_where('position')} is at batch {self.position.batches}, beyond the worker's {count} batches"
            )
