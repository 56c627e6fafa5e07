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
want=$(cat pyproject.toml tools/setup.sh tools/constraints.txt | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
  # torch and the loader (the `torch` extra), the integrations' libraries (in `test`), all at the
  # pinned torch: tools/constraints.txt keeps any of them from pulling another torch
  .venv/bin/python -m pip install --quiet -c tools/constraints.txt -e ".[torch,test,s3,plot]"
  echo "$want" > "$stamp"
fi
