"""The compiled towers kept across runs (``model.compile``): torch's portable cache artifacts
(``torch.compiler.save_cache_artifacts``: inductor's compiled graphs, AOTAutograd's, Triton's kernels
and autotuning results) written under ``<data.cache_dir>/compile/`` (``$MEGABATCH_CACHE``) after the
towers' warm-up, and loaded before it by the next run of the same model and shapes. A resumed run,
the second run of a model and every sweep job after the first then find their graphs compiled, also
on another node or a fresh GPU machine when the cache directory is shared.

One file per key: the model's config, the sub-batch rows, whether GradCache's graph-free pass is
compiled, the precision, the GPU, and the torch, Triton, CUDA and Python versions. A file that does
not load (damaged, cut short, written by another torch) is ignored with a warning and the towers
compile as without it; a file that cannot be written is a warning too.
"""

from __future__ import annotations

import logging
import platform
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from ...runtime.files import replace_whole
from .cache_keys import keyed_file, library_versions

log = logging.getLogger(__name__)

FORMAT = 2  # bumped when what goes into a key, or what is compiled for it, changes


def cache_key(cfg: DictConfig, rows: int, graph_free: bool, device: torch.device,
              image_rows: dict[int, int] | None = None) -> dict:
    """What a compiled tower depends on, as a JSON-able dict (``image_rows``: a NaFlex tower's rows per sequence
    length where a token budget joins sub-batches, ``trainer.sub_batch_tokens``)."""
    return {"format": FORMAT, "model": OmegaConf.to_container(cfg.model, resolve=True), "rows": int(rows),
            "graph_free": bool(graph_free), "precision": cfg.trainer.precision,
            "feature_dtype": cfg.trainer.feature_dtype,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            **library_versions(), "python": platform.python_version(),
            # a NaFlex tower's images: one graph per sequence length the data draws
            "naflex_seq_lens": OmegaConf.to_container(cfg.data.naflex, resolve=True) if "naflex" in cfg.data else None,
            **({"image_rows": {str(k): int(v) for k, v in image_rows.items()}} if image_rows else {})}


def cache_file(cfg: DictConfig, rows: int, graph_free: bool, device: torch.device,
               image_rows: dict[int, int] | None = None) -> Path:
    """``<data.cache_dir>/compile/<model name>-<hash of the key>.bin``."""
    return keyed_file(cfg, "compile", cache_key(cfg, rows, graph_free, device, image_rows), "bin")


# dynamo's own timers (``torch._dynamo.utils.compile_times``, process totals): where a warm-up's seconds went.
# ``_compile.compile_inner`` holds the tracing, the forward graphs (AOTAutograd, inductor, or their caches) and the
# guards; a backward graph compiles at its first call; the kernel compilers' workers are waited on inside both
INNER, TRACING, FORWARD = "_compile.compile_inner", "bytecode_tracing", "OutputGraph.call_user_compiler"
BACKWARD, KERNELS = "backward._backward_impl", "async_compile.wait"


def compile_timers() -> dict[str, float]:
    """Dynamo's timers so far, seconds by name; empty where this torch has none."""
    try:
        from torch._dynamo.utils import compile_times

        names, values = compile_times(repr="csv", aggregate=True)
        return {str(name): float(value) for name, value in zip(names, values, strict=True)}
    except Exception:  # noqa: BLE001 - an account, never a reason to stop
        return {}


def describe_split(before: dict[str, float], after: dict[str, float], seconds: float) -> str:
    """``'tracing 2.1 s, forward graphs 3.0 s, ...'``: the timers' growth from ``before`` to ``after`` over a
    warm-up of ``seconds``; '' where this torch's timers lack dynamo's total."""
    grew = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    if INNER not in grew:
        return ""
    tracing, forward, backward = grew.get(TRACING, 0.0), grew.get(FORWARD, 0.0), grew.get(BACKWARD, 0.0)
    other, running = max(0.0, grew[INNER] - tracing - forward), max(0.0, seconds - grew[INNER] - backward)
    return (f"tracing {tracing:.1f} s, forward graphs {forward:.1f} s, backward graphs {backward:.1f} s, dynamo's "
            f"other work {other:.1f} s; waiting on the kernel compilers {grew.get(KERNELS, 0.0):.1f} s of those; "
            f"running the calls {running:.1f} s")


def _misses() -> int:
    """Graphs compiled anew in this process so far (inductor's and AOTAutograd's cache misses)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"])


class CompileCache:
    """``load`` before compiling, ``save`` after the warm-up (rank 0 writes: ``enabled``)."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled
        self.loaded = False
        self.misses_before = 0

    def load(self) -> bool:
        """Load the cached artifacts, if any; whether they loaded. Never raises."""
        self.misses_before = _misses()
        if not self.path.is_file():
            if self.enabled:
                log.info("model.compile: no compiled towers cached for this model and shapes yet; compiling, then "
                         "keeping them in %s", self.path)
            return False
        try:
            info = torch.compiler.load_cache_artifacts(self.path.read_bytes())
            problem = None if info is not None else "torch found nothing it could use in it"
        except Exception as error:  # noqa: BLE001 - a cache must never stop a run
            info, problem = None, f"{type(error).__name__}: {error}"
        if info is None:
            log.warning("model.compile: the compile cache %s could not be loaded (%s); ignored: the towers compile "
                        "as without it, and a good copy replaces it", self.path, str(problem)[:200])
            return False
        self.loaded = True
        if self.enabled:
            log.info("model.compile: compiled towers loaded from %s (%s)", self.path,
                     ", ".join(f"{len(keys)} {kind}" for kind, keys in info.artifacts.items()))
        return True

    def save(self) -> None:
        """Write what this process compiled or loaded, when it compiled anything new. Never raises."""
        if not self.enabled or (self.loaded and _misses() == self.misses_before):
            return
        try:
            artifacts = torch.compiler.save_cache_artifacts()
            if artifacts is None:
                return
            replace_whole(self.path, lambda partial: partial.write_bytes(artifacts[0]))  # nodes sharing the cache
            log.info("model.compile: compiled towers kept in %s (%.1f MB) for the next run", self.path,
                     len(artifacts[0]) / 1e6)
        except Exception as error:  # noqa: BLE001 - a cache must never stop a run
            log.warning("model.compile: the compile cache could not be written to %s (%s: %s); the next run "
                        "compiles again", self.path, type(error).__name__, str(error)[:200])
