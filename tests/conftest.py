"""What the tests share: the tiny pipelines (fixtures), the settings that keep them fast, and helpers that run grpo.py
and read what it wrote. pytest loads this file first; the test files import its helpers by name."""

import dataclasses
import json
import os
import subprocess
import sys
import types
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread a process: the workers (pytest.ini) and their children
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

torch.set_num_threads(1)  # as grpo.py sets it on a CPU: every test, and the runs it compares, at one thread

ROOT = Path(__file__).resolve().parent.parent  # the repository: grpo.py, tools/, examples/
sys.path.insert(0, str(ROOT))  # grpo.py, helpers/ and tools/, however pytest was started

import grpo  # noqa: E402
from helpers import fast_decode, run, trainer  # noqa: E402
from helpers.offline_model import sharpen, tiny_glm_image  # noqa: E402

DEVICE = os.environ.get("GRPO_TEST_DEVICE", "cpu")  # where the models run: cpu (CI), or cuda on a machine with a GPU
# sampler vs trainer in float32: 1e-5 on the CPU; on CUDA their attention kernels differ (the decode step's masked one,
# the trainer's causal one) and the sharpened model (logits x 16) reached 1.0e-5 on an H100 (2026-11-24)
PARITY = 1e-5 if DEVICE == "cpu" else 2e-5
T = 0.9  # GLM-Image's sampling temperature
# the tiny model at small settings, so that the tests run in minutes (the demo's defaults: G 8, 2 prompts a step, 96x96)
TINY = ["--model", "tiny", "--device", DEVICE, "--group-size", "4", "--prompts-per-step", "1", "--height", "64",
        "--width", "64", "--before-after", "0",
        "--mu", "1", "--kl-beta", "0", "--diversity", "0"]  # one update, no KL, no bonus: a step's metrics show the
# first ratio (exactly 1), unless a test asks for more; test_main_defaults runs the tiny defaults (mu 2, KL, bonus)
TINY_CPU = [*TINY[:2], "--device", "cpu", *TINY[4:]]  # torchrun tests: gloo on the CPU (one GPU cannot host 2 ranks)


def choices(name: str) -> tuple:
    """The values the command line's field `name` accepts (grpo.Config's, the variants' or the run's)."""
    config = run.with_run_settings(grpo.Config)
    return next(f for f in dataclasses.fields(config) if f.name == name).metadata["choices"]


CORRECTIONS = choices("sampler_correction")


def codebook(model) -> int:
    """The AR's codebook size K."""
    return model.config.vq_config.num_embeddings


def sample_group(pipe, prompt, group_size, height, width, temperature, seed, source=None, top_k=0, top_p=1.0):
    """One prompt's group as the trainer samples it (helpers/trainer.py: the fast decode, the kept codes' bits): the
    tokens of grpo.sample_groups (tests/test_fast_decode.py)."""
    return trainer.sample_groups(grpo, pipe, [prompt], group_size, height, width, temperature, [seed], top_k, top_p,
                                 None if source is None else [source])[0]


def lora_policy(pipe, rank=4, seed=0):
    """The tiny AR with LoRA adapters of `rank` whose B weights are random (peft starts them at 0: a no-op)."""
    policy = trainer.trained_model(grpo, pipe, types.SimpleNamespace(lora_rank=rank, gradient_checkpointing=False,
                                                                       seed=0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # LoRA starts as a no-op (B = 0); give it weights so the tests can see it
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return policy


def kept_codes(rollout, model):
    """A rollout's kept codes as the trainer sees them, (G, N, K) bool (micro_batches unpacks the sampler's bits), or
    None (no top-k / top-p)."""
    return None if rollout.support is None else fast_decode.code_support(rollout.support, codebook(model))


def sampled_rows(logits, top_p, generator, advantages=(1.0, -1.0)):
    """A sampler on given (S, N, K) logits: tokens drawn from code_logprobs at `top_p`, as a MicroBatch of a Rollout
    with its q and p log-probs and the kept codes' bits (no preview)."""
    S, N, K = logits.shape
    q = grpo.code_logprobs(logits, T, K, top_p=top_p)
    tokens = torch.multinomial(q.exp().flatten(0, 1), 1, generator=generator).view(S, N)
    p_logprobs = grpo.logprob_of(grpo.code_logprobs(logits, T, K), tokens)
    support = fast_decode.support_bits(q.isfinite()) if top_p < 1 else None
    rollout = trainer.Sampled(grpo.Prompt({}, (0, 0), (1, N)), tokens, grpo.logprob_of(q, tokens), p_logprobs, support)
    return trainer.micro_batches([rollout], torch.tensor([advantages]), S)[0]


def smooth_source(height=64, width=64, seed=0) -> torch.Tensor:
    """A smooth random RGB image (3, H, W) in [0, 1], quantised to 8 bits like an image read from a file."""
    g = torch.Generator().manual_seed(seed)
    image = torch.nn.functional.interpolate(torch.rand(1, 3, 4, 4, generator=g), size=(height, width), mode="bilinear")
    return (image[0] * 255).round() / 255


# ---- the order the workers take the tests in ------------------------------------------------------

FIRST = ("test_notebook.py", "torchrun", "test_stops.py", "two_nodes", "test_main_", "test_train_tiny_quick")
# what takes longest, the longest kinds first: the workers (pytest.ini) start with them, so that none is left to run
# alone at the end (xdist's load scheduling hands out tests in this order). A whole file moves as one (the notebook's
# tests share its one execution: a module fixture is set up again each time its file's tests are interrupted).


def pytest_collection_modifyitems(items):
    def cost(item):
        return next((i for i, name in enumerate(FIRST) if name in item.nodeid), len(FIRST))

    items.sort(key=cost)  # stable: the rest keep the files' order


# ---- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pipe():
    """A tiny pipeline shared by tests that do not change it."""
    return grpo.load_glm_image("tiny", DEVICE)


def fresh_pipe():
    return grpo.load_glm_image("tiny", DEVICE)


@pytest.fixture(scope="module")
def sharp_pipe():
    """The random tiny model built in code, made peaked: wrong log-probs are far from right ones on it."""
    return sharpen(grpo.only_ar_trains(tiny_glm_image(0))).to(DEVICE)


@pytest.fixture(scope="module")
def random_pipe():
    """The randomly initialised tiny model built in code: its samples differ from one seed to the next (the trained
    one draws the same blank picture for a prompt it cannot read, whatever the seed). Frozen and in eval mode as
    load_glm_image leaves a model (built in code it starts in train mode, where its DiT and VAE draw from the global
    RNG: the same tokens would decode to other pictures)."""
    return grpo.only_ar_trains(tiny_glm_image(0)).to(DEVICE)


# ---- helpers ------------------------------------------------------------------------------------

def picture(scene: dict, rng=None) -> torch.Tensor:
    """A rendered scene of world.py as grpo.py's images are: (3, H, W) float in [0, 1]."""
    from helpers import world
    return torch.from_numpy(np.array(world.render(scene, rng))).permute(2, 0, 1).float() / 255


def write_example(tmp_path, lines, size=64, name="t.png"):
    Image.fromarray(np.full((size, size, 3), 128, np.uint8)).save(tmp_path / name)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(lines) + "\n")
    return prompts


def write_evals(tmp_path, size=64):
    """Three eval prompts (an odd number: two processes share them unevenly), two with a category, gray targets."""
    Image.fromarray(np.full((size, size, 3), 100, np.uint8)).save(tmp_path / "e.png")
    lines = [{"prompt": "a red circle", "target": "e.png", "category": "single"},
             {"prompt": "two blue squares", "target": "e.png", "category": "counting"},
             {"prompt": "a green triangle", "target": "e.png"}]
    (tmp_path / "evals.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return tmp_path / "evals.jsonl"


def eval_lines(out):
    return [x for x in run_record(out) if x.get("eval")]


def as_line(record, step):
    """tools/compare.py's record as the run's eval line at `step` (run_record drops the seconds)."""
    return {k: v for k, v in record.items() if not k.startswith("sec_")} | {"step": step}


def run_cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, str(ROOT / "grpo.py"), *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def error_lines(text):
    return [line for line in text.strip().splitlines() if not line.startswith("note:")]


def tiny_run(tmp_path, out, *extra):
    prompts = write_example(tmp_path, ["a gray square | t.png", "another | t.png"])
    return grpo.main([*TINY, "--prompts", str(prompts), "--out", str(out), "--image-every", "0",
                      "--micro-batch-size", "2", *extra])


def latest_state(out):
    """The trainer state of a run's latest checkpoint (checkpoints/step-N/trainer_state.pt), as --resume reads it."""
    from helpers import run_io
    return run_io.read_checkpoint(run_io.resume_point(out)[1])


def run_record(out):
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in x.items() if not k.startswith("sec_")} for x in lines]


def snapshot(directory: Path) -> dict:
    """Every file under `directory` with its bytes: to check that nothing the user has was changed."""
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def expect_exit(argv, code, needle, capsys):
    """main(argv) exits with `code` after one line on stderr that contains `needle`, without a traceback."""
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.startswith("grpo.py: error:")]
    assert exit_info.value.code == code and len(lines) == 1 and needle in lines[0], (argv, err)
    assert "Traceback" not in err
    return err


def one_process(*args, script: Path = ROOT / "grpo.py"):
    """What `torchrun --nproc-per-node 1 SCRIPT ARGS` runs, in this process (at one thread, as each process of the
    torchrun tests: the same float summation order): the reference a torchrun test compares with, without a new
    interpreter."""
    import dit_grpo
    return (dit_grpo if script.name == "dit_grpo.py" else grpo).main(list(args))


def torchrun(*args, script: Path = ROOT / "grpo.py", timeout: int = 600, nproc: int = 2):
    """Run `script` under torchrun with `nproc` processes; returns the CompletedProcess."""
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), str(script), *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=timeout)

def zero_gradient_entries(name: str, config) -> torch.Tensor | None:
    """The entries of k_proj.bias outside the rotary dims: softmax ignores a constant added to every key, so their
    true gradient is exactly 0, their float gradient is rounding noise, and AdamW turns that noise into steps of
    random sign (~lr / 100). Any change of summation order moves them (one process, micro-batch 2 vs 4, too)."""
    if not name.endswith("k_proj.bias"):
        return None
    head_dim = config.hidden_size // config.num_attention_heads
    rotary = int(head_dim * config.rope_parameters["partial_rotary_factor"])
    return (torch.arange(config.num_key_value_heads * head_dim) % head_dim) >= rotary


def assert_same_weights(dir_a: Path, dir_b: Path, tol: float = 1e-5) -> float:
    """final/ of two runs hold the same weights within `tol` (the zero-gradient entries above excepted)."""
    from safetensors.torch import load_file
    name = "adapter_model.safetensors" if (dir_a / "adapter_model.safetensors").exists() else "model.safetensors"
    a, b = load_file(dir_a / name), load_file(dir_b / name)
    config = fresh_pipe().vision_language_encoder.config.text_config
    assert a.keys() == b.keys() and a
    worst = 0.0
    for key in a:
        diff = (a[key].float() - b[key].float()).abs()
        mask = zero_gradient_entries(key, config)
        worst = max(worst, (diff[~mask] if mask is not None else diff).max().item())
    assert worst <= tol, worst
    return worst


def assert_same_metrics(run_a: Path, run_b: Path, tol: float = 1e-5) -> None:
    a, b = run_record(run_a), run_record(run_b)
    assert len(a) == len(b) and [x.get("prompts") for x in a] == [x.get("prompts") for x in b]  # eval lines: None
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            if isinstance(x[key], float):  # the entropy sums -p log p over every code: the rare codes amplify
                # the float rounding by which two runs' weights differ (2.7e-5 after 2 steps, torchrun against one)
                limit = 10 * tol if key == "entropy" else tol
                assert abs(x[key] - y[key]) <= limit * max(1.0, abs(x[key])), (x["step"], key, x[key], y[key])
            else:
                assert x[key] == y[key], (x["step"], key)
