"""Tests for helpers/parallel.py's collectives as the process group's backend serves them, on CPU.

torchrun on GPUs runs NCCL, which takes CUDA tensors only; every torchrun test here runs gloo on the CPU, where CPU
tensors are fine. So a collective that sends a CPU tensor passes them all and crashes a GPU run at step 1 (issue 84).
These tests build what NCCL imposes on the CPU: an in-process group of torch's fake backend registered for CUDA only.

    python -m pytest -q tests/test_parallel.py
    GRPO_TEST_DEVICE=cuda python -m pytest -q tests/test_parallel.py    # on a GPU: NCCL itself, one process
"""

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from helpers import parallel, run, trainer


@pytest.fixture
def cuda_only_group():
    """A process group of 2 (this process rank 0) whose backend serves CUDA tensors only, as NCCL's does: torch's fake
    backend, which moves no data, registered as "cuda:fake"."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("cuda:fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def cuda_missing(error: BaseException) -> bool:
    """Whether `error` is torch saying this machine has no CUDA (no driver, no GPU, a CPU build)."""
    return any(words in str(error) for words in ("NVIDIA driver", "no CUDA GPUs", "not compiled with CUDA",
                                                  "CUDA driver"))


def test_collectives_on_the_backends_device(cuda_only_group, monkeypatch):
    """Under a backend that serves only CUDA, every collective of the training loop (the step's agreement, the rows
    per process, the stop, the metrics' merge, evaluation's and the variants' gathers) sends its tensors to the GPU:
    none raises torch's "No backend type associated with device type cpu" (what a CPU tensor raised at step 1).
    Without a GPU the one failure left is CUDA's absence."""
    assert parallel.collective_device() == torch.device("cuda")
    monkeypatch.setitem(parallel.INTERRUPT, "agreed", False)
    calls = {"all_agree": lambda: parallel.all_agree(True), "rows_per_process": lambda: parallel.rows_per_process(3),
             "stop_requested": parallel.stop_requested, "gather_rows": lambda: parallel.gather_rows(torch.ones(2, 3)),
             "gather_list": lambda: parallel.gather_list(["a prompt"]),
             "reduce_metrics": lambda: parallel.reduce_metrics({"kl": 0.1, "sequences": 4})}
    for name, call in calls.items():
        try:
            call()
        except Exception as error:  # noqa: BLE001 (which one is the test)
            assert "device type cpu" not in str(error), name
            assert not torch.cuda.is_available() and cuda_missing(error), (name, error)


@pytest.mark.parametrize("backend, device", [("gloo", "cpu"), ("nccl", "cuda"), ("cuda:nccl", "cuda"),
                                             ("cpu:gloo,cuda:nccl", "cpu"), ("mpi", "cpu"), ("cuda:fake", "cuda")])
def test_collective_device(monkeypatch, backend, device):
    """A collective's tensor goes where the backend serves it: the CPU when it serves the CPU (gloo, a cpu:gloo pair),
    else the process's GPU (NCCL, a cuda-only pair)."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert parallel.collective_device() == torch.device(device)


def test_collective_timeout(tmp_path, monkeypatch):
    """torchrun's collectives wait torch's 10 minutes, plus the longest a served reward can keep a process from them:
    7 tries of --reward-timeout and 63 s of waits, for each served reward of each group a step (or a share of the
    evaluation) scores; start_processes gives that to the process group, which fails a process only after it."""
    import grpo
    served = "http://127.0.0.1:9/judge"
    config = trainer.parse_config(grpo, ["--reward", f"ssim=1,{served}=0", "--reward-timeout", "30", "--prompts-per-step",
                                "3"])
    r = run.Run(config, tmp_path, 0, None, [], {"ssim": None, served: None}, None, grpo)
    assert run.collective_timeout(r) == 600 + 3 * (7 * 30 + 63)
    r.evals = ([{}] * 9, {"ssim": None, served: None, "http://127.0.0.1:9/other": None})  # 9 prompts, 2 served
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run.collective_timeout(r) == 600 + 5 * 2 * (7 * 30 + 63)  # 5 of the 9 on one process, 2 served each
    r.rewards, r.evals = {"ssim": None}, None
    assert run.collective_timeout(r) == 600  # no served reward: torch's default
    seen = {}
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(dist, "init_process_group", lambda backend, timeout: seen.update(backend=backend,
                                                                                       timeout=timeout))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    parallel.start_processes("cpu", 1883.0)
    assert seen == {"backend": "gloo", "timeout": datetime.timedelta(seconds=1883)}


@pytest.mark.skipif(os.environ.get("GRPO_TEST_DEVICE") != "cuda", reason="NCCL needs a GPU (GRPO_TEST_DEVICE=cuda)")
def test_collectives_under_nccl(monkeypatch):
    """On a GPU, NCCL itself (one process): every collective of the loop runs and gives its one-process value."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        assert parallel.collective_device() == torch.device("cuda")
        assert parallel.all_agree(True) and not parallel.all_agree(False)
        assert parallel.rows_per_process(3) == 3.0 and parallel.stop_requested() is False
        assert parallel.gather_rows(torch.ones(2, 3)).shape == (2, 3) and parallel.gather_list(["a"]) == ["a"]
        assert parallel.reduce_metrics({"kl": 0.1, "sequences": 4}) == {"kl": 0.1}
    finally:
        dist.destroy_process_group()
