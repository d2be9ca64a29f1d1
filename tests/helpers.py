"""Test helpers: spawn N gloo ranks on the CPU, relative errors, one step's gradients on a fixed
batch, running the entry points as a user does."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megabatch.config.compose import CONFIGS, compose
from megabatch.models import build_model

ROOT = CONFIGS.parent

# for tests that run the Triton kernels in models built on the CPU: there the kernels run only through
# the interpreter (conftest sets it where no GPU is; a GPU machine runs the kernels' own tests instead)
interpreted_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="a CPU model: its Triton kernels need TRITON_INTERPRET=1")


def record_calls(monkeypatch, owner, name: str, record=lambda *args, **kwargs: None) -> list:
    """Wrap ``owner.name`` (for the test) so that each call first appends ``record(*args, **kwargs)``
    to the list returned, then runs the real function."""
    calls, real = [], getattr(owner, name)

    def wrapper(*args, **kwargs):
        calls.append(record(*args, **kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# run_ranks forks its ranks from a server process that has imported these once (per pytest worker), not
# from a fresh interpreter each that imports torch and megabatch again (about 4 s of CPU a rank)
_PRELOAD = ["torch", "torch.distributed", "megabatch.config", "megabatch.models", "megabatch.train.trainer.loop"]
# a collective that waits this long fails the test with gloo's timeout error instead of gloo's default of 30 minutes
# (past pytest's own limit, so a deadlocked test would end as a bare timeout); the tests' collectives carry a few
# tensors, their slowest wait is another rank running interpreted Triton kernels on 2 cores
RANK_TIMEOUT = timedelta(minutes=5)


def _worker(rank: int, world: int, port: int, fn, args, out_dir: str, environ: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment now, not the fork server's from when it started
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=RANK_TIMEOUT)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except Exception:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn, *args, tmp_path: Path) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks, forked from a fork server that has torch and
    megabatch imported (each rank a fresh process with the caller's environment); return their results.

    ``fn`` must be importable (module level) and return something ``torch.save`` can write.
    """
    out_dir = tmp_path / f"ranks{world}"
    out_dir.mkdir(exist_ok=True)
    multiprocessing.set_forkserver_preload(_PRELOAD)  # read when the server starts (the first call)
    mp.start_processes(
        _worker, args=(world, free_port(), fn, args, str(out_dir), dict(os.environ)), nprocs=world,
        start_method="forkserver", join=True,
    )
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise relative error ``|a - e| / |e|`` (in float64)."""
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-300))


GLOBAL_BATCH = 12


def preprocess(size: int = 32, **overrides) -> dict:
    """A model's preprocessing config (OpenAI CLIP's values unless overridden) at ``size`` pixels."""
    from megabatch.models.preprocess import resolve_preprocess

    return resolve_preprocess({}, overrides, size, "model.preprocess")


def fixed_batch(tokenize):
    """Random images and real captions, tokenised by ``tokenize`` (the model's tokenizer)."""
    generator = torch.Generator().manual_seed(123)
    images = torch.randn(GLOBAL_BATCH, 3, 32, 32, generator=generator)
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    captions = [f"a handwritten {words[i % 10]} number {i}" for i in range(GLOBAL_BATCH)]
    return images, tokenize(captions)


def gradients(rank: int, world: int, overrides: list[str]) -> dict[str, torch.Tensor]:
    """Gradients (DDP-averaged when world > 1) of one ``TrainStep`` on this rank's share of a
    fixed global batch of ``GLOBAL_BATCH``."""
    from hydra.utils import instantiate

    from megabatch.data.samples import SubBatch
    from megabatch.train.step.step import TrainStep

    cfg = compose(*overrides)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    step = TrainStep(model, instantiate(cfg.loss), None, torch.device("cpu"), precision="fp32")
    images, texts = fixed_batch(model.tokenizer())
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    step.gradients(iter([SubBatch(images[rows], texts[rows], None)]))
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def build_parts(cfg, device: str = "cpu"):
    """A run's parts as the trainer builds them: the process-wide settings first, then ``RunParts``."""
    from megabatch.distributed import init_distributed
    from megabatch.runtime.process import configure_backends
    from megabatch.train.build.parts import RunParts

    env = init_distributed(device)
    configure_backends(cfg, env.device)
    return RunParts.build(cfg, env)


def run_script(*args: str, cwd) -> subprocess.CompletedProcess:
    """Run ``python <args>`` in ``cwd`` as a user would; fail the test with its output on error."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
    result = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


TORCHRUN_RUN = ["batch=64", "trainer.max_steps=12", "trainer.log_every=1", "trainer.ckpt_every=100", "eval=none",
                "data.train.shuffle_buffer=64", "model.image.patch_dropout=0"]


def torchrun(cwd, *args: str, launcher: tuple[str, ...] = (), script: Path | None = None,
             env: dict[str, str] | None = None) -> subprocess.Popen:
    """``torchrun --nproc_per_node=2 [launcher...] train.py`` (or ``script``) with a 12-step tiny run,
    then ``args``, with ``env`` added to the environment, in a session of its own (``finish`` ends
    all of it); output (stdout and stderr together) on a pipe."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", *launcher,
               str(script or ROOT / "train.py"), *TORCHRUN_RUN, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def finish(job: subprocess.Popen, timeout: float = 300) -> str:
    """``job``'s output once it ends; past ``timeout`` every process of its session is killed (no
    worker left behind) and the output so far raised."""
    try:
        return job.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, 9)
        raise AssertionError(f"still running after {timeout} s:\n{job.communicate()[0][-3000:]}") from None


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """torchrun's worker processes: rank -> pid."""
    pids = {}
    for child in Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split():
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        rank = [item[5:] for item in environ if item.startswith(b"RANK=")]
        if rank:
            pids[int(rank[0])] = int(child)
    return pids


def assert_compiles_whole(fn, tensors, tolerance: float = 1e-5) -> None:
    """``torch.compile(fn, fullgraph=True)`` traces ``fn`` (a custom op is no graph break) and gives
    eager's value of ``fn(*tensors)`` (a scalar) and gradients with respect to ``tensors``."""
    import torch

    torch._dynamo.reset()
    eager = fn(*tensors)
    eager_grads = torch.autograd.grad(eager, tensors)
    compiled = torch.compile(fn, fullgraph=True)(*tensors)
    compiled_grads = torch.autograd.grad(compiled, tensors)
    assert rel_error(compiled.detach(), eager.detach()) <= tolerance
    for want, got in zip(eager_grads, compiled_grads, strict=True):
        assert rel_error(got, want) <= tolerance


def sample_keys(tar_path) -> list[str]:
    """The sample keys of a tar shard, sorted."""
    import tarfile

    with tarfile.open(tar_path) as tar:
        return sorted({member.name.split(".")[0] for member in tar.getmembers()})


def rewrite_members(tar_path, change: dict) -> None:
    """``tar_path`` written again with each member ``change`` names dropped (``None``) or holding other bytes."""
    import io
    import tarfile

    with tarfile.open(tar_path) as tar:
        members = [(member, tar.extractfile(member).read()) for member in tar.getmembers()]
    with tarfile.open(tar_path, "w") as tar:
        for member, data in members:
            if member.name in change:
                data = change[member.name]
                if data is None:
                    continue
                member.size = len(data)
            tar.addfile(member, io.BytesIO(data))

