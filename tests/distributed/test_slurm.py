"""SLURM without torchrun: ranks from srun's variables, the master from the node list."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from megabatch.distributed.slurm import expand_nodelist, master_port, torchrun_env

from ..helpers import ROOT, free_port, gradients, rel_error

NODELISTS = [  # forms seen on real clusters
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("gpu[1-3]", ["gpu1", "gpu2", "gpu3"]),
    ("cn[0998-1001]", ["cn0998", "cn0999", "cn1000", "cn1001"]),
    ("a[1-2],b3,c[05,07]", ["a1", "a2", "b3", "c05", "c07"]),
    ("gpu-a100-[001-002]", ["gpu-a100-001", "gpu-a100-002"]),
    ("node[1,3-4]-ib", ["node1-ib", "node3-ib", "node4-ib"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("n1.cluster.local,n2.cluster.local", ["n1.cluster.local", "n2.cluster.local"]),
    ("jwb[0001,0003-0004]", ["jwb0001", "jwb0003", "jwb0004"]),
    ("nid[001234-001235]", ["nid001234", "nid001235"]),
]


@pytest.mark.parametrize("nodelist, hosts", NODELISTS)
def test_nodelist_expansion(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[3-1]", "node[a-c]", ""])
def test_a_nodelist_that_cannot_be_read_is_an_error(bad):
    with pytest.raises(ValueError, match="node list"):
        expand_nodelist(bad)


def test_slurm_variables_become_torchrun_variables():
    slurm = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "123456",
             "SLURM_JOB_NODELIST": "gpu[07-08]"}
    assert torchrun_env(slurm) == {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu07",
                                   "MASTER_PORT": str(20000 + 123456 % 10000)}
    assert torchrun_env({**slurm, "SLURM_STEP_NUM_TASKS": "8"})["WORLD_SIZE"] == "8"  # srun's own step
    assert torchrun_env({**slurm, "MASTER_ADDR": "head", "MASTER_PORT": "1234"})["MASTER_ADDR"] == "head"
    assert torchrun_env({**slurm, "WORLD_SIZE": "2", "RANK": "0"}) == {}  # torchrun inside srun: torchrun's
    assert torchrun_env({}) == {}
    assert master_port("1234_7") == master_port("12347")  # array jobs


def launch_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "TORCHELASTIC"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    return {**env, "PYTHONPATH": f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}", **extra}


def free_job_id() -> str:
    """A job id whose derived port is free here."""
    for job in range(4242, 4242 + 10000, 37):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", master_port(str(job))))
                return str(job)
            except OSError:
                continue
    raise RuntimeError("no free port in the SLURM range")


def results(folder) -> list[dict]:
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.slow  # 37-46 s on 2 cores (srun-launched ranks against torchrun's): make test-all
def test_srun_variables_alone_give_the_torchrun_gradients(tmp_path):
    worker = [sys.executable, "-m", "tests.distributed.rank_gradients"]
    (tmp_path / "slurm").mkdir()
    (tmp_path / "torchrun").mkdir()
    job = free_job_id()
    tasks = [subprocess.Popen([*worker, str(tmp_path / "slurm")], cwd=ROOT, env=launch_env(
        SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank), SLURM_JOB_ID=job,
        SLURM_JOB_NODELIST="localhost", SLURM_NODEID="0"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True) for rank in range(2)]
    for task in tasks:
        output, _ = task.communicate(timeout=300)
        assert task.returncode == 0, output[-3000:]
    torchrun = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                               f"--master_port={free_port()}", "-m", "tests.distributed.rank_gradients",
                               str(tmp_path / "torchrun")], cwd=ROOT, env=launch_env(), capture_output=True,
                              text=True, timeout=300)
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    slurm, reference = results(tmp_path / "slurm"), results(tmp_path / "torchrun")
    assert [(r["rank"], r["world"], r["local"]) for r in slurm] == [(0, 2, 0), (1, 2, 1)]
    for ours, theirs in zip(slurm, reference, strict=True):
        assert ours["grads"].keys() == theirs["grads"].keys() and "clip.logit_scale" in ours["grads"]
        for name, grad in theirs["grads"].items():
            assert torch.equal(ours["grads"][name], grad), name
    # not vacuous: a rank that trained alone on its half (no rendezvous) would be far off
    alone = gradients(0, 2, ["loss=vanilla"])
    assert rel_error(alone["clip.logit_scale"], slurm[0]["grads"]["clip.logit_scale"]) > 1e-3
