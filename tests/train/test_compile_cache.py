"""model.compile's cache across runs (train/build/compile_cache.py): a second process, with inductor's own
cache empty as on another node, loads the first one's compiled towers from the cache directory,
compiles no graph anew and gives the same gradients; a damaged cache file is ignored with a warning."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from megabatch.train.build.compile_cache import CompileCache

from ..helpers import ROOT, rel_error

RUN = """
import logging, sys, torch
from torch._dynamo.utils import counters
from megabatch.config.compose import compose
from megabatch.config.schema import validate
from megabatch.data.samples import SubBatch
from megabatch.distributed import init_distributed
from megabatch.runtime.process import configure_backends
from megabatch.train.build.parts import step_without_data

torch.set_num_threads(1)
logging.basicConfig(level=logging.INFO)
cfg = validate(compose("batch=8", "model.compile=true", "model.trim_text=false", "model.image.patch_dropout=0",
                       "data.cache_dir=" + sys.argv[1]))
env = init_distributed("cpu")
configure_backends(cfg, env.device)
step = step_without_data(cfg, env)
images, texts = step.model.example_inputs(8, torch.device("cpu"))  # uint8 images, as a loader gives them
step.gradients(iter([SubBatch(images, texts, None)]))
grads = torch.cat([p.grad.flatten() for p in step.model.parameters() if p.grad is not None])
torch.save({"grads": grads, "counters": {k: dict(v) for k, v in counters.items()}}, sys.argv[2])
"""


def compiled_run(cache_dir, out, inductor_dir) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir), "OMP_NUM_THREADS": "1"}
    ran = subprocess.run([sys.executable, "-c", RUN, str(cache_dir), str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return torch.load(out) | {"log": ran.stderr}


@pytest.mark.slow  # two compilations from scratch, 130 s on 2 cores: make test-all
def test_a_second_run_loads_the_compiled_towers_and_compiles_nothing(tmp_path):
    cache = tmp_path / "cache"
    first = compiled_run(cache, tmp_path / "first.pt", tmp_path / "inductor-1")
    assert first["counters"]["inductor"].get("fxgraph_cache_miss", 0) > 0  # compiled from scratch
    files = list((cache / "compile").glob("tiny-*.bin"))
    assert len(files) == 1 and "compiled towers kept in" in first["log"]
    second = compiled_run(cache, tmp_path / "second.pt", tmp_path / "inductor-2")  # inductor's own cache empty
    assert "compiled towers loaded from" in second["log"]
    assert second["counters"]["inductor"].get("fxgraph_cache_hit", 0) > 0
    assert second["counters"]["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert second["counters"].get("aot_autograd", {}).get("autograd_cache_miss", 0) == 0
    assert rel_error(second["grads"], first["grads"]) <= 1e-6


def test_a_damaged_or_unwritable_cache_is_a_warning_never_an_error(tmp_path, caplog, monkeypatch):
    damaged = tmp_path / "compile" / "tiny-0.bin"
    damaged.parent.mkdir()
    for content in (b"", b"not a cache", os.urandom(4096)):
        damaged.write_bytes(content)
        with caplog.at_level(logging.WARNING, logger="megabatch.train.build.compile_cache"):
            caplog.clear()
            assert CompileCache(damaged).load() is False
        assert "could not be loaded" in caplog.text and "ignored" in caplog.text
    blocked = tmp_path / "a file" / "tiny-0.bin"
    blocked.parent.write_text("")  # the cache's folder is a file: nothing can be written there
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"compiled", None))  # something to keep
    with caplog.at_level(logging.WARNING, logger="megabatch.train.build.compile_cache"):
        caplog.clear()
        CompileCache(blocked).save()
    assert "could not be written" in caplog.text


def test_the_compile_log_says_where_the_warm_ups_seconds_went():
    """``describe_split``: dynamo's timers' growth over a warm-up, in words; this torch still has the timers it reads
    (a compile through dynamo, its graph handed to a backend); a torch without them gets no account, no error."""
    from megabatch.train.build.compile_cache import FORWARD, INNER, TRACING, compile_timers, describe_split

    before = compile_timers()
    compiled = torch.compile(lambda x: torch.nn.functional.gelu(x) * 2 + 1, backend="eager")
    compiled(torch.randn(4, 3))
    after = compile_timers()
    assert {INNER, TRACING, FORWARD} <= after.keys()
    assert after[INNER] > before.get(INNER, 0.0)

    said = describe_split({INNER: 1.0, TRACING: 0.5}, {INNER: 4.0, TRACING: 1.5, FORWARD: 1.5,
                                                      "backward._backward_impl": 2.0, "async_compile.wait": 0.5}, 6.0)
    assert said == ("tracing 1.0 s, forward graphs 1.5 s, backward graphs 2.0 s, dynamo's other work 0.5 s; waiting "
                    "on the kernel compilers 0.5 s of those; running the calls 1.0 s")
    assert describe_split({}, {"something else": 1.0}, 3.0) == ""
