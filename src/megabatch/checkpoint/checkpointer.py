"""One checkpointer for every part of a run: each part saves and loads its own state.

``Checkpointer`` holds the model and the optimizer (whose state goes whole into a ``.pt``, or as
every rank's shards into a DCP folder: ``files.py``) and a dict of named ``Stateful`` parts
(the scaler, the schedule, the data position, the RNG states, the trainer's counters), each
saved under its name by its own ``state_dict`` and given back to its own ``load_state_dict``.
A new part (EMA weights, a teacher's settings) is one more entry in that dict.

    checkpointer = Checkpointer(ckpt_dir, model, optimizer, {"train_state": counters, "rng": RngStates(...)},
                                header=lambda: {"config": ..., "open_clip": ...}, sharded=False, keep=3,
                                main=rank == 0, distributed=False)
    checkpointer.save(step=100, numbered=True)   # step_00000100.pt and last.pt
    checkpointer.load(path, state)               # every part from the file load_resume found

``asynchronous`` (``trainer.ckpt_async``): a whole-file checkpoint is copied to the host at once (the weights, the
optimizer's moments, every part's state: what the step will change next) and written by a thread while the steps
go on; at most one write is in flight (the next save waits for it), ``wait`` waits for it (a stop, the run's end)
and raises what failed in it. The file appears by a rename once whole, so a run killed mid-write leaves the
previous checkpoint the newest. A sharded checkpoint the same way through DCP's ``async_save``: every rank's shards
copied to the host, then written by a thread whose collectives run in a gloo group of their own (beside the
training's); ``wait`` (every rank, at the same point: the next save, a stop, the end) publishes the folder.

A part with tensors sharded like the model's parameters (the moving average of ``train/step/ema.py``) has a
``tensors()`` method (name -> tensor, the same objects its state's ``weights`` entry holds): a sharded
checkpoint writes them with the model's shards (every rank its own) and its other entries in
``meta.pt``, and reads them back in place.

A file also carries a header for its readers (evaluation, export, the run reports): the step,
the global batch, the config and the model's description. A part absent from a file (written
before the part existed) keeps its fresh state, logged; files written before the parts had their
own entries are read through ``legacy_parts``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..config import ConfigError
from ..distributed.fsdp import is_sharded, local
from ..models.pretrained import mismatched_shapes
from .files import (
    ShardedWrite,
    capture_rng,
    load_sharded_state,
    load_whole_state,
    restore_rng,
    write_run_checkpoint,
)

log = logging.getLogger("megabatch")

TENSORS = "weights"  # a part's entry of tensors sharded like the model's (written to a DCP folder with them)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainState:
    """The trainer's counters: optimizer steps done and samples seen."""

    step: int = 0
    samples_seen: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.samples_seen = int(state["step"]), int(state["samples_seen"])


class RngStates:
    """Every rank's RNG states (python, numpy, torch CPU and CUDA): gathered into one list on save
    (a collective: every rank saves), each rank's own restored on load when the number of ranks is
    the same (else each rank keeps its fresh seed: ``seed + 1000 x rank``)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def state_dict(self) -> dict[str, Any]:
        rng = capture_rng()
        if self.world_size == 1:
            return {"ranks": [rng]}
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, rng)
        return {"ranks": gathered}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["ranks"]) == self.world_size:
            restore_rng(state["ranks"][self.rank])


def _always_empty(part) -> bool:
    """A part whose state is empty, and so never saved: a disabled GradScaler (every run but fp16's). Its absence
    from a checkpoint is not news."""
    return isinstance(part, torch.amp.GradScaler) and not part.is_enabled()


def legacy_parts(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint written before each part had its own entry (flat keys: ``step``,
    ``samples_seen``, ``global_batch``, ``loader_slots``, ``rng`` as a list) with those entries
    added; a newer one as it is."""
    if "train_state" in state:
        return state
    step = int(state["step"])
    upgraded = dict(state)
    # samples seen (checkpoints before it was stored: the steps at the checkpoint's batch)
    upgraded["train_state"] = {"step": step, "samples_seen": int(state.get("samples_seen",
                                                                           step * int(state["global_batch"])))}
    upgraded["data_position"] = {"global_batch": int(state["global_batch"]), "loader_slots": state.get("loader_slots")}
    if isinstance(state.get("rng"), list):  # one entry a rank
        upgraded["rng"] = {"ranks": state["rng"]}
        upgraded["data_position"]["world_size"] = len(state["rng"])
    return upgraded


class Checkpointer:
    """Saves and resumes ``model``, ``optimizer`` and the ``parts`` (name -> ``Stateful``) in
    ``ckpt_dir``: ``.pt`` files written by rank 0, or (``sharded``) DCP folders every rank writes
    its shards into. ``header()``: what readers of the file need beyond the parts (the config, the
    model's description). ``keep``: numbered checkpoints kept. ``saved_step``: the step last saved (its state taken;
    with ``asynchronous`` perhaps still being written). ``write_s``: the seconds the last finished write took."""

    def __init__(self, ckpt_dir: Path, model: torch.nn.Module, optimizer, parts: dict[str, Stateful], *,
                 header: Callable[[], dict[str, Any]], sharded: bool, keep: int | None, main: bool,
                 distributed: bool, asynchronous: bool = False):
        self.ckpt_dir, self.model, self.optimizer, self.parts = ckpt_dir, model, optimizer, parts
        self.header, self.sharded, self.keep, self.main, self.distributed = header, sharded, keep, main, distributed
        self.saved_step: int | None = None
        self.asynchronous = asynchronous
        self.write_s = 0.0
        self._writer: ThreadPoolExecutor | None = None
        self._writing: Future | None = None
        self._sharded_write: ShardedWrite | None = None  # asynchronous and sharded: published by wait()
        self._snapshot = HostSnapshot()  # asynchronous whole files: the host copies' buffers, kept
        self._group = None  # the sharded writes' own process group (gloo), made at the first

    def save(self, step: int, numbered: bool) -> bool:
        """Write the checkpoint of ``step`` (every rank calls it; ``numbered``: ``step_<N>`` beside
        ``last``), unless a weight is not finite (the last finite checkpoint is kept). Returns whether
        it was written."""
        if not self.weights_finite():
            log.error("step %d: the weights are not finite; no checkpoint written (the last finite ones in %s "
                      "are kept)", step, self.ckpt_dir)
            return False
        payload = {name: part.state_dict() for name, part in self.parts.items()}  # collectives: every rank
        payload = {name: state for name, state in payload.items() if state}  # a disabled scaler's {}: nothing
        if self.sharded:  # every rank writes its shards: of the model, the optimizer and the parts' weights
            tensors = {name: {TENSORS: state.pop(TENSORS)} for name, state in payload.items() if TENSORS in state}
            meta = {**self.header(), **payload, "step": step}
            if not self.asynchronous:
                ShardedWrite.begin(self.ckpt_dir, self.model, self.optimizer, meta if self.main else None, step,
                                   numbered, self.keep, tensors).finish()
            else:
                self.wait()  # at most one write in flight: the last one published first (every rank)
                if self._group is None and self.distributed:  # collective: every rank is here
                    self._group = dist.new_group(backend="gloo")
                self._sharded_write = ShardedWrite.begin(
                    self.ckpt_dir, self.model, self.optimizer, on_host(meta) if self.main else None, step, numbered,
                    self.keep, tensors, asynchronous=True, group=self._group)
            self.saved_step = step
            return True
        meta = {**self.header(), **payload, "step": step}
        if self.main:
            whole = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), **meta}
            if self.asynchronous:
                self.wait()  # at most one write in flight
                if self._writer is None:
                    self._writer = ThreadPoolExecutor(1, thread_name_prefix="megabatch-checkpoint")
                # a copy on the host, taken now: the next steps change the weights, moments and counters in place
                self._writing = self._writer.submit(self._write, self._snapshot.take(whole), step, numbered)
            else:
                self._write(whole, step, numbered)
        self.saved_step = step
        return True

    def _write(self, whole: dict[str, Any], step: int, numbered: bool) -> None:
        started = time.perf_counter()
        write_run_checkpoint(self.ckpt_dir, whole, step, numbered, self.keep)
        self.write_s = time.perf_counter() - started

    def wait(self) -> None:
        """Until the checkpoint being written (``asynchronous``) is on disk; what failed in its write is raised here.
        Nothing in flight: no wait."""
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.result()
        sharded, self._sharded_write = self._sharded_write, None
        if sharded is not None:  # every rank: its shards on disk, then rank 0 publishes the folder
            sharded.finish()
            self.write_s = time.perf_counter() - sharded.started

    def close(self) -> None:
        """Wait for the write in flight, then end the writing thread."""
        try:
            self.wait()
        finally:
            if self._writer is not None:
                self._writer.shutdown()
                self._writer = None

    def load(self, path: Path, state: dict[str, Any]) -> None:
        """Resume from ``path``, whose parts (and, for a ``.pt``, weights) ``state`` holds: the
        weights and the optimizer's state as the file's format gives them (a DCP folder reshards to
        this run's ranks; a whole ``.pt`` into a sharded model keeps each rank's shard), then each
        part from its own entry."""
        if not path.is_dir():
            check_fits(state["model"], self.model, path)
        if path.is_dir():  # a sharded checkpoint (any number of ranks wrote it): each rank reads its part
            tensors = {name: {TENSORS: part.tensors()} for name, part in self.parts.items()
                       if name in state and hasattr(part, "tensors")}  # read in place (DCP), then loaded below
            load_sharded_state(path, self.model, self.optimizer, tensors)
            state = {**state, **{name: {**state[name], **read} for name, read in tensors.items()}}
        elif is_sharded(self.model):  # a whole-model .pt (a DDP run's): each rank keeps its shard of it
            load_whole_state(state, self.model, self.optimizer)
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        state = legacy_parts(state)
        for name, part in self.parts.items():
            if name in state:
                part.load_state_dict(state[name])
            elif self.main and not _always_empty(part):
                log.info("checkpoint %s has no %s: it starts fresh", path, name)
        self.saved_step = int(state["step"])

    def weights_finite(self) -> bool:
        """Whether every weight is finite (the same answer on every rank: replicas agree, and
        FSDP's shards are checked together)."""
        finite = torch.stack([torch.isfinite(local(p)).all() for p in self.model.parameters()]).all()
        if is_sharded(self.model) and self.distributed:
            flag = finite.float().reshape(1)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            finite = flag[0] > 0
        return bool(finite)


class HostSnapshot:
    """Copies of a state on the host, into buffers kept from one checkpoint to the next: a tensor of a shape and dtype
    met at the same place of the last snapshot is copied into that one's buffer (page-locked where it comes from a
    GPU: the copies are queued without a host sync, then waited for once), not into memory allocated anew (a 5 GB
    ViT-L/14 checkpoint's pageable copy took most of its 5.1 s, docs/multi-gpu.md). Call ``take`` only once the last
    snapshot is written (``Checkpointer.save`` waits for it first): its buffers are overwritten."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}  # the place of each tensor in the state -> its buffer
        self.queued = False  # a copy from a GPU queued by this take

    def take(self, state: Any) -> Any:
        """``state`` (dicts, lists and tuples of tensors and values) with every tensor copied to the host, detached:
        a snapshot that what the step does next leaves unchanged."""
        self.queued = False
        copied = self._copy(state, "")
        if self.queued:
            torch.cuda.synchronize()  # the copies queued from the GPU are done before the writer reads them
        return copied

    def _copy(self, state: Any, at: str) -> Any:
        if isinstance(state, torch.Tensor):
            source = state.detach()
            buffer = self.buffers.get(at)
            if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
                buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=source.is_cuda)
                self.buffers[at] = buffer
            buffer.copy_(source, non_blocking=source.is_cuda)
            self.queued |= source.is_cuda
            return buffer
        if isinstance(state, dict):  # an OrderedDict stays one, with a state dict's _metadata (load_state_dict's)
            copied = type(state)((key, self._copy(value, f"{at}/{key}")) for key, value in state.items())
            if hasattr(state, "_metadata"):
                copied._metadata = state._metadata
            return copied
        if isinstance(state, tuple) and hasattr(state, "_fields"):  # a named tuple
            return type(state)(*(self._copy(value, f"{at}/{index}") for index, value in enumerate(state)))
        if isinstance(state, (list, tuple)):
            return type(state)(self._copy(value, f"{at}/{index}") for index, value in enumerate(state))
        return state


def on_host(state: Any) -> Any:
    """``state`` with every tensor copied to the host into new memory (``HostSnapshot`` keeps its buffers)."""
    return HostSnapshot().take(state)


def check_fits(weights: dict[str, Any], model, path: Path) -> None:
    """A ``ConfigError`` naming ``path``, ``resume`` and the first mismatched tensors with both shapes where the
    checkpoint's ``weights`` do not fit ``model`` (another architecture or width), before anything is loaded."""
    own = model.state_dict()
    misfits = mismatched_shapes(weights, own, resized=())
    missing = [name for name in own if name not in weights]
    unexpected = [name for name in weights if name not in own]
    if misfits or missing or unexpected:
        found = misfits[:3] + [f"missing {missing[:3]}"] * bool(missing) + [f"unexpected {unexpected[:3]}"] * bool(
            unexpected)
        raise ConfigError(f"resume={str(path)!r} does not fit this run's model: {'; '.join(found)}"
                          f"{f' (and {len(misfits) - 3} more shapes)' if len(misfits) > 3 else ''}; resume with the "
                          "model settings it was trained with, or start another run (name=... or resume=null)")
