#!/usr/bin/env bash
# Issue 59's GPU measurement as one script for a lent H100 / H200 (at most 8 minutes from a fresh machine):
#   1. the carried wheels installed (.whl/, made here by `bash tools/gpu_wheels.sh`; the device call carries [".whl"]);
#   2. tools/gpu_measure.py: 3 real-default steps of grpo.main on GLM-Image at full depth (random bf16 weights),
#      then 2 with --num-inference-steps 20: phase seconds, peak GiB beside the plan, ms a token step, the bf16 drift;
#   3. the CUDA tests that decide exactness: test_grpo.py and tests/test_fast_decode.py (GRPO_TEST_DEVICE=cuda).
# Everything lands in the results folder ($OUT on the device machine, else runs/gpu_measure): measure.md, measure.json,
# each run's metrics.jsonl, the tests' log and gpu.txt.
#   bash tools/gpu_measure.sh                                        # on the GPU
#   MODEL=random:2 SIZE=256 STEPS=2 SHORT_STEPS=1 DIT=2 SHORT_DIT=1 MEASURE_SECONDS=1500 TESTS="-k copied_alone" \
#     bash tools/gpu_measure.sh                                      # a dry run of the plumbing on a CPU
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_measure}; mkdir -p "$OUT"
began=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"
  python3 -c "import torch, transformers, diffusers; print(torch.__version__, transformers.__version__, diffusers.__version__)" 2>&1 | tail -1
} | tee "$OUT/gpu.txt"
grep -q Error "$OUT/gpu.txt" && { echo "gpu_measure: cannot import torch, transformers or diffusers (the line above); for the two last: run 'bash tools/gpu_wheels.sh' where pip works and carry .whl"; exit 2; }
timeout "${MEASURE_SECONDS:-330}" python3 tools/gpu_measure.py "$OUT" --model "${MODEL:-random}" --size "${SIZE:-1024}" \
  --steps "${STEPS:-3}" --short-steps "${SHORT_STEPS:-2}" --dit "${DIT:-0}" --short-dit "${SHORT_DIT:-20}" 2>&1 | grep -v "it/s\]" | tee "$OUT/measure.log" | tail -80
device=$([ -z "${MODEL:-}" ] && echo cuda || echo "${GRPO_TEST_DEVICE:-cpu}")
left=$(( ${BUDGET:-470} - ($(date +%s) - began) ))  # the tests get what is left of the 8 minutes (at least 60 s)
[ "$left" -lt 60 ] && left=60
# shellcheck disable=SC2086
GRPO_TEST_DEVICE=$device timeout "$left" python3 -m pytest -q -p no:cacheprovider --durations=10 -W ignore::FutureWarning \
  test_grpo.py tests/test_fast_decode.py tests/test_parallel.py ${TESTS:-} 2>&1 | tee "$OUT/cuda_tests.txt" | tail -25
echo "gpu_measure: $(( $(date +%s) - began )) s in all; results in $OUT"
