"""Plants each guarded line wrong, one at a time, in a throwaway clone of this repository's HEAD, and runs the tests
that guard it: each must fail (exit 1). Prints one line per planted bug; exits 1 if any survived. The plants: issue
67's variants, issue 75's rules for what a user gives (helpers/user_input.py), issue 76's landing of a step,
issue 79's served reward's faults, issue 84's review, issue 85's surroundings, issue 86's train, issue 87's
objective, issue 88's monitor.

    OMP_NUM_THREADS=1 python tools/plant_bugs.py     # about 20 minutes on 2 cores (the resets' and stops' tests run main)
    python tools/plant_bugs.py gate cluster           # only the plants whose name holds one of these words
"""
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
PY = sys.executable


def variants(k: str) -> list[str]:
    return ["tests/test_variants.py", "-k", k]


def user_input(k: str) -> list[str]:
    return ["tests/test_user_input.py", "-k", k]


STOPS = ["tests/test_stops.py", "-k", "anywhere"]
SERVED = ["tests/test_served_reward.py"]
PLANTS = [
    ("dino cosine not clamped", "helpers/variants.py",
     "return (features @ features.T).clamp(-1, 1)", "return features @ features.T", variants("dino or similarity")),
    ("gardo_factor multiplies the negatives", "helpers/variants.py",
     "return torch.where(advantages < 0, torch.ones_like(d), relative)",
     "return torch.where(advantages < 0, relative, torch.ones_like(d))", variants("gardo")),
    ("gardo_factor not divided by the group's mean", "helpers/variants.py",
     "relative = torch.where(mean > 1e-6, d / mean.clamp(min=1e-6), torch.ones_like(d))",
     "relative = torch.where(mean > 1e-6, d, torch.ones_like(d))", variants("gardo")),
    ("nearest counts the sample itself", "helpers/variants.py",
     "return D.clone().fill_diagonal_(math.inf).min(-1).values", "return D.clone().min(-1).values", variants("gardo or cluster")),
    ("cluster: direct links only (no chain)", "helpers/variants.py",
     "        for _ in range(len(grid)):  # a chain has at most G - 1 links\n",
     "        for _ in range(0):\n", variants("cluster")),
    ("gate binds the certain, not the uncertain", "helpers/variants.py",
     "gated = (u > torch.quantile(", "gated = (u < torch.quantile(", variants("uncertain")),
    ("gate keeps A = 0 samples", "helpers/variants.py",
     ") & trained  # numpy's percentile", ")  # numpy's percentile", variants("uncertain")),
    ("ties ranked by place", "helpers/variants.py",
     "return 1 + above + (tied - 1) / 2", "return 1 + above", variants("rank or uncertain")),
    ("risk: grow and shrink swapped", "helpers/variants.py",
     "self.share = self.share * 1.1", "self.share = self.share * 0.9", variants("uncertain or risk or gardo")),
    ("reset: the anchor aliases the policy (no clone)", "helpers/variants.py",
     "self.anchor = [p.detach().clone() for p in self.trained()]",
     "self.anchor = [p.detach() for p in self.trained()]", variants("reset or gardo")),
    ("reset on the wrong step", "helpers/variants.py",
     "step - reference.last >= cfg.reference_reset_every", "step - reference.last > cfg.reference_reset_every",
     variants("reset or gardo")),
    ("reset count not restarted by the KL trigger", "helpers/variants.py",
     "step - reference.last >= cfg.reference_reset_every", "step % cfg.reference_reset_every == 0",
     variants("reset_schedule")),
    ("KL trigger reads the last update only", "helpers/parallel.py",
     '{"kl_peak": max(kls)}', '{"kl_peak": kls[-1]}', variants("reset_schedule")),
    ("last reset's step not saved", "helpers/variants.py",
     '"last": self.last}', "}", variants("reset_schedule or reference_reset")),
    ("an older checkpoint's last reset one step late", "helpers/variants.py",
     "reference.last = (step - 1) // cfg", "reference.last = step // cfg", variants("reset_schedule")),
    ("kl_peak taken over a NaN", "helpers/parallel.py",
     ' and math.isfinite(m["kl"])', "", ["tests/test_run.py", "-k", "merge_metrics"]),
    ("swap not restored", "helpers/variants.py",
     "            for p, v in zip(params, own):\n                p.copy_(v)\n",
     "            pass\n", variants("reset or gardo")),
    ("reference state not saved", "helpers/variants.py",
     'return {"weights": [gathered(w) for w in self.anchor], "last": self.last}', "return {}", variants("reset or gardo")),
]
PLANTS += [
    # issue 75: what a user gives (helpers/user_input.py)
    ("images: no EXIF orientation", "helpers/user_input.py", "image = ImageOps.exif_transpose(opened)  # a copy, upright",
     "image = opened.copy()", user_input("exif")),
    ("images: 16-bit clipped at 255", "helpers/user_input.py", "return values / 65535, []",
     "return np.clip(values, 0, 255) / 255, []", user_input("sixteen")),
    ("images: transparency over the stored colour", "helpers/user_input.py",
     "return rgba[..., :3] * alpha + (1 - alpha), notes", "return rgba[..., :3], notes", user_input("transparency")),
    ("prompts: str.splitlines", "helpers/user_input.py", "lines = LINE_END.split(text)",
     "lines = text.splitlines()", user_input("line_ends or captions")),
    ("prompts: the BOM kept", "helpers/user_input.py", 'text = data.decode("utf-8-sig")', 'text = data.decode("utf-8")',
     user_input("notepad or captions")),
    ("prompts: NUL bytes read (UTF-16 without a BOM)", "helpers/user_input.py", '    if b"\\0" in data:',
     "    if False:", user_input("json_lines")),
    ("prompts: JSON Lines by suffix only", "helpers/user_input.py",
     " or (bool(content) and is_json_object(content[0][1]))", "", user_input("json_lines")),
    ("rewards: the inputs shared", "helpers/user_input.py", "value = fn(images.clone(), copy.deepcopy(example))",
     "value = fn(images, example)", user_input("cannot_change")),
    ("rewards: autograd on", "helpers/user_input.py", "            with torch.no_grad():\n                value = fn(",
     "            with torch.enable_grad():\n                value = fn(", user_input("graph")),
    ("rewards: scores not detached", "helpers/user_input.py", "return value.detach().reshape(n)", "return value.reshape(n)",
     user_input("graph")),
    ("rewards: any shape taken", "helpers/user_input.py", "if shape not in ((n,), (n, 1), (1, n)):", "if False:",
     user_input("returns_refused")),
    ("rewards: checked on 2 images", "helpers/user_input.py", "fn(torch.full((3, 3, height, width), 0.5), example)",
     "fn(torch.full((2, 3, height, width), 0.5), example)", user_input("returns_refused")),
    ("numbers: infinity in range", "helpers/user_input.py",
     "if not math.isfinite(value) or (self.multiple > 1 and value % self.multiple):",
     "if self.multiple > 1 and value % self.multiple:", user_input("rules_refuse or out_of_range")),
    ("numbers: a flag without its rule", "helpers/user_input.py", '    "seed": Rule(0, SEEDS, "high"),\n', "",
     user_input("every_number or out_of_range")),
    ("rewards: a sys.exit in a reward exits the run", "helpers/user_input.py",
     "        except SystemExit as error:  # sys.exit,", "        except KeyError as error:  # sys.exit,",
     user_input("raises_is_named")),
    ("rewards: a file path not imported", "helpers/rewards.py", 'if where.endswith(".py") else None',
     "if False else None", user_input("parse_rewards")),
    ("rewards: a module's SyntaxError a traceback", "helpers/rewards.py",
     "    except Exception as error:\n        sys.stderr.write(printed.getvalue())",
     "    except ImportError as error:\n        sys.stderr.write(printed.getvalue())", user_input("parse_rewards")),
    ("rewards: a file imported each time it is named", "helpers/rewards.py", "    if name in sys.modules:  # the same file",
     "    if False:  # the same file", user_input("parse_rewards")),
    ("rewards: files named alike one module", "helpers/rewards.py",
     'name = "reward_file_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]', 'name = "reward_file_" + file.stem',
     user_input("parse_rewards")),
    ("rewards: a file's folder not searched", "helpers/rewards.py", "        sys.path.append(str(file.parent))",
     "        pass", user_input("parse_rewards")),
    ("rewards: a file path's '@' taken for a checkpoint", "helpers/user_input.py", 'if is_url(name) or ".py:" in name:',
     "if is_url(name):", user_input("parse_rewards")),
    ("numbers: an infinite reward weight", "helpers/user_input.py", "if not (math.isfinite(weight) and weight >= 0):",
     "if not weight >= 0:", user_input("parse_rewards")),
    ("logged: k3 below 0", "helpers/diagnostics.py", "(log_ratio.exp() - 1 - log_ratio).clamp_min(0).mean()",
     "(log_ratio.exp() - 1 - log_ratio).mean()", user_input("sign")),
    # issue 76: a step lands whole, or not at all
    ("landing: after_step outside it", "helpers/trainer.py",
     "                run.after_step(job, step, examples, images, reward, each)",
     "            run.after_step(job, step, examples, images, reward, each)", STOPS),
    ("landing: a checkpoint saves the RNG of now", "helpers/run.py", "carried, r.rng)", "carried)", STOPS),
    ("landing: an evaluation draws from training's RNG", "helpers/run.py",
     'with timed(seconds, "eval", r), rng_kept():', 'with timed(seconds, "eval", r):', STOPS),
    ("grids: the before grid outside the run's handlers", "helpers/run.py",
     "    try:\n        with interrupts_caught():  # Ctrl-C and SIGTERM: see parallel.on_interrupt\n"
     "            if r.cfg.before_after and r.start == 0:",
     "    if r.cfg.before_after and r.start == 0:\n        show(r, \"before.png\", \"before training\")\n    try:\n"
     "        with interrupts_caught():\n            if False:", ["tests/test_stops.py", "-k", "grids"]),
    ("grids: a reward failing in the after grid a traceback", "helpers/run.py",
     "    except RewardError as error:  # the model is saved;", "    except KeyError as error:  # the model is saved;",
     ["tests/test_stops.py", "-k", "grids"]),
    ("landing: a new run not seeded", "helpers/run.py", "        seed_everything(r.cfg.seed)\n", "        pass\n", STOPS),
    ("landing: a checkpoint before any update keeps the state get_state_dict made", "helpers/parallel.py",
     "        optimizer.state.clear()\n        optimizer_state = {", "        optimizer_state = {",
     ["tests/test_run.py", "-k", "trainable_state"]),
    ("schedule: once a step, not once an update", "helpers/trainer.py",
     "        if stepped and scheduler is not None:", "        if stepped and scheduler is not None and _ == mu - 1:",
     ["tests/test_run.py", "-k", "lr_schedule_steps"]),
    ("landing: one process never stops after it", "helpers/parallel.py",
     "    if stop_requested():\n        raise KeyboardInterrupt\n\n\ndef stop_requested",
     "    if distributed() and stop_requested():\n        raise KeyboardInterrupt\n\n\ndef stop_requested", STOPS),
    # issue 79: a reward in its own process
    ("served: no retry in the run", "helpers/served_reward.py",
     "waits = RETRY_WAITS if self.answered else ()", "waits = ()", SERVED),
    ("served: retries before the first answer", "helpers/served_reward.py",
     "waits = RETRY_WAITS if self.answered else ()", "waits = RETRY_WAITS", SERVED),
    ("served: a NaN taken as a score", "helpers/served_reward.py",
     "    if not all(math.isfinite(v) for v in values):", "    if False:", SERVED),
    ("served: a 500 retried", "helpers/served_reward.py",
     "RETRIED_STATUSES = (502, 503, 504)", "RETRIED_STATUSES = (500, 502, 503, 504)", SERVED),
    ("served: images sent as they are, not 8-bit PNGs", "helpers/served_reward.py",
     '    return PNG + base64.b64encode(buffer.getvalue()).decode("ascii")',
     '    return PNG + base64.b64encode(buffer.getvalue()).decode("ascii") if image.dim() < 0 else str(image.tolist())',
     SERVED),
    # issue 84: what a review with experiments found
    ("collectives: a CPU tensor under NCCL", "helpers/parallel.py",
     "t = torch.tensor(float(flag), device=collective_device())", "t = torch.tensor(float(flag))",
     ["tests/test_parallel.py"]),
    ("collectives: torch's 10 minutes whatever a served reward takes", "helpers/run.py",
     "    return COLLECTIVE_TIMEOUT + longest\n", "    return COLLECTIVE_TIMEOUT\n", ["tests/test_parallel.py"]),
    ("rewards: the reward's own buffer kept", "helpers/user_input.py", "dtype=torch.float32, copy=True)",
     "dtype=torch.float32)", user_input("reused_buffer")),
    ("kl: clamped at 0 in the loss", "grpo.py", "        kl = torch.exp(d) - d - 1  #",
     "        kl = (torch.exp(d) - d - 1).clamp_min(0)  #", ["test_grpo.py", "-k", "kl_gradient"]),
    ("stops: a forced stop promises a checkpoint", "helpers/run.py", '        print(f"interrupted: {to_continue(r)}"',
     '        print(f"interrupted: the last checkpoint is kept in {r.out}; continue it with: {resume_command(r)}"',
     ["tests/test_stops.py", "-k", "every_stop"]),
    ("stops: a read-only disk told to make room", "helpers/run.py", "    fix = fixes.get(error.errno, \"fix it, then \")",
     "    fix = \"make room, then \"", ["tests/test_stops.py", "-k", "every_stop"]),
    # issue 85: the run and its surroundings
    ("config: a key given twice, the last kept", "helpers/user_input.py",
     "            if key in lines:\n                raise DuplicateKey",
     "            if key in lines and False:\n                raise DuplicateKey", user_input("twice")),
    ("config: paths relative to the working directory", "helpers/user_input.py",
     "            values[key] = str((folder / Path(values[key]).expanduser()).absolute())",
     "            values[key] = str(Path(values[key]).expanduser().absolute())", user_input("config_paths")),
    ("resume: a changed input read as it is", "helpers/user_input.py",
     "        if file_digest(Path(path)) != digest:\n            return f\"{path} changed\"",
     "        if False:\n            return f\"{path} changed\"", ["tests/test_run.py", "-k", "own_inputs"]),
    ("run dir: two live runs into one --out", "helpers/run_io.py",
     "        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)", "        pass", ["tests/test_run.py", "-k", "one_run"]),
    ("served: loopback through the proxy", "helpers/served_reward.py",
     "    if loopback(parts.hostname) or urllib.request.proxy_bypass_environment",
     "    if urllib.request.proxy_bypass_environment", ["tests/test_served_reward.py", "-k", "proxy"]),
    ("served: the timeout between two bytes, not a deadline", "helpers/served_reward.py",
     "        worker.join(self.timeout)", "        worker.join()", ["tests/test_served_reward.py", "-k", "deadline"]),
    # issue 86: train, the lesson's loop, honours every field (test_grpo.py::test_train against main)
    ("train: the prompts in order whatever --shuffle", "grpo.py",
     "example_index(g, len(examples), cfg.seed, cfg.shuffle)", "example_index(g, len(examples), cfg.seed, False)",
     ["test_grpo.py", "-k", "test_train"]),
    ("train: --top-p dropped", "grpo.py", "cfg.top_k, cfg.top_p,\n", "cfg.top_k, 1.0,\n",
     ["test_grpo.py", "-k", "test_train"]),
    ("train: --decode-seed dropped", "grpo.py", "cfg.num_inference_steps, cfg.decode_seed,",
     "cfg.num_inference_steps, 0,", ["test_grpo.py", "-k", "test_train"]),
    # issue 87: the objective whose optimum is known
    ("kl in the reward: divided by the group's std", "helpers/variants.py",
     "    return shaped - shaped.mean(dim=-1, keepdim=True)\n",
     "    return (shaped - shaped.mean(dim=-1, keepdim=True)) / (shaped.std(dim=-1, keepdim=True) + 1e-4)\n",
     variants("kl_in_reward or kl_regularised")),
    ("kl in the reward: added, not taken off", "helpers/variants.py",
     "    shaped = reward - beta * (policy_logprobs - ref_logprobs)",
     "    shaped = reward + beta * (policy_logprobs - ref_logprobs)", variants("kl_in_reward or kl_regularised")),
    ("kl in the reward: the preview's codes summed too", "helpers/variants.py",
     "        first = math.prod(rollout.prompt.preview_hw) if start is None else start", "        first = 0",
     variants("kl_regularised")),
    ("mara: allowed with the KL in the loss", "helpers/variants.py",
     "    if cfg.mara_threshold is not None and not cfg.kl_in_reward:", "    if False:",
     variants("validate_kl_in_reward")),
    ("kl in the reward: its readings this process's only", "helpers/variants.py",
     '        readings["mara/augmented_share"] = gather_rows(high.float()).mean().item()',
     '        readings["mara/augmented_share"] = high.float().mean().item()', variants("every_process")),
    ("kl in the reward: the KL left in the loss too", "helpers/variants.py",
     "0.0 if cfg.kl_in_reward else cfg.kl_beta", "cfg.kl_beta", variants("loss_has_no_kl")),
    ("mara: anchored on the least likely", "helpers/variants.py",
     "    anchor = torch.where(high, ref_logprobs, -math.inf).argmax()",
     "    anchor = torch.where(high, ref_logprobs, math.inf).argmin()", ["tests/test_bandit.py", "-k", "mara"]),
    ("mara: the reference's log-ratio without beta", "helpers/variants.py",
     "reward[anchor] + beta * (ref_logprobs[anchor] - ref_logprobs)",
     "reward[anchor] + (ref_logprobs[anchor] - ref_logprobs)", ["tests/test_bandit.py", "-k", "mara"]),
    ("monitor: luma by the channels' mean", "helpers/monitor.py",
     "luma = rgb2gray(rgb)  # (N, H, W)", "luma = rgb.mean(axis=-1)  # (N, H, W)", ["tests/test_monitor.py", "-k", "not in_a_run"]),
    ("monitor: colourfulness without its mean term", "helpers/monitor.py",
     "            + 0.3 * np.hypot(rg.mean(axis=(1, 2)), yb.mean(axis=(1, 2)))}",
     "            + 0.0 * np.hypot(rg.mean(axis=(1, 2)), yb.mean(axis=(1, 2)))}", ["tests/test_monitor.py", "-k", "not in_a_run"]),
    ("monitor: the spread from the values, not their changes", "helpers/monitor.py",
     "spread = max(float(np.std(changes)) / math.sqrt(2),", "spread = max(float(np.std(values[:BASE])),", ["tests/test_monitor.py", "-k", "not in_a_run"]),
    ("monitor: one base for every prompt set", "helpers/monitor.py",
     "    return sets if sum(n for n in seen.values() if n >= max(FIRST, 2)) >= BASE / 2 else [()] * len(sets)",
     "    return [()] * len(sets)", ["tests/test_monitor.py", "-k", "not in_a_run"]),
    ("monitor: diversity warns with the token grids", "helpers/monitor.py",
     "past = past and (tokens is None or tokens > -1)", "past = past", ["tests/test_monitor.py", "-k", "not in_a_run"]),
    ("monitor: a signal warns every step", "helpers/monitor.py",
     "if threshold > 0 and past and name not in warned:", "if threshold > 0 and past:", ["tests/test_monitor.py", "-k", "not in_a_run"]),
]
rows = []
REPO = pathlib.Path(tempfile.mkdtemp()) / "repo"
subprocess.run(["git", "clone", "-q", str(ROOT), str(REPO)], check=True)
words = sys.argv[1:]
chosen = [plant for plant in PLANTS if not words or any(w in plant[0] for w in words)]
stale = [f"{name} ({(REPO / path).read_text().count(old)} places in {path})" for name, path, old, *_ in chosen
         if (REPO / path).read_text().count(old) != 1]
if stale:  # before any test runs: a plant whose line was rewritten names itself, rather than stopping the run midway
    sys.exit("plant_bugs.py: these plants no longer match their line once; update them: " + "; ".join(stale))
for name, path, old, new, tests in chosen:
    f = REPO / path
    text = f.read_text()
    f.write_text(text.replace(old, new))
    try:
        r = subprocess.run([PY, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", *tests],
                           cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-200:]
        failed = [l.split(" ")[1] for l in r.stdout.splitlines() if l.startswith("FAILED")]
        rows.append((name, "caught" if r.returncode == 1 else f"NOT caught (rc {r.returncode})", failed, last))
    finally:
        f.write_text(text)
    print(f"{rows[-1][1]:>9}: {name}  ({', '.join(rows[-1][2]) or rows[-1][3]})", flush=True)
shutil.rmtree(REPO.parent)
sys.exit(int(any(r[1] != "caught" for r in rows)))
