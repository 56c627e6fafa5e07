#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv, offline-safe.
# torch is pinned to 2.13.0: that version installs from a local CPU wheel on our machines;
# any other spec downloads gigabytes of CUDA packages.
# Azurite (the Azure blob emulator of the az:// tests) comes from npm when node is present; it is
# installed under .venv/node_modules, and the Azure tests skip, saying why, without it.
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
  # torch and the loader (the `torch` extra), the integrations' libraries (in `test`), the cloud
  # clients (`cloud`), all at the pinned torch: tools/constraints.txt keeps any of them from pulling
  # another torch, and keeps pip from backtracking over the boto3/botocore/aiobotocore versions
  .venv/bin/python -m pip install --quiet -c tools/constraints.txt -e ".[torch,test,cloud,plot]"
  # torchtitan (the `torchtitan` extra), without its dependencies: its pin datasets<4.8 asks for an fsspec
  # older than the cloud stack's; what it imports comes with the test extra (pyproject.toml)
  if .venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    .venv/bin/python -m pip install --quiet --no-deps "torchtitan==0.3.0"
  fi
  if command -v npm >/dev/null 2>&1 && command -v node >/dev/null 2>&1; then
    npm install --silent --no-audit --no-fund --prefix .venv azurite@3 >/dev/null 2>&1 \
      || echo "setup.sh: npm install azurite failed; the az:// tests will skip" >&2
  fi
  echo "$want" > "$stamp"
fi
