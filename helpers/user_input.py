"""The edges of a run: every reader of what a user makes, each with its rule. What enters here is checked before
anything is written, and a problem is a ValueError whose message names the file (and line), the flag or the reward,
and the fix; helpers/run.py turns it into one line on stderr and exit 2.

  prompts files  (read_prompts)  UTF-8, with or without a byte-order mark (UTF-16 with one too, as Windows' tools
                 write it); a line ends at \\n, \\r\\n or \\r and nowhere else (not at U+2028, U+2029, U+0085, \\v, \\f
                 or \\x1c-\\x1e, where Python's str.splitlines also splits: a caption pasted from a web page may hold
                 them); a file whose first line is a JSON object is JSON Lines whatever its name, and a JSON object
                 is never trained on as a caption.
  images         (load_image)  as a viewer shows them: the EXIF orientation applied (a phone's JPEG stands upright);
                 16-bit and 32-bit pixels scaled by their range, not clipped; transparent pixels shown over white, as a
                 web page shows them; every mode Pillow opens, or one line naming the mode. What a person would see
                 differently (a resize, the white behind transparency, the first frame of an animation, a range
                 stretched) is said in one line.
  rewards        (parse_rewards, guarded)  each reward gets its own copy of the images and of the example, runs
                 without autograd, and its return becomes a (G,) float32 tensor on the images' device: a (G,) or
                 (G, 1) tensor, numpy array or list of G numbers is taken as it is; anything else (one number for G
                 images, another length or shape, text) is one line naming the reward.
  numbers        (RULES, check_numbers)  every numeric flag and config key has a rule here, which the check and
                 --help both read: finite, and in the range of what it means.
  config files   (read_config_file)  YAML or JSON read as the prompts files are (a BOM, any line ends), each value of
                 its flag's type, each key once (a key given twice is refused: which one wins is the parser's
                 accident); a path in it is relative to the file's own folder, as a path on the command line is
                 relative to the working directory (config_paths); a syntax error keeps what was found and where.
"""

import copy
import dataclasses
import functools
import json
import math
import re
import sys
import traceback
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image, ImageOps

from .rewards import CheckpointError, exit_call, import_reward, with_checkpoint
from .served_reward import ServedReward, ServedRewardError, is_url


# ---- Text files: prompts files and config files ----------------------------------------------------

LINE_END = re.compile(r"\r\n|\r|\n")  # the line ends editors write; str.splitlines also splits at \v, \f,
# \x1c-\x1e, U+0085, U+2028 and U+2029, which a caption may hold


def read_text(path: str | Path, flag: str, fix: str) -> str:
    """The text of a user's file: UTF-8 with or without a byte-order mark, or UTF-16 with one (PowerShell's `>`
    writes it). A NUL byte is refused: no caption holds one, and UTF-16 saved without a byte-order mark is valid UTF-8
    when its text is ASCII ("a\\0 \\0r\\0..."), so it would otherwise be read as captions laced with NULs.
    Raises ValueError naming `flag`, the file, the line of a NUL or of a byte that is not UTF-8, and `fix`."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        reason = "a directory" if path.is_dir() else error.strerror or str(error)
        raise ValueError(f"cannot read {flag} {path} ({reason}); {fix}") from None
    nul = "holds a NUL: UTF-16 without a byte-order mark, UTF-32, or not a text file; save it as UTF-8"
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):  # UTF-16's byte-order marks
        try:
            text = data.decode("utf-16")
        except UnicodeDecodeError:
            raise ValueError(f"{flag} {path} starts as UTF-16 and is not; save it as UTF-8") from None
    else:
        if b"\0" in data:  # before decoding: a BOM-less UTF-16 file with an "é" is not UTF-8 either, and this says why
            line = data[:data.index(b"\0")].count(b"\n") + 1
            raise ValueError(f"{flag} {path}:{line} {nul}")
        try:
            text = data.decode("utf-8-sig")  # the BOM, if any, dropped
        except UnicodeDecodeError as error:
            line = data[:error.start].count(b"\n") + 1
            raise ValueError(f"{flag} {path}:{line} is not UTF-8 text (byte 0x{data[error.start]:02x}); save the "
                             "file as UTF-8") from None
    if "\0" in text:  # UTF-32 read as UTF-16 (its byte-order mark starts as UTF-16's)
        line = text[:text.index("\0")].count("\n") + 1
        raise ValueError(f"{flag} {path}:{line} {nul}")
    return text


def text_lines(text: str) -> list[str]:
    """The lines of `text`, split at \\n, \\r\\n and \\r only (LINE_END); no line ends in one."""
    lines = LINE_END.split(text)
    return lines[:-1] if lines and lines[-1] == "" else lines


# ---- Prompts files ------------------------------------------------------------------------------

JSONL_EXAMPLE = '{"prompt": "make it night", "target": "night.png", "source": "day.png"}'


def read_prompts(path: str | Path, flag: str = "--prompts") -> list[dict]:
    """A prompts file -> examples: dicts with "prompt", "target" and "source" (image paths or None), "text" (the
    text the image should show, or None), "where" (file:line, for messages) and any other fields of a JSON line.

    Text: 'prompt | target.png' per line (split at the last '|'), or a prompt alone (no target). JSON Lines (a .jsonl
    file, or any file whose first line is a JSON object): one object per line, {"prompt": "make it night", "target":
    "night.png", "source": "day.png"}; "target" and "source" (an image to edit) are optional. Paths are relative to
    the prompts file (~ is your home). "text" is the JSON field, else the text in quotes in the prompt (GLM-Image's
    convention: its glyph encoder renders quoted text). Blank lines and '#' comments are skipped; a caption is
    otherwise kept as written (its ends stripped). Raises ValueError naming the file and line (and `flag`).
    """
    path = Path(path)
    lines = text_lines(read_text(path, flag, "give a text file of 'prompt | target.png' lines or a .jsonl file"))
    content = [(number, line.strip()) for number, line in enumerate(lines, start=1)
               if line.strip() and not line.strip().startswith("#")]
    json_lines = path.suffix.lower() in (".jsonl", ".ndjson") or (bool(content) and is_json_object(content[0][1]))
    if not json_lines and content and content[0][1][0] in "[{":
        one_document(path, lines, flag)
    examples = []
    for number, line in content:
        where = f"{path}:{number}"
        fields = read_jsonl_line(line, where) if json_lines else read_text_line(line, where)
        quoted = " ".join(a or b for a, b in re.findall(r'"([^"]+)"|“([^”]+)”', fields["prompt"]))
        paths = {key: path.parent / Path(fields[key]).expanduser() if fields.get(key) else None
                 for key in ("target", "source")}
        examples.append({**fields, "text": fields.get("text") or quoted or None, "where": where, **paths})
    if not examples:
        raise ValueError(f"{flag} {path} has no examples; add lines of the form 'prompt | target.png'")
    return examples


def is_json_object(line: str) -> bool:
    """Whether a line is a JSON object (the mark of a JSON Lines file, and never a caption)."""
    if not line.startswith("{"):
        return False
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def one_document(path: Path, lines: list[str], flag: str) -> None:
    """Refuse a file that is one JSON document over several lines (a .json list of examples): read as lines, its
    brackets would be trained on as captions."""
    try:
        json.loads("\n".join(lines))
    except json.JSONDecodeError:
        return
    raise ValueError(f"{flag} {path} is one JSON document; write one example per line (JSON Lines), e.g. "
                     f"{JSONL_EXAMPLE}")


def read_text_line(line: str, where: str) -> dict:
    """'prompt | target.png' or a prompt alone -> {"prompt", "target"}. A JSON object is refused: the file's first
    line made it a text file."""
    if is_json_object(line):
        raise ValueError(f"{where}: a JSON object in a file whose first line is text; write every line as JSON "
                         f"(JSON Lines, e.g. {JSONL_EXAMPLE}) or as 'prompt | target.png'")
    prompt, bar, target = (part.strip() for part in line.rpartition("|"))
    if bar and not (prompt and target):
        raise ValueError(f"{where}: expected 'prompt | target.png' or a prompt alone, got '{line}'")
    return {"prompt": prompt, "target": target} if bar else {"prompt": line}


def read_jsonl_line(line: str, where: str) -> dict:
    """One JSON object with a "prompt" string and optional "target", "source", "text" strings -> that dict."""
    try:
        fields = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not JSON ({error.msg}); in a JSON Lines file write one object per line, e.g. "
                         f"{JSONL_EXAMPLE}") from None
    if not isinstance(fields, dict) or not isinstance(fields.get("prompt"), str) or not fields["prompt"].strip():
        raise ValueError(f'{where}: needs a "prompt" string, e.g. {JSONL_EXAMPLE}')
    for key in ("target", "source", "text"):
        if fields.get(key) is not None and not (isinstance(fields[key], str) and fields[key].strip()):
            raise ValueError(f'{where}: "{key}" must be a non-empty string, e.g. {JSONL_EXAMPLE}')
    return {**fields, "prompt": fields["prompt"].strip()}


# ---- Images ---------------------------------------------------------------------------------------

SIXTEEN_BITS = ("I;16", "I;16L", "I;16B", "I;16N")  # Pillow's modes of 16-bit gray pixels (a 16-bit PNG's)
ALPHA = ("RGBA", "LA", "La", "RGBa", "PA")  # modes with a transparency channel; "P" may carry one in its info


def read_image(path: str | Path, role: str = "target") -> tuple[np.ndarray, list[str]]:
    """An image file -> (H, W, 3) float32 RGB in [0, 1], as a viewer shows it, and what a person would see
    differently, in words (empty for an 8-bit RGB picture):
    - the EXIF orientation is applied (ImageOps.exif_transpose), as viewers and diffusers' training scripts do;
    - 16-bit gray (I;16) is divided by 65535; 32-bit integers (I) by 65535 when they fit 16 bits (Pillow reads some
      16-bit files so), else stretched from their minimum to their maximum (said); 32-bit floats (F) are kept when
      in [0, 1], else stretched (said); NaN or inf is refused;
    - transparency (RGBA, LA, P with a transparent colour, ...) is composited over white, as a web page shows the
      picture (said when a pixel is not opaque);
    - gray, 1-bit, palette, CMYK and YCbCr become RGB as Pillow converts them; an animation gives its first frame
      (said).
    Raises ValueError for a missing or unreadable file, or a mode with no RGB (LAB, HSV: save it as RGB)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{role} {path} does not exist; fix its path in the prompts file")
    try:
        with Image.open(path) as opened:
            notes = [f"{role} {path} has {opened.n_frames} frames; the first is used"] if getattr(
                opened, "n_frames", 1) > 1 else []
            image = ImageOps.exif_transpose(opened)  # a copy, upright
            pixels, more = rgb_pixels(image)
    except (OSError, Image.DecompressionBombError, SyntaxError) as error:  # SyntaxError: Pillow's broken headers
        raise ValueError(f"{role} {path} is not a readable image ({error}); replace it or fix the prompts file")
    except ValueError as error:
        raise ValueError(f"{role} {path}: {error}") from None
    return pixels, notes + [f"{role} {path}: {note}" for note in more]


def rgb_pixels(image: Image.Image) -> tuple[np.ndarray, list[str]]:
    """A Pillow image of any mode -> (H, W, 3) float32 in [0, 1] and notes (read_image's rules)."""
    if image.mode in (*SIXTEEN_BITS, "I", "F"):
        gray, notes = high_range(np.asarray(image).astype(np.float64), image.mode)
        return np.repeat(gray[..., None], 3, axis=-1).astype(np.float32), notes
    if image.mode in ("LAB", "HSV"):
        raise ValueError(f"its mode {image.mode} has no RGB conversion here; save it as an RGB PNG")
    if image.mode in ALPHA or "transparency" in image.info:
        rgba = np.asarray(image.convert("RGBA"), dtype=np.float32) / 255  # (H, W, 4)
        alpha = rgba[..., 3:]
        notes = ["transparent pixels are shown over white"] if (alpha < 1).any() else []
        return rgba[..., :3] * alpha + (1 - alpha), notes  # over white: a web page's background
    return np.asarray(image.convert("RGB"), dtype=np.float32) / 255, []


def high_range(values: np.ndarray, mode: str) -> tuple[np.ndarray, list[str]]:
    """16- and 32-bit gray pixels (float64) -> [0, 1] by their range, and a note when they had to be stretched."""
    if not np.isfinite(values).all():
        raise ValueError("its pixels hold NaN or inf; save a picture of finite values")
    low, high = values.min(), values.max()
    if mode in SIXTEEN_BITS or (mode == "I" and low >= 0 and high <= 65535):
        return values / 65535, []
    if mode == "F" and low >= 0 and high <= 1:
        return values, []
    spread = high - low if high > low else 1.0
    return (values - low) / spread, [f"its {mode} pixels span [{low:g}, {high:g}]; stretched to [0, 1]"]


def load_image(path: str | Path, height: int, width: int, role: str = "target") -> torch.Tensor:
    """An image file -> (3, H, W) float32 in [0, 1], as a viewer shows it (read_image), resized (bicubic, in float)
    when its size differs. What a person would see differently is one note line on stderr each. Raises ValueError
    for a missing or unreadable image."""
    pixels, notes = read_image(path, role)  # (h, w, 3)
    if pixels.shape[:2] != (height, width):
        notes.append(f"{role} {path} is {pixels.shape[1]}x{pixels.shape[0]}, resized to {width}x{height}")
        channels = [Image.fromarray(pixels[..., c], "F").resize((width, height), Image.BICUBIC) for c in range(3)]
        pixels = np.clip(np.stack([np.asarray(c) for c in channels], axis=-1), 0, 1)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1).contiguous()  # (3, H, W)


def load_examples(examples: list[dict], rewards: dict, height: int, width: int) -> list[dict]:
    """Check that every reward has the fields it needs in every example, read the images ("target" and "source"
    become (3, H, W) float32 tensors in [0, 1]: load_image), then run each reward's own check on the example as the
    reward will see it. Raises ValueError naming the prompts line."""
    loaded = []
    for example in examples:
        for role in ("target", "source"):  # before the rewards' own checks, which may open the files
            if example[role] is not None and not Path(example[role]).is_file():
                raise ValueError(f"{example['where']}: {role} {example[role]} does not exist; fix its path in the "
                                 "prompts file")
        for name, (fn, _) in rewards.items():
            for field in getattr(fn, "needs", ()):
                if example.get(field) is None:
                    raise ValueError(f"{example['where']}: reward '{name}' needs a {field} and this example has none; "
                                     f"add one, or leave '{name}' out of --reward")
        try:
            images = {role: load_image(example[role], height, width, role)
                      for role in ("target", "source") if example[role] is not None}
        except ValueError as error:
            raise ValueError(f"{example['where']}: {error}") from None  # name the prompts line
        for name, (fn, _) in rewards.items():  # on the example as the reward will see it: its images loaded
            problem = (getattr(fn, "check", None) or (lambda _: None))({**example, **images})
            if problem:
                raise ValueError(f"{example['where']}: reward '{name}': {problem}")
        loaded.append({**example, **images})
    return loaded


# ---- The files a run reads: a resumed run reads the same ones --------------------------------------

def input_files(cfg) -> list[Path]:
    """Every file a run reads, absolute: the prompts file with its targets and sources, the --eval-prompts file with
    its, each reward file of --reward and --eval-reward (path/to/file.py:function). Call it on a config whose paths are
    absolute (relative ones are the working directory's)."""
    files = []
    for path, flag in ((cfg.prompts, "--prompts"), (getattr(cfg, "eval_prompts", ""), "--eval-prompts")):
        if path:
            files.append(Path(path).absolute())
            files += [Path(e[role]).absolute() for e in read_prompts(path, flag) for role in ("target", "source")
                      if e[role] is not None]
    for spec in (cfg.reward, getattr(cfg, "eval_reward", "")):
        for part in spec.split(",") if spec else ():
            name = split_reward(part)[0]
            if ".py:" in name and not is_url(name):
                files.append(Path(name.rpartition(":")[0].strip()).expanduser().absolute())
    return list(dict.fromkeys(files))


def file_digest(path: Path) -> str:
    """The sha256 of a file's bytes (hex)."""
    import hashlib
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def input_digests(cfg) -> dict[str, str]:
    """{absolute path: sha256} of every file the run reads (input_files): what a resume checks it reads again."""
    return {str(path): file_digest(path) for path in input_files(cfg)}


def changed_inputs(saved: dict[str, str]) -> str | None:
    """The first file of a run's saved digests that is gone or changed since, in words ('prompts.txt changed'); None
    when every one is as the run read it."""
    for path, digest in saved.items():
        if not Path(path).is_file():
            return f"{path} no longer exists"
        if file_digest(Path(path)) != digest:
            return f"{path} changed"
    return None


# ---- Rewards: the spec, and the functions' rule -------------------------------------------------

class RewardError(ValueError):
    """A reward that raised, or returned what is not one score per image: its name, what went wrong, the traceback."""

    def __init__(self, name: str, problem: str, details: str = "", where: str | None = None):
        super().__init__(f"reward '{name}' {problem}")
        self.reward, self.details, self.where = name, details, where  # where: the example's file:line


def parse_rewards(spec: str, table: dict, flag: str = "--reward", timeout: float = 600.0,
                  base: Path | None = None, wait: float = 0.0, served: dict | None = None) -> dict[str, tuple]:
    """'ssim=1,ocr=0.5,pickscore@yuvalkirstain/PickScore_v1=1,mypkg.rewards:clip=1' -> {name: (fn, weight)} (a name
    alone weighs 1): names of `table` (grpo.REWARDS; a learned one may name its checkpoint after @), import paths
    module:function (found like `python -m` finds modules: installed, or in the current directory) or
    path/to/file.py:function, or the URL of a served reward, http://HOST:PORT/NAME (helpers/served_reward.py;
    `timeout`: the seconds a try may take; `wait`: those its first answer may take to come), each `guarded`. `base`: the directory its relative paths (a reward file, a
    module beside it, a checkpoint folder) are relative to, when it is not the current one (a resume from elsewhere:
    the run's own start directory); the names stay as written, the metrics' names. `served`: {a served reward's URL:
    where it is served now}, for a server that moved since the run started.
    Every reward listed is computed and logged; weight 0 only keeps it out of the sum. Raises ValueError naming the
    problem."""
    rewards = {}
    for part in spec.split(","):
        name, where, weight = split_reward(part, flag)
        if name in rewards:
            raise ValueError(f"reward '{name}' is listed twice in {flag} '{spec}'; list it once")
        found, where = split_reward(reward_paths(part, base), flag)[:2] if base else (name, where)
        fn = (ServedReward(name, timeout, wait, (served or {}).get(name)) if is_url(name)
              else import_reward(found, flag, base) if ":" in name else table.get(name))
        if fn is None:
            raise ValueError(f"unknown reward '{name}' in {flag} '{spec}'; use {', '.join(table)}, module:function "
                             "or path/to/file.py:function")
        if where is not None:
            fn = with_checkpoint(name, fn, where)
        rewards[name] = (guarded(name, fn), weight)
    if sum(w for _, w in rewards.values()) <= 0:
        raise ValueError(f"{flag} '{spec}' gives every reward weight 0; give at least one a positive weight")
    return rewards


def split_reward(part: str, flag: str = "--reward") -> tuple[str, str | None, float]:
    """One entry of --reward, 'name@where=weight' -> (name, where, weight): `where` None without an @ (a learned
    reward's checkpoint, or the ocr reward's languages; a URL or a path/to/file.py:function keeps its '@'); a name
    alone weighs 1. Raises ValueError for a weight that is not a finite number >= 0."""
    name, _, value = (x.strip() for x in part.rpartition("=")) if "=" in part else (part.strip(), "", "")
    try:
        weight = float(value) if "=" in part else 1.0
    except ValueError:
        raise ValueError(f"reward weight '{part}' is not name=number; write e.g. {flag} ssim=1,mse=0") from None
    if not (math.isfinite(weight) and weight >= 0):
        raise ValueError(f"reward weight '{part}' in {flag} is {'negative' if weight < 0 else 'not finite'}; weights "
                         "must be finite numbers >= 0")
    if is_url(name) or ".py:" in name:  # a served reward's URL, a file's path: an '@' is theirs
        return name, None, weight
    name, at, where = name.partition("@")
    return name, where.strip() if at else None, weight


def reward_weights(spec: str) -> dict[str, float]:
    """--reward's weights by reward name (parse_rewards checked the spec before the run started)."""
    return {name: weight for name, _, weight in map(split_reward, spec.split(","))}


def guarded(name: str, fn):
    """The reward `fn` as a run calls it: it can change training only through its scores.
    - It gets its own copy of the (G, 3, H, W) images and of the example (target, source, every field), so that an
      in-place change (images.sub_(0.5), example["target"] *= 2) reaches neither the other rewards nor a later step.
    - It runs under torch.no_grad(), and its scores are detached: a reward computed by a trainable module builds no
      graph, so the GRPO loss never backpropagates into it.
    - Its return becomes `scores`' (G,) float32 tensor on the images' device, a copy: a buffer the reward reuses from
      group to group changes no group's scores after they are returned.
    An exception it raises, or a sys.exit, becomes a RewardError naming it, with the traceback kept for the run's
    error file. The
    function's own attributes (needs, check) stay; `guarded(...).__wrapped__` is `fn`."""
    @functools.wraps(fn)
    def reward(images: torch.Tensor, example: dict) -> torch.Tensor:
        try:
            with torch.no_grad():
                value = fn(images.clone(), copy.deepcopy(example))
        except (ImportError, CheckpointError):  # a missing package, a checkpoint that does not load: their own line
            raise
        except ServedRewardError as error:  # a served reward's fault: its own line (helpers/served_reward.py)
            raise RewardError(name, str(error), traceback.format_exc(), example.get("where")) from error
        except Exception as error:
            raise RewardError(name, f"raised {type(error).__name__}: {first_line(error)}", traceback.format_exc(),
                              example.get("where")) from error
        except SystemExit as error:  # sys.exit, or argparse's parse_args() inside the reward
            raise RewardError(name, f"exited ({exit_call(error)}) instead of returning scores",
                              traceback.format_exc(), example.get("where")) from None
        try:
            return scores(value, len(images), name, images.device)
        except RewardError as error:
            error.where = example.get("where")
            raise
    return reward


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"


def scores(value, n: int, name: str, device) -> torch.Tensor:
    """A reward's return for `n` images -> (n,) float32 on `device`, detached. Taken as they are: a tensor or numpy
    array of shape (n,), (n, 1) or (1, n), of floats, integers or booleans; a list or tuple of n numbers (or of
    one-element tensors). Always a copy, never the reward's own memory. Refused with a RewardError naming the reward: one number for n images, another number of
    values, another shape, a type that is not numbers."""
    what = type(value).__name__
    if isinstance(value, (list, tuple)):
        try:
            value = torch.stack([torch.as_tensor(v).detach().cpu().reshape(()) for v in value]) if value else []
        except (TypeError, RuntimeError, ValueError):
            raise RewardError(name, f"returned a {what} of {', '.join(sorted({type(v).__name__ for v in value}))}; "
                                    f"return one number per image, a ({n},) tensor") from None
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        value = torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, (int, float, np.number)) or (torch.is_tensor(value) and value.dim() == 0):
        raise RewardError(name, f"returned one number for {n} images; return one per image, a ({n},) tensor")
    if not torch.is_tensor(value) or value.is_complex() or not (value.is_floating_point() or value.dtype in (
            torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)):
        kind = f"{what} of {value.dtype}" if torch.is_tensor(value) or isinstance(value, np.ndarray) else what
        raise RewardError(name, f"returned a {kind}; return one number per image, a ({n},) float tensor")
    shape = tuple(value.shape)
    if shape not in ((n,), (n, 1), (1, n)):
        raise RewardError(name, f"returned shape {shape} for {n} images; return one score per image, a ({n},) "
                                "tensor")
    # a copy, never the reward's own memory: a reward that writes every group's scores into one buffer (out=, a
    # numpy array it keeps) would otherwise hand every group the last group's scores (group_rewards stacks them last)
    return value.detach().reshape(n).to(device=device, dtype=torch.float32, copy=True)


def check_rewards(rewards: dict, example: dict, height: int, width: int) -> None:
    """Call every reward once on three gray images (an odd number: a reward that returns 2 or 4 values whatever it is
    given shows), so that a missing package, an error or a wrong return stops the run before anything is written
    (ValueError)."""
    for name, (fn, _) in rewards.items():
        try:
            fn(torch.full((3, 3, height, width), 0.5), example)
        except ImportError as error:  # an optional package (e.g. EasyOCR for ocr): the message says what to install
            raise ValueError(f"reward '{name}': {error}") from None
        except CheckpointError:  # a learned reward's checkpoint that does not load: its own line names the fix
            raise
        except RewardError as error:
            raise ValueError(f"{error} on three gray test images") from None


# ---- Numbers: a rule per numeric flag -----------------------------------------------------------

class Rule(NamedTuple):
    """What a numeric setting may be: finite, from `low` and up to `high` (None: no bound), each bound included
    unless `open` names it ("low", "high" or "both"); `multiple`: a multiple of it; `why`: said with a refusal."""
    low: float | None = None
    high: float | None = None
    open: str = ""
    multiple: int = 1
    why: str = ""

    def holds(self, value) -> bool:
        if not math.isfinite(value) or (self.multiple > 1 and value % self.multiple):
            return False
        low_ok = self.low is None or (value > self.low if self.open in ("low", "both") else value >= self.low)
        high_ok = self.high is None or (value < self.high if self.open in ("high", "both") else value <= self.high)
        return low_ok and high_ok

    def text(self) -> str:
        """The rule in words, as --help and a refusal say it: 'in (0, 1)', '>= 1', 'a positive multiple of 32'."""
        if self.multiple > 1:
            return f"a positive multiple of {self.multiple}"
        if self.low is None and self.high is None:
            return "a finite number"
        if self.low is not None and self.high is not None:
            left, right = "(" if self.open in ("low", "both") else "[", ")" if self.open in ("high", "both") else "]"
            return f"in {left}{self.low:g}, {self.high:g}{right}"
        if self.low is not None:
            return f"{'>' if self.open == 'low' else '>='} {self.low:g}"
        return f"{'<' if self.open == 'high' else '<='} {self.high:g}"


SEEDS = 2 ** 32  # a seed below it: grpo.group_seed multiplies it by 1_000_003, and torch takes seeds below 2^64
RULES = {  # every int and float field of grpo.Config, dit_grpo.DitConfig, the variants' and the run's settings
    # the algorithm
    "group_size": Rule(2, why="GRPO compares samples within a group"),
    "prompts_per_step": Rule(1),
    "clip_eps": Rule(0, 1, "both"),
    "kl_beta": Rule(0, why="0: no KL term"),
    "mu": Rule(1),
    "lr": Rule(0, 1, "both"),
    "steps": Rule(1),
    "micro_batch_size": Rule(0, why="0: a whole group"),
    "temperature": Rule(0, open="low"),
    "top_p": Rule(0, 1, "low", why="1: off"),
    "top_k": Rule(0, why="0: off"),
    "sampler_cap": Rule(1, why="below 1 it cuts even an exact sampler's weight"),
    "seed": Rule(0, SEEDS, "high"),
    "height": Rule(32, multiple=32, why="GLM-Image's tokens are 32x32 pixels"),
    "width": Rule(32, multiple=32, why="GLM-Image's tokens are 32x32 pixels"),
    "num_inference_steps": Rule(1),
    "guidance_scale": Rule(1, why="1: no guidance"),
    "decode_seed": Rule(0, SEEDS, "high"),
    "lora_rank": Rule(0, why="0: train every weight"),
    "weight_decay": Rule(0),
    "max_grad_norm": Rule(0, open="low"),
    "before_after": Rule(0),
    # dit_grpo.py's SDE sampler
    "sde_noise": Rule(0, open="low", why="a deterministic step has no log-prob"),
    "sde_steps": Rule(0, why="0: --num-inference-steps"),
    "sde_window": Rule(0, why="0: every step"),
    # the variants (helpers/variants.py)
    "diversity": Rule(0),
    "cluster_bonus": Rule(0),
    "cluster_radius": Rule(0, 1, "high"),
    "unlikeliness": Rule(0),
    "monitor_threshold": Rule(0, why="0: no warnings"),
    "mara_threshold": Rule(why="a reward value: the samples at or above it share the target's mass"),
    "clip_eps_high": Rule(0, open="low"),
    "reference_reset_every": Rule(0, why="0: never"),
    "reference_reset_kl": Rule(0, why="0: off"),
    "entropy_bonus": Rule(0),
    # the run's (helpers/run.py)
    "image_every": Rule(0, why="0: never"),
    "eval_every": Rule(0, why="0: only before the first step and after the last"),
    "eval_samples": Rule(1),
    "eval_inference_steps": Rule(0, why="0: --num-inference-steps"),
    "save_every": Rule(0, why="0: only at the end"),
    "save_total_limit": Rule(0, why="0: keep every checkpoint"),
    "warmup_steps": Rule(0),
    "reward_timeout": Rule(0, open="low"),
    "reward_wait": Rule(0),
}


def check_numbers(cfg) -> None:
    """Every numeric field of `cfg` with a rule in RULES follows it (None: an option left off); else ValueError
    naming the flag, its value and the rule."""
    for name, rule in RULES.items():
        value = getattr(cfg, name, None)
        if value is not None and not rule.holds(value):
            why = f" ({rule.why})" if rule.why else ""
            raise ValueError(f"--{name.replace('_', '-')} {value} is out of range; it must be {rule.text()}{why}")


# ---- Config files ---------------------------------------------------------------------------------

KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
ONLY_ON_THE_COMMAND_LINE = ("resume", "overwrite")  # not read from a --config file


def field_kind(f: dataclasses.Field) -> type:
    """The type a field's flag parses its value to (a preset, `int | None`, parses as int)."""
    kinds = {"int | None": int, "float | None": float, "bool | None": bool}  # optional: a model-dependent default
    return kinds.get(str(f.type), f.type)


def read_config_file(path: str, config) -> dict:
    """--config FILE (.yaml / .yml / .json; a run's config.json too; read as `read_text` reads) -> {field: value} of
    the dataclass `config`, each value of its field's type (YAML reads 5e-6 as a string: it is parsed as the flag
    would be); resume and overwrite are the command line's only. ValueError naming an unknown key, a bad value or an
    unreadable file."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--config {path}: {'a directory; give a file in it' if file.is_dir() else 'no such file'}")
    text = read_text(file, "--config", "give a YAML or JSON file")
    try:
        values = parse_json(text) if file.suffix == ".json" else parse_yaml(text)
    except DuplicateKey as error:
        raise ValueError(f"--config {path}: {error}") from None
    except Exception as error:  # a syntax error: what was found, and where
        raise ValueError(f"--config {path} does not parse: {syntax_error(error)}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"--config {path} holds a {type(values).__name__}; it should map field names to values "
                         "(group_size: 4)")
    fields = {f.name: f for f in dataclasses.fields(config)}
    unknown = [key for key in values if key not in fields]
    if unknown:
        raise ValueError(f"--config {path}: unknown key{'s' * (len(unknown) > 1)} {', '.join(map(str, unknown))} "
                         "(keys are the flags' field names, as in a run's config.json: group_size, kl_beta, ...)")
    typed = {}
    for key, value in values.items():
        if key in ONLY_ON_THE_COMMAND_LINE:  # what to do with --out's folder: a run's config.json holds them too
            continue
        kind = field_kind(fields[key])
        if value is None and fields[key].default is None:  # an option off
            typed[key] = None
        elif value is None:  # null: the field's default (the model's, where it has a preset), as if not given
            continue
        elif isinstance(value, str) and kind is not bool:  # parsed as the flag's text would be
            try:
                typed[key] = kind(value)
            except ValueError:
                raise ValueError(f"--config {path}: {key}: {value!r} is not {KIND_NAMES[kind]}") from None
        elif isinstance(value, kind) and not (kind is int and isinstance(value, bool)) or \
                kind is float and type(value) is int:
            typed[key] = kind(value)
        else:
            raise ValueError(f"--config {path}: {key}: {value!r} is not {KIND_NAMES[kind]}")
    return config_paths(typed, file.resolve().parent)


class DuplicateKey(ValueError):
    """A key given twice in a config file: which one wins is the parser's accident (PyYAML and json keep the last)."""


def parse_yaml(text: str):
    """YAML (PyYAML's safe loader: a dependency of transformers) with every mapping's keys once each. Raises
    DuplicateKey naming the key and both lines, and PyYAML's errors for the rest."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        lines = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in lines:
                raise DuplicateKey(f"{key} is given twice (line {lines[key]} and line {line}); give it once")
            lines[key] = line
        return yaml.SafeLoader.construct_mapping(loader, node, deep)

    UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return yaml.load(text, Loader=UniqueKeys)  # noqa: S506 (a SafeLoader)


def parse_json(text: str):
    """JSON with every object's keys once each. Raises DuplicateKey naming the key, json's errors for the rest."""
    def unique(pairs: list) -> dict:
        keys = [key for key, _ in pairs]
        twice = next((key for key in keys if keys.count(key) > 1), None)
        if twice is not None:
            raise DuplicateKey(f"{twice} is given twice; give it once")
        return dict(pairs)
    return json.loads(text, object_pairs_hook=unique)


def syntax_error(error: Exception) -> str:
    """A YAML or JSON syntax error in one line that keeps its cause and its place: what was found (and while doing
    what), at which line and column, and for a tab the fix (YAML indents with spaces)."""
    mark = getattr(error, "problem_mark", None)
    if mark is not None:  # PyYAML: context ("while scanning ..."), problem ("found character '\t' ..."), the mark
        problem = getattr(error, "problem", None) or first_line(error)
        context = f" ({error.context})" if getattr(error, "context", None) else ""
        tab = "; YAML indents with spaces, not tabs" if "'\\t'" in problem else ""
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}{context}{tab}"
    if isinstance(error, json.JSONDecodeError):
        return f"{error.msg} at line {error.lineno}, column {error.colno}"
    return first_line(error)


PATH_FIELDS = ("prompts", "eval_prompts", "out")  # a config file's paths, relative to its folder


def config_paths(values: dict, folder: Path) -> dict:
    """A config file's paths, absolute: relative to the file's own folder, as on the command line they are relative to
    the working directory (so a config file means the same from any directory). prompts, eval_prompts and out; model
    when it names a folder there (a hub id, tiny or random stays); in reward and eval_reward, a reward file
    (path/to/file.py:function) and a checkpoint folder (name@folder). ~ is the home folder."""
    values = dict(values)
    for key in PATH_FIELDS:
        if values.get(key):
            values[key] = str((folder / Path(values[key]).expanduser()).absolute())
    model = values.get("model")
    if model and ((folder / model).is_dir() or model.startswith((".", "/", "~"))):
        values["model"] = str((folder / Path(model).expanduser()).absolute())
    for key in ("reward", "eval_reward"):
        if values.get(key):
            values[key] = ",".join(reward_paths(part, folder) for part in values[key].split(","))
    return values


def reward_paths(part: str, folder: Path) -> str:
    """One --reward entry with its relative paths made absolute from `folder` (a file's, a checkpoint folder's); an
    entry without one is returned as it is."""
    entry, equals, weight = part.rpartition("=") if "=" in part else (part, "", "")
    name = entry.strip()
    if is_url(name):
        return part
    if ".py:" in name:
        file, _, attr = name.rpartition(":")
        return f"{(folder / Path(file.strip()).expanduser()).absolute()}:{attr}{equals}{weight}"
    base, at, where = name.partition("@")
    where = where.strip()
    if at and where and ((folder / where).is_dir() or where.startswith((".", "/", "~"))):
        return f"{base}@{(folder / Path(where).expanduser()).absolute()}{equals}{weight}"
    return part
