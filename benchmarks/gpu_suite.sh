#!/usr/bin/env bash
# The GPU suite on one NVIDIA GPU, ~8 minutes, no network: writes benchmarks/results/gpu_suite.json and prints
# a table (benchmarks/gpu_suite.py says what it runs and how it measures).
#
#   bash benchmarks/gpu_suite.sh                 # all cases
#   bash benchmarks/gpu_suite.sh --cases fusion_eager,strategy_fsdp
#   bash benchmarks/gpu_suite.sh --dry-run       # CPU, tiny shapes: checks the suite itself
#
# The GPU machine has torch, torchvision, transformers, tokenizers, pyarrow, pandas, ... but not deepspeed,
# datasets, hjson, pydantic, dill or multiprocess. Carry them as wheels in .whl/ (git-ignored), made on a
# machine with network (deepspeed publishes no wheel, only an sdist: build a pure-Python one, no ops):
#
#   echo /.whl/ >> .git/info/exclude
#   PLAT="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
#   python3 -m pip download --no-deps --only-binary=:all: $PLAT -d .whl datasets==5.2.0 dill==0.4.1 \
#       multiprocess==0.70.19 hjson==3.1.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
#       typing-inspection==0.4.5 transformers==5.24.0 tokenizers==0.23.3
#   DS_BUILD_OPS=0 python3 -m pip wheel --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
#
# transformers 5.24 (the version shardtrain is tested with) because the image's 5.17 may lack
# transformers.initialization.no_init_weights, which the ZeRO-3 setup uses. Everything in .whl/ is installed
# into /tmp/site; without deepspeed the ZeRO cases fail (and say so in the JSON), the others still run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! PYTHONPATH=${PYTHONPATH:-} "$PY" -c "import deepspeed, datasets" 2>/dev/null; then
    echo "gpu_suite: deepspeed and/or datasets missing: carry them in .whl/ (see the top of $0)" >&2
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
# 8 minutes in all: the driver stops starting cases at --budget-s (default 450 s); this is the hard stop.
exec timeout 480 "$PY" benchmarks/gpu_suite.py "$@"
