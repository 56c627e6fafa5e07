"""The loader's steering methods: ``skip``, ``exclude``, ``set_weights`` (docs/steering.md).

Each is a collective (every process calls it with the same arguments at the same planned step,
checked by ``steer.agree``), validated before anything changes (a bad one is a ``SteeringError``
and the run keeps its settings), recorded in the run's log, and applied from the next planned
step: a skip where the stream reaches it, an exclusion or new weights by re-planning the rest of
the epoch (``plans.SteeredPlan``) and every later epoch. The same exclusion or skip given
again (a requeue replaying its launch script) is a replay: nothing more changes. How the stream
follows them is here too: a seek over skipped steps, a step of several batches handed out as one.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from ...errors import MixtureError, SteeringError, UsageError
from .. import state as statemod
from ..batching import Batch
from ..block import ID_SHIFT, concat_blocks, join_rows
from ..collate import assemble
from ..counts import round_robin_share
from ..cursor import positions_of_share, turn_after
from ..plan import torch_seed
from ..resume import items_between
from ..tails import merges_tails
from .agree import agree_on_change
from .ahead import Ahead, AheadInputs, PlanKey, readied, replan_ahead
from .log import Change, Exclude, Log, Rescheduled, Weights, check_weights
from .plans import Leaving, SteeredPlan, exclusions_of, steer_plans
from .prestart import Prestarted, started
from .runtime import Replans
from .schedule import Schedule

log = logging.getLogger(__name__)

_STREAMED = (
    "{what} on an endless stream needs its epochs whole, one after another, to say where a planned step is: pass "
    "equal_batches=True (docs/steering.md)"
)


class SteeringMethods:
    """What a ``Loader`` offers a trainer that steers it (mixed into the loader)."""

    #: the re-plan of the first pending change, made in a thread (``_prepare``)
    _ahead: Ahead | None = None
    #: the stream of the re-plan the last change took, started ahead (``_pass_stream`` takes it)
    _prestarted: Prestarted | None = None
    #: threads closing the streams of passes a change ended (``_end_stream``)
    _retiring: tuple = ()
    _replans: Replans

    # -- the planned step -----------------------------------------------------------------------
    @property
    def planned_step(self) -> int:
        """The planned step of the next batch: its place in the run's planned sequence of steps
        (every epoch's, skipped ones included), which ``skip`` ranges name."""
        self._settle_epoch()
        return self.steering.planned

    @planned_step.setter
    def planned_step(self, step: int) -> None:
        """Only where a state saved before steering existed left it unknown (``skip`` says so)."""
        if not self.steering.unknown:
            raise SteeringError(f"the planned step is known ({self.steering.planned}); it moves only by iterating")
        self.steering.planned = self.steering.epoch_start = int(step)
        self.steering.unknown = False

    def _steer_first(self, what: str, args: Any) -> None:
        """What every change does first: settle the epoch, agree across processes, know where we are."""
        self._settle_epoch()
        agree_on_change(what, self.steering.planned, args)
        if self.steering.unknown:
            raise SteeringError(
                "this loader was restored from a state saved before steering existed, which does not say the run's "
                "planned step: set loader.planned_step = N (the trainer's step: nothing was skipped before) first"
            )

    # -- skip -----------------------------------------------------------------------------------
    def skip(self, start: int, stop: int) -> int:
        """Leave out planned steps [start, stop): the batches yielded are the planned sequence with
        that range removed, exactly on resume. The same range given again is a replay and removes
        nothing more; a range that overlaps a recorded one without being it, or lies wholly before
        the next planned step, is refused. Returns the first planned step it removes
        (``max(start, planned_step)`` when it was recorded)."""
        self._steer_first("skip()", ["skip", start, stop])
        return self._take_skip(start, stop)

    def _take_skip(self, start: int, stop: int) -> int:
        if self._streamed:
            raise SteeringError(_STREAMED.format(what="skip()"))
        if self._epoch_total() is None:
            raise SteeringError("skip() needs the epoch's batch counts: an index, or raw text with a count sidecar")
        recorded, replay = self.steering.log.add_skip(start, stop, self.steering.planned)
        if replay:
            log.info("skip(%d, %d) is recorded already (a replay): nothing more is skipped", start, stop)
        else:
            log.info("planned steps [%d, %d) are skipped", recorded.start, recorded.stop)
        return recorded.start

    # -- exclude --------------------------------------------------------------------------------
    def exclude(
        self,
        *,
        sources: Iterable[str] = (),
        shards: Iterable[int | str] = (),
        docs: Iterable[int] = (),
        at: int | None = None,
    ) -> int:
        """Never yield these again, from planned step ``at`` (None: the next step, or
        ``steer_horizon`` steps after it), returned: a mixture's ``sources`` by name, ``shards``
        by number (as item ids name them) or name, and ``docs`` by id (the values of a batch's
        ``docs``; of its ``rows`` for a packed dataset). The rest of the epoch is re-planned
        without them, and so is every later epoch; a mixture's other sources share an excluded
        source's weight from the next epoch on. An exclusion that names nothing known, or would
        leave nothing to read, is refused; the same one again is a replay."""
        names, shard_ids, items = self._exclusion(sources, shards, docs)
        _check_at(at)
        self._steer_first("exclude()", ["exclude", list(names), list(shard_ids), list(items), at])
        return self._take_exclusion(names, shard_ids, items, self._effective(at))

    def _take_exclusion(
        self, names: tuple[str, ...], shard_ids: tuple[int, ...], items: tuple[int, ...], at: int
    ) -> int:
        steer = self.steering
        change = Exclude(names, shard_ids, items, 0)
        for old in [*steer.log.exclusions, *self._pending(Exclude)]:
            if old.same(change):
                log.info("this exclusion is recorded already (a replay): nothing more is excluded")
                return steer.planned
        self._check_something_left(change)
        return self._schedule(change, at)

    def _pending(self, kind: type) -> list:
        """The pending changes of one kind, in the order they take effect."""
        return [c.change for c in self.steering.pending if isinstance(c.change, kind)]

    def _effective(self, at: int | None) -> int:
        """The planned step a change made now takes effect at: ``at``, else the horizon after the
        next step; never a step already planned."""
        planned = self.steering.planned
        if at is None:
            return planned + self.steering.horizon
        if at < planned:
            raise SteeringError(
                f"at={at}: the next planned step is {planned}; a change takes effect at a step not yet planned"
            )
        return int(at)

    def _schedule(self, change: Exclude | Weights, at: int) -> int:
        """Take ``change`` now where ``at`` is the next planned step, else hold it for step ``at``
        and start its re-plan in the background (``ahead.Ahead``)."""
        steer = self.steering
        if self._streamed:
            raise SteeringError(_STREAMED.format(what=f"{change.kind}()"))
        self._check_depth()
        if at == steer.planned:
            self._take_change(change)
            return at
        steer.add_pending(Change(at, change))
        log.info("%s made at planned step %d takes effect at step %d", change.kind, steer.planned, at)
        self._prepare()
        return at

    def _check_depth(self) -> None:
        """Refuse a change a state could not hold: each one inside an epoch plans the rest over
        the plan before it, and a state reads at most ``MAX_PLAN_DEPTH`` plans deep."""
        plan = self.source.plan_for(self.cursor.epoch) if self._mid_epoch() else None
        depth = 0
        while plan is not None:
            depth, plan = depth + 1, getattr(plan, "base", None)
        if depth + len(self.steering.pending) + 1 > statemod.MAX_PLAN_DEPTH:
            raise SteeringError(
                f"epoch {self.cursor.epoch} was planned again {depth} times (each change inside it, and each resume "
                f"on another layout, plans the rest over the plan before), with {len(self.steering.pending)} changes "
                f"pending; a state holds at most {statemod.MAX_PLAN_DEPTH}: make this change at the next epoch's "
                "first step (at=), or give the mixture shorter epochs (epoch_items=)"
            )

    def _take_change(self, change: Exclude | Weights) -> None:
        """Record ``change`` at the next planned step and re-plan for it."""
        planned = self.steering.planned
        if isinstance(change, Weights):
            self._apply(
                Weights(change.weights, self._change_epoch(), self._units_point()), Leaving(weights=change.weights)
            )
            names = list(self.catalog.mixture.names)
            log.info("mixture weights from planned step %d: %s", planned, dict(zip(names, change.weights)))
        else:
            made = replace(change, epoch=self._change_epoch())
            self._apply(made, Leaving())
            log.info("excluded from planned step %d: %s", planned, made.to_json())

    def _take_due(self) -> None:
        """Take the pending changes whose step the stream has reached."""
        steer = self.steering
        while steer.due():
            self._take_change(steer.pending.pop(0).change)
        self._prepare()

    def _exclusion(self, sources: Iterable[str], shards: Iterable[int | str], docs: Iterable[int]):
        catalog = self.catalog
        names = tuple(sorted({str(s) for s in sources}))
        known = list(catalog.mixture.names) if catalog.mixing is not None else []
        unknown = [n for n in names if n not in known]
        if unknown:
            what = f"the mixture's sources are {known}" if known else "this loader reads one dataset, not a mixture"
            raise SteeringError(f"exclude(sources=...): no source named {', '.join(map(repr, unknown))}; {what}")
        n_shards = len(catalog.urls)
        by_name = (
            {str(u).rsplit("/", 1)[-1]: i for i, u in enumerate(catalog.urls)}
            if any(isinstance(s, str) for s in shards)
            else {}
        )
        shard_ids = []
        for s in shards:
            i = by_name.get(s) if isinstance(s, str) else s
            if i is None or isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < n_shards:
                raise SteeringError(f"exclude(shards=...): {s!r:.80} is not one of this dataset's {n_shards:,} shards")
            shard_ids.append(int(i))
        items = []
        per_shard = catalog.items_per_shard
        docs = list(docs)
        if docs and any(not part.opens_units for part in catalog.components()):
            raise SteeringError(
                "exclude(docs=...) names packed documents by shard and ordinal; raw text names its documents by "
                "input file and line, which a plan cannot find without reading: exclude its shards (units) or "
                "sources, or pack it"
            )
        for d in docs:
            if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0:
                raise SteeringError(f"exclude(docs=...): {d!r:.40} is not an item id (a value of a batch's docs)")
            shard, ordinal = int(d) >> ID_SHIFT, int(d) & ((1 << ID_SHIFT) - 1)
            if shard >= n_shards or (per_shard is not None and ordinal >= int(per_shard[shard])):
                raise SteeringError(f"exclude(docs=...): {int(d)} names no item of this dataset")
            items.append(int(d))
        if not (names or shard_ids or items):
            raise SteeringError("exclude() names nothing: give sources=, shards= or docs=")
        return names, tuple(sorted(set(shard_ids))), tuple(sorted(set(items)))

    def _check_something_left(self, change: Exclude) -> None:
        """Refuse an exclusion after which nothing would be read."""
        catalog = self.catalog
        previous = [*self.steering.log.exclusions, *self._pending(Exclude), change]
        gone_sources = {n for ex in previous for n in ex.sources}
        gone_shards = {s for ex in previous for s in ex.shards}
        if catalog.mixing is not None:
            names = list(catalog.mixture.names)
            bases = catalog.mixing.bases
            for s, name in enumerate(names):
                if name in gone_sources:
                    gone_shards |= set(range(int(bases[s]), int(bases[s + 1])))
        per_shard = catalog.items_per_shard
        if per_shard is None:
            left = len(catalog.urls) - len(gone_shards)
        else:
            items = {i for ex in previous for i in ex.items if (i >> ID_SHIFT) not in gone_shards}
            kept = np.ones(len(per_shard), bool)
            kept[list(gone_shards)] = False
            left = int(np.asarray(per_shard, np.int64)[kept].sum()) - len(items)
        if left <= 0:
            raise SteeringError("this exclusion would leave nothing to read; nothing was excluded")

    # -- the schedule ---------------------------------------------------------------------------
    def set_schedule(self, schedule: Schedule | Mapping) -> int:
        """A schedule for the rest of the run: a later phase changed or added, from the next planned
        step (returned) on. It must agree with the schedule in force on every step already planned
        (a past phase cannot change); it is recorded, so a resume follows it."""
        new = schedule if isinstance(schedule, Schedule) else Schedule.from_json(schedule)
        steer = self.steering
        self._steer_first("set_schedule()", ["set_schedule", new.to_json()])
        made = self._scheduled(new)
        if not (steer.phases.agrees(made.phases, steer.planned) and steer.rows.agrees(made.rows, steer.planned)):
            raise SteeringError(
                f"set_schedule(): {new!r} takes other batches (or rows) on steps already planned (before "
                f"{steer.planned}); a schedule set while the run trains may change only what comes next"
            )
        steer.log.add(steer.planned, Rescheduled(new.to_json()))
        steer.phases, steer.rows = made.phases, made.rows
        log.info("the schedule from planned step %d: %r", steer.planned, new)
        return steer.planned

    # -- set_weights ----------------------------------------------------------------------------
    def set_weights(self, weights: Mapping[str, float], at: int | None = None) -> int:
        """A mixture's weights from planned step ``at`` (None: the next step, or ``steer_horizon``
        steps after it), returned, on, by source name (every source named; they are
        normalised). The rest of the epoch takes its remaining documents in the new proportions
        as far as they go (the source that runs out first for its weight sets how far; what
        others had planned beyond waits for a later pass); later epochs' quotas follow the new
        weights. Refused: unknown or missing names, negative, NaN, infinite or all-zero weights,
        weight on an excluded source."""
        normal = self._checked_weights(weights)
        _check_at(at)
        self._steer_first("set_weights()", ["set_weights", list(normal), at])
        return self._take_weights(normal, self._effective(at))

    def _checked_weights(self, weights: Mapping[str, float]) -> tuple[float, ...]:
        """Weights by name as the mixture's sources come, normalised, or a ``SteeringError``."""
        catalog = self.catalog
        if catalog.mixing is None:
            raise SteeringError("set_weights() steers a mixture; this loader reads one dataset")
        names = list(catalog.mixture.names)
        if not isinstance(weights, Mapping):
            raise SteeringError("set_weights() takes a mapping of source name -> weight")
        unknown = sorted(set(map(str, weights)) - set(names))
        missing = [n for n in names if n not in weights]
        if unknown or missing:
            raise SteeringError(
                f"set_weights(): {'unknown sources ' + repr(unknown) if unknown else ''}"
                f"{'; ' if unknown and missing else ''}{'missing sources ' + repr(missing) if missing else ''} "
                f"(the mixture's sources are {names})"
            )
        normal = check_weights([weights[n] for n in names], "set_weights() weights")
        excluded = {n for ex in [*self.steering.log.exclusions, *self._pending(Exclude)] for n in ex.sources}
        heavy = [n for n, w in zip(names, normal) if w > 0 and n in excluded]
        if heavy:
            raise SteeringError(f"set_weights(): sources {heavy} are excluded and must weigh 0")
        try:
            catalog.mix_planner().check_weights(normal)
        except MixtureError as exc:
            raise SteeringError(f"set_weights(): {exc}") from None
        return normal

    def _take_weights(self, normal: tuple[float, ...], at: int) -> int:
        return self._schedule(Weights(normal, 0), at)

    def _units_point(self) -> int:
        """Where the run stands in the mixture's units (over every rank), as the drift counts it."""
        planner = self.catalog.planner
        if not self._mid_epoch() or self._mix is None:
            return planner.epoch * self._change_epoch()
        unit = 0 if self.catalog.mixture.unit == "tokens" else 1
        return planner.epoch * self.cursor.epoch + int(self._mix.this_epoch[:, unit].sum()) * self.world_size

    def weights_now(self) -> tuple[float, ...] | None:
        """A mixture's weights in force at the next planned step (None: one dataset)."""
        if self.catalog.mixing is None:
            return None
        changes = self.steering.log.weight_changes
        if changes:
            return changes[-1].weights
        planner = self.catalog.planner
        at = self.cursor.epoch * planner.epoch
        return next(w for start, w in reversed(planner.phases()) if start <= at)

    def _steer_metrics(self) -> dict[str, float]:
        """Steering's figures for ``metrics()``: the planned step, the schedule's phase, what was
        skipped and excluded (items: documents, or rows), the weights set while the run trained."""
        out = self.steering.metrics()
        if not self.steering.log.changes:
            return out
        out.update(self._replans.metrics())
        plan = self.source.plan_for(self.cursor.epoch)
        if plan is not None and plan.remainder:
            out["steer_excluded_items"], out["steer_excluded_tokens"] = map(float, plan.excluded())
        changes = self.steering.log.weight_changes
        if changes:
            out.update({f"steer_weight/{n}": w for n, w in zip(self.catalog.mixture.names, changes[-1].weights)})
        return out

    # -- a steering file, re-read while the run trains (steerfile.py) ----------------------------
    def _reload(self) -> None:
        """Take what the steering file says now (every rank the same, from rank 0's reading)."""
        from .file import shared

        url = self._steer_url
        names = list(self.catalog.mixture.names) if self.catalog.mixing is not None else []
        status, what = shared(url, names)
        if status == "error":
            log.error("steering file %s", what)
            return
        try:
            takes = self._checked_file(what)
        except SteeringError as exc:
            log.error("steering file %s was not taken, the run keeps its settings: %s", url, exc)
            return
        for take in takes:
            take()

    def _checked_file(self, what: dict) -> list:
        """Every entry of a steering file checked before any is taken: what to call, in order."""
        takes = []
        if "weights" in what:
            normal = self._checked_weights(what["weights"])
            pending = self._pending(Weights)
            now = pending[-1].weights if pending else self.weights_now()
            if now is None or max(abs(a - b) for a, b in zip(normal, now)) > 1e-9:
                takes.append(lambda: self._take_weights(normal, self._effective(None)))
        trial = Log(list(self.steering.log.changes))
        for start, stop in what.get("skip", []):
            trial.add_skip(start, stop, self.steering.planned)
            takes.append(lambda a=start, b=stop: self._take_skip(a, b))
        if "exclude" in what:
            ex = {k: v for k, v in what["exclude"].items() if v}
            if ex:
                names, shard_ids, items = self._exclusion(
                    ex.get("sources", ()), ex.get("shards", ()), ex.get("docs", ())
                )
                self._check_something_left(Exclude(names, shard_ids, items, 0))
                takes.append(lambda: self._take_exclusion(names, shard_ids, items, self._effective(None)))
        return takes

    # -- the stream under steering --------------------------------------------------------------
    def _skip_rest(self, epoch: int) -> None:
        """Count the rest of the epoch as skipped where a skipped range ends it (the planned step
        moves to the epoch's end)."""
        target = self.steering.skip_target()
        if target is not None:
            self._seek(epoch, target)

    def _seek(self, epoch: int, target: int) -> bool:
        """Move this pass to planned step ``target`` (the end of a skipped range): the workers
        start again where the plan has the loader's batches of that step, as a resume does.
        False where ``target`` lies beyond the epoch (which then ends, its steps counted)."""
        steer, cursor = self.steering, self.cursor
        total = self._epoch_total()
        if total is None:
            raise UsageError("skipping steps needs the batch counts of the epoch (an index, or a count sidecar)")
        skipped = steer.phases.batches_between(steer.planned, target)
        position = min(total, cursor.yielded + skipped)
        end = steer.epoch_start + steer.epoch_steps(steer.epoch_start, total)
        plan = self.source.plan_for(epoch)
        counts = self.here.worker_counts(epoch, self.world_size, self.workers, plan)[self.rank]
        before, after = (round_robin_share(counts, n).tolist() for n in (cursor.yielded, position))
        items, tokens = items_between(self.catalog, self.cfg, epoch, self.rank, self.world_size, plan, before, after)
        steer.skipped.add(min(target, end) - steer.planned, position - cursor.yielded, items, tokens)
        steer.planned = min(target, end)
        if position >= total:
            cursor.yielded = total
            return False
        positions = positions_of_share(epoch, counts, position)
        self.source.resume_from(positions)
        self._transport.forget()
        served = {w: (p[0], p[1]) for w, p in positions.items()}
        cursor.seek(positions, position, turn_after(served, self.workers))
        return True

    def _hand_out_group(self, group: list[Batch]) -> dict:
        """One step of several of the loader's batches: each counted as handed out, collated
        together, their rows joined where a seq_len schedule says so."""
        join = self.steering.rows.group_at(self.steering.planned - 1)
        if len(group) == 1 and join == 1:
            return self._hand_out(group[0])
        began = time.perf_counter()
        for batch in group:
            if self._mix is not None:
                self._mix.add(batch.mix, batch.epoch)
            if batch.stats:
                self.stats.add(batch.stats)
            if batch.tail:
                self.cursor.merged_out()
            else:
                self.cursor.handed_out(batch.worker, batch.epoch, batch.index, batch.hint)
        options = self.collate_options
        if join > 1:
            options = replace(options, seq_len=options.seq_len * join, max_segments=(options.max_segments or 1) * join)
        items = concat_blocks([join_rows(b.items, join) for b in group])
        out = assemble(items, group[0].epoch, options)
        self.observer.handed(group[-1].worker, time.perf_counter() - began)
        return self._pinned(out)

    # -- applying a change ----------------------------------------------------------------------
    def _mid_epoch(self) -> bool:
        """Whether the next step falls inside an epoch already begun (else at an epoch's start)."""
        return self.cursor.order is not None or self.cursor.restored is not None

    def _change_epoch(self) -> int:
        """The first epoch a change made now shapes from its start."""
        return self.cursor.epoch + 1 if self._mid_epoch() else self.epoch

    def _apply(self, change: Exclude | Weights, now: Leaving) -> None:
        """Record ``change`` and re-plan: the rest of the epoch in progress (``now``: the weights
        it takes, where they changed), then every epoch it shapes from the start."""
        steer = self.steering
        if self._streamed:
            raise SteeringError(_STREAMED.format(what=f"{change.kind}()"))
        if self._mid_epoch():
            epoch = self.cursor.epoch
            consumed = self._consumed_now(epoch)
            base = self.source.plan_for(epoch)
            steer.log.add(steer.planned, change)
            leaving = self._leaving(now)
            plan = self._replan(PlanKey.of(epoch, consumed, base, leaving), consumed, base)
            self.source.set_plan(epoch, plan)
            self.source.resume_from({})
            self._transport.forget()
            self._total.forget()
            if plan.own_total is not None:  # counted ahead
                self._total.know(self.here, epoch, plan, plan.own_total)
            self.cursor.restored = None
            self.cursor.positions, self.cursor.yielded = {}, 0
            steer.epoch_start = steer.planned
            steer.restart = True
        else:
            steer.log.add(steer.planned, change)
        steer_plans(steer.log, self.catalog, self.source)

    def _replan(self, key: PlanKey, consumed: list[list[int]], base: Any) -> SteeredPlan:
        """The rest of the epoch as ``key`` says: made ahead (``_prepare``), else now."""
        ahead, self._ahead = self._ahead, None
        began = time.perf_counter()
        plan = ahead.take(key) if ahead is not None else None
        self._replans.add(plan is not None, time.perf_counter() - began)
        if ahead is not None and plan is not None:  # its stream, started ahead, is for this plan
            self._prestarted, ahead.prestarted = ahead.prestarted, None
        elif ahead is not None:
            self._abandon(ahead)
        if plan is None:
            plan = SteeredPlan(key.epoch, self.world_size, self.workers, consumed, base, leaving=key.leaving)
            if self._transport.bundled:  # made once here, before the workers fork, not in each of them
                readied(self.here, plan, deal=False)
        return plan

    def _prepare(self) -> None:
        """Start the re-plan of the first pending change in a thread, where it falls inside the
        epoch in progress: what every consumer will have consumed at its step follows from the
        batch count there (the round robin), so the plan does not wait for the step."""
        steer, cursor = self.steering, self.cursor
        if not steer.pending or not self._mid_epoch() or not self.layout.reads:  # a receiver reads nothing
            return
        if merges_tails(self.catalog, self.cfg, self.workers):
            return
        if self.world_size > 1 and not self.cfg.keeps_equal_batches(self.world_size):
            return
        first = steer.pending[0]
        epoch = cursor.epoch
        base = self.source.plan_for(epoch)
        trial = Log(list(steer.log.changes))
        trial.add(first.at, first.change)
        weights = first.change.weights if isinstance(first.change, Weights) else None
        leaving = exclusions_of(trial, self.catalog).joined(Leaving(weights=weights))
        yielded = cursor.restored.state.yielded if cursor.restored is not None else cursor.yielded
        upto = yielded + steer.phases.batches_between(steer.planned, first.at)
        inputs = AheadInputs(
            self.here, self._transport, self.pipeline, epoch, base, leaving, upto, torch_seed(self.cfg.seed, epoch)
        )
        expected = PlanKey.of(epoch, [], base, leaving)
        ahead = self._ahead
        if ahead is None or (ahead.expected, ahead.upto) != (expected, upto):
            if ahead is not None:  # made for a plan an earlier change replaced
                self._abandon(ahead)
            self._ahead = Ahead(expected, upto, functools.partial(replan_ahead, inputs))

    def _abandon(self, ahead: Ahead) -> None:
        """A re-plan made ahead that no step will take: it ends in the background (joined at close)."""
        ahead.abandon()
        self._retiring = (*(t for t in self._retiring if t.is_alive()), ahead.thread)

    def _prestart_workers(self) -> None:
        """Between steps, once the plan made ahead is there: fork the workers of its pass now,
        so that they read while the old plan's batches are still handed out."""
        ahead = self._ahead
        plan = ahead.plan() if ahead is not None else None
        if plan is None or ahead.prestarted is not None or not self._transport.bundled:
            return
        epoch = self.cursor.epoch
        ahead.prestarted = started(self._transport, self.pipeline, epoch, plan, torch_seed(self.cfg.seed, epoch))
        steer = self.steering
        log.debug("the workers of the re-plan for step %d start at step %d", steer.pending[0].at, steer.planned)

    def _end_stream(self, batches: Any) -> None:
        """Close a pass's stream; one that a change ended closes in a thread (its workers' exit,
        its buffers freed), so that the new pass's first step does not wait for it."""
        steer = self.steering
        if not (steer.restart or steer.due()):
            batches.close()
            return
        retiring = threading.Thread(target=batches.close, name="wdsllm-steer-retire", daemon=True)
        retiring.start()
        self._retiring = (*(t for t in self._retiring if t.is_alive()), retiring)

    def _close_steering(self) -> None:
        """What steering started ends with the loader: a re-plan made ahead, a stream started
        ahead, old streams closing."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.close()
        pre, self._prestarted = self._prestarted, None
        if pre is not None:
            pre.close()
        retiring, self._retiring = self._retiring, ()
        for thread in retiring:
            thread.join()

    def _pass_stream(self, epoch: int) -> Any:
        """The transport's stream of the pass that starts now: the one started ahead where it
        reads the plan this pass follows from its start, else a new one."""
        pre, self._prestarted = self._prestarted, None
        if pre is not None and pre.plan is self.source.plan_for(epoch) and not self.source.resume_positions:
            return pre.stream
        if pre is not None:
            pre.close()
        return self._transport.stream(self.pipeline, torch_seed(self.cfg.seed, epoch))

    def _leaving(self, now: Leaving) -> Leaving:
        return exclusions_of(self.steering.log, self.catalog).joined(now)

    def _consumed_now(self, epoch: int) -> list[list[int]]:
        """Batches every (rank, worker) has handed out of the epoch so far (equal batches, or this
        rank alone)."""
        if merges_tails(self.source.catalog, self.cfg, self.workers):
            raise SteeringError("changes inside an epoch need the epoch's batch counts (an index, or a count sidecar)")
        cursor = self.cursor
        restored = cursor.restored
        yielded = restored.state.yielded if restored is not None else cursor.yielded
        if self.world_size == 1:
            positions = self.source.resume_positions if restored is not None else cursor.positions
            return [[int(positions[w][1]) if w in positions else 0 for w in range(self.workers)]]
        if not self.cfg.keeps_equal_batches(self.world_size):
            raise SteeringError("changes inside an epoch on several ranks need equal batches (equal_batches=True)")
        counts = self.here.worker_counts(epoch, self.world_size, self.workers, self.source.plan_for(epoch))
        return [[int(x) for x in round_robin_share(counts[r], yielded)] for r in range(self.world_size)]


def _check_at(at: Any) -> None:
    """``at=`` is a planned step (None: the loader's horizon)."""
    if at is not None and (isinstance(at, bool) or not isinstance(at, (int, np.integer)) or not 0 <= at < 1 << 62):
        raise SteeringError(f"at={at!r:.40} is not a planned step")


__all__ = ["SteeringMethods"]
