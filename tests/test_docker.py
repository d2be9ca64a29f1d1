"""What can be checked of the Docker image without a Docker engine (none on CI or the GPU machines):
the Dockerfile parses, its base has a C compiler (a devel image) whose torch and CUDA meet
requirements.txt, pip is held to the base's torch, the build context leaves the heavy folders out,
and the smoke script is there and parses."""

from __future__ import annotations

import re
import subprocess

from packaging.requirements import Requirement
from packaging.version import Version

from .helpers import ROOT

INSTRUCTIONS = {"FROM", "ARG", "ENV", "WORKDIR", "COPY", "ADD", "RUN", "CMD", "ENTRYPOINT", "HEALTHCHECK",
                "EXPOSE", "LABEL", "USER", "VOLUME", "SHELL", "STOPSIGNAL", "ONBUILD"}


def instructions() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of docker/Dockerfile, continuation lines joined."""
    logical, current = [], ""
    for line in (ROOT / "docker" / "Dockerfile").read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            logical.append(current)
            current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    return [(text.split(None, 1)[0], text.split(None, 1)[1]) for text in logical]


def test_the_dockerfile_parses_and_its_base_meets_the_requirements():
    parsed = instructions()
    assert all(name in INSTRUCTIONS for name, _ in parsed), [n for n, _ in parsed if n not in INSTRUCTIONS]
    args = dict(re.fullmatch(r"(\w+)=(\S+)", value).groups() for name, value in parsed
                if name == "ARG" and "=" in value)
    base = next(value for name, value in parsed if name == "FROM")
    image = re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], base)
    match = re.fullmatch(r"pytorch/pytorch:(?P<torch>[\d.]+)-cuda(?P<cuda>[\d.]+)-cudnn\d+-(?P<flavour>\w+)", image)
    assert match, image
    assert match["flavour"] == "devel", "Triton needs a C compiler: the runtime images have none"
    pins = {Requirement(line).name: Requirement(line) for line in (ROOT / "requirements.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")}
    assert Version(match["torch"]) in pins["torch"].specifier, (image, pins["torch"])
    assert Version(match["cuda"]) >= Version("12.0")  # Hopper kernels, bf16
    build = " ".join(value for name, value in parsed if name == "RUN")
    assert "-c /tmp/base-constraints.txt -r requirements.txt" in build  # pip keeps the base's torch


def test_the_build_context_leaves_out_environments_runs_and_caches():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".venv", ".git", "runs", ".ci-cache", "docs/bench", "wandb"} <= ignored


def test_the_smoke_script_is_executable_and_parses():
    smoke = ROOT / "docker" / "smoke.sh"
    assert smoke.stat().st_mode & 0o111
    subprocess.run(["bash", "-n", str(smoke)], check=True)
    healthcheck = next(value for name, value in instructions() if name == "HEALTHCHECK")
    assert "docker/smoke.sh" in healthcheck
