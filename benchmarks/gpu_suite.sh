#!/usr/bin/env bash
# The GPU suite on one NVIDIA GPU, no network: benchmarks/gpu_suite.py says what it runs and how it measures.
# The result JSON is rewritten after every case, at --out (on a lent machine: under $OUT, so it comes back).
#
#   bash benchmarks/gpu_suite.sh --out "$OUT/gpu_suite.json" --work /tmp/gpu-suite
#   bash benchmarks/gpu_suite.sh --out r.json --work /tmp/w --cases fp16_ddp_grad_scaler,strategy_fsdp
#   bash benchmarks/gpu_suite.sh --out r.json --work /tmp/w --budget-s 200 --case-timeout-s 180
#
# Wheels the GPU machine lacks are installed from .whl/ when it holds any (docs/performance.md, "GPU suite",
# lists them and the pip lines that make them); the driver's preflight then names any package still missing.
# The hard stop is --budget-s (no case starts after it) + --case-timeout-s (the longest a case may run) + 30 s,
# so the last case that starts can finish and be written.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
budget=300 case_timeout=240 dry=0
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
        --budget-s) budget=${args[i + 1]} ;;
        --budget-s=*) budget=${args[i]#*=} ;;
        --case-timeout-s) case_timeout=${args[i + 1]} ;;
        --case-timeout-s=*) case_timeout=${args[i]#*=} ;;
        --dry-run) dry=1 ;;
    esac
done
# The wheels are the GPU machine's (Python 3.12): a CPU dry run here uses this machine's own packages.
if [ "$dry" = 0 ] && compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
hard_stop=$(( ${budget%.*} + ${case_timeout%.*} + 30 ))
echo "gpu_suite: budget ${budget} s, case timeout ${case_timeout} s, hard stop ${hard_stop} s"
exec timeout "$hard_stop" "$PY" benchmarks/gpu_suite.py --budget-s "$budget" --case-timeout-s "$case_timeout" "$@"
