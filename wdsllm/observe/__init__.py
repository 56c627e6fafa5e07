"""Seeing the data path: the exposed data wait on the trainer's thread, the workers' stages and
queues, the stores, the mixture's drift, a watchdog for stuck workers, and exporters
(docs/observability.md). Imports no torch until a reduction or an exporter needs it."""

from .wait import WaitClock, WaitSummary

__all__ = ["WaitClock", "WaitSummary"]
