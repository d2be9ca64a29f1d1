"""Checkpoints that load with ``torch.load(..., weights_only=True)``: tensors, numbers, strings.

Layout: ``<run_dir>/checkpoints/last.pt`` plus ``step_<N>.pt`` every ``trainer.ckpt_every`` steps.
Written by rank 0 to a temporary file and renamed, so a crash mid-write never corrupts ``last.pt``.

Sharded runs (``trainer.parallel=fsdp``) write ``last.dcp/`` and ``step_<N>.dcp/`` folders instead,
with ``torch.distributed.checkpoint`` (DCP): every rank writes its own shards of the weights and
of AdamW's moments, rank 0 adds ``meta.pt`` (the step, the RNG states, the config, the model's
description). The folder is written under a temporary name and renamed once every rank has
finished and DCP's ``.metadata`` is down: complete or absent, as a ``.pt``. ``last.dcp`` next to a
numbered one is made of hard links to its files (no second write). DCP reshards on load: a sharded
checkpoint resumes on any number of ranks, sharded or not, and evaluation and export read it whole
(``load_checkpoint``).
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import ConfigError

# DCP warns on every call without a process group that it assumes one process: that is meant (a one-rank run's sharded
# checkpoints; a filter for the process, since DCP's async_save warns from its writing thread)
warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")

log = logging.getLogger(__name__)

_STEP_FILE = re.compile(r"^step_(\d+)\.(pt|dcp)$")
SHARDED = ".dcp"      # a sharded checkpoint's folder suffix
META = "meta.pt"      # a sharded checkpoint's step, RNG states, config and model description
EMA = "ema"           # the moving average's entry (train/step/ema.py): counters, and its "weights" (name -> tensor)


def capture_rng() -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU and CUDA) as tensors."""
    state = {
        "python": torch.tensor(random.getstate()[1], dtype=torch.int64),  # Mersenne Twister words and position
        "numpy": torch.from_numpy(np.random.get_state()[1].astype(np.int64)),
        "numpy_pos": torch.tensor(np.random.get_state()[2]),
        "torch": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of ``capture_rng``."""
    random.setstate((3, tuple(int(x) for x in state["python"]), None))
    np_state = np.random.get_state()
    np.random.set_state(
        (np_state[0], state["numpy"].numpy().astype(np.uint32), int(state["numpy_pos"]), 0, 0.0)
    )
    torch.random.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` atomically and durably: a temporary file in the same folder,
    flushed and fsync'ed, then renamed over ``path``. On failure the temporary file is removed and
    a full disk is named as such."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _replace_with(path, lambda tmp: _write_durably(tmp, lambda handle: torch.save(payload, handle)))


def _write_durably(path: Path, write) -> None:
    """``write(handle)`` into a new file at ``path``, flushed and fsync'ed."""
    with open(path, "wb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())


def _replace_with(path: Path, make) -> None:
    """``make(tmp)`` creates a temporary file beside ``path``, renamed over ``path`` once made; on
    failure the temporary file is removed and a full disk is named as such."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        make(tmp)
        os.replace(tmp, path)
    except BaseException as error:
        tmp.unlink(missing_ok=True)
        if _disk_full(error):
            raise _no_space(path.parent, path.name) from error
        raise


def _no_space(folder: Path, name: str) -> OSError:
    """A full disk, named with its folder and what is free, and what to do."""
    free = shutil.disk_usage(folder).free / 1e9
    return OSError(errno.ENOSPC, f"no space left on the disk of {folder} ({free:.2f} GB free) while writing "
                   f"checkpoint {name}; free space, lower trainer.keep_ckpts, or give a run_dir on a larger disk")


def _disk_full(error: BaseException) -> bool:
    """ENOSPC, also when torch's writer wraps it in a RuntimeError."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def write_run_checkpoint(
    ckpt_dir: Path, payload: dict[str, Any], step: int, numbered: bool, keep: int | None
) -> None:
    """Save ``last.pt`` (and ``step_<N>.pt`` if ``numbered``: the payload serialised once, ``last.pt``
    a hard link to it), pruning old numbered files."""
    last = ckpt_dir / "last.pt"
    if numbered:
        numbered_path = ckpt_dir / f"step_{step:08d}.pt"
        save_checkpoint(numbered_path, payload)
        _link_over(numbered_path, last)
        _prune(ckpt_dir, keep)
    else:
        save_checkpoint(last, payload)
    log.info("checkpoint at step %d -> %s", step, last)


def _link_over(source: Path, target: Path) -> None:
    """Make ``target`` name ``source``'s file, atomically (a hard link renamed over it; a durable copy
    where the disk has no hard links). A later save replaces ``target`` by a rename, never in place,
    so ``source`` keeps its bytes."""
    def make(tmp: Path) -> None:
        try:
            os.link(source, tmp)
        except OSError:
            with open(source, "rb") as reader:
                _write_durably(tmp, lambda writer: shutil.copyfileobj(reader, writer, 16 << 20))

    _replace_with(target, make)


def load_checkpoint(path: str | os.PathLike, weights: bool = True) -> dict[str, Any]:
    """Load a checkpoint on the CPU with ``weights_only=True``; an unreadable one is a
    ``ConfigError`` naming the file. A sharded one (a ``.dcp`` folder) gives its ``meta.pt`` and,
    with ``weights``, its whole model state dict under ``model`` (read from every rank's shards)."""
    path = Path(path).expanduser()
    if path.is_dir():
        return load_sharded_meta(path, weights)
    return _load_file(path, required=("model", "step"))


def _load_file(path: Path, required: tuple[str, ...]) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - truncated, empty, garbage: torch raises many kinds
        reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise ConfigError(f"checkpoint {path} cannot be loaded: {reason} (truncated or not a megabatch "
                          "checkpoint?)") from None
    missing = set(required) - set(state) if isinstance(state, dict) else set(required)
    if missing:
        raise ConfigError(f"checkpoint {path} is not a megabatch checkpoint: no {sorted(missing)}")
    return state


def run_checkpoints(ckpt_dir: Path) -> list[Path]:
    """A run's checkpoints, newest first: ``last.pt`` / ``last.dcp`` (written with every numbered
    one and at the end; the newer first if a run changed ``trainer.parallel``), then ``step_<N>``
    by decreasing N."""
    if not ckpt_dir.is_dir():
        return []
    numbered = sorted((p for p in ckpt_dir.iterdir() if _STEP_FILE.match(p.name)),
                      key=lambda p: (int(_STEP_FILE.match(p.name).group(1)), p.suffix == SHARDED), reverse=True)
    last = [p for p in (ckpt_dir / "last.pt", ckpt_dir / f"last{SHARDED}") if p.exists()]
    return sorted(last, key=lambda p: p.stat().st_mtime, reverse=True) + numbered


def check_shards(path: Path) -> None:
    """A ``ConfigError`` where a sharded checkpoint's shard files hold fewer bytes than its DCP metadata says its
    items take (a file cut short, or gone): found before a resume reads it, so that ``resume=latest`` goes on to the
    one before. Reads the metadata alone."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(path)).read_metadata().storage_data or {}
    except Exception as error:  # noqa: BLE001 - an unreadable .metadata: the checkpoint is damaged
        raise ConfigError(f"checkpoint {path} cannot be loaded: its DCP metadata is unreadable ({error})") from None
    needed: dict[str, int] = {}
    for info in storage.values():
        name = str(info.relative_path)
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    for name, size in sorted(needed.items()):
        held = (path / name).stat().st_size if (path / name).is_file() else -1
        if held < size:
            raise ConfigError(f"checkpoint {path} is damaged: {name} " + ("is missing" if held < 0 else
                              f"holds {held} of the {size} bytes its items take (cut short)"))


def load_sharded_meta(path: Path, weights: bool = True) -> dict[str, Any]:
    """A sharded checkpoint's ``meta.pt``, and with ``weights`` its whole model state dict
    (``model``). One whose writing did not finish (no DCP ``.metadata`` or no ``meta.pt``: torn) is
    a ``ConfigError``."""
    missing = [name for name in (".metadata", META) if not (path / name).is_file()]
    if missing:
        raise ConfigError(f"checkpoint {path} is incomplete (no {' or '.join(missing)}: its writing was "
                          "interrupted)")
    check_shards(path)
    state = _load_file(path / META, required=("step",))
    if weights:
        state["model"] = _read_sharded(path, "model")
        if EMA in state:  # its counters in meta.pt, its weights in every rank's shards
            state[EMA] = {**state[EMA], **_read_sharded(path, EMA)}
    return state


def model_weights(state: dict[str, Any], weights: str, where: str) -> dict[str, torch.Tensor]:
    """A loaded checkpoint's model state dict with ``weights``: ``raw`` (as trained) or ``ema`` (the
    moving average, ``ema.decay``, in place of every parameter it holds). ``where``: the key that
    chose (named by the error for a checkpoint without an average)."""
    if weights == "raw":
        return state["model"]
    if weights != "ema":
        raise ConfigError(f"{where}={weights!r}: use raw (the weights as trained) or ema (their moving average)")
    if not (state.get(EMA) or {}).get("weights"):
        raise ConfigError(f"{where}=ema but the checkpoint holds no moving average of the weights (its run had no "
                          f"ema.decay): use {where}=raw")
    return {**state["model"], **state[EMA]["weights"]}


def _read_sharded(path: Path, key: str) -> dict[str, Any]:
    """Entry ``key`` of a DCP checkpoint (the model's or the optimizer's state dict), every tensor
    whole, in this process alone: ``dcp.load`` into a target laid out from the checkpoint's own
    metadata (each entry's path in the saved state dict, its shape and dtype)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(path))
    metadata = reader.read_metadata()
    target: dict[str, Any] = {}
    for name, meta in metadata.state_dict_metadata.items():
        route = metadata.planner_data[name]  # ("optimizer", "state", "0", "exp_avg"), list indices as ints
        if route[0] != key:
            continue
        leaf = torch.empty(meta.size, dtype=meta.properties.dtype) if isinstance(meta, TensorStorageMetadata) \
            else None  # a non-tensor value (the optimizer's param_groups): loaded in place of None
        node = target
        for part, below in zip(route[1:-1], route[2:], strict=True):
            node = _child(node, part, [] if isinstance(below, int) else {})
        _child(node, route[-1], leaf, replace=True)
    dcp.load({key: target}, storage_reader=reader, no_dist=True)
    return target


def _child(node: dict | list, part: str | int, empty: Any, replace: bool = False) -> Any:
    """``node[part]``, set to ``empty`` when absent (or always, with ``replace``); lists grow to ``part``."""
    if isinstance(node, list):
        node.extend([None] * (part + 1 - len(node)))
        if replace or node[part] is None:
            node[part] = empty
        return node[part]
    if replace or part not in node:
        node[part] = empty
    return node[part]


class ShardedWrite:
    """A sharded checkpoint being written: every rank writes its shards of the model and the optimizer (and of the
    parts' sharded tensors: entry -> state, the moving average's) as ``step_<N>.dcp`` (numbered) or ``last.dcp``;
    rank 0 (the one given ``meta``) adds ``meta.pt``, publishes the folder by renaming it once all are done, links
    ``last.dcp`` to a numbered one and prunes old ones. ``begin`` (every rank): its state taken and its shards
    written into a temporary folder, or with ``asynchronous`` handed to DCP's ``async_save`` (its collectives in
    ``group``, a process group of the writing thread's own, beside the training's), which copies them to the host
    and returns while a thread writes them; ``finish`` (every rank, at the same point): the shards on disk, then
    rank 0 adds ``meta.pt`` and publishes the folder. A run stopped between the two leaves the temporary folder
    unpublished: the newest checkpoint is the one before."""

    def __init__(self, ckpt_dir: Path, tmp: Path, name: str, meta: dict[str, Any] | None, step: int,
                 numbered: bool, keep: int | None, writing=None, started: float = 0.0):
        self.ckpt_dir, self.tmp, self.name, self.meta = ckpt_dir, tmp, name, meta
        self.step, self.numbered, self.keep, self.writing = step, numbered, keep, writing
        self.started = started  # time.perf_counter() when begun

    @classmethod
    def begin(cls, ckpt_dir: Path, model: torch.nn.Module, optimizer, meta: dict[str, Any] | None, step: int,
              numbered: bool, keep: int | None, tensors: dict[str, Any] | None = None, asynchronous: bool = False,
              group=None) -> ShardedWrite:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        started = time.perf_counter()
        distributed = dist.is_available() and dist.is_initialized()
        name = f"step_{step:08d}{SHARDED}" if numbered else f"last{SHARDED}"
        tmp = ckpt_dir / f".{name}.tmp"
        if meta is not None:  # rank 0 clears what an interrupted writer left
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        if distributed:
            dist.barrier()
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state, **(tensors or {})}
        writing = None
        try:
            if not asynchronous:
                dcp.save(state, checkpoint_id=str(tmp), no_dist=not distributed)
            else:  # staged on the host now (the steps after it change the weights in place), written by a thread
                options = {"no_dist": True} if not distributed and _takes(dcp.async_save, "no_dist") else {}
                writing = dcp.async_save(state, checkpoint_id=str(tmp),
                                         process_group=group if distributed else None, **options)
        except BaseException as error:
            if _disk_full(error):
                raise _no_space(ckpt_dir, name) from error
            raise
        return cls(ckpt_dir, tmp, name, meta, step, numbered, keep, writing, started)

    def finish(self) -> None:
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        if self.writing is not None:
            writing, self.writing = self.writing, None
            try:
                future = getattr(writing, "upload_completion", writing)  # an AsyncSaveResponse, or the future
                future.result()
            except BaseException as error:
                if _disk_full(error):
                    raise _no_space(self.ckpt_dir, self.name) from error
                raise
        if distributed:
            dist.barrier()  # every rank's shards are on disk
        if self.meta is not None:
            save_checkpoint(self.tmp / META, self.meta)
            _publish(self.tmp, self.ckpt_dir / self.name)
            if self.numbered:
                _publish(_linked_copy(self.ckpt_dir / self.name, self.ckpt_dir / f".last{SHARDED}.tmp"),
                         self.ckpt_dir / f"last{SHARDED}")
                _prune(self.ckpt_dir, self.keep)
            log.info("checkpoint at step %d -> %s (sharded)", self.step, self.ckpt_dir / self.name)
        if distributed:
            dist.barrier()  # no rank goes on (and may be stopped) before the folder is in place


def _takes(function, keyword: str) -> bool:
    import inspect

    return keyword in inspect.signature(function).parameters


def load_sharded_state(path: Path, model: torch.nn.Module, optimizer, tensors: dict[str, Any] | None = None) -> None:
    """Load a sharded checkpoint's weights and AdamW state into ``model`` and ``optimizer``, sharded
    or not, on any number of ranks (DCP reads each rank's part of every tensor); ``tensors`` (entry ->
    state of tensors, e.g. the moving average's) are read in place too."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state, **(tensors or {})}
    dcp.load(state, checkpoint_id=str(path), no_dist=not (dist.is_available() and dist.is_initialized()))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_whole_state(state: dict[str, Any], model: torch.nn.Module, optimizer) -> None:
    """A whole-model checkpoint's (``.pt``) weights and AdamW state into a sharded ``model`` and its
    ``optimizer``: each rank keeps its shard of every full tensor. The optimizer state of a ``.pt``
    numbers the parameters in the optimizer's order, which the same builder gives the sharded run;
    they are named here, as DCP's loader wants them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    names = {id(param): name for name, param in model.named_parameters()}
    order = [names[id(param)] for group in optimizer.param_groups for param in group["params"]]
    saved = state["optimizer"]
    numbered = [index for group in saved["param_groups"] for index in group["params"]]
    if len(numbered) != len(order):
        raise ConfigError(f"the checkpoint's optimizer holds {len(numbered)} parameters and this run's "
                          f"{len(order)}: it was written for another model or another trainable set")
    name_of = dict(zip(numbered, order, strict=True))
    optim_state = {"state": {name_of[index]: value for index, value in saved["state"].items()},
                   "param_groups": [{**group, "params": [name_of[index] for index in group["params"]]}
                                    for group in saved["param_groups"]]}
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True))


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished folder ``tmp`` to ``final``, replacing an older one."""
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _linked_copy(source: Path, target: Path) -> Path:
    """``target``: a folder of hard links to ``source``'s files (copies where the disk has none)."""
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    for item in source.iterdir():
        try:
            os.link(item, target / item.name)
        except OSError:
            shutil.copy2(item, target / item.name)
    return target


def _prune(ckpt_dir: Path, keep: int | None) -> None:
    """Keep the ``keep`` newest numbered checkpoints (``None``: all)."""
    if not keep:
        return
    numbered = sorted((p for p in ckpt_dir.iterdir() if _STEP_FILE.match(p.name)),
                      key=lambda p: int(_STEP_FILE.match(p.name).group(1)))
    for old in numbered[:-keep]:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def check_stored_targets(node: Any, where: str = "config") -> None:
    """Refuse a stored config (a checkpoint's) that would build anything but this project's own
    classes and torch's optimizers: Hydra's ``instantiate`` calls whatever ``_target_`` names, so a
    crafted checkpoint could otherwise run code (``weights_only=True`` guards the tensors only)."""
    from omegaconf import DictConfig, ListConfig

    if isinstance(node, DictConfig):
        target = node.get("_target_")
        if target is not None and not _allowed_target(str(target)):
            raise ConfigError(f"{where}._target_={target!r}: a checkpoint's stored config may build only "
                              "megabatch's own models, losses and schedules (and torch.optim optimizers); "
                              "refusing to load it. Rebuild the model from your own config instead")
        for key, value in node.items_ex(resolve=False):
            check_stored_targets(value, f"{where}.{key}")
    elif isinstance(node, ListConfig):
        for index, value in enumerate(node):
            check_stored_targets(value, f"{where}[{index}]")


def _allowed_target(target: str) -> bool:
    """Defined in megabatch itself (``megabatch.data.offload.os.system`` is ``os.system``: refused),
    or an optimizer class of ``torch.optim``. Nothing outside megabatch is imported to decide."""
    if target.startswith("megabatch."):
        from hydra.utils import get_object

        try:
            found = get_object(target)
        except Exception:  # noqa: BLE001 - unresolvable: not ours
            return False
        return callable(found) and str(getattr(found, "__module__", "")).startswith("megabatch.")
    module, _, name = target.rpartition(".")
    return module == "torch.optim" and isinstance(getattr(torch.optim, name, None), type) \
        and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)


def build_stored(node, where: str):
    """``instantiate`` a node of a checkpoint's stored config, once its targets are checked."""
    from hydra.utils import instantiate

    check_stored_targets(node, where)
    return instantiate(node, _convert_="all")


def load_resume(resume: str | None, run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """What to resume from: ``resume=latest`` -> the newest checkpoint of ``run_dir`` that loads
    (each one skipped is warned about; none at all: start fresh); ``resume=<path>`` -> that file;
    ``null`` -> nothing. Returns ``(path, state)``."""
    if resume in (None, "", "none", "null"):
        return None
    if resume != "latest":
        return Path(str(resume)).expanduser(), load_checkpoint(resume, weights=False)
    candidates = run_checkpoints(run_dir / "checkpoints")
    if not candidates:
        log.info("resume=latest: no checkpoint in %s yet, starting fresh", run_dir)
        return None
    reasons = []
    for path in candidates:
        try:
            return path, load_checkpoint(path, weights=False)
        except ConfigError as error:
            log.warning("resume=latest: skipping %s", error)
            reasons.append(str(error))
    raise ConfigError(f"resume=latest: none of the {len(candidates)} checkpoints in {run_dir / 'checkpoints'} "
                      f"loads ({'; '.join(reasons)}); remove them to start over, or resume=<path> a good one")
