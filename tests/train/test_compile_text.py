"""model.compile from cold caches: a second process compiles the text tower's graphs while the run compiles the image
tower's (train/build/compile_text.py); the run's text graphs then load from inductor's cache, and a failed process
leaves the run to compile them itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from megabatch.config.run import RunSettings
from megabatch.train.build import compile_text
from megabatch.train.build.compile_text import TextCompiler, memory_allowance, wanted

from ..helpers import compose

SRC = str(Path(__file__).parents[2] / "src")

# a run's build in a fresh interpreter (inductor's cache directory is read once per process), the CPU standing in for
# the GPU: the second process starts before the sub-batch is planned, is told the rows, and compiles the text tower's
# graphs while the run compiles the image tower's; then one step
SPLIT = """
import logging
from torch._dynamo.utils import counters
from megabatch.config.compose import compose
from megabatch.config.schema import validate
from megabatch.distributed import init_distributed
from megabatch.runtime.process import configure_backends
from megabatch.train.build import compile_text
from megabatch.train.build.parts import RunParts

compile_text.wanted = lambda settings, env: settings.model.compile  # as on one GPU
logging.basicConfig(level=logging.INFO)
cfg = validate(compose("model=tiny", "model.compile=true", "model.image.layers=2", "model.text.layers=2", "batch=8",
                       "trainer.sub_batch=auto", "eval=none", "optim=sgd", "trainer.max_steps=1"))
env = init_distributed("cpu")
configure_backends(cfg, env.device)
parts = RunParts.build(cfg, env)
hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
assert hits >= 3 and misses >= 3, (hits, misses)  # the text tower's graphs loaded, the image tower's compiled here
graphs = counters["stats"]["unique_graphs"]
loss, _ = parts.step.gradients(parts.inputs(0))
assert counters["stats"]["unique_graphs"] == graphs and loss.isfinite(), "a step compiled a graph"
parts.close()
print("hits", hits, "misses", misses)
"""


def test_the_text_towers_graphs_compile_in_a_second_process_and_load_in_the_run(tmp_path):
    script = tmp_path / "split.py"
    script.write_text(SPLIT)
    env = {**os.environ, "PYTHONPATH": SRC, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "hits" in result.stdout and "in a second process" in result.stderr


def test_a_failed_second_process_leaves_the_run_to_compile_the_text_tower(caplog):
    """It ends with an error before it is told anything: ``wait`` says so (a warning with its last lines) and the
    warm-up goes on, compiling the text tower itself."""
    failing = subprocess.Popen([sys.executable, "-c", "import sys; print('no GPU here'); sys.exit(3)"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    helper = TextCompiler(failing, open(os.devnull, "w+"), Path(os.devnull + ".absent"))
    helper.compile(4, graph_free=False)
    with caplog.at_level("WARNING", logger="megabatch"):
        assert helper.wait() is False
    assert "ended with 3" in caplog.text and compile_text.OFF in caplog.text


def test_it_is_wanted_for_one_gpu_and_cold_caches_only(monkeypatch):
    """CUDA, one process, ``model.compile`` without CUDA graphs, FP8, FSDP, a caption loss or self_distill's views;
    ``MEGABATCH_COMPILE_HELPER=0`` turns it off. The memory it may hold: what the plan leaves, less a margin."""
    one_gpu = SimpleNamespace(device=torch.device("cuda", 0), world_size=1)

    def settings(*overrides):
        return RunSettings.of(compose("model.compile=true", *overrides))

    assert wanted(settings(), one_gpu)
    assert not wanted(settings(), SimpleNamespace(device=torch.device("cpu"), world_size=1))
    assert not wanted(settings(), SimpleNamespace(device=torch.device("cuda", 0), world_size=2))
    assert not wanted(settings("model.compile=false"), one_gpu)
    assert not wanted(settings("trainer.parallel=fsdp"), one_gpu)
    monkeypatch.setenv(compile_text.OFF, "0")
    assert not wanted(settings(), one_gpu)
    assert memory_allowance(141e9, 100e9) == 141e9 - 100e9 - compile_text.MARGIN_BYTES
    assert memory_allowance(80e9, 75e9) is None
