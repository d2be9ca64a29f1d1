"""``model.compile`` from cold caches on one GPU: a second process compiles the text tower's graphs while this one
compiles the image tower's, and this one then loads them from inductor's cache on disk.

A tower's graphs compile one after another in one process (dynamo's tracing and inductor's lowering hold the
interpreter), so a cold start waits for both towers' in turn: on one H200, 39-43 s of a ViT-B/16 4k run's 60 s first
step. The text tower's graphs need nothing of the image tower's, and inductor keeps what it compiles under keys of the
graph and its inputs' shapes, whichever process compiled it (``TORCHINDUCTOR_CACHE_DIR``, shared by the processes of a
node). So ``TextCompiler`` starts ``python -m megabatch.train.build.compile_text`` as soon as the run knows that it
will compile from cold caches (no kept sub-batch probes), before the probes; the process imports, builds the model
(seeded as the run's) and waits. Once the sub-batch is planned it is told the rows, compiles the text tower's graphs
(``ClipModel.warm_up(texts_only=True)``), and exits; the run compiles the image tower's meanwhile, waits for it, and
its text graphs then load. The graphs, the kept compile cache (``compile_cache.py``) and the numbers trained are those
of a run without it: only where the text tower's graphs were compiled differs.

Where it applies: CUDA, one process (a multi-GPU run's ranks each compile), ``model.compile`` without CUDA graphs,
FP8, FSDP, a caption decoder's loss or ``self_distill``'s views (whose calls take both towers together).
``MEGABATCH_COMPILE_HELPER=0`` turns it off. The second process holds the GPU memory the plan left
(``memory_bytes``); a process that fails, runs out of memory or takes too long leaves the run to compile the text
tower itself, as without it (a warning with the process's last lines).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("megabatch")

OFF = "MEGABATCH_COMPILE_HELPER"  # =0: the run compiles both towers itself
MARGIN_BYTES = 4e9                # kept free beside the two processes' plans: CUDA contexts, kernels, fragmentation
WAIT_S = 900.0                    # the longest wait() waits for the text tower's graphs


def wanted(settings, env) -> bool:
    """Whether a run of ``settings`` on ``env`` compiles its text tower in a second process (see the module)."""
    model = settings.model
    return (env.device.type == "cuda" and env.world_size == 1 and model.compile and not model.cuda_graphs
            and not model.fp8 and settings.trainer.parallel != "fsdp" and settings.caption_weight <= 0
            and not settings.self_distill.on and os.environ.get(OFF, "1") != "0")


class TextCompiler:
    """The second process, from this side: ``start``, then ``compile`` (the plan's rows) or ``stop``; ``wait``
    until it has compiled (what ``ClipModel.warm_up`` calls as ``text_elsewhere``)."""

    def __init__(self, process: subprocess.Popen, log_file, config_file: Path):
        self.process, self.log_file, self.config_file = process, log_file, config_file
        self.asked = False
        self.memory_bytes: float | None = None  # the GPU bytes it may hold (the plan's leftover; None: no limit)
        self.seconds = 0.0  # how long the run waited for it

    @classmethod
    def start(cls, cfg: DictConfig, device: torch.device, threads: int | None = None) -> TextCompiler:
        """Start the process for ``cfg`` (resolved) on ``device``; it imports and builds, then waits to be told.
        ``threads``: its inductor compile workers (``TORCHINDUCTOR_COMPILE_THREADS``; default half the cores, the run
        keeping its own)."""
        config = tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="megabatch-compile-text-", delete=False)
        with config:
            config.write(OmegaConf.to_yaml(cfg, resolve=True))
        log_file = tempfile.TemporaryFile("w+")
        env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": str(threads or max(1, (os.cpu_count() or 2) // 2))}
        if device.type == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(_visible_index(device))
        src = str(Path(__file__).resolve().parents[3])  # this megabatch, installed or not
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
        process = subprocess.Popen([sys.executable, "-m", "megabatch.train.build.compile_text", config.name,
                                    "cuda" if device.type == "cuda" else device.type],
                                   stdin=subprocess.PIPE, stdout=log_file, stderr=subprocess.STDOUT, text=True, env=env)
        return cls(process, log_file, Path(config.name))

    def compile(self, rows: int, graph_free: bool) -> None:
        """Tell it the rows a compiled call takes and whether GradCache's graph-free pass is compiled."""
        self._tell({"rows": int(rows), "graph_free": bool(graph_free), "memory_bytes": self.memory_bytes})
        self.asked = True

    def stop(self) -> None:
        """Nothing (more) to compile (the compile cache had it all, or the run failed): it exits, or is ended where it
        was already told to compile."""
        if self.process.poll() is None:
            if not self.asked:
                self._tell({"stop": True})
            try:
                self.process.wait(timeout=0 if self.asked else 30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._clean()

    def wait(self, timeout: float = WAIT_S) -> bool:
        """Until it has compiled the text tower's graphs; whether it did. A failure is a warning: the run then
        compiles them itself."""
        start = time.perf_counter()
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            code = None
        self.seconds = time.perf_counter() - start
        done = code == 0 and self.asked
        if not done:
            log.warning("model.compile: the process compiling the text tower's graphs %s; this process compiles them "
                        "(%s=0 turns that process off). Its last lines:\n%s",
                        "took too long" if code is None else f"ended with {code}", OFF, self.tail())
        self._clean()
        return done

    def wait_beside(self, images_s: float) -> bool:
        """``wait``, for as long as the image tower's graphs took this process (``images_s``) and half again, at least
        a minute: a second process slower than that gains nothing, and the run compiles the text tower itself."""
        return self.wait(timeout=max(60.0, 1.5 * images_s))

    def tail(self, lines: int = 12) -> str:
        self.log_file.seek(0)
        return "".join(self.log_file.readlines()[-lines:])

    def _tell(self, message: dict) -> None:
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.close()
        except (BrokenPipeError, OSError, ValueError):  # it ended already: wait() says how
            pass

    def _clean(self) -> None:
        self.config_file.unlink(missing_ok=True)


def _visible_index(device: torch.device) -> str:
    """``device``'s GPU as ``CUDA_VISIBLE_DEVICES`` names it for a child (this process may see a subset)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        names = [name.strip() for name in visible.split(",") if name.strip()]
        if index < len(names):
            return names[index]
    return str(index)


def memory_allowance(capacity_bytes: float, planned_bytes: float) -> float | None:
    """The GPU bytes the second process may hold beside a run whose plan peaks at ``planned_bytes``; None where
    too little is left for it to be worth starting (under 2 GB)."""
    left = capacity_bytes - planned_bytes - MARGIN_BYTES
    return left if left >= 2e9 else None


def main(argv: list[str]) -> int:
    """The second process: build the run's model, wait for the rows, compile the text tower's graphs."""
    from ...runtime.process import configure_process

    configure_process()
    config_path, device_type = argv
    cfg = OmegaConf.load(config_path)
    from ...config.run import RunSettings
    from ...distributed import init_distributed
    from ...runtime.process import configure_backends
    from .parts import build_model_for, compile_scope, precision_of

    logging.basicConfig(level=logging.INFO, format="compile_text: %(message)s")
    env = init_distributed(device_type)
    configure_backends(cfg, env.device)
    settings = RunSettings.of(cfg)
    model = build_model_for(cfg, settings, env)
    precision = precision_of(settings, env)
    line = sys.stdin.readline()
    if not line:
        return 0  # the run ended
    asked = json.loads(line)
    if asked.get("stop"):
        return 0
    if asked.get("memory_bytes") and env.device.type == "cuda":
        capacity = torch.cuda.get_device_properties(env.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, asked["memory_bytes"] / capacity), env.device)
    start = time.perf_counter()
    model.trim_text(settings.model.trim_text and settings.caption_weight <= 0)  # as build_step does
    model.compile_towers(asked["rows"], scope=compile_scope(settings.model))
    model.warm_up(asked["rows"], env.device, precision.autocast, graph_free=asked["graph_free"], texts_only=True)
    log.info("the text tower's graphs compiled in %.1f s", time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
