#!/usr/bin/env bash
# The figures only a GPU machine can give (issue #44), as one short command, in minutes:
#
#   1. tools/bench_gpu.py: a training loop fed by wdsllm.loader against batches already on the GPU
#      (the ~124M and ~10M models; the goal: fed/synthetic >= 0.98 and >= 0.95);
#   2. tests/test_nccl.py: every collective the loader makes, over NCCL;
#   3. tools/bench_load.py --workers 0,1,2,4,8 --ranks 8: workers that scale with the machine's cores,
#      and 8 ranks at once (one process per rank, 1 worker each).
#
#   tools/gpu_check.sh [OUT_DIR]        # results: OUT_DIR (default $OUT, else bench-out/gpu-check)
#
# The data is the wiki corpus in docs mode as bench_load.py packs it (bench-out/wiki-docs, 27 MB): on a
# machine without ../shared/data, pack it where the corpus is and bring the folder along:
#   python -c "import sys; sys.path.insert(0, 'tools'); import bench_load; bench_load.pack_corpus('bench-out', False, 'docs')"
# PYTHON: the interpreter (default .venv/bin/python, else python3) with torch (CUDA), numpy, webdataset and
# xxhash. Each step runs even when an earlier one failed; the exit status is the number of steps that
# failed. Then put the tables in docs/benchmarks.md with the machine named.
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-bench-out/gpu-check}}"
mkdir -p "$OUT_DIR"
PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
failed=0

step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, output to OUT_DIR/NAME.log and the terminal
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*" | tee "$OUT_DIR/$name.log"
    local began=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$OUT_DIR/$name.log"
    local status=${PIPESTATUS[0]}
    echo "== $name: exit $status after $((SECONDS - began)) s" | tee -a "$OUT_DIR/$name.log"
    [ "$status" -eq 0 ] || failed=$((failed + 1))
}

{
    echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"
    echo "cores: $(nproc); memory: $(free -g | awk '/Mem:/ {print $2}') GiB"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || echo "no nvidia-smi"
    "$PYTHON" -c "import torch, numpy; print('python', __import__('sys').version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), 'nccl', torch.distributed.is_nccl_available())"
    git log -1 --format='commit %h %s' 2>/dev/null | cut -c1-120
} 2>&1 | tee "$OUT_DIR/machine.txt"

step bench_gpu 300 "$PYTHON" tools/bench_gpu.py --json "$OUT_DIR/bench_gpu.json"
step nccl 240 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_nccl.py -k over_nccl
step scaling 420 "$PYTHON" tools/bench_load.py --workers 0,1,2,4,8 --ranks 8 --repeat 3 --scaling docs,pack \
    --json "$OUT_DIR/scaling.json"

echo "== done: $failed step(s) failed; logs and JSON in $OUT_DIR"
exit "$failed"
