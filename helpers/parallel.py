"""Many processes for grpo.py: `torchrun --nproc-per-node N grpo.py ...` (torch.distributed + FSDP2).

Each process samples, decodes and scores whole groups of its own, so the algorithm never sees the world size;
FSDP2 (`torch.distributed.fsdp.fully_shard`) shards the AR's weights, gradients and AdamW state over the processes
and averages the gradients. Without torchrun every function here is an identity or a no-op, so grpo.py reads the
same for one process and for many.
"""

import contextlib
import datetime
import math
import os
import signal
import sys

import torch
import torch.distributed as dist


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


INNER_DELAY = 3.0  # seconds a phase runs before its bar shows: the real model's phases do, the tiny model's never


def bars_shown() -> bool:
    """Progress bars in a terminal; in a file (a cluster job's log, stderr redirected) none: a bar's carriage returns
    would fill it (helpers/run.py writes a plain line a step there instead)."""
    return sys.stderr.isatty()


def inner_bar(desc: str) -> dict:
    """tqdm's settings for a bar under the step's (the token draws, the DiT steps, an evaluation's prompts): on rank 0
    only, in a terminal only, shown once its work has run INNER_DELAY seconds, cleared when done."""
    shown = int(os.environ.get("RANK", 0)) == 0 and bars_shown()
    return {"desc": desc, "leave": False, "delay": INNER_DELAY, "disable": not shown}


def start_processes(device: str, timeout: float = 600.0) -> tuple[int, int, str]:
    """Under torchrun (WORLD_SIZE > 1): join the process group (NCCL on GPUs, gloo on the CPU), one GPU per process;
    a process waiting in a collective longer than `timeout` seconds for the others is failed (NCCL's watchdog, gloo's
    timeout). Returns (rank, world size, device). Without torchrun: (0, 1, device)."""
    cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if int(os.environ.get("WORLD_SIZE", 1)) == 1:
        return 0, 1, "cuda" if cuda else "cpu"
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size(), f"cuda:{local_rank}" if cuda else "cpu"


def stop_processes() -> None:
    """Under torchrun: leave the process group once every process is done. A gloo / NCCL thread still alive when
    the interpreter exits can abort the process ("terminate called without an active exception"; seen in CI)."""
    if distributed():
        dist.barrier()
        dist.destroy_process_group()


# ---- Sharding ------------------------------------------------------------------------------------

def unwrapped(model):
    """The GlmImageForConditionalGeneration inside a peft model (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def shard(model, dtype: torch.dtype) -> None:
    """FSDP2: every decoder layer of the AR's language model is one unit, the vision tower and the VQ one each (they
    only run to encode a source image, so text-to-image never gathers them), the rest of the AR (embeddings, lm_head,
    final norm) the root; a DiT (--train dit): every transformer block one unit, the rest the root. With bf16 the
    weights are gathered in bf16 and gradients averaged in float32. A frozen model (the KL reference of full
    fine-tuning) also reshards its root after each forward: no backward follows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    ar = unwrapped(model)  # with LoRA the inner AR: sharding the PeftModel would leave generate() half-gathered
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    # the mesh on the model's device: FSDP's default is CUDA whenever one is visible, even for --device cpu (gloo)
    mesh = init_device_mesh(next(ar.parameters()).device.type, (dist.get_world_size(),))
    if hasattr(ar, "transformer_blocks"):  # --train dit: the DiT, one unit per transformer block, the rest the root
        units = list(ar.transformer_blocks)
    else:
        units = [*ar.model.language_model.layers, ar.model.visual, ar.model.vqmodel]
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    frozen = not any(p.requires_grad for p in ar.parameters())
    fully_shard(ar, mesh=mesh, mp_policy=policy, reshard_after_forward=True if frozen else None)


def fsdp_units(model) -> list:
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def unsharded(model):
    """Gather every unit of the AR on entry and keep it gathered to the end of the block (one `generate`), then shard
    it again: left to itself, FSDP would all-gather every layer again for every generated token. Measured on the
    tiny model: 3 all-gathers per group instead of 521."""
    units = fsdp_units(model)
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()  # now, in every process: one with nothing to sample (evaluate) still joins the all-gather
    try:
        yield
    finally:
        for unit in units:
            unit.set_reshard_after_forward(unit is not units[0], recurse=False)  # the root stays gathered, as FSDP sets
            unit.reshard()


# ---- Collectives of the training loop -------------------------------------------------------------

def collective_device() -> torch.device:
    """The device of the tensors a collective sends: the CPU where the process group's backend serves it (gloo), else
    this process's GPU (start_processes set it). NCCL serves CUDA tensors only: a CPU tensor there raises "No backend
    type associated with device type cpu". (The object collectives, all_gather_object, pick their device themselves.)"""
    backend = dist.get_backend()  # a name ("nccl", "gloo") or "device:backend" pairs ("cpu:gloo,cuda:nccl")
    if ":" in backend:
        served = [pair.split(":")[0] for pair in backend.split(",")]
    else:
        served = dist.Backend.backend_capability.get(backend, ["cpu"])
    return torch.device("cpu") if "cpu" in served else torch.device("cuda")


def all_agree(flag: bool) -> bool:
    """True only if `flag` is true in every process (e.g. "my loss was finite")."""
    if not distributed():
        return flag
    t = torch.tensor(float(flag), device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def rows_per_process(n: int) -> float:
    """The mean of `n` over the processes (each process's sequences in the loss): FSDP averages the processes'
    gradients, so a loss that is a mean over this many rows per process is the mean over every process's rows."""
    if not distributed():
        return n
    t = torch.tensor(float(n), dtype=torch.float64, device=collective_device())
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def gather_rows(t: torch.Tensor) -> torch.Tensor:
    """(P, ...) on each process -> (world * P, ...) in rank order, on every process."""
    if not distributed():
        return t
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, t.detach().cpu())
    return torch.cat(parts)


def gather_list(items: list) -> list:
    if not distributed():
        return items
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, items)
    return [x for part in parts for x in part]


EXTREMES = {"ratio_min": min, "ratio_max": max, "sampler_gap": max, "skipped": max,
            "outside_truncation": sum}  # and names ending /max, /min; the rest: means


def extreme(key: str):
    """How a metric combines over micro-batches, updates or processes (min, max, sum), or None: a mean."""
    return EXTREMES.get(key) or {"/max": max, "/min": min}.get(key[-4:])


def merge_parts(parts: list[tuple[dict, float]]) -> dict:
    """Micro-batches' (metrics, share) -> one dict: extremes by rule, the rest means weighted by each part's share,
    over the parts that have the metric (an editing group has no preview region)."""
    keys = dict.fromkeys(k for m, _ in parts for k in m)
    return {k: extreme(k)([m[k] for m, _ in parts if k in m]) if extreme(k) else
            sum(m[k] * s for m, s in parts if k in m) / sum(s for m, s in parts if k in m)
            for k in keys}


def merge_metrics(updates: list[list[tuple[dict, float]]]) -> dict:
    """trainer.train_step's mu updates, each a list of micro-batches' (metrics, share) -> one dict: the last update's
    means, the extremes over all updates (counted once), the sampler's own readings (sampler_gap,
    outside_truncation) from the first update, and with mu > 1 kl_peak, the largest update's mean kl (GARDO's KL
    trigger reads every update's: variants.after_step)."""
    each, every = [merge_parts(update) for update in updates], merge_parts([part for update in updates for part in update])
    first, kls = each[0], [m["kl"] for m in each if "kl" in m and math.isfinite(m["kl"])]
    return {**each[-1], **{k: v for k, v in every.items() if extreme(k)},
            **{k: first[k] for k in ("sampler_gap", "outside_truncation") if k in first},
            **({"kl_peak": max(kls)} if len(updates) > 1 and kls else {})}


def reduce_metrics(metrics: dict) -> dict:
    """train_step's metrics of every process -> one dict: extremes and counts by their rule (`extreme`: min, max or
    sum), the rest averaged over the processes weighted by the sequences each had in the loss (its "sequences", which
    is not logged): the mean over every sequence in the loss, also when a group left the loss on one process."""
    metrics = dict(metrics)
    weight = metrics.pop("sequences", 1)
    if not distributed():
        return metrics
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (metrics, weight))
    keys = dict.fromkeys(k for part, _ in parts for k in part)  # a process that only edits has no preview/ metrics

    def mean(k: str) -> float:
        values = [(part[k], w) for part, w in parts if k in part]
        total = sum(w for _, w in values)
        if not total:  # no process had a sequence in the loss: the plain mean
            return sum(v for v, _ in values) / len(values)
        return sum(v * w for v, w in values) / total

    return {k: extreme(k)([part[k] for part, _ in parts if k in part]) if extreme(k) else mean(k) for k in keys}


# ---- State: the same checkpoint format for one process and for many ------------------------------

def trainable_state(policy, optimizer) -> tuple[dict, dict]:
    """Full (unsharded, on the CPU) state dicts of the trainable weights and of the optimizer, keyed by parameter
    name. Every process must call it; with FSDP only rank 0 receives the tensors. The format does not depend on the
    number of processes, so a checkpoint resumes on any number of them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    fresh = not optimizer.state  # no update applied yet: get_state_dict steps it once at lr 0 to make a state ...
    weights, optimizer_state = get_state_dict(policy, optimizer, options=options)
    if fresh:  # ... whose step count of 1 the next update would carry (AdamW's bias correction): put it back fresh
        optimizer.state.clear()
        optimizer_state = {**optimizer_state, "state": {}}
    return weights, optimizer_state


def load_trainable_state(policy, optimizer, state: dict) -> None:
    """Put what trainable_state returned (saved in a checkpoint) back into a fresh policy and optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    for group, saved in zip(optimizer.param_groups, state["optimizer"].get("param_groups", [])):
        for key, value in saved.items():  # keys a scheduler added (initial_lr), for an optimizer without one
            if key != "params":
                group.setdefault(key, value)
    set_state_dict(policy, optimizer, model_state_dict=state["weights"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(full_state_dict=True, strict=False))  # strict=False: frozen weights absent
    if not state["optimizer"].get("state"):  # saved before any update: fresh, as set_state_dict's own step left it not
        optimizer.state.clear()


def final_weights(policy) -> dict | None:
    """What save_pretrained should write: None in one process (it reads the model itself); with FSDP the full
    weights gathered on rank 0 (the adapter alone for a peft model)."""
    if not fsdp_units(policy):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    lora = hasattr(policy, "get_base_model")  # peft saves only the adapter: gather only the trainable weights
    return get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                 ignore_frozen_params=lora))


# ---- Ctrl-C and SIGTERM: a step lands whole, or not at all ------------------------------------------
# A step's work splits in two. Sampling, decoding and scoring change nothing the run carries, so a stop there drops
# the step (it is redone on resume). From the update on (the update, its log line, the learning-rate schedule, the
# reference, the variants' state, the image grid, the checkpoint when due: `landing` in helpers/run.py) a stop waits
# for the end. One process stops at once outside that part; many processes always finish the step, and stop together.

INTERRUPT = {"requested": False, "held": False, "forced": False, "agreed": False}


def on_interrupt(signum, frame) -> None:
    """SIGINT (Ctrl-C) or SIGTERM (a cluster's scheduler preempting the job). One process: stop at once, unless the
    step is landing (then when it has landed). Many processes: always land the step, so that every process stops at
    the same one. A second signal stops at once, without a checkpoint (the last one stays)."""
    if INTERRUPT["held"] or distributed():
        if not INTERRUPT["requested"]:
            INTERRUPT["requested"] = True
            if not distributed() or dist.get_rank() == 0:
                print("\ninterrupt: finishing this step, then saving (interrupt again to stop at once)",
                      file=sys.stderr)
            return
        INTERRUPT["forced"] = True
    raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_caught():
    """Handle SIGINT and SIGTERM with `on_interrupt` inside the block (torchrun passes Ctrl-C on as SIGTERM)."""
    INTERRUPT.update(requested=False, held=False, forced=False, agreed=False)
    previous = {sig: signal.signal(sig, on_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def interrupts_held():
    """Within this block an interrupt waits; when the block has run to its end, a stop asked for in any process
    (`stop_requested`) is raised, in every process at once."""
    INTERRUPT["held"] = True
    try:
        yield
    finally:
        INTERRUPT["held"] = False
    if stop_requested():
        raise KeyboardInterrupt


def stop_requested() -> bool:
    """Whether a stop was asked for, in any process (under torchrun every process learns it here, so every process
    must call it at the same points)."""
    if distributed():
        INTERRUPT["agreed"] = INTERRUPT["agreed"] or not all_agree(not INTERRUPT["requested"])
        return INTERRUPT["agreed"]
    return INTERRUPT["requested"]
