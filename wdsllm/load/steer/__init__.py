"""Steering a run while it trains (docs/steering.md): a folder whose listing is the feature list.

- ``schedule``: schedules declared up front (batch sizes, token budgets, row lengths), as planned steps;
- ``log``: the changes made while the run trains (skips, exclusions, weights), as the state keeps them;
- ``runtime``: a loader's steering at run time (the planned step, the steps' batches, the state's part);
- ``face``: the loader's ``skip``, ``exclude``, ``set_weights`` and the steering file's reload;
- ``plans``: the rest of an epoch re-planned after a change, and the later epochs' plans;
- ``agree``: every rank takes the same change (one gather); ``file``: the operator's steering file;
- ``losses``: per-source losses of a mixture's batch, for online mixing (imports torch).
"""
