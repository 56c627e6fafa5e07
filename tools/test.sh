#!/usr/bin/env bash
# Set up the environment if needed, then run the whole test suite (CI runs this); `-m "not slow"`
# runs the quick one (tests/conftest.py SLOW_TESTS lists what it leaves out).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
exec .venv/bin/python -m pytest tests -q --durations=25 "$@"
