#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv, offline-safe.
# torch is pinned to 2.13.0: that version installs from a local CPU wheel on our machines;
# any other spec downloads gigabytes of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.wdsllm-installed
want=$(cat pyproject.toml tools/setup.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
  .venv/bin/python -m pip install --quiet -e ".[test,s3,plot]"
  echo "$want" > "$stamp"
fi
