"""What a GRPO run writes besides its metrics: image grids, and checkpoints that survive a kill or a full disk.

Helpers of `grpo.py`'s main loop, kept out of the tutorial file; `grpo.py` re-exports them. Every file is written
under a temporary name, flushed to disk, then renamed over the old one, so a kill or a failed write (a full disk)
never leaves a half-written file in place of a good one.
"""

import contextlib
import dataclasses
import importlib.util
import json
import os
import random
import re
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw


RUN_FILES = ("config.json", "inputs.json", "metrics.jsonl", "samples.jsonl", "checkpoint.pt", "checkpoints", "images", "final",
             "final.tmp", "final.old", "curves.png", "tensorboard", "wandb", "wandb_run_id.txt", "error.txt")  # a run's files in --out (checkpoint.pt: a run's one checkpoint
# before checkpoints/ existed; final.tmp / .old: what a killed write of final/ leaves)
STATE = "trainer_state.pt"  # in each checkpoints/step-N/, beside the loadable model: what --resume reads
CHECKPOINT_KEYS = {"weights", "optimizer", "step", "config", "rng"}


# ---- Before anything is written: can --out hold a run, and what does --resume continue? ----------

def check_out_dir(out: Path) -> None:
    """Raise ValueError if `out` cannot hold a run: it is a file, lies under a file, or is not writable.
    Probes by creating (and removing) a temporary file in `out` or its nearest existing parent."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory; give a directory path")
    parent = next(p for p in [out, *out.absolute().parents] if p.exists())
    if not parent.is_dir():
        raise ValueError(f"--out {out} lies under {parent}, which is a file; give a directory path")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".grpo-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise ValueError(f"--out {out} is not writable ({error.strerror or error}); choose a directory you can "
                         "write to") from None


HELD: dict[tuple[int, int], int] = {}  # the run directories this process holds: (device, inode) -> a descriptor


def hold_run_dir(out: Path) -> None:
    """Make `out` this run's alone while the process lives: an exclusive flock on the directory itself (created if it
    does not exist; no lock file is written), which the operating system releases when the process ends, however it
    ends (a killed run leaves nothing to clean). The process may hold it again (a resume after a run in one Python
    session). Raises ValueError while another live process holds it: a second run into the same --out, --resume and
    --overwrite included. Where flock is missing (Windows) nothing is held."""
    try:
        import fcntl
    except ImportError:
        return
    out.mkdir(parents=True, exist_ok=True)
    status = out.stat()
    key = (status.st_dev, status.st_ino)
    if key in HELD:
        return
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        holder = lock_holder(status.st_ino)
        raise ValueError(f"--out {out} is in use by a live run{f' (process {holder})' if holder else ''}: wait for it "
                         "to end, or give another --out") from None
    HELD[key] = fd


def release_run_dir(out: Path) -> None:
    """Let go of `out` (hold_run_dir), at the end of a run that finished in a process that goes on."""
    with contextlib.suppress(OSError):
        status = out.stat()
        fd = HELD.pop((status.st_dev, status.st_ino), None)
        if fd is not None:
            os.close(fd)


def lock_holder(inode: int) -> int | None:
    """The process holding a flock on the file of `inode`, from Linux's /proc/locks; None where that cannot be read."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if fields[1] == "FLOCK" and int(fields[5].split(":")[-1]) == inode:
                return int(fields[4])
    return None


def failed_start(out: Path) -> bool:
    """Whether `out` holds only what a run that stopped before its first checkpoint and its first landed step left
    (config.json, an error.txt, the before grid, a tracker's files): nothing a resume could continue and no step's
    result, so a new run may start there without --overwrite."""
    if checkpoint_steps(out) or (out / "checkpoint.pt").exists() or (out / "final").exists():
        return False
    try:
        lines = (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if (out / "metrics.jsonl").exists() \
            else []
        return all(json.loads(line).get("eval") for line in lines if line.strip())  # evaluations of the base only
    except (OSError, ValueError, AttributeError):  # a line that is not a run's (or a damaged file): the user's to keep
        return False


def checkpoint_steps(out: Path) -> list[tuple[int, Path]]:
    """The saved checkpoints of a run, (step, folder) in step order: out/checkpoints/step-N/ holding trainer_state.pt
    (a folder still being written is named step-N.tmp and does not count)."""
    found = []
    for folder in (out / "checkpoints").glob("step-*"):
        number = folder.name.removeprefix("step-")
        if number.isdigit() and (folder / STATE).is_file():
            found.append((int(number), folder))
    return sorted(found)


def resume_point(path: Path) -> tuple[Path, Path]:
    """--resume's argument -> (the run directory, the trainer state to load): a run directory (its latest
    checkpoint), or one of its checkpoints (RUN/checkpoints/step-N). A run saved before checkpoints/ existed
    resumes from its checkpoint.pt. Raises ValueError naming what is missing."""
    if path.parent.name == "checkpoints" and re.fullmatch(r"step-\d+", path.name) and (path / STATE).is_file():
        return path.parent.parent, path / STATE
    saved = checkpoint_steps(path)
    if saved:
        return path, saved[-1][1] / STATE
    if (path / "checkpoint.pt").is_file():  # the single checkpoint of a run from before checkpoints/
        return path, path / "checkpoint.pt"
    raise ValueError(f"--resume {path}: no checkpoint there; give a run directory (its latest checkpoint) or one of "
                     "its checkpoints/step-N folders")


def read_resume(out: Path, state_path: Path) -> tuple[dict, int, int]:
    """The saved config (config.json) of the run in `out`; of the trainer state `state_path`, the number of finished
    steps and the groups a step trained over all processes (its own config's prompts per step x its processes: a
    resumed run may have run on another number of processes since). Raises ValueError naming the file if either is
    missing, truncated or not written by grpo.py."""
    config_path = out / "config.json"
    if not config_path.is_file():
        raise ValueError(f"--resume {out}: no config.json there; resume a directory a run saved into")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        assert isinstance(config, dict)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AssertionError):
        raise ValueError(f"{config_path} is truncated or not a grpo.py config; restore it from the checkpoint's "
                         f"copy (torch.load('{state_path}')['config']) or start a new run") from None
    state = read_checkpoint(state_path)
    return config, state["step"], state["config"]["prompts_per_step"] * state.get("world", 1)


def read_checkpoint(path: Path) -> dict:
    """torch.load of a checkpoint, memory-mapped (tensors are read only when used) and weights_only (a foreign
    pickle runs no code). Raises ValueError naming the file if it is truncated or not a grpo.py checkpoint."""
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        assert isinstance(state, dict) and CHECKPOINT_KEYS <= state.keys()
    except Exception:  # truncated zip, another format, a foreign pickle: all the same to the user
        raise ValueError(f"{path} is truncated or not a grpo.py checkpoint; resume from an earlier one (--resume "
                         "RUN/checkpoints/step-N), or start a new run with --overwrite (which deletes the run)") from None
    return state


def read_metrics(out: Path, name: str = "metrics.jsonl") -> list[dict]:
    """The metrics lines of `out` (or those of its file `name`); a last line cut off by a kill is dropped. Raises
    ValueError for other damage."""
    path = out / name
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise ValueError(f"{path}:{number} is not a JSON line; repair or delete the file") from None
    return records


def read_inputs(out: Path) -> dict | None:
    """A run's inputs.json: {"cwd": the directory it started in, "files": {absolute path: sha256} of what it reads};
    None for a run saved before it existed. Raises ValueError when it is damaged."""
    path = out / "inputs.json"
    if not path.is_file():
        return None
    try:
        inputs = json.loads(path.read_text(encoding="utf-8"))
        assert isinstance(inputs.get("cwd"), str) and isinstance(inputs.get("files"), dict)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AssertionError, AttributeError):
        raise ValueError(f"{path} is truncated or not a run's inputs.json; delete it to resume without checking the "
                         "inputs, or start a new run") from None
    return inputs


def open_run_dir(out: Path, cfg, start: int, inputs: dict | None = None) -> list[dict]:
    """Make `out` ready for a run starting at step `start`; returns the training metrics of the steps before it.

    A new run first clears what an earlier run left (the caller allows that only with --overwrite);
    a resumed run keeps its metrics, samples and image grids up to the checkpoint and drops later ones, as those steps
    are redone: the steps up to `start` (counted from 1), and the evaluations of the weights after them.
    Resumed from an earlier checkpoint than the latest (the caller allows that only with --overwrite), the later
    checkpoints and final/ are deleted.
    """
    if not cfg.resume:
        for name in RUN_FILES:
            shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink(missing_ok=True)
    later = [folder for step, folder in checkpoint_steps(out) if step > start]
    if cfg.resume and later:  # going back to an earlier checkpoint (with --overwrite): what came after goes
        for folder in [*later, out / "final"]:
            shutil.rmtree(folder, ignore_errors=True)
    (out / "images").mkdir(parents=True, exist_ok=True)
    for image in [*(out / "images").glob("step_*.png"), *(out / "images").glob("monitor_*.png")]:  # the grids of
        number = image.stem.split("_")[1]  # the steps to redo (step_00012, monitor_00012_brightness)
        if cfg.resume and number.isdigit() and int(number) > start:
            image.unlink()
    kept = [h for h in read_metrics(out) if h["step"] <= start] if cfg.resume else []
    samples = [row for row in read_metrics(out, "samples.jsonl") if row["step"] <= start] if cfg.resume else []
    saved = {**dataclasses.asdict(cfg), "overwrite": False}  # what a later --resume continues: never to delete
    atomic_write(out / "config.json", lambda f: f.write(json.dumps(saved, indent=2).encode()))
    if inputs is not None:  # the files the run reads: a resume reads the same ones (run.prepare checks)
        atomic_write(out / "inputs.json", lambda f: f.write(json.dumps(inputs, indent=2).encode()))
    atomic_write(out / "metrics.jsonl", lambda f: f.write("".join(json.dumps(h) + "\n" for h in kept).encode()))
    atomic_write(out / "samples.jsonl", lambda f: f.write("".join(json.dumps(s) + "\n" for s in samples).encode()))
    return [h for h in kept if not h.get("eval")]


# ---- Writing ---------------------------------------------------------------------------------------

def atomic_write(path: Path, write) -> None:
    """write(f) into a temporary file beside `path`, flush it to disk, then rename it over `path`. On any failure
    (a full disk, Ctrl-C) the temporary file is removed and `path` keeps its previous content."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def append_metrics(out: Path, record: dict, name: str = "metrics.jsonl") -> None:
    """One JSON line per step (or several: a list of records, as samples.jsonl takes a step's samples), appended and
    flushed at once: a killed run keeps every finished step. A failed write (a full disk) is cut back off, so the file
    never ends in half a line."""
    path = out / name
    size = path.stat().st_size if path.exists() else 0
    records = record if isinstance(record, list) else [record]
    try:
        with open(path, "a") as f:
            f.write("".join(json.dumps(one) + "\n" for one in records))
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        with contextlib.suppress(OSError):
            os.truncate(path, size)
        raise


def save_image(image: Image.Image, path: Path) -> None:
    atomic_write(path, lambda f: image.save(f, format="PNG"))


def image_grid(rows: list[list[tuple[str, torch.Tensor | None]]], rewards: torch.Tensor,
               titles: list[str] | None = None, each: dict | None = None) -> Image.Image:
    """One row per prompt: labelled reference tiles (source, target; None draws a blank), then the samples with their
    rewards written underneath (the weighted sum, and with more than one reward in `each` every reward's value on a
    line of its own), and a title strip above each row when `titles` are given (the prompt, the step).
    rows[p] = [(label, (3, H, W) or None), ...]; rewards and each[name]: (P, n samples). Tiles smaller than 128 pixels
    are enlarged (nearest neighbour) so that a tiny model's pictures can be seen."""
    each = each if each and len(each) > 1 else {}
    G, label, title = rewards.shape[1], 14 * (1 + len(each)), 14 if titles else 0
    _, H, W = next(t for row in rows for _, t in row if t is not None and t.ndim == 3).shape
    zoom = max(1, 128 // max(H, W))
    H, W = H * zoom, W * zoom
    n_ref = len(rows[0]) - G
    grid = Image.new("RGB", (len(rows[0]) * W, len(rows) * (title + H + label)), "white")
    draw = ImageDraw.Draw(grid)
    for r, row in enumerate(rows):
        y = r * (title + H + label)
        if titles:
            draw.text((2, y + 1), titles[r], fill="black")
        for col, (text, picture) in enumerate(row):
            if picture is not None:
                pixels = (picture.float().clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255).round().astype(np.uint8)
                grid.paste(Image.fromarray(pixels).resize((W, H), Image.NEAREST), (col * W, y + title))
            if col >= n_ref:
                i = col - n_ref
                text = "\n".join([f"{rewards[r, i].item():.3f}",
                                  *(f"{name} {values[r, i].item():.3f}" for name, values in each.items())])
            draw.multiline_text((col * W + 2, y + title + H + 1), text, fill="black", spacing=3)
    return grid


def plot_curves(out: Path) -> Path:
    """out/curves.png from out/metrics.jsonl, one panel each, per step (x: the step, from 1; a training point at step
    N is the N-th update's, its rewards drawn by the policy after N - 1 updates; an evaluation at N reads it after N): the
    training reward (each step's mean, its mean over 20 steps, and the step's mean within-group std as a band), the
    eval rewards (overall, and per category of the eval reward), the eval's diversity (distinct layouts of K, and the
    share of prompts drawn with one), the KL to the reference (the loss's and the untruncated one), the clip
    fraction, the share of groups with no spread (zero advantage: no signal) and the distinct samples in a training
    group. Returns the path; ValueError if there are no lines."""
    from matplotlib.figure import Figure  # not pyplot: no global backend, so a notebook's plots are left alone
    records = read_metrics(out)
    train, evals = [r for r in records if not r.get("eval")], [r for r in records if r.get("eval")]
    if not records:
        raise ValueError(f"{out / 'metrics.jsonl'} has no steps yet; plot a run that has trained")
    figure = Figure(figsize=(20, 7.5))  # fixed margins: constrained layout took half of the figure's time
    figure.subplots_adjust(left=0.035, right=0.99, bottom=0.07, top=0.91, wspace=0.18, hspace=0.32)
    axes = figure.subplots(2, 4).ravel()
    x = np.array([r["step"] for r in train])

    def smooth(values):  # the mean of the last 20 steps' finite values (NaN where none): single steps are noisy
        windows = [values[max(0, i - 19):i + 1] for i in range(len(values))]
        return np.array([w[np.isfinite(w)].mean() if np.isfinite(w).any() else np.nan for w in windows])

    if train:
        mean, spread = np.array([r["reward_mean"] for r in train]), np.array([r["reward_std"] for r in train])
        axes[0].fill_between(x, mean - spread, mean + spread, alpha=0.2, label="± std within groups")
        axes[0].plot(x, mean, lw=0.8, alpha=0.6, label="mean of the step")
        axes[0].plot(x, smooth(mean), lw=2, label="mean of the last 20 steps")
    diversity = ("eval/distinct_layouts", "eval/one_layout")
    keys = {k for r in evals for k in r}
    for panel, shown in ((1, [k for k in keys if k.count("/") == 1 and k not in diversity]),
                         (2, [k for k in keys if k.startswith("eval/reward/")]), (3, [k for k in diversity if k in keys])):
        for key in sorted(shown):
            axes[panel].plot([r["step"] for r in evals if key in r], [r[key] for r in evals if key in r], marker="o",
                             label=key[5:])
    for panel, key, scale, name in ((4, "kl", 1, ""), (5, "clip_frac", 1, ""), (6, "zero_std_groups", None, ""),
                                    (7, "distinct_in_group", 1, "")):
        values = np.array([r.get(key, np.nan) / (scale or len(r["prompts"])) for r in train], dtype=float)
        if len(values) and np.nanmax(np.abs(values), initial=0.0) == 0:  # e.g. KL with --kl-beta 0, the clip with mu 1
            axes[panel].text(0.5, 0.6, "0 at every step", ha="center", transform=axes[panel].transAxes, color="gray")
        axes[panel].plot(x, values, lw=0.8, alpha=0.6, label=f"{name}, each step".lstrip(", "))
        axes[panel].plot(x, smooth(values), lw=2, label=f"{name}, mean of the last 20 steps".lstrip(", "))
    titles = ["training reward", "eval reward (held-out prompts, fixed seeds)", "eval reward by category",
              "eval diversity: distinct layouts of K; share with one", "KL to the reference (k3 per token)",
              "clip fraction", "share of groups with no spread (no signal)", "distinct samples in a training group"]
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        elif not ax.lines and not ax.collections:
            ax.text(0.5, 0.5, "no eval lines (--eval-prompts)" if title.startswith("eval") else "no data",
                    ha="center", va="center", transform=ax.transAxes, color="gray")
    figure.suptitle(str(out), fontsize=10)
    path = out / "curves.png"
    atomic_write(path, lambda f: figure.savefig(f, format="png", dpi=80))
    return path


def side_by_side(left: Path, right: Path) -> Image.Image:
    """Two image grids next to each other, 16 white pixels apart (the before and the after grid)."""
    with Image.open(left) as a, Image.open(right) as b:
        both = Image.new("RGB", (a.width + 16 + b.width, max(a.height, b.height)), "white")
        both.paste(a, (0, 0))
        both.paste(b, (a.width + 16, 0))
    return both


def save_checkpoint(folder: Path, model, model_weights: dict | None, weights: dict, optimizer_state: dict,
                    step: int, cfg, world: int = 1, base_model: str = "", scheduler: dict | None = None,
                    variants: dict | None = None, rng: dict | None = None) -> None:
    """checkpoints/step-N/: trainer_state.pt (the trainable weights, the optimizer state, the RNG states, the steps
    done, the config) beside the trained model as save_trained writes it (loadable on its own), the folder written
    whole or not at all. `weights` / `optimizer_state`: full (unsharded) state dicts, as `trainable_state` returns
    them; `model_weights`: `final_weights`' (None in one process). `world`: the number of processes
    (cfg.prompts_per_step is per process); `scheduler`: the learning rate schedule's state dict; `variants`: the
    variants' state (helpers/variants.py's State); `rng`: the RNG states to save (`rng_state`'s; default: now)."""
    state = {"weights": weights, "optimizer": optimizer_state, "step": step, "config": dataclasses.asdict(cfg),
             "world": world, **({"scheduler": scheduler} if scheduler is not None else {}),
             **({"variants": variants} if variants else {}),
             "rng": rng or rng_state()}

    def write(tmp: Path) -> None:
        atomic_write(tmp / STATE, lambda f: torch.save(state, f))
        save_trained(model, tmp, model_weights, base_model)
        card = checkpoint_card(folder, step, cfg, base_model)  # in place of peft's empty template
        atomic_write(tmp / "README.md", lambda f: f.write(card.encode()))
    atomic_folder(folder, write)


def seed_everything(seed: int) -> None:
    """A new run's global RNGs (torch's on every device, numpy's, Python's) from --seed, as transformers' set_seed:
    grpo.py's own draws have their own generators, but a user's reward may draw from these (a random crop)."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def rng_state() -> dict:
    """The global RNGs' states (torch's, CUDA's, numpy's, Python's) as tensors and numbers, which a checkpoint holds
    and torch.load(weights_only=True) reads back."""
    _, keys, position, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {"torch": torch.random.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "position": position, "has_gauss": has_gauss,
                      "gauss": gauss},
            "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                       "gauss_next": gauss_next}}


def restore_rng(state: dict) -> None:
    """Put `rng_state()`'s states back (a checkpoint from before numpy's and Python's were saved restores torch's)."""
    torch.random.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        saved = state["numpy"]
        np.random.set_state(("MT19937", saved["keys"].numpy().astype(np.uint32), saved["position"],
                             saved["has_gauss"], saved["gauss"]))
    if "python" in state:
        saved = state["python"]
        random.setstate((saved["version"], tuple(saved["internal"].tolist()), saved["gauss_next"]))


@contextlib.contextmanager
def rng_kept():
    """The global RNGs as they were before the block, after it: an evaluation (whose rewards may draw) leaves
    training's draws as they would be without it, so that a run resumed before or after one goes on the same."""
    state = rng_state()
    try:
        yield
    finally:
        restore_rng(state)


def what_trained(cfg) -> tuple[str, str, str]:
    """What a run trains, as its cards and start-up summary name it: the model ("the AR (vision_language_encoder)" or
    the DiT's), how ("LoRA r=N" or "every weight") and the library whose call loads the result (peft, diffusers or
    transformers)."""
    trained = {"ar": "the AR (vision_language_encoder)", "dit": "the DiT (transformer)"}[cfg.train]
    how = f"LoRA r={cfg.lora_rank}" if cfg.lora_rank else "every weight"
    library = "diffusers" if cfg.train == "dit" else "peft" if cfg.lora_rank else "transformers"
    return trained, how, library


def checkpoint_card(folder: Path, step: int, cfg, base_model: str) -> str:
    """A checkpoint's README.md: what it is, how it resumes and loads (the run's final/README.md is the full card)."""
    trained, how, library = what_trained(cfg)
    script = {"ar": "grpo.py", "dit": "dit_grpo.py"}[cfg.train]
    hub_base = base_model and not Path(base_model).is_absolute()  # the hub's metadata names hub ids, not folders
    return "\n".join(["---", *([f"base_model: {base_model}"] if hub_base else []), f"library_name: {library}",
                      "pipeline_tag: text-to-image", "tags: [grpo, glm-image, text-to-image]", "---", "",
                      f"# {folder.parent.parent.name}, checkpoint after step {step} of {cfg.steps}", "",
                      f"GRPO on GLM-Image's {trained.removeprefix('the ')}: {how}, base `{base_model or cfg.model}`, "
                      f"reward `{cfg.reward}`. The model here loads alone, as the run's final/README.md shows; "
                      f"`python {script} --resume {folder}` continues the run from it (trainer_state.pt; with "
                      "`--overwrite` when later checkpoints exist, which it deletes).", ""])


def prune_checkpoints(out: Path, keep: int) -> list[Path]:
    """After a save: --save-total-limit removes all but the `keep` latest checkpoints (0: keep them all), and what a
    killed save left (step-N.tmp, step-N.old) goes. Returns the removed."""
    saved = [folder for _, folder in checkpoint_steps(out)]
    removed = saved[:-keep] if keep > 0 else []
    removed += [*(out / "checkpoints").glob("step-*.tmp"), *(out / "checkpoints").glob("step-*.old")]
    for folder in removed:
        shutil.rmtree(folder, ignore_errors=True)
    return removed


def save_trained(model, folder: Path, state_dict: dict | None = None, base_model: str = "") -> None:
    """The trained model into `folder`, in the format that one standard call loads:
    - the AR with LoRA: peft's adapter (adapter_config.json names `base_model`, the hub id or folder it was trained
      on), which `pipe.vision_language_encoder.load_adapter(folder)` (transformers) loads;
    - the DiT with LoRA: diffusers' LoRA file (`diffusers_lora`), which `pipe.transformer.load_lora_adapter(folder)`
      loads;
    - without LoRA: the whole AR (GlmImageForConditionalGeneration.from_pretrained(folder)) or DiT
      (GlmImageTransformer2DModel.from_pretrained(folder)).
    `state_dict`: the weights gathered from every process under torchrun (`final_weights`; None: read from
    `model`)."""
    folder.mkdir(parents=True, exist_ok=True)
    lora = hasattr(model, "get_base_model")
    from_diffusers = hasattr(model.get_base_model() if lora else model, "save_config")  # the DiT
    if lora and from_diffusers:
        diffusers_lora(model, folder, state_dict)
    elif lora:
        model.peft_config["default"].base_model_name_or_path = base_model or None  # not this machine's cache path
        model.save_pretrained(folder, save_embedding_layers=False,  # never trained; and no look-up on the hub
                              **({} if state_dict is None else {"state_dict": state_dict}))
    elif from_diffusers and state_dict is not None:  # a diffusers model takes no state_dict: its config and the
        model.save_config(folder)  # weights gathered from every process, as it names them
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in state_dict.items()}, folder / "diffusion_pytorch_model.safetensors")
    else:
        model.save_pretrained(folder, **({} if state_dict is None else {"state_dict": state_dict}))


def diffusers_lora(model, folder: Path, state_dict: dict | None = None) -> None:
    """The DiT's LoRA (a peft model) as diffusers' pipelines save theirs (`save_lora_weights`): the weights named
    "transformer.<module>.lora_A.weight", the LoRA config in the safetensors header. diffusers 0.42's
    `load_lora_adapter(folder)` reads, without arguments, only pytorch_lora_weights.bin (with use_safetensors=True
    the .safetensors): both are written, the same tensors."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file
    adapter = get_peft_model_state_dict(model, state_dict=state_dict, save_embedding_layers=False)
    weights = {"transformer." + name.removeprefix("base_model.model."): value.detach().cpu().contiguous()
               for name, value in adapter.items()}
    config = {f"transformer.{key}": sorted(value) if isinstance(value, set) else value
              for key, value in model.peft_config["default"].to_dict().items()}
    header = {"format": "pt", "lora_adapter_metadata": json.dumps(config, indent=2, sort_keys=True)}
    save_file(weights, folder / "pytorch_lora_weights.safetensors", metadata=header)
    torch.save(weights, folder / "pytorch_lora_weights.bin")


def atomic_folder(path: Path, write) -> None:
    """write(tmp) fills a temporary folder beside `path`, which then takes `path`'s place: `path` is never half-written,
    and the previous one survives a failure (a full disk, Ctrl-C)."""
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


# ---- Live dashboards: --report-to tensorboard | wandb --------------------------------------------

REPORTERS = ("none", "tensorboard", "wandb")
WANDB_ID = "wandb_run_id.txt"  # in the run directory: a resume continues the same wandb run


def reporters(spec: str) -> list[str]:
    """--report-to's comma list -> the trackers named (none: [])."""
    return [kind for kind in (part.strip() for part in spec.split(",")) if kind and kind != "none"]


def check_reporter(spec: str) -> None:
    """Raise ValueError for an unknown tracker in --report-to, or one whose package is not installed (each imported
    only when used)."""
    for kind in reporters(spec):
        if kind not in REPORTERS:
            raise ValueError(f"--report-to {kind}: use {', '.join(REPORTERS)}, or a comma list (tensorboard,wandb)")
        if importlib.util.find_spec(kind) is None:
            raise ValueError(f"--report-to {kind} needs the {kind} package, which is not installed: pip install {kind} "
                             "(or leave --report-to at none)")
        if kind == "wandb" and wandb_mode() == "online" and not wandb_key():
            raise ValueError("--report-to wandb logs online, and this machine has no wandb API key: run wandb login "
                             "(or set WANDB_API_KEY), or log offline with WANDB_MODE=offline (wandb sync uploads later)")


def wandb_mode() -> str:
    """wandb's mode as wandb.init will read it: WANDB_MODE, else the settings `wandb offline` / `wandb online` wrote,
    else online."""
    import configparser
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    settings = configparser.ConfigParser()
    settings.read(Path(os.environ.get("WANDB_CONFIG_DIR", Path.home() / ".config" / "wandb")) / "settings")
    return settings.get("default", "mode", fallback="online")


def wandb_key() -> bool:
    """Whether wandb finds an API key without asking: WANDB_API_KEY, or `wandb login`'s entry in ~/.netrc."""
    import netrc
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        return bool(os.environ.get("WANDB_API_KEY") or netrc.netrc().authenticators(host))
    except (OSError, netrc.NetrcParseError):
        return False


class Reporter:
    """The run's metrics lines (their numbers) and image grids, also sent to the trackers of --report-to (a comma
    list): TensorBoard (event files in <out>/tensorboard: `tensorboard --logdir <out>`; a resume continues at its step,
    later events of an earlier try purged) and Weights & Biases (online unless WANDB_MODE says otherwise, e.g.
    offline: <out>/wandb, `wandb sync` uploads it; --wandb-project, --wandb-entity, --run-name; the run's id kept in
    <out>/wandb_run_id.txt, so a resume continues the same wandb run). "none" does nothing; metrics.jsonl and the PNG
    grids are written either way. `start`: the steps done before (a resume). A wandb that cannot start online (no
    network, the service down) logs offline instead, said in one line: the run never stops for its tracker."""

    def __init__(self, spec: str, out: Path, config: dict, start: int = 0):
        self.kinds, self.writers = reporters(spec), {}
        if "tensorboard" in self.kinds:
            from torch.utils.tensorboard import SummaryWriter
            self.writers["tensorboard"] = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=start + 1)
            if not start:
                self.writers["tensorboard"].add_text("config",
                                                     "    " + json.dumps(config, indent=1).replace("\n", "\n    "))
        if "wandb" in self.kinds:
            import wandb
            id_file = out / WANDB_ID
            run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]  # wandb's form
            atomic_write(id_file, lambda f: f.write(run_id.encode()))
            settings = dict(dir=str(out), config=config, id=run_id, resume="allow", name=config.get("run_name") or
                            out.name, project=config.get("wandb_project") or "grpo-glm-image",
                            entity=config.get("wandb_entity") or None)
            try:  # mode: WANDB_MODE, else `wandb offline`'s setting, else online
                self.writers["wandb"] = wandb.init(**settings)
            except Exception as error:  # no network, a proxy in the way, the service down: the run goes on, offline
                reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
                print(f"warning: wandb could not start online ({reason[:200]}); logging offline to {out / 'wandb'} "
                      f"instead: wandb sync {out / 'wandb'}/offline-run-* uploads it later", file=sys.stderr)
                wandb.teardown()  # the failed online start still holds the run's id in wandb's service
                self.writers["wandb"] = wandb.init(**settings, mode="offline")
            # the run's own step as the x axis: wandb drops lines below its last step, and a resume redoes steps
            self.writers["wandb"].define_metric("step")
            self.writers["wandb"].define_metric("*", step_metric="step")

    def log(self, record: dict) -> None:
        """A metrics line: every number in it at its "step" (eval lines under their eval/ names)."""
        numbers = {k: v for k, v in record.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        if "tensorboard" in self.writers:
            for key, value in numbers.items():
                self.writers["tensorboard"].add_scalar(key, value, record["step"])
        if "wandb" in self.writers:
            self.writers["wandb"].log({"step": record["step"], **numbers})

    def table(self, name: str, rows: list[dict], step: int) -> None:
        """Rows of equal keys (the step's samples) as a table: markdown text in TensorBoard, a wandb.Table."""
        if not rows:
            return
        keys = list(rows[0])
        if "tensorboard" in self.writers:
            cell = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
            lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(cell(row[k]) for k in keys) + " |" for row in rows]
            self.writers["tensorboard"].add_text(name, "\n".join(lines), step)
        if "wandb" in self.writers:
            import wandb
            self.writers["wandb"].log({"step": step, name: wandb.Table(columns=keys,
                                                                       data=[[row[k] for k in keys] for row in rows])})

    def image(self, name: str, path: Path, step: int) -> None:
        """An image grid written at `path` (a PNG), under `name`."""
        if not self.writers or not Path(path).exists():
            return
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("RGB"))
        if "tensorboard" in self.writers:
            self.writers["tensorboard"].add_image(name, pixels, step, dataformats="HWC")
        if "wandb" in self.writers:
            import wandb
            self.writers["wandb"].log({"step": step, name: wandb.Image(pixels)})

    def close(self) -> None:
        if "tensorboard" in self.writers:
            self.writers["tensorboard"].close()
        if "wandb" in self.writers:
            self.writers["wandb"].finish()
