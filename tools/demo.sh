#!/usr/bin/env bash
# Set up the environment if needed, pack a real local corpus (Wikipedia from ../shared/data) and
# stream batches from it, printing a summary. Runs offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
exec .venv/bin/python examples/quickstart.py "$@"
