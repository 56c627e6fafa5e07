"""Process-global state: one owned object per concern, one fork hook, one ``reset()``.

Storage keeps a few things for the life of a process: connection pools and clients, counters,
recycled mappings, the block scheduler and the stores' measured speeds, parked spools, the fetch
process, resolved revisions and credentials. Each lives in one object, keyed by what it
describes (a store, a repository, a filesystem's options), registered here under a name. A forked
child (a DataLoader worker) cannot use its parent's threads, sockets or locks: the one
``os.register_at_fork`` hook below asks every registered object to forget them
(:meth:`ProcessState.after_fork`). :func:`reset` drops everything (tests, a process that is done
reading), closing what was started.
"""

from __future__ import annotations

import os
import pickle
import threading
from typing import Any, Protocol, TypeVar


class ProcessState(Protocol):
    """What an object holding process-global state answers."""

    def reset(self) -> None:
        """Drop what is held, closing what this process started (threads, processes, streams)."""

    def after_fork(self) -> None:
        """In a forked child: forget the parent's threads, sockets, sessions and locks without
        closing them (they are the parent's), and start empty."""


class Carried(Protocol):
    """State that a spawned helper (the fetch process) takes from this process, so that it does
    not find again what this one found (credentials after a slow search, the commit a branch
    named). A forked child has it already."""

    def export(self) -> Any:
        """A picklable snapshot (what does not pickle is left out)."""

    def adopt(self, snapshot: Any) -> None:
        """Take what another process's :meth:`export` gave."""


S = TypeVar("S", bound=ProcessState)
C = TypeVar("C", bound=Carried)

_owned: dict[str, ProcessState] = {}
_carried: dict[str, Carried] = {}
_lock = threading.Lock()


def own(name: str, state: S) -> S:
    """Register ``state`` under ``name`` (once per concern) and return it."""
    with _lock:
        if name in _owned:
            raise ValueError(f"process state {name!r} is registered twice")
        _owned[name] = state
    return state


def carry(name: str, state: C) -> C:
    """Register ``state`` as one a spawned helper takes (:func:`exported`) and return it."""
    with _lock:
        _carried[name] = state
    return state


def exported() -> dict[str, Any]:
    """Every carried state's snapshot, by name."""
    with _lock:
        states = dict(_carried)
    return {name: state.export() for name, state in states.items()}


def adopt(snapshots: dict[str, Any]) -> None:
    """Take the snapshots of :func:`exported` from another process."""
    for name, snapshot in snapshots.items():
        state = _carried.get(name)
        if state is not None:
            state.adopt(snapshot)


def picklable(value: Any) -> bool:
    """Whether ``value`` survives pickling (a snapshot leaves out what does not)."""
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


def owned(name: str) -> ProcessState:
    """The object registered under ``name``."""
    return _owned[name]


def reset() -> None:
    """Drop every concern's state, the most recently registered first (tests; a process that
    reads no more)."""
    with _lock:
        states = list(_owned.values())
    for state in reversed(states):
        state.reset()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    for state in list(_owned.values()):
        state.after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
