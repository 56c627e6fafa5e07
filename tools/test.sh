#!/usr/bin/env bash
# Set up the environment if needed, then run the whole test suite (CI runs this) on one pytest-xdist
# worker per core; `--quick` runs the quick suite instead (`-m "not slow"`: tests/conftest.py
# SLOW_TESTS lists what it leaves out). Other arguments go to pytest as they are, after ours, so
# `-n 1`, `-k NAME` or test files given here win (without one, pytest runs its testpaths, tests/).
# The 15 slowest tests are printed at the end.
#
# worksteal hands each worker a contiguous half of the collected tests (so a module's fixtures are
# mostly built once) and lets an idle worker take half of what the other has left: the few long
# tests (multi-process launches, the docs' pages) do not leave one core idle at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
workers=$(nproc 2>/dev/null || echo 2)
select=()
if [ "${1:-}" = "--quick" ]; then
  shift
  select=(-m "not slow")
fi
exec .venv/bin/python -m pytest -q -n "$workers" --dist worksteal --durations=15 ${select[@]+"${select[@]}"} "$@"
