#!/usr/bin/env bash
# The wheels a lent GPU machine lacks, fetched here into .whl/ (ignored by git) for tools/gpu_measure.sh and
# tools/gpu_check.sh, which install them first. The GPU machine's image has torch 2.11, transformers 5.17 and no
# diffusers (/work/.library/device/KINDS.md); GLM-Image needs transformers 5.24 and diffusers 0.42.1, and LoRA peft.
# Its huggingface_hub, tokenizers, safetensors and accelerate already satisfy these (checked against their
# Requires-Dist). Python 3.12 x86-64 wheels, whatever this machine is; about 21 MB in all.
#   bash tools/gpu_wheels.sh          then, in the device call: carry [".whl"]
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl transformers==5.24.0 diffusers==0.42.1 peft==0.21.2 regex==2026.11.19
ls -1 .whl
du -sh .whl
