"""The process-wide settings a run makes: one place, at the start, logged; none at import.

    configure_process()                       # an entry point's first call, before torch is imported
    configure_backends(cfg, torch.device(...))  # a run's own, before anything is built

``configure_process``: what must be set before torch (and CUDA) start. ``CUDA_DEVICE_MAX_CONNECTIONS``:
the GPU decoding (data/gpu_decode.py) runs beside the step on other CUDA streams; CUDA maps all
streams onto that many hardware queues (8 by default), and a stream that shares a queue with the
step's waits behind everything the step has queued; 32 is the most CUDA allows
(docs/performance.md). A value already set wins. The kept bytecode (``bytecode.py``): where torch
was installed without bytecode and Python may not write it, bytecode is read from the cache
directory. ``train.py`` calls it first; ``configure_backends`` calls it again (idempotent), for a
benchmark or a notebook that did not.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from .bytecode import in_use as bytecode_in_use
from .bytecode import use_kept_bytecode

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig

log = logging.getLogger("megabatch")

CUDA_QUEUES = "32"  # CUDA_DEVICE_MAX_CONNECTIONS unless set

RECOMPILE_LIMIT = 16  # graphs per compiled function: 3 gradient modes x the caption lengths met before dynamic


# imported once in the loader workers' fork server (data.worker_start), so that each worker forked from it starts with
# them: what unpickling a loader's dataset needs, and the module that keeps the server alive through a stop signal
SERVER_PRELOAD = ["__main__", "megabatch.data.worker_server", "megabatch.data.train_data", "open_clip"]

# train.py's arguments that leave the fork server unused (data/worker_start.py: auto is forkserver on CUDA with workers)
NO_SERVER = {"data.worker_start": ("fork",), "data.num_workers": ("0",), "trainer.device": ("cpu",)}
NO_RUN = ("--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "--shell-completion", "-sc")  # Hydra's: no run

# what the first compilation imports beyond what start_compile_workers has (torch 2.11 to 2.14; a module a torch lacks
# is skipped): in a warm 4k start on one H200, 1.5 s of the main thread before the towers' first graph
COMPILER_MODULES = ("torch._inductor.compile_fx", "torch._dynamo.backends.inductor", "torch._functorch.partitioners",
                    "torch._inductor.codegen.triton", "torch._inductor.codegen.cuda_combined_scheduling",
                    "torch._inductor.runtime.triton_heuristics", "torch.export._trace", "torch.utils.cpp_extension")


def configure_process(argv: list[str] | None = None) -> None:
    """Before torch starts: CUDA's hardware queues for the decoding streams, and the kept bytecode (see
    the module). Idempotent; a setting made too late (CUDA already started) is warned about.
    ``argv``: ``train.py``'s own arguments (not where another module imports it: the fork server's preload): the
    loader workers' fork server starts now (``early_worker_server``)."""
    if "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = CUDA_QUEUES
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            log.warning("CUDA_DEVICE_MAX_CONNECTIONS=%s set after CUDA started, so it does not apply: the GPU "
                        "decoding may wait behind the step's kernels; call "
                        "megabatch.runtime.process.configure_process() first, or set it in the environment",
                        CUDA_QUEUES)
    use_kept_bytecode()
    from .signals import kill_workers_at_exit

    kill_workers_at_exit()  # a failed run's workers, which ignore SIGTERM, never hold its exit
    if argv is not None and early_worker_server(argv):
        start_worker_server()


def early_worker_server(argv: list[str], gpu_node: str = "/dev/nvidiactl") -> bool:
    """Whether ``train.py`` (its arguments ``argv``) starts the loader workers' fork server before its own imports.
    Started at the build (``configure_loading``), the server imported torch and the data modules while the inductor
    compile workers did too, and the first loader's start waited 7.9 s for it on an H200 (ViT-B/16 at 4k, warm: the
    towers had compiled by then, docs/performance.md); started first, it imports beside the launch. Where the run
    will not use it (``data.worker_start=auto`` is ``forkserver`` on CUDA with loader workers): no GPU on this node
    (``gpu_node``, ``CUDA_VISIBLE_DEVICES`` empty), or ``argv`` setting the workers' start to fork, no workers or
    the CPU. A server started for a run that then does not use it (those keys set in a config file) idles, and ends
    with the run. Nor for Hydra's flags that run nothing (``--help``, ``--cfg``, ...)."""
    if not os.path.exists(gpu_node) or os.environ.get("CUDA_VISIBLE_DEVICES", "0").strip() in ("", "-1"):
        return False
    for arg in argv:
        key, _, value = arg.lstrip("+~").partition("=")
        if arg in NO_RUN or value.strip().strip("'\"") in NO_SERVER.get(key, ()):
            return False
    return True


def start_worker_server() -> None:
    """Start this process's fork server for the loader workers now, with ``SERVER_PRELOAD`` imported in it
    (idempotent: a server already running, started by other code, is kept as it is). It imports while the process
    starts and the model and the data are built; the first loader's workers wait for it only if it is not done by
    then. It ends when this process does."""
    import multiprocessing
    from multiprocessing import forkserver

    from .signals import stop_signals_blocked

    multiprocessing.get_context("forkserver").set_forkserver_preload(SERVER_PRELOAD)
    with stop_signals_blocked():  # the server starts with them blocked, until its preload ignores them
        forkserver.ensure_running()


def configure_backends(cfg: DictConfig, device: torch.device) -> list[str]:
    """Set what a run of ``cfg`` on ``device`` needs process-wide, before anything is built (the
    trainer and the benchmarks call it; building a run changes no global state). Idempotent.
    Returns one line per setting, for the log.

    - CUDA: TF32 tensor cores for fp32 matmuls and convolutions (``trainer.tf32``: the loss on fp32
      features).
    - ``model.compile``: inductor's random ops draw from torch's generator as eager ones do
      (``fallback_random``), so GradCache's replay redraws the dropout masks phase 1 drew; dynamo
      may keep up to ``RECOMPILE_LIMIT`` graphs per compiled function.
    - CUDA: Triton's kernel cache (``TRITON_CACHE_DIR``, where unset) under ``data.cache_dir``
      (``$MEGABATCH_CACHE``) beside the compile cache: the loss's and the towers' own Triton kernels,
      which torch's compile cache does not hold, are then compiled once for every job and node that
      shares the folder, not once per machine (each compiles in 0.1-1 s).
    - ``model.compile`` on CUDA: inductor's pool of compile workers started now. torch starts it at the
      first compilation and compiles in the main process, one kernel after another, until the pool's
      processes have imported torch (seconds, longer on a machine without bytecode); started here, they
      do that while the model, the data and the loader are built.

    The data's own process-wide settings (the step's CUDA stream beside the GPU decoding, the loader workers' fork
    server) are ``megabatch.data.loading.configure_loading``'s, called beside this one.
    """
    import torch

    from ..config.schema import model_settings

    configure_process()
    done = []
    if bytecode_in_use():
        done.append(f"bytecode read from {sys.pycache_prefix}: the packages were installed without it and Python may "
                    "not write it beside them (MEGABATCH_PYCACHE=0: off)")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(cfg.trainer.tf32)
        done.append(f"TF32 for fp32 matmuls {'on' if cfg.trainer.tf32 else 'off'} (trainer.tf32)")
        if "TRITON_CACHE_DIR" not in os.environ:
            os.environ["TRITON_CACHE_DIR"] = str(Path(cfg.data.cache_dir).expanduser() / "triton")
        done.append(f"Triton's compiled kernels kept in {os.environ['TRITON_CACHE_DIR']} (TRITON_CACHE_DIR)")
    if model_settings(cfg.model).compile:
        import torch._dynamo.config as dynamo_config
        import torch._inductor.config as inductor_config

        inductor_config.fallback_random = True
        limit = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
        setattr(dynamo_config, limit, max(getattr(dynamo_config, limit), RECOMPILE_LIMIT))
        done.append(f"compiled random ops drawn as in eager mode; up to {getattr(dynamo_config, limit)} graphs "
                    "per compiled function (model.compile)")
        if device.type == "cuda":
            done.append(start_compile_workers())
    return done


@contextmanager
def compiler_imports(imports: bool, hash_triton: bool) -> Iterator[None]:
    """``model.compile``: while the body runs, import what the first compilation imports (``COMPILER_MODULES``) in
    one thread (``imports``) and, with ``hash_triton`` (CUDA), hash Triton's library in another (``triton_key``, which
    inductor's cache keys read: 0.75 s of an H200's warm start, cached for the process). The body is the model's
    build, whose seeded initialisation runs in torch's ops with the interpreter's lock released, so the threads run
    beside it rather than in the first compilation. Both are joined on exit: after it the main thread may import what
    they import, and two threads importing modules that import each other can leave one half made (so ``imports``
    only where the body imports nothing they might). A thread's error is only logged (the compilation imports again,
    and reports it there)."""
    jobs = [job for job, wanted in ((_import_compiler, imports), (_hash_triton, hash_triton)) if wanted]
    threads = [threading.Thread(target=_logged, args=(job,), name=f"megabatch-{job.__name__[1:]}", daemon=True)
               for job in jobs]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        start = time.perf_counter()
        for thread in threads:
            thread.join()
        log.debug("compiler imports: waited %.2f s for them after the build", time.perf_counter() - start)


def _import_compiler() -> None:
    for name in COMPILER_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # not in this torch
            pass


def _hash_triton() -> None:
    from torch._inductor.runtime.triton_compat import HAS_TRITON, triton_key

    if HAS_TRITON:
        triton_key()


def _logged(job) -> None:
    try:
        job()
    except Exception as error:  # noqa: BLE001 - ahead of the compilation, which meets it again
        log.debug("%s ahead of the compilation failed: %r", job.__name__, error)


def start_compile_workers() -> str:
    """Start inductor's compile workers (its ``maybe_warm_pool``, which the inductor backend calls at the
    first compilation) and say how many, or why not."""
    from torch._inductor import async_compile

    warm = getattr(async_compile, "maybe_warm_pool", None)
    if warm is None:  # a torch without it starts its pool at the first compilation
        return "inductor's compile workers start at the first compilation (model.compile)"
    warm()
    threads = async_compile.get_compile_threads() if hasattr(async_compile, "get_compile_threads") else None
    return (f"inductor's {threads} compile workers starting beside the build (model.compile)" if threads and threads > 1
            else "inductor compiles in this process (TORCHINDUCTOR_COMPILE_THREADS=1)")
