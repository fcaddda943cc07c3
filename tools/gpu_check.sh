#!/usr/bin/env bash
# The GPU checks as one script (a lent H100/H200, minutes): the DiT's denoising step measured
# (tools/bench_dit_step.py), then every test file on CUDA (GRPO_TEST_DEVICE=cuda; test_notebook.py runs the notebook
# on the CPU and needs Jupyter, which the GPU machine lacks). Logs go to $OUT (or runs/gpu_check).
#   bash tools/gpu_check.sh [seconds for the tests, default 330]      (BENCH=0: skip the measurement)
# Wheels in .whl/ (transformers, diffusers, peft, regex: `bash tools/gpu_wheels.sh` fetches them) are installed first when
# present; the device call carries [".whl"].
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, diffusers; print(torch.__version__, transformers.__version__, diffusers.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${BENCH:-1}" != 0 ]; then  # BENCH=0: the tests only
  timeout 150 python3 tools/bench_dit_step.py 2>&1 | grep -v Warning | tee "$OUT/bench_dit_step.txt"
fi
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8" || echo "")
GRPO_TEST_DEVICE=cuda timeout "${1:-330}" python3 -m pytest -q -p no:cacheprovider $workers --durations=12 \
  --ignore tests/test_notebook.py -W ignore::FutureWarning tests 2>&1 | tee "$OUT/cuda_tests.txt" | tail -60
