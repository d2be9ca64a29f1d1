"""Ranks from SLURM when there is no torchrun: ``srun python train.py`` with one task per GPU.

``srun`` starts every task itself and tells each where it stands (``SLURM_PROCID``, ``SLURM_NTASKS``,
``SLURM_LOCALID``); torch's ``env://`` rendezvous wants ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``. ``torchrun_env`` translates: the master is the first host of the job's node list
(its compressed form, ``gpu[01-04,07]``, is expanded here: ``scontrol`` may be absent on compute
nodes) and the port is derived from the job id, so concurrent jobs sharing a node do not collide.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping

TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK")
PORT_BASE, PORT_SPAN = 20000, 10000  # 20000-29999: below Linux's ephemeral range (32768-60999)
_ITEM = re.compile(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*|\[[^\]]*\][^,\[]*")


def expand_nodelist(nodelist: str) -> list[str]:
    """Every host of a SLURM node list: ``node[01-03,07],gpu5`` -> node01 node02 node03 node07 gpu5.
    Ranges keep their zero padding; several bracket groups in one name multiply
    (``rack[1-2]-n[1-2]`` -> rack1-n1 rack1-n2 rack2-n1 rack2-n2)."""
    hosts: list[str] = []
    for item in _ITEM.findall(nodelist.replace(" ", "")):
        choices = []
        for part in re.split(r"(\[[^\]]*\])", item):
            if part.startswith("["):
                choices.append([name for span in part[1:-1].split(",") if span for name in _span(span, nodelist)])
            elif part:
                choices.append([part])
        hosts.extend("".join(parts) for parts in itertools.product(*choices))
    if not hosts:
        raise ValueError(f"SLURM node list {nodelist!r} names no host")
    return hosts


def _span(span: str, nodelist: str) -> list[str]:
    first, dash, last = span.partition("-")
    if not dash:
        return [first]
    if not (first.isdigit() and last.isdigit()) or int(last) < int(first):
        raise ValueError(f"SLURM node list {nodelist!r}: cannot read the range {span!r}")
    return [str(number).zfill(len(first)) for number in range(int(first), int(last) + 1)]


def master_port(job_id: str) -> int:
    """A port for the job's rendezvous, the same on every task of the job."""
    digits = re.sub(r"\D", "", job_id) or "0"  # array jobs: 1234_7
    return PORT_BASE + int(digits) % PORT_SPAN


def torchrun_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The torchrun variables a SLURM task lacks, or ``{}`` when torchrun set them already or this
    is not a SLURM task. ``MASTER_ADDR``/``MASTER_PORT`` already in the environment win."""
    if any(name in environ for name in TORCHRUN_VARS):
        return {}
    if "SLURM_PROCID" not in environ or "SLURM_NTASKS" not in environ:
        return {}
    world = environ.get("SLURM_STEP_NUM_TASKS") or environ["SLURM_NTASKS"]  # srun sets the step's own
    nodelist = (environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
                or environ.get("SLURM_NODELIST") or "localhost")
    return {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": world,
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or expand_nodelist(nodelist)[0],
        "MASTER_PORT": environ.get("MASTER_PORT") or str(master_port(environ.get("SLURM_JOB_ID", "0"))),
    }
